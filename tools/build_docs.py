"""The lab's docs, built offline: `make docs` (a static site in _docs/) and `make readme` (README.md).

    python tools/build_docs.py html [--execute all|none|NAME,...] [--out DIR] [--jobs N] [--fresh] [--timeout S]
    python tools/build_docs.py readme

Failures are one line each, naming the notebook and the cell (a cell that raises, ends the process or runs past
--timeout; a notebook that is not valid JSON): exit 1. A bad --out is refused before any work: exit 2. The site is
built in a folder beside --out and moved there whole; --out is replaced only when it is new, empty, or a site this
builder made (it holds the builder's marker file, .diffq_docs_site): a folder of anything else is never deleted.

Why mkdocs-material + mkdocs-jupyter, not hand-built nbconvert pages, Sphinx + myst-nb or nbdev_docs:
  * nbdev_docs needs Quarto, which cannot be installed on these machines (PyPI's quarto-cli downloads a
    binary at build time), and it leaves nbs/_quarto.yml, nbdev.yml and sidebar.yml behind.
  * Hand-built nbconvert pages had no navigation, no search and no page contents; writing those by hand
    is writing a site generator. mkdocs-material gives all three, a responsive layout and a dark mode,
    from one PyPI wheel whose assets (JS, CSS, icons, the lunr search) ship inside it: with
    `font: false` (no Google Fonts) and its `offline` plugin the site needs no network at all. Search runs in a
    web worker, which a browser refuses on a page opened from file://: there a banner says how to serve the site
    (python -m http.server -d _docs 8000), where search works.
  * mkdocs-jupyter renders each notebook with nbconvert, i.e. its markdown as Jupyter renders it
    (CommonMark: lists straight after a paragraph, tables, raw HTML); feeding the notebooks' markdown
    to Python-Markdown instead would re-render it differently. Sphinx + myst-nb would also render
    them faithfully, but for a 19-page site it is a heavier toolchain (sphinx, myst-parser, myst-nb,
    jupyter-cache, a theme), a slower build, and it too loads MathJax and the widget manager from a CDN.
  Both tools are small pure-Python dev requirements in settings.ini (`pip install -e .[dev]`).

What this builder adds around mkdocs, because the notebooks are nbdev notebooks saved without outputs:
  1. execute: each notebook runs in its own process from nbs/ as nbdev_test runs it (cells flagged with
     a tst_flag such as `#| gpu`, and `#| eval: false`, are skipped), one torch thread, --jobs at once.
     An executed notebook is cached in _proc/executed/ under a hash of the notebook, the package and
     data/, so a rebuild only re-runs what changed (`--fresh` ignores the cache; `--execute none` or a
     comma-separated list of notebooks renders the others unexecuted, with their show_doc output only).
     A widget output is replaced by a static HTML snapshot of the widget (its images, captions and
     controls as they were), taken in the executing process: a docs page has no kernel to drive it.
  2. process: nbdev's own doc processors (hidden cells dropped, directives stripped, show_doc rendered,
     symbols linked); the Quarto front matter they make from the title cell becomes a heading and a
     lead paragraph again; `#| echo: false` hides the input; $math$ becomes MathML (latex2mathml: the
     browser renders it, no MathJax); nbdev's absolute doc links and the index's links to nbs/*.ipynb
     become links to the site's pages, named as nbdev names them (04_plan.ipynb -> plan.html), so
     the symbol links nbdev writes (`plan.html#plan_linears`) resolve here as on an nbdev site.
  3. render: mkdocs builds the site from a mkdocs.yml generated in a temporary folder (no generated
     config lands in the repository), the nav listing the notebooks in order.
  4. check: every page's scripts and styles are local (any CDN tag left by a template is dropped),
     symbol anchors are matched to the headings' ids, and every internal link must resolve: the build
     fails and names the link otherwise.
"""
from __future__ import annotations
import argparse, base64, hashlib, html, json, os, re, shutil, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit, unquote

ROOT = Path(__file__).resolve().parent.parent
NBS, CACHE = ROOT/'nbs', Path(os.environ.get('DIFFQ_DOCS_CACHE') or ROOT/'_proc'/'executed')  # the cache: env for tests
BUILDER_VERSION = '3'  # bump when execution changes what a cached notebook holds
MARKER = '.diffq_docs_site'  # written into every site this builder makes: only such a folder is ever replaced
CELL_TIMEOUT = 1200  # seconds a cell may run before its notebook's build is stopped (--timeout)

class DocsError(Exception):
    "A failure the builder reports in one line (naming the notebook and cell), with no traceback."

def _say(msg: str, code: int):
    print(f'build_docs.py: {msg}', file=sys.stderr); raise SystemExit(code)
WIDGET_MIME = 'application/vnd.jupyter.widget-view+json'

def _config():
    from nbdev.config import get_config
    return get_config(path=ROOT)

def page_name(nb: Path | str) -> str:
    "The page a notebook becomes, as nbdev names it: 04_plan.ipynb -> plan (index stays index)."
    return re.sub(r'^\d+[a-zA-Z0-9]*_', '', Path(nb).stem)

def notebooks(folder: Path | None = None) -> list[Path]:
    "The notebooks of the site (of `folder`, default nbs/), in nav order: index first, then the numbered ones."
    nbs = sorted(p for p in Path(folder or NBS).glob('*.ipynb') if not p.name.startswith('_'))
    return sorted(nbs, key=lambda p: (p.stem != 'index', p.name))

def check_notebooks(nbs: list[Path]):
    "Every notebook readable as one (JSON with cells) before any work: DocsError naming the first that is not."
    for p in nbs:
        try: d = json.loads(p.read_text(encoding='utf-8'))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DocsError(f'{_rel(p)}: not a readable notebook ({type(e).__name__}: {e}); restore it (git checkout -- {_rel(p)})') from None
        if not isinstance(d, dict) or not isinstance(d.get('cells'), list):
            raise DocsError(f'{_rel(p)}: not a notebook (no list of cells)')

def nav_label(stem: str, title: str) -> str:
    "A sidebar label a reader can read: the title without its number or underscores ('__main__' -> 'Main')."
    if stem == 'index': return 'Home'
    t = re.sub(r'_+', ' ', title).strip() or stem
    return ACRONYMS.get(t.lower(), t[0].upper() + t[1:])

ACRONYMS = {'cli': 'CLI', 'gguf': 'GGUF'}  # page titles that are names, not words

def check_out(out: Path) -> Path:
    "`out` resolved, if the builder may (re)place a site there: else DocsError (exit 2) saying why, before any work."
    out = Path(out).expanduser().resolve()
    if out.exists() and not out.is_dir(): raise DocsError(f'--out {out}: it is a file, not a folder; name a folder for the site')
    if out.is_dir() and any(out.iterdir()) and not (out/MARKER).exists() and not _legacy_site(out):
        raise DocsError(f'--out {out}: refusing to replace a folder this builder did not make (it has files and no {MARKER}); '
                        'name a new or empty folder')
    if out == ROOT or out in ROOT.parents or out == NBS: raise DocsError(f'--out {out}: that folder holds the sources')
    return out

def _legacy_site(out: Path) -> bool:
    "A site an earlier version of this builder made (before the marker): only mkdocs's outputs, with the builder's CSS."
    made = {'assets', 'search', 'sitemap.xml', 'sitemap.xml.gz'}
    return (out/'assets'/'extra.css').is_file() and all(p.name in made or p.suffix == '.html' for p in out.iterdir())

# ------------------------------------------------------------------------------------------ 1. execute
def _skip_re():
    flags = '|'.join(map(re.escape, _config().tst_flags.split()))
    return re.compile(r'^#\|\s*(eval:\s*false|' + flags + r')\b', re.M)

def widget_html(w) -> str:
    "A static HTML snapshot of an ipywidget as it is now: images inline, HTML and labels as text, controls as their value."
    import ipywidgets as W
    esc = lambda s: html.escape(str(s))
    desc = lambda w: f'<span class="ws-desc">{esc(w.description)}</span> ' if getattr(w, 'description', '') else ''
    lay = getattr(w, 'layout', None)  # the sizes the widget's Layout sets, as inline style
    style = ';'.join(f'{k.replace("_", "-")}:{v}' for k in ('width', 'height', 'max_width', 'max_height')
                     if (v := getattr(lay, k, None))) if lay is not None else ''
    style = f' style="{esc(style)}"' if style else ''
    if isinstance(w, W.Box):
        kids = ''.join(widget_html(c) for c in w.children)
        return f'<div class="ws-box {"ws-row" if isinstance(w, W.HBox) else "ws-col"}"{style}>{kids}</div>'
    if isinstance(w, W.Image):
        fmt = w.format if w.format != 'url' else 'png'
        b64 = base64.b64encode(bytes(w.value)).decode()
        width = f' width="{esc(w.width)}"' if w.width else ''
        return f'<img class="ws-image" src="data:image/{esc(fmt)};base64,{b64}"{width}{style} alt="widget image">'
    if isinstance(w, (W.HTML, W.HTMLMath)): return f'<div class="ws-html">{desc(w)}{w.value}</div>'
    if isinstance(w, W.Label): return f'<span class="ws-label">{esc(w.value)}</span>'
    if isinstance(w, (W.ToggleButtons, W.RadioButtons, W.Dropdown, W.Select, W.SelectionSlider)):
        opts = ''.join(f'<span class="ws-option{" ws-selected" if l == w.label else ""}">{esc(l)}</span>' for l in w._options_labels)
        return f'<div class="ws-control">{desc(w)}{opts}</div>'
    if isinstance(w, W.ValueWidget):
        return f'<div class="ws-control">{desc(w)}<span class="ws-value">{esc(w.value)}</span></div>'
    return f'<span class="ws-other">[{esc(type(w).__name__)}]</span>'

def _snapshot_widgets(cell):
    "Replace each widget output of an executed cell by its static snapshot (the live widget is in this process)."
    from ipywidgets.widgets.widget import _instances
    for o in cell.get('outputs', []):
        data = o.get('data', {})
        if WIDGET_MIME not in data: continue
        w = _instances.get(data[WIDGET_MIME].get('model_id'))
        snap = widget_html(w) if w is not None else '<p>(widget)</p>'
        o['data'] = {'text/html': '<div class="widget-snapshot">' + snap + '<p class="widget-note">A static snapshot '
                     'of an interactive widget: open the notebook in JupyterLab to use it.</p></div>'}

def _execute_here(src: Path, dst: Path):
    "Run `src` in this process like nbdev_test (from nbs/, flagged cells skipped) and write it, with outputs, to `dst`."
    from execnb.nbio import read_nb, write_nb
    from execnb.shell import CaptureShell
    import torch
    torch.set_num_threads(1)
    skip = _skip_re()
    from nbdev.process import NBProcessor
    from nbdev.processors import populate_language, add_show_docs
    nb = read_nb(src)
    NBProcessor(nb=nb, procs=[populate_language, add_show_docs], rm_directives=False).process()  # nbdev's implicit show_doc cells, run in place
    os.chdir(src.parent)
    shell = CaptureShell(src)
    shell.run_cell('from nbdev.showdoc import show_doc')
    status = os.environ.get('DIFFQ_DOCS_STATUS')
    def pre(c):
        skipped = c.cell_type == 'code' and bool(skip.search(c.source))
        if status and c.cell_type == 'code' and not skipped:  # which cell runs now: the parent names it if the process ends here
            Path(status).write_text(json.dumps({'cell': c.idx_, 'line': c.source.strip().splitlines()[0][:60] if c.source.strip() else ''}))
        return skipped
    try: shell.run_all(nb, exc_stop=True, preproc=pre, postproc=_snapshot_widgets)
    except BaseException as e:  # one line for the parent, naming the cell (its traceback stays in the notebook's own run)
        at = json.loads(Path(status).read_text()) if status and Path(status).exists() else {}
        if status: Path(status).write_text(json.dumps({**at, 'done': True}))  # the cells are over: no timeout from here
        print(f'DIFFQ-DOCS-ERROR: cell [{at.get("cell", "?")}] {at.get("line", "")!r} raised {type(e).__name__}: '
              f'{(str(e).strip().splitlines() or [""])[0][:300]}', file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if status: Path(status).write_text(json.dumps({'done': True}))
    for c in nb.cells: c.get('metadata', {}).pop('execution', None)
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_nb(nb, dst)

def _state_hash() -> str:
    "What every notebook's outputs depend on besides itself: the package, the data it reads, this builder."
    h = hashlib.sha256(BUILDER_VERSION.encode())
    files = sorted((ROOT/'diffq_lab').rglob('*.py')) + sorted(p for p in (ROOT/'data').rglob('*')
                                                              if p.is_file() and 'cache' not in p.relative_to(ROOT/'data').parts)
    for p in files: h.update(str(p.relative_to(ROOT)).encode()); h.update(p.read_bytes())
    return h.hexdigest()

def _rel(p: Path) -> str:
    try: return str(p.relative_to(ROOT))
    except ValueError: return str(p)

_ENV = {'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false', 'MPLBACKEND': 'Agg',
        'TQDM_DISABLE': '1', 'HF_HUB_DISABLE_PROGRESS_BARS': '1'}  # no progress bars in a page: they read as errors there

def _run_one(nb: Path, dst: Path, timeout: int = CELL_TIMEOUT) -> tuple[Path, str]:
    "Execute `nb` into `dst` in its own process, watched: (nb, '') when it ran whole, else (nb, one line saying where it stopped)."
    env = {**os.environ, **_ENV, 'HF_HUB_OFFLINE': os.environ.get('HF_HUB_OFFLINE', '1')}
    t = time.time()
    with tempfile.TemporaryDirectory(prefix='diffq_docs_exec_') as tmp:
        status, log = Path(tmp)/'status.json', Path(tmp)/'stderr.txt'
        env['DIFFQ_DOCS_STATUS'] = str(status)
        dst.unlink(missing_ok=True)
        with open(log, 'w') as err:
            proc = subprocess.Popen([sys.executable, __file__, '_exec', str(nb), str(dst)], stdout=subprocess.DEVNULL, stderr=err, env=env)
            started, last = time.time(), None
            while proc.poll() is None:  # the per-cell timeout: a cell is timed from when it starts
                try: mark = status.read_text()
                except OSError: mark = None  # not yet (the imports before the first cell get 10 minutes at least)
                if mark != last: started, last = time.time(), mark
                if time.time() - started > (max(timeout, 600) if not last or '"done"' in last else timeout):
                    proc.kill(); proc.wait()
                    return nb, f'{_cell(status)} ran past the {timeout} s cell timeout (--timeout)'
                time.sleep(0.2)
        lines = [l for l in log.read_text(errors='replace').splitlines() if l.strip()]
        mine = [l.removeprefix('DIFFQ-DOCS-ERROR: ') for l in lines if l.startswith('DIFFQ-DOCS-ERROR: ')]
        if mine: err = mine[-1]
        elif proc.returncode != 0: err = f'{_cell(status)} ended the process with exit code {proc.returncode}' + (f': {lines[-1][:300]}' if lines else '')
        elif not dst.exists(): err = f'{_cell(status)} ended the process (exit code 0, e.g. sys.exit or os._exit) before the notebook finished'
        else: err = ''
    print(f'  executed {nb.name} in {time.time() - t:.1f} s' + (' FAILED' if err else ''), flush=True)
    return nb, err

def _cell(status: Path) -> str:
    "The cell the status file names, as 'cell [i] 'first line''."
    try: at = json.loads(status.read_text())
    except (OSError, ValueError): return 'the notebook (before its first cell)'
    return f'cell [{at.get("cell", "?")}] {at.get("line", "")!r}'

def execute_all(nbs: list[Path], jobs: int = 2, fresh: bool = False, stale_ok: bool = False, timeout: int = CELL_TIMEOUT) -> dict[Path, Path]:
    "Executed copies of `nbs` (cached by content), each run in a fresh process; raise naming every notebook that failed."
    state = _state_hash()
    out, todo = {}, []
    for nb in nbs:
        key = hashlib.sha256((state + nb.read_text(encoding='utf-8')).encode()).hexdigest()[:16]
        dst = CACHE/f'{nb.stem}.{key}.ipynb'
        out[nb] = dst
        if not dst.exists() and stale_ok and (runs := sorted(CACHE.glob(f'{nb.stem}.*.ipynb'), key=lambda p: p.stat().st_mtime)):
            out[nb] = runs[-1]; print(f'  reusing {runs[-1].name} (an older run: the notebook, package or data changed since)')
        elif fresh or not dst.exists(): todo.append((nb, dst))
    if todo: print(f'executing {len(todo)} notebook(s), {jobs} at a time ({len(nbs) - len(todo)} reused from {_rel(CACHE)})')
    with ThreadPoolExecutor(max(1, jobs)) as ex: results = list(ex.map(lambda job: _run_one(*job, timeout=timeout), todo))
    failed = [f'{nb.name}: {err}' for nb, err in results if err]
    if failed: raise DocsError('\n'.join(failed))
    for nb, _ in todo:  # keep the 3 newest runs of each notebook (another build may be using an older one)
        for old in sorted(CACHE.glob(f'{nb.stem}.*.ipynb'), key=lambda p: p.stat().st_mtime, reverse=True)[3:]:
            old.unlink(missing_ok=True)
    return out

# ------------------------------------------------------------------------------------------ 2. process
def _fm2md(src: str, site: bool = True) -> str:
    "nbdev's Quarto front matter (title, description) as the title cell it was made from (a lead paragraph on the site)."
    import yaml
    m = re.match(r'\s*---\s*\n(.*?)\n---\s*$', src, re.S)
    fm = (yaml.safe_load(m.group(1)) if m else None) or {}
    title, desc = fm.get('title', ''), fm.get('description', '')
    lead = (f'<div class="nb-lead">\n\n{desc}\n\n</div>' if site else f'> {desc}') if desc else ''  # markdown inside
    return (f'# {title}\n\n' if title else '') + lead + '\n'

_MATH = re.compile(r'(?<![\\$\w])\$(?!\s)([^$\n]+?)(?<!\s)\$(?![\w$])')
_CODE = re.compile(r'(```.*?```|`[^`\n]*`)', re.S)

def math_to_mathml(md: str) -> str:
    "Inline $...$ (outside code) as MathML, which browsers render natively: no MathJax to load."
    from latex2mathml.converter import convert
    def conv(m):
        try: return convert(m.group(1))
        except Exception: return m.group(0)
    return ''.join(p if i % 2 else _MATH.sub(conv, p) for i, p in enumerate(_CODE.split(md)))

def _link_rewriter(pages: set[str]):
    cfg = _config()
    site = (cfg.doc_host.rstrip('/') + '/' + cfg.doc_baseurl.strip('/')).rstrip('/') + '/'
    absolute = re.compile(re.escape(site) + r'([\w.-]+)\.html')
    local_nb = re.compile(r'(?<=\]\()(?:\.?/?nbs/)?(\d+[a-zA-Z0-9]*_[\w-]+|index)\.ipynb|'
                          r'(?<=href=")(?:\.?/?nbs/)?(\d+[a-zA-Z0-9]*_[\w-]+|index)\.ipynb')
    def rw(s: str) -> str:
        s = re.sub(r'\{target="_blank"[^}]*\}', '', s)  # Quarto link attributes mean nothing here
        s = absolute.sub(lambda m: f'{m.group(1)}.html', s)
        def nb(m):
            name = page_name(m.group(1) or m.group(2))
            return f'{name}.html' if name in pages else m.group(0)
        return local_nb.sub(nb, s)
    return rw

_BAR = re.compile(r'\d+%\|.*\|\s*\d+/\d+|\d+(?:\.\d+)?(?:it|s)/(?:s|it)\]|^\s*\x1b\[A')

def _no_progress(o: dict) -> dict | None:
    "A stderr stream without its progress-bar lines (tqdm, diffusers, transformers), or None when nothing else is left."
    if o.get('output_type') != 'stream' or o.get('name') != 'stderr': return o
    text = ''.join(o['text']) if isinstance(o.get('text'), list) else (o.get('text') or '')
    keep = [l for l in re.split(r'[\r\n]+', text) if l.strip() and not _BAR.search(l)]
    return {**o, 'text': '\n'.join(keep) + '\n'} if keep else None

def _doc_procs(executed: bool) -> list:
    "nbdev's doc processors (FilterDefaults), less what an executed notebook already did, with a lenient show_doc run otherwise."
    import nbdev.processors as P
    class exec_show_docs_lenient(P.exec_show_docs):
        "nbdev's exec_show_docs runs export, import and show_doc cells out of context: a cell that needs an unrun one fails; drop its output."
        def __call__(self, cell):
            try: super().__call__(cell)
            except Exception:
                self.k.exc = None
                cell.outputs = [o for o in cell.get('outputs', []) if o.get('output_type') != 'error']
    procs = []
    for proc in P.FilterDefaults().procs():
        if executed and proc in (P.add_show_docs, P.exec_show_docs): continue  # ran with the notebook, in context
        procs.append(exec_show_docs_lenient if proc is P.exec_show_docs else proc)
    return procs

def processed(nb_path: Path, executed: Path | None, pages: set[str], site: bool = True) -> dict:
    "The notebook as its docs page (or, `site=False`, the README) shows it: nbdev's doc processors, then the fixes above."
    from execnb.nbio import read_nb, nb2str
    from nbdev.process import NBProcessor
    nb = read_nb(executed or nb_path)
    nb.path_ = str(nb_path)  # nbdev's processors name the page from it
    if executed: nb.has_docs_ = True
    cwd = os.getcwd(); os.chdir(nb_path.parent)
    try: NBProcessor(nb=nb, procs=_doc_procs(executed is not None)).process()
    finally: os.chdir(cwd)
    d = json.loads(nb2str(nb))
    d['metadata'].pop('widgets', None)  # saved widget state would pull the widget manager from a CDN
    rw, cells = _link_rewriter(pages), []
    for c in d['cells']:
        src = ''.join(c['source']) if isinstance(c['source'], list) else (c['source'] or '')
        c.pop('idx_', None); c.get('metadata', {}).pop('execution', None)
        if c['cell_type'] == 'raw' and src.lstrip().startswith('---'):
            c = {'cell_type': 'markdown', 'metadata': {}, 'source': _fm2md(src, site)}; cells.append(c); continue
        if c['cell_type'] == 'code':
            if re.search(r'^#\|\s*echo:\s*false', src, re.M): c.setdefault('metadata', {})['tags'] = ['remove_input']
            src = '\n'.join(l for l in src.splitlines() if not l.startswith('#|')).strip()
            if not src and not c.get('outputs'): continue
        if c['cell_type'] == 'markdown':
            if not src.strip(): continue
            src = math_to_mathml(rw(src)) if site else src
        c['source'] = src
        if c['cell_type'] == 'code': c['outputs'] = [o for o in map(_no_progress, c.get('outputs', [])) if o is not None]
        for o in c.get('outputs', []):
            for k, v in o.get('data', {}).items():
                if k in ('text/markdown', 'text/html'):
                    o['data'][k] = rw(''.join(v) if isinstance(v, list) else v)
        cells.append(c)
    for i, c in enumerate(cells): c.setdefault('id', f'docs-{i}')  # cells the processors added have none
    d['cells'] = cells
    d['nbformat'], d['nbformat_minor'] = 4, max(5, d.get('nbformat_minor', 5))
    return d

# ------------------------------------------------------------------------------------------ 3. render
EXTRA_CSS = """
.md-grid { max-width: 90rem; }
.md-typeset .jupyter-wrapper h1 { margin-bottom: 0.3em; }
.nb-lead p { font-size: 1.1em; color: var(--md-default-fg-color--light); margin-top: -0.4em; }
.md-typeset .jupyter-wrapper table:not([class]) { font-size: 0.62rem; }
.md-typeset .jupyter-wrapper table:not([class]) td, .md-typeset .jupyter-wrapper table:not([class]) th { padding: 0.35em 0.7em; }
/* show_doc: the source link beside the symbol's heading, as on an nbdev site */
.jp-RenderedMarkdown > hr + p:has(> a:only-child) { float: right; margin: 1.1em 0 0; font-size: 0.8em; }
.jupyter-wrapper .jp-OutputArea-output { overflow-x: auto; }
/* wide tables scroll inside the page instead of being clipped at its edge */
.md-typeset .jupyter-wrapper table { display: block; max-width: 100%; overflow-x: auto; }
.md-typeset .jupyter-wrapper .jp-RenderedHTMLCommon { overflow-x: auto; }
.file-banner { background: #fff3cd; color: #5c4400; padding: 0.5em 1em; font-size: 0.7rem; border-bottom: 1px solid #e0c872; }
.file-banner code { background: transparent; }
.widget-snapshot { border: 1px dashed var(--md-default-fg-color--lighter); padding: 0.6em; border-radius: 4px; }
.widget-snapshot .ws-row { display: flex; gap: 0.8em; flex-wrap: wrap; align-items: flex-start; }
.widget-snapshot .ws-col { display: flex; flex-direction: column; gap: 0.4em; align-items: flex-start; }
.widget-snapshot .ws-image { image-rendering: pixelated; }
.widget-snapshot .ws-option { display: inline-block; padding: 0.1em 0.6em; margin: 0 0.2em; border: 1px solid #bbb; border-radius: 3px; }
.widget-snapshot .ws-selected { background: var(--md-primary-fg-color); color: var(--md-primary-bg-color); }
.widget-snapshot .widget-note { font-size: 0.8em; color: var(--md-default-fg-color--light); margin: 0.4em 0 0; }
math { font-size: 1.05em; }
"""

# Opened from file://, a browser refuses the search's web worker (search stays at "Initializing search"): say how to serve.
EXTRA_JS = """
document.addEventListener('DOMContentLoaded', function () {
  if (location.protocol !== 'file:') return;
  var b = document.createElement('div');
  b.className = 'file-banner';
  b.innerHTML = 'Search needs the site served over HTTP (a browser blocks it on pages opened from a file): run ' +
    '<code>python -m http.server -d _docs 8000</code> in the checkout and open <code>http://localhost:8000</code>.';
  document.body.insertBefore(b, document.body.firstChild);
  var q = document.querySelector('.md-search__input');
  if (q) { q.placeholder = 'Search: serve the site (see the banner)'; }
});
"""

def _title(d: dict, fallback: str) -> str:
    for c in d['cells']:
        if c['cell_type'] == 'markdown' and (m := re.match(r'#\s+(.+)', c['source'])): return m.group(1).strip()
    return fallback

def _nb_toc_tokens(fpath, toc_depth):
    """A page's contents (mkdocs toc tokens) from its markdown cells' headings, each with the id its rendered
    heading has. mkdocs-jupyter re-parses the notebook with Python-Markdown for this, which drops `code` from
    a heading's slug (`## The `auto` ladder` -> #the-ladder, while the page says id="the-auto-ladder")."""
    from nbconvert.filters.markdown_mistune import markdown2html_mistune
    flat = []
    for c in json.loads(Path(fpath).read_text(encoding='utf-8'))['cells']:
        if c['cell_type'] != 'markdown': continue
        src = re.sub(r'^```.*?^```', '', ''.join(c['source']), flags=re.S | re.M)
        for m in re.finditer(r'^(#{1,6})\s+\S.*$', src, re.M):
            level = len(m.group(1))
            if level > toc_depth: continue
            h = markdown2html_mistune(m.group(0))  # the same renderer, so the same id, as the page
            if not (i := re.search(r'\sid="([^"]+)"', h)): continue
            name = html.unescape(re.sub(r'<a class="anchor-link".*?</a>|<[^>]+>', '', h)).strip()
            flat.append({'level': level, 'id': i.group(1), 'name': name, 'html': name, 'data-toc-label': '', 'children': []})
    root, stack = [], []
    for t in flat:
        while stack and stack[-1]['level'] >= t['level']: stack.pop()
        (stack[-1]['children'] if stack else root).append(t); stack.append(t)
    return root, next((t['name'] for t in flat if t['level'] == 1), None)

def render(docs: dict[str, dict], navs: list[tuple[str, str]], out: Path):
    "Write the processed notebooks and a generated mkdocs.yml to a temporary folder, and build the site into `out`."
    import tempfile
    with tempfile.TemporaryDirectory(prefix='diffq_docs_') as stage: _render(docs, navs, out, Path(stage))

def _render(docs, navs, out: Path, stage: Path):
    import yaml
    from mkdocs.config import load_config
    from mkdocs.commands.build import build
    import mkdocs_jupyter.plugin as mkj
    if hasattr(mkj, '_get_nb_toc_tokens'): mkj._get_nb_toc_tokens = _nb_toc_tokens  # else the anchor check says what broke
    cfg = _config()
    (stage/'docs'/'assets').mkdir(parents=True)
    for name, d in docs.items(): (stage/'docs'/f'{name}.ipynb').write_text(json.dumps(d), encoding='utf-8')
    (stage/'docs'/'assets'/'extra.css').write_text(EXTRA_CSS)
    (stage/'docs'/'assets'/'extra.js').write_text(EXTRA_JS)
    conf = {
        'site_name': cfg.title, 'site_description': cfg.description,
        'docs_dir': str(stage/'docs'), 'site_dir': str(out), 'use_directory_urls': False,
        'repo_url': cfg.git_url, 'edit_uri': '',
        'theme': {'name': 'material', 'font': False, 'features': ['navigation.top', 'navigation.tracking', 'toc.follow',
                  'search.highlight', 'content.code.copy'],
                  'palette': [{'scheme': 'default', 'primary': 'indigo', 'toggle': {'icon': 'material/brightness-7', 'name': 'Dark mode'}},
                              {'scheme': 'slate', 'primary': 'indigo', 'toggle': {'icon': 'material/brightness-4', 'name': 'Light mode'}}]},
        'plugins': ['search', 'offline', {'mkdocs-jupyter': {
            'include': ['*.ipynb'], 'execute': False, 'ignore_h1_titles': True, 'include_source': False, 'no_prompt': True, 'toc_depth': 3,
            'remove_tag_config': {'remove_input_tags': ['remove_input']}, 'cache': False, 'include_requirejs': False}}],
        'extra_css': ['assets/extra.css'], 'extra_javascript': ['assets/extra.js'],
        'nav': [{title: f'{name}.ipynb'} for name, title in navs],
        'validation': {'nav': {'omitted_files': 'warn'}, 'links': {'not_found': 'warn'}},
    }
    yml = stage/'mkdocs.yml'
    yml.write_text(yaml.safe_dump(conf, sort_keys=False))
    import logging
    logging.getLogger('mkdocs').setLevel(logging.WARNING)
    build(load_config(str(yml)))

# ------------------------------------------------------------------------------------------ 4. check
_ID = re.compile(r'\sid="([^"]+)"')
_HREF = re.compile(r'<(a|link|script|img|iframe|source)\b[^>]*?\s(href|src)="([^"]*)"', re.I)
_EXTERNAL_ASSET = re.compile(r'<script\b[^>]*\ssrc="(?:https?:)?//[^"]*"[^>]*>\s*</script>|'
                             r'<link\b[^>]*\shref="(?:https?:)?//[^"]*"[^>]*>', re.I)

def _is_internal(url: str) -> bool:
    return bool(url) and not re.match(r'^(?:[a-z][a-z0-9+.-]*:|//)', url, re.I)

def _symbol_anchors() -> set[str]:
    "The `page.html#anchor` targets nbdev links symbols to (from _modidx)."
    import importlib
    modidx = importlib.import_module(f'{_config().lib_name}._modidx')
    return {t[0] for m in modidx.d['syms'].values() for t in m.values()}

def postprocess(out: Path) -> tuple[list[str], list[str]]:
    """Drop CDN tags and point links at the ids the pages have. Returns (dead, stray): internal links whose page
    does not exist, and links whose #anchor names no id on an existing page (a heading renamed in a notebook).
    A symbol link whose object has no show_doc heading points at its module's page instead."""
    pages = {p: p.read_text(encoding='utf-8') for p in out.rglob('*.html')}
    for p, text in pages.items():  # MathJax / mermaid / require.js from a CDN: dead offline, and nothing here needs them
        text = _EXTERNAL_ASSET.sub('', text)
        text = re.sub(r'<script type="module">\s*(?:(?!</script>).)*?https?://(?:(?!</script>).)*</script>', '', text, flags=re.S)
        text = re.sub(r'<script type="text/x-mathjax-config">.*?</script>', '', text, flags=re.S)
        text = re.sub(r'<!-- Load mathjax -->\s*(<script src="">\s*</script>)?|<!-- MathJax configuration -->.*?<!-- End of mathjax configuration -->',
                      '', text, flags=re.S)  # what the template leaves of MathJax: math is MathML here
        pages[p] = text
    ids = {p: set(_ID.findall(t)) for p, t in pages.items()}
    lower = {p: {i.lower(): i for i in s} for p, s in ids.items()}
    symbols = _symbol_anchors()
    dead, stray = [], []
    for p, text in pages.items():
        def fix(m):
            url = m.group(3)
            if not _is_internal(url): return m.group(0)
            parts = urlsplit(url)
            path, frag = unquote(parts.path), unquote(parts.fragment)
            target = ((out/path.lstrip('/')) if path.startswith('/') else (p.parent/path)).resolve() if path else p
            if not target.exists():
                dead.append(f'{p.relative_to(out)}: {url}'); return m.group(0)
            if not frag or target.suffix != '.html' or frag in ids.get(target, ()): return m.group(0)
            real = lower.get(target, {}).get(frag.lower())  # nbdev writes Quarto's lower-case ids
            if real: return m.group(0).replace(url, (parts.path + '#' if parts.path else '#') + real)
            if f'{target.name}#{frag}' in symbols:  # documented in its module, without a heading of its own
                return m.group(0).replace(url, parts.path or target.name)
            stray.append(f'{p.relative_to(out)}: {url}'); return m.group(0)
        pages[p] = _HREF.sub(fix, text)
    for p, text in pages.items(): p.write_text(text, encoding='utf-8')
    return dead, stray

def external_assets(out: Path) -> list[str]:
    "Scripts, styles, images or frames the site would load from another host."
    bad = []
    for p in out.rglob('*.html'):
        for m in _HREF.finditer(p.read_text(encoding='utf-8')):
            tag, attr, url = m.groups()
            if tag.lower() != 'a' and re.match(r'^(?:https?:)?//', url) and not (tag.lower() == 'link' and 'rel="canonical"' in m.group(0)):
                bad.append(f'{p.name}: <{tag} {attr}="{url}">')
    return bad

# ------------------------------------------------------------------------------------------ commands
def html_site(execute: str = 'all', out: Path = ROOT/'_docs', jobs: int = 2, fresh: bool = False,
              only: list[str] | None = None, strict_anchors: bool = False, stale_ok: bool = False,
              timeout: int = CELL_TIMEOUT, folder: Path | None = None) -> Path:
    "Build the site: execute what `execute` names ('all', 'none' or notebook names), process, render, check."
    t0 = time.time()
    out = check_out(out)
    nbs = notebooks(folder)
    check_notebooks(nbs)
    if only: nbs = [p for p in nbs if p.stem in only or page_name(p) in only]
    want = {p.stem for p in nbs} if execute == 'all' else set() if execute == 'none' else set(execute.split(','))
    unknown = want - {p.stem for p in nbs} - {page_name(p) for p in nbs}
    if unknown: raise SystemExit(f'no notebook named {sorted(unknown)}')
    to_run = [p for p in nbs if p.stem in want or page_name(p) in want]
    executed = execute_all(to_run, jobs=jobs, fresh=fresh, stale_ok=stale_ok, timeout=timeout)
    t1 = time.time()
    pages = {page_name(p) for p in nbs}
    docs, navs = {}, []
    for p in nbs:
        d = processed(p, executed.get(p), pages)
        docs[page_name(p)] = d
        navs.append((page_name(p), nav_label(p.stem, _title(d, page_name(p)))))
    t2 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f'.{out.name}.building-'))
    try:
        render(docs, navs, stage)
        dead, stray = postprocess(stage)
        ext = external_assets(stage)
        for s in stray: print(f'warning: link to a missing anchor (a renamed heading?) {s}')
        bad = ['dead internal link ' + d for d in dead] + ['external asset ' + e for e in ext]
        if strict_anchors: bad += ['missing anchor ' + s for s in stray]
        if bad: raise SystemExit('docs check failed:\n  ' + '\n  '.join(bad))
        (stage/MARKER).write_text('made by tools/build_docs.py: the builder replaces this folder on its next build\n')
        os.chmod(stage, 0o755)  # mkdtemp makes 0700
        check_out(out)  # still ours (or new) now that the site is ready
        if out.exists(): shutil.rmtree(out)
        os.replace(stage, out)
    finally: shutil.rmtree(stage, ignore_errors=True)
    print(f'wrote {len(docs)} pages to {out} (execute {t1 - t0:.0f} s, process {t2 - t1:.0f} s, render {time.time() - t2:.0f} s)')
    print(f'open {out/"index.html"}; for search, serve it: python -m http.server -d {_rel(out)} 8000')
    return out

def readme():
    "README.md from nbs/index.ipynb (executed, or reused from the cache), as GitHub shows it."
    from nbconvert import MarkdownExporter
    from traitlets.config import Config
    import nbformat
    idx = NBS/'index.ipynb'
    check_notebooks([idx])
    d = processed(idx, execute_all([idx])[idx], pages=set(), site=False)  # links to nbs/*.ipynb stay: they work on GitHub
    c = Config(); c.TagRemovePreprocessor.remove_input_tags = {'remove_input'}; c.TagRemovePreprocessor.enabled = True
    body, _ = MarkdownExporter(config=c).from_notebook_node(nbformat.reads(json.dumps(d), as_version=4))
    body = re.sub(r'\n{3,}', '\n\n', body).strip() + '\n'
    readme_md = ROOT/'README.md'
    old = readme_md.read_text() if readme_md.exists() else ''
    if old == body: return print('README.md unchanged')
    readme_md.write_text(body)
    import difflib
    n = sum(1 for l in difflib.unified_diff(old.splitlines(), body.splitlines(), lineterm='', n=0)
            if l[:1] in '+-' and not l.startswith(('+++', '---')))
    print(f'wrote README.md: {n} line(s) changed in a tracked file (review: git diff README.md)')

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = ap.add_subparsers(dest='cmd', required=True)
    h = sub.add_parser('html', help='the static site, into _docs/')
    h.add_argument('--execute', default='all', help="'all' (default), 'none', or notebook names separated by commas")
    h.add_argument('--only', default='', help='build only these notebooks (comma-separated names)')
    h.add_argument('--out', default=str(ROOT/'_docs'), help=f'the site folder (default _docs/): new, empty, or a site this builder made ({MARKER})')
    h.add_argument('--timeout', type=int, default=CELL_TIMEOUT, help=f'seconds a cell may run (default {CELL_TIMEOUT})')
    h.add_argument('--nbs', default=str(NBS), help='the folder of notebooks (default nbs/)')
    h.add_argument('--jobs', type=int, default=2, help='notebooks executed at once (one torch thread each)')
    h.add_argument('--fresh', action='store_true', help='execute again even where a cached run matches')
    h.add_argument('--stale-ok', action='store_true', help='reuse the newest cached run of a notebook even if it, the package or data/ changed since (fast, for work on the docs)')
    h.add_argument('--strict-anchors', action='store_true', help='fail on a link to a missing #anchor too (else a warning)')
    sub.add_parser('readme', help='README.md from nbs/index.ipynb')
    e = sub.add_parser('_exec'); e.add_argument('src'); e.add_argument('dst')
    a = ap.parse_args(argv)
    if a.cmd == '_exec': return _execute_here(Path(a.src).resolve(), Path(a.dst).resolve())
    if a.cmd == 'html' and a.timeout < 1: ap.error(f'--timeout must be >= 1 second, got {a.timeout}')
    try:
        if a.cmd == 'html':
            html_site(a.execute, Path(a.out), a.jobs, a.fresh, [s for s in a.only.split(',') if s] or None, a.strict_anchors,
                      a.stale_ok, a.timeout, Path(a.nbs))
        else: readme()
    except DocsError as e:
        _say(str(e), 2 if str(e).startswith('--out') else 1)
    except KeyboardInterrupt: _say('interrupted; the site in --out is as it was', 130)

if __name__ == '__main__':
    main()
