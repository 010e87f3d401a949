"""The lab's docs, built offline: `make docs` (a static site in _docs/) and `make readme` (README.md).

    python tools/build_docs.py html [--execute all|none|NAME,...] [--out DIR] [--nbs DIR] [--jobs N] [--fresh]
                                    [--cell-timeout S] [--max-cell-output MB] [--max-site-mb MB] [--strict]
    python tools/build_docs.py readme

A notebook that fails (a cell raises, ends the process, or runs past --cell-timeout, default 600 s) never stops the
site: its page opens with a banner holding the whole error in one line, then its cells as far as they ran (or
unexecuted, if the process died); the rest builds, and the command lists the failures at the end on stderr, one line
a notebook. Exit 0 then (the site is there); --strict makes it exit 1, for CI that must not publish such a page.
Output is capped: a cell's outputs beyond --max-cell-output MB (default 5) are cut with a visible note on the page,
and a site over --max-site-mb (default 300) is refused in one line, leaving --out as it was.
Bad input is refused in one line before any work, exit 2: a missing or empty --nbs; an --out that is a file, under
/proc, /sys or /dev, a mount point, unwritable, or a folder holding files this builder did not write. The site is
built in a folder beside --out and moved there whole; the builder removes only the files its manifest
(.diffq-docs-manifest.json, written into every site it makes) lists, each unchanged since (its sha256): a folder with
any other file, or a page edited since, is never touched.
A notebook that is not valid JSON stops the build (exit 1): restore it. Progress goes to stderr (tqdm).

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
import argparse, base64, hashlib, html, itertools, json, os, re, shutil, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit, unquote

ROOT = Path(__file__).resolve().parent.parent
NBS, CACHE = ROOT/'nbs', Path(os.environ.get('DIFFQ_DOCS_CACHE') or ROOT/'_proc'/'executed')  # the cache: env for tests
BUILDER_VERSION = '3'  # bump when execution changes what a cached notebook holds
MANIFEST = '.diffq-docs-manifest.json'  # every file the builder wrote into a site: the only files it ever removes
OLD_MARKER = '.diffq_docs_site'  # what builders before the manifest left: such a site lists nothing, so it is refused
CELL_TIMEOUT = 600  # seconds a cell may run before its notebook is stopped (--cell-timeout)
MAX_CELL_OUTPUT_MB = 5  # a cell's outputs beyond this are cut, with a note on the page (--max-cell-output)
MAX_SITE_MB = 300  # a site bigger than this is refused (--max-site-mb): GitHub Pages takes 1 GB, a reader far less
VIRTUAL_FS = ('/proc', '/sys', '/dev')  # kernel file systems: a site cannot live there

class DocsError(Exception):
    "A failure the builder reports in one line (naming the notebook and cell), with no traceback; `code` is the exit status."
    def __init__(self, msg: str, code: int = 1): super().__init__(msg); self.code = code

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

def check_nbs(folder: Path | None) -> list[Path]:
    "The notebooks of `folder` (default nbs/), refused in one line (exit 2) if it is missing, not a folder, or holds none."
    folder = Path(folder or NBS).expanduser()
    if not folder.is_dir():
        raise DocsError(f'--nbs {folder}: ' + ('it is a file, not a folder' if folder.exists() else 'no such folder') +
                        '; name the folder of notebooks (default nbs/)', 2)
    nbs = notebooks(folder)
    if not nbs: raise DocsError(f'--nbs {folder}: no notebooks (*.ipynb) in it; name the folder of notebooks (default nbs/)', 2)
    return nbs

def _manifest(out: Path) -> dict[str, str] | None:
    "{relative posix path: sha256} of the files the builder wrote into `out`, as its manifest lists them; None without a readable one."
    try: d = json.loads((out/MANIFEST).read_text(encoding='utf-8'))
    except (OSError, UnicodeDecodeError, ValueError): return None
    files = d.get('files') if isinstance(d, dict) else None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()): return None
    return files

def _sha(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, 'rb') as f:
        for b in iter(lambda: f.read(1 << 20), b''): h.update(b)
    return h.hexdigest()

def _entries(out: Path):
    "Every file, link and folder under `out` as (path, relative posix name, is_folder), links not followed, deepest first."
    for top, dirs, files in os.walk(out, topdown=False):
        for n in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            p = Path(top)/n; yield p, p.relative_to(out).as_posix(), False
        for d in dirs:
            p = Path(top)/d
            if not p.is_symlink(): yield p, p.relative_to(out).as_posix(), True

def not_ours(out: Path, first: int | None = None) -> list[str]:
    """The files under `out` that are not as the builder wrote them: not in its manifest (all, without one), or changed
    since (another digest), or a link. What the builder must never remove; the `first` few found, or all."""
    listed = _manifest(out) or {}
    return sorted(itertools.islice((rel for p, rel, folder in _entries(out) if not folder and not _ours(p, rel, listed)), first))

def _ours(p: Path, rel: str, listed: dict[str, str]) -> bool:
    "Whether the file `p` is one the builder wrote, as it wrote it (a plain file, with the digest its manifest lists)."
    return rel == MANIFEST or (rel in listed and not p.is_symlink() and p.is_file() and _sha(p) == listed[rel])

def check_out(out: Path) -> Path:
    "`out` resolved, if the builder may (re)place a site there: else DocsError (exit 2) saying why, before any work."
    out = Path(out).expanduser().resolve()
    say = lambda why: DocsError(f'--out {out}: {why}', 2)
    if any(out == Path(v) or Path(v) in out.parents for v in VIRTUAL_FS):
        raise say(f'it lies under {next(v for v in VIRTUAL_FS if out == Path(v) or Path(v) in out.parents)}, a kernel file system; name a folder on disk')
    if out == ROOT or out in ROOT.parents or out == NBS: raise say('that folder holds the sources')
    if out.exists() and not out.is_dir(): raise say('it is a file, not a folder; name a folder for the site')
    if out.is_dir():
        if os.path.ismount(out): raise say('it is a mount point, which the builder cannot replace (it swaps in a new folder); name a folder inside it')
        if stray := not_ours(out, first=4):  # a few are enough to refuse: no walk of a whole home folder
            why = ('a site made by an earlier builder, without a manifest of its files: remove it once yourself'
                   if (out/OLD_MARKER).exists() and _manifest(out) is None else
                   f'refusing to replace a folder holding files this builder did not write ({", ".join(stray[:3])}'
                   + (' and more' if len(stray) > 3 else '') + (f'; no {MANIFEST} lists them)' if _manifest(out) is None else
                                                                  f'; its {MANIFEST} does not list them as they are now)'))
            raise say(why + '; name a new or empty folder')
        if not all(os.access(p, os.W_OK | os.X_OK) for p in [out] + [p for p, _, f in _entries(out) if f]):
            raise say('not writable, so its old site cannot be removed; name a folder you can write')
    anc = out.parent  # the site is built beside `out`, so that folder (or the nearest that exists) must take a new folder
    while not anc.exists(): anc = anc.parent
    if not anc.is_dir(): raise say(f'{anc} is a file, so no folder can be made there')
    try: os.rmdir(tempfile.mkdtemp(dir=anc, prefix='.diffq-docs-probe-'))
    except OSError as e: raise say(f'cannot make a folder in {anc} ({e.strerror or e}); name a folder you can write') from None
    return out

def write_manifest(site: Path):
    "List every file of `site` in its manifest: the files a later build may remove, and no others."
    files = {rel: _sha(p) for p, rel, folder in sorted(_entries(site), key=lambda e: e[1]) if not folder and rel != MANIFEST}
    (site/MANIFEST).write_text(json.dumps({'builder': 'tools/build_docs.py', 'note': 'the files this builder wrote, with their '
                                           'sha256: the only ones its next build removes, and only while unchanged', 'files': files}, indent=1))

def replace_site(stage: Path, out: Path):
    "Move the finished site `stage` to `out`, first removing only the files `out`'s manifest lists (and folders left empty)."
    if out.exists():
        if stray := not_ours(out, first=3):
            raise DocsError(f'--out {out}: files appeared that this builder did not write ({", ".join(stray)}); the new site is not installed', 2)
        listed = _manifest(out) or {}
        try:
            for p, rel, folder in list(_entries(out)):  # deepest first: a folder is removed only once emptied
                if folder:
                    try: p.rmdir()
                    except OSError: pass  # not empty: something not ours (refused above), left alone
                elif _ours(p, rel, listed): p.unlink()
            out.rmdir()  # empty now, or an OSError: nothing that is not ours is ever removed
        except OSError as e: raise DocsError(f'--out {out}: could not remove its old site ({e}); the new site is not installed', 1) from None
    os.replace(stage, out)

def site_size(site: Path, cap_mb: float):
    "The size of `site` in bytes; DocsError in one line naming the biggest files when it is over `cap_mb`."
    sizes = {p: p.stat().st_size for p in site.rglob('*') if p.is_file() and not p.is_symlink()}
    total = sum(sizes.values())
    if total > cap_mb * 1e6:
        big = ', '.join(f'{p.relative_to(site)} {n / 1e6:.1f} MB' for p, n in sorted(sizes.items(), key=lambda t: -t[1])[:3])
        raise DocsError(f'the site would be {total / 1e6:.0f} MB, over the {cap_mb:g} MB cap (--max-site-mb); biggest: {big}; '
                        '--out is as it was')
    return total

def one_line(text: str) -> str:
    "A message of any length on one line, whole: its lines joined by ' | '."
    return ' | '.join(l.strip() for l in str(text).splitlines() if l.strip())

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

def _text(v) -> str: return ''.join(v) if isinstance(v, list) else str(v or '')

def _out_size(o: dict) -> int:
    "Characters an output puts on a page: its text, every representation of its data, its traceback."
    return (len(_text(o.get('text'))) + sum(len(_text(v)) for v in (o.get('data') or {}).values())
            + sum(len(str(l)) for l in o.get('traceback') or []))

def cap_outputs(outputs: list, limit: int) -> list:
    "`outputs` within `limit` characters: the first ones whole, a stream cut at a line, the rest dropped, and a visible note."
    total = sum(map(_out_size, outputs))
    if total <= limit: return outputs
    kept, left = [], max(limit - 1000, 0)  # room for the note, so that a capped cell fits when capped again
    for o in outputs:
        n = _out_size(o)
        if n <= left: kept.append(o); left -= n; continue
        if o.get('output_type') == 'stream' and left > 0:  # its head, to the last whole line that fits
            head = _text(o.get('text'))[:left]
            kept.append({**o, 'text': head[:head.rfind('\n') + 1] or head})
        elif o.get('output_type') == 'error':  # that the cell failed matters more than where: keep its message line
            kept.append({**o, 'traceback': [f"{o.get('ename', 'Error')}: {one_line(o.get('evalue', ''))[:max(left, 1000)]}"]})
        left = 0  # anything else cut in half (an image, a table) is no use: dropped
    note = (f'Output cut: this cell wrote {_size(total)}; the docs keep its first {_size(limit)} '
            '(tools/build_docs.py --max-cell-output). Run the notebook to see it all.')
    kept.append({'output_type': 'display_data', 'metadata': {},
                 'data': {'text/plain': note, 'text/html': f'<div class="docs-truncated">{html.escape(note)}</div>'}})
    return kept

def _size(n: float) -> str: return f'{n / 1e6:.1f} MB' if n >= 1e5 else f'{n / 1e3:.0f} kB'

def _max_output() -> int:
    return int(float(os.environ.get('DIFFQ_DOCS_MAX_CELL_OUTPUT') or MAX_CELL_OUTPUT_MB * 1e6))

def _execute_here(src: Path, dst: Path):
    "Run `src` in this process like nbdev_test (from nbs/, flagged cells skipped) and write it, with outputs, to `dst`."
    from execnb.nbio import read_nb, write_nb
    from execnb.shell import CaptureShell
    # one torch thread: _run_one sets OMP_NUM_THREADS=1, which torch reads when the notebook imports it (importing torch
    # here to say so would cost a notebook that never uses it a second of CPU)
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
    limit = _max_output()
    def post(c):
        _snapshot_widgets(c)
        if c.get('outputs'): c['outputs'] = cap_outputs(c['outputs'], limit)  # 300 MB of prints is no page: cut here, before the cache
    try: shell.run_all(nb, exc_stop=True, preproc=pre, postproc=post)
    except BaseException as e:  # the whole message in one line for the parent, naming the cell (the traceback stays in the page)
        at = json.loads(Path(status).read_text()) if status and Path(status).exists() else {}
        msg = one_line(e)
        if len(msg) > limit: msg = msg[:limit] + f' ... ({len(msg) - limit} more characters: over --max-cell-output)'
        err = f'cell [{at.get("cell", "?")}] {at.get("line", "")!r} raised {type(e).__name__}' + (f': {msg}' if msg else '')
        if status: Path(status).write_text(json.dumps({**at, 'done': True, 'error': err}))  # the cells are over: no timeout from here
        if partial := os.environ.get('DIFFQ_DOCS_PARTIAL'):  # the cells as far as they ran, the failing one with its traceback
            try:
                for c in nb.cells: c.get('metadata', {}).pop('execution', None)
                write_nb(nb, partial)
            except Exception: pass  # the page then shows the notebook unexecuted, with the same banner
        print(f'DIFFQ-DOCS-ERROR: {err}', file=sys.stderr, flush=True)
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

def _run_one(nb: Path, dst: Path, timeout: int = CELL_TIMEOUT, partial: Path | None = None,
             on_cell=lambda nb, at: None) -> tuple[Path, str]:
    """Execute `nb` into `dst` in its own process, watched: (nb, '') when it ran whole, else (nb, one line saying where it
    stopped, with the whole error), and then, in `partial`, its cells as far as they ran (when the process lived to write them).
    `on_cell(nb, at)` hears of each cell as it starts (at: its status, a dict) and every few seconds while it runs."""
    env = {**os.environ, **_ENV, 'HF_HUB_OFFLINE': os.environ.get('HF_HUB_OFFLINE', '1')}
    t = time.time()
    with tempfile.TemporaryDirectory(prefix='diffq_docs_exec_') as tmp:
        status, log, part = Path(tmp)/'status.json', Path(tmp)/'stderr.txt', Path(tmp)/'partial.ipynb'
        env['DIFFQ_DOCS_STATUS'], env['DIFFQ_DOCS_PARTIAL'] = str(status), str(part)
        dst.unlink(missing_ok=True)
        with open(log, 'w') as err:
            proc = subprocess.Popen([sys.executable, __file__, '_exec', str(nb), str(dst)], stdout=subprocess.DEVNULL, stderr=err, env=env)
            started, last, heard, news, err = time.time(), None, 0.0, False, ''
            while proc.poll() is None:  # the per-cell timeout: a cell is timed from when it starts
                try: mark = status.read_text()
                except OSError: mark = None  # not yet (the imports before the first cell get 10 minutes at least)
                if mark != last: started, last, news = time.time(), mark, True
                if time.time() - heard > (1 if news else 5):  # a new cell at most once a second; a long one still shows as alive
                    heard, news = time.time(), False; on_cell(nb, _status(status))
                if time.time() - started > (max(timeout, 600) if not last or '"done"' in last else timeout):
                    proc.kill(); proc.wait()
                    err = f'{_cell(status)} ran past the {timeout:g} s cell timeout (--cell-timeout)'
                    break
                time.sleep(0.2)
        if not err:
            lines = [l for l in log.read_text(errors='replace').splitlines() if l.strip()]
            if at := _status(status).get('error'): err = at
            elif proc.returncode != 0: err = f'{_cell(status)} ended the process with exit code {proc.returncode}' + (f': {lines[-1]}' if lines else '')
            elif not dst.exists(): err = f'{_cell(status)} ended the process (exit code 0, e.g. sys.exit or os._exit) before the notebook finished'
        if partial is not None:
            partial.unlink(missing_ok=True)  # a run of an older failure is no page of this one
            if err and part.exists(): partial.parent.mkdir(parents=True, exist_ok=True); shutil.move(part, partial)
    _write(f'  executed {nb.name} in {time.time() - t:.1f} s' + (' FAILED' if err else ''))
    return nb, err

def _write(msg: str):
    "A line on stdout that leaves the progress bars on stderr whole."
    from tqdm import tqdm
    tqdm.write(msg, file=sys.stdout); sys.stdout.flush()

def _status(status: Path) -> dict:
    try: d = json.loads(status.read_text())
    except (OSError, ValueError): return {}
    return d if isinstance(d, dict) else {}

def _cell(status: Path) -> str:
    "The cell the status file names, as 'cell [i] 'first line''."
    at = _status(status)
    if 'cell' not in at: return 'the notebook (before its first cell)'
    return f'cell [{at.get("cell", "?")}] {at.get("line", "")!r}'

def execute_all(nbs: list[Path], jobs: int = 2, fresh: bool = False, stale_ok: bool = False,
                timeout: int = CELL_TIMEOUT) -> tuple[dict[Path, Path | None], dict[Path, str]]:
    """Executed copies of `nbs` (cached by content), each run in a fresh process, and the failures: ({nb: its run, or of
    a failed one its cells as far as they ran, or None}, {nb: one line saying where and why it failed}). Progress on stderr."""
    from tqdm import tqdm
    state = _state_hash()
    out, todo = {}, []
    for nb in nbs:
        key = hashlib.sha256((state + nb.read_text(encoding='utf-8')).encode()).hexdigest()[:16]
        dst = CACHE/f'{nb.stem}.{key}.ipynb'
        out[nb] = dst
        if not dst.exists() and stale_ok and (runs := sorted(CACHE.glob(f'{nb.stem}.*.ipynb'), key=lambda p: p.stat().st_mtime)):
            out[nb] = runs[-1]; print(f'  reusing {runs[-1].name} (an older run: the notebook, package or data changed since)')
        elif fresh or not dst.exists(): todo.append((nb, dst))
    failed = {}
    if not todo: return out, failed
    print(f'executing {len(todo)} notebook(s), {jobs} at a time ({len(nbs) - len(todo)} reused from {_rel(CACHE)}); '
          f'a cell may run {timeout:g} s (--cell-timeout)', flush=True)
    bar = tqdm(total=len(todo), desc='executing', unit='nb', file=sys.stderr, dynamic_ncols=True)
    running = {}
    def on_cell(nb, at):  # the bar names what runs now: each notebook and its cell
        running[nb.stem] = f'{nb.stem} [{at["cell"]}]' if 'cell' in at else nb.stem
        bar.set_postfix_str(', '.join(running.values()), refresh=True)
    def job(nb, dst):
        try: return _run_one(nb, dst, timeout=timeout, partial=CACHE/'failed'/f'{nb.stem}.ipynb', on_cell=on_cell)
        finally:
            running.pop(nb.stem, None)
            bar.set_postfix_str(', '.join(running.values()), refresh=False); bar.update(1)
    try:
        with ThreadPoolExecutor(max(1, jobs)) as ex:
            for nb, err in ex.map(lambda j: job(*j), todo):
                if not err: continue
                failed[nb] = err
                part = CACHE/'failed'/f'{nb.stem}.ipynb'
                out[nb] = part if part.exists() else None
    finally: bar.close()
    for nb, _ in todo:  # keep the 3 newest runs of each notebook (another build may be using an older one)
        for old in sorted(CACHE.glob(f'{nb.stem}.*.ipynb'), key=lambda p: p.stat().st_mtime, reverse=True)[3:]:
            old.unlink(missing_ok=True)
    return out, failed

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

def failure_cell(err: str, ran: bool) -> dict:
    "The banner a failed notebook's page opens with: that it failed, and the whole error, on one line."
    how = ('its cells below ran up to the one that failed (with its traceback); the rest show no output' if ran else
           'its cells below are shown unexecuted')
    return {'cell_type': 'markdown', 'metadata': {}, 'source':
            f'<div class="docs-failed"><p><strong>This notebook failed when the docs were built</strong>: {how}. '
            f'Run it in JupyterLab to see why.</p><p class="docs-failed-error">{html.escape(one_line(err))}</p></div>'}

def processed(nb_path: Path, executed: Path | None, pages: set[str], site: bool = True, failure: str = '',
              max_output: int = int(MAX_CELL_OUTPUT_MB * 1e6)) -> dict:
    """The notebook as its docs page (or, `site=False`, the README) shows it: nbdev's doc processors, then the fixes above;
    each cell's outputs capped at `max_output` characters; a `failure` (one line) as a banner under the title."""
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
        if c['cell_type'] == 'code':
            c['outputs'] = cap_outputs([o for o in map(_no_progress, c.get('outputs', [])) if o is not None], max_output)
        for o in c.get('outputs', []):
            for k, v in o.get('data', {}).items():
                if k in ('text/markdown', 'text/html'):
                    o['data'][k] = rw(''.join(v) if isinstance(v, list) else v)
        cells.append(c)
    if failure:  # under the title (and its lead), above everything else
        at = next((i + 1 for i, c in enumerate(cells) if c['cell_type'] == 'markdown' and c['source'].startswith('# ')), 0)
        cells.insert(at, failure_cell(failure, ran=executed is not None))
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
.docs-failed { border-left: 4px solid #c62828; background: #fdecea; color: #5f1111; padding: 0.4em 1em; margin: 1em 0; }
.docs-failed-error { font-family: var(--md-code-font-family, monospace); font-size: 0.85em; overflow-wrap: anywhere; }
.docs-truncated { border-left: 4px solid #e0a800; background: #fff8e1; color: #5c4400; padding: 0.3em 0.8em; font-size: 0.85em; }
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
    with tempfile.TemporaryDirectory(prefix='diffq_docs_') as stage, _templates_compiled_once(), \
            _notebook_css_linked(Path(stage)):
        _render(docs, navs, out, Path(stage))

NOTEBOOK_CSS = 'assets/jupyter.css'  # mkdocs-jupyter's notebook stylesheet, one file the pages link

class _notebook_css_linked:
    """mkdocs-jupyter inlines its 585 KB notebook stylesheet into every page, and nbconvert then parses each page
    whole with BeautifulSoup (a third of the render's CPU, 0.6 MB of every page): within the block, its templates are
    read from a copy whose page template includes no stylesheet, and the stylesheet is written once, for every page
    to link (`extra_css`). The light theme's, as mkdocs-jupyter's default; its template's other blocks unchanged."""
    def __init__(self, stage: Path): self.stage = stage
    def __enter__(self):
        import shutil
        from mkdocs_jupyter.config import settings
        self.settings, self.real = settings, settings.templates_dir
        real, ours = Path(self.real), self.stage/'templates'
        shutil.copytree(real, ours)
        page = ours/'mkdocs_html'/'notebook.html.j2'
        src = page.read_text(encoding='utf-8')
        css = re.compile(r'(\{% block notebook_css %\}).*?(\{%- endblock notebook_css %\})', re.S)
        if not css.search(src): return self  # another mkdocs-jupyter: pages inline their stylesheet, as before
        page.write_text(css.sub(r'\1\2', src), encoding='utf-8')
        assets = real/'mkdocs_html'/'assets'
        (self.stage/'docs'/NOTEBOOK_CSS).parent.mkdir(parents=True, exist_ok=True)
        (self.stage/'docs'/NOTEBOOK_CSS).write_text('\n'.join((assets/f).read_text(encoding='utf-8')
                                                             for f in ('index.css', 'theme-light.css')), encoding='utf-8')
        settings.templates_dir = str(ours)
        return self
    def __exit__(self, *exc): self.settings.templates_dir = self.real

class _templates_compiled_once:
    """mkdocs-jupyter makes a new nbconvert exporter, so a new jinja environment, for every page, and each compiles the
    same dozen templates again (a quarter of the render's CPU): within the block, every such environment shares one
    in-memory bytecode cache, which jinja keys by template name and checks against the template's source."""
    def __enter__(self):
        import jinja2
        from nbconvert.exporters.templateexporter import TemplateExporter
        codes = {}
        class Memory(jinja2.BytecodeCache):
            def load_bytecode(self, bucket):
                if bucket.key in codes: bucket.bytecode_from_string(codes[bucket.key])
            def dump_bytecode(self, bucket): codes[bucket.key] = bucket.bytecode_to_string()
        cache, self.real = Memory(), TemplateExporter.__dict__.get('_create_environment')
        if self.real is None: return self  # another nbconvert: pages compile their own templates, as before
        real = self.real
        def create(exporter):
            env = real(exporter); env.bytecode_cache = cache; return env
        TemplateExporter._create_environment = create
        return self
    def __exit__(self, *exc):
        if self.real is not None:
            from nbconvert.exporters.templateexporter import TemplateExporter
            TemplateExporter._create_environment = self.real

def _render(docs, navs, out: Path, stage: Path):
    import yaml
    from mkdocs.config import load_config
    from mkdocs.commands.build import build
    import mkdocs_jupyter.plugin as mkj
    if hasattr(mkj, '_get_nb_toc_tokens'): mkj._get_nb_toc_tokens = _nb_toc_tokens  # else the anchor check says what broke
    cfg = _config()
    (stage/'docs'/'assets').mkdir(parents=True, exist_ok=True)
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
        'extra_css': [*([NOTEBOOK_CSS] if (stage/'docs'/NOTEBOOK_CSS).exists() else []), 'assets/extra.css'],
        'extra_javascript': ['assets/extra.js'],
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
              timeout: int = CELL_TIMEOUT, folder: Path | None = None, max_cell_output_mb: float = MAX_CELL_OUTPUT_MB,
              max_site_mb: float = MAX_SITE_MB, strict: bool = False) -> tuple[Path, dict[Path, str]]:
    """Build the site: execute what `execute` names ('all', 'none' or notebook names), process, render, check.
    Returns (the site, {notebook: one line} for each that failed: its page says so and the rest is built)."""
    from tqdm import tqdm
    t0 = time.time()
    out = check_out(out)
    nbs = check_nbs(folder)
    check_notebooks(nbs)
    if only:
        if unknown := set(only) - {p.stem for p in nbs} - {page_name(p) for p in nbs}: raise DocsError(f'--only: no notebook named {sorted(unknown)}', 2)
        nbs = [p for p in nbs if p.stem in only or page_name(p) in only]
    want = {p.stem for p in nbs} if execute == 'all' else set() if execute == 'none' else set(execute.split(','))
    unknown = want - {p.stem for p in nbs} - {page_name(p) for p in nbs}
    if unknown: raise DocsError(f"--execute: no notebook named {sorted(unknown)} (give 'all', 'none' or names separated by commas)", 2)
    print(f'build_docs.py: {len(nbs)} page(s) from {_rel(Path(folder or NBS).resolve())}/ into {_rel(out)}/', flush=True)  # within 2 s: no heavy import yet
    to_run = [p for p in nbs if p.stem in want or page_name(p) in want]
    os.environ['DIFFQ_DOCS_MAX_CELL_OUTPUT'] = str(int(max_cell_output_mb * 1e6))  # the executing processes inherit it
    executed, failed = execute_all(to_run, jobs=jobs, fresh=fresh, stale_ok=stale_ok, timeout=timeout)
    t1 = time.time()
    pages = {page_name(p) for p in nbs}
    docs, navs = {}, []
    for p in tqdm(nbs, desc='processing', unit='page', file=sys.stderr, dynamic_ncols=True):
        try: d = processed(p, executed.get(p), pages, failure=failed.get(p, ''), max_output=int(max_cell_output_mb * 1e6))
        except Exception as e:  # nbdev's processors choked on it: still a page, saying so
            failed[p] = f'processing its page raised {type(e).__name__}: {one_line(e)}'
            d = {'cells': [{'cell_type': 'markdown', 'metadata': {}, 'source': f'# {p.stem}'}, failure_cell(failed[p], False)],
                 'metadata': {}, 'nbformat': 4, 'nbformat_minor': 5}
            for i, c in enumerate(d['cells']): c['id'] = f'docs-{i}'
        docs[page_name(p)] = d
        navs.append((page_name(p), nav_label(p.stem, _title(d, page_name(p)))))
    t2 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f'.{out.name}.building-'))
    try:
        with _ticking(f'rendering {len(docs)} page(s) with mkdocs'): render(docs, navs, stage)
        dead, stray = postprocess(stage)
        ext = external_assets(stage)
        for s in stray: print(f'warning: link to a missing anchor (a renamed heading?) {s}')
        bad = ['dead internal link ' + d for d in dead] + ['external asset ' + e for e in ext]
        if strict_anchors: bad += ['missing anchor ' + s for s in stray]
        if bad: raise DocsError(f'docs check failed ({len(bad)}): ' + '; '.join(bad) + '; --out is as it was')
        size = site_size(stage, max_site_mb)
        write_manifest(stage)
        os.chmod(stage, 0o755)  # mkdtemp makes 0700
        check_out(out)  # still ours (or new) now that the site is ready
        replace_site(stage, out)
    finally: shutil.rmtree(stage, ignore_errors=True)
    print(f'wrote {len(docs)} pages ({size / 1e6:.1f} MB) to {out} (execute {t1 - t0:.0f} s, process {t2 - t1:.0f} s, '
          f'render {time.time() - t2:.0f} s)')
    print(f'open {out/"index.html"}; for search, serve it: python -m http.server -d {_rel(out)} 8000', flush=True)
    report_failures(failed, len(docs), strict)
    return out, failed

class _ticking:
    "A line on stderr naming a long step and the time it has taken, redrawn every 2 s (mkdocs reports no progress of its own)."
    def __init__(self, desc: str): self.desc = desc
    def __enter__(self):
        import threading
        from tqdm import tqdm
        self.bar = tqdm(desc=self.desc, bar_format='{desc}: {elapsed}', file=sys.stderr)
        self.stop = threading.Event()
        self.th = threading.Thread(target=lambda: [self.bar.refresh() for _ in iter(lambda: self.stop.wait(2), True)], daemon=True)
        self.th.start()
    def __exit__(self, *exc): self.stop.set(); self.th.join(); self.bar.close()

def report_failures(failed: dict[Path, str], total: int, strict: bool):
    "The notebooks that failed, one line each on stderr, after the site is written."
    if not failed: return
    print(f'build_docs.py: {len(failed)} of {total} notebook(s) failed; the site is built and their pages say so '
          + ('(--strict: exit 1)' if strict else '(exit 0; --strict makes this exit 1)') + ':', file=sys.stderr)
    for nb, err in sorted(failed.items()): print(f'  {nb.name}: {err}', file=sys.stderr)
    sys.stderr.flush()

def readme():
    "README.md from nbs/index.ipynb (executed, or reused from the cache), as GitHub shows it."
    from nbconvert import MarkdownExporter
    from traitlets.config import Config
    import nbformat
    idx = NBS/'index.ipynb'
    check_notebooks([idx])
    runs, failed = execute_all([idx])
    if failed: raise DocsError(f'{idx.name}: {failed[idx]}; README.md is left as it was')  # the README is never a failed run
    d = processed(idx, runs[idx], pages=set(), site=False)  # links to nbs/*.ipynb stay: they work on GitHub
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
    h.add_argument('--out', default=str(ROOT/'_docs'), help=f'the site folder (default _docs/): new, empty, or a site this builder made ({MANIFEST})')
    h.add_argument('--cell-timeout', '--timeout', dest='timeout', type=float, default=CELL_TIMEOUT,
                   help=f'seconds a cell may run before its notebook is stopped and its page says so (default {CELL_TIMEOUT})')
    h.add_argument('--max-cell-output', type=float, default=MAX_CELL_OUTPUT_MB, metavar='MB',
                   help=f"a cell's outputs beyond this many MB are cut, with a note on the page (default {MAX_CELL_OUTPUT_MB})")
    h.add_argument('--max-site-mb', type=float, default=MAX_SITE_MB, metavar='MB', help=f'refuse a site bigger than this (default {MAX_SITE_MB})')
    h.add_argument('--strict', action='store_true', help='exit 1 when a notebook failed (the site is still built, its page saying so)')
    h.add_argument('--nbs', default=str(NBS), help='the folder of notebooks (default nbs/)')
    h.add_argument('--jobs', type=int, default=2, help='notebooks executed at once (one torch thread each)')
    h.add_argument('--fresh', action='store_true', help='execute again even where a cached run matches')
    h.add_argument('--stale-ok', action='store_true', help='reuse the newest cached run of a notebook even if it, the package or data/ changed since (fast, for work on the docs)')
    h.add_argument('--strict-anchors', action='store_true', help='fail on a link to a missing #anchor too (else a warning)')
    sub.add_parser('readme', help='README.md from nbs/index.ipynb')
    e = sub.add_parser('_exec'); e.add_argument('src'); e.add_argument('dst')
    a = ap.parse_args(argv)
    if a.cmd == '_exec': return _execute_here(Path(a.src).resolve(), Path(a.dst).resolve())
    if a.cmd == 'html':
        for flag, v, lo in (('--cell-timeout', a.timeout, 1), ('--max-cell-output', a.max_cell_output, 0.001),
                            ('--max-site-mb', a.max_site_mb, 0.001), ('--jobs', a.jobs, 1)):
            if not v >= lo or v == float('inf'): _say(f'{flag} must be a number >= {lo:g}, got {v:g}', 2)
    try:
        if a.cmd == 'html':
            _, failed = html_site(a.execute, Path(a.out), a.jobs, a.fresh, [s for s in a.only.split(',') if s] or None,
                                  a.strict_anchors, a.stale_ok, a.timeout, Path(a.nbs), a.max_cell_output, a.max_site_mb, a.strict)
            if failed and a.strict: raise SystemExit(1)
        else: readme()
    except DocsError as e: _say(str(e), e.code)
    except KeyboardInterrupt: _say('interrupted; the site in --out is as it was', 130)

if __name__ == '__main__':
    main()
