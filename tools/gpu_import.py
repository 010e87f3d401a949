"""Bring a GPU run's rows home: unpack the results.tar.gz that tools/gpu_check.sh left in $OUT into data/results.

    python3 tools/gpu_import.py OUT/results.tar.gz [--into data/results] [--allow-dry-run]

Every table in the tarball is appended to the table of the same name (the lab's locked, all-or-nothing store, one
recording), rows keeping the run id, device, capability and versions they were measured with; a row without a git sha
(the device's tree has no .git) takes the sha the run was stamped with (provenance.json, '+dirty' when the code that ran
differed from it). One row per run goes to the 'gpu_runs' table: device, versions, source and each stage's outcome.
Runs already in a table are skipped, so importing twice changes nothing. A dry run's (CPU) tarball is refused unless
--allow-dry-run. Exit 2, with nothing written, for a tarball that is not one of the script's.
"""
from __future__ import annotations
import argparse, io, json, re, sys, tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KIND = re.compile(r'[a-z0-9][a-z0-9_\-]*')
FILL = ('device_name', 'capability', 'git_sha')  # provenance columns a row may lack; filled from provenance.json


class BadTarball(ValueError):
    "A tarball that is not what tools/gpu_check.sh packs."


def read_tarball(path) -> dict:
    "provenance, status rows, tables {kind: DataFrame} and plans {name: bytes} of a GPU run's tarball, else BadTarball."
    import pandas as pd
    path = Path(path)
    if not path.is_file(): raise BadTarball(f'{path}: no such file')
    try: tar = tarfile.open(path, 'r:gz')
    except (tarfile.TarError, OSError) as e: raise BadTarball(f'{path}: not a gzipped tarball ({e})') from None
    prov, status, tables, plans = None, [], {}, {}
    with tar:
        for m in tar.getmembers():
            name = m.name
            if name.startswith('/') or '..' in Path(name).parts: raise BadTarball(f'{path}: unsafe member {name!r}')
            if m.isdir(): continue
            if not m.isfile(): raise BadTarball(f'{path}: member {name!r} is not a plain file')
            data = tar.extractfile(m).read()
            parts = Path(name).parts
            if name == 'provenance.json': prov = json.loads(data)
            elif name == 'status.tsv':
                status = [dict(zip(('stage', 'budget_s', 'elapsed_s', 'rc', 'status'), line.split('\t')))
                          for line in data.decode().splitlines() if line.strip()]
            elif len(parts) == 2 and parts[0] == 'results' and name.endswith('.csv'):
                kind = Path(name).stem
                if not KIND.fullmatch(kind): raise BadTarball(f'{path}: bad table name {name!r}')
                tables[kind] = pd.read_csv(io.BytesIO(data)) if data.strip() else pd.DataFrame()
            elif len(parts) == 3 and parts[:2] == ('results', 'plans') and name.endswith('.json'):
                plans[parts[2]] = data
            elif parts[0] == 'results' and (name.endswith('.tmp') or Path(name).name.startswith('.')):
                continue  # a table's staging leftover (a stage killed mid-write)
            else: raise BadTarball(f'{path}: unexpected member {name!r}')
    if prov is None: raise BadTarball(f'{path}: no provenance.json (not packed by tools/gpu_check.sh)')
    return dict(provenance=prov, status=status, tables={k: v for k, v in tables.items() if not v.empty}, plans=plans)


def _filled(df, prov: dict):
    df = df.copy()
    for col in FILL:
        v = prov.get(col)
        if v is None: continue
        if col not in df: df[col] = v
        else: df[col] = df[col].astype(object).where(df[col].notna() & (df[col].astype(str) != ''), v)
    return df


def import_tarball(path, into=None, allow_dry_run: bool = False) -> dict:
    "Append the tarball's tables (and a 'gpu_runs' row) to the results store at `into`; {table: rows added}."
    from diffq_lab.core import load_table, record_tables, results_dir
    run = read_tarball(path)
    prov = run['provenance']
    if prov.get('dry_run') and not allow_dry_run:
        raise BadTarball(f'{path}: a dry run ({prov.get("device_name")}): its rows are not GPU rows '
                         '(--allow-dry-run to import anyway)')
    root = results_dir(into)
    new, added = {}, {}
    for kind, df in run['tables'].items():
        df = _filled(df, prov)
        have = load_table(kind, root)
        if 'run' in df and 'run' in have: df = df[~df['run'].isin(set(have['run']))]
        if 'utc' not in df: raise BadTarball(f'{path}: table {kind} has no utc column: not the lab\'s results store')
        added[kind] = len(df)
        if len(df): new[kind] = df.astype(object).where(df.notna(), None).to_dict('records')
    runs = sorted({r for df in run['tables'].values() if 'run' in df for r in df['run'].dropna()})
    gpu_runs = load_table('gpu_runs', root)
    key = f"{prov.get('utc')}|{prov.get('device_name')}|{prov.get('host')}"
    if new or 'key' not in gpu_runs or key not in set(gpu_runs['key']):
        pk = prov.get('packages') or {}
        stages = '; '.join(f"{s['stage']} {s['status']} {s['elapsed_s']}/{s['budget_s']} s" for s in run['status'])
        new['gpu_runs'] = [dict(key=key, utc=prov.get('utc'), device='cuda' if prov.get('capability') else 'cpu',
                                device_name=prov.get('device_name'), capability=prov.get('capability'),
                                git_sha=prov.get('git_sha'), code_matches_source=prov.get('code_matches_source'),
                                python=prov.get('python'), torch_cuda=prov.get('torch_cuda'),
                                nvidia_smi=prov.get('nvidia_smi'),
                                **{k: pk.get(k) for k in ('torch', 'torchao', 'diffusers', 'transformers')},
                                packages=json.dumps(pk), runs=' '.join(runs), stages=stages, tarball=Path(path).name)]
        added['gpu_runs'] = 1
    if new: record_tables(new, root=root, allow_dirty=True)  # each row says where it was measured; here it is filed
    plans = root/'plans'
    for name, data in run['plans'].items():
        if not (plans/name).exists():
            plans.mkdir(parents=True, exist_ok=True); (plans/name).write_bytes(data)
    added['plans'] = len(run['plans'])
    return added


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('tarball'); ap.add_argument('--into', default=None, help='results folder (default: data/results)')
    ap.add_argument('--allow-dry-run', action='store_true')
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    try: added = import_tarball(a.tarball, a.into, a.allow_dry_run)
    except (BadTarball, ValueError) as e: print(f'gpu_import: {e}', file=sys.stderr); return 2
    for k, n in added.items(): print(f'{k}: {n} {"files" if k == "plans" else "rows"} added')
    return 0


if __name__ == '__main__':
    sys.exit(main())
