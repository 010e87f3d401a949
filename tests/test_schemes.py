"""diffq_lab.schemes beyond the notebook's inline checks: spellings and bad input over many values, the configs the
notebook does not pin, each guard switched off to show its hazard returns, private-API tripwires, cross-checks."""
import copy, dataclasses
from collections import Counter
import pytest
import torch
from torch import nn
from diffq_lab import filters, schemes
from diffq_lab.schemes import REGISTRY, SCHEMES, normalize_scheme, make_config
from diffq_lab.filters import (make_filter_fn, skip_reason, skip_reasons, has_zero_output_row, quantized_linears,
    is_quantized_linear, fp8_gate_bypassed)
from diffq_lab.plan import QuantizationError, plan_linears, quantize
from diffq_lab.capability import SchemeUnavailableError, smoke_probe

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


def test_every_alias_names_its_scheme_and_records_pass_through():
    for s in REGISTRY.values():
        for a in (s.name, *s.aliases):
            assert normalize_scheme(a) == s.name and normalize_scheme(a.upper().replace('_', '-')) == s.name, a
        assert schemes.get_scheme(s) is s and normalize_scheme(s) == s.name
    assert SCHEMES == tuple(REGISTRY)


@pytest.mark.parametrize('bad', ['int4', 'fp16', 'nvfp8', 'int8x', 'auto8', 8, 1.0, True, ('int8',)])
def test_normalize_rejects_unknown_listing_choices(bad):
    with pytest.raises(ValueError) as e: normalize_scheme(bad)
    for s in SCHEMES: assert s in str(e.value)


def test_register_refuses_keywords():
    gate = schemes.Gate((8, 0), True, '')
    for alias in ('auto', 'off', 'Dense'):
        with pytest.raises(ValueError, match='already name'):
            schemes.register_scheme(schemes.Scheme('w9', 'x', '', None, gate, lambda k, n: 0, aliases=(alias,)))
    assert 'w9' not in REGISTRY


# ---------------------------------------------------------------- configs (what the notebook does not pin)
def test_make_config_types_and_settings():
    from torchao.quantization import PerRow
    names = {s: type(make_config(s)).__name__ for s in ('int8wo', 'fp8wo', 'nvfp4wo')}
    assert names == {'int8wo': 'Int8WeightOnlyConfig', 'fp8wo': 'Float8WeightOnlyConfig', 'nvfp4wo': 'NVFP4WeightOnlyConfig'}
    v = schemes._int8_version()
    assert make_config('int8wo').version == v
    assert v == (1 if schemes._torchao_version() < (0, 16) else 2)  # 0.15's version 2 is the inaccurate one
    assert isinstance(getattr(make_config('fp8wo'), 'granularity', PerRow()), PerRow)  # the field is new in 0.18
    mx = make_config('mxfp8')
    assert (mx.activation_dtype, mx.weight_dtype) == (torch.float8_e4m3fn, torch.float8_e4m3fn)
    assert mx.kernel_preference.value == 'auto'  # the fastest kernel on the real path, not EMULATED
    if not torch.cuda.is_available(): assert make_config('nvfp4').use_triton_kernel is False


def test_every_torchao_scheme_has_a_torchao_handler():
    "Each registered torchao scheme's config is one `quantize_` knows; fresh on every call (configs are mutable)."
    from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER
    for s in REGISTRY.values():
        if s.library != 'torchao': assert s.make_config() is None, s.name; continue  # diffusers casts, nunchaku kernels
        cfg = s.make_config()
        assert type(cfg) in _QUANTIZE_CONFIG_HANDLER, s.name
        assert s.make_config() is not cfg


@pytest.mark.parametrize('bad', ['auto', 'off', 'int4'])
def test_make_config_bad_input(bad):
    with pytest.raises(ValueError): make_config(bad)


def test_build_drops_kwargs_an_older_torchao_lacks():
    class OldConfig:  # stands in for a torchao release without activation_value_lb
        def __init__(self, granularity=None): self.granularity = granularity
    with pytest.warns(UserWarning, match='activation_value_lb'):
        cfg = schemes._build(OldConfig, granularity='row', activation_value_lb=1e-12)
    assert cfg.granularity == 'row'


# ---------------------------------------------------------------- filters
def test_filter_through_torchao_quantizes_leaves_not_the_container():
    from torchao.quantization import quantize_
    model = nn.Sequential(stack(512, 512, 512), nn.Linear(512, 512, **BF))
    quantize_(model, make_config('int8wo'), filter_fn=make_filter_fn(0))
    assert quantized_linears(model) == ['0.0', '0.1', '1']
    assert type(model[0]) is nn.Sequential


def test_filter_reasons():
    lin = lambda i, o, **kw: nn.Linear(i, o, **{**BF, **kw})
    f = make_filter_fn(512, exclude_tokens=('embed', 'norm_out'), divisible_by=64)
    assert f.skip_reason(lin(256, 3840), 'blocks.0.adaLN_modulation') == 'too small'
    assert f.skip_reason(lin(3840, 256), 'x') == 'too small'  # out features count too
    assert f.skip_reason(lin(512, 512), 't_embedder.mlp') == 'excluded'  # a token is a substring of the fqn
    assert f.skip_reason(lin(512, 544), 'x') == 'not divisible by 64'
    assert f.skip_reason(nn.MultiheadAttention(512, 8).out_proj, 'attn.out_proj') == 'attention out_proj'
    assert make_filter_fn(512, require_bf16=False)(lin(512, 512, dtype=torch.float32), 'x') is True
    assert skip_reason(lin(512, 512), 'a.embed') is None and skip_reason(lin(512, 512), 'a.embed', exclude_tokens='embed') == 'excluded'


@pytest.mark.parametrize('kw', [dict(min_features=1.5), dict(min_features=True), dict(divisible_by=2.0),
                                dict(divisible_by=True), dict(exclude_tokens=(3,)), dict(exclude_tokens=('a', None))])
def test_filter_bad_settings(kw):
    with pytest.raises(ValueError): make_filter_fn(**kw)
    with pytest.raises(ValueError): skip_reason(nn.Linear(8, 8), 'x', **kw)


def test_zimage_real_dims_skipped_are_all_too_small():
    from diffusers import ZImageTransformer2DModel
    with torch.device('meta'): m = ZImageTransformer2DModel()
    linears = {n: x for n, x in m.named_modules() if isinstance(x, nn.Linear)}
    f = make_filter_fn(512)
    skipped = {n for n, x in linears.items() if not f(x, n)}
    # adaLN modulation of 30 layers + 2 noise refiners, final-layer modulation, timestep MLP, patch embed, final proj
    shapes = Counter((linears[n].in_features, linears[n].out_features) for n in skipped)
    assert shapes == {(256, 15360): 32, (256, 3840): 1, (256, 1024): 1, (1024, 256): 1, (64, 3840): 1, (3840, 64): 1}
    reasons = skip_reasons(m, 'int8', f)  # the same 37 as too small, on a meta model (no zero-row check possible)
    assert sum(r is None for r in reasons.values()) == 239 and set(reasons.values()) == {None, 'too small'}


# ---------------------------------------------------------------- zero rows
def test_has_zero_output_row_edges():
    lin = zero_row(nn.Linear(64, 32, **BF), 5)
    with torch.no_grad(): lin.weight[5, 0] = 1e-3  # one tiny value keeps the row alive
    assert not has_zero_output_row(lin)
    zero_col = nn.Linear(64, 32, **BF)
    with torch.no_grad(): zero_col.weight[:, 4] = 0  # a zero *input* column is harmless
    assert not has_zero_output_row(zero_col)
    with torch.device('meta'): assert not has_zero_output_row(nn.Linear(64, 32))
    live, dead = stack(512, 512), nn.Sequential(zero_row(nn.Linear(512, 512, **BF)))
    for m in (live, dead): quantize(m, 'int8wo', make_filter_fn(0), backend='torchao')
    assert not has_zero_output_row(live[0]) and has_zero_output_row(dead[0])  # read through the torchao tensor


@pytest.mark.parametrize('scheme', ['fp8', 'fp8wo'])
def test_zero_row_guard_off_gives_nan_on(scheme, monkeypatch):
    "The real per-row fp8 kernels (fp8 dynamic with its CPU gate lifted): a zero weight row is a NaN column without the guard."
    model = nn.Sequential(nn.Linear(512, 512, **BF), zero_row(nn.Linear(512, 512, **BF)), nn.Linear(512, 512, **BF))
    x = torch.randn(6, 512, **BF); x[1] = 0  # a zero activation row: the activation floor's case
    with torch.no_grad(): ref = model(x)
    with fp8_gate_bypassed():
        with monkeypatch.context() as mp:
            mp.setattr(filters, 'has_zero_output_row', lambda linear: False)  # guard off
            bad = copy.deepcopy(model)
            assert quantize(bad, scheme, make_filter_fn(0), backend='torchao').quantized == ['0', '1', '2']
            with torch.no_grad(): assert torch.isnan(bad[:2](x)).any(0).nonzero().flatten().tolist() == [3]
        p = quantize(model, scheme, make_filter_fn(0), backend='torchao')
        with torch.no_grad(): y = model(x)
    assert p.quantized == ['0', '2'] and p.skipped == {'1': 'zero output row'}
    assert torch.isfinite(y).all() and rel_err(y, ref) < 0.1


def test_shape_rule_off_torchao_fails_and_restores(monkeypatch):
    "NVFP4 weight-only needs multiples of 16: without the rule torchao raises on the 2nd Linear; with it, it is skipped."
    model = nn.Sequential(nn.Linear(512, 528, **BF), nn.Linear(528, 520, **BF), nn.Linear(520, 512, **BF))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with monkeypatch.context() as mp:
        mp.setitem(REGISTRY, 'nvfp4wo', dataclasses.replace(REGISTRY['nvfp4wo'], multiple_of=(1, 1)))  # rule off
        with pytest.raises(QuantizationError, match='nvfp4wo'): quantize(model, 'nvfp4wo', backend='torchao')
    assert quantized_linears(model) == [] and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    p = quantize(model, 'nvfp4wo', backend='torchao')
    assert p.quantized == ['0'] and p.skipped == {'1': 'not divisible by 16', '2': 'not divisible by 16'}


def test_gate_bypass_restores_the_gate_and_notices_if_it_moves(monkeypatch):
    import torchao.quantization.quant_api as qa
    gate, sm89 = qa._check_hardware_support, qa.is_sm_at_least_89  # this test fails when torchao moves its gate
    with fp8_gate_bypassed():
        assert qa._check_hardware_support is not gate
        if not torch.cuda.is_available(): assert qa.is_sm_at_least_89() is True
    assert qa._check_hardware_support is gate and qa.is_sm_at_least_89 is sm89
    with pytest.raises(KeyError):
        with fp8_gate_bypassed(): raise KeyError('inside')
    assert qa._check_hardware_support is gate  # restored on the way out of an error too
    monkeypatch.delattr(qa, '_check_hardware_support')
    with pytest.raises(RuntimeError, match='moved'):
        with fp8_gate_bypassed(): pass


@pytest.mark.skipif(torch.cuda.is_available(), reason='the gate only refuses where there is no sm_89+ GPU')
def test_fp8_dynamic_refused_on_cpu_raises_and_leaves_module_dense():
    model = stack(512, 512, 512)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(QuantizationError, match='restored') as e: quantize(model, 'fp8', make_filter_fn(0), backend='torchao')
    assert isinstance(e.value.__cause__, AssertionError) and (e.value.scheme, e.value.backend) == ('fp8', 'torchao')
    assert quantized_linears(model) == [] and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- the real kernels that run here, and the rules per backend
@pytest.mark.parametrize('scheme', ['int8', 'int8wo', 'fp8wo', 'nvfp4wo', 'fp8_layerwise'])
def test_real_kernels_that_run_on_cpu(scheme):
    model = stack(512, 1024, 512)
    x = torch.randn(8, 512, **BF)
    with torch.no_grad(): ref = model(x)
    p = quantize(model, scheme, backend='torchao')
    assert p.quantized == ['0', '1'] and quantized_linears(model) == ['0', '1'] and p.backend == REGISTRY[scheme].library
    with torch.no_grad(): y = model(x)
    assert torch.isfinite(y).all() and 0 < rel_err(y, ref) < 0.2


@pytest.mark.parametrize('scheme', SCHEMES)
def test_emulation_quantises_exactly_what_the_real_kernel_would(scheme):
    "The rules do not depend on the backend: an emulated study quantises the Linears the real kernels would."
    model = nn.Sequential(zero_row(nn.Linear(512, 512, **BF)), nn.Linear(512, 520, **BF), nn.Linear(520, 512, **BF),
                          nn.Linear(512, 512), nn.Linear(512, 512, dtype=torch.float16), nn.Linear(512, 64, **BF))
    a = plan_linears(model, scheme, make_filter_fn(0), backend='emulate', device='cpu')
    try: b = plan_linears(model, scheme, make_filter_fn(0), backend='torchao', device='cpu')
    except SchemeUnavailableError as e:  # a kernel that converts here but cannot compute is refused before any plan
        assert smoke_probe(scheme, 'cpu').stage == 'forward' and "backend='emulate'" in str(e)
        return
    assert a.linears.keys() == b.linears.keys() and a.quantized == b.quantized and a.skipped == b.skipped


def test_non_linear_module_via_filter_is_never_quantised():
    model = nn.Sequential(nn.Conv2d(512, 512, 1, **BF), nn.Linear(512, 512, **BF), nn.Embedding(1000, 512, **BF))
    p = quantize(model, 'int8wo', lambda m, fqn: True, backend='torchao')  # a filter that says yes to everything
    assert p.quantized == ['1'] and p.n_linear == 1
    assert quantized_linears(model) == ['1'] and type(model[0].weight) is nn.Parameter


@pytest.mark.parametrize('call,match', [
    (lambda: quantize(torch.zeros(3), 'int8'), 'nn.Module'),
    (lambda: quantize(stack(512, 512), 'int8', backend='cuda'), 'backend'),
    (lambda: quantize(nn.Module(), 'int8', backend='torchao'), 'no nn.Linear'),
    (lambda: quantize(stack(512, 512), 'int8', filter_fn='all', backend='torchao'), 'callable'),
    (lambda: skip_reasons(stack(512, 512), 'auto'), 'resolve it'),
    (lambda: skip_reasons(stack(512, 512), None), 'concrete scheme')])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match): call()


def test_layerwise_detection_uses_the_private_registry():
    "Notices when diffusers moves where it keeps its hooks (`layerwise_registry` reads `_diffusers_hook`)."
    from diffusers.hooks import apply_layerwise_casting_hook
    lin = nn.Linear(512, 512, **BF)
    assert not is_quantized_linear(lin) and filters.layerwise_registry(lin) is None
    apply_layerwise_casting_hook(lin, torch.float8_e4m3fn, torch.bfloat16, False)
    assert hasattr(lin, '_diffusers_hook') and filters.layerwise_registry(lin) is lin._diffusers_hook
    assert is_quantized_linear(lin) and lin.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize('scheme', ['int8', 'fp8', 'nvfp4', 'mxfp8', 'fp8_layerwise'])
def test_auto_backend_with_the_real_probe(scheme, monkeypatch, tmp_path):
    "backend='auto' runs the real library where its probe passes here, else emulates; zero rows and activations stay finite."
    from diffq_lab import capability
    from diffq_lab.emulate import EmulatedLinear
    monkeypatch.setenv('DIFFQ_LAB_CACHE', str(tmp_path))  # hermetic probe cache
    capability.clear_probe_cache()
    model = nn.Sequential(nn.Linear(512, 1024, **BF), zero_row(nn.Linear(1024, 512, **BF)), nn.Linear(512, 64, **BF))
    x = torch.randn(8, 512, **BF); x[2] = 0
    with torch.no_grad(): ref = model(x)
    p = quantize(model, scheme, device='cpu')
    probe = capability.smoke_probe(scheme, 'cpu')
    assert p.backend == (REGISTRY[scheme].library if probe.ok else 'emulate')
    if not probe.ok: assert probe.reason in p.backend_reason
    expect = ['0'] if REGISTRY[scheme].zero_row_hazard else ['0', '1']
    assert p.quantized == expect and quantized_linears(model) == expect and p.skipped['2'] == 'too small'
    if p.backend == 'emulate': assert all(isinstance(model[int(f)], EmulatedLinear) for f in expect)
    with torch.no_grad(): y = model(x)
    assert torch.isfinite(y).all() and rel_err(y, ref) < 0.3
    capability.clear_probe_cache()
