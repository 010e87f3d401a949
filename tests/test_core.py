"Core: the results store's atomicity and bad inputs, and the Makefile's notebook/package sync check."
import os, shutil, subprocess, sys
from pathlib import Path
import pandas as pd
import pytest
from diffq_lab import core
from diffq_lab.core import append_rows, load_table, atomic_write_text, latest_run, fingerprint, as_dtype

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
    assert sorted(p.name for p in tmp_path.iterdir()) == ['t.csv']

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
