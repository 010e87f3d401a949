"""Block selection: per-block sensitivity and the keep-schedule search, on a real trained encoder, tiny encoders, a toy stack and a DiT.

The notebook (nbs/07_block_select.ipynb) holds the worked examples and their assertions; these tests add the properties,
faults, wiring and end-to-end runs it does not make."""
import copy, math, os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from torch import nn
from diffq_lab import block_select as bs
from diffq_lab import encoder_io as eio
from diffq_lab import family_blocks as fb
from diffq_lab import remedies as rm
from diffq_lab import lab_encoders as le
from diffq_lab.core import load_table, results_dir
from diffq_lab.capability import SchemeUnavailableError
from diffq_lab.filters import quantized_linears
from diffq_lab.pipelines import tiny_pipeline



# ---- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def mini():
    model, tok = eio.load_minilm()
    return model, tok, eio.encoder_inputs(tok, eio.load_prompts(n=4))


@pytest.fixture(scope='module')
def spiked(mini):
    model, tok, inp = mini
    hot = copy.deepcopy(model)
    bs.inject_outliers(hot, [0, 5])
    return hot


def out(model, inp):
    with torch.no_grad(): return model(**inp).last_hidden_state


def snapshot(model):
    return {f: m for f, m in model.named_modules()}


def assert_untouched(model, modules, inp=None, ref=None):
    assert quantized_linears(model) == []
    now = dict(model.named_modules())
    assert now.keys() == modules.keys() and all(now[f] is m for f, m in modules.items())
    if ref is not None: assert torch.equal(out(model, inp), ref)


def toy(depth, planted=()):
    return bs.toy_stack(depth, planted)


# ---- the judged behaviours --------------------------------------------------------------------------------------
def test_planted_first_and_last_blocks_are_found_exactly(mini, spiked):
    model, tok, inp = mini
    ref = out(spiked, inp)
    assert torch.equal(ref, out(model, inp))  # the planted outliers leave the dense function bit-identical
    mods = snapshot(spiked)
    ks = bs.find_keep_schedule(spiked, inp, 'int8', bar=0.99, min_features=256)
    assert ks.keep == (1, 1) and ks.ok, ks
    assert ks.full_cosine < 0.99 <= ks.cosine, ks
    assert set(ks.sensitivity.nsmallest(2, 'cosine').block) == {'encoder.layer.0', 'encoder.layer.5'}
    assert ks.forward_passes <= 1 + 3 * 6 + 2 * 3
    assert list(ks.curve.columns[:5]) == ['phase', 'keep_first', 'keep_last', 'dense_blocks', 'kept']
    assert ks.curve.clears.any() and not ks.curve.clears.all()
    assert_untouched(spiked, mods, inp, ref)


@pytest.mark.parametrize('planted', [(0, -1), (0,), (-1,)])
def test_toy_stack_finds_planted_blocks(planted):
    ks = bs.find_keep_schedule(*toy(8, planted), 'int8', bar=0.995)
    want = (1 if 0 in planted else 0, 1 if -1 in planted else 0)
    assert ks.keep == want, ks
    assert set(ks.sensitivity.nsmallest(len(planted), 'cosine').index) == {p % 8 for p in planted}


def test_search_cost_is_linear_in_depth():
    passes = {}
    for depth in (4, 8, 16):  # 32 and 64: the notebook's toy cell and the recorded keep_schedules table
        ks = bs.find_keep_schedule(*toy(depth, (0, -1)), 'int8', bar=0.995)
        assert ks.keep == (1, 1), (depth, ks)
        passes[depth] = ks.forward_passes
        assert passes[depth] <= 1 + 3 * depth + 2 * math.ceil(math.log2(depth)) + 2, (depth, passes[depth])
        no_rank = bs.find_keep_schedule(*toy(depth, (0, -1)), 'int8', bar=0.995, per_block=False)
        assert no_rank.keep == (1, 1) and no_rank.forward_passes <= 2 * depth + math.ceil(math.log2(depth)) + 3
    assert passes[16] / passes[4] < 5  # quadrupling the depth about quadruples the cost; all pairs would be ~10x


def test_reference_is_reused_and_configurations_memoised():
    calls, read = [], eio.encoder_run('last')
    def run(m, x): calls.append(1); return read(m, x)
    ks = bs.find_keep_schedule(*toy(6, (0, -1)), 'int8', bar=0.995, run_fn=run, fidelity_fn=bs.token_fidelity)
    assert ks.forward_passes == len(calls)
    every = set(range(6))
    cast = {frozenset(every - {int(k) for k in kept.split()}) for kept in ks.curve.kept} | {frozenset({p}) for p in ks.sensitivity.pos}
    assert len(calls) == 1 + len(cast - {frozenset()})  # one pass per distinct configuration, plus the reference once


def test_backend_is_the_capability_policy(mini, monkeypatch):
    "The backend is capability.resolve_backend's (the real path where it runs, else emulation); a GPU under 'auto' refuses."
    model, tok, inp = mini
    mods, ref = snapshot(model), out(model, inp)
    assert bs.block_sensitivity(model, inp, 'int8').attrs['backend'] == 'torchao'          # its CPU kernel runs
    assert bs.block_sensitivity(model, inp, 'fp8').attrs['backend'] == 'emulate'           # no CPU kernel: emulated
    lw = bs.block_sensitivity(model, inp, 'fp8_layerwise')                                 # diffusers' hook is its real path
    assert lw.attrs['backend'] == 'diffusers' and (lw.n_quantized == 6).all() and (lw.cosine > 0.99).all()
    assert_untouched(model, mods, inp, ref)
    passes = []
    def refuse(scheme, device): raise SchemeUnavailableError(f'{scheme} does not run on {device}')
    monkeypatch.setattr(bs, 'module_device', lambda m: torch.device('cuda'))
    real = bs.resolve_backend  # the policy refuses on a GPU when asked to (gpu_refuses): stand in for the GPU's failing probe
    monkeypatch.setattr(bs, 'resolve_backend', lambda s, b, d, gpu_refuses=False:
                        refuse(s, d) if gpu_refuses and d.type == 'cuda' else real(s, b, 'cpu'))
    run = lambda m, x: passes.append(1) or eio.encoder_run('last')(m, x)
    with pytest.raises(SchemeUnavailableError, match='fp8 does not run'): bs.find_keep_schedule(model, inp, 'fp8', run_fn=run)
    assert passes == []  # refused before any forward pass
    assert_untouched(model, mods, inp, ref)


# ---- filters, read layers, integrity ----------------------------------------------------------------------------
def test_filters_are_honoured(mini):
    model, tok, inp = mini
    sens = bs.block_sensitivity(model, inp, 'int8', exclude_tokens=('intermediate', 'output.dense'))
    assert (sens.n_quantized == 3).all()  # q, k, v left of each block
    ks = bs.find_keep_schedule(model, inp, 'int8', bar=0.9999, min_features=512)  # MiniLM is 384 wide: nothing qualifies
    assert ks.keep == (0, 0) and ks.full_cosine == pytest.approx(1.0, abs=1e-5) and ks.n_rest == 0
    assert ks.forward_passes == 1  # the reference only
    none = bs.block_sensitivity(model, inp, 'fp8wo', exclude_tokens='encoder')
    assert (none.n_quantized == 0).all() and none.attrs['forward_passes'] == 1
    rest = bs.find_keep_schedule(model, inp, 'int8', exclude_tokens='pooler')
    assert rest.n_rest == 0 and bs.find_keep_schedule(model, inp, 'int8', per_block=False).n_rest == 1


def test_read_layers(mini):
    model, tok, inp = mini
    last = bs.block_sensitivity(model, inp, 'int8', read_layer='last')
    early = bs.block_sensitivity(model, inp, 'int8', read_layer=3)  # hidden_states[3]: after block 2
    assert early.cosine.iloc[3:].min() == pytest.approx(1.0, abs=1e-5)  # blocks after the read layer cannot matter
    assert not early.cosine.equals(last.cosine)
    stacked = bs.find_keep_schedule(model, inp, 'int8', read_layer=(2, 4, 6), per_block=False)
    assert stacked.ok and stacked.read_layer == (2, 4, 6)
    pipe = tiny_pipeline('flux.2-dev', text_layers=4)  # FLUX.2 stacks layers 10, 20, 30: a 4-block encoder stacks 2, 3, 4
    rl = fb.family_read_layer('flux.2-dev', n_layers=4)
    assert rl == (2, 3, 4)
    enc_in = eio.encoder_inputs(pipe.tokenizer, eio.load_prompts(n=3))
    assert eio.encoder_run(rl)(pipe.text_encoder, enc_in).shape[-1] == 3 * pipe.text_encoder.config.text_config.hidden_size
    ks = bs.find_keep_schedule(pipe.text_encoder, enc_in, 'int8', bar=0.99, read_layer=rl)
    assert ks.ok and ks.n_blocks == 4  # the vision tower is no block stack


def test_model_is_dense_again_after_a_failure(mini):
    model, tok, inp = mini
    mods, ref = snapshot(model), out(model, inp)
    calls = []
    def flaky(m, x):
        calls.append(1)
        if len(calls) == 4: raise RuntimeError('device lost mid-search')
        return eio.encoder_run('last')(m, x)
    with pytest.raises(RuntimeError, match='device lost'): bs.find_keep_schedule(model, inp, 'int8', run_fn=flaky)
    assert_untouched(model, mods, inp, ref)


def test_bad_inputs(mini):
    model, tok, inp = mini
    for bar in (0, -0.5, 1.01, float('nan'), True, '0.99', None):
        with pytest.raises(ValueError, match=r'\(0, 1\]'): bs.find_keep_schedule(model, inp, bar=bar)
    with pytest.raises(ValueError, match='no nn.ModuleList'): bs.find_keep_schedule(nn.Sequential(nn.Linear(8, 8)), torch.ones(2, 8))
    with pytest.raises(ValueError, match='no nn.ModuleList'): bs.block_sensitivity(nn.Linear(8, 8), torch.ones(2, 8))
    with pytest.raises(ValueError, match='unknown read layer'): bs.find_keep_schedule(model, inp, read_layer='penultimate')
    with pytest.raises(ValueError, match='unknown read layer'): bs.block_sensitivity(model, inp, read_layer=(1.0,))
    with pytest.raises(ValueError, match='returns 7 hidden states'): bs.find_keep_schedule(model, inp, read_layer=(2, 7))
    with pytest.raises(ValueError, match='unknown scheme'): bs.find_keep_schedule(model, inp, scheme='int4x')
    with pytest.raises(ValueError, match='concrete scheme'): bs.find_keep_schedule(model, inp, scheme='auto')
    with pytest.raises(ValueError, match='unknown backend'): bs.block_sensitivity(model, inp, backend='cuda')
    with pytest.raises(ValueError, match='non-empty'): bs.block_sensitivity(model, inp, exclude_tokens=('', 'x'))
    with pytest.raises(ValueError, match='min_features'): bs.block_sensitivity(model, inp, min_features=-1)
    with pytest.raises(ValueError, match='run_fn must be callable'): bs.block_sensitivity(model, inp, run_fn=3)
    with pytest.raises(ValueError, match='nn.Module'): bs.find_keep_schedule('bert', inp)
    with pytest.raises(ValueError, match='unknown blocks'): bs.measure_schedule(model, inp, ['encoder.layer.6'])
    with pytest.raises(ValueError, match='unknown block'): bs.inject_outliers(copy.deepcopy(model), [6])
    with pytest.raises(ValueError, match='two ints'): bs.schedule_blocks(model, 1, -2)
    with pytest.raises(ValueError, match='no encoder'): fb.family_read_layer('z-image', 'text_encoder_3')
    with pytest.raises(ValueError, match='at least one prompt'): eio.encoder_inputs(tok, [])
    with pytest.raises(FileNotFoundError, match='no prompt set'): eio.load_prompts('/nonexistent/prompts.txt')
    assert quantized_linears(model) == []


# ---- the DiT ----------------------------------------------------------------------------------------------------
def test_dit_block_stack_with_replayed_calls():
    pipe = tiny_pipeline('z-image')
    calls = fb.dit_calls(pipe, steps=2)
    assert len(calls) == 2
    dit = copy.deepcopy(pipe.transformer)
    mods = snapshot(dit)
    ref = fb.replay_run(dit, calls)
    bs.inject_outliers(dit, ['layers.1'])
    assert bs.flat_fidelity(ref, fb.replay_run(dit, calls))['cosine'] == pytest.approx(1.0, abs=1e-3)  # bf16 rounding only
    ks = bs.find_keep_schedule(dit, calls, 'int8', bar=0.999, run_fn=fb.replay_run)
    assert ks.sensitivity.nsmallest(1, 'cosine').block.item() == 'layers.1'
    assert ks.ok and 'layers.1' in bs.schedule_blocks(dit, *ks.keep), ks
    assert ks.n_rest > 0 and ks.read_layer == 'run_fn'
    assert quantized_linears(dit) == [] and all(dict(dit.named_modules())[f] is m for f, m in mods.items())


# ---- wiring -----------------------------------------------------------------------------------------------------
def test_schedule_for_family(mini, spiked):
    model, tok, inp = mini
    fs = fb.schedule_for_family('qwen-image', encoder=fb.EncoderSource(spiked, tok, name='spiked'), prompts=eio.load_prompts(n=4))
    assert fs.keep == (1, 1) and fs.cosine >= 0.99
    entry = fs.as_family()
    assert entry.keep_bf16 == (1, 1) and entry.keep_bf16_cosine == round(fs.cosine, 4)
    assert 'schedule_for_family' in entry.sources['keep_bf16']
    fp8 = fb.schedule_for_family('qwen-image', 'fp8', encoder=fb.EncoderSource(spiked, tok), prompts=eio.load_prompts(n=2),
                                 backend='emulate')
    with pytest.raises(ValueError, match='int8 schedule'): fp8.as_family()
    multi = fb.schedule_for_family('sd3', encoder=fb.EncoderSource(text_layers=2), prompts=eio.load_prompts(n=3))
    assert set(multi.schedules) == {'text_encoder', 'text_encoder_2', 'text_encoder_3'}
    assert multi.schedules['text_encoder'].read_layer == -2 and multi.schedules['text_encoder_3'].read_layer == 'last'


def test_policy_and_probe_settings_are_one_call(mini):
    "A QuantPolicy / Probe passed whole and the same fields passed as keywords give the same measurement."
    from diffq_lab.policy import QuantPolicy
    model, tok, inp = mini
    by_kw = bs.measure_schedule(model, inp, (1, 0), 'int8', read_layer=3, min_features=256, exclude_tokens='pooler')
    whole = bs.measure_schedule(model, inp, (1, 0), 'int8', probe=bs.Probe(read_layer=3, exclude_tokens='pooler'),
                                policy=QuantPolicy(min_features=256))
    assert by_kw == whole and by_kw['cosine'] < 1
    floor = bs.measure_schedule(model, inp, (0, 0), 'int8', policy=QuantPolicy(min_features=512))  # 384 wide: none cast
    assert floor['cosine'] == 1.0 and floor['forward_passes'] == 1
    with pytest.raises(ValueError, match='Probe fields'): bs.find_keep_schedule(model, inp, read_layers=3)
    with pytest.raises(ValueError, match='probe must be a Probe'): bs.block_sensitivity(model, inp, 'int8', 'last')
    with pytest.raises(ValueError, match='EncoderSource'): fb.schedule_for_family('qwen-image', encoder=model)


def test_token_fidelity_is_embedding_cosine_over_real_tokens(mini):
    "The twin is gone: token_fidelity's cosines are text_encoder.embedding_cosine of the real (unmasked) tokens, in fp64."
    from diffq_lab.text_encoder import embedding_cosine
    model, tok, inp = mini
    with torch.no_grad(): ref = model(**inp).last_hidden_state.float()
    out = ref + 0.05 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(0))
    live = inp['attention_mask'].bool()
    assert not live.all()  # padding present: the mask matters
    tf, ec = bs.token_fidelity(ref, out, inp), embedding_cosine([ref[live].double()], [out[live].double()])
    assert (tf['cosine'], tf['cosine_min']) == (ec['cosine'], ec['cosine_min'])
    assert tf['cosine'] != embedding_cosine([ref.double()], [out.double()])['cosine']  # the padded tokens left out
    from diffq_lab import text_encoder as TE
    assert 'token_cosines' in bs.token_fidelity.__code__.co_names  # one per-token cosine, shared with embedding_cosine
    assert 'token_cosines' in TE.embedding_cosine.__code__.co_names
    c = TE.token_cosines([ref[live].double()], [out[live].double()])
    assert tf['cosine_p01'] == torch.quantile(c, 0.01).item() and tf['cosine_min'] <= tf['cosine_p01'] <= tf['cosine']
    b, t = tf['worst_prompt'], tf['worst_pos']  # the worst token, found again from its prompt and its position
    assert torch.cosine_similarity(ref[b, t].double(), out[b, t].double(), dim=0).item() == pytest.approx(tf['cosine_min'])


def test_cli_blocks(tmp_path):
    txt = rm.cli_blocks('minilm', 'int8', 0.99, min_features=256, n_prompts=3, n_calib=8)
    assert txt.splitlines()[0] == '# diffq-lab blocks: all-MiniLM-L6-v2 (BertModel), 3 prompts, read \'last\', min_features 256'
    assert 'keep first' in txt and '| phase' in txt and '| smoothquant ' in txt  # the remedies, as on a real encoder
    # a diffusers-style folder: the encoder in text_encoder/, its tokenizer in the sibling tokenizer/
    pipe = tiny_pipeline('sana', text_layers=2)
    pipe.text_encoder.save_pretrained(tmp_path/'text_encoder')
    pipe.tokenizer.save_pretrained(tmp_path/'tokenizer')
    ptxt = rm.cli_blocks(str(tmp_path/'text_encoder'), 'nvfp4wo', 0.9, n_prompts=2, read_layer='-1')
    assert 'Gemma2Model' in ptxt and "read -1" in ptxt
    ftxt = rm.cli_blocks('wan', 'int8', 0.99, n_prompts=2)
    assert 'wan2.1' in ftxt and 'registry int8 schedule' in ftxt
    with pytest.raises(ValueError, match='neither a folder'): rm.cli_blocks('not-a-family')
    with pytest.raises(ValueError, match=r'\(0, 1\]'): rm.cli_blocks('minilm', bar=0)


def test_record_writes_only_where_told(tmp_path):
    committed = results_dir()
    before = {p.name: p.stat().st_mtime for p in committed.glob('*.csv')}
    sens, sched = le.record_block_selection(root=tmp_path, prompts=eio.load_prompts(n=2), schemes=('int8',), bars=(0.99,),
                                            families=('z-image',), depths=(6,), toy_depths=(4,))
    assert {p.name for p in tmp_path.iterdir()} == {'block_sensitivity.csv', 'keep_schedules.csv'}
    table = load_table('keep_schedules', tmp_path)
    assert len(table) == len(sched) and {'keep_first', 'keep_last', 'cosine', 'forward_passes', 'device_name', 'torch'} <= set(table)
    assert set(table.weights) == {'trained', 'trained, spiked', 'trained, repeated, spiked', 'random', 'synthetic'}
    assert len(load_table('block_sensitivity', tmp_path)) == len(sens) > 0
    assert {p.name: p.stat().st_mtime for p in committed.glob('*.csv')} == before


def test_blocks_never_says_clears_below_the_worst_bar(tmp_path):
    "A bar the all-cast encoder clears on the mean but misses on the worst token: no row, verdict or schedule says it clears."
    pipe = tiny_pipeline('z-image')
    pipe.text_encoder.save_pretrained(tmp_path/'enc'); pipe.tokenizer.save_pretrained(tmp_path/'enc')
    kw = dict(prompts=eio.prompt_set()[0][:6], read_layer=-2, n_calib=8)
    full = rm.encoder_remedy(pipe.text_encoder, pipe.tokenizer, 'int8', 0.5, worst_bar=-1, **kw).iloc[0]  # all cast
    bar, wb = float(full.cosine) - 1e-6, (float(full.cosine_min) + 1) / 2  # the mean clears, the worst token does not
    df = rm.encoder_remedy(pipe.text_encoder, pipe.tokenizer, 'int8', bar, worst_bar=wb, **kw)
    assert df.cosine.iloc[0] >= bar and not df.clears.iloc[0]
    assert (df.clears == ((df.cosine >= bar) & (df.cosine_min >= wb))).all() and (df[df.chosen].cosine_min >= wb).all()
    ks = df.attrs['keep_schedule']
    assert ks.keep != (0, 0) and (not ks.ok or ks.cosine_min >= wb)  # the block search: both bars too
    txt = rm.cli_blocks(str(tmp_path/'enc'), 'int8', bar, worst_bar=wb, read_layer='-2', n_prompts=6, n_calib=8)
    verdict = txt.splitlines()[2]
    assert verdict == rm.remedy_verdict(df) and not verdict.split(': ', 2)[-1].startswith('all cast')
    for r in df.itertuples():  # each printed candidate says clears exactly where both bars hold
        line = next(l for l in txt.splitlines() if l.startswith(f'| {r.remedy} '))
        assert [c.strip() for c in line.split('|')][7] == str(bool(r.cosine >= bar and r.cosine_min >= wb))
