"""The README's commands run as written: its Python blocks in order, its `diffq-lab` shell lines under the lab's own
settings (HF_HUB_OFFLINE=1, as the Makefile sets), each writing where the README says, and every `make` target it names
exists. (`make study` and `make test` themselves are what CI and bench/lab_cost.py run.)"""
import os, re, shlex, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT/'README.md').read_text(encoding='utf-8')
BLOCKS = re.findall(r'^```(\w*)\n(.*?)^```', README, re.M | re.S)


def test_the_readme_has_its_blocks():
    kinds = [k for k, _ in BLOCKS]
    assert kinds.count('sh') >= 2 and kinds.count('') >= 4, kinds


def test_python_blocks_run_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = '\n'.join(b for k, b in BLOCKS if k == '')
    ns = {}
    exec(compile(code, 'README.md', 'exec'), ns)  # noqa: S102 -- the README's own code, as a reader pastes it
    assert 'text_encoder: int8wo via torchao' in ns['plan'].summary() and ns['again'] is not None


def test_diffq_lab_lines_run_as_written_and_write_where_they_say(tmp_path):
    lines = [l for k, b in BLOCKS if k == 'sh' for l in b.splitlines() if l.startswith('diffq-lab ')]
    assert lines, 'the README shows no diffq-lab command'
    exe = Path(sys.executable).parent/'diffq-lab'
    env = dict(os.environ, HF_HUB_OFFLINE='1')
    for line in lines:
        r = subprocess.run([str(exe), *shlex.split(line)[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-2000:])
    for path in re.findall(r'writes `(out/[\w./-]+)`', README):  # "writes `out/plan.json` ... and `out/plan.py`"
        assert (tmp_path/path).is_file(), path
    assert (tmp_path/'out'/'plan.py').is_file()


def test_every_make_target_it_names_exists():
    named = set(re.findall(r'`make ([a-z][\w-]*)', README))  # a target, as the prose quotes one
    named |= {l.split()[1] for k, b in BLOCKS if k == 'sh' for l in b.splitlines() if l.startswith('make ')}
    targets = set(re.findall(r'^([a-z][\w-]*):', (ROOT/'Makefile').read_text(), re.M))
    assert {'study', 'test', 'docs'} <= named and named <= targets, named - targets
