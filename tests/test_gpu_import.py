"""tools/gpu_import.py against hostile tarballs: each is built small in tmp_path, and each refusal must be one line on
stderr, exit 2, with the store exactly as it was; a good tarball imports its rows and plans in one commit."""
import csv, gzip, importlib.util, io, json, os, sys, tarfile, time
from pathlib import Path
import pytest

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO/'tools'
sys.path.insert(0, str(TOOLS))
if 'gpu_import' not in sys.modules:
    spec = importlib.util.spec_from_file_location('gpu_import', TOOLS/'gpu_import.py')
    sys.modules['gpu_import'] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules['gpu_import'])
gi = sys.modules['gpu_import']
gs = sys.modules['gpu_stages']  # imported by gpu_import

PROV = dict(dry_run=False, python='3.12.3', executable='/usr/bin/python3', host='gpu', device='cuda',
            device_name='NVIDIA H200', capability='9.0', torch_cuda='13.0', gpu_count=1, gpu_memory_GiB=139.8,
            sm_count=132, git_sha='abc123def456', code_matches_source=True, code_digest_run='0123456789abcdef',
            source=dict(git_sha='abc123def456', dirty=False, code_digest='0123456789abcdef'),
            nvidia_smi='NVIDIA H200, 570.86, 143771 MiB, 1980 MHz', utc='2026-12-02T10:00:00Z',
            packages=dict(torch='2.11.0+cu130', torchao='0.18.0', diffusers='0.42.1', transformers='5.17.0'),
            imports={'torch': 'ok', 'gguf': 'ModuleNotFoundError: No module named gguf'})
STATUS = 'install\t20\t3\t0\tok\nprobe\t30\t12\t0\tok\n'
COLS = ['run', 'device', 'device_name', 'capability', 'torch', 'git_sha', 'utc', 'scheme', 'gate_ok', 'probe_ok',
        'rel_err', 'runs_as']  # capability.csv's columns (a subset of data/results')
RUN = '2026-12-02T10:01:00Z-aaaaaa'


def _csv(rows, cols=COLS) -> bytes:
    f = io.StringIO(); w = csv.writer(f, lineterminator='\n'); w.writerow(cols); w.writerows(rows)
    return f.getvalue().encode()


def _row(scheme='int8', **kw):
    r = dict(run=RUN, device='cuda', device_name='NVIDIA H200', capability='9.0', torch='2.11.0+cu130', git_sha='',
             utc='2026-12-02T10:01:00Z', scheme=scheme, gate_ok='True', probe_ok='True', rel_err='0.011',
             runs_as='torchao kernel')
    return [{**r, **kw}[c] for c in COLS]


def _plan():
    from diffq_lab.plan import ComponentPlan, LinearPlan, QuantPlan
    return QuantPlan({'': ComponentPlan({'lin': LinearPlan(None, None, 'too narrow', (8, 8))})})


PLAN = _plan()
PLAN_NAME = f'results/plans/{PLAN.digest()}.json'


def _members(prov=PROV, status=STATUS, table=None, plan=True):
    "A good run's members, in gpu_stages.pack's order: (name, bytes or None for a folder)."
    ms = [('provenance.json', json.dumps(prov).encode()), ('status.tsv', status.encode()), ('results', None),
          ('results/capability.csv', table if table is not None else _csv([_row('int8'), _row('fp8')]))]
    if plan: ms += [('results/plans', None), (PLAN_NAME, PLAN.to_json(compact=True).encode())]
    return ms


def _pack(path, members):
    "A .tar.gz of `members`: (name, bytes | None: a folder | TarInfo: as given)."
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode='w', format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            if isinstance(data, tarfile.TarInfo): tar.addfile(data); continue
            info = tarfile.TarInfo(name)
            if data is None: info.type = tarfile.DIRTYPE; tar.addfile(info)
            else: info.size = len(data); tar.addfile(info, io.BytesIO(data))
    path.write_bytes(gzip.compress(buf.getvalue(), compresslevel=1))
    return path


@pytest.fixture
def store(tmp_path):
    "A results store holding a CPU capability row."
    s = tmp_path/'store'; s.mkdir()
    (s/'capability.csv').write_bytes(_csv([_row('int8', run='cpu-run', device='cpu', device_name='CPU AMD EPYC',
                                                capability='', git_sha='111')]))
    return s


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None for p in folder.rglob('*')}


def _refused(tmp_path, store, capsys, members=None, path=None, says='', **kw):
    "Import the tarball of `members` (or `path`): exit 2, one line naming `says`, the store unchanged."
    path = path or _pack(tmp_path/'run.tar.gz', members)
    before = _snapshot(store)
    assert gi.main([str(path), '--into', str(store), *kw.get('args', ())]) == 2
    out, err = capsys.readouterr()
    assert err.count('\n') == 1 and err.startswith('gpu_import: ') and 'Traceback' not in err, err
    assert says in err, err
    assert _snapshot(store) == before and out == ''
    return err


# ------------------------------------------------------------------------------------------------------ good runs
def test_a_good_run_imports_once(tmp_path, store, capsys):
    path = _pack(tmp_path/'run.tar.gz', _members())
    assert gi.main([str(path), '--into', str(store)]) == 0
    assert capsys.readouterr().out.splitlines() == ['capability: 2 rows added', 'gpu_runs: 1 rows added',
                                                    'plans: 1 files added']
    import pandas as pd
    cap = pd.read_csv(store/'capability.csv')
    assert list(cap.device_name) == ['CPU AMD EPYC', 'NVIDIA H200', 'NVIDIA H200']
    assert list(cap.git_sha.astype(str)) == ['111', 'abc123def456', 'abc123def456']  # the stamped sha fills the blank
    runs = pd.read_csv(store/'gpu_runs.csv')
    assert runs.device.tolist() == ['cuda'] and runs.capability.tolist() == [9.0] and runs.runs.tolist() == [RUN]
    assert (store/'plans'/f'{PLAN.digest()}.json').read_text() == PLAN.to_json(compact=True)
    assert sorted(p.name for p in store.iterdir()) == ['capability.csv', 'gpu_runs.csv', 'plans']  # no leftovers
    before = _snapshot(store)
    assert gi.import_tarball(path, store) == {'capability': 0, 'plans': 0}  # twice: nothing added
    assert _snapshot(store) == before
    (store/'plans'/f'{PLAN.digest()}.json').unlink()  # a plan lost since: it alone comes back
    assert gi.import_tarball(path, store) == {'capability': 0, 'plans': 1} and _snapshot(store) == before


def test_the_stamped_commit_is_the_rows_source_when_the_code_matches(tmp_path, store):
    "A device copy's stale .git says another sha (+dirty): the code digest matched the stamp, so the stamp's sha wins."
    import pandas as pd
    table = _csv([_row(git_sha='e887c3161a77+dirty'), _row('fp8', git_sha='e887c3161a77+dirty')])
    gi.import_tarball(_pack(tmp_path/'run.tar.gz', _members(table=table)), store)
    assert list(pd.read_csv(store/'capability.csv').git_sha.astype(str))[1:] == ['abc123def456'] * 2
    other = {**PROV, 'code_matches_source': False}  # code not the stamp's: each row keeps what it says
    gi.import_tarball(_pack(tmp_path/'run2.tar.gz', _members(prov=other, table=_csv([_row(run='r2', git_sha='f00')]))),
                      store)
    assert pd.read_csv(store/'capability.csv').git_sha.astype(str).iloc[-1] == 'f00'


def test_leftovers_newlines_and_a_new_stage_kind(tmp_path, store):
    te = _csv([['r1', 'cuda', 'NVIDIA H200', '9.0', '2026-12-02T10:05:00Z', 'fp8', 'RuntimeError: CUDA error\n\tat x']],
              ['run', 'device', 'device_name', 'capability', 'utc', 'scheme', 'error'])
    ms = [*_members(status=STATUS + 'text_encoder\t40\t30\t0\tok\n', plan=False), ('results/te_bench.csv', te),
          ('results/.capability.csv.x1.tmp', b'half a table'), ('results/.diffq-commit-1-ab.staging', None),
          ('results/.diffq-commit-1-ab.staging/0.table', b'x')]
    assert gi.import_tarball(_pack(tmp_path/'run.tar.gz', ms), store) == {'capability': 2, 'te_bench': 1,
                                                                          'gpu_runs': 1, 'plans': 0}
    import pandas as pd
    assert pd.read_csv(store/'te_bench.csv').error[0] == 'RuntimeError: CUDA error\n\tat x'  # a multi-line error


def test_a_dry_run_only_when_allowed(tmp_path, store, capsys):
    prov = dict(PROV, dry_run=True, device='cpu', device_name='CPU AMD EPYC', capability=None, torch_cuda=None,
                gpu_count=0)
    table = _csv([_row(device='cpu', device_name='CPU AMD EPYC', capability='', run='dry-1')])
    path = _pack(tmp_path/'dry.tar.gz', _members(prov=prov, table=table))
    _refused(tmp_path, store, capsys, path=path, says='--allow-dry-run to import anyway')
    assert gi.main([str(path), '--into', str(store), '--allow-dry-run']) == 0
    import pandas as pd
    assert pd.read_csv(store/'gpu_runs.csv').device.tolist() == ['cpu']


def test_a_row_may_name_its_gpu_by_index(tmp_path, store):
    path = _pack(tmp_path/'run.tar.gz', _members(table=_csv([_row(device='cuda:0')]), plan=False))
    assert gi.import_tarball(path, store)['capability'] == 1


def test_a_rerun_without_the_probe_takes_its_device_from_the_rows(tmp_path, store):
    prov = {k: v for k, v in PROV.items() if k not in ('device', 'device_name', 'capability', 'torch_cuda',
                                                        'gpu_count', 'gpu_memory_GiB', 'sm_count', 'imports')}
    ms = _members(prov=prov, status='install\t20\t3\t0\tok\nprobe\t30\t12\t0\tok\n')
    assert gi.import_tarball(_pack(tmp_path/'run.tar.gz', ms), store)['capability'] == 2
    import pandas as pd
    assert pd.read_csv(store/'gpu_runs.csv').device_name.tolist() == ['NVIDIA H200']


# ------------------------------------------------------------------------------------------ refused: what it holds
def test_required_members(tmp_path, store, capsys):
    ms = _members()
    _refused(tmp_path, store, capsys, [m for m in ms if m[0] != 'status.tsv'], says='no status.tsv')
    _refused(tmp_path, store, capsys, [m for m in ms if m[0] != 'provenance.json'], says='no provenance.json')
    _refused(tmp_path, store, capsys, path=tmp_path/'missing.tar.gz', says='no such file')


def test_duplicate_unexpected_and_unsafe_members(tmp_path, store, capsys):
    ms = _members()
    _refused(tmp_path, store, capsys, [*ms, ('results/capability.csv', _csv([_row('nvfp4')]))], says='appears twice')
    for name in ('run.sh', 'results/sub/x.csv', 'results/Capability.csv', 'results/plans/x.json', 'extra/a'):
        _refused(tmp_path, store, capsys, [*ms, (name, b'x')], says='unexpected')
    for name in ('../escape.csv', '/etc/x', 'results//a.csv'):
        _refused(tmp_path, store, capsys, [*ms, (name, b'x')], says='unsafe member')
    link = tarfile.TarInfo('results/numerics.csv'); link.type = tarfile.SYMTYPE; link.linkname = '/etc/passwd'
    _refused(tmp_path, store, capsys, [*ms, ('', link)], says='not a plain file')
    hard = tarfile.TarInfo('results/agreement.csv'); hard.type = tarfile.LNKTYPE; hard.linkname = 'status.tsv'
    _refused(tmp_path, store, capsys, [*ms, ('', hard)], says='not a plain file')


def test_broken_archives(tmp_path, store, capsys):
    good = _pack(tmp_path/'good.tar.gz', _members()).read_bytes()
    (tmp_path/'cut.tar.gz').write_bytes(good[:len(good) // 2])
    _refused(tmp_path, store, capsys, path=tmp_path/'cut.tar.gz', says='not a whole gzipped tarball')
    (tmp_path/'cut_end.tar.gz').write_bytes(good[:-4])  # only the gzip trailer lost: the CRC check finds it
    _refused(tmp_path, store, capsys, path=tmp_path/'cut_end.tar.gz', says='not a whole gzipped tarball')
    (tmp_path/'plain.tar.gz').write_bytes(b'just text\n')
    _refused(tmp_path, store, capsys, path=tmp_path/'plain.tar.gz', says='not a whole gzipped tarball')
    (tmp_path/'notar.tar.gz').write_bytes(gzip.compress(b'x' * 2000))
    _refused(tmp_path, store, capsys, path=tmp_path/'notar.tar.gz', says='not a whole gzipped tarball')


def test_gzip_bombs_stop_at_the_cap(tmp_path, store, capsys, monkeypatch):
    # a member declaring 9 GB: refused at its header, before a byte of it is read
    huge = tarfile.TarInfo('results/capability.csv'); huge.size = 9 * 2**30
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode='w') as tar: tar.addfile(tarfile.TarInfo('status.tsv'), io.BytesIO(b''))
    body = raw.getvalue()[:512] + huge.tobuf(tarfile.GNU_FORMAT) + b'\0' * 2**20
    (tmp_path/'bomb.tar.gz').write_bytes(gzip.compress(body, compresslevel=1))
    t0 = time.perf_counter()
    _refused(tmp_path, store, capsys, path=tmp_path/'bomb.tar.gz', says='over the')
    assert time.perf_counter() - t0 < 2
    # bytes no member header declares (a GNU long name, read whole; zeros past the archive's end): the stream's cap
    monkeypatch.setattr(gi, 'MAX_TOTAL', 2**20)
    long = tarfile.TarInfo('././@LongLink'); long.type = tarfile.GNUTYPE_LONGNAME; long.size = 4 * 2**20
    _refused(tmp_path, store, capsys, path=_bomb(tmp_path, long), says='more than 1048576 bytes')
    tail = _pack(tmp_path/'tail.tar.gz', _members()).read_bytes()
    (tmp_path/'tail.tar.gz').write_bytes(tail + gzip.compress(b'\0' * 4 * 2**20, compresslevel=1))
    _refused(tmp_path, store, capsys, path=tmp_path/'tail.tar.gz', says='more than 1048576 bytes')
    monkeypatch.setattr(gi, 'MAX_MEMBER', 1000)
    big = _csv([_row(f's{i}') for i in range(40)])
    _refused(tmp_path, store, capsys, _members(table=big), says='over the 1000 a member may have')


def _bomb(tmp_path, long):
    body = long.tobuf(tarfile.GNU_FORMAT)[:512] + b'a' * long.size
    (tmp_path/'long.tar.gz').write_bytes(gzip.compress(body, compresslevel=1))
    return tmp_path/'long.tar.gz'


# --------------------------------------------------------------------------------------------- refused: provenance
@pytest.mark.parametrize('prov, says', [
    (dict(PROV, device='cpu', capability=None), 'a CPU run cannot be imported as a GPU run'),
    (dict(PROV, device_name='CPU AMD EPYC'), 'a CPU run cannot be imported as a GPU run'),
    (dict(PROV, dry_run=0), "'dry_run' must be true/false"),
    (dict(PROV, dry_run=True, device='cpu', device_name='CPU AMD EPYC', capability=None), 'a dry run'),
    (dict(PROV, dry_run=True), 'says a dry run (a CPU) but names device'),
    (dict(PROV, capability='nine'), "'capability' is not well-formed"),
    (dict(PROV, gpu_count=True), "'gpu_count' must be int"),
    (dict(PROV, gpu_count=0), 'gpu_count 0'),
    (dict(PROV, torch_cuda=None), 'torch_cuda null'),
    ({k: v for k, v in PROV.items() if k != 'capability'}, 'but not all of'),
    ({k: v for k, v in PROV.items() if k != 'utc'}, "has no 'utc'"),
    (dict(PROV, utc='yesterday'), "'utc' is not well-formed"),
    (dict(PROV, host='gpu\x1b[2J'), 'control character'),
    (dict(PROV, packages=['torch']), "'packages' must be an object"),
    (dict(PROV, packages=dict(torch=2.11)), "'packages' has a bad entry"),
    (dict(PROV, evil=1), 'unexpected keys'),
    (dict(PROV, git_sha='not a sha'), "'git_sha' is not well-formed"),
])
def test_provenance_schema(tmp_path, store, capsys, prov, says):
    _refused(tmp_path, store, capsys, _members(prov=prov), says=says)


def test_provenance_that_is_not_an_object(tmp_path, store, capsys):
    for text, says in (('["dry_run", false]', 'is a list, not an object'), ('{"dry_run": false', 'not JSON'),
                       (json.dumps(PROV)[:-1] + ', "dry_run": true}', 'given twice'), ('{"a": NaN}', 'not JSON'),
                       ('[' * 100000, 'not JSON')):
        ms = [(n, text.encode() if n == 'provenance.json' else d) for n, d in _members()]
        _refused(tmp_path, store, capsys, ms, says=says)


def test_rows_must_be_measured_where_provenance_says(tmp_path, store, capsys):
    cpu = _csv([_row(device='cpu', device_name='CPU AMD EPYC', capability='')])
    _refused(tmp_path, store, capsys, _members(table=cpu), says="measured on 'cpu'")
    other = _csv([_row(device_name='NVIDIA B200', capability='10.0')])
    _refused(tmp_path, store, capsys, _members(table=other), says="provenance.json says 'NVIDIA H200'")
    _refused(tmp_path, store, capsys, _members(table=_csv([_row(run='')])), says='needs its run id')
    _refused(tmp_path, store, capsys, _members(table=_csv([_row(utc='')])), says='UTC time')
    bare = {k: v for k, v in PROV.items() if k not in ('device', 'device_name', 'capability')}
    two = _csv([_row(), _row(device_name='NVIDIA B200', capability='10.0')])
    _refused(tmp_path, store, capsys, _members(prov=bare, table=two), says='several devices')
    _refused(tmp_path, store, capsys, _members(prov=bare, table=_csv([_row(capability='')])), says='not a GPU')


# ----------------------------------------------------------------------------------------------- refused: status
@pytest.mark.parametrize('status, says', [
    ('probe\t30\t12\tok\n', '4 fields, expected 5'), ('', 'status.tsv is empty'),
    ('probe\t30\t12\t0\tgreat\n', 'great'),
    ('evil\t30\t12\t0\tok\n', "unknown stage 'evil'"), ('probe\tthirty\t12\t0\tok\n', 'must be integers'),
    ('install\t20\t3\t0\tok\n', 'written by stage probe'), (b'probe\t30\t12\t0\tok\n\xff', 'not UTF-8'),
])
def test_status_lines(tmp_path, store, capsys, status, says):
    ms = [(n, (status if isinstance(status, bytes) else status.encode()) if n == 'status.tsv' else d)
          for n, d in _members()]
    _refused(tmp_path, store, capsys, ms, says=says)


# ------------------------------------------------------------------------------------------------ refused: tables
def test_table_columns_and_cells(tmp_path, store, capsys):
    wide = _csv([[*_row(), 'x']], [*COLS, 'evil'])
    _refused(tmp_path, store, capsys, _members(table=wide), says="columns the capability table does not: ['evil']")
    # a stage's declared new columns are taken beside its table's own, and only for that table
    assert set(gs.NEW_COLS['transformer_bench']) <= gi.allowed_columns('transformer_bench')
    assert not set(gs.NEW_COLS['transformer_bench']) & gi.allowed_columns('capability')
    for bad, says in (('a\0b', 'holds a NUL byte'), ('a\x1b[31m', "control character '\\x1b'"),
                      ('gpu\u202eok', "control character '\\u202e'"),
                      ('x' * 5000, 'over 4096 characters')):
        _refused(tmp_path, store, capsys, _members(table=_csv([_row(runs_as=bad)])), says=says)
    cr = _csv([_row(runs_as='@@')]).replace(b'@@', b'"a\rb"')  # quoted: the CSV is whole, the cell is not
    _refused(tmp_path, store, capsys, _members(table=cr), says="control character '\\r'")
    for table, says in ((_csv([_row()])[:-1], 'cut short'), (_csv([_row()[:-1]]), 'fields where the header has'),
                        (_csv([_row()], [*COLS[:-1], 'run']), 'repeated columns'),
                        (_csv([_row()[1:]], COLS[1:]), 'has no run column'),
                        (_csv([_row()], [*COLS[:-1], 'a b']), 'bad column name'), (b'\xff\xfe', 'not UTF-8')):
        _refused(tmp_path, store, capsys, _members(table=table), says=says)


def test_table_kinds(tmp_path, store, capsys):
    fake = _csv([['r', 'cuda', 'NVIDIA H200', '9.0', '2026-12-02T10:01:00Z']],
                ['run', 'device', 'device_name', 'capability', 'utc'])
    _refused(tmp_path, store, capsys, [*_members(), ('results/fake_probe.csv', fake)], says='neither data/results nor')
    _refused(tmp_path, store, capsys, [*_members(), ('results/gpu_runs.csv', fake)], says="the import's own")


# ------------------------------------------------------------------------------------------------- refused: plans
def test_plans_must_be_quant_plans_named_by_digest(tmp_path, store, capsys):
    ms = [m for m in _members() if m[0] != PLAN_NAME]
    _refused(tmp_path, store, capsys, [*ms, ('results/plans/0123456789ab.json', b'{"junk": 1}')],
             says='not a QuantPlan')
    _refused(tmp_path, store, capsys, [*ms, ('results/plans/0123456789ab.json', PLAN.to_json().encode())],
             says=f'holds plan {PLAN.digest()}, not 0123456789ab')
    bad = json.loads(PLAN.to_json()); bad['components']['']['linears']['lin'] = ['int9', 'torchao', '', 8, 8]
    _refused(tmp_path, store, capsys, [*ms, ('results/plans/0123456789ab.json', json.dumps(bad).encode())],
             says='int9')


# ------------------------------------------------------------------------------------------------ the one commit
def test_a_plans_folder_that_is_a_file_refuses_all_then_a_reimport_lands_all(tmp_path, store, capsys):
    (store/'plans').write_text('not a folder')
    path = _pack(tmp_path/'run.tar.gz', _members())
    _refused(tmp_path, store, capsys, path=path, says='is not a folder')
    (store/'plans').unlink()
    assert gi.import_tarball(path, store) == {'capability': 2, 'gpu_runs': 1, 'plans': 1}  # not skipped as done
    assert (store/'plans'/f'{PLAN.digest()}.json').is_file()


def test_plans_never_go_through_a_link(tmp_path, store, capsys):
    (tmp_path/'elsewhere').mkdir()
    (store/'plans').symlink_to(tmp_path/'elsewhere')
    _refused(tmp_path, store, capsys, _members(), says='or is a link')
    assert not any((tmp_path/'elsewhere').iterdir())


def test_a_failed_plan_move_leaves_no_row(tmp_path, store, capsys, monkeypatch):
    real = os.replace
    def replace(src, dst, *a, **k):
        if str(dst).endswith(f'{PLAN.digest()}.json'): raise OSError(28, 'No space left on device')
        return real(src, dst, *a, **k)
    monkeypatch.setattr(os, 'replace', replace)
    err = _refused(tmp_path, store, capsys, _members(), says='No space left on device')
    assert 'OSError' in err and not (store/'gpu_runs.csv').exists()
