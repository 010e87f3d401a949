"""Run notebooks' test cells (and pytest files) under many seeds, and report how many seeds pass.

    python tools/seed_sweep.py [--seeds N] [--first K] [--budget S] [--json FILE] nbs/02_emulate.ipynb tests/test_emulate.py ...

Seed k changes every draw the tests make, and nothing the library seeds itself:
- a notebook is run in-process as `nbdev_test` runs it (same skipped flags), once per seed, in one child process per
  notebook: the global generators of torch, numpy and `random` start from k, and every seed a test cell sets itself
  (`torch.manual_seed(s)`, `np.random.seed(s)`, `np.random.default_rng(s)`, `random.seed(s)`, called from cell code)
  becomes s + k. Library code (`diffq_lab/*.py`) keeps its seeds (a render's, a builder's);
  `torch.Generator().manual_seed(s)` in a cell is not varied.
- a pytest file is run once per seed with `DIFFQ_LAB_SEED=k`, which tests/conftest.py reads: every test starts from
  seed k, and seeds a test sets itself are offset by k.
Seed 0 is what `nbdev_test` and `pytest` run. Prints one line per file (passed/run, failing seeds and their first error)."""
import argparse, contextlib, io, json, os, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _offset(real, k: int):
    "`real(seed)` with `seed + k` when called from notebook cell code (frames compiled from '<...>'), else unchanged."
    def seed(s=None, *args, **kwargs):
        cell = sys._getframe(1).f_code.co_filename.startswith('<')
        return real(s + k if cell and isinstance(s, int) and not isinstance(s, bool) else s, *args, **kwargs)
    seed.__wrapped__ = real
    return seed


@contextlib.contextmanager
def seeded(k: int):
    "Global generators at seed `k`, and cell-set seeds offset by `k`, for the block."
    import random
    import numpy as np
    import torch
    real = dict(t=torch.manual_seed, r=random.seed, n=np.random.seed, g=np.random.default_rng)
    real['t'](k); real['r'](k); real['n'](k % 2**32)
    torch.manual_seed, random.seed = _offset(real['t'], k), _offset(real['r'], k)
    np.random.seed, np.random.default_rng = _offset(real['n'], k), _offset(real['g'], k)
    try: yield
    finally:
        torch.manual_seed, random.seed, np.random.seed, np.random.default_rng = real['t'], real['r'], real['n'], real['g']


def _first_error(text: str) -> str:
    "The last line of a traceback that names an exception, or the last line."
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    errs = [l for l in lines if ('Error' in l or 'Exception' in l or 'assert' in l.lower()) and not l.startswith('File ')]
    return (errs[-1] if errs else lines[-1] if lines else '')[:200]


def child_notebook(nb: str, seeds: list[int], deadline: float):
    "In this process: run notebook `nb` under each seed until `deadline`; one JSON line per seed on stdout."
    from nbdev.config import get_config
    from nbdev.test import test_nb
    flags = str(get_config().get('tst_flags', '')).split()
    for k in seeds:
        if time.time() > deadline: break
        err = io.StringIO()
        t0 = time.time()
        with seeded(k), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ok, _ = test_nb(Path(nb).resolve(), skip_flags=flags, showerr=True)
        print(json.dumps(dict(seed=k, ok=bool(ok), s=round(time.time() - t0, 1), error='' if ok else _first_error(err.getvalue()))),
              flush=True)


def run_notebook(nb: str, seeds: list[int], budget: float) -> list[dict]:
    "One child process runs `nb` under `seeds` (imports paid once); its results, one per seed it reached in `budget` s."
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS', '1'), 'PYTHONWARNINGS': 'ignore'}
    cmd = [sys.executable, __file__, '--child', nb, '--seed-list', ','.join(map(str, seeds)), '--deadline', str(time.time() + budget)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=budget + 900)
    rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith('{')]
    if p.returncode and not rows: rows = [dict(seed=seeds[0], ok=False, s=0, error=_first_error(p.stderr))]
    return rows


def run_pytest(path: str, seeds: list[int], budget: float) -> list[dict]:
    "`pytest -q path` once per seed (DIFFQ_LAB_SEED=k) until `budget` s are spent."
    rows, end = [], time.time() + budget
    for k in seeds:
        if time.time() > end: break
        env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS', '1'), 'DIFFQ_LAB_SEED': str(k)}
        t0 = time.time()
        p = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider', path], capture_output=True,
                           text=True, env=env, cwd=ROOT)
        rows.append(dict(seed=k, ok=p.returncode == 0, s=round(time.time() - t0, 1),
                         error='' if p.returncode == 0 else _first_error(p.stdout)))
    return rows


def summary(path: str, rows: list[dict]) -> str:
    "One line: passed/run, the failing seeds and the first error."
    bad = [r for r in rows if not r['ok']]
    s = sum(r['s'] for r in rows) / max(len(rows), 1)
    tail = f"; fails at seeds {[r['seed'] for r in bad]}: {bad[0]['error']}" if bad else ''
    return f'{path}: {len(rows) - len(bad)}/{len(rows)} seeds pass ({s:.1f} s a seed){tail}'


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('paths', nargs='*', help='notebooks (.ipynb) and pytest files (.py)')
    ap.add_argument('--seeds', type=int, default=20, help='how many seeds (default 20)')
    ap.add_argument('--first', type=int, default=0, help='the first seed (default 0)')
    ap.add_argument('--seed-list', default=None, help='comma-separated seeds, instead of --seeds/--first')
    ap.add_argument('--budget', type=float, default=600, help='seconds per file: seeds not reached by then are not run')
    ap.add_argument('--json', default=None, help='write every per-seed result here')
    ap.add_argument('--child', default=None, help=argparse.SUPPRESS)
    ap.add_argument('--deadline', type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seed_list.split(',')] if a.seed_list else list(range(a.first, a.first + a.seeds))
    if a.seeds < 1 or not seeds: ap.error('--seeds must be at least 1')
    if a.child: child_notebook(a.child, seeds, a.deadline or float('inf')); return 0
    if not a.paths: ap.error('name at least one notebook or test file')
    bad = [p for p in a.paths if not Path(p).is_file() or Path(p).suffix not in ('.ipynb', '.py')]
    if bad: ap.error(f'not a notebook or test file: {", ".join(bad)}')
    results, failed = {}, False
    for path in a.paths:
        rows = (run_notebook if path.endswith('.ipynb') else run_pytest)(path, seeds, a.budget)
        results[path] = rows
        failed |= not all(r['ok'] for r in rows)
        print(summary(path, rows), flush=True)
    if a.json: Path(a.json).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == '__main__': sys.exit(main())
