"""Fault injection: a failure at the k-th Linear conversion of any quantisation entry point, on a pipeline with two
encoders, leaves the whole pipeline bit-identical to before and raises (QuantizationError; a KeyboardInterrupt stays one).

The fault fires inside the real library (torchao's config handler, `EmulatedLinear.from_linear`, diffusers'
`apply_layerwise_casting_hook`) through the `fail_at_kth_linear` fixture of conftest.py. Entry points are listed in
`ENTRY_POINTS`: add the transformer ones (`quantize_transformer`, `load_pipeline_quantized`) there and every case
below runs on them too."""
import copy
from dataclasses import dataclass
from typing import Callable
import pytest
import torch
from torch import nn
from diffq_lab import schemes
from diffq_lab import text_encoder as te
from diffq_lab.pipelines import text_encoders, tiny_pipeline
from diffq_lab.plan import QuantizationError, plan_linears, quantize

FAMILY = 'flux.1-dev'  # CLIP-L + T5: two encoders, so a k can land in the second after the first was converted
KEEP = (0, 0)          # FLUX.1 has no keep-bf16 schedule: an explicit one lets int8 run as int8 (else fp8_layerwise)
# (scheme, backend asked for): the library that converts follows from the plan (fp8_layerwise's is diffusers)
CASES = [('int8', 'torchao'), ('int8wo', 'torchao'), ('fp8wo', 'torchao'),
         ('nvfp4', 'emulate'), ('mxfp8', 'emulate'), ('fp8_layerwise', 'torchao')]
CASE_IDS = [s for s, _ in CASES]


# ---------------------------------------------------------------- entry points
@dataclass(frozen=True)
class EntryPoint:
    "A public quantisation entry point as the fault tests drive it."
    name: str
    planned: Callable  # (pipe, scheme, backend) -> [(component, fqn, library)] in conversion order; changes nothing
    run: Callable      # (pipe, scheme, backend) -> applies the same plan in place
    roots: Callable    # pipe -> the modules whose Linears it converts (the fault counts only these)


def _both(pipe) -> nn.ModuleDict:
    "One module holding both encoders of `pipe` (the same objects): `plan.quantize` counts across the two."
    return nn.ModuleDict(text_encoders(pipe))

def _plan_module(pipe, scheme, backend):
    p = plan_linears(_both(pipe), scheme, schemes.make_filter_fn(0), backend)
    return [(f.split('.')[0], f, l.backend) for f, l in p.linears.items() if l.scheme]

def _plan_encoders(pipe, scheme, backend):
    p = te.plan_text_encoders(pipe, scheme, backend=backend, keep=KEEP)
    return [(c, f'{c}.{f}', cp.linears[f].backend) for c, cp in p.components.items() for f in cp.quantized]

ENTRY_POINTS = [
    EntryPoint('plan.quantize', _plan_module,
               lambda pipe, s, b: quantize(_both(pipe), s, schemes.make_filter_fn(0), backend=b),
               lambda pipe: list(text_encoders(pipe).values())),
    EntryPoint('quantize_text_encoders', _plan_encoders,
               lambda pipe, s, b: te.quantize_text_encoders(pipe, s, backend=b, keep=KEEP),
               lambda pipe: list(text_encoders(pipe).values())),
]
ENTRY_IDS = [e.name for e in ENTRY_POINTS]


# ---------------------------------------------------------------- the pipeline and its full state
@pytest.fixture(scope='module')
def pristine():
    return tiny_pipeline(FAMILY)

@pytest.fixture
def pipe(pristine):
    return copy.deepcopy(pristine)  # ~15 ms: every test starts from the same dense pipeline, whatever the last one did


def modules_of(pipe) -> dict[str, nn.Module]:
    return {c: m for c, m in pipe.components.items() if isinstance(m, nn.Module)}

def state(pipe) -> dict:
    "Everything a restore must give back, for every component: module objects, their attributes, Parameters, values."
    mods = modules_of(pipe)
    return dict(
        modules={(c, f): id(m) for c, root in mods.items() for f, m in root.named_modules()},
        attrs={(c, f): sorted(vars(m)) for c, root in mods.items() for f, m in root.named_modules()},
        params={(c, n): (id(p), p.dtype, p.requires_grad, type(p)) for c, root in mods.items()
                for n, p in root.named_parameters(remove_duplicate=False)},
        tensors={(c, k): v.detach().clone() for c, root in mods.items() for k, v in root.state_dict().items()})

def assert_same_state(before: dict, after: dict):
    for part in ('modules', 'attrs', 'params'):
        assert after[part] == before[part], (part, {k: (before[part].get(k), v) for k, v in after[part].items()
                                                    if before[part].get(k) != v})
    assert list(after['tensors']) == list(before['tensors'])
    for k, v in after['tensors'].items():
        ref = before['tensors'][k]
        assert type(v) is type(ref) and v.dtype == ref.dtype and torch.equal(v, ref), k

def assert_dense(pipe):
    for c, root in modules_of(pipe).items():
        assert schemes.quantized_linears(root) == [], c
        assert all(schemes.layerwise_registry(m) is None for m in root.modules()), c

def n_quantized(roots) -> int: return sum(len(schemes.quantized_linears(r)) for r in roots)

def k_values(planned) -> dict[str, int]:
    "k = 1, 2, the first Linear of the second encoder, the last Linear."
    second = next(i for i, (c, *_) in enumerate(planned) if c != planned[0][0])
    return {'1': 1, '2': 2, 'second_first': second + 1, 'last': len(planned)}


def check_fault(pipe, entry, scheme, backend, k_name, fail_at_kth_linear, monkeypatch, when='before',
                exc=None, expect=QuantizationError):
    "Inject the fault, check the raise and the restore, then disarm and show the same call converts every planned Linear."
    planned = entry.planned(pipe, scheme, backend)
    libraries = {lib for *_, lib in planned}
    assert len(libraries) == 1 and len({c for c, *_ in planned}) == 2, (libraries, planned)  # the premise: two encoders
    k = k_values(planned)[k_name]
    roots = entry.roots(pipe)
    dense = te.prompt_embeddings(pipe)
    before = state(pipe)
    names = {id(m): f'{c}.{f}' for c, root in text_encoders(pipe).items() for f, m in root.named_modules()}
    rec = fail_at_kth_linear(scheme, libraries.pop(), k, exc=exc, within=roots, when=when,
                             on_fault=lambda r: n_quantized(roots))
    with pytest.raises(expect) as e: entry.run(pipe, scheme, backend)
    assert rec.fired and names[id(rec.fired_on)] == planned[k - 1][1], 'the fault fired at another Linear than the k-th'
    assert rec.at_fault >= k - 1, 'the Linears before the k-th were not converted: nothing to restore'
    if expect is QuantizationError:
        err = e.value
        assert isinstance(err.__cause__, RuntimeError) and 'injected fault' in str(err) and 'restored' in str(err)
        assert err.scheme == scheme
        if when == 'before':  # the error names the Linear that failed, in its component
            comp, fqn = (err.component, err.fqn) if err.component else err.fqn.split('.', 1)
            assert f'{comp}.{fqn}' == planned[k - 1][1], (err.component, err.fqn)
    assert_same_state(before, state(pipe))
    assert_dense(pipe)
    assert all(torch.equal(a, b) for a, b in zip(dense, te.prompt_embeddings(pipe), strict=True))
    monkeypatch.undo()  # the same call, disarmed: the restored pipeline takes the full plan
    entry.run(pipe, scheme, backend)
    assert n_quantized(roots) == len(planned)


# ---------------------------------------------------------------- the judged behaviour
@pytest.mark.parametrize('k_name', ['1', '2', 'second_first', 'last'])
@pytest.mark.parametrize('scheme,backend', CASES, ids=CASE_IDS)
@pytest.mark.parametrize('entry', ENTRY_POINTS, ids=ENTRY_IDS)
def test_fault_at_kth_linear_restores_bit_identical(pipe, entry, scheme, backend, k_name, fail_at_kth_linear, monkeypatch):
    check_fault(pipe, entry, scheme, backend, k_name, fail_at_kth_linear, monkeypatch)


@pytest.mark.parametrize('k_name', ['2', 'last'])
@pytest.mark.parametrize('scheme,backend', CASES, ids=CASE_IDS)
@pytest.mark.parametrize('entry', ENTRY_POINTS, ids=ENTRY_IDS)
def test_fault_after_converting_the_kth_linear(pipe, entry, scheme, backend, k_name, fail_at_kth_linear, monkeypatch):
    "The k-th conversion completes (weights swapped, hook attached, fp8 cast done) and then dies."
    check_fault(pipe, entry, scheme, backend, k_name, fail_at_kth_linear, monkeypatch, when='after')


@pytest.mark.parametrize('scheme,backend', CASES, ids=CASE_IDS)
@pytest.mark.parametrize('entry', ENTRY_POINTS, ids=ENTRY_IDS)
def test_keyboard_interrupt_restores_and_propagates(pipe, entry, scheme, backend, fail_at_kth_linear, monkeypatch):
    "Ctrl-C in the second encoder: restored, and still a KeyboardInterrupt (never swallowed into an error row)."
    check_fault(pipe, entry, scheme, backend, 'second_first', fail_at_kth_linear, monkeypatch, when='after',
                exc=KeyboardInterrupt(), expect=KeyboardInterrupt)


# ---------------------------------------------------------------- the injector itself
@pytest.mark.parametrize('scheme,backend', CASES, ids=CASE_IDS)
def test_the_injector_counts_every_real_conversion(pipe, scheme, backend, fail_at_kth_linear):
    """Armed past the end it never fires and counts exactly the planned Linears: a library path that stops going through
    the wrapped function (and would leave the fault tests above testing nothing) fails here."""
    entry = ENTRY_POINTS[1]
    planned = entry.planned(pipe, scheme, backend)
    rec = fail_at_kth_linear(scheme, planned[0][2], len(planned) + 1, within=entry.roots(pipe))
    entry.run(pipe, scheme, backend)
    assert not rec.fired and rec.calls == len(planned) == n_quantized(entry.roots(pipe))


# ---------------------------------------------------------------- a library that skips, a bare Linear
def test_a_linear_the_library_silently_skips_is_recorded_dense(monkeypatch):
    "torchao's handler returning the second Linear untouched: the applied plan says so, and a warning names it."
    from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER
    cfg = type(schemes.make_config('int8wo'))
    real, seen = _QUANTIZE_CONFIG_HANDLER[cfg], []
    def lazy(module, *args, **kwargs):
        seen.append(module)
        return module if len(seen) == 2 else real(module, *args, **kwargs)
    monkeypatch.setitem(_QUANTIZE_CONFIG_HANDLER, cfg, lazy)
    model = nn.Sequential(*[nn.Linear(512, 512, dtype=torch.bfloat16) for _ in range(3)])
    with pytest.warns(UserWarning, match=r"1 planned Linear\(s\) left dense by the library: \['1'\]"):
        p = quantize(model, 'int8wo', backend='torchao')
    assert p.quantized == ['0', '2'] and p.skipped == {'1': 'left dense by torchao'}
    assert schemes.quantized_linears(model) == ['0', '2'] and len(seen) == 3


@pytest.mark.parametrize('scheme,backend', [('int8wo', 'torchao'), ('nvfp4', 'emulate')])
def test_a_bare_linear_that_fails_comes_back_as_it_was(scheme, backend, fail_at_kth_linear):
    lin = nn.Linear(512, 512, dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    fail_at_kth_linear(scheme, backend, 1)
    with pytest.raises((QuantizationError, ValueError)): quantize(lin, scheme, backend=backend)
    assert dict(lin.named_children()) == {}
    assert all(torch.equal(before[k], v) for k, v in lin.state_dict().items())
