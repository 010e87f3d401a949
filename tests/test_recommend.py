"""recommend_plan: the plan (rank variants in it) clears its bar re-measured in a fresh process; never predicted slower than a uniform plan that clears
it; planted sensitivity stays dense or 8-bit; the plan exports to diffusers; its text encoder gets the remedy `blocks` chooses; bad input refused."""
import json, os, subprocess, sys, textwrap
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from diffq_lab.gpus import gpu_spec
from diffq_lab.speed import Workload
from diffq_lab.pipelines import tiny_pipeline
from diffq_lab.plan import to_pipeline_config
from diffq_lab.recommend import (EncoderBar, RealTarget, RenderWork, gpu_formats, plan_chain, recommend_encoders,
                                 recommend_plan, resolution, settle)

PAIRS = [(0, 'a photo of a cat'), (1, 'a red circle')]
PLANT = '''
def plant(pipe, block, channels=(3, 17), gain=200.0):
    b = pipe.transformer.get_submodule(block)
    with torch.no_grad():
        for c in channels:
            b.ffn_norm1.weight[c] *= gain
            for f in ('w1', 'w3'): getattr(b.feed_forward, f).weight[:, c] /= gain
    return [f'{block}.feed_forward.w1', f'{block}.feed_forward.w3']
'''
exec(PLANT)


@pytest.fixture(scope='module')
def planted_rec():
    pipe = tiny_pipeline('z-image')
    hot = plant(pipe, 'noise_refiner.0') + plant(pipe, 'layers.0')
    spec = {**gpu_spec('b200'), 'gpu': 'fp4-heavy what-if', 'fp4_tflops': 8 * 9000.0}
    target = RealTarget(work=Workload(size=2048))
    # the search's own plan (simplest=False): with the fitted FP4 path its gain over uniform fp8 is inside the model's error
    # one branch rank beside the plain formats: the fresh-process check then loads a plan naming a rank variant
    return pipe, hot, recommend_plan(pipe, spec, 28.0, RenderWork(PAIRS, device='cpu'), target, simplest=False, ranks=(16,))


def test_planted_sensitivity_stays_dense_or_8_bit(planted_rec):
    _, hot, rec = planted_rec
    assert all(rec.choice[f] in ('bf16', 'int8', 'fp8', 'mxfp8') for f in hot), {f: rec.choice[f] for f in hot}
    assert 'nvfp4_lr16' in rec.choice.values()


def test_never_predicted_slower_than_a_uniform_plan_that_clears(planted_rec):
    _, _, rec = planted_rec
    uni = rec.table[rec.table.source.str.startswith('uniform') & rec.table.clears]
    assert rec.clears and (uni.empty or rec.predicted_s <= uni.time_s.min())


def test_the_plan_clears_its_bar_in_a_fresh_process(planted_rec, tmp_path):
    _, _, rec = planted_rec
    rec.plan.save(tmp_path/'plan.json')
    code = PLANT + textwrap.dedent(f'''
        import math, torch
        from diffq_lab.pipelines import tiny_pipeline, render
        from diffq_lab.plan import QuantPlan, apply_plan
        from diffq_lab.quality import psnr
        torch.set_num_threads(1)
        dense = tiny_pipeline('z-image'); plant(dense, 'noise_refiner.0'); plant(dense, 'layers.0')
        q = tiny_pipeline('z-image'); plant(q, 'noise_refiner.0'); plant(q, 'layers.0')
        apply_plan(q, QuantPlan.load({str(tmp_path/'plan.json')!r}))
        vals = [psnr(render(q, p, steps=2, size=32, seed=s), render(dense, p, steps=2, size=32, seed=s)) for s, p in {PAIRS!r}]
        print(sum(vals) / len(vals))
    ''')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert out.returncode == 0, out.stderr[-2000:]
    again = float(out.stdout.strip().splitlines()[-1])
    assert again >= rec.bar and abs(again - rec.psnr) < 1e-6, (again, rec.psnr)


def test_the_plan_exports_to_diffusers_where_torchao_carries_it(planted_rec):
    "A low-rank Linear is nunchaku's kernel, no torchao config: refused in one line; the same plan without the branch exports."
    from diffq_lab.plan import QuantPlan
    from diffq_lab.policy import as_policy
    from diffq_lab.recommend import _plan_for
    pipe, _, rec = planted_rec
    with pytest.raises(ValueError, match='apply_plan'): to_pipeline_config(rec.plan)
    choice = {f: 'nvfp4' if s == 'nvfp4_lr16' else s for f, s in rec.choice.items()}
    plan = QuantPlan({'transformer': _plan_for(pipe.transformer, choice, as_policy(None), 'cpu')})
    cfg = to_pipeline_config(plan).quant_mapping['transformer']
    assert type(cfg.quant_type).__name__ == 'FqnToConfig' and len(cfg.quant_type.fqn_to_config) == plan.components['transformer'].n_quantized


def test_the_chain_runs_from_fastest_to_dense():
    opts = {'a': {'bf16': (3.0, 0.0), 'fp8': (1.0, 0.2)}, 'b': {'bf16': (3.0, 0.0), 'fp8': (2.0, 0.001)}}
    chain = plan_chain(opts)
    assert chain[0] == {'a': 'fp8', 'b': 'fp8'} and chain[-1] == {'a': 'bf16', 'b': 'bf16'} and chain[1] == {'a': 'bf16', 'b': 'fp8'}


@pytest.mark.parametrize('kw,work,match', [(dict(bar=0), {}, 'PSNR'), (dict(bar=float('nan')), {}, 'PSNR'),
                                           (dict(bar=30), dict(steps=0), 'steps'), (dict(bar=30), dict(pairs=[]), 'pair'),
                                           (dict(bar=30, gpu='tpu-v5'), {}, 'unknown gpu'),
                                           (dict(bar=30, backend='cuda'), {}, 'unknown backend'),
                                           (dict(bar=30, min_feature=0), {}, 'QuantPolicy fields')])
def test_bad_input_is_refused(pipes, kw, work, match):
    kw = {'gpu': 'b200', **kw}
    with pytest.raises(ValueError, match=match):  # refused before any work
        recommend_plan(pipes['z-image'], kw.pop('gpu'), renders=RenderWork(**work), **kw)


def test_a_gpu_without_low_precision_cores_is_refused(pipes):
    v100ish = {'gpu': 'v100-ish', 'bf16_tflops': 120.0, 'mem_bw_tbs': 0.9}
    assert gpu_formats(v100ish) == ()
    with pytest.raises(ValueError, match='no low-precision format'): recommend_plan(pipes['z-image'], v100ish, bar=30)


def test_low_rank_formats_are_offered_where_their_gemm_is_timed():
    assert gpu_formats('b200') == ('int8', 'fp8', 'mxfp8', 'nvfp4', 'nvfp4_lr8', 'nvfp4_lr16', 'nvfp4_lr')
    assert gpu_formats('rtx4090', ranks=(8, 32)) == ('int8', 'fp8', 'int4_lr8', 'int4_lr')
    assert gpu_formats('h200') == ('int8', 'fp8') and gpu_formats('b200', ranks=()) == ('int8', 'fp8', 'mxfp8', 'nvfp4')


def test_a_low_rank_plan_only_where_it_beats_8_bit_beyond_the_resolution():
    r, row = resolution(), lambda t, db: dict(time_s=t, psnr=db, clears=db >= 40)
    u = {'int8': row(1.0, 45.0), 'nvfp4_lr16': row(1.0 / r ** 0.5, 48.0)}   # better-rendering, faster inside the resolution
    assert settle(1.0 / r ** 0.9, u) == 'int8' and settle(0.9 / r, u) is None
    assert settle(0.99, {**u, 'nvfp4_lr16': row(0.9 / r, 41.0)}) == 'nvfp4_lr16'


# strict bars on the tiny encoder (random weights: its int8 error is small), where all cast fails and the candidates differ
ENC_BAR = (0.99995, 0.9999)


def _kept(comp):
    return sorted(f for f, r in comp.skipped.items() if r == 'kept bf16 by the remedy')


def test_recommend_and_blocks_choose_the_same_encoder_remedy(pipes, tmp_path):
    "The same encoder, prompts and bars: recommend's encoder plan is the remedy `diffq-lab blocks` prints as chosen."
    from diffq_lab.encoder_io import prompt_set
    from diffq_lab.remedies import cli_blocks, remedy_verdict
    pipe, (bar, wb) = pipes['z-image'], ENC_BAR
    plan, tabs = recommend_encoders(pipe, 'int8', EncoderBar(bar, wb, tuple(prompt_set()[0][:6]), -2, n_calib=8))
    df, comp = tabs['text_encoder'], plan.components['text_encoder']
    assert df.n_low.nunique() > 1 and not df.clears.iloc[0]  # all cast fails: the choice is not trivial
    pipe.text_encoder.save_pretrained(tmp_path/'enc'); pipe.tokenizer.save_pretrained(tmp_path/'enc')
    txt = cli_blocks(str(tmp_path/'enc'), 'int8', bar, worst_bar=wb, read_layer='-2', n_prompts=6, n_calib=8)
    chosen = df[df.chosen].iloc[0]
    assert remedy_verdict(df) in txt.splitlines() and f'clears with {chosen.n_low} of 14' in txt
    assert comp.n_quantized == chosen.n_low and len(_kept(comp)) == 14 - chosen.n_low
    assert (comp.smoothing is not None) == chosen.remedy.startswith('smoothquant')


def test_recommend_plan_carries_the_encoder_remedy(planted_rec):
    "recommend_plan with te_scheme: the encoder's plan is `recommend_encoders`' and its summary says what blocks would."
    from diffq_lab.encoder_io import prompt_set
    from diffq_lab.remedies import remedy_verdict
    pipe, _, rec = planted_rec
    eb = EncoderBar(*ENC_BAR, tuple(prompt_set()[0][:6]), -2, n_calib=8)
    got = recommend_plan(pipe, 'h200', 20.0, RenderWork(PAIRS[:1], steps=1, device='cpu'), te_scheme='int8', te_bar=eb,
                         ranks=(), sensitivity=rec.sensitivity)  # the DiT's errors measured already: renders only
    df, te = got.te_remedies['text_encoder'], got.plan.components['text_encoder']
    chosen = df[df.chosen].iloc[0]
    assert te.n_quantized == chosen.n_low < 14 and len(_kept(te)) == 14 - chosen.n_low  # the chosen remedy, not the rules'
    assert f'text_encoder: {remedy_verdict(df)}' in got.summary() and not df.clears.iloc[0]
    with pytest.raises(ValueError, match='EncoderBar'): recommend_plan(pipe, 'h200', 20.0, te_scheme='int8', te_bar=0.99)


def test_recommend_encoders_reads_min_features_as_the_encoders_floor():
    "The encoders planned alone: a policy's `min_features` is their floor (as documented), not dropped for the denoisers'."
    from diffq_lab.pipelines import tiny_pipeline
    from diffq_lab.policy import QuantPolicy
    from diffq_lab.recommend import recommend_encoders
    pipe = tiny_pipeline('z-image')  # planned, never cast: one pipeline serves every floor
    plan = lambda mf: recommend_encoders(pipe, 'fp8_layerwise', None, policy=QuantPolicy(min_features=mf))[0]
    wide, none = plan(0).components['text_encoder'], plan(10**6).components['text_encoder']
    assert wide.n_quantized > 0 and none.n_quantized == 0, (wide.summary(), none.summary())
    assert plan(None).components['text_encoder'].n_quantized == wide.n_quantized  # tiny: by width, every Linear
