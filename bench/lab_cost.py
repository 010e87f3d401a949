"""What the lab's own work costs: the study, each notebook under nbdev_test, the slowest tests (a benchmark, not a test).

    .venv/bin/python bench/lab_cost.py notebooks [--top 5] [NAME ...]   # each notebook as nbdev_test runs it, per cell
    .venv/bin/python bench/lab_cost.py tests [--top 30] [PYTEST ARGS]   # pytest, its slowest tests
    .venv/bin/python bench/lab_cost.py study [STUDY ARGS]               # `diffq-lab study --no-record`, by stage
    .venv/bin/python bench/lab_cost.py checks [GIT REF]                # how many tests and inline assertions
    .venv/bin/python bench/lab_cost.py all                             # the three, and a summary

Every figure is wall seconds and CPU seconds (user + system of the process and its children), with the machine they
came from: wall time on a shared 2-core machine grows 3-5x under load, CPU seconds much less, so budgets are kept in
CPU seconds. A notebook runs in its own process, the way nbdev_test runs it (execnb's CaptureShell, the cells flagged
`notest gpu slow` skipped, one torch thread), and the slowest cells are named with their first line. The figures are
printed and written to `bench/lab_cost.json` (git-ignored); the cost model in README (`## What the lab's own work
costs`) is read from a run of this script.
"""
import argparse, json, os, platform, re, resource, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
ENV = dict(os.environ, HF_HUB_OFFLINE='1', OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false')


def cpu_now() -> float:
    "CPU seconds used so far by this process and its finished children."
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def timed(cmd, **kw) -> dict:
    "Run `cmd`; its wall and CPU seconds, return code and output."
    c0, t0 = cpu_now(), time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, **kw)
    return dict(wall_s=time.perf_counter() - t0, cpu_s=cpu_now() - c0, rc=r.returncode, out=r.stdout, err=r.stderr)


# One notebook the nbdev_test way, each cell timed: run in a child process (`_cells` below).
_CELLS = r'''
import json, resource, sys, time
from fastcore.xtras import working_directory
from execnb.nbio import read_nb
from execnb.shell import CaptureShell
from nbdev.process import NBProcessor
from nbdev.frontmatter import FrontmatterProc
from nbdev.config import get_config
from pathlib import Path
fn = Path(sys.argv[1]); flags = set(get_config().tst_flags.split())
nb = NBProcessor(fn, procs=FrontmatterProc, process=True).nb
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
def skip(c):
    if c.cell_type != 'code' or 'nbdev_export(' in c.source: return True
    d = getattr(c, 'directives_', {}) or {}
    return d.get('eval:', [''])[0].lower() == 'false' or bool(flags & d.keys())
k, rows = CaptureShell(fn), []
with working_directory(fn.parent):
    for i, c in enumerate(nb.cells):
        if skip(c): continue
        t0, c0 = time.perf_counter(), cpu()
        k.cell(c)
        rows.append(dict(cell=i, first=c.source.strip().splitlines()[0][:70] if c.source.strip() else '',
                         wall_s=time.perf_counter() - t0, cpu_s=cpu() - c0, ok=k.exc is None))
        if k.exc is not None: break
print('@@' + json.dumps(rows))
'''


def notebooks(names=(), top: int = 5) -> list[dict]:
    "Each notebook (or those matching `names`) run as nbdev_test runs it: its wall and CPU seconds, its slowest cells."
    out = []
    for nb in sorted((ROOT/'nbs').glob('*.ipynb')):
        if names and not any(n in nb.stem for n in names): continue
        r = timed([PY, '-c', _CELLS, str(nb)])
        cells = json.loads(r['out'].split('@@')[-1]) if '@@' in r['out'] else []
        row = dict(notebook=nb.stem, wall_s=round(r['wall_s'], 1), cpu_s=round(r['cpu_s'], 1),
                   ok=r['rc'] == 0 and all(c['ok'] for c in cells),
                   slowest=sorted(cells, key=lambda c: -c['cpu_s'])[:top])
        print(f"{row['notebook']:22s} {row['wall_s']:7.1f} s wall {row['cpu_s']:7.1f} s CPU"
              + ('' if row['ok'] else '  FAILED'), flush=True)
        for c in row['slowest']:
            if c['cpu_s'] >= 1: print(f"    cell {c['cell']:3d} {c['cpu_s']:6.1f} s CPU  {c['first']}", flush=True)
        out.append(row)
    return out


_DUR = re.compile(r'^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)', re.M)

def tests(args=(), top: int = 30) -> dict:
    "pytest over tests/ (or `args`): wall and CPU seconds, counts, and its `top` slowest phases."
    r = timed([PY, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', f'--durations={top}', *(args or ['tests'])])
    slow = [dict(seconds=float(s), phase=ph, test=t) for s, ph, t in _DUR.findall(r['out'])]
    summary = (r['out'].strip().splitlines() or [''])[-1]
    print(f"pytest: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, rc {r['rc']}: {summary}")
    for d in slow: print(f"  {d['seconds']:7.2f} s {d['phase']:8s} {d['test']}")
    failed = [l for l in r['out'].splitlines() if l.startswith(('FAILED', 'ERROR'))]
    for l in failed: print('  ' + l)
    return dict(failed=failed, wall_s=round(r['wall_s'], 1), cpu_s=round(r['cpu_s'], 1), rc=r['rc'], summary=summary, slowest=slow)


def study(args=()) -> dict:
    "`diffq-lab study --no-record` into a temporary folder: wall and CPU seconds, and the stage lines it printed."
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        r = timed([PY, '-m', 'diffq_lab', 'study', '--no-record', '--out', str(Path(d)/'study'), *args])
    stages = [l for l in (r['out'] + r['err']).splitlines() if re.search(r'\d s\b|finished in', l)][-12:]
    print(f"study: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, rc {r['rc']}")
    for l in stages: print('  ' + l)
    return dict(wall_s=round(r['wall_s'], 1), cpu_s=round(r['cpu_s'], 1), rc=r['rc'], stages=stages)


_CHECK = re.compile(r'\b(test_eq|test_ne|test_close|test_fail|test_is|test_shuffled|test_warns|test_stdout|test_sig)\(|^\s*assert\b', re.M)

def checks(ref=None) -> dict:
    "Inline assertions in the notebooks' test cells (fastcore checks and asserts) and pytest's tests, here or at `ref`."
    import tempfile
    def count(root: Path) -> dict:
        n = 0
        for nb in sorted((root/'nbs').glob('*.ipynb')):
            for c in json.loads(nb.read_text())['cells']:
                src = ''.join(c['source'])
                if c['cell_type'] == 'code' and not re.match(r'#\|\s*export', src): n += len(_CHECK.findall(src))
        r = subprocess.run([PY, '-m', 'pytest', '--collect-only', '-q', '-p', 'no:cacheprovider', 'tests'], cwd=root,
                           capture_output=True, text=True, env=ENV)
        tests = sum(1 for l in r.stdout.splitlines() if '::' in l)
        return dict(inline_assertions=n, tests=tests)
    if ref is None: out = count(ROOT)
    else:
        with tempfile.TemporaryDirectory() as d:
            subprocess.run(['git', 'worktree', 'add', '--detach', d, ref], cwd=ROOT, capture_output=True, check=True)
            try: out = count(Path(d))
            finally: subprocess.run(['git', 'worktree', 'remove', '--force', d], cwd=ROOT, capture_output=True)
    print(f"{ref or 'this tree'}: {out['tests']} tests, {out['inline_assertions']} inline assertions")
    return out


def machine() -> dict:
    "Where the figures came from."
    cpu = next((l.split(':', 1)[1].strip() for l in Path('/proc/cpuinfo').read_text().splitlines()
                if l.startswith('model name')), platform.processor()) if Path('/proc/cpuinfo').exists() else ''
    git = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, cwd=ROOT).stdout
    return dict(cpu=cpu, cores=os.cpu_count(), python=platform.python_version(), git=git.strip(),
                date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('what', choices=('notebooks', 'tests', 'study', 'checks', 'all'))
    p.add_argument('--top', type=int, default=None, help='slowest cells per notebook (5) or slowest tests (30)')
    a, rest = p.parse_known_args(argv)
    res = dict(machine=machine())
    print(json.dumps(res['machine']))
    if a.what in ('notebooks', 'all'): res['notebooks'] = notebooks(rest if a.what == 'notebooks' else (), a.top or 5)
    if a.what in ('tests', 'all'): res['tests'] = tests(rest if a.what == 'tests' else (), a.top or 30)
    if a.what in ('study', 'all'): res['study'] = study(rest if a.what == 'study' else ())
    if a.what in ('checks', 'all'): res['checks'] = checks(rest[0] if a.what == 'checks' and rest else None)
    if 'notebooks' in res:
        nbs = res['notebooks']
        print(f"notebooks: {sum(n['cpu_s'] for n in nbs):.0f} s CPU in all, {sum(n['wall_s'] for n in nbs):.0f} s wall "
              "one after another")
    (ROOT/'bench'/'lab_cost.json').write_text(json.dumps(res, indent=1))
    return 0


if __name__ == '__main__': sys.exit(main())
