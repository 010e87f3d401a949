"""Offline docs: execute the notebooks (skipping flagged cells), run nbdev's doc processors, render with nbconvert.

Quarto cannot be installed on these machines, so this stands in for `nbdev_readme` / `nbdev_docs`:
  python tools/build_docs.py readme   -> README.md from nbs/index.ipynb
  python tools/build_docs.py html     -> _docs/*.html, one page per notebook
"""
import os, re, sys, json
from pathlib import Path
from execnb.nbio import read_nb, nb2str
from execnb.shell import CaptureShell
from nbdev.config import get_config
from nbdev.processors import FilterDefaults
from nbdev.process import first_code_ln
import nbformat
from nbconvert import MarkdownExporter, HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
SKIP = re.compile(r'^#\|\s*(eval:\s*false|' + '|'.join(get_config().tst_flags.split()) + r')\b', re.M)

def _skip(cell):
    "Cells nbdev_test would not run: `#| eval: false` and those carrying a test flag (gpu, slow, notest)."
    return cell.cell_type == 'code' and bool(SKIP.search(cell.source))

def execute(path: Path):
    "Run the notebook like nbdev_test does (from its folder, flagged cells skipped); return it with outputs."
    nb = read_nb(path)
    cwd = os.getcwd(); os.chdir(path.parent)
    try:
        shell = CaptureShell(path)
        shell.run_all(nb, exc_stop=True, preproc=_skip)
    finally: os.chdir(cwd)
    return nb

def processed(path: Path):
    "The executed notebook after nbdev's doc processors (hidden cells dropped, directives stripped, show_doc rendered)."
    nb = execute(path)
    FilterDefaults()(nb)
    d = json.loads(nb2str(nb))
    for c in d['cells']:
        c.get('metadata', {}).pop('execution', None)  # execnb's float timings fail nbformat's validator
        c.pop('idx_', None)
        src = ''.join(c['source']) if isinstance(c['source'], list) else c['source']
        if c['cell_type'] == 'code' and re.search(r'^#\|\s*echo:\s*false', src, re.M):
            c['metadata']['tags'] = ['remove_input']  # what Quarto would do with `#| echo: false`
        c['source'] = '\n'.join(l for l in src.splitlines() if not l.startswith('#|')).strip()
        for o in c.get('outputs', []):  # Quarto link attributes mean nothing to markdown/HTML
            for k, v in o.get('data', {}).items():
                if isinstance(v, str): o['data'][k] = re.sub(r'\{target="_blank"[^}]*\}', '', v)
                elif isinstance(v, list): o['data'][k] = [re.sub(r'\{target="_blank"[^}]*\}', '', x) for x in v]
    d.setdefault('nbformat', 4); d.setdefault('nbformat_minor', 5)
    return nbformat.reads(json.dumps(d), as_version=4)

def _exporter(cls):
    "An nbconvert exporter that honours the `remove_input` tag set above."
    from traitlets.config import Config
    c = Config(); c.TagRemovePreprocessor.remove_input_tags = {'remove_input'}; c.TagRemovePreprocessor.enabled = True
    return cls(config=c)

def readme():
    nb = processed(ROOT/'nbs'/'index.ipynb')
    body, _ = _exporter(MarkdownExporter).from_notebook_node(nb)
    front = re.match(r'---\n(.*?)\n---\n', body, re.S)  # Quarto front matter: a title and blurb on GitHub instead
    if front:
        meta = dict(re.findall(r"^(\w[\w-]*): '?(.*?)'?$", re.sub(r"\n\s+", ' ', front.group(1)), re.M))
        body = f"# {meta.get('title', 'diffq_lab')}\n\n> {meta.get('description', '')}\n\n" + body[front.end():]
    body = re.sub(r'\n{3,}', '\n\n', body).strip() + '\n'
    (ROOT/'README.md').write_text(body)
    print('wrote README.md')

def html():
    out = ROOT/'_docs'; out.mkdir(exist_ok=True)
    for p in sorted((ROOT/'nbs').glob('*.ipynb')):
        body, _ = _exporter(HTMLExporter).from_notebook_node(processed(p))
        (out/f'{p.stem}.html').write_text(body)
        print('wrote', out/f'{p.stem}.html')

if __name__ == '__main__':
    cmds = {'readme': readme, 'html': html}
    if len(sys.argv) != 2 or sys.argv[1] not in cmds: sys.exit(f"usage: build_docs.py {{{'|'.join(cmds)}}}")
    cmds[sys.argv[1]]()
