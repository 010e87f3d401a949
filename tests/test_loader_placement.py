"""The loader's seed contract: an unavailable scheme leaves the component dense with a note (or raises when asked), a transformer
is never moved onto a device it does not fit (free memory given), torchao under offload only when its offload probe passes."""
import copy, os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
from types import SimpleNamespace
import pytest
from torch import nn
import diffq_lab.loader as G
from diffq_lab.capability import SchemeUnavailableError
from diffq_lab.memory import module_bytes, plan_memory
from diffq_lab.filters import quantized_linears


def _sizes(pipe):
    b = [module_bytes(m) for m in pipe.components.values() if isinstance(m, nn.Module)]
    return sum(b), max(b)


def _load(pipe, **kw):
    "The loader on a copy of `pipe` whose .to() calls are recorded."
    p, moves = copy.deepcopy(pipe), []
    real = p.to
    p.to = lambda *a, **k: (moves.append(a), real(*a, **k))[1]
    out, st = G.load_pipeline_quantized(p, compile=False, reserve=0.0, **kw)
    return out, st, moves


@pytest.mark.parametrize('family', ['z-image', 'flux.1-dev'])
def test_an_over_budget_dense_fallback_is_never_moved(pipes, family):
    total, largest = _sizes(pipes[family])
    _, st, moves = _load(pipes[family], free_bytes=(total + largest) // 2)
    assert not moves and st.placement.startswith('model CPU offload planned')
    _, st, moves = _load(pipes[family], free_bytes=largest // 2)
    assert not moves and st.placement.startswith('left on the CPU')
    _, st, moves = _load(pipes[family], free_bytes=10 * total)
    assert moves and st.placement.startswith('on cpu')


def test_a_quantised_transformer_that_does_not_fit_falls_back_without_moving(pipes):
    total, largest = _sizes(pipes['z-image'])
    _, st, moves = _load(pipes['z-image'], transformer_quant='int8', min_features=0, free_bytes=largest // 2)
    assert st.path == 'dense' and 'memory plan' in st.fallback_reason and not moves


def test_torchao_under_offload_needs_its_probe(pipes, monkeypatch):
    pipe = pipes['z-image']
    mp = plan_memory(pipe, 'int8', 'cpu', free_bytes=10 ** 12, min_features=0)
    budget = max(mp.dense_bytes, mp.rest_bytes)  # the dense transformer fits alone, quantised + rest do not: 'offload'
    assert plan_memory(pipe, 'int8', 'cpu', free_bytes=budget, min_features=0, reserve=0.0).decision == 'offload'
    monkeypatch.setattr(G, 'offload_probe', lambda *a, **k: SimpleNamespace(ok=False, reason='differs', device_name='CPU'))
    _, st, _ = _load(pipe, transformer_quant='int8', min_features=0, free_bytes=budget)
    assert st.path == 'dense' and 'offload probe failed' in st.fallback_reason
    monkeypatch.setattr(G, 'offload_probe', lambda *a, **k: SimpleNamespace(ok=True, reason='ok', device_name='CPU'))
    out, st, moves = _load(pipe, transformer_quant='int8', min_features=0, free_bytes=budget)
    assert st.path == 'quant' and 'offload probe passed' in st.backend_note and quantized_linears(out.transformer)
    assert st.placement.startswith('model CPU offload planned')


def test_unavailable_encoder_scheme_dense_by_default_raise_on_request(pipes):
    out, st, _ = _load(pipes['z-image'], family='ltx-2', te_quant='fp8')
    assert 'denied for ltx-2' in st.te_fallback_reason and quantized_linears(out.text_encoder) == []
    assert G.engaged(out)['text_encoder'] == dict(path='dense', scheme=None, backend=None, reason=st.te_fallback_reason)
    with pytest.raises(ValueError, match='denied for ltx-2'):
        _load(pipes['z-image'], family='ltx-2', te_quant='fp8', on_unavailable='raise')


def test_unavailable_transformer_scheme_raises_on_request(pipes):
    with pytest.raises(SchemeUnavailableError, match='no Linear qualifies'):
        _load(pipes['z-image'], transformer_quant='int4wo', min_features=0, on_unavailable='raise')
    _, st, _ = _load(pipes['z-image'], transformer_quant='int4wo', min_features=0)
    assert st.path == 'dense' and 'no Linear qualifies' in st.fallback_reason


def test_the_runtime_marker_says_what_engaged(pipes):
    out, st, _ = _load(pipes['z-image'], transformer_quant='int8', te_quant='int8wo', min_features=0)
    e = G.engaged(out)
    assert e['transformer']['path'] == 'quant' and e['transformer']['scheme'] == 'int8' and e['transformer']['backend'] == 'torchao'
    assert e['text_encoder']['path'] == 'quant' and e['text_encoder']['scheme'] == 'int8wo'
    assert G.engaged(pipes['z-image'])['transformer']['reason'] == 'not loaded by the lab'


def test_the_report_reads_scheme_backend_and_counts_from_the_plan(pipes):
    "No copies beside the plan: LoadReport stores none of what the plan holds, and a change to the plan shows at once."
    from dataclasses import fields
    stored = {f.name for f in fields(G.LoadReport)}
    assert not stored & {'scheme', 'backend', 'linears_quantized', 'linears_total', 'backend_note', 'quant_plan'}
    out, st, _ = _load(pipes['z-image'], transformer_quant='int8', min_features=0)
    tp = st.plan.components['transformer']
    assert (st.scheme, st.backend, st.linears_quantized, st.linears_total) == (tp.scheme, tp.backend, tp.n_quantized,
                                                                             tp.n_linear)
    assert st['scheme'] is st.scheme and st.quant_plan is st.plan and out._diffq_report is st  # views, not copies
    assert not hasattr(out, '_diffq_engaged')


def test_engaged_reads_each_denoisers_own_plan(pipes):
    "Wan 2.2's two experts: each reports its own plan's scheme and backend."
    out, st, _ = _load(pipes['wan2.2-t2v-a14b'], transformer_quant='int8wo', min_features=0)
    e = G.engaged(out)
    for a in ('transformer', 'transformer_2'):
        p = st.plan.components[a]
        assert (e[a]['path'], e[a]['scheme'], e[a]['backend']) == (st.path, p.scheme, p.backend), (a, e[a])
