"""Run All, as JupyterLab runs it: every notebook (or those named) in a real Jupyter kernel, with nbclient.

    python tools/run_all.py [NAME ...] [--timeout 900] [--kernel python3]

nbdev_test runs notebooks in an in-process IPython shell and skips the cells flagged `#| gpu` / `#| slow`; a user's
Run All does neither: every cell runs, in a kernel whose sys.argv is the kernel's own. So the flagged cells must
skip by themselves (they print one line), and nothing may read the command line. This runs each notebook from
nbs/ in a fresh kernel, never writes the notebooks back, and prints one line per notebook: passed, or the cell
that failed and its error. Exit 1 if any failed. NAME is a notebook's stem or page name (15_study or study).
"""
from __future__ import annotations
import argparse, os, re, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT/'nbs'

def notebooks(names=()) -> list[Path]:
    "The notebooks named (stem or name without its number), or all of nbs/, in order."
    nbs = sorted(p for p in NBS.glob('*.ipynb') if not p.name.startswith('_'))
    if not names: return nbs
    key = lambda p: {p.stem, re.sub(r'^\d+[a-zA-Z0-9]*_', '', p.stem)}
    unknown = [n for n in names if not any(n in key(p) for p in nbs)]
    if unknown: raise SystemExit(f'run_all.py: no notebook named {unknown}; choose from {[p.stem for p in nbs]}')
    return [p for p in nbs if key(p) & set(names)]

def run_one(path: Path, timeout: int = 900, kernel: str = 'python3') -> tuple[bool, str]:
    "Execute `path` in a fresh kernel from its folder: (passed, one line saying how it went)."
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel, resources={'metadata': {'path': str(path.parent)}},
                            extra_arguments=['--IPKernelApp.log_level=ERROR'])  # not its TCP-transport notice per notebook
    try: client.execute()
    except CellTimeoutError: return False, f'a cell ran past {timeout} s (cell {_failed_cell(nb)})'
    except DeadKernelError as e: return False, f'the kernel died (cell {_failed_cell(nb)}): {str(e)[:200]}'
    except CellExecutionError as e:
        err = (e.ename + ': ' + str(e.evalue)).splitlines()[0][:300] if getattr(e, 'ename', None) else str(e).splitlines()[0]
        return False, f'cell {_failed_cell(nb)} raised {err}'
    skipped = sum(1 for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', [])
                  if o.get('output_type') == 'stream' and str(o.get('text', '')).startswith('skipped'))
    return True, f'passed ({sum(c.cell_type == "code" for c in nb.cells)} code cells, {skipped} said they skipped)'

def _failed_cell(nb) -> str:
    "The index and first line of the last code cell that started executing (where it stopped)."
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == 'code' and c.get('execution_count')]
    if not code: return '?'
    i, c = code[-1]
    return f'[{i}] {c.source.splitlines()[0][:60] if c.source else ""!r}'

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('names', nargs='*', help='notebooks to run (default: all of nbs/)')
    ap.add_argument('--timeout', type=int, default=900, help='seconds a cell may run (default 900)')
    ap.add_argument('--kernel', default='python3', help='the kernelspec to start (default python3)')
    a = ap.parse_args(argv)
    os.environ.setdefault('HF_HUB_OFFLINE', '1'); os.environ.setdefault('OMP_NUM_THREADS', '1')
    os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')  # the kernels inherit these
    from tqdm import tqdm
    nbs, failed, t0 = notebooks(a.names), [], time.time()
    bar = tqdm(nbs, desc='Run All', unit='nb', disable=len(nbs) < 2)  # ~20 minutes for all of nbs/ on 2 cores: an estimate
    for p in bar:
        t = time.time()
        bar.set_postfix_str(p.name)
        ok, msg = run_one(p, a.timeout, a.kernel)
        bar.write(f'{"PASS" if ok else "FAIL"} {p.name} in {time.time() - t:.0f} s: {msg}')
        if not ok: failed.append(p.name)
    print(f'{len(nbs) - len(failed)}/{len(nbs)} notebooks passed Run All in a real kernel in {time.time() - t0:.0f} s'
          + (f'; failed: {", ".join(failed)}' if failed else ''))
    return 1 if failed else 0

if __name__ == '__main__':
    sys.exit(main())
