"""Screenshots of the built docs site in headless Chromium: the index and the findings page (and any others named).

    python tools/screenshots.py [--site _docs] [--out _docs_shots] [--width 1400] [--height 1800] [PAGE ...]

Needs Debian's `chromium` (apt-get install -y chromium) and a built site (`make docs`). The pages are opened
from file:// with networking disabled, so a screenshot shows what an offline reader sees. Writes
<out>/<page>.png and exits non-zero, saying why, if chromium is missing, the site is not built, or a
screenshot comes back empty.
"""
from __future__ import annotations
import argparse, shutil, subprocess, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ('chromium', 'chromium-browser', 'google-chrome', 'google-chrome-stable')

def find_browser() -> str:
    for b in BROWSERS:
        if path := shutil.which(b): return path
    sys.exit('screenshots.py: no headless Chromium found (looked for ' + ', '.join(BROWSERS) + ').\n'
             'Install Debian\'s package: apt-get update && apt-get install -y chromium')

def screenshot(browser: str, page: Path, png: Path, width: int, height: int, timeout: int = 120, anchor: str = ''):
    "One PNG of `page` (scrolled to `#anchor` if given) at width x height, from file:// with no network."
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix='shots-profile-') as profile:
        cmd = [browser, '--headless', '--no-sandbox', '--disable-gpu', '--hide-scrollbars', '--no-first-run',
               f'--user-data-dir={profile}', '--proxy-server=127.0.0.1:9', '--proxy-bypass-list=<-loopback>',
               '--virtual-time-budget=5000', f'--window-size={width},{height}', f'--screenshot={png}', page.as_uri() + (f'#{anchor}' if anchor else '')]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 or not png.exists() or png.stat().st_size < 1000:
        sys.exit(f'screenshots.py: chromium made no screenshot of {page} (exit {r.returncode}):\n{r.stderr[-2000:]}')

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('pages', nargs='*', default=['index', 'findings'],
                    help='page names, each optionally with #anchor to scroll to (default: index findings)')
    ap.add_argument('--site', default=str(ROOT/'_docs'))
    ap.add_argument('--out', default=str(ROOT/'_docs_shots'))
    ap.add_argument('--width', type=int, default=1400)
    ap.add_argument('--height', type=int, default=1800)
    a = ap.parse_args(argv)
    browser = find_browser()
    site, out = Path(a.site).resolve(), Path(a.out).resolve()
    for spec in a.pages:
        name, _, anchor = spec.partition('#')
        page = site/f'{name}.html'
        if not page.exists(): sys.exit(f'screenshots.py: {page} does not exist: build the site first (make docs)')
        png = out/(f'{name}-{anchor}.png' if anchor else f'{name}.png')
        screenshot(browser, page, png, a.width, a.height, anchor=anchor)
        print('wrote', png)

if __name__ == '__main__':
    main()
