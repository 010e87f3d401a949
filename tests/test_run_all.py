"""Run All as a user runs it: notebooks in a real Jupyter kernel (nbclient), where sys.argv is the kernel's and the
`#| gpu` / `#| slow` flags mean nothing, so flagged cells must skip by themselves. The default suite runs two fast
notebooks and a synthetic one; DIFFQ_LAB_RUN_ALL=1 runs every notebook (tools/run_all.py does the same by hand)."""
import importlib.util, json, os, re
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location('run_all', ROOT/'tools'/'run_all.py')
ra = importlib.util.module_from_spec(spec); spec.loader.exec_module(ra)
NBS = sorted(p for p in (ROOT/'nbs').glob('*.ipynb') if not p.name.startswith('_'))

@pytest.fixture(autouse=True)
def _env(monkeypatch):
    "The kernels inherit these: offline, one thread, and never the full training."
    monkeypatch.setenv('HF_HUB_OFFLINE', '1'); monkeypatch.setenv('OMP_NUM_THREADS', '1')
    monkeypatch.delenv('DIFFQ_LAB_SLOW', raising=False)

def test_every_notebook_names_its_kernel():
    "Lab opens a notebook without a kernelspec by asking which kernel to start."
    missing = [p.name for p in NBS if json.loads(p.read_text())['metadata'].get('kernelspec', {}).get('name') != 'python3']
    assert missing == []

def test_flagged_cells_skip_by_themselves_in_a_kernel():
    "A `#| gpu` or `#| slow` cell runs under Run All: each must test for what it needs and print why it skipped."
    bad = []
    for p in NBS:
        for i, c in enumerate(json.loads(p.read_text())['cells']):
            src = ''.join(c['source'])
            if c['cell_type'] == 'code' and re.search(r'^#\|\s*(gpu|slow)\b', src, re.M) and "print('skipped" not in src:
                bad.append(f'{p.name} cell {i}')
    assert bad == []

@pytest.mark.parametrize('name', ['19_main', '13_compare'])
def test_fast_notebooks_pass_run_all(name):
    "19_main read the kernel's argv and exited before; 13_compare holds the widget users open first."
    ok, msg = ra.run_one(ROOT/'nbs'/f'{name}.ipynb', timeout=600)
    assert ok, msg

def test_a_failing_cell_is_named(tmp_path):
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('x = 1'), nbformat.v4.new_code_cell('import sys\nprint(sys.argv[1])\n1/0')])
    nb.metadata.kernelspec = {'name': 'python3', 'display_name': 'python3', 'language': 'python'}
    nbformat.write(nb, tmp_path/'toy.ipynb')
    ok, msg = ra.run_one(tmp_path/'toy.ipynb', timeout=120)
    assert not ok and msg.startswith("cell [1] 'import sys' raised ZeroDivisionError"), msg
    assert not list(tmp_path.glob('*.ipynb'))[0].read_text().count('"outputs": [\n     {')  # never written back

def test_unknown_notebook_names_the_choices():
    with pytest.raises(SystemExit, match='choose from'): ra.notebooks(['no_such_notebook'])
    assert [p.stem for p in ra.notebooks(['study', '19_main'])] == ['15_study', '19_main']

@pytest.mark.skipif(os.environ.get('DIFFQ_LAB_RUN_ALL') != '1', reason='every notebook in a kernel takes ~15 min: DIFFQ_LAB_RUN_ALL=1')
@pytest.mark.parametrize('path', NBS, ids=lambda p: p.stem)
def test_every_notebook_passes_run_all(path):
    ok, msg = ra.run_one(path, timeout=1200)
    assert ok, msg
