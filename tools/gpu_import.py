"""Bring a GPU run's rows home: unpack the results.tar.gz that tools/gpu_check.sh left in $OUT into data/results.

    python3 tools/gpu_import.py OUT/results.tar.gz [--into data/results] [--allow-dry-run]

The tarball is checked whole before anything is written; it is read as a stream, each member and the whole
decompressed stream under a cap (a gzip bomb stops at the cap, in well under a second). It must hold provenance.json
and status.tsv, results/<kind>.csv tables and results/plans/<digest>.json plans, nothing else (a stage's hidden
staging leftovers under results/ are passed over), no name twice, no links. provenance.json must have the keys and
types `gpu_stages.provenance` writes, and say one consistent thing: a GPU run (dry_run false) names a CUDA device
with a compute capability, a dry run a CPU. status.tsv has one line per stage (stage, budget s, took s, rc, status).
A table may have only the columns of that kind's table in data/results (or in the store it goes into); a kind neither
has must be one a GPU stage writes; every row names its run, its UTC time and the device the provenance names, and no
cell holds NUL or another control character (a multi-line error message keeps its newlines and tabs). A plan must load
as a QuantPlan whose digest is its file name.

Every table is then appended to the table of the same name, rows keeping the run id, device, capability and versions
they were measured with; a row without a git sha (the device's tree has no .git) takes the sha the run was stamped
with (provenance.json, '+dirty' when the code that ran differed from it). One row per run goes to the 'gpu_runs'
table: device, versions, source and each stage's outcome. The rows and the new plans land in one journalled commit of
the lab's store (`append_tables`): all of them or none. Runs already in a table and plans already in the store are
skipped, so importing twice changes nothing. A dry run's (CPU) tarball is refused unless --allow-dry-run. Every
refusal is one line on stderr, exit 2, with nothing written.
"""
from __future__ import annotations
import argparse, csv, gzip, io, json, math, re, shutil, sys, tarfile, tempfile, zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO/'tools'
if str(TOOLS) not in sys.path: sys.path.insert(0, str(TOOLS))
from gpu_stages import NEW_COLS, RUN_STAGES, TABLES  # noqa: E402 -- the stages, the tables each writes

# Caps, read at call time (tests lower them). A real run's tarball is well under a MiB: the transfer holds 64 MiB.
MAX_TARBALL = 64 * 2**20   # the .tar.gz file itself
MAX_TOTAL = 64 * 2**20     # the decompressed stream: headers, every member, padding
MAX_MEMBER = 16 * 2**20    # one member
MAX_MEMBERS = 4096         # members of any kind
MAX_CELL = 4096            # characters in one table cell (the longest in data/results: 300)
MAX_COLUMNS = 256          # columns of a table of a new kind (data/results' widest has 62)
CHUNK = 2**20              # the stream is read this much at a time, never a member at once

KIND = re.compile(r'[a-z0-9][a-z0-9_\-]*')
TABLE_MEMBER = re.compile(r'results/([a-z0-9][a-z0-9_\-]*)\.csv')
PLAN_MEMBER = re.compile(r'results/plans/([0-9a-f]{12})\.json')  # a plan is saved under its digest
LEFTOVER = re.compile(r'results/(plans/)?\.[^/]+(/.+)?')  # a staging temp file or journal of a stage killed mid-write
FOLDERS = ('results', 'results/plans')
COLUMN = re.compile(r'[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}')
UTC = re.compile(r'\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ')
CAPABILITY = re.compile(r'\d{1,2}\.\d{1,2}')
GIT_SHA = re.compile(r'[0-9a-f]{4,40}(\+dirty)?')
PACKAGE = re.compile(r'[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}')
_FORMAT = '\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff'  # invisible and bidi controls: text that shows otherwise
CONTROL = re.compile(f'[\\x00-\\x1f\\x7f-\\x9f{_FORMAT}]')        # no control character at all
CONTROL_CELL = re.compile(f'[\\x00-\\x08\\x0b-\\x1f\\x7f-\\x9f{_FORMAT}]')  # save a multi-line error's newline, tab
GPU_DEVICE = re.compile(r'cuda(:\d{1,2})?')  # a row's device: fingerprint's 'cuda', or a row's own 'cuda:0'
STATUS_FIELDS = ('stage', 'budget_s', 'elapsed_s', 'rc', 'status')
STAGE_STATUSES = ('ok', 'failed', 'killed at its budget', 'skipped', 'no wheels')  # what gpu_check.sh records
FILL = ('device', 'device_name', 'capability', 'git_sha')  # provenance columns a row may lack; filled from provenance
CPU_NAMES = ('', 'cpu', 'x86_64', 'amd64', 'aarch64', 'arm64', 'i386', 'i686')  # what device_name says of a bare CPU
_N = type(None)
# provenance.json, as gpu_stages.provenance writes it: key -> (required, the JSON types its value may take)
PROVENANCE = {'dry_run': (True, (bool,)), 'utc': (True, (str,)), 'python': (True, (str,)), 'host': (True, (str,)),
              'packages': (True, (dict,)), 'git_sha': (True, (str, _N)), 'code_matches_source': (True, (bool, _N)),
              'executable': (False, (str,)), 'source': (False, (dict,)), 'code_digest_run': (False, (str, _N)),
              'nvidia_smi': (False, (str, _N)), 'imports': (False, (dict,)), 'device': (False, (str,)),
              'device_name': (False, (str,)), 'capability': (False, (str, _N)), 'torch_cuda': (False, (str, _N)),
              'gpu_count': (False, (int,)), 'gpu_memory_GiB': (False, (int, float)), 'sm_count': (False, (int,))}
DEVICE_KEYS = ('device', 'device_name', 'capability')  # the probe stage writes all three; the packer's fallback none
MULTILINE = ('nvidia_smi',)  # nvidia-smi prints a line per GPU (or its error); imports' values are error messages


class BadTarball(ValueError):
    "A tarball that is not what tools/gpu_check.sh packs, or one that does not fit the store it is imported into."


# ------------------------------------------------------------------------------------------------------- the stream
class _Capped:
    "The decompressed bytes of a gzip file, at most `cap` of them: reading past it refuses the tarball."
    def __init__(self, gz, cap: int, path):
        self.gz, self.cap, self.n, self.path = gz, cap, 0, path

    def read(self, size: int = -1) -> bytes:
        want = self.cap + 1 - self.n if size is None or size < 0 else min(size, self.cap + 1 - self.n)
        data = self.gz.read(max(want, 0))
        self.n += len(data)
        if self.n > self.cap:
            raise BadTarball(f'{self.path}: unpacks to more than {self.cap} bytes (the cap): not a GPU run\'s tarball')
        return data


def _read_member(tar, m, path, cap: int) -> bytes:
    "Member `m`'s bytes, read in chunks, refused past `cap` (its header's size was checked: this is the proof)."
    f, parts, n = tar.extractfile(m), [], 0
    while chunk := f.read(min(CHUNK, cap + 1 - n)):
        n += len(chunk)
        if n > cap: raise BadTarball(f'{path}: member {m.name!r} is over {cap} bytes (the cap)')
        parts.append(chunk)
    if n != m.size: raise BadTarball(f'{path}: member {m.name!r} is cut short ({n} of {m.size} bytes)')
    return b''.join(parts)


def _wanted(name: str) -> bool:
    "Whether member `name` is one the import reads (else a hidden leftover, passed over, or refused as unexpected)."
    return name in ('provenance.json', 'status.tsv') or any(p.fullmatch(name) for p in (TABLE_MEMBER, PLAN_MEMBER))


def read_members(path) -> dict[str, bytes]:
    "{name: bytes} of the members the import reads, the tarball streamed under the caps; BadTarball for anything else."
    path = Path(path)
    if not path.is_file(): raise BadTarball(f'{path}: no such file')
    if path.stat().st_size > MAX_TARBALL:
        raise BadTarball(f'{path}: {path.stat().st_size} bytes, over the {MAX_TARBALL} a GPU run brings back')
    out, seen, declared = {}, set(), 0
    try:
        with open(path, 'rb') as raw, gzip.GzipFile(fileobj=raw, mode='rb') as gz:
            stream = _Capped(gz, MAX_TOTAL, path)
            with tarfile.open(fileobj=stream, mode='r|') as tar:
                for m in tar:
                    name = m.name
                    if name in seen: raise BadTarball(f'{path}: member {name!r} appears twice')
                    seen.add(name)
                    if len(seen) > MAX_MEMBERS: raise BadTarball(f'{path}: over {MAX_MEMBERS} members')
                    if name.startswith('/') or '..' in name.split('/') or '' in name.split('/') or CONTROL.search(name):
                        raise BadTarball(f'{path}: unsafe member {name!r}')
                    if m.isdir():
                        if name in FOLDERS or LEFTOVER.fullmatch(name): continue
                        raise BadTarball(f'{path}: unexpected folder {name!r}')
                    if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
                        raise BadTarball(f'{path}: member {name!r} is not a plain file (a link or a device)')
                    if m.size > MAX_MEMBER: raise BadTarball(f'{path}: member {name!r} is {m.size} bytes, '
                                                             f'over the {MAX_MEMBER} a member may have')
                    declared += m.size
                    if declared > MAX_TOTAL: raise BadTarball(f'{path}: members over {MAX_TOTAL} bytes in all')
                    if _wanted(name): out[name] = _read_member(tar, m, path, MAX_MEMBER)
                    elif not LEFTOVER.fullmatch(name): raise BadTarball(f'{path}: unexpected member {name!r}')
            while stream.read(CHUNK): pass  # to the gzip stream's end: its length and CRC prove it whole
    except BadTarball: raise
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise BadTarball(f'{path}: not a whole gzipped tarball ({type(e).__name__}: {e})') from None
    for need in ('provenance.json', 'status.tsv'):
        if need not in out: raise BadTarball(f'{path}: no {need} (not packed by tools/gpu_check.sh)')
    return out


# -------------------------------------------------------------------------------------------------- the members
def _text(path, name: str, data: bytes) -> str:
    "`data` as UTF-8 text without NUL, else BadTarball naming member `name`."
    if b'\0' in data: raise BadTarball(f'{path}: {name} holds a NUL byte')
    try: return data.decode('utf-8')
    except UnicodeDecodeError as e: raise BadTarball(f'{path}: {name} is not UTF-8 text (byte {e.start})') from None


def _plain(path, where: str, v, limit: int = 1000, multiline: bool = False):
    "Refuse text `v` with control characters (a newline and tab allowed in `multiline` text) or over `limit` chars."
    if isinstance(v, str):
        if (CONTROL_CELL if multiline else CONTROL).search(v):
            raise BadTarball(f'{path}: provenance.json {where} holds a control character')
        if len(v) > limit: raise BadTarball(f'{path}: provenance.json {where} is over {limit} characters')


def _no_dup_keys(pairs):
    "A JSON object's pairs as a dict, refusing a key given twice (json's default keeps the last, silently)."
    keys = [k for k, _ in pairs]
    if dup := sorted({k for k in keys if keys.count(k) > 1}): raise ValueError(f'key {dup[0][:40]!r} given twice')
    return dict(pairs)


def _no_constant(c): raise ValueError(f'{c} is not a JSON number')


def _json(path, name: str, data: bytes):
    try: return json.loads(_text(path, name, data), object_pairs_hook=_no_dup_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
        raise BadTarball(f'{path}: {name} is not JSON ({type(e).__name__}: {str(e)[:120]})') from None


def _is(v, types) -> bool:
    "Whether `v` is exactly one of the JSON `types` (True is not an int here, as JSON tells them apart)."
    return any(type(v) is t for t in types) or (float in types and type(v) is int)


def check_provenance(prov, path='provenance.json') -> dict:
    "`prov` if it has provenance.json's keys, each of its type and well-formed, and says one consistent thing."
    if not isinstance(prov, dict):
        raise BadTarball(f'{path}: provenance.json is a {type(prov).__name__}, not an object')
    if extra := sorted(set(prov) - set(PROVENANCE)):
        raise BadTarball(f'{path}: provenance.json has unexpected keys {extra[:5]} (it holds {sorted(PROVENANCE)})')
    for k, (required, types) in PROVENANCE.items():
        if k not in prov:
            if required: raise BadTarball(f'{path}: provenance.json has no {k!r}')
            continue
        v = prov[k]
        if not _is(v, types):
            want = ' or '.join('null' if t is _N else {bool: 'true/false', dict: 'an object'}.get(t, t.__name__)
                               for t in types)
            raise BadTarball(f'{path}: provenance.json {k!r} must be {want}, got {json.dumps(v)[:40]}')
        _plain(path, repr(k), v, 4000 if k in MULTILINE else 1000, k in MULTILINE)
        if type(v) is float and not math.isfinite(v): raise BadTarball(f'{path}: provenance.json {k!r} is not finite')
        if type(v) is int and v < 0: raise BadTarball(f'{path}: provenance.json {k!r} is negative')
    for k, pat in (('utc', UTC), ('git_sha', GIT_SHA), ('capability', CAPABILITY)):
        if isinstance(prov.get(k), str) and not pat.fullmatch(prov[k]):
            raise BadTarball(f'{path}: provenance.json {k!r} is not well-formed: {prov[k][:40]!r}')
    for k, values, limit in (('packages', (str, _N), 1000), ('source', (str, bool, int, _N), 1000),
                             ('imports', (str,), 4000)):
        for name, v in prov.get(k, {}).items():
            if not PACKAGE.fullmatch(name) or not _is(v, values):
                raise BadTarball(f'{path}: provenance.json {k!r} has a bad entry {name[:40]!r}: {json.dumps(v)[:40]}')
            _plain(path, f'{k}[{name!r}]', v, limit, k == 'imports')
    # what it says must hang together: the probe stage writes the device's three keys, the packer's fallback none
    if (has := [k for k in DEVICE_KEYS if k in prov]) and len(has) < len(DEVICE_KEYS):
        raise BadTarball(f'{path}: provenance.json names {has} of the device but not all of {list(DEVICE_KEYS)}')
    if has:
        dev, name, cap = (prov[k] for k in DEVICE_KEYS)
        if prov['dry_run'] and (dev != 'cpu' or cap is not None):
            raise BadTarball(f'{path}: provenance.json says a dry run (a CPU) but names device {dev!r}, '
                             f'capability {cap}')
        if not prov['dry_run']:
            if dev != 'cuda' or cap is None or _cpu_name(name):
                raise BadTarball(f'{path}: provenance.json says a GPU run (dry_run false) but names device {dev!r} '
                                 f'{name[:60]!r}, capability {cap}: a CPU run cannot be imported as a GPU run')
            if prov.get('gpu_count', 1) < 1: raise BadTarball(f'{path}: provenance.json: a GPU run with gpu_count 0')
            if 'torch_cuda' in prov and prov['torch_cuda'] is None:
                raise BadTarball(f'{path}: provenance.json: a GPU run whose torch has no CUDA (torch_cuda null)')
    return prov


def _cpu_name(name) -> bool:
    "Whether a device name is a CPU's (the lab names one 'CPU <model>', else the platform's processor)."
    return not isinstance(name, str) or name.strip().lower() in CPU_NAMES or name.startswith('CPU')


def parse_status(text: str, path='status.tsv') -> list[dict]:
    "status.tsv's lines (stage, budget s, took s, rc, status), each checked; BadTarball naming the first bad line."
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip(): continue
        f = line.split('\t')
        if len(f) != len(STATUS_FIELDS):
            raise BadTarball(f'{path}: status.tsv line {i}: {len(f)} fields, expected {len(STATUS_FIELDS)} '
                             f'({", ".join(STATUS_FIELDS)})')
        r = dict(zip(STATUS_FIELDS, f))
        if r['stage'] not in ('install', *RUN_STAGES):
            raise BadTarball(f'{path}: status.tsv line {i}: unknown stage {r["stage"][:40]!r} '
                             f'(the stages: install, {", ".join(RUN_STAGES)})')
        if not all(re.fullmatch(r'-?\d{1,9}', r[k]) for k in ('budget_s', 'elapsed_s', 'rc')):
            raise BadTarball(f'{path}: status.tsv line {i}: budget, time and rc must be integers')
        if r['status'] not in STAGE_STATUSES:
            raise BadTarball(f'{path}: status.tsv line {i}: status {r["status"][:40]!r} is not one of {STAGE_STATUSES}')
        rows.append(r)
    if not rows: raise BadTarball(f'{path}: status.tsv is empty: no stage ran')
    return rows


def parse_table(kind: str, data: bytes, path='table'):
    "A tarball table's text parsed strictly: (header, rows as lists of str); BadTarball naming the first problem."
    name = f'results/{kind}.csv'
    text = _text(path, name, data)
    if not text: return [], []
    if not text.endswith('\n'): raise BadTarball(f'{path}: {name}: the last line is cut short (no newline)')
    reader = csv.reader(io.StringIO(text))
    try:
        header, rows = next(reader), []
        for r in reader:
            if len(r) != len(header):
                raise BadTarball(f'{path}: {name} line {reader.line_num}: {len(r)} fields where the header has '
                                 f'{len(header)}')
            for c in r:
                if CONTROL_CELL.search(c):
                    raise BadTarball(f'{path}: {name} line {reader.line_num}: a control character '
                                     f'{CONTROL_CELL.search(c).group()!r} in a cell')
                if len(c) > MAX_CELL:
                    raise BadTarball(f'{path}: {name} line {reader.line_num}: a cell over {MAX_CELL} characters')
            rows.append(r)
    except csv.Error as e: raise BadTarball(f'{path}: {name} line {reader.line_num}: not CSV ({e})') from None
    if bad := [h for h in header if not COLUMN.fullmatch(h)]:
        raise BadTarball(f'{path}: {name}: bad column name {bad[0][:40]!r}')
    if dup := sorted({h for h in header if header.count(h) > 1}):
        raise BadTarball(f'{path}: {name}: repeated columns {dup[:5]}')
    if missing := [c for c in ('run', 'utc') if c not in header]:
        raise BadTarball(f'{path}: {name} has no {missing[0]} column: not the lab\'s results store')
    return header, rows


def parse_plan(digest: str, data: bytes, path='plan') -> str:
    "Plan `digest`'s text as the store writes it (compact), if it loads as a QuantPlan of that digest; else BadTarball."
    from diffq_lab.plan import QuantPlan
    name = f'results/plans/{digest}.json'
    try: plan = QuantPlan.from_json(_text(path, name, data))
    except BadTarball: raise
    except ValueError as e: raise BadTarball(f'{path}: {name}: {str(e)[:200]}') from None
    if plan.digest() != digest: raise BadTarball(f'{path}: {name} holds plan {plan.digest()}, not {digest}')
    return plan.to_json(compact=True)


def read_tarball(path) -> dict:
    "provenance, status rows, tables {kind: DataFrame of text} and plans {file name: text} of a GPU run's tarball."
    import pandas as pd
    members = read_members(path)
    prov = check_provenance(_json(path, 'provenance.json', members.pop('provenance.json')), path)
    status = parse_status(_text(path, 'status.tsv', members.pop('status.tsv')), path)
    tables, plans = {}, {}
    for name, data in sorted(members.items()):
        if m := PLAN_MEMBER.fullmatch(name): plans[f'{m[1]}.json'] = parse_plan(m[1], data, path)
        else:
            kind = TABLE_MEMBER.fullmatch(name)[1]
            header, rows = parse_table(kind, data, path)
            tables[kind] = pd.DataFrame(rows, columns=header, dtype=object)  # text as packed: no float re-rendering
    ran = {r['stage'] for r in status}
    for kind in tables:
        by = [s for s, kinds in TABLES.items() if kind in kinds]
        if by and not set(by) & ran:
            raise BadTarball(f'{path}: results/{kind}.csv is written by stage {" or ".join(by)}, which status.tsv '
                             'does not list')
    return dict(provenance=prov, status=status, tables={k: v for k, v in tables.items() if not v.empty}, plans=plans,
                headers={k: list(v.columns) for k, v in tables.items()})


# ----------------------------------------------------------------------------------------------------- the store
def _header(csv_path: Path) -> list:
    "The header of a results table on disk (read alone: the repo's own store is not replayed or locked here)."
    if not csv_path.is_file(): return []
    try:
        with open(csv_path, newline='', encoding='utf-8') as f: return next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise BadTarball(f'{csv_path}: unreadable header ({e})') from None


def allowed_columns(kind: str, have_columns=(), path='tarball') -> set | None:
    "The columns a `kind` row may have: its data/results header and the target's; None: any (a new GPU stage kind)."
    if kind == 'gpu_runs': raise BadTarball(f'{path}: results/gpu_runs.csv: that table is the import\'s own')
    known = set(_header(REPO/'data'/'results'/f'{kind}.csv')) | set(have_columns) | set(NEW_COLS.get(kind, ()))
    if known: return known
    if not any(kind in kinds for kinds in TABLES.values()):
        raise BadTarball(f'{path}: results/{kind}.csv: neither data/results nor a GPU stage has a {kind!r} table '
                         f'(the stages write: {", ".join(sorted({k for ks in TABLES.values() for k in ks}))})')
    return None


def _blank(s) -> bool: return s is None or (isinstance(s, float) and math.isnan(s)) or str(s).strip() == ''


def _filled(df, prov: dict):
    "`df` with its blank provenance cells (or missing columns) taken from provenance.json; the stamped commit's sha."
    df = df.copy()
    for col in FILL:
        v = prov.get(col)
        if v is None: continue
        if col not in df: df[col] = v
        else: df[col] = [v if _blank(x) else x for x in df[col]]
    src = (prov.get('source') or {}).get('git_sha')
    # the code that ran hashed to the stamped commit's: that commit is the rows' source, whatever the device's copy of
    # .git said (the run tool's copy may carry a stale one: rows read "<the session's first sha>+dirty")
    if prov.get('code_matches_source') and src: df['git_sha'] = src
    return df


def check_rows(kind: str, df, prov: dict, path='tarball') -> set:
    "Refuse a row without its run, UTC time or device, or measured elsewhere than the run says; {(device_name, cap)}."
    dry, where = prov['dry_run'], f'{path}: results/{kind}.csv'
    for col in ('device', 'device_name'):
        if col not in df: raise BadTarball(f'{where}: its rows do not say their {col}, nor does provenance.json')
    seen = set()
    for i, r in enumerate(df.to_dict('records'), 2):
        if _blank(r['run']) or not UTC.fullmatch(str(r['utc'])):
            raise BadTarball(f'{where} line {i}: a row needs its run id and a UTC time (YYYY-MM-DDTHH:MM:SSZ)')
        dev, name, cap = r['device'], r['device_name'], r.get('capability')
        if not (dev == 'cpu' if dry else isinstance(dev, str) and GPU_DEVICE.fullmatch(dev)):
            raise BadTarball(f'{where} line {i}: measured on {str(dev)[:20]!r}, but the run is a '
                             f'{"dry run (cpu)" if dry else "GPU run (cuda)"}')
        if not dry and (_cpu_name(name) or _blank(cap) or not CAPABILITY.fullmatch(str(cap))):
            raise BadTarball(f'{where} line {i}: a GPU row on {str(name)[:60]!r}, capability {cap}: not a GPU\'s')
        if dry and not _blank(cap): raise BadTarball(f'{where} line {i}: a dry run\'s row with capability {cap}')
        for k, v in (('device_name', name), ('capability', cap)):
            if prov.get(k) is not None and v != prov[k]:
                raise BadTarball(f'{where} line {i}: {k} {str(v)[:60]!r}, but provenance.json says {prov[k]!r}')
        seen.add((name, None if _blank(cap) else cap))
    return seen


def _check_target(root: Path, plans: dict, path):
    "Before anything is written: refuse a store or plans folder that is not a folder, a plan's name that is not a file."
    if root.exists() and not root.is_dir(): raise BadTarball(f'{path}: cannot import into {root}: it is not a folder')
    if (root/'plans').is_symlink() or (root/'plans').exists() and not (root/'plans').is_dir():
        raise BadTarball(f'{path}: cannot put plans into {root/"plans"}: it is not a folder (or is a link)')
    for name in plans:
        f = root/'plans'/name
        if (f.exists() or f.is_symlink()) and not (f.is_file() and not f.is_symlink()):
            raise BadTarball(f'{path}: {f} exists and is not a plan file')


def import_tarball(path, into=None, allow_dry_run: bool = False) -> dict:
    "Append the tarball's tables (and a 'gpu_runs' row) and its new plans to the store at `into`, one commit; counts."
    run = read_tarball(path)  # first: a bad tarball is refused before torch is imported
    from diffq_lab.core import load_table, results_dir
    from diffq_lab.store import append_tables
    prov = run['provenance']
    if prov['dry_run'] and not allow_dry_run:
        raise BadTarball(f'{path}: a dry run ({prov.get("device_name", "CPU")}): its rows are not GPU rows '
                         '(--allow-dry-run to import anyway)')
    root = results_dir(into)
    _check_target(root, run['plans'], path)
    new, added, devices = {}, {}, set()
    for kind, header in run['headers'].items():
        have = load_table(kind, root) if (root/f'{kind}.csv').exists() else None
        allowed = allowed_columns(kind, [] if have is None else have.columns, path)
        if allowed is not None and (foreign := [c for c in header if c not in allowed]):
            raise BadTarball(f'{path}: results/{kind}.csv has columns the {kind} table does not: {foreign[:5]}')
        if allowed is None and len(header) > MAX_COLUMNS:
            raise BadTarball(f'{path}: results/{kind}.csv has {len(header)} columns, over {MAX_COLUMNS}')
        if kind not in run['tables']: continue
        df = _filled(run['tables'][kind], prov)
        devices |= check_rows(kind, df, prov, path)
        if have is not None and 'run' in have: df = df[~df['run'].isin(set(have['run'].astype(str)))]
        added[kind] = len(df)
        if len(df): new[kind] = df.to_dict('records')
    if len({d for d, _ in devices}) > 1:
        raise BadTarball(f'{path}: its rows name several devices {sorted(d for d, _ in devices)[:3]}: '
                         'a run has one')
    name, cap = next(iter(devices), (prov.get('device_name'), prov.get('capability')))
    runs = sorted({r for df in run['tables'].values() for r in df['run']})
    gpu_runs = load_table('gpu_runs', root) if (root/'gpu_runs.csv').exists() else None
    key = f"{prov['utc']}|{prov.get('device_name', name)}|{prov['host']}"
    if new or gpu_runs is None or 'key' not in gpu_runs or key not in set(gpu_runs['key']):
        pk = prov['packages']
        stages = '; '.join(f"{s['stage']} {s['status']} {s['elapsed_s']}/{s['budget_s']} s" for s in run['status'])
        smi = prov.get('nvidia_smi')
        new['gpu_runs'] = [dict(key=key, utc=prov['utc'], device='cpu' if prov['dry_run'] else 'cuda',
                                device_name=name, capability=cap, git_sha=prov['git_sha'],
                                code_matches_source=prov['code_matches_source'], python=prov['python'],
                                torch_cuda=prov.get('torch_cuda'),
                                nvidia_smi=' | '.join(smi.split('\n')).replace('\t', ' ') if smi else smi,
                                **{k: pk.get(k) for k in ('torch', 'torchao', 'diffusers', 'transformers')},
                                packages=json.dumps(pk), runs=' '.join(runs), stages=stages, tarball=Path(path).name)]
        added['gpu_runs'] = 1
    plans = {n: t for n, t in run['plans'].items() if not (root/'plans'/n).is_file()}  # a digest names one plan
    added['plans'] = len(plans)
    if not (new or plans): return added
    root.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix='.diffq-gpu-import-', dir=root)) if plans else None  # same filesystem
    try:
        for n, text in plans.items(): (stage/n).write_text(text, encoding='utf-8'); (stage/n).chmod(0o644)
        # rows and plans in one journalled commit: all land, or none (each row says where it was measured: allow_dirty)
        append_tables(new, root=root, allow_dirty=True, report=(stage, root/'plans') if plans else None)
    finally:
        if stage is not None: shutil.rmtree(stage, ignore_errors=True)
    return added


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('tarball'); ap.add_argument('--into', default=None, help='results folder (default: data/results)')
    ap.add_argument('--allow-dry-run', action='store_true')
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    try: added = import_tarball(a.tarball, a.into, a.allow_dry_run)
    except (ValueError, OSError) as e:  # BadTarball, a damaged store table (DamagedTable), a store we cannot write
        msg = ' '.join(str(e).split())
        print(f'gpu_import: {msg if isinstance(e, ValueError) else f"{type(e).__name__}: {msg}"} (nothing was '
              'imported)', file=sys.stderr)
        return 2
    for k, n in added.items(): print(f'{k}: {n} {"files" if k == "plans" else "rows"} added')
    return 0


if __name__ == '__main__':
    sys.exit(main())
