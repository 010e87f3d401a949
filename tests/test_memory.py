"diffq_lab.memory: the real-dims plans against byte-exact counts, released encoder/VAE sizes, torchao storage, folders, bad inputs."
import os, warnings
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from torch import nn

from diffq_lab.gguf import write_gguf
from diffq_lab.loader import load_pipeline_quantized
import diffq_lab.memory as M
import diffq_lab.meta as MT
from diffq_lab.memory import linear_bytes, module_bytes, plan_memory
from diffq_lab.meta import real_dims_components
from diffq_lab.pipelines import render, tiny_pipeline
from diffq_lab.transformer import plan_transformer

warnings.filterwarnings('ignore', message='.*Tensor objects.*')


@pytest.mark.parametrize('family', ['z-image', 'flux.1-dev', 'qwen-image'])
def test_real_dims_plan_matches_the_parameter_counts(family):
    p = plan_memory(family, 'int8', 'cpu', free_bytes=2**40)
    tr = MT.meta_transformer(family)  # the parameter counts and dense bytes: 08a_meta (the transformer alone: one builder)
    assert p.transformer_params == sum(t.numel() for t in tr.parameters())
    # the int8 plan: every quantised Linear at one byte a weight plus 5 bytes of scale a row, the rest bf16
    lin = {f: m for f, m in tr.named_modules() if isinstance(m, nn.Linear)}
    picked = set(plan_transformer(tr, 'int8').quantized)
    saved = sum(m.in_features * m.out_features - 5 * m.out_features for f, m in lin.items() if f in picked)
    assert p.quant_bytes == p.dense_bytes - saved
    assert p.decision == 'dense+quant'


def test_plan_encoders_and_vae_are_the_released_sizes():
    p = plan_memory('flux.1-dev', None, 'cpu', free_bytes=2**40)
    assert p.encoder_bytes['text_encoder'] == 2 * 123_060_480  # CLIP-L text
    assert abs(p.encoder_bytes['text_encoder_2'] / 2 / 4.762e9 - 1) < 0.001  # T5-XXL v1.1 encoder
    assert abs(p.vae_bytes / 2 / 83.8e6 - 1) < 0.001 and p.decision == 'dense'
    q = plan_memory('qwen-image', None, 'cpu', free_bytes=2**40)
    assert abs(q.encoder_bytes['text_encoder'] / 2 / 8.29e9 - 1) < 0.001  # Qwen2.5-VL-7B with its vision tower


def test_linear_bytes_match_the_stored_bytes_without_bias_and_with_padding():
    "09_memory checks biased Linears whose dims tile; here no bias, dims the kernels pad, and diffusers' fp8 (bias cast too)."
    from torchao.quantization import quantize_
    from diffq_lab.plan import quantize
    from diffq_lab.schemes import make_config
    from diffq_lab.filters import fp8_gate_bypassed, make_filter_fn
    for k, n, bias in ((160, 272, False), (2048, 384, False), (64, 16, True)):
        for s in ('int8', 'int8wo', 'fp8', 'fp8wo', 'nvfp4wo', 'mxfp8'):
            m = nn.Sequential(nn.Linear(k, n, bias=bias)).to(torch.bfloat16)
            with fp8_gate_bypassed(): quantize_(m, make_config(s))
            assert module_bytes(m) == linear_bytes(k, n, s, bias), (s, k, n, bias)
        m = nn.Sequential(nn.Linear(k, n, bias=bias)).to(torch.bfloat16)
        assert quantize(m, 'fp8_layerwise', make_filter_fn(0)).backend == 'diffusers'
        assert module_bytes(m) == linear_bytes(k, n, 'fp8_layerwise', bias) < linear_bytes(k, n, None, bias), (k, n, bias)


@pytest.mark.parametrize('scheme', [None, 'int8', 'int8wo', 'fp8_layerwise', 'Q8_0'])
def test_the_plan_is_the_loaded_bytes(scheme, tmp_path):
    "Live, not from the recorded table 09_memory reads: the loader's resident transformer bytes are the plan's, to the byte."
    pipe = tiny_pipeline('z-image')
    p = plan_memory(pipe, None if scheme == 'Q8_0' else scheme, 'cpu', min_features=0, free_bytes=2**34)
    gguf = write_gguf(pipe.transformer, tmp_path/'z.gguf') if scheme == 'Q8_0' else None
    out, st = load_pipeline_quantized(pipe, transformer_quant=None if gguf else scheme, gguf=gguf, compile=False, min_features=0)
    assert st.path == ('gguf' if gguf else 'quant' if scheme else 'dense'), st
    assert st.backend in (None, 'torchao', 'diffusers'), st  # real storage, not the bf16 emulation
    want = p.gguf_bytes if gguf else p.quant_bytes if scheme else p.dense_bytes
    assert st.mem_load_bytes == want, (scheme, st.mem_load_bytes, want)


def test_plan_from_a_pipeline_folder_equals_the_plan_of_the_pipeline(tmp_path):
    pipe = tiny_pipeline('flux.1-schnell')
    pipe.save_pretrained(tmp_path/'flux')
    a = plan_memory(pipe, 'int8', 'cpu', free_bytes=2**30, min_features=0)
    b = plan_memory(str(tmp_path/'flux'), 'int8', 'cpu', free_bytes=2**30, min_features=0)
    for k in ('transformer_params', 'linears', 'quantized_linears', 'dense_bytes', 'quant_bytes', 'gguf_bytes', 'encoder_bytes', 'vae_bytes'):
        assert getattr(a, k) == getattr(b, k), k
    # and the loader takes the folder through diffq_lab.weights.load_pipeline
    out, st = load_pipeline_quantized(str(tmp_path/'flux'), transformer_quant='int8', compile=False, min_features=0)
    assert st.path == 'quant' and st.linears_quantized == a.quantized_linears > 0
    assert torch.isfinite(render(out, steps=1)).all()


def test_plan_bad_inputs():
    with pytest.raises(ValueError, match='known families'): plan_memory('not-a-family', 'int8')
    with pytest.raises(ValueError, match='Q8_0'): plan_memory('z-image', 'int8', gguf_type='Q2_K')
    with pytest.raises(ValueError, match='reserve'): plan_memory('z-image', 'int8', reserve=1.5)
    with pytest.raises(ValueError, match='no real-dims'): plan_memory('sana', 'int8')
    with pytest.raises(ValueError, match='choose one of'): plan_memory('z-image', 'int4')
    with pytest.raises(ValueError, match="'auto'"): linear_bytes(64, 64, 'auto')


# ---- the whole-pipeline memory model (pipeline_memory, trace_ops) ----------------------------------

import diffq_lab.memory as M
from diffq_lab.memory import pipeline_memory
from diffq_lab.meta import pipeline_trace, quantised_linears, trace_ops
from diffq_lab.policy import QuantPolicy


def test_trace_counts_a_known_forward_exactly():
    lin = nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 256)).to('meta', torch.bfloat16)
    x = torch.empty(64, 256, device='meta', dtype=torch.bfloat16)
    t = trace_ops(lambda: lin(x))
    assert t.total('matmul', 'flops') == 2 * 64 * 256 * 512 * 2
    assert t.fused_kernels == 3                                   # two GEMMs and one fused elementwise group
    assert t.fused_bytes <= t.total('other')                      # fusing never moves more bytes than eager
    assert 64 * 512 * 2 <= t.peak_bytes <= 3 * 64 * 512 * 2


def test_activations_grow_with_batch_and_size():
    a = pipeline_trace('z-image', 512, 1)['vae'].peak_bytes
    assert pipeline_trace('z-image', 512, 2)['vae'].peak_bytes == pytest.approx(2 * a, rel=0.01)
    assert pipeline_trace('z-image', 1024, 1)['vae'].peak_bytes == pytest.approx(4 * a, rel=0.05)


def test_resident_bytes_agree_with_plan_memory_under_the_lab_rules():
    e = pipeline_memory('z-image', 'int8', M.RenderShape(1024, 1))
    p = plan_memory('z-image', 'int8', 'cpu', free_bytes=2**40)
    assert e.weights['transformer'] == p.quant_bytes
    assert e.resident_bytes == p.quant_bytes + p.rest_bytes


def test_load_modes_order_the_peaks():
    peaks = {m: pipeline_memory('z-image', 'nvfp4', size=1024, batch=1, load=m).load_peak for m in ('after-load', 'at-load', 'none')}
    assert peaks['after-load'] > peaks['at-load'] > peaks['none']
    assert pipeline_memory('z-image', None, M.RenderShape(), load='after-load').load_peak == pipeline_memory('z-image').resident_bytes


def test_rules_choose_the_linears():
    lab, every = quantised_linears('flux.1-dev', 'fp8', 'lab'), quantised_linears('flux.1-dev', 'fp8', 'all')
    assert lab < every and not any('norm1.linear' in f for f in lab) and 'proj_out' in every
    assert pipeline_memory('flux.1-dev', 'fp8', rules='all').resident_bytes < pipeline_memory('flux.1-dev', 'fp8').resident_bytes


@pytest.mark.parametrize('kw,match', [(dict(load='lazy'), 'after-load'), (dict(batch=0), 'batch'),
                                      (dict(rules='some'), 'selective'), (dict(family='sdxl'), 'z-image'),
                                      (dict(workload=1024), 'must be a RenderShape'), (dict(size=1000), 'multiple of 16'),
                                      (dict(min_feature=0), 'QuantPolicy fields')])
def test_pipeline_memory_bad_inputs(kw, match):
    args = dict(family='z-image', scheme='int8') | kw
    with pytest.raises(ValueError, match=match): pipeline_memory(**args)


def test_a_render_shape_is_one_record_whether_given_or_spelled_out():
    "RenderShape(size, batch, ...) and the same fields as keywords give one estimate; a policy sets the lab rules' floor."
    w = M.RenderShape(512, 2, text_tokens=64)
    a, b = pipeline_memory('z-image', 'int8', w), pipeline_memory('z-image', 'int8', size=512, batch=2, text_tokens=64)
    assert a == b and (a.size, a.batch) == (512, 2)
    assert pipeline_memory('z-image', 'int8', w, batch=4).batch == 4  # keywords laid over the record
    assert a.activations == {k: t.peak_bytes for k, t in pipeline_trace('z-image', 512, 2, None, 64).items()}
    floor0 = quantised_linears('flux.1-dev', 'int8', policy=QuantPolicy(min_features=0))
    assert floor0 == quantised_linears('flux.1-dev', 'int8', min_features=0) > quantised_linears('flux.1-dev', 'int8')
    p = plan_memory('flux.1-dev', 'int8', 'cpu', policy=QuantPolicy(free_bytes=2**40, reserve=0.25))
    assert (p.free_bytes, p.reserve, p.budget) == (2**40, 0.25, int(2**40 * 0.75))
    assert plan_memory('flux.1-dev', 'int8', 'cpu', free_bytes=2**40, reserve=0.25).budget == p.budget


def test_one_way_to_build_a_real_denoiser_on_meta():
    "meta_transformer is real_dims_components' transformer (one builder), also for a family whose other parts are unknown."
    a, b = MT.meta_transformer('z-image'), real_dims_components('z-image')['transformer']
    assert type(a) is type(b) and a.config == b.config and all(t.device.type == 'meta' for t in a.parameters())
    assert [(n, t.shape, t.dtype) for n, t in a.named_parameters()] == [(n, t.shape, t.dtype) for n, t in b.named_parameters()]
    only = [f for f in MT.MODELS if not MT.get_family(f).real_dims]
    for f in only:  # a transformer alone: the family's pipeline is not known at real dims
        assert type(MT.meta_transformer(f)).__name__ == MT.get_family(f).denoiser
        with pytest.raises(ValueError, match='no real-dims configs'): real_dims_components(f)


def test_layerwise_casting_skips_diffusers_patterns_and_encoders_keep_their_floor():
    "fp8_layerwise under 'all' is diffusers' enable_layerwise_casting (its skip patterns); encoder_plan keeps narrow Linears."
    tr = nn.ModuleDict(dict(norm1=nn.ModuleDict(dict(linear=nn.Linear(8, 8))), proj_out=nn.Linear(8, 8),
                            ff=nn.Linear(8, 8))).to('meta')
    assert MT.linears_under_rules(tr, 'fp8_layerwise', 'all', 0) == {'ff'}
    assert MT.linears_under_rules(tr, 'fp8wo', 'all', 0) == {'norm1.linear', 'proj_out', 'ff'}
    enc = nn.ModuleDict(dict(wide=nn.Linear(1024, 1024), narrow=nn.Linear(64, 1024), lm_head=nn.Linear(1024, 1024)))
    assert M.encoder_plan(enc, 'int8', 512) == {'wide': 'int8'}
    with pytest.raises(ValueError, match='choose one of bf16'): M.encoder_plan(enc, 'fp7', 512)


def test_reserved_bytes_follow_the_allocator_segments():
    assert M.reserved_bytes([1, 1]) == 2 << 20 and M.reserved_bytes([5 << 20] * 5) == 40 << 20
    assert M.reserved_bytes([100 << 20]) == 100 << 20 and M.reserved_bytes([(100 << 20) + 1]) == 102 << 20


@pytest.mark.parametrize('scheme, residual', [('nvfp4_lr', 'nvfp4'), ('int4_lr', None)])
def test_a_lowrank_linear_carries_its_branch_bytes(scheme, residual):
    "An SVDQuant Linear's bytes: the 4-bit residual, r (K + N) 2 for the bf16 branch, 2 K for the smoothing factor."
    k, n, r = 3072, 12288, 32
    extra = linear_bytes(k, n, scheme, bias=False) - (2 * r * (k + n) + 2 * k)
    want = linear_bytes(k, n, residual, bias=False) if residual else n * k // 2 + n * (k // 64) * 2
    assert extra == want
