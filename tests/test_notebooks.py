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

LAB_FROM = (20, '')  # notebooks 20 on are the lab wing: the experiments and their recorders; below them, the library

def _wings() -> tuple[set, set]:
    "(library modules, lab modules) by the number of the notebook that exports each."
    order = _notebook_order()
    return {m for m, o in order.items() if o < LAB_FROM}, {m for m, o in order.items() if o >= LAB_FROM}

def test_the_library_never_imports_the_lab():
    "The lab (20_lab and the notebooks after it) sits above the library: no library module imports it, by statement or by name."
    lib, lab = _wings()
    assert 'lab' in lab and len(lib) >= 15, (lib, lab)
    bad = {m: sorted((_package_imports(PKG/f'{m}.py') & lab) | {l for l in lab if f'diffq_lab.{l}' in (PKG/f'{m}.py').read_text()})
           for m in lib}
    assert not any(bad.values()), {m: d for m, d in bad.items() if d}

# library modules that still define a `record_*` (issue 39 moves each recorder into the lab): this set only shrinks.
_RECORDERS_LEFT = set()

def test_recorders_live_in_the_lab():
    "A results table's recorder (`def record_...`) is defined in the lab wing, not in a library module."
    lib, _ = _wings()
    has = {m for m in lib if re.search(r'^\s*def record_', (PKG/f'{m}.py').read_text(), re.M)}
    assert has <= _RECORDERS_LEFT, f'record_* defined in library modules {sorted(has - _RECORDERS_LEFT)}: move it to the lab'

def test_notebook_numbers_are_unique():
    nums = [p.name.split('_')[0] for p in NBS if p.name[0].isdigit()]
    assert len(nums) == len(set(nums)), sorted(nums)
