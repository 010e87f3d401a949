"diffq_lab.transformer: the tiny-M tokens against the forward in every family, real-dims plans on the meta device, per-block compile."
import copy, os, warnings
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from torch import nn

import diffq_lab.transformer as T
from diffq_lab.loader import load_pipeline_quantized
from diffq_lab.pipelines import TINY_FAMILIES, get_family, render, tiny_pipeline
from diffq_lab.policy import QuantPolicy
from diffq_lab.filters import quantized_linears
from diffq_lab.transformer import denoisers, plan_transformer, quantize_transformer

warnings.filterwarnings('ignore', message='.*Tensor objects.*')


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


@pytest.mark.parametrize('family', TINY_FAMILIES)
def test_the_width_floor_and_backend_are_the_policys(pipes, family):
    "A tiny denoiser (32-64 wide) plans as at min_features=0; a policy or keyword settings set floor and backend."
    for mod in denoisers(pipes[family]).values():
        assert plan_transformer(mod, 'int8').quantized == plan_transformer(mod, 'int8', min_features=0).quantized
        assert plan_transformer(mod, 'int8', policy=QuantPolicy(min_features=512)).n_quantized == 0
        emu = plan_transformer(mod, 'int8', policy=QuantPolicy(backend='emulate'))
        assert emu.quantized and {emu.linears[f].backend for f in emu.quantized} == {'emulate'}, family
        over = plan_transformer(mod, 'int8', policy=QuantPolicy(backend='emulate'), backend='torchao')  # settings win
        assert {over.linears[f].backend for f in over.quantized} == {'torchao'}
        with pytest.raises(ValueError, match='QuantPolicy fields'): plan_transformer(mod, 'int8', min_feature=0)
        with pytest.raises(ValueError, match='QuantPolicy'): T.transformer_filter(mod, 'int8', 512)


def test_real_dims_z_image_plans_every_scheme_on_meta():
    "int8's 239/276 is 08_transformer's; the other schemes plan the same Linears at real dims, and nothing is converted."
    with torch.device('meta'):
        import diffusers
        z = diffusers.ZImageTransformer2DModel().to(torch.bfloat16)  # as loaded: fp8 and MX require bf16 weights
    for s in ('int8wo', 'fp8', 'fp8wo', 'nvfp4', 'mxfp8', 'fp8_layerwise'):
        rep = plan_transformer(z, s)
        assert (rep.n_quantized, rep.n_linear, rep.scheme) == (239, 276, s), s
    assert quantized_linears(z) == [] and all(p.device.type == 'meta' for p in z.parameters())
    assert plan_transformer(z.float(), 'fp8').skipped['layers.0.attention.to_q'] == 'not bf16'


def test_flux_activation_schemes_skip_modulation_weight_only_keep_it():
    with torch.device('meta'):
        import diffusers
        flux = diffusers.FluxTransformer2DModel(guidance_embeds=True).to(torch.bfloat16)
    int8, wo = (plan_transformer(flux, s) for s in ('int8', 'int8wo'))
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


def test_per_block_compile_after_quantisation(pipes):
    "SD3 declares no _repeated_blocks: each top-level block compiles alone (08_transformer renders the repeated-blocks path)."
    pipe, st = load_pipeline_quantized(copy.deepcopy(pipes['sd3']), transformer_quant='int8', compile=False, min_features=0)
    assert st.path == 'quant', st
    ref = render(pipe, steps=1)
    rep = T.compile_transformer(pipe.transformer, backend='eager')
    assert rep.method == 'per_block' and len(rep.regions) == pipe.transformer.config.num_layers
    cs = T.compile_stats(lambda: render(pipe, steps=1), runs=1)
    assert cs['frames_first_call'] >= len(rep.block_classes) and cs['recompiles'] == 0
    assert torch.allclose(cs['output'], ref, atol=1e-2)
    with pytest.raises(ValueError, match='already compiled'): quantize_transformer(pipe.transformer, 'int8', min_features=0)
    with pytest.raises(ValueError, match='already compiled'): T.compile_transformer(pipe.transformer)
