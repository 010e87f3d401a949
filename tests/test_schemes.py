"Tests for diffq_lab.schemes: naming, configs, filters, the zero-row guard, quantize and its failure modes."
import copy, sys, types
from collections import Counter
import pytest
import torch
from torch import nn
from diffq_lab import schemes
from diffq_lab.schemes import (SCHEMES, ALIASES, SCHEME_RULES, normalize_scheme, make_config, make_filter_fn, skip_reason,
                               has_zero_output_row, plan, quantize, quantized_linears, is_quantized_linear, QuantReport,
                               PartialQuantizationError, fp8_gate_bypassed)

BF = dict(dtype=torch.bfloat16)


def stack(*dims, dtype=torch.bfloat16, seed=0):
    "nn.Sequential of Linears through `dims` (512, 1024, 512 -> two Linears)."
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(a, b, dtype=dtype) for a, b in zip(dims, dims[1:])])


def zero_row(linear, row=3):
    with torch.no_grad(): linear.weight[row] = 0
    return linear


def rel_err(y, ref): return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


# ---------------------------------------------------------------- names
@pytest.mark.parametrize('value,expected', [
    ('int8', 'int8'), ('INT8', 'int8'), (' int8 ', 'int8'), ('int8-dq', 'int8'), ('int8_dynamic', 'int8'),
    ('int8dq', 'int8'), ('int8_weight_only', 'int8wo'), ('Int8-WO', 'int8wo'),
    ('fp8_dynamic', 'fp8'), ('fp8dq', 'fp8'), ('FP8 Dynamic', 'fp8'), ('float8', 'fp8'),
    ('fp8-wo', 'fp8wo'), ('fp8_weight_only', 'fp8wo'),
    ('fp8-layerwise', 'fp8_layerwise'), ('FP8 Layerwise', 'fp8_layerwise'), ('layerwise', 'fp8_layerwise'),
    ('NVFP4', 'nvfp4'), ('w4a4', 'nvfp4'), ('nvfp4_weight_only', 'nvfp4wo'), ('MX-FP8', 'mxfp8'),
    ('auto', 'auto'), ('AUTO', 'auto'), (None, None), ('', None), ('none', None), ('None', None), ('off', None),
    ('  OFF ', None)])
def test_normalize(value, expected):
    assert normalize_scheme(value) == expected


def test_normalize_is_idempotent_and_aliases_unambiguous():
    for s in SCHEMES: assert normalize_scheme(s) == s
    keys = [schemes._key(a) for s, names in ALIASES.items() for a in (s, *names)]
    assert len(keys) == len(set(keys)), 'an alias spells two schemes (or twice the same)'
    for s, names in ALIASES.items():
        for a in names: assert normalize_scheme(a) == s


@pytest.mark.parametrize('bad', ['int4', 'fp16', 'nvfp8', 'int8x', 'auto8', 8, 1.0, True, ('int8',)])
def test_normalize_rejects_unknown_listing_choices(bad):
    with pytest.raises(ValueError) as e: normalize_scheme(bad)
    for s in SCHEMES: assert s in str(e.value)


# ---------------------------------------------------------------- configs
def test_make_config_types_and_settings():
    from torchao.quantization import PerRow
    names = {s: type(make_config(s)).__name__ for s in SCHEMES}
    assert names['int8'] == 'Int8DynamicActivationInt8WeightConfig'
    assert names['int8wo'] == 'Int8WeightOnlyConfig'
    assert names['fp8'] == 'Float8DynamicActivationFloat8WeightConfig'
    assert names['fp8wo'] == 'Float8WeightOnlyConfig'
    assert names['fp8_layerwise'] == 'NoneType'
    assert names['nvfp4'] == 'NVFP4DynamicActivationNVFP4WeightConfig'
    assert names['nvfp4wo'] == 'NVFP4WeightOnlyConfig'
    assert names['mxfp8'] == 'MXDynamicActivationMXWeightConfig'
    v = schemes._int8_version()
    assert make_config('int8').version == v and make_config('int8wo').version == v
    assert v == (1 if schemes._torchao_version() < (0, 16) else 2)  # 0.15's version 2 is the inaccurate one
    fp8 = make_config('fp8')
    assert fp8.activation_value_lb == 1e-12
    assert all(isinstance(g, PerRow) for g in fp8.granularity)
    assert isinstance(getattr(make_config('fp8wo'), 'granularity', PerRow()), PerRow)  # the field is new in 0.18
    mx = make_config('mxfp8')
    assert (mx.block_size, mx.activation_dtype, mx.weight_dtype) == (32, torch.float8_e4m3fn, torch.float8_e4m3fn)
    assert mx.kernel_preference.value == 'auto'  # the fastest kernel on the real path, not EMULATED
    if not torch.cuda.is_available(): assert make_config('nvfp4').use_triton_kernel is False


@pytest.mark.parametrize('bad', ['auto', None, 'off', 'int4'])
def test_make_config_bad_input(bad):
    with pytest.raises(ValueError): make_config(bad)


def test_build_drops_kwargs_an_older_torchao_lacks():
    class OldConfig:  # stands in for a torchao release without activation_value_lb
        def __init__(self, granularity=None): self.granularity = granularity
    with pytest.warns(UserWarning, match='activation_value_lb'):
        cfg = schemes._build(OldConfig, granularity='row', activation_value_lb=1e-12)
    assert cfg.granularity == 'row'


# ---------------------------------------------------------------- filters
def test_filter_true_only_for_linears_never_containers():
    inner = stack(512, 512, 512)
    model = nn.Sequential(inner, nn.LayerNorm(512), nn.ModuleDict({'proj': nn.Linear(512, 1024, **BF)}))
    for min_features in (0, 1, 512):
        f = make_filter_fn(min_features)
        for fqn, m in model.named_modules():
            assert f(m, fqn) == isinstance(m, nn.Linear), (fqn, type(m).__name__)


def test_filter_through_torchao_quantizes_leaves_not_the_container():
    from torchao.quantization import quantize_
    model = nn.Sequential(stack(512, 512, 512), nn.Linear(512, 512, **BF))
    quantize_(model, make_config('int8wo'), filter_fn=make_filter_fn(0))
    assert quantized_linears(model) == ['0.0', '0.1', '1']
    assert type(model[0]) is nn.Sequential


def test_filter_reasons():
    lin = lambda i, o, **kw: nn.Linear(i, o, **{**BF, **kw})
    f = make_filter_fn(512, exclude_tokens=('embed', 'norm_out'), require_bf16=True, divisible_by=64)
    assert f.skip_reason(lin(512, 512), 'blocks.0.attn.to_q') is None
    assert f.skip_reason(lin(256, 3840), 'blocks.0.adaLN_modulation') == 'too small'
    assert f.skip_reason(lin(3840, 256), 'x') == 'too small'  # out features count too
    assert f.skip_reason(lin(512, 512), 't_embedder.mlp') == 'excluded'
    assert f.skip_reason(lin(512, 512, dtype=torch.float32), 'x') == 'not bf16'
    assert f.skip_reason(lin(512, 544), 'x') == 'not divisible by 64'
    assert f.skip_reason(nn.LayerNorm(512), 'norm') == 'not Linear'
    assert f.skip_reason(nn.MultiheadAttention(512, 8).out_proj, 'attn.out_proj') == 'attention out_proj'
    assert make_filter_fn(0)(lin(16, 16), 'x') is True
    assert make_filter_fn(512, require_bf16=False)(lin(512, 512, dtype=torch.float32), 'x') is True
    assert skip_reason(lin(512, 512), 'a.embed') is None and skip_reason(lin(512, 512), 'a.embed', exclude_tokens='embed') == 'excluded'


def test_filter_rejects_already_quantised():
    m = stack(512, 512)
    quantize(m, 'int8wo', make_filter_fn(0), backend='torchao')
    assert make_filter_fn(0).skip_reason(m[0], '0') == 'already quantised'
    assert make_filter_fn(0)(m[0], '0') is False


@pytest.mark.parametrize('kw', [dict(min_features=-1), dict(min_features=1.5), dict(min_features=True), dict(divisible_by=0),
                                dict(divisible_by=2.0), dict(exclude_tokens=('',)), dict(exclude_tokens=(3,))])
def test_filter_bad_settings(kw):
    with pytest.raises(ValueError): make_filter_fn(**kw)


def test_zimage_real_dims_filter_selects_239_of_276():
    from diffusers import ZImageTransformer2DModel
    with torch.device('meta'): m = ZImageTransformer2DModel()
    linears = [(n, x) for n, x in m.named_modules() if isinstance(x, nn.Linear)]
    f = make_filter_fn(512)
    assert (sum(f(x, n) for n, x in m.named_modules()), len(linears)) == (239, 276)
    skipped = {n for n, x in linears if not f(x, n)}
    assert all(min(x.in_features, x.out_features) < 512 for n, x in linears if n in skipped)
    # adaLN modulation of 30 layers + 2 noise refiners, final-layer modulation, timestep MLP, patch embed, final proj
    shapes = Counter((x.in_features, x.out_features) for n, x in linears if n in skipped)
    assert shapes == {(256, 15360): 32, (256, 3840): 1, (256, 1024): 1, (1024, 256): 1, (64, 3840): 1, (3840, 64): 1}
    # plan() reports the same 37 as too small, and on the fp32 meta model fp8 would need bf16 first
    reasons = plan(m, 'int8', f)
    assert sum(r is None for r in reasons.values()) == 239 and set(reasons.values()) == {None, 'too small'}


# ---------------------------------------------------------------- zero rows
def test_has_zero_output_row():
    lin = nn.Linear(64, 32, **BF)
    assert not has_zero_output_row(lin)
    zero_row(lin, 5)
    assert has_zero_output_row(lin)
    with torch.no_grad(): lin.weight[5, 0] = 1e-3
    assert not has_zero_output_row(lin)
    zero_col = nn.Linear(64, 32, **BF)
    with torch.no_grad(): zero_col.weight[:, 4] = 0  # a zero *input* column is harmless
    assert not has_zero_output_row(zero_col)
    with torch.device('meta'): assert not has_zero_output_row(nn.Linear(64, 32))


def test_zero_weight_row_nan_in_raw_torchao_fp8wo_guarded_by_quantize():
    from torchao.quantization import quantize_
    model = nn.Sequential(zero_row(stack(512, 512)[0]))
    x = torch.randn(4, 512, **BF)
    raw = copy.deepcopy(model)
    quantize_(raw, make_config('fp8wo'))
    with torch.no_grad(): y = raw(x)
    assert torch.isnan(y).any(0).nonzero().flatten().tolist() == [3]  # the hazard, reproduced
    with pytest.warns(UserWarning, match='zero output row'): rep = quantize(model, 'fp8wo', make_filter_fn(0), backend='torchao')
    assert rep.skipped == {'0': 'zero output row'} and rep.quantized == []
    with torch.no_grad(): assert torch.isfinite(model(x)).all()


def test_zero_rows_fp8_dynamic_with_gate_bypassed():
    from torchao.quantization import quantize_, Float8DynamicActivationFloat8WeightConfig, PerRow
    x = torch.randn(6, 512, **BF); x[1] = 0
    with fp8_gate_bypassed():
        nofloor = stack(512, 512)
        quantize_(nofloor, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        with torch.no_grad(): assert torch.isnan(nofloor(x)).any(1).nonzero().flatten().tolist() == [1]
        raw_w = nn.Sequential(zero_row(stack(512, 512)[0]))
        quantize_(raw_w, make_config('fp8'))
        with torch.no_grad(): assert torch.isnan(raw_w(x)).any(0).nonzero().flatten().tolist() == [3]
        model = nn.Sequential(nn.Linear(512, 512, **BF), zero_row(nn.Linear(512, 512, **BF)), nn.Linear(512, 512, **BF))
        ref = model(x).detach()
        rep = quantize(model, 'fp8', make_filter_fn(0), backend='torchao')
        assert rep.quantized == ['0', '2'] and rep.skipped == {'1': 'zero output row'}
        with torch.no_grad(): y = model(x)
    assert torch.isfinite(y).all() and rel_err(y, ref) < 0.1


def test_gate_bypass_restores_the_gate_and_notices_if_it_moves(monkeypatch):
    import torchao.quantization.quant_api as qa
    gate, sm89 = qa._check_hardware_support, qa.is_sm_at_least_89  # this test fails when torchao moves its gate
    with fp8_gate_bypassed():
        assert qa._check_hardware_support is not gate
        if not torch.cuda.is_available(): assert qa.is_sm_at_least_89() is True
    assert qa._check_hardware_support is gate and qa.is_sm_at_least_89 is sm89
    monkeypatch.delattr(qa, '_check_hardware_support')
    with pytest.raises(RuntimeError, match='moved'):
        with fp8_gate_bypassed(): pass


@pytest.mark.skipif(torch.cuda.is_available(), reason='the gate only refuses where there is no sm_89+ GPU')
def test_fp8_dynamic_refused_on_cpu_leaves_module_dense():
    model = stack(512, 512, 512)
    with pytest.raises(AssertionError):  # nothing was converted: the original error, not a partial one
        quantize(model, 'fp8', make_filter_fn(0), backend='torchao')
    assert quantized_linears(model) == []


# ---------------------------------------------------------------- quantize and its report
def test_quantize_int8_report_and_numerics():
    model = nn.Sequential(nn.Linear(512, 1024, **BF), nn.GELU(), nn.Linear(1024, 512, **BF), nn.Linear(512, 64, **BF))
    model.add_module('embed', nn.Linear(512, 512, **BF))
    x = torch.randn(16, 512, **BF)
    with torch.no_grad(): ref = model[:4](x)
    rep = quantize(model, 'int8_dynamic', make_filter_fn(512, exclude_tokens=('embed',)), backend='torchao')
    assert isinstance(rep, QuantReport) and rep.scheme == 'int8' and rep.backend == 'torchao'
    assert rep.quantized == ['0', '2'] and rep.skipped == {'3': 'too small', 'embed': 'excluded'}
    assert (rep.n_quantized, rep.n_linear) == (2, 4)
    assert quantized_linears(model) == ['0', '2']
    with torch.no_grad(): err = rel_err(model[:4](x), ref)
    assert 0 < err < 0.05
    s = rep.summary()
    assert 'int8' in s and 'torchao' in s and '2/4' in s and 'too small 1' in s and 'excluded 1' in s
    df = rep.to_frame()
    assert list(df.columns) == ['fqn', 'in', 'out', 'action', 'reason', 'backend']
    assert list(df.fqn) == ['0', '2', '3', 'embed']  # module order
    assert df.set_index('fqn').loc['3', ['in', 'out', 'action', 'reason']].tolist() == [512, 64, 'skipped', 'too small']
    assert df.set_index('fqn').loc['0', ['action', 'backend']].tolist() == ['quantised', 'torchao']


@pytest.mark.parametrize('scheme', ['int8', 'int8wo', 'fp8wo', 'nvfp4wo', 'fp8_layerwise'])
def test_quantize_schemes_that_run_on_cpu(scheme):
    model = stack(512, 1024, 512)
    x = torch.randn(8, 512, **BF)
    with torch.no_grad(): ref = model(x)
    rep = quantize(model, scheme, backend='torchao')
    assert rep.quantized == ['0', '1'] and quantized_linears(model) == ['0', '1']
    with torch.no_grad(): y = model(x)
    assert torch.isfinite(y).all() and 0 < rel_err(y, ref) < 0.2


def test_scheme_divisibility_and_dtype_rules_on_top_of_the_filter():
    model = nn.Sequential(nn.Linear(512, 528, **BF), nn.Linear(528, 520, **BF), nn.Linear(520, 512, **BF))
    assert SCHEME_RULES['mxfp8']['divisible_by'] == 32 and SCHEME_RULES['nvfp4']['divisible_by'] == 16
    assert plan(model, 'nvfp4wo') == {'0': None, '1': 'not divisible by 16', '2': 'not divisible by 16'}
    assert plan(model, 'mxfp8') == {'0': 'not divisible by 32', '1': 'not divisible by 32', '2': 'not divisible by 32'}
    assert plan(model, 'fp8') == plan(model, 'fp8wo') == {'0': None, '1': 'not divisible by 16', '2': 'not divisible by 16'}
    assert set(plan(model, 'int8').values()) == {None}
    rep = quantize(model, 'nvfp4wo', backend='torchao')  # without the rule torchao raises on the 2nd Linear
    assert rep.quantized == ['0'] and rep.skipped == {'1': 'not divisible by 16', '2': 'not divisible by 16'}
    fp32 = stack(512, 512, dtype=torch.float32)
    assert plan(fp32, 'fp8') == {'0': 'not bf16'} and plan(fp32, 'mxfp8') == {'0': 'not bf16'}
    assert plan(stack(512, 512, dtype=torch.float16), 'nvfp4') == {'0': 'not bf16/fp32'}
    assert plan(fp32, 'int8') == {'0': None}


def test_require_bf16_fp32_weight():
    model = stack(512, 512, dtype=torch.float32)
    with pytest.warns(UserWarning, match='none of the 1 Linears'):
        rep = quantize(model, 'int8', make_filter_fn(512, require_bf16=True), backend='torchao')
    assert rep.skipped == {'0': 'not bf16'} and rep.quantized == [] and quantized_linears(model) == []


def test_plain_callable_filter_and_default_filter():
    model = nn.Sequential(nn.Linear(512, 512, **BF), nn.Linear(512, 64, **BF), nn.Linear(512, 512, **BF))
    assert plan(model, 'int8') == {'0': None, '1': 'too small', '2': None}  # default: min_features=512
    rep = quantize(model, 'int8wo', lambda m, fqn: fqn != '2', backend='torchao')
    assert rep.quantized == ['0', '1'] and rep.skipped == {'2': 'rejected by filter'}


def test_torchao_silent_skip_is_reported():
    "A planned Linear that torchao leaves dense is reported, not counted as quantised."
    model = stack(512, 512, 512)
    from torchao.quantization import quantize_ as real
    def lazy_torchao(module, config, filter_fn):  # a torchao that quietly skips the second Linear
        return real(module, config, filter_fn=lambda m, fqn: fqn != '1' and filter_fn(m, fqn))
    mp = pytest.MonkeyPatch()
    mp.setattr(schemes, 'quantize_', lazy_torchao)
    try:
        with pytest.warns(UserWarning, match='left 1 planned'): rep = quantize(model, 'int8wo', backend='torchao')
    finally: mp.undo()
    assert rep.quantized == ['0'] and rep.skipped == {'1': 'left dense by torchao'}


def test_tied_weight_skipped_for_layerwise():
    a, b = nn.Linear(512, 512, **BF), nn.Linear(512, 512, **BF)
    b.weight = a.weight
    model = nn.Sequential(a, b, nn.Linear(512, 512, **BF))
    rep = quantize(model, 'fp8_layerwise', backend='torchao')
    assert rep.quantized == ['2'] and rep.skipped == {'0': 'tied weight', '1': 'tied weight'}
    assert a.weight.dtype == torch.bfloat16 and model[2].weight.dtype == torch.float8_e4m3fn
    assert plan(model, 'int8wo')['0'] is None  # torchao replaces the Parameter per module: ties are no hazard there


def test_scheme_none_is_a_noop_report():
    model = stack(512, 512)
    for off in (None, 'none', 'off'):
        rep = quantize(model, off)
        assert (rep.scheme, rep.backend, rep.quantized, rep.skipped) == (None, None, [], {'0': 'no scheme'})
    assert quantized_linears(model) == []


@pytest.mark.parametrize('call,match', [
    (lambda: quantize(stack(512, 512), 'int4', backend='torchao'), 'unknown scheme'),
    (lambda: quantize(torch.zeros(3), 'int8'), 'nn.Module'),
    (lambda: quantize(stack(512, 512), 'int8', backend='cuda'), 'backend'),
    (lambda: quantize(nn.Sequential(nn.LayerNorm(8), nn.ReLU()), 'int8', backend='torchao'), 'no nn.Linear'),
    (lambda: quantize(nn.Module(), 'int8', backend='torchao'), 'no nn.Linear'),
    (lambda: quantize(stack(512, 512), 'int8', filter_fn='all', backend='torchao'), 'callable'),
    (lambda: plan(stack(512, 512), 'auto'), 'concrete scheme')])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match): call()


def test_non_linear_module_via_filter_is_never_quantised():
    model = nn.Sequential(nn.Conv2d(512, 512, 1, **BF), nn.Linear(512, 512, **BF), nn.Embedding(1000, 512, **BF))
    rep = quantize(model, 'int8wo', lambda m, fqn: True, backend='torchao')  # a filter that says yes to everything
    assert rep.quantized == ['1'] and rep.n_linear == 1
    assert quantized_linears(model) == ['1'] and type(model[0].weight) is nn.Parameter


# ---------------------------------------------------------------- partial failure
def test_partial_failure_torchao_names_the_converted(monkeypatch):
    from torchao.quantization import quantize_ as real
    def third_fails(module, config, filter_fn):
        seen = []
        def f(m, fqn):
            ok = filter_fn(m, fqn)
            if ok: seen.append(fqn)
            if ok and len(seen) == 3: raise RuntimeError('simulated kernel failure')
            return ok
        return real(module, config, filter_fn=f)
    monkeypatch.setattr(schemes, 'quantize_', third_fails)
    model = stack(512, 512, 512, 512, 512)
    with pytest.raises(PartialQuantizationError) as e: quantize(model, 'int8', backend='torchao')
    err = e.value
    assert err.converted == ['0', '1'] and err.failed == '2' and err.scheme == 'int8' and err.backend == 'torchao'
    assert "['0', '1']" in str(err) and 'half-quantised' in str(err) and 'simulated' in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    assert quantized_linears(model) == ['0', '1']  # the error tells the truth about the module


def test_partial_failure_layerwise(monkeypatch):
    import diffusers.hooks as dh
    real, calls = dh.apply_layerwise_casting_hook, []
    def third_fails(module, *a, **k):
        calls.append(module)
        if len(calls) == 3: raise RuntimeError('hook failure')
        return real(module, *a, **k)
    monkeypatch.setattr(dh, 'apply_layerwise_casting_hook', third_fails)
    model = stack(512, 512, 512, 512, 512)
    with pytest.raises(PartialQuantizationError) as e: quantize(model, 'fp8_layerwise', backend='torchao')
    assert (e.value.converted, e.value.failed) == (['0', '1'], '2')


def test_layerwise_hook_detection_uses_the_private_registry():
    "Notices when diffusers moves where it keeps its hooks."
    from diffusers.hooks import apply_layerwise_casting_hook
    lin = nn.Linear(512, 512, **BF)
    assert not is_quantized_linear(lin)
    apply_layerwise_casting_hook(lin, torch.float8_e4m3fn, torch.bfloat16, False)
    assert hasattr(lin, '_diffusers_hook') and schemes._layerwise_hook(lin) and is_quantized_linear(lin)


# ---------------------------------------------------------------- emulate and auto backends (with stand-ins)
class FakeEmulatedLinear(nn.Module):
    "Stand-in for diffq_lab.emulate.EmulatedLinear: same contract (from_linear, in/out_features, weight, scheme)."
    fail_on = None
    calls = 0
    def __init__(self, linear, scheme):
        super().__init__()
        self.in_features, self.out_features, self.weight, self.bias = linear.in_features, linear.out_features, linear.weight, linear.bias
        self.scheme = scheme
    @classmethod
    def from_linear(cls, linear, scheme):
        cls.calls += 1
        if cls.calls == cls.fail_on: raise RuntimeError('emulation failure')
        return cls(linear, scheme)
    def forward(self, x): return nn.functional.linear(x, self.weight, self.bias)


@pytest.fixture
def fake_emulate(monkeypatch):
    mod = types.ModuleType('diffq_lab.emulate')
    cls = type('EmulatedLinear', (FakeEmulatedLinear,), dict(fail_on=None, calls=0))
    mod.EmulatedLinear = cls
    monkeypatch.setitem(sys.modules, 'diffq_lab.emulate', mod)
    return cls


@pytest.fixture
def fake_capability(monkeypatch):
    mod = types.ModuleType('diffq_lab.capability')
    mod.probes, mod.ok = [], True
    def smoke_probe(scheme, device=None):
        mod.probes.append((scheme, device))
        return types.SimpleNamespace(scheme=scheme, ok=mod.ok, reason='ok' if mod.ok else 'needs sm_100')
    mod.smoke_probe = smoke_probe
    mod.select_scheme = lambda requested, device=None: 'int8wo'
    monkeypatch.setitem(sys.modules, 'diffq_lab.capability', mod)
    return mod


def test_emulate_backend_swaps_selected_linears(fake_emulate):
    model = nn.Sequential(nn.Linear(512, 512, **BF), nn.Sequential(nn.Linear(512, 512, **BF)), nn.Linear(512, 64, **BF))
    rep = quantize(model, 'nvfp4', backend='emulate')
    assert rep.backend == 'emulate' and rep.quantized == ['0', '1.0'] and rep.skipped == {'2': 'too small'}
    assert type(model[0]) is fake_emulate and type(model[1][0]) is fake_emulate and model[1][0].scheme == 'nvfp4'
    assert quantized_linears(model) == ['0', '1.0']
    assert make_filter_fn(0).skip_reason(model[0], '0') == 'already quantised'
    again = quantize(model, 'nvfp4', make_filter_fn(0), backend='emulate')
    assert again.quantized == ['2'] and again.skipped == {'0': 'already quantised', '1.0': 'already quantised'}
    df = rep.to_frame()
    assert set(df[df.action == 'quantised'].backend) == {'emulate'} and set(df[df.action == 'skipped'].backend) == {''}


def test_emulate_backend_partial_failure(fake_emulate):
    fake_emulate.fail_on = 3
    model = stack(512, 512, 512, 512, 512)
    with pytest.raises(PartialQuantizationError) as e: quantize(model, 'fp8', backend='emulate')
    assert (e.value.converted, e.value.failed, e.value.backend) == (['0', '1'], '2', 'emulate')


def test_emulate_backend_bare_linear_refused(fake_emulate):
    with pytest.raises(ValueError, match='parent'): quantize(nn.Linear(512, 512, **BF), 'int8', backend='emulate')


def test_emulate_backend_applies_the_same_rules(fake_emulate):
    "An emulated run quantises exactly the Linears the real kernels would."
    model = nn.Sequential(zero_row(nn.Linear(512, 512, **BF)), nn.Linear(512, 520, **BF), nn.Linear(512, 512, **BF))
    rep = quantize(model, 'fp8', make_filter_fn(0), backend='emulate')
    assert rep.quantized == ['2'] and rep.skipped == {'0': 'zero output row', '1': 'not divisible by 16'}


def test_auto_backend_follows_the_probe(fake_capability, fake_emulate):
    model = stack(512, 512, 512)
    rep = quantize(model, 'int8wo', backend='auto', device='cpu')
    assert rep.backend == 'torchao' and fake_capability.probes == [('int8wo', torch.device('cpu'))]
    assert quantized_linears(model) == ['0', '1'] and 'EmulatedLinear' not in type(model[0]).__name__
    fake_capability.ok = False
    model = stack(512, 512, 512)
    rep = quantize(model, 'nvfp4')  # backend defaults to 'auto'
    assert rep.backend == 'emulate' and 'needs sm_100' in rep.backend_reason and 'needs sm_100' in rep.summary()
    assert type(model[0]) is fake_emulate


def test_auto_scheme_resolved_by_capability(fake_capability, fake_emulate):
    model = stack(512, 512)
    rep = quantize(model, 'auto', backend='torchao')
    assert rep.scheme == 'int8wo' and rep.quantized == ['0']
    fake_capability.select_scheme = lambda requested, device=None: None
    rep = quantize(stack(512, 512), 'auto')
    assert rep.scheme is None and rep.quantized == [] and rep.skipped == {'0': 'no scheme'}


# ---------------------------------------------------------------- with the real capability and emulate modules
@pytest.mark.parametrize('scheme', ['int8', 'fp8', 'nvfp4', 'mxfp8', 'fp8_layerwise'])
def test_auto_backend_with_real_capability_and_emulate(scheme, monkeypatch, tmp_path):
    capability = pytest.importorskip('diffq_lab.capability')
    emulate = pytest.importorskip('diffq_lab.emulate')
    monkeypatch.setenv('DIFFQ_LAB_CACHE', str(tmp_path))  # hermetic probe cache
    capability.clear_probe_cache()
    model = nn.Sequential(nn.Linear(512, 1024, **BF), zero_row(nn.Linear(1024, 512, **BF)), nn.Linear(512, 64, **BF))
    x = torch.randn(8, 512, **BF); x[2] = 0
    with torch.no_grad(): ref = model(x)
    rep = quantize(model, scheme, device='cpu')
    probe = capability.smoke_probe(scheme, 'cpu')
    real = 'diffusers' if scheme == 'fp8_layerwise' else 'torchao'  # layerwise casting is diffusers' hook
    assert rep.backend == (real if probe.ok else 'emulate')
    if not probe.ok: assert probe.reason in rep.backend_reason
    expect = ['0'] if SCHEME_RULES[scheme]['zero_row'] else ['0', '1']
    assert rep.quantized == expect and quantized_linears(model) == expect and rep.skipped['2'] == 'too small'
    if rep.backend == 'emulate': assert all(isinstance(model[int(f)], emulate.EmulatedLinear) for f in expect)
    with torch.no_grad(): y = model(x)
    assert torch.isfinite(y).all() and rel_err(y, ref) < 0.3
    capability.clear_probe_cache()
