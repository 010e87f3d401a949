"Notebook conventions the docs build and `nbdev_test --flags gpu` depend on."
import ast, json, re
from pathlib import Path
import pytest

NBS = sorted((Path(__file__).resolve().parent.parent/'nbs').glob('*.ipynb'))
DIRECTIVE = re.compile(r'^#\|\s*([\w-]+)', re.M)

def code_cells(nb):
    for i, c in enumerate(json.loads(nb.read_text())['cells']):
        if c['cell_type'] == 'code': yield i, ''.join(c['source'])

def _has(tree, types): return any(isinstance(n, types) for n in ast.walk(tree))

@pytest.mark.parametrize('nb', NBS, ids=lambda p: p.stem)
def test_import_cells_hold_only_imports(nb):
    "nbdev's docs processor runs every cell that imports: such a cell must not compute with earlier cells' state."
    bad = []
    for i, src in code_cells(nb):
        dirs = set(DIRECTIVE.findall(src))
        if dirs & {'export', 'exports', 'exporti', 'exec_doc'} or 'eval' in dirs: continue
        tree = ast.parse('\n'.join(l for l in src.splitlines() if not l.lstrip().startswith(('%', '!'))))
        if _has(tree, (ast.Import, ast.ImportFrom)) and _has(tree, (ast.Expr, ast.Assign)): bad.append(i)
    assert not bad, f'{nb.name}: cells {bad} mix imports with other code (move the imports to the top import cell)'

@pytest.mark.parametrize('nb', NBS, ids=lambda p: p.stem)
def test_flagged_cells_have_no_imports(nb):
    "gpu/slow cells are skipped by nbdev_test yet run by the docs build when they import."
    bad = [i for i, src in code_cells(nb) if set(DIRECTIVE.findall(src)) & {'gpu', 'slow'}
           and _has(ast.parse(src), (ast.Import, ast.ImportFrom))]
    assert not bad, f'{nb.name}: gpu/slow cells {bad} import'
