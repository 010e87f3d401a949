"""One test per seed rule (unsloth studio's diffusion_precision.py, diffu's quantize.py): a seed's setting reproduces the
seed's decision on the tiny families."""
import copy, os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from torch import nn
import diffq_lab.loader as G
from diffq_lab.schemes import normalize_scheme, vocabulary_table
from diffq_lab.text_encoder import ENCODER_MIN_FEATURES, encoder_min_features, plan_encoder, plan_text_encoders, select_encoder_scheme


def _load(pipe, **kw):
    return G.load_pipeline_quantized(copy.deepcopy(pipe), compile=False, min_features=0, **kw)


@pytest.mark.parametrize('name,lab', [('fp8', 'fp8_layerwise'), ('fp8_dynamic', 'fp8'), ('nvfp4', 'nvfp4wo')])
def test_unsloth_text_encoder_names(pipes, name, lab):
    "unsloth's fp8 is the layerwise storage cast, fp8_dynamic the dynamic one, nvfp4 weight-only."
    _, st = _load(pipes['z-image'], te_quant=name, vocabulary='unsloth-te')
    assert st['quant_plan'].components['text_encoder'].scheme == lab


def test_unsloth_fp8_on_ltx2_is_allowed_as_in_the_seed(pipes):
    "The lab denies fp8 dynamic on ltx-2's encoder; unsloth's fp8 (layerwise) is allowed there, as in the seed."
    _, lab = _load(pipes['z-image'], family='ltx-2', te_quant='fp8')
    assert 'denied for ltx-2' in lab['te_fallback_reason']
    _, seed = _load(pipes['z-image'], family='ltx-2', te_quant='fp8', vocabulary='unsloth-te')
    assert seed['te_fallback_reason'] == '' and seed['quant_plan'].components['text_encoder'].scheme == 'fp8_layerwise'


@pytest.mark.parametrize('name,lab', [('int8', 'int8wo'), ('fp8', 'fp8wo'), ('int8dq', 'int8'), ('fp8dq', 'fp8')])
def test_diffu_transformer_names(pipes, name, lab):
    "diffu's int8 and fp8 are weight-only, int8dq and fp8dq dynamic."
    _, st = _load(pipes['z-image'], transformer_quant=name, vocabulary='diffu')
    assert st['quant_plan'].components['transformer'].scheme == lab


def test_a_name_the_vocabularies_disagree_on_is_read_in_the_named_one():
    assert set(vocabulary_table().query('ambiguous').name) == {'fp8', 'int8', 'nvfp4'}
    assert {normalize_scheme('fp8'), normalize_scheme('fp8', 'unsloth-te'), normalize_scheme('fp8', 'diffu')} == {'fp8', 'fp8_layerwise', 'fp8wo'}
    with pytest.raises(ValueError, match='not a diffu name'): normalize_scheme('nvfp4', 'diffu')


def test_an_unavailable_explicit_scheme_leaves_the_encoder_dense(pipes):
    "The seed's contract: the default path cannot regress (mxfp8 has no kernel on this CPU, forced to torchao)."
    out, st = _load(pipes['z-image'], te_quant='mxfp8', backend='torchao')
    assert st['te_fallback_reason'] and G.engaged(out)['text_encoder']['path'] == 'dense'


def test_encoder_min_features_512_on_a_real_encoder_0_on_a_tiny_one(pipes):
    "ByT5's 1472 -> 384 projection stays dense in a real-width encoder; the tiny test encoders (< 512 wide) are the exception."
    byt5ish = nn.Sequential(nn.Linear(1472, 1472), nn.Linear(1472, 384)).to(torch.bfloat16)
    assert encoder_min_features(byt5ish) == ENCODER_MIN_FEATURES == 512
    assert plan_encoder(byt5ish, 'int8wo', device='cpu').quantized == ['0']
    assert encoder_min_features(pipes['z-image'].text_encoder) == 0
    assert plan_encoder(pipes['z-image'].text_encoder, 'int8wo', device='cpu').n_quantized > 0


def test_torchao_encoder_modes_need_bf16(pipes):
    fp32 = copy.deepcopy(pipes['z-image']); fp32.text_encoder.float()
    with pytest.raises(ValueError, match='needs bf16 text encoders'): plan_text_encoders(fp32, 'int8wo', device='cpu')
    assert plan_text_encoders(fp32, 'fp8_layerwise', device='cpu').components['text_encoder'].n_quantized > 0  # a cast, any dtype
    _, st = G.load_pipeline_quantized(fp32, compile=False, te_quant='int8wo')
    assert 'needs bf16' in st['te_fallback_reason']


@pytest.mark.parametrize('family,dense', [('wan2.2-t2v-a14b', True), ('hunyuanvideo-1.5-720p', True), ('hunyuanvideo-1.5', True),
                                          ('wan2.2-ti2v-5b', False), ('ltx-2', False)])
def test_auto_keeps_the_seeds_dense_families_dense(family, dense):
    s, note = select_encoder_scheme('auto', family, device='cpu')
    assert (s is None) == dense, (s, note)
