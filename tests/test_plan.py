"""Fault injection: a failure at the k-th Linear conversion of any quantisation entry point, on a pipeline with two
encoders and a transformer, leaves the pipeline bit-identical to before and raises (QuantizationError; a
KeyboardInterrupt stays one) -- or, for the loader, falls back with the reason and never returns a half-quantised component.

The fault fires inside the real library (torchao's config handler, `EmulatedLinear.from_linear`, diffusers'
`apply_layerwise_casting_hook`) through the `fail_at_kth_linear` fixture of conftest.py. Entry points are listed in
`ENTRY_POINTS`; every case below runs on each of them."""
import copy
from dataclasses import dataclass
from typing import Callable, NamedTuple
import pytest
import torch
from torch import nn
from diffq_lab import filters, schemes
from diffq_lab import text_encoder as te
from diffq_lab.loader import load_pipeline_quantized
from diffq_lab.export import quantize_text_encoders
from diffq_lab.pipelines import text_encoders, tiny_pipeline
from diffq_lab.plan import QuantizationError, plan_linears, quantize
from diffq_lab.transformer import plan_transformer, quantize_transformer

FAMILY = 'flux.1-dev'  # CLIP-L + T5 + a transformer: a k can land in the second encoder, or in the transformer
KEEP = (0, 0)          # FLUX.1 has no keep-bf16 schedule: an explicit one lets int8 run as int8 (else fp8_layerwise)
# (scheme, backend asked for): the library that converts follows from the plan (fp8_layerwise's is diffusers)
CASES = [('int8', 'torchao'), ('int8wo', 'torchao'), ('fp8wo', 'torchao'),
         ('nvfp4', 'emulate'), ('mxfp8', 'emulate'), ('fp8_layerwise', 'torchao')]
ENCODERS = ('text_encoder', 'text_encoder_2')
# the loader as a user calls it (backend 'auto'): the encoders' plan, then the transformer's, in one window
LOADER = dict(family=FAMILY, compile=False, min_features=0, validate=True)


# ---------------------------------------------------------------- entry points
class Planned(NamedTuple):
    "One planned Linear, in conversion order."
    component: str
    name: str      # 'component.fqn'
    library: str   # the plan's backend: torchao, emulate, diffusers
    scheme: str


@dataclass(frozen=True)
class EntryPoint:
    "A public quantisation entry point as the fault tests drive it."
    name: str
    components: tuple   # the components it converts, in conversion order
    planned: Callable   # (pipe, scheme, backend) -> [Planned] in conversion order; changes nothing
    run: Callable       # (pipe, scheme, backend) -> applies the same plan in place
    roots: Callable     # pipe -> the modules whose Linears it converts (the fault counts only these)
    prefix: str = ''    # the component a QuantizationError of a bare module (component '') means
    falls_back: bool = False  # a loader: a failure may end in a returned fallback, not a raise

    def where(self, err: QuantizationError) -> str:
        "The 'component.fqn' that `err` names."
        c = err.component or self.prefix
        return f'{c}.{err.fqn}' if c else err.fqn


def _both(pipe) -> nn.ModuleDict:
    "One module holding both encoders of `pipe` (the same objects): `plan.quantize` counts across the two."
    return nn.ModuleDict(text_encoders(pipe))

def _rows(comps: dict) -> list[Planned]:
    return [Planned(c, f'{c}.{f}', p.linears[f].backend, p.linears[f].scheme) for c, p in comps.items() for f in p.quantized]

def _plan_module(pipe, scheme, backend):
    p = plan_linears(_both(pipe), scheme, filters.make_filter_fn(0), backend)
    return [Planned(f.split('.')[0], f, l.backend, l.scheme) for f, l in p.linears.items() if l.scheme]

def _plan_encoders(pipe, scheme, backend):
    return _rows(te.plan_text_encoders(pipe, scheme, backend=backend, keep=KEEP).components)

def _plan_transformer(pipe, scheme, backend):
    return _rows({'transformer': plan_transformer(pipe.transformer, scheme, min_features=0, backend=backend)})

def _plan_loader(pipe, scheme, backend):
    "What `load_pipeline_quantized` applies: the family's encoder plan (int8 -> fp8_layerwise on FLUX.1), then the transformer's."
    enc = te.plan_text_encoders(pipe, scheme, family=FAMILY)
    return _rows({**enc.components, 'transformer': plan_transformer(pipe.transformer, scheme, min_features=0)})

def _encoder_roots(pipe): return list(text_encoders(pipe).values())
def _all_roots(pipe): return [*text_encoders(pipe).values(), pipe.transformer]

ENTRY_POINTS = [
    EntryPoint('plan.quantize', ENCODERS, _plan_module,
               lambda pipe, s, b: quantize(_both(pipe), s, filters.make_filter_fn(0), backend=b), _encoder_roots),
    EntryPoint('quantize_text_encoders', ENCODERS, _plan_encoders,
               lambda pipe, s, b: quantize_text_encoders(pipe, s, backend=b, keep=KEEP), _encoder_roots),
    EntryPoint('quantize_transformer', ('transformer',), _plan_transformer,
               lambda pipe, s, b: quantize_transformer(pipe.transformer, s, min_features=0, backend=b),
               lambda pipe: [pipe.transformer], prefix='transformer'),
    EntryPoint('load_pipeline_quantized', (*ENCODERS, 'transformer'), _plan_loader,
               lambda pipe, s, b: load_pipeline_quantized(pipe, transformer_quant=s, te_quant=s, **LOADER),
               _all_roots, falls_back=True),
]


def k_names(entry) -> tuple[str, ...]:
    "k = 1, 2, the first Linear of each component after the first, the last Linear."
    return ('1', '2', *(f'first_of_{c}' for c in entry.components[1:]), 'last')

def k_values(planned) -> dict[str, int]:
    firsts = {}
    for i, p in enumerate(planned): firsts.setdefault(p.component, i + 1)
    return {'1': 1, '2': 2, **{f'first_of_{c}': i for c, i in list(firsts.items())[1:]}, 'last': len(planned)}

def fault_params(ks, persist=(False,)):
    "(entry, scheme, backend, k name, persist) for every entry point; `persist` varies only for a loader (a second apply)."
    return [pytest.param(e, s, b, k, p, id=f"{e.name}-{s}-{k}{'-persist' if p else ''}")
            for e in ENTRY_POINTS for s, b in CASES for k in ks(e) for p in (persist if e.falls_back else (False,))]


# ---------------------------------------------------------------- the pipeline and its full state
@pytest.fixture(scope='module')
def pristine():
    return tiny_pipeline(FAMILY)

@pytest.fixture
def pipe(pristine):
    return copy.deepcopy(pristine)  # ~15 ms: every test starts from the same dense pipeline, whatever the last one did


def modules_of(pipe) -> dict[str, nn.Module]:
    return {c: m for c, m in pipe.components.items() if isinstance(m, nn.Module)}

def state(pipe, only=None) -> dict:
    "Everything a restore must give back, for every component (or those in `only`): module objects, attributes, Parameters, values."
    mods = {c: m for c, m in modules_of(pipe).items() if only is None or c in only}
    return dict(
        modules={(c, f): id(m) for c, root in mods.items() for f, m in root.named_modules()},
        attrs={(c, f): sorted(vars(m)) for c, root in mods.items() for f, m in root.named_modules()},
        params={(c, n): (id(p), p.dtype, p.requires_grad, type(p)) for c, root in mods.items()
                for n, p in root.named_parameters(remove_duplicate=False)},
        tensors={(c, k): v.detach().clone() for c, root in mods.items() for k, v in root.state_dict().items()})

def restrict(st: dict, only) -> dict:
    return {part: {k: v for k, v in d.items() if k[0] in only} for part, d in st.items()}

def assert_same_state(before: dict, after: dict):
    for part in ('modules', 'attrs', 'params'):
        assert after[part] == before[part], (part, {k: (before[part].get(k), v) for k, v in after[part].items()
                                                    if before[part].get(k) != v})
    assert list(after['tensors']) == list(before['tensors'])
    for k, v in after['tensors'].items():
        ref = before['tensors'][k]
        assert type(v) is type(ref) and v.dtype == ref.dtype and torch.equal(v, ref), k

def assert_dense(pipe, only=None):
    for c, root in modules_of(pipe).items():
        if only is not None and c not in only: continue
        assert filters.quantized_linears(root) == [], c
        assert all(filters.layerwise_registry(m) is None for m in root.modules()), c

def n_quantized(roots) -> int: return sum(len(filters.quantized_linears(r)) for r in roots)


def expected_outcome(entry, failed_component: str, exc, persist: bool) -> str:
    """'raise' or 'fallback'. The loader's fallback is the transformer's: a failure converting a denoiser falls back to a
    dense transformer and applies the encoders alone; a failure converting an encoder raises, everything restored (the
    encoders have no fallback). A KeyboardInterrupt is never caught."""
    if not entry.falls_back or (exc is not None and not isinstance(exc, Exception)): return 'raise'
    return 'raise' if failed_component in ENCODERS else 'fallback'


def check_fault(pipe, entry, scheme, backend, k_name, fail_at_kth_linear, monkeypatch, when='before',
                exc=None, expect=QuantizationError, persist=False):
    "Inject the fault, check the raise and the restore (or the loader's fallback), then disarm and show the plan completes."
    planned = entry.planned(pipe, scheme, backend)
    assert tuple(dict.fromkeys(p.component for p in planned)) == entry.components, planned  # the premise
    k = k_values(planned)[k_name]
    at = planned[k - 1]
    roots = entry.roots(pipe)
    dense = te.prompt_embeddings(pipe)
    before = state(pipe)
    names = {id(m): f'{c}.{f}' for c, root in modules_of(pipe).items() for f, m in root.named_modules()}
    rec = fail_at_kth_linear(scheme, tuple(dict.fromkeys(p.library for p in planned)), k, exc=exc, within=roots,
                             when=when, on_fault=lambda r: n_quantized(roots), persist=persist)
    outcome = expected_outcome(entry, at.component, exc, persist)
    if outcome == 'raise':
        with pytest.raises(expect) as e: entry.run(pipe, scheme, backend)
    else:
        out, status = entry.run(pipe, scheme, backend)
    assert rec.fired and names[id(rec.fired_on)] == at.name, 'the fault fired at another Linear than the k-th'
    assert rec.at_fault >= k - 1, 'the Linears before the k-th were not converted: nothing to restore'
    if outcome == 'fallback':
        return check_fallback(pipe, entry, scheme, out, status, planned, at, before, when, monkeypatch)
    if expect is QuantizationError:
        err = e.value
        assert isinstance(err.__cause__, RuntimeError) and 'injected fault' in str(err) and 'restored' in str(err)
        assert err.scheme == at.scheme
        if when == 'before': assert entry.where(err) == at.name, (err.component, err.fqn)  # the Linear that failed
    assert_same_state(before, state(pipe))
    assert_dense(pipe)
    assert all(torch.equal(a, b) for a, b in zip(dense, te.prompt_embeddings(pipe), strict=True))
    monkeypatch.undo()  # the same call, disarmed: the restored pipeline takes the full plan
    entry.run(pipe, scheme, backend)
    assert n_quantized(roots) == len(planned)


def check_fallback(pipe, entry, scheme, out, status, planned, at, before, when, monkeypatch):
    "The loader fell back: the reason names the fault; every component is quantised in full or bit-identical; which is which is exact."
    reason = status['fallback_reason']
    assert out is pipe and reason.startswith(f'{scheme} (auto): QuantizationError') and 'restored' in reason, reason
    if when == 'before':  # the reason names the Linear that failed, in its component
        c, fqn = at.name.split('.', 1)
        assert f"{c}: {fqn!r}" in reason, reason
    assert (status['path'], status['scheme'], status['linears_quantized']) == ('dense', None, 0), status
    qp = status['quant_plan']
    assert tuple(qp.components) == entry.components
    want = {c: {p.name.split('.', 1)[1] for p in planned if p.component == c} for c in entry.components}
    for c, p in qp.components.items():
        done = set(filters.quantized_linears(getattr(pipe, c)))
        assert done == set(p.quantized), (c, 'the status says otherwise than the module')
        assert done in (set(), want[c]), (c, 'half-quantised', len(done), len(want[c]))
        if not done:  # dense: bit-identical to before, no hook left behind
            assert_same_state(restrict(before, {c}), state(pipe, {c}))
            assert_dense(pipe, {c})
    # which outcome, exactly: the encoders (applied alone after the fallback) in full, the transformer dense for the reason
    assert {c for c, p in qp.components.items() if p.quantized} == set(ENCODERS)
    assert set(qp.components['transformer'].skipped.values()) == {reason}
    rest = set(modules_of(pipe)) - set(entry.components)  # the VAE: never touched
    assert rest, modules_of(pipe)
    assert_same_state(restrict(before, rest), state(pipe, rest))
    monkeypatch.undo()  # disarmed, the restored transformer takes its full plan beside the quantised encoders
    _, st = load_pipeline_quantized(pipe, transformer_quant=scheme, **LOADER)
    assert st['path'] == 'quant' and st['fallback_reason'] == '', st
    assert n_quantized(entry.roots(pipe)) == len(planned)


# ---------------------------------------------------------------- the judged behaviour
@pytest.mark.parametrize('entry,scheme,backend,k_name,persist', fault_params(k_names, persist=(False, True)))
def test_fault_at_kth_linear_restores_bit_identical(pipe, entry, scheme, backend, k_name, persist, fail_at_kth_linear,
                                                    monkeypatch):
    check_fault(pipe, entry, scheme, backend, k_name, fail_at_kth_linear, monkeypatch, persist=persist)


@pytest.mark.parametrize('entry,scheme,backend,k_name,persist', fault_params(lambda e: ('2', 'last')))
def test_fault_after_converting_the_kth_linear(pipe, entry, scheme, backend, k_name, persist, fail_at_kth_linear, monkeypatch):
    "The k-th conversion completes (weights swapped, hook attached, fp8 cast done) and then dies."
    check_fault(pipe, entry, scheme, backend, k_name, fail_at_kth_linear, monkeypatch, when='after')


@pytest.mark.parametrize('entry,scheme,backend,k_name,persist',
                         fault_params(lambda e: (f'first_of_{e.components[-1]}',) if len(e.components) > 1 else ('last',)))
def test_keyboard_interrupt_restores_and_propagates(pipe, entry, scheme, backend, k_name, persist, fail_at_kth_linear,
                                                    monkeypatch):
    "Ctrl-C in the last component: restored, and still a KeyboardInterrupt (never swallowed into a fallback or an error row)."
    check_fault(pipe, entry, scheme, backend, k_name, fail_at_kth_linear, monkeypatch, when='after',
                exc=KeyboardInterrupt(), expect=KeyboardInterrupt)


# ---------------------------------------------------------------- the injector itself
@pytest.mark.parametrize('scheme,backend', CASES, ids=[s for s, _ in CASES])
@pytest.mark.parametrize('entry', ENTRY_POINTS, ids=[e.name for e in ENTRY_POINTS])
def test_the_injector_counts_every_real_conversion(pipe, entry, scheme, backend, fail_at_kth_linear):
    """Armed past the end it never fires and counts exactly the planned Linears: a library path that stops going through
    the wrapped function (and would leave the fault tests above testing nothing), or an entry point that applies
    another plan than the one these tests compute, fails here."""
    planned = entry.planned(pipe, scheme, backend)
    rec = fail_at_kth_linear(scheme, tuple(dict.fromkeys(p.library for p in planned)), len(planned) + 1,
                             within=entry.roots(pipe))
    out = entry.run(pipe, scheme, backend)
    assert not rec.fired and rec.calls == len(planned) == n_quantized(entry.roots(pipe))
    if entry.falls_back:
        _, status = out
        assert status['path'] == 'quant' and status['fallback_reason'] == '', status
        assert [p.name for p in planned] == [f'{c}.{f}' for c, cp in status['quant_plan'].components.items() for f in cp.quantized]


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
    assert filters.quantized_linears(model) == ['0', '2'] and len(seen) == 3


@pytest.mark.parametrize('scheme,backend', [('int8wo', 'torchao'), ('nvfp4', 'emulate')])
def test_a_bare_linear_that_fails_comes_back_as_it_was(scheme, backend, fail_at_kth_linear):
    lin = nn.Linear(512, 512, dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    fail_at_kth_linear(scheme, backend, 1)
    with pytest.raises((QuantizationError, ValueError)): quantize(lin, scheme, backend=backend)
    assert dict(lin.named_children()) == {}
    assert all(torch.equal(before[k], v) for k, v in lin.state_dict().items())
