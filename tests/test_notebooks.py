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

PKG = Path(__file__).resolve().parent.parent/'diffq_lab'

def _notebook_order() -> dict[str, int]:
    "module name -> the number of the notebook that exports it (the order data flows through the lab)."
    order = {}
    for py in PKG.glob('*.py'):
        m = re.search(r'File to edit: \.\./nbs/(\d+)([a-z]?)_\w+\.ipynb', py.read_text())
        if m: order[py.stem] = (int(m[1]), m[2])  # 10a comes after 10 and before 10b and 11
    return order

def _package_imports(py: Path) -> set[str]:
    "The diffq_lab modules `py` imports anywhere (top level or inside functions)."
    out = set()
    for n in ast.walk(ast.parse(py.read_text())):
        if isinstance(n, ast.ImportFrom):
            mod = n.module or ''
            if n.level == 1: out |= {mod} if mod else {a.name for a in n.names}
            elif mod.startswith('diffq_lab.'): out.add(mod.split('.')[1])
            elif mod == 'diffq_lab': out |= {a.name for a in n.names}
        elif isinstance(n, ast.Import):
            out |= {a.name.split('.')[1] for a in n.names if a.name.startswith('diffq_lab.')}
    return out - {'_modidx'}

def test_no_module_imports_a_later_notebook():
    "Data flows one way: a module imports only modules of earlier notebooks, so the import graph has no circle."
    order = _notebook_order()
    assert len(order) >= 15, order
    bad = [f'{m} ({order[m]}) imports {d} ({order.get(d, "?")})' for m in order
           for d in _package_imports(PKG/f'{m}.py') if d != m and (d not in order or order[d] >= order[m])]
    assert not bad, bad

def test_the_library_never_imports_the_lab():
    "The lab's experiments (20_lab) sit above the library: no other module imports them, by statement or by name."
    order = _notebook_order()
    assert 'lab' in order and order['lab'] == max(order.values()), order
    bad = [m for m in order if m != 'lab' and ('lab' in _package_imports(PKG/f'{m}.py')
                                               or 'diffq_lab.lab' in (PKG/f'{m}.py').read_text())]
    assert not bad, bad

def test_notebook_numbers_are_unique():
    nums = [p.name.split('_')[0] for p in NBS if p.name[0].isdigit()]
    assert len(nums) == len(set(nums)), sorted(nums)
