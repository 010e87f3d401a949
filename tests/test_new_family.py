"""A new family is its registry entry: registered here (a throwaway Z-Image at 64 wide, its own input recipe), it renders,
plans, passes memory's preflight and gets a speed prediction with no other edit, and leaves the registry as it was."""
import os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
from diffq_lab import pipelines as P
from diffq_lab.pipelines import FAMILIES, Family, get_family, register_family, unregister_family

NAME = 'toy-dit'
CALLS = []  # the token grids the family's own recipe was asked for


def _inputs(c, t, grid, T, B):
    "Z-Image's forward kwargs, noting that this family's recipe (not a class-name lookup) built them."
    CALLS.append(tuple(grid))
    return P._zimage_inputs(c, t, grid, T, B)


@pytest.fixture(scope='module')
def toy():
    from diffq_lab.parts import tiny_z_image
    qwen = dict(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16)
    f = register_family(Family(
        NAME, 'ZImagePipeline', 'nobody/toy-dit', ('text_encoder',), ('Qwen3Model',), aliases=('toy',),
        denoiser='ZImageTransformer2DModel', inputs=_inputs, tiny_m=(('t_embedder',), ('adaLN_modulation',)),
        denoiser_dims=dict(dim=64, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                           axes_dims=[8, 12, 12]),
        dims_source='a throwaway: Z-Image at 64 wide', text_tokens=16, tiny=lambda **k: tiny_z_image(**k),
        real_dims=dict(text_encoder=('transformers', 'Qwen3Model', qwen), vae=('diffusers', 'AutoencoderKL', {}),
                       tokenizer='qwen')))
    yield f
    assert unregister_family(NAME) is f
    assert NAME not in FAMILIES and 'toy' not in P._ALIASES  # the registry as it was: every spelling gone


def test_it_is_found_by_name_and_alias(toy):
    from diffq_lab.meta import get_model
    assert get_family('Toy') is toy and FAMILIES[NAME] is toy and get_model('toy') is toy  # real dims: memory, speed
    with pytest.raises(ValueError, match='already registered'): register_family(toy)


def test_it_renders(toy):
    import torch
    from diffq_lab.pipelines import render, tiny_pipeline
    img = render(tiny_pipeline(NAME), 'a red fox in the snow', steps=1)
    assert torch.isfinite(img).all()


def test_it_plans(toy):
    from diffq_lab.export import plan_pipeline
    plan = plan_pipeline(NAME, 'int8', 'int8', min_features=0)
    assert set(plan.components) == {'transformer', 'text_encoder'}
    assert all(c.n_quantized > 0 for c in plan.components.values())
    # a floor per role: the encoders' (every Linear here is under 64 wide on one side) leaves the denoiser's alone
    split = plan_pipeline(NAME, 'int8', 'int8', min_features=0, te_min_features=64).components
    assert split['text_encoder'].n_quantized == 0 and split['transformer'].quantized == plan.components['transformer'].quantized


def test_memory_preflight_traces_it_with_its_own_recipe(toy):
    from diffq_lab.memory import plan_memory
    CALLS.clear()
    mp = plan_memory(NAME, 'int8', 'cpu', free_bytes=1 << 30, size=256)
    assert mp.family == NAME and mp.quantized_linears > 0 and mp.activation_bytes > 0
    assert CALLS == [(1, 16, 16)]


def test_the_speed_model_predicts_it(toy):
    from diffq_lab.speed import predict
    CALLS.clear()
    rows = predict('h100', NAME, ('bf16', 'int8'), size=512, intervals=False)
    assert [r['model'] for r in rows] == [NAME, NAME] and all(r['seconds'] > 0 for r in rows)
    assert CALLS == [(1, 32, 32)]  # a new size: one fresh trace of the denoiser, fed by the family's recipe
