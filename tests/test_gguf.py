"diffq_lab.gguf: every tiny family x scheme through the loader, te_quant, real GGUF files, failures inside the apply window, bad inputs."
import copy, os, warnings
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import numpy as np
import pytest
import torch
from torch import nn

import diffq_lab.gguf as G
import diffq_lab.loader as L
from diffq_lab.capability import smoke_probe
from diffq_lab.pipelines import TINY_FAMILIES, render, tiny_pipeline
from diffq_lab.schemes import SCHEMES
from diffq_lab.filters import quantized_linears
from diffq_lab.memory import GGUF_TYPES, plan_memory
from diffq_lab.transformer import denoisers, is_gguf_linear, plan_transformer, quantize_transformer
from diffq_lab.gguf import write_gguf
from diffq_lab.loader import load_pipeline_quantized

warnings.filterwarnings('ignore', message='.*Tensor objects.*')


def n_planned(pipe, scheme, min_features=0):
    return sum(plan_transformer(m, scheme, min_features=min_features).n_quantized for m in denoisers(pipe).values())


# ---- every tiny family x scheme through the loader ----------------------------------------------------------------------

@pytest.mark.parametrize('family', TINY_FAMILIES)
def test_every_scheme_renders_finite_with_the_planned_count(pipes, dense_images, family):
    for s in SCHEMES:
        pipe, st = load_pipeline_quantized(copy.deepcopy(pipes[family]), transformer_quant=s, compile=False, min_features=0)
        x = render(pipe, steps=1)
        assert torch.isfinite(x).all(), (family, s)
        planned = n_planned(pipes[family], s)
        quant = sum(len(quantized_linears(m)) for m in denoisers(pipe).values())
        if planned == 0:  # the tiny Sana / Wan have no Linear whose dims fp8 / NVFP4 / MX tile: a clean dense fallback
            assert (st.path, st.linears_quantized, quant) == ('dense', 0, 0), (family, s, st)
            assert 'no Linear qualifies' in st.fallback_reason
            assert torch.equal(x, dense_images[family])
            continue
        assert (st.path, st.scheme, st.fallback_reason) == ('quant', s, ''), (family, s, st)
        assert st.linears_quantized == planned == quant, (family, s, st)
        for a, m in denoisers(pipe).items():  # the status' applied plan is what the modules hold
            assert st.plan.components[a].quantized == quantized_linears(m), (family, s, a)
        # the real path wherever the capability probe passes: a torchao kernel, or diffusers' cast for fp8_layerwise
        real = 'diffusers' if s == 'fp8_layerwise' else 'torchao' if smoke_probe(s, 'cpu').ok else 'emulate'
        assert st.backend == real or 'failed in the forward' in st.backend_note, (family, s, st)
        assert not torch.equal(x, dense_images[family]), (family, s)  # something really changed


def test_te_quant_alone_quantises_the_encoders_and_leaves_the_transformer_bit_identical(pipes, dense_images):
    pipe = copy.deepcopy(pipes['flux.1-dev'])
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    out, st = load_pipeline_quantized(pipe, te_quant='int8wo', compile=False)
    assert out is pipe and (st.path, st.scheme, st.fallback_reason) == ('dense', None, ''), st
    qp = st.plan
    assert list(qp.components) == ['text_encoder', 'text_encoder_2', 'transformer']
    for c in ('text_encoder', 'text_encoder_2'):
        assert qp.components[c].scheme == 'int8wo' and qp.components[c].quantized == quantized_linears(getattr(pipe, c)) != []
    assert set(qp.components['transformer'].skipped.values()) == {'dense requested'} and quantized_linears(pipe.transformer) == []
    assert all(torch.equal(before[k], v) for k, v in pipe.transformer.state_dict().items())
    assert not torch.equal(render(out, steps=1), dense_images['flux.1-dev'])  # the encoders really changed


def test_auto_on_cpu_stays_dense_with_a_reason(pipes, dense_images):
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='auto', compile=False, min_features=0)
    assert st.path == 'dense' and 'auto' in st.fallback_reason and quantized_linears(pipe.transformer) == []
    assert torch.equal(render(pipe, steps=1), dense_images['z-image'])


def test_unsupported_scheme_falls_back_clean(pipes, dense_images):
    "fp8 dynamic forced onto torchao on a CPU: the hardware gate refuses it before any Linear is converted."
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='fp8', backend='torchao',
                                       compile=False, min_features=0)
    assert st.path == 'dense' and 'fp8 (torchao)' in st.fallback_reason, st
    assert quantized_linears(pipe.transformer) == []
    assert torch.equal(render(pipe, steps=1), dense_images['z-image'])


def test_loader_compiles_and_reports(pipes):
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['flux.1-schnell']), transformer_quant='int8wo', min_features=0,
                                       compile=True, compile_kwargs=dict(backend='eager'))  # the policy's default: no compile
    assert st.path == 'quant' and st.compile.startswith('transformer: compile_repeated_blocks: 2 regions')
    assert torch.isfinite(render(pipe, steps=1)).all()


# ---- failures inside the apply window (the k-th Linear of every entry point: test_plan) ------------------------------------

def test_a_forward_failure_is_retried_emulated_then_restores_dense_bit_exact(pipes, dense_images, monkeypatch):
    "The validation render fails after every planned Linear was converted, under torchao and again under the emulation retry."
    pipe = copy.deepcopy(pipes['z-image'])
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    seen = []
    def dies(p, status, device):
        seen.append((len(quantized_linears(p.transformer)), type(p.transformer.layers[0].attention.to_q).__name__))
        raise L._ForwardFailed('RuntimeError: kernel died (forced)')
    monkeypatch.setattr(L, '_validate', dies)
    out, st = load_pipeline_quantized(pipe, transformer_quant='int8', compile=False, min_features=0)
    planned = n_planned(pipes['z-image'], 'int8')
    assert [n for n, _ in seen] == [planned, planned] and seen[0][1] != seen[1][1], seen  # torchao, then emulated
    assert (st.path, st.scheme, st.linears_quantized) == ('dense', None, 0), st
    assert st.fallback_reason == 'int8 (emulate): _ForwardFailed: RuntimeError: kernel died (forced)', st.fallback_reason
    assert quantized_linears(pipe.transformer) == []
    assert all(torch.equal(before[k], v) for k, v in pipe.transformer.state_dict().items())
    assert torch.equal(render(out, steps=1), dense_images['z-image'])


def test_a_failure_at_a_linear_falls_back_to_gguf(pipes, tmp_path, fail_at_kth_linear):
    gpath = write_gguf(pipes['z-image'].transformer, tmp_path/'z.gguf')
    pipe = copy.deepcopy(pipes['z-image'])
    rec = fail_at_kth_linear('int8', 'torchao', 3, exc=torch.OutOfMemoryError('CUDA out of memory (forced)'), within=[pipe.transformer])
    pipe, st = load_pipeline_quantized(pipe, transformer_quant='int8', gguf=gpath, compile=False, min_features=0)
    assert rec.fired and st.path == 'gguf', st
    assert st.fallback_reason.startswith('int8 (auto): QuantizationError') and 'out of memory' in st.fallback_reason
    assert st.linears_quantized == sum(is_gguf_linear(m) for m in pipe.transformer.modules()) > 0
    assert quantized_linears(pipe.transformer) == [] and torch.isfinite(render(pipe, steps=1)).all()
    assert set(st.plan.components['transformer'].skipped.values()) == {f'GGUF {gpath}'}


def test_a_restore_that_fails_is_never_returned(pipes, monkeypatch, fail_at_kth_linear):
    import diffq_lab.plan as P
    real = P._restore
    def half_restores(snap):
        real(snap[:2])
        raise RuntimeError('cannot restore (forced)')
    monkeypatch.setattr(P, '_restore', half_restores)
    pipe = copy.deepcopy(pipes['z-image'])
    fail_at_kth_linear('int8', 'torchao', 10, within=[pipe.transformer])
    try: out, st = load_pipeline_quantized(pipe, transformer_quant='int8', compile=False, min_features=0)
    except Exception: return  # raising is the contract: a half-restored pipeline is never handed back
    pytest.fail(f"returned path={st.path!r} with {len(quantized_linears(out.transformer))} quantised Linears left; "
                f"reason {st.fallback_reason!r}")


def test_a_plan_that_does_not_fit_falls_back(pipes, dense_images, tmp_path):
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='int8', compile=False, min_features=0,
                                       free_bytes=1000)
    assert st.path == 'dense' and st.fallback_reason.startswith('memory plan: the dense transformer')
    assert st.memory.startswith('too-large: ')
    assert quantized_linears(pipe.transformer) == [] and torch.equal(render(pipe, steps=1), dense_images['z-image'])
    z = pipes['z-image'].transformer
    gpath = write_gguf(z, tmp_path/'z.gguf')
    p = plan_memory(pipes['z-image'], 'int8', 'cpu', min_features=0)
    # room for the GGUF transformer beside the rest, not for the int8 one (the tiny int8 keeps its embedders bf16)
    free = int((p.gguf_bytes + p.quant_bytes + 2 * p.rest_bytes) / 2 / 0.9)
    assert p.gguf_bytes + p.rest_bytes <= 0.9 * free < p.quant_bytes + p.rest_bytes
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='int8', gguf=gpath, compile=False,
                                       min_features=0, free_bytes=free)
    assert st.path == 'gguf' and st.fallback_reason.startswith('memory plan: GGUF'), st


# ---- GGUF ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('qtype', ['Q8_0', 'Q4_0'])
def test_torch_gguf_blocks_are_bit_exact_with_gguf_py(qtype):
    import gguf
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * torch.logspace(-3, 2, 48)[:, None]
    w[3] = 0; w[5, :32] = 0; w[7, 7] = -w[7].abs().max() * 2; w[9] = torch.round(w[9] * 4) / 4  # zero blocks, negative max, ties
    ref = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, qtype))
    ours = G.gguf_blocks(w, qtype)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape and np.array_equal(ours, ref)
    assert GGUF_TYPES[qtype] == tuple(gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)])


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
        assert st.path == 'gguf' and st.linears_quantized == n == expect > 0, (family, qt, st)
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
    with pytest.raises(ValueError, match='divisible by 32'): G.gguf_blocks(torch.zeros(4, 48))
    with pytest.raises(ValueError, match='no GGUF file'): load_pipeline_quantized(copy.deepcopy(pipes['z-image']), gguf=tmp_path/'nope.gguf')
    with pytest.raises(ValueError, match='not denoisers'):
        load_pipeline_quantized(copy.deepcopy(pipes['z-image']), gguf={'unet': tmp_path/'nope.gguf'})
    quantize_transformer(z, 'int8', min_features=0)
    with pytest.raises(ValueError, match='dense transformer'): write_gguf(z, tmp_path/'q.gguf')
    g = G.load_gguf_transformer(write_gguf(pipes['z-image'].transformer, tmp_path/'z.gguf'), pipes['z-image'].transformer)
    with pytest.raises(ValueError, match='GGUF'): quantize_transformer(g, 'int8', min_features=0)


def test_loader_bad_inputs(pipes):
    with pytest.raises(ValueError, match='choose one of'): load_pipeline_quantized(pipes['z-image'], transformer_quant='int3')
    with pytest.raises(ValueError, match='choose one of'): load_pipeline_quantized(pipes['z-image'], te_quant='int3')
    with pytest.raises(ValueError, match='backend'): load_pipeline_quantized(pipes['z-image'], transformer_quant='int8', backend='cuda')
    with pytest.raises(ValueError, match='known families'): plan_transformer(pipes['z-image'].transformer, 'int8', family='nope')
    with pytest.raises(ValueError, match='nn.Module'): quantize_transformer('transformer', 'int8')
    assert all(quantized_linears(m) == [] for m in pipes['z-image'].components.values() if isinstance(m, nn.Module))
