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
    'recommend': _module('recommend', 'record_recommendations', bar=40.0),
    'study': lambda: __import__('diffq_lab.cli', fromlist=['main']).main(['study', '--device', 'cpu', '--full', '--record']),
}

if __name__ == '__main__':
    names = sys.argv[1:] or list(TABLES)
    unknown = [n for n in names if n not in TABLES]
    if unknown: sys.exit(f'unknown table(s) {unknown}; choose from {list(TABLES)}')
    for n in names:
        t0 = time.perf_counter()
        TABLES[n]()
        print(f'recorded {n} in {time.perf_counter() - t0:.0f} s', flush=True)
