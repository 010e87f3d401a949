"""The wheels carried to the lent GPU machine: pinned with hashes, checked against that machine's image.

    python3 tools/gpu_wheels.py download [--dest .gpu_wheels]   # fetch the pinned wheels (hash-checked), check, stamp
    python3 tools/gpu_wheels.py check [--wheels DIR]            # closure, tags, transfer size (committed metadata)
    python3 tools/gpu_wheels.py stamp [--dest .gpu_wheels]      # the git sha + code digest the run will report
    python3 tools/gpu_wheels.py lock DIR                        # maintainers: rewrite the pins from the wheels in DIR

data/gpu_image/wheels.txt is the pinned list (pip's hash-checking requirements format); data/gpu_image/wheels.json holds
each wheel's file name, sha256, size, tags, Requires-Python and Requires-Dist, so the closure is checked offline.
"""
from __future__ import annotations
import argparse, hashlib, json, re, subprocess, sys, zipfile
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMAGE = REPO/'data'/'gpu_image'/'image_packages.txt'
PINS = REPO/'data'/'gpu_image'/'wheels.txt'
META = REPO/'data'/'gpu_image'/'wheels.json'
TRANSFER_LIMIT = 64 * 2**20      # tree + carried paths, as the device tool carries them
TESTED_TORCHAO = '0.18.0'        # the torchao the lab's tests run with
GPU_PYTHON = ('3.12', '3.12.3')  # the image's python3
REHEARSAL_PYTHON = ('3.11', '3.11.7')  # this machine's: the rehearsal installs the very same files
PLATFORM_ARGS = ['--python-version', '3.12', '--implementation', 'cp', '--platform', 'manylinux_2_28_x86_64',
                 '--platform', 'manylinux_2_17_x86_64', '--platform', 'manylinux2014_x86_64']
RUN_NEEDS = ('torchao', 'diffusers', 'gguf', 'ipywidgets', 'ipython', 'traitlets', 'comm')  # absent there; imported
# declared, never imported by a headless run: ipywidgets' notebook and JupyterLab widget JavaScript (static files, 2.3
# MiB of the 64 MiB that travels) and IPython's tab completion (jedi and its parser parso, 4.8 MiB: IPython 9 imports jedi
# lazily, the first time a completion needs it: `IPython.core.completer._get_jedi`); their requirement is met without them
NOT_CARRIED = {'widgetsnbextension': 'the classic notebook front end\'s widget JS',
               'jupyterlab-widgets': 'the JupyterLab front end\'s widget JS',
               'jedi': 'IPython\'s tab completion, imported on a first completion only',
               'parso': 'jedi\'s parser'}


def norm(name: str) -> str:
    "A distribution name as PEP 503 normalises it."
    return re.sub(r'[-_.]+', '-', name).lower()


def read_image(path=IMAGE) -> dict:
    "name -> dict(version or None, source, required_by {name: specifier}) from the image package list."
    out = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip() or line.startswith('#'): continue
        name, version, source = (line.split(None, 2) + ['', ''])[:3]
        req = {}
        if source.startswith('implied: required by '):
            for tok in source.removeprefix('implied: required by ').split(', '):
                n, _, spec = tok.partition(' ')
                req[norm(n)] = spec.strip('()')
        out[norm(name)] = dict(version=None if version == '-' else version, source=source.split(':')[0].split(',')[0],
                               required_by=req)
    return out


def wheel_meta(path) -> dict:
    "name, version, file, sha256, size, tags, requires_python, requires_dist of the wheel at `path`."
    path = Path(path)
    with zipfile.ZipFile(path) as z:
        info = [n for n in z.namelist() if n.endswith('.dist-info/METADATA')]
        if len(info) != 1: raise ValueError(f'{path.name}: {len(info)} METADATA files')
        m = Parser().parsestr(z.read(info[0]).decode())
    tags = path.name[:-4].split('-')[-3:]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(name=m['Name'], version=m['Version'], file=path.name, sha256=digest,
                size=path.stat().st_size, tags='-'.join(tags), requires_python=m.get('Requires-Python') or '',
                requires_dist=m.get_all('Requires-Dist') or [])


def _env(py):
    return dict(python_version=py[0], python_full_version=py[1], sys_platform='linux', platform_system='Linux',
                platform_machine='x86_64', os_name='posix', implementation_name='cpython',
                platform_python_implementation='CPython', platform_release='', platform_version='', extra='')


def _base(v: str) -> str: return v.split('+')[0]


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
    except ImportError:  # a bare python3 with pip: pip's own copy
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.specifiers import SpecifierSet
    return Requirement, SpecifierSet


def closure(wheels: list[dict], image: dict, py=GPU_PYTHON) -> tuple[list[str], list[str]]:
    "(problems, notes): each carried wheel's Requires-Dist met by a carried wheel or the image, on python `py`."
    Requirement, SpecifierSet = _packaging()
    env, problems, notes = _env(py), [], []
    carried = {norm(w['name']): w['version'] for w in wheels}
    for w in wheels:
        who = f"{w['name']} {w['version']}"
        if w['requires_python'] and not SpecifierSet(w['requires_python']).contains(py[1], prereleases=True):
            problems.append(f"{who} requires Python {w['requires_python']}, the run has {py[1]}")
        for d in w['requires_dist']:
            q = Requirement(d)
            if q.marker is not None and not q.marker.evaluate(env): continue
            n = norm(q.name)
            if n in NOT_CARRIED: continue
            have = image.get(n)
            if n in carried:
                if not q.specifier.contains(carried[n], prereleases=True):
                    problems.append(f'{who} needs {q}: carried {carried[n]}')
            elif have is not None and have['source'] != 'absent':
                if have['version'] is None:
                    if any(s.operator != '!=' for s in q.specifier):
                        notes.append(f"{who} needs {q}: the image has {n} ({have['source']}), version not read")
                elif not q.specifier.contains(_base(have['version']), prereleases=True):
                    problems.append(f"{who} needs {q}: the image has {have['version']}")
            else: problems.append(f'{who} needs {q}: neither on the image nor carried')
    for n, v in carried.items():  # a carried wheel shadows the image's copy (PYTHONPATH first): it must suit the image
        for dep, spec in (image.get(n) or {}).get('required_by', {}).items():
            if spec and not SpecifierSet(spec).contains(v, prereleases=True):
                problems.append(f'carried {n} {v} shadows the image\'s, but {dep} there needs {n} {spec}')
    return problems, notes


def tag_ok(tags: str, py=GPU_PYTHON) -> bool:
    "Whether wheel tags `tags` ('py3-none-any', 'cp310-abi3-manylinux_...') install on CPython `py` on Linux x86_64."
    pyt, abi, plat = tags.split('-')
    major, minor = map(int, py[0].split('.'))
    pys = pyt.split('.')
    py_ok = any(p in ('py3', f'py{major}', f'cp{major}{minor}')
                or (abi == 'abi3' and p.startswith('cp3') and int(p[3:]) <= minor) for p in pys)
    abi_ok = abi in ('none', 'abi3', f'cp{major}{minor}')
    plat_ok = plat == 'any' or all(p.endswith('x86_64') and (p.startswith('manylinux') or p == 'linux_x86_64')
                                   for p in plat.split('.'))
    return py_ok and abi_ok and plat_ok


def tree_bytes(root=REPO) -> int:
    "Bytes of what the device tool carries of the tree: tracked files and untracked ones git does not ignore."
    out = subprocess.run(['git', 'ls-files', '-z', '-co', '--exclude-standard'], cwd=root, capture_output=True,
                         check=True).stdout
    return sum((Path(root)/p).stat().st_size for p in out.decode().split('\0') if p and (Path(root)/p).is_file())


def load_meta(path=META) -> list[dict]:
    return json.loads(Path(path).read_text())


def check(wheels_dir=None, meta=None, image=None, tree=None) -> list[str]:
    "Every problem with the carried set: closure on the GPU's Python and this one's, tags, torchao, run needs, size."
    wheels = meta if meta is not None else load_meta()
    image = image if image is not None else read_image()
    problems = []
    for py in (GPU_PYTHON, REHEARSAL_PYTHON):
        p, _ = closure(wheels, image, py)
        problems += [f'python {py[1]}: {x}' for x in p]
        problems += [f"{w['file']}: tags {w['tags']} do not install on CPython {py[0]}"
                     for w in wheels if not tag_ok(w['tags'], py)]
    names = {norm(w['name']): w['version'] for w in wheels}
    if names.get('torchao') != TESTED_TORCHAO:
        problems.append(f"torchao carried {names.get('torchao')}, the lab is tested with {TESTED_TORCHAO}")
    problems += [f'{n} is not on the image and not carried' for n in RUN_NEEDS if n not in names]
    if wheels_dir is not None:
        files = {p.name: p for p in Path(wheels_dir).glob('*.whl')}
        for w in wheels:
            f = files.pop(w['file'], None)
            if f is None: problems.append(f"{w['file']} missing from {wheels_dir}")
            elif hashlib.sha256(f.read_bytes()).hexdigest() != w['sha256']:
                problems.append(f"{w['file']}: sha256 differs from the pin")
        problems += [f'{n} in {wheels_dir} is not pinned' for n in files]
    total = (tree if tree is not None else tree_bytes()) + sum(w['size'] for w in wheels)
    if total > TRANSFER_LIMIT:
        problems.append(f'tree + wheels = {total / 2**20:.1f} MiB > {TRANSFER_LIMIT / 2**20:.0f} MiB')
    return problems


def stamp(dest) -> dict:
    "Write dest/SOURCE: the git sha, whether the code differs from it, and the code digest the run compares with."
    sys.path.insert(0, str(REPO/'tools'))
    from gpu_stages import code_digest
    git = lambda *a: subprocess.run(['git', *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    s = dict(git_sha=git('rev-parse', '--short=12', 'HEAD') or None,
             dirty=bool(git('status', '--porcelain', '--untracked-files=no', '--', '.', ':(exclude)data')),
             code_digest=code_digest(REPO))
    Path(dest).mkdir(parents=True, exist_ok=True)
    (Path(dest)/'SOURCE').write_text(json.dumps(s) + '\n')
    return s


def download(dest) -> int:
    "Fetch the pinned wheels for the GPU's Python (hash-checked), check them, and stamp the source."
    pinned = {w['file'] for w in load_meta()}
    for old in Path(dest).glob('*.whl'):  # what an older pin list left behind would be carried too
        if old.name not in pinned: old.unlink()
    cmd = [sys.executable, '-m', 'pip', 'download', '-q', '--no-deps', '--only-binary=:all:', *PLATFORM_ARGS,
           '--require-hashes', '-r', str(PINS), '-d', str(dest)]
    if subprocess.run(cmd).returncode: print('pip download failed', file=sys.stderr); return 1
    problems = check(dest)
    for p in problems: print('PROBLEM:', p, file=sys.stderr)
    s = stamp(dest)
    wheels = load_meta()
    print(f"{len(wheels)} wheels, {sum(w['size'] for w in wheels) / 2**20:.1f} MiB in {dest}; "
          f"tree {tree_bytes() / 2**20:.1f} MiB; "
          f"source {s['git_sha']}{' +dirty' if s['dirty'] else ''}")
    return 1 if problems else 0


def lock(folder) -> int:
    "Rewrite wheels.txt and wheels.json from the wheels in `folder`."
    wheels = sorted((wheel_meta(p) for p in Path(folder).glob('*.whl')), key=lambda w: norm(w['name']))
    PINS.write_text('# The wheels carried to the GPU machine (tools/gpu_wheels.py; `make gpu-wheels`), with hashes.\n'
                    + ''.join(f"{w['name']}=={w['version']} --hash=sha256:{w['sha256']}\n" for w in wheels))
    META.write_text(json.dumps(wheels, indent=1) + '\n')
    print(f'{len(wheels)} wheels locked')
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest='cmd', required=True)
    for c in ('download', 'stamp'): sub.add_parser(c).add_argument('--dest', default=str(REPO/'.gpu_wheels'))
    sub.add_parser('check').add_argument('--wheels', default=None)
    sub.add_parser('lock').add_argument('folder')
    a = ap.parse_args(argv)
    if a.cmd == 'download': return download(a.dest)
    if a.cmd == 'stamp': print(stamp(a.dest)); return 0
    if a.cmd == 'lock': return lock(a.folder)
    wheels, image = load_meta(), read_image()
    problems = check(a.wheels)
    _, notes = closure(wheels, image)
    for n in notes: print('note:', n)
    for p in problems: print('PROBLEM:', p)
    print(f"{len(wheels)} wheels, {sum(w['size'] for w in wheels) / 2**20:.1f} MiB; "
          f"{'no problems' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
