"""Screenshots of the built docs site in headless Chromium: the index and the findings page (and any others named).

    python tools/screenshots.py [--site _docs] [--out _docs_shots] [--width 1400] [--height 1800] [PAGE ...]
    python tools/screenshots.py --lab URL [--notebook 13_compare.ipynb]   # JupyterLab: open, Run All, screenshot

With --lab (a running `make lab`, its URL with the token), Chromium is driven over its DevTools protocol: the
notebook is opened, "Run All Cells" is run from the command palette, as a person would, and the page is
captured once the kernel is idle and the widgets have rendered: <out>/lab-<notebook>.png.

Needs Debian's `chromium` (apt-get install -y chromium) and a built site (`make docs`). The pages are opened
from file:// with networking disabled, so a screenshot shows what an offline reader sees. Writes
<out>/<page>.png and exits non-zero, saying why, if chromium is missing, the site is not built, or a
screenshot comes back empty.
"""
from __future__ import annotations
import argparse, contextlib, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ('chromium', 'chromium-browser', 'google-chrome', 'google-chrome-stable')

def find_browser() -> str:
    for b in BROWSERS:
        if path := shutil.which(b): return path
    sys.exit('screenshots.py: no headless Chromium found (looked for ' + ', '.join(BROWSERS) + ').\n'
             'Install Debian\'s package: apt-get update && apt-get install -y chromium')

def _cdp(ws_url: str):
    "A minimal DevTools-protocol client over tornado's websocket (a dependency of Jupyter): send(method, **params) -> result."
    import itertools, json
    from tornado.ioloop import IOLoop
    from tornado.websocket import websocket_connect
    loop = IOLoop.current()
    conn = loop.run_sync(lambda: websocket_connect(ws_url, max_message_size=256 * 2**20))
    ids = itertools.count(1)
    def send(method, timeout=60, **params):
        i = next(ids)
        conn.write_message(json.dumps({'id': i, 'method': method, 'params': params}))
        async def wait():
            while True:
                msg = await conn.read_message()
                if msg is None: raise RuntimeError('the browser closed the DevTools connection')
                m = json.loads(msg)
                if m.get('id') == i:
                    if 'error' in m: raise RuntimeError(f"{method}: {m['error']}")
                    return m.get('result', {})
        return loop.run_sync(wait, timeout=timeout)
    return send

@contextlib.contextmanager
def devtools(browser: str, width: int, height: int, offline: bool = True):
    "A headless Chromium driven over its DevTools protocol: yields (send, js), js(expr) -> the expression's value."
    import json, urllib.request
    with tempfile.TemporaryDirectory(prefix='shots-profile-') as profile:
        proc = subprocess.Popen([browser, '--headless', '--no-sandbox', '--disable-gpu', '--no-first-run',
                                 *([] if offline else ['--hide-scrollbars']),  # a docs page shows its scrollbars, as a reader sees them
                                 '--disable-background-networking', f'--user-data-dir={profile}', '--remote-debugging-port=0',
                                 *(['--proxy-server=127.0.0.1:9', '--proxy-bypass-list=<-loopback>'] if offline else []),
                                 f'--window-size={width},{height}', 'about:blank'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port_file = Path(profile)/'DevToolsActivePort'
            for _ in range(300):
                if port_file.exists() and port_file.read_text().strip(): break
                time.sleep(0.1)
            else: sys.exit('screenshots.py: chromium did not open its DevTools port')
            port = port_file.read_text().split()[0]
            page = next(t for t in json.load(urllib.request.urlopen(f'http://127.0.0.1:{port}/json/list')) if t['type'] == 'page')
            send = _cdp(page['webSocketDebuggerUrl'])
            yield send, lambda expr: send('Runtime.evaluate', expression=expr, returnByValue=True).get('result', {}).get('value')
        finally:
            proc.terminate(); proc.wait(timeout=30)

def _until(js, expr, what, limit):
    t0 = time.time()
    while not js(expr):
        if time.time() - t0 > limit: sys.exit(f'screenshots.py: {what} within {limit} s')
        time.sleep(1)

# Tables wider than their box, and whether each can scroll there (else it is clipped)
TABLES = """(() => { let wide = 0, clipped = 0;
  for (const t of document.querySelectorAll('.md-content table')) {
    const over = [];
    for (let e = t; e && !e.classList.contains('md-content'); e = e.parentElement)
      if (e.scrollWidth > e.clientWidth + 1) over.push(getComputedStyle(e).overflowX);
    if (over.length) { wide++; if (!over.some(o => o === 'auto' || o === 'scroll')) clipped++; } }
  return {wide, clipped}; })()"""

def page_screenshot(browser: str, page: Path, png: Path, width: int, height: int, anchor: str = '') -> dict:
    "One PNG of a docs page (scrolled to `#anchor`), from file:// with no network; returns its wide-table counts."
    import base64
    png.parent.mkdir(parents=True, exist_ok=True)
    with devtools(browser, width, height) as (send, js):
        send('Page.enable'); send('Page.navigate', url=page.as_uri())
        _until(js, "document.readyState === 'complete'", f'{page.name} did not load', 60)
        if anchor: js(f"(() => {{ const e = document.getElementById({anchor!r}); if (e) e.scrollIntoView({{block: 'start'}}); }})()")
        time.sleep(1.5)
        png.write_bytes(base64.b64decode(send('Page.captureScreenshot', format='png')['data']))
        return js(TABLES) or {}

def lab_screenshot(browser: str, url: str, png: Path, width: int = 1400, height: int = 1100, timeout: int = 600):
    "Open `url` (a JupyterLab notebook) in headless Chromium, Run All Cells from the command palette, wait, screenshot."
    import base64
    png.parent.mkdir(parents=True, exist_ok=True)
    with devtools(browser, width, height, offline=False) as (send, js):  # JupyterLab is on the loopback
            until = lambda expr, what, limit: _until(js, expr, 'JupyterLab: ' + what, limit)
            send('Page.enable'); send('Page.navigate', url=url)
            until("!!document.querySelector('.jp-Notebook .jp-Cell') && "
                  "!!document.querySelector('.jp-Notebook-ExecutionIndicator, .jp-KernelStatus, .jp-Toolbar-kernelName')",
                  'no notebook opened', 180)
            time.sleep(5)  # the kernel starts
            key = lambda k, code, mods=0, vk=0: [send('Input.dispatchKeyEvent', type=t, key=k, code=code, modifiers=mods,
                                                      windowsVirtualKeyCode=vk) for t in ('keyDown', 'keyUp')]
            js("document.querySelector('.jp-Notebook').focus()")
            key('C', 'KeyC', 2 | 8, 67)  # Ctrl+Shift+C: the command palette
            time.sleep(1)
            send('Input.insertText', text='Run All Cells'); time.sleep(1)
            key('Enter', 'Enter', 0, 13)
            time.sleep(5)
            until("(() => { const p = [...document.querySelectorAll('.jp-InputPrompt')].map(e => e.textContent);"
                  " return p.length && !p.some(t => t.includes('*')) && p.some(t => /\\d/.test(t)); })()",
                  'Run All did not finish', timeout)
            time.sleep(3)
            js("(() => { const w = document.querySelector('.jupyter-widgets, .widget-toggle-buttons');"
               " if (w) w.scrollIntoView({block: 'start'}); })()")
            time.sleep(2)
            png.write_bytes(base64.b64decode(send('Page.captureScreenshot', format='png')['data']))
            # then as a person would: pick the first scheme of the toggle; the images and caption must change
            before = js("([...document.querySelectorAll('.widget-html-content')][1] || {}).innerHTML || ''")
            js("(() => { const b = document.querySelector('.widget-toggle-buttons button'); if (b) b.click(); })()")
            time.sleep(4)
            after = js("([...document.querySelectorAll('.widget-html-content')][1] || {}).innerHTML || ''")
            clicked = png.with_name(png.stem + '-clicked.png')
            clicked.write_bytes(base64.b64decode(send('Page.captureScreenshot', format='png')['data']))
            return js("document.querySelectorAll('.jupyter-widgets').length"), before != after

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('pages', nargs='*', default=['index', 'findings'],
                    help='page names, each optionally with #anchor to scroll to (default: index findings)')
    ap.add_argument('--site', default=str(ROOT/'_docs'))
    ap.add_argument('--out', default=str(ROOT/'_docs_shots'))
    ap.add_argument('--width', type=int, default=1400)
    ap.add_argument('--height', type=int, default=1800)
    ap.add_argument('--lab', default='', help='a running JupyterLab URL with its token (make lab prints it)')
    ap.add_argument('--notebook', default='13_compare.ipynb', help='the notebook to open with --lab (default 13_compare.ipynb)')
    a = ap.parse_args(argv)
    browser = find_browser()
    if a.lab:
        from urllib.parse import urlsplit, urlunsplit
        u = urlsplit(a.lab)
        url = urlunsplit((u.scheme, u.netloc, u.path.rstrip('/').removesuffix('/lab').removesuffix('/tree') + f'/lab/tree/{a.notebook}',
                          u.query, ''))
        png = Path(a.out).resolve()/f'lab-{Path(a.notebook).stem}.png'
        n, responded = lab_screenshot(browser, url, png, a.width, min(a.height, 1100))
        print('wrote', png, f'and {png.stem}-clicked.png ({n} widget element(s); the first toggle '
              + ('changed the caption' if responded else 'changed NOTHING') + ')')
        if not responded: sys.exit(1)
        return
    site, out = Path(a.site).resolve(), Path(a.out).resolve()
    for spec in a.pages:
        name, _, anchor = spec.partition('#')
        page = site/f'{name}.html'
        if not page.exists(): sys.exit(f'screenshots.py: {page} does not exist: build the site first (make docs)')
        png = out/(f'{name}-{anchor}.png' if anchor else f'{name}.png')
        t = page_screenshot(browser, page, png, a.width, a.height, anchor=anchor)
        print('wrote', png, f"({t.get('wide', '?')} table(s) wider than the page, {t.get('clipped', '?')} of them clipped)")

if __name__ == '__main__':
    main()
