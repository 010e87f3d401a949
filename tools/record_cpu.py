"""Re-record committed CPU results tables under data/results, from the current checkout: the experiments registered in
`diffq_lab.lab.EXPERIMENTS` (nbs/20_lab.ipynb: each one's recorder, tables, minutes and needs).

  python tools/record_cpu.py            # every experiment, one after another (hours: encoder_tails alone ~85 min)
  python tools/record_cpu.py numerics   # some of them, by name
  python tools/record_cpu.py --list     # the experiments, their tables and costs

Commit the code first: each row carries the git sha it was measured with (`+dirty` when the tree had changes).
The lent GPU records its own stages (tools/gpu_check.sh; `make gpu-import` brings the rows home).
"""
import os, sys, textwrap
from pathlib import Path
os.environ.setdefault('HF_HUB_OFFLINE', '1')
# this checkout's package first: run from a clean worktree, a script's own folder (tools/) would otherwise leave the
# import to the editable install, i.e. another checkout's code and its data/results
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == '__main__':
    from diffq_lab.lab import EXPERIMENTS, run_experiments
    names = sys.argv[1:]
    if names == ['--list']:
        for e in EXPERIMENTS.values():  # within 120 columns: the name and cost, then what it writes and needs
            print(f"{e.name}{'' if e.minutes is None else f' (~{e.minutes:g} min)'}")
            print(textwrap.fill(f"writes {', '.join(e.tables)}" + (f'; needs {e.needs}' if e.needs else ''), 120,
                                initial_indent='    ', subsequent_indent='    '))
        sys.exit(0)
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        print(f'record_cpu.py: unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)}', file=sys.stderr)
        sys.exit(2)
    run_experiments(names or None)
