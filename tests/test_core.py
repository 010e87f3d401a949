"Core: the results store's atomicity and bad inputs, and the Makefile's notebook/package sync check."
import os, shutil, subprocess, sys
from pathlib import Path
import pandas as pd
import pytest
from diffq_lab import core, store
from diffq_lab.core import load_table, atomic_write_text, latest_run, fingerprint, as_dtype
from diffq_lab.store import append_rows

ROOT = Path(__file__).resolve().parent.parent

def test_rows_carry_fingerprint_and_keep_their_own(tmp_path):
    gpu_row = dict(fingerprint('cpu'), device='cuda', device_name='NVIDIA H200', capability='9.0', scheme='fp8')
    t = append_rows('probe', [dict(scheme='int8'), gpu_row], root=tmp_path, device='cpu')
    assert list(t.device_name)[1] == 'NVIDIA H200'  # a row recorded elsewhere keeps its provenance
    assert t.loc[0, 'device'] == 'cpu' and pd.notna(t.loc[0, 'torch'])

def test_failed_write_leaves_old_table(tmp_path, monkeypatch):
    append_rows('t', dict(a=1), root=tmp_path, device='cpu')
    before = (tmp_path/'t.csv').read_text()
    def boom(*a, **k): raise OSError('disk full')
    monkeypatch.setattr(core.os, 'replace', boom)
    with pytest.raises(OSError): append_rows('t', dict(a=2), root=tmp_path, device='cpu')
    assert (tmp_path/'t.csv').read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith('.lock')) == ['t.csv']

def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match='at least one row'): append_rows('t', [], root=tmp_path)
    with pytest.raises(ValueError, match='bad table kind'): load_table('Bad Name', root=tmp_path)
    with pytest.raises(ValueError, match='bf16'): as_dtype('int3')

def test_env_var_results_dir(tmp_path, monkeypatch):
    monkeypatch.setenv('DIFFQ_LAB_RESULTS', str(tmp_path))
    append_rows('envtest', dict(x=1), device='cpu')
    assert (tmp_path/'envtest.csv').exists()

def test_atomic_write_creates_parents(tmp_path):
    atomic_write_text(tmp_path/'a'/'b.txt', 'hi')
    assert (tmp_path/'a'/'b.txt').read_text() == 'hi'

@pytest.fixture
def lab_copy(tmp_path):
    "A copy of the lab's notebooks, package and build files (no git), to break on purpose."
    for name in ('nbs', 'diffq_lab'): shutil.copytree(ROOT/name, tmp_path/name, ignore=shutil.ignore_patterns('__pycache__'))
    for name in ('settings.ini', 'setup.py', 'Makefile', 'pyproject.toml'): shutil.copy(ROOT/name, tmp_path/name)
    return tmp_path

def _sync_check(path):
    venv = Path(sys.executable).parent.parent
    env = {k: v for k, v in os.environ.items() if k != 'CI'}
    # -o: treat the venv as up to date, so the check runs without reinstalling
    return subprocess.run(['make', '-s', '-o', f'{venv}/.installed', f'VENV={venv}', 'sync-check'],
                          cwd=path, capture_output=True, text=True, env=env, timeout=300)

def test_sync_check_passes_on_clean_copy(lab_copy):
    r = _sync_check(lab_copy)
    assert r.returncode == 0, r.stdout + r.stderr

def test_sync_check_catches_hand_edit(lab_copy):
    core_py = lab_copy/'diffq_lab'/'core.py'
    core_py.write_text(core_py.read_text() + '\nHAND_EDIT = 1\n')
    r = _sync_check(lab_copy)
    assert r.returncode != 0 and 'DRIFT' in r.stdout, r.stdout + r.stderr


_WRITER = """
import sys
from diffq_lab.store import append_rows
for i in range(40): append_rows('shared', dict(writer=sys.argv[2], i=i), root=sys.argv[1], device='cpu')
"""

def test_two_writers_keep_every_row(tmp_path):
    "Two processes appending 40 rows each to one table, one row a call: the lock keeps all 80 (without it: 53 of 80)."
    from forked import Forked, stop  # two processes forked with the store imported: no torch import each (tests/forked.py)
    try:
        procs = [Forked(_WRITER, str(tmp_path), w) for w in 'ab']
        assert all(p.wait(timeout=300) == 0 for p in procs), [p.output()[1][-2000:] for p in procs]
    finally: stop()
    t = load_table('shared', tmp_path)
    assert len(t) == 80 and sorted(t.groupby('writer').i.apply(sorted).sum()) == sorted(list(range(40)) * 2)


@pytest.mark.parametrize('damage', ['cut', 'extra field'])
def test_a_damaged_table_is_refused_and_left_byte_identical(tmp_path, damage):
    append_rows('t', [dict(ssim=0.9983, psnr=41.2), dict(ssim=0.97, psnr=38.0)], root=tmp_path, device='cpu')
    path = tmp_path/'t.csv'
    text = path.read_text()
    path.write_text(text[:-6] if damage == 'cut' else text + 'x,y,z\n')  # cut mid-line, or a record of 3 fields
    before = path.read_bytes()
    with pytest.raises(core.DamagedTable, match=r't\.csv, line \d+'): append_rows('t', dict(ssim=0.5), root=tmp_path, device='cpu')
    with pytest.raises(core.DamagedTable): load_table('t', tmp_path)
    assert path.read_bytes() == before


def test_a_table_that_is_a_folder_is_refused(tmp_path):
    (tmp_path/'t.csv').mkdir()
    with pytest.raises(ValueError, match='is a folder'): append_rows('t', dict(a=1), root=tmp_path, device='cpu')


def test_recording_into_the_checkout_from_a_dirty_tree_is_refused(monkeypatch):
    monkeypatch.setattr(store, 'git_sha', lambda path=None: 'abc123+dirty')
    monkeypatch.delenv('DIFFQ_LAB_ALLOW_DIRTY', raising=False)
    monkeypatch.delenv('DIFFQ_LAB_RESULTS', raising=False)
    with pytest.raises(ValueError, match='uncommitted changes'): store._check_clean_tree(None, allow_dirty=False)
    store._check_clean_tree(None, allow_dirty=True)                      # asked for: allowed, and the rows say +dirty
    monkeypatch.setenv('DIFFQ_LAB_ALLOW_DIRTY', '1'); store._check_clean_tree(None, allow_dirty=False)


def test_a_recording_is_all_or_nothing_across_tables(tmp_path, monkeypatch):
    append_rows('a', dict(x=1), root=tmp_path, device='cpu')
    before = (tmp_path/'a.csv').read_bytes()
    real, calls = os.replace, []
    def second_rename_fails(src, dst):
        calls.append(dst)
        if len(calls) == 1: raise OSError('disk full (forced)')
        return real(src, dst)
    monkeypatch.setattr(core.os, 'replace', second_rename_fails)
    with pytest.raises(OSError): store.append_tables({'a': [dict(x=2)], 'b': [dict(y=1)]}, root=tmp_path, device='cpu')
    assert (tmp_path/'a.csv').read_bytes() == before and not (tmp_path/'b.csv').exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith('.tmp')]
