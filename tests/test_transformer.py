"diffq_lab.transformer: every tiny family x scheme through the loader, real GGUF files, forced fallbacks, the memory plan, compile."
import argparse, copy, os, warnings
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import numpy as np
import pytest
import torch
from diffq_lab.capability import smoke_probe
from torch import nn

import diffq_lab.transformer as T
from diffq_lab.core import load_table
from diffq_lab.pipelines import TINY_FAMILIES, render, tiny_pipeline
from diffq_lab.schemes import SCHEMES, PartialQuantizationError, quantize, quantized_linears
from diffq_lab.transformer import (denoisers, is_gguf_linear, linear_bytes, load_pipeline_quantized, module_bytes,
                                   plan_memory, quantize_transformer, write_gguf)

warnings.filterwarnings('ignore', message='.*Tensor objects.*')



@pytest.fixture(scope='module')
def pipes():
    return {f: tiny_pipeline(f) for f in TINY_FAMILIES}


@pytest.fixture(scope='module')
def dense_images(pipes):
    return {f: render(p, steps=1) for f, p in pipes.items()}


def n_planned(pipe, scheme, min_features=0):
    return sum(quantize_transformer(m, scheme, min_features=min_features, dry_run=True).n_quantized for m in denoisers(pipe).values())


# ---- which Linears --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('family', TINY_FAMILIES)
def test_tiny_m_tokens_name_exactly_the_linears_that_run_at_batch_rows(pipes, family):
    "The table is checked against the forward: the tokens select the Linears that see M <= 2 rows, and no other."
    pipe = pipes[family]
    for attr, mod in denoisers(pipe).items():
        rows = T.linear_rows(pipe, attr, steps=1)
        embed, modulation = T.tiny_m_tokens(mod)
        by_token = {f for f in rows.index if any(t in f for t in embed + modulation)}
        assert set(rows[rows <= 2].index) == by_token, family
        assert type(mod).__name__ in T.TINY_M


def test_real_dims_z_image_plans_239_of_276():
    with torch.device('meta'):
        import diffusers
        z = diffusers.ZImageTransformer2DModel().to(torch.bfloat16)  # as loaded: fp8 and MX require bf16 weights
    for s in ('int8', 'int8wo', 'fp8', 'nvfp4', 'mxfp8'):
        rep = quantize_transformer(z, s, dry_run=True)
        assert (rep.n_quantized, rep.n_linear) == (239, 276), s
        assert rep.backend == 'plan' and not quantized_linears(z)
    assert quantize_transformer(z.float(), 'fp8', dry_run=True).skipped['layers.0.attention.to_q'] == 'not bf16'


def test_flux_activation_schemes_skip_modulation_weight_only_keep_it():
    with torch.device('meta'):
        import diffusers
        flux = diffusers.FluxTransformer2DModel(guidance_embeds=True).to(torch.bfloat16)
    int8, wo = (quantize_transformer(flux, s, dry_run=True) for s in ('int8', 'int8wo'))
    mods = [f for f in int8.skipped if 'modulation' in int8.skipped[f]]
    assert len(mods) == 19 * 2 + 38 + 1  # norm1 + norm1_context per double block, norm per single block, norm_out
    assert all(f in wo.quantized for f in mods)
    assert all(int8.skipped[f] == wo.skipped[f] for f in wo.skipped)  # the embedders are skipped by both


# ---- every tiny family x scheme through the loader -----------------------------------------------------------------

@pytest.mark.parametrize('family', TINY_FAMILIES)
def test_every_scheme_renders_finite_with_the_planned_count(pipes, dense_images, family):
    for s in SCHEMES:
        pipe, st = load_pipeline_quantized(copy.deepcopy(pipes[family]), transformer_quant=s, compile=False, min_features=0)
        x = render(pipe, steps=1)
        assert torch.isfinite(x).all(), (family, s)
        planned = n_planned(pipes[family], s)
        quant = sum(len(quantized_linears(m)) for m in denoisers(pipe).values())
        if planned == 0:  # the tiny Sana / Wan have no Linear whose dims fp8 / NVFP4 / MX tile: a clean dense fallback
            assert (st['path'], st['linears_quantized'], quant) == ('dense', 0, 0), (family, s, st)
            assert 'no Linear qualifies' in st['fallback_reason']
            assert torch.equal(x, dense_images[family])
            continue
        assert (st['path'], st['scheme'], st['fallback_reason']) == ('quant', s, ''), (family, s, st)
        assert st['linears_quantized'] == planned == quant, (family, s, st)
        # the real path wherever the capability probe passes: a torchao kernel, or diffusers' cast for fp8_layerwise
        real = 'diffusers' if s == 'fp8_layerwise' else 'torchao' if smoke_probe(s, 'cpu').ok else 'emulate'
        assert st['backend'] == real or 'failed in the forward' in st['backend_note'], (family, s, st)
        assert not torch.equal(x, dense_images[family]), (family, s)  # something really changed


def test_nvfp4wo_forward_failure_is_emulated_with_the_reason(pipes):
    "torchao 0.18's NVFP4 weight-only fails on 3-D non-contiguous inputs: the probe sees it, the loader emulates and says why."
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['sd3']), transformer_quant='nvfp4wo', compile=False, min_features=0)
    assert (st['path'], st['backend']) == ('quant', 'emulate')
    assert '3-D non-contiguous' in st['backend_note'] and st['fallback_reason'] == ''


def test_default_path_never_regresses(pipes, dense_images):
    pipe = copy.deepcopy(pipes['flux.1-dev'])
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    out, st = load_pipeline_quantized(pipe, compile=False)
    assert out is pipe and st['path'] == 'dense' and st['scheme'] is None and st['fallback_reason'] == ''
    assert quantized_linears(out.transformer) == []
    assert all(torch.equal(before[k], v) for k, v in out.transformer.state_dict().items())
    assert torch.equal(render(out, steps=1), dense_images['flux.1-dev'])


def test_auto_on_cpu_stays_dense_with_a_reason(pipes, dense_images):
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='auto', compile=False, min_features=0)
    assert st['path'] == 'dense' and 'auto' in st['fallback_reason'] and quantized_linears(pipe.transformer) == []
    assert torch.equal(render(pipe, steps=1), dense_images['z-image'])


def test_unsupported_scheme_falls_back_clean(pipes, dense_images):
    "fp8 dynamic forced onto torchao on a CPU: the hardware gate refuses it before any Linear is converted."
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='fp8', backend='torchao',
                                       compile=False, min_features=0)
    assert st['path'] == 'dense' and 'fp8 (torchao)' in st['fallback_reason'], st
    assert quantized_linears(pipe.transformer) == []
    assert torch.equal(render(pipe, steps=1), dense_images['z-image'])


# ---- forced failures ------------------------------------------------------------------------------------------------

def _dies_half_way(monkeypatch, exc):
    real = T.quantize_transformer
    def fake(tr, scheme, **kw):
        if kw.get('dry_run'): return real(tr, scheme, **kw)
        # converts every Linear of the first block, including some the plan never selected, then dies
        quantize(tr, 'int8', filter_fn=lambda m, f: isinstance(m, nn.Linear) and '.0.' in f, backend='torchao')
        assert quantized_linears(tr)
        raise exc
    monkeypatch.setattr(T, 'quantize_transformer', fake)


def test_half_way_failure_restores_dense_bit_exact(pipes, dense_images, monkeypatch):
    _dies_half_way(monkeypatch, torch.OutOfMemoryError('CUDA out of memory (forced)'))
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='int8', compile=False, min_features=0)
    assert st['path'] == 'dense' and 'out of memory' in st['fallback_reason'] and st['linears_quantized'] == 0
    assert quantized_linears(pipe.transformer) == []
    assert torch.equal(render(pipe, steps=1), dense_images['z-image'])  # the dense weights are the very same


def test_half_way_failure_falls_back_to_gguf(pipes, monkeypatch, tmp_path):
    gpath = write_gguf(pipes['z-image'].transformer, tmp_path/'z.gguf')
    _dies_half_way(monkeypatch, PartialQuantizationError('int8', 'torchao', ['layers.0.attention.to_q'], None, RuntimeError('x')))
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='int8', gguf=gpath, compile=False,
                                       min_features=0)
    assert st['path'] == 'gguf' and 'PartialQuantizationError' in st['fallback_reason']
    assert st['linears_quantized'] == sum(is_gguf_linear(m) for m in pipe.transformer.modules()) > 0
    assert quantized_linears(pipe.transformer) == [] and torch.isfinite(render(pipe, steps=1)).all()


def test_a_restore_that_fails_is_never_returned(pipes, monkeypatch, tmp_path):
    _dies_half_way(monkeypatch, RuntimeError('forced'))
    def broken_restore(module, snapshot, device):
        raise PartialQuantizationError('restore', 'dense', ['x'], None, RuntimeError('cannot'))
    monkeypatch.setattr(T, '_restore', broken_restore)
    with pytest.raises(PartialQuantizationError, match='restore'):
        load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='int8', compile=False, min_features=0)
    gpath = write_gguf(pipes['z-image'].transformer, tmp_path/'z.gguf')  # with a GGUF file the broken transformer is replaced
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='int8', gguf=gpath, compile=False,
                                       min_features=0)
    assert st['path'] == 'gguf' and quantized_linears(pipe.transformer) == []


def test_a_plan_that_does_not_fit_falls_back(pipes, dense_images, tmp_path):
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='int8', compile=False, min_features=0,
                                       free_bytes=1000)
    assert st['path'] == 'dense' and st['fallback_reason'].startswith('memory plan: the dense transformer')
    assert quantized_linears(pipe.transformer) == [] and torch.equal(render(pipe, steps=1), dense_images['z-image'])
    z = pipes['z-image'].transformer
    gpath = write_gguf(z, tmp_path/'z.gguf')
    p = plan_memory(pipes['z-image'], 'int8', 'cpu', min_features=0)
    # room for the GGUF transformer beside the rest, not for the int8 one (the tiny int8 keeps its embedders bf16)
    free = int((p.gguf_bytes + p.quant_bytes + 2 * p.rest_bytes) / 2 / 0.9)
    assert p.gguf_bytes + p.rest_bytes <= 0.9 * free < p.quant_bytes + p.rest_bytes
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='int8', gguf=gpath, compile=False,
                                       min_features=0, free_bytes=free)
    assert st['path'] == 'gguf' and st['fallback_reason'].startswith('memory plan: GGUF'), st


# ---- GGUF -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('qtype', ['Q8_0', 'Q4_0'])
def test_torch_gguf_blocks_are_bit_exact_with_gguf_py(qtype):
    import gguf
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * torch.logspace(-3, 2, 48)[:, None]
    w[3] = 0; w[5, :32] = 0; w[7, 7] = -w[7].abs().max() * 2; w[9] = torch.round(w[9] * 4) / 4  # zero blocks, negative max, ties
    ref = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, qtype))
    ours = T.gguf_blocks(w, qtype)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape and np.array_equal(ours, ref)
    assert T.GGUF_TYPES[qtype] == tuple(gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)])


@pytest.mark.parametrize('family', ['z-image', 'flux.1-dev', 'qwen-image', 'wan2.2-t2v-a14b', 'sdxl'])
def test_gguf_written_here_loads_through_diffusers(pipes, dense_images, family, tmp_path):
    pipe = copy.deepcopy(pipes[family])
    errs = {}
    for qt in ('Q8_0', 'Q4_0'):
        paths = {a: write_gguf(m, tmp_path/f'{a}-{qt}.gguf', qt) for a, m in denoisers(pipe).items()}
        out, st = load_pipeline_quantized(copy.deepcopy(pipe), gguf=paths, compile=False)
        n = sum(is_gguf_linear(m) for d in denoisers(out).values() for m in d.modules())
        expect = sum(isinstance(m, nn.Linear) and m.in_features % 32 == 0 and not set(f.split('.')) & set(d._keep_in_fp32_modules or ())
                     for d in denoisers(pipe).values() for f, m in d.named_modules())  # diffusers keeps those fp32
        assert st['path'] == 'gguf' and st['linears_quantized'] == n == expect > 0, (family, qt, st)
        assert torch.isfinite(render(out, steps=1)).all()
        from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor
        dense = {f'{a}.{f}': m.weight.float() for a, d in denoisers(pipe).items() for f, m in d.named_modules() if isinstance(m, nn.Linear)}
        diffs = [(dequantize_gguf_tensor(m.weight).float() - dense[f'{a}.{f}']).abs().mean() / dense[f'{a}.{f}'].abs().mean()
                 for a, d in denoisers(out).items() for f, m in d.named_modules() if is_gguf_linear(m)]
        errs[qt] = torch.stack(diffs).mean().item()
    assert 0 < errs['Q8_0'] < 0.02 < errs['Q4_0'] < 0.2, (family, errs)  # the weights diffusers loads: 4 bits lose more than 8


def test_gguf_bad_inputs(pipes, tmp_path):
    z = copy.deepcopy(pipes['z-image'].transformer)
    with pytest.raises(ValueError, match='Q8_0'): write_gguf(z, tmp_path/'x.gguf', 'Q5_K')
    with pytest.raises(ValueError, match='divisible by 32'): T.gguf_blocks(torch.zeros(4, 48))
    with pytest.raises(ValueError, match='no GGUF file'): load_pipeline_quantized(copy.deepcopy(pipes['z-image']), gguf=tmp_path/'nope.gguf')
    with pytest.raises(ValueError, match='not denoisers'):
        load_pipeline_quantized(copy.deepcopy(pipes['z-image']), gguf={'unet': tmp_path/'nope.gguf'})
    quantize_transformer(z, 'int8', min_features=0)
    with pytest.raises(ValueError, match='dense transformer'): write_gguf(z, tmp_path/'q.gguf')
    g = T.load_gguf_transformer(write_gguf(pipes['z-image'].transformer, tmp_path/'z.gguf'), pipes['z-image'].transformer)
    with pytest.raises(ValueError, match='GGUF'): quantize_transformer(g, 'int8', min_features=0)


# ---- the memory plan ------------------------------------------------------------------------------------------------

PUBLISHED = {'z-image': 6.15e9, 'flux.1-dev': 11.9e9, 'qwen-image': 20.4e9}  # the model cards' transformer sizes


@pytest.mark.parametrize('family', list(PUBLISHED))
def test_real_dims_plan_matches_the_parameter_counts(family):
    p = plan_memory(family, 'int8', 'cpu', free_bytes=2**40)
    tr = T.real_dims_components(family)['transformer']
    n = sum(t.numel() for t in tr.parameters())
    assert p.transformer_params == n and abs(n / PUBLISHED[family] - 1) < 0.01
    assert p.dense_bytes == 2 * n
    # the int8 plan: every quantised Linear at one byte a weight plus 5 bytes of scale a row, the rest bf16
    lin = {f: m for f, m in tr.named_modules() if isinstance(m, nn.Linear)}
    picked = set(quantize_transformer(tr, 'int8', dry_run=True).quantized)
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


def test_linear_bytes_match_torchao_storage():
    from torchao.quantization import quantize_
    from diffq_lab.schemes import fp8_gate_bypassed, make_config
    for s in ('int8', 'int8wo', 'fp8', 'fp8wo', 'nvfp4wo', 'mxfp8'):
        for k, n, bias in ((64, 16, True), (160, 272, False), (2048, 384, True)):
            m = nn.Sequential(nn.Linear(k, n, bias=bias)).to(torch.bfloat16)
            with fp8_gate_bypassed(): quantize_(m, make_config(s))
            assert module_bytes(m) == linear_bytes(k, n, s, bias), (s, k, n)


def test_plan_from_a_pipeline_folder_equals_the_plan_of_the_pipeline(pipes, tmp_path):
    pipe = pipes['flux.1-schnell']
    pipe.save_pretrained(tmp_path/'flux')
    a = plan_memory(pipe, 'int8', 'cpu', free_bytes=2**30, min_features=0)
    b = plan_memory(str(tmp_path/'flux'), 'int8', 'cpu', free_bytes=2**30, min_features=0)
    for k in ('transformer_params', 'linears', 'quantized_linears', 'dense_bytes', 'quant_bytes', 'gguf_bytes', 'encoder_bytes', 'vae_bytes'):
        assert getattr(a, k) == getattr(b, k), k
    # and the loader takes the folder through diffq_lab.pipelines.load_pipeline
    out, st = load_pipeline_quantized(str(tmp_path/'flux'), transformer_quant='int8', compile=False, min_features=0)
    assert st['path'] == 'quant' and st['linears_quantized'] == a.quantized_linears > 0
    assert torch.isfinite(render(out, steps=1)).all()


def test_plan_bad_inputs():
    with pytest.raises(ValueError, match='known families'): plan_memory('not-a-family', 'int8')
    with pytest.raises(ValueError, match='Q8_0'): plan_memory('z-image', 'int8', gguf_type='Q2_K')
    with pytest.raises(ValueError, match='reserve'): plan_memory('z-image', 'int8', reserve=1.5)
    with pytest.raises(ValueError, match='no real-dims'): plan_memory('sana', 'int8')
    with pytest.raises(ValueError, match='choose one of'): plan_memory('z-image', 'int4')
    with pytest.raises(ValueError, match="'auto'"): linear_bytes(64, 64, 'auto')


def test_loader_bad_inputs(pipes):
    with pytest.raises(ValueError, match='choose one of'): load_pipeline_quantized(pipes['z-image'], transformer_quant='int3')
    with pytest.raises(ValueError, match='backend'): load_pipeline_quantized(pipes['z-image'], transformer_quant='int8', backend='cuda')
    with pytest.raises(ValueError, match='known families'): quantize_transformer(pipes['z-image'].transformer, 'int8', family='nope', dry_run=True)
    with pytest.raises(ValueError, match='nn.Module'): quantize_transformer('transformer', 'int8')


# ---- compile --------------------------------------------------------------------------------------------------------

def test_dynamo_counters_still_count_compiles():
    "The one private API: if torch moves the counters, this fails."
    class M(nn.Module):
        def __init__(self): super().__init__(); self.l = nn.Linear(8, 8)
        def forward(self, x): return torch.relu(self.l(x)) * 3
    m = M(); m.compile(backend='eager')
    st = T.compile_stats(lambda: m(torch.randn(2, 8)), runs=2)
    assert st['frames_first_call'] == 1 and st['recompiles'] == 0
    m(torch.randn(2, 8, dtype=torch.float64).float()[:, :8])  # same shapes: no recompile
    before = T.dynamo_counters()['frames']
    m(torch.randn(2, 3, 8))  # a new rank: a guard fails and Dynamo compiles again
    assert T.dynamo_counters()['frames'] == before + 1


@pytest.mark.parametrize('family,method', [('flux.1-dev', 'compile_repeated_blocks'), ('sd3', 'per_block')])
def test_regional_compile_after_quantisation(pipes, family, method):
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes[family]), transformer_quant='int8', compile=False, min_features=0)
    ref = render(pipe, steps=1)
    rep = T.compile_transformer(pipe.transformer, backend='eager')
    assert rep.method == method and rep.regions
    cs = T.compile_stats(lambda: render(pipe, steps=1), runs=1)
    assert cs['frames_first_call'] >= len(rep.block_classes) and cs['recompiles'] == 0
    assert torch.allclose(cs['output'], ref, atol=1e-2)
    with pytest.raises(ValueError, match='already compiled'): quantize_transformer(pipe.transformer, 'int8', min_features=0)
    with pytest.raises(ValueError, match='already compiled'): T.compile_transformer(pipe.transformer)


def test_loader_compiles_and_reports(pipes):
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['flux.1-schnell']), transformer_quant='int8wo', min_features=0,
                                       compile_kwargs=dict(backend='eager'))
    assert st['path'] == 'quant' and st['compile'].startswith('transformer: compile_repeated_blocks: 2 regions')
    assert torch.isfinite(render(pipe, steps=1)).all()


@pytest.mark.skipif(not os.environ.get('DIFFQ_LAB_SLOW'), reason='inductor on CPU takes 20-80 s; set DIFFQ_LAB_SLOW=1')
def test_inductor_compiles_the_int8_transformer(pipes):
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='int8', compile=False, min_features=0)
    ref = render(pipe, steps=1)
    T.compile_transformer(pipe.transformer)
    cs = T.compile_stats(lambda: render(pipe, steps=1), runs=1)
    assert cs['recompiles'] == 0 and torch.allclose(cs['output'], ref, atol=5e-2)


# ---- the benchmark --------------------------------------------------------------------------------------------------

def test_bench_rows_and_record(tmp_path):
    df = T.record_transformer_bench(root=tmp_path, pipe_or_family='flux.1-schnell', schemes=('int8', 'nvfp4'), runs=1, min_features=0)
    table = load_table('transformer_bench', tmp_path)
    assert len(table) == 4 and list(table.config) == ['gguf-Q8_0', 'dense', 'int8', 'nvfp4']
    assert {'device_name', 'torch', 'torchao', 'run'} <= set(table.columns)
    d = df.set_index('config')
    assert d.loc['dense', 'vs_dense'] == 1 and d.loc['gguf-Q8_0', 'vs_gguf'] == 1 and np.isinf(d.loc['dense', 'psnr'])
    assert d.loc['int8', 'psnr'] > d.loc['nvfp4', 'psnr'] > 10  # 8 bits stay closer to dense than 4
    assert d.loc['int8', 'quantized'] == f"{n_planned(tiny_pipeline('flux.1-schnell'), 'int8')}/28"
    assert df.finite.all() and (df.recompiles == 0).all() and df.peak_gen_MiB.isna().all()  # no CUDA peak on a CPU
    assert d.loc['dense', 'ssim'] == 1 and d.loc['nvfp4', 'ssim'] < d.loc['int8', 'ssim'] < 1
    assert 'lpips' in df or df.lpips_unavailable.str.len().gt(0).all()  # a score, or the reason there is none


def test_cli_transformer_bench_runs_from_flags(capsys):
    args = argparse.Namespace(model=None, family='sana', transformer_quant=['int8'], steps=1, size=32, runs=1, compile=False,
                              device='cpu', gguf='none', dims='tiny', min_features=None, no_record=True)
    df = T.cli_transformer_bench(args)
    assert list(df.config) == ['dense', 'int8'] and 'median_s' in capsys.readouterr().out
    assert df.set_index('config').loc['int8', 'quantized'] == '11/14'  # tiny: min_features 0; the 2 + 1 time Linears stay bf16


def test_bench_takes_a_gguf_file_and_refuses_nonsense(pipes, tmp_path):
    g = write_gguf(pipes['sd3'].transformer, tmp_path/'sd3-q4.gguf', 'Q4_0')
    df = T.transformer_bench(pipes['sd3'], schemes=(), runs=1, gguf=str(g), min_features=0)
    assert list(df.config) == ['gguf-sd3-q4', 'dense'] and df.set_index('config').loc['gguf-sd3-q4', 'path'] == 'gguf'
    with pytest.raises(ValueError, match='gguf must be'): T.transformer_bench(pipes['sd3'], gguf='Q3_K')
    with pytest.raises(ValueError, match='runs'): T.transformer_bench(pipes['sd3'], runs=0)
    with pytest.raises(ValueError, match='dims'): T.transformer_bench('sd3', dims='huge')
