"diffq_lab.transformer: the tiny-M tokens against the forward, the real-dims filter, regional compile."
import copy, os, warnings
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from torch import nn

import diffq_lab.transformer as T
from diffq_lab.gguf import load_pipeline_quantized
from diffq_lab.pipelines import TINY_FAMILIES, get_family, render, tiny_pipeline
from diffq_lab.schemes import quantized_linears
from diffq_lab.transformer import denoisers, quantize_transformer

warnings.filterwarnings('ignore', message='.*Tensor objects.*')


@pytest.fixture(scope='module')
def pipes():
    return {f: tiny_pipeline(f) for f in TINY_FAMILIES}


@pytest.fixture(scope='module')
def dense_images(pipes):
    return {f: render(p, steps=1) for f, p in pipes.items()}


# ---- which Linears ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('family', TINY_FAMILIES)
def test_tiny_m_tokens_name_exactly_the_linears_that_run_at_batch_rows(pipes, family):
    "The registry's tokens are checked against the forward: the tokens select the Linears that see M <= 2 rows, and no other."
    pipe = pipes[family]
    for attr, mod in denoisers(pipe).items():
        rows = T.linear_rows(pipe, attr, steps=1)
        embed, modulation = T.tiny_m_tokens(mod)
        by_token = {f for f in rows.index if any(t in f for t in embed + modulation)}
        assert set(rows[rows <= 2].index) == by_token, family
        assert type(mod).__name__ == get_family(family).denoiser and get_family(family).tiny_m is not None


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


# ---- compile ------------------------------------------------------------------------------------------------------------

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


@pytest.mark.skipif(not os.environ.get('DIFFQ_LAB_SLOW'), reason='inductor on CPU takes 20-80 s; set DIFFQ_LAB_SLOW=1')
def test_inductor_compiles_the_int8_transformer(pipes):
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['z-image']), transformer_quant='int8', compile=False, min_features=0)
    ref = render(pipe, steps=1)
    T.compile_transformer(pipe.transformer)
    cs = T.compile_stats(lambda: render(pipe, steps=1), runs=1)
    assert cs['recompiles'] == 0 and torch.allclose(cs['output'], ref, atol=5e-2)
