"""Fault injection, one test per category of issue #15: bad arguments, concurrent writers, kills mid-run and mid-write,
corrupted tables and caches, failures inside quantisation. Each asserts the outcome: a clear one-line error (exit 2, no
traceback), nothing lost or half-written, the model restored. Tiny models, no network, well under two minutes on 2 cores."""
import contextlib
import copy, json, os, random, signal, subprocess, sys, time, warnings
from pathlib import Path
import pytest
import torch
from torch import nn
from diffq_lab.cli import BAD_INPUTS, BAD_WITHOUT_GPU, main
from diffq_lab.core import load_table, DamagedTable
from diffq_lab.store import append_rows, append_tables
from diffq_lab.filters import quantized_linears, make_filter_fn
from forked import Forked, stop as stop_fork_server

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}


def run_main(argv, capsys) -> tuple[int, str]:
    "(exit code, stderr) of the CLI run in-process."
    try: code = main(argv)
    except SystemExit as e: code = e.code
    return code, capsys.readouterr().err


def one_line_error(err: str) -> bool:
    "stderr holds exactly one line (a note line aside) and no traceback."
    lines = [l for l in err.splitlines() if l.strip() and ': note:' not in l]
    return len(lines) == 1 and 'Traceback' not in err and 'error' in lines[0]


# ---------------------------------------------------------------- bad arguments: one line, exit 2, nothing written
@pytest.fixture
def scratch(tmp_path, monkeypatch):
    "Junk inputs and an isolated results folder."
    monkeypatch.setenv('DIFFQ_LAB_RESULTS', str(tmp_path/'results'))
    (tmp_path/'empty').mkdir()
    (tmp_path/'garbage').mkdir(); (tmp_path/'garbage'/'model_index.json').write_text('{not json')
    (tmp_path/'enc').mkdir(); (tmp_path/'enc'/'config.json').write_text('xx')
    (tmp_path/'noweights').mkdir()
    (tmp_path/'noweights'/'config.json').write_text(json.dumps(dict(model_type='bert', hidden_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=2, intermediate_size=37, vocab_size=100)))
    (tmp_path/'junk.gguf').write_bytes(random.Random(0).randbytes(1000))  # seeded junk: not a GGUF
    (tmp_path/'afile').write_text('x')
    (tmp_path/'big.txt').write_text('x' * 260_000 + '\n')
    (tmp_path/'many.txt').write_text('a cat\n' * 10_000)
    (tmp_path/'binary.txt').write_bytes(b'\xff\xfe\x00bad')
    return tmp_path


BAD = [*BAD_INPUTS, *([] if torch.cuda.is_available() else BAD_WITHOUT_GPU)]  # the one table, in 17_cli


@pytest.mark.parametrize('argv,says', BAD, ids=lambda v: ' '.join(v)[:60] if isinstance(v, list) else None)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(argv, says, scratch, capsys, monkeypatch):
    monkeypatch.chdir(scratch)  # a default --out (export, recommend) would land in scratch/out
    argv = [a.replace('$T', str(scratch)) for a in argv]
    if argv[0] == 'study' and '--out' not in argv: argv += ['--out', str(scratch/'out')]
    code, err = run_main(argv, capsys)
    assert code == 2 and one_line_error(err) and says in err, (argv, err)
    assert not (scratch/'results').exists() or not list((scratch/'results').iterdir())  # at most the checked, empty folder
    assert not (scratch/'out').exists() and not [p for p in scratch.iterdir() if 'staging' in p.name]


def test_python_dash_m_runs_the_command():
    "`python -m diffq_lab.cli` is the command itself (it used to exit 0 doing nothing)."
    ok = subprocess.run([sys.executable, '-m', 'diffq_lab.cli', '--help'], capture_output=True, text=True, timeout=120, env=ENV)
    assert ok.returncode == 0 and 'study' in ok.stdout
    # a bad value its parser refuses (crossover's --frames, refused after loading the model registry, is a BAD_INPUTS case)
    bad = subprocess.run([sys.executable, '-m', 'diffq_lab.cli', 'study', '--steps', '0'], capture_output=True, text=True,
                         timeout=120, env=ENV)
    assert bad.returncode == 2 and one_line_error(bad.stderr), bad.stderr


# ---------------------------------------------------------------- repeats: deduplicated, said out loud
def test_repeated_schemes_and_seeds_run_once_and_say_so(tmp_path, monkeypatch, capsys):
    import diffq_lab.study as S
    seen = {}
    def fake_study(device, **kw): seen.update(kw)
    monkeypatch.setattr(S, 'default_study', fake_study)
    assert main(['study', '--schemes', 'int8,int8,w8a8,fp8', '--seeds', '0,0,1', '--out', str(tmp_path/'o'), '--no-record']) == 0
    assert seen['schemes'] == ['int8', 'fp8'] and seen['seeds'] == [0, 1]
    err = capsys.readouterr().err
    assert 'note: --schemes repeats int8' in err and 'note: --seeds repeats 0' in err


# ---------------------------------------------------------------- interrupted and killed runs: nothing half-written
def test_ctrl_c_in_a_study_exits_130_and_leaves_the_report_as_it_was(tmp_path, monkeypatch, capsys):
    import diffq_lab.study as S
    out = tmp_path/'out'; out.mkdir(); (out/'report.md').write_text('the last report')
    def interrupted(device, out=None, **kw):
        (Path(out)/'report.md').write_text('half a report')
        raise KeyboardInterrupt
    monkeypatch.setattr(S, 'default_study', interrupted)
    code, err = run_main(['study', '--out', str(out), '--no-record', '--schemes', 'int8'], capsys)
    assert code == 130 and len(err.strip().splitlines()) == 1 and 'interrupted' in err and 'Traceback' not in err
    assert (out/'report.md').read_text() == 'the last report' and [p.name for p in tmp_path.iterdir()] == ['out']


def test_a_reused_out_keeps_no_stale_grid(tmp_path, monkeypatch, capsys):
    import diffq_lab.study as S
    out = tmp_path/'out'; out.mkdir()
    for f in ('grid.png', 'report.html', 'report.md'): (out/f).write_text('old')
    (out/'notes.txt').write_text('mine')
    def study_without_renders(device, out=None, **kw): (Path(out)/'report.md').write_text('new')
    monkeypatch.setattr(S, 'default_study', study_without_renders)
    assert main(['study', '--out', str(out), '--no-record']) == 0
    assert sorted(p.name for p in out.iterdir()) == ['notes.txt', 'report.md'] and (out/'report.md').read_text() == 'new'


@pytest.fixture(scope='module', autouse=True)
def fork_server():
    "The processes below fork from one server that imported diffq_lab.core (tests/forked.py); stopped, and so counted, at the end."
    yield
    stop_fork_server()


def _child(code: str, *args) -> Forked:
    "A real process running `code` with `args`, forked with the store already imported (no 1.7 s torch import each)."
    return Forked(code, *args, cwd=ROOT)


def _sigint_as_python_starts():
    "A process started while SIGINT is ignored (pytest as a background job) ignores it for good: give it python's default."
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_mid_study_exits_130_with_the_tables_untouched(tmp_path):
    "A real study process, Ctrl-C'd once it is at work: exit 130, one line, the results table byte for byte as it was."
    results = tmp_path/'results'
    env = {**ENV, 'DIFFQ_LAB_RESULTS': str(results), 'DIFFQ_LAB_CACHE': str(tmp_path/'cache'), 'PYTHONUNBUFFERED': '1'}
    append_rows('study', dict(scheme='int8', ssim=0.99), root=results, device='cpu')
    before = (results/'study.csv').read_bytes()
    # the smallest study there is (random-weight tiny z-image, one scheme, one seed, one step at 16 px), recording (else no
    # table is at stake): the signal lands as it starts its work, so what it would render costs nothing
    p = subprocess.Popen([sys.executable, '-m', 'diffq_lab.cli', 'study', '--device', 'cpu', '--schemes', 'int8', '--seeds', '0',
                          '--random-weights', '--steps', '1', '--size', '16', '--record', '--out', str(tmp_path/'out')],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                         preexec_fn=_sigint_as_python_starts)
    for line in p.stdout:  # at work: the capability report is out, the study runs
        if line.startswith('## Capability'): break
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and 'interrupted' in err and 'Traceback' not in err, err[-2000:]
    assert (results/'study.csv').read_bytes() == before
    assert not (tmp_path/'out').exists() and not [q for q in tmp_path.iterdir() if 'staging' in q.name]
    assert sorted(q.name for q in results.iterdir() if not q.name.startswith('.')) == ['study.csv']


WRITER = """
import sys
from diffq_lab.store import append_rows
who, n = sys.argv[1], int(sys.argv[2])
for i in range(n): append_rows('runs', dict(writer=who, i=i, note='x' * 2000), root=sys.argv[3], device='cpu')
print('done', flush=True)
"""


def test_concurrent_writers_lose_nothing(tmp_path):
    procs = [_child(WRITER, f'w{k}', '8', str(tmp_path)) for k in range(3)]
    for p in procs: assert p.wait(timeout=300) == 0, p.output()[1][-2000:]
    t = load_table('runs', tmp_path)
    assert len(t) == 24 and sorted(t.groupby('writer').i.count()) == [8, 8, 8] and t.run.nunique() == 24


def test_a_writer_killed_mid_write_leaves_a_whole_table(tmp_path):
    "SIGKILL at a random moment of a stream of appends: the table parses strictly and every row it holds is whole."
    p = _child(WRITER.replace("print('done', flush=True)", '') .replace('for i in range(n):', "print('go', flush=True)\nfor i in range(n):"),
               'k', '100000', str(tmp_path))
    p.wait_for('go')
    while not (tmp_path/'runs.csv').exists(): time.sleep(0.01)  # the stream has begun: a first row is whole
    time.sleep(random.Random(0).uniform(0.2, 0.5))  # then a (seeded) moment of a stream of 2000-character rows
    p.kill(); p.wait(timeout=60)
    t = load_table('runs', tmp_path)  # strict: a cut row would raise DamagedTable
    assert len(t) > 0 and (t.note.str.len() == 2000).all() and list(t.i) == list(range(len(t)))


# ---------------------------------------------------------------- corrupted tables and disks
def test_a_malformed_table_stops_a_recording_before_any_table_changes(tmp_path):
    append_rows('capability', dict(scheme='int8'), root=tmp_path, device='cpu')
    append_rows('study', dict(scheme='int8', ssim=0.9), root=tmp_path, device='cpu')
    cap, study = tmp_path/'capability.csv', tmp_path/'study.csv'
    study.write_text(study.read_text() + 'one,field\n')
    before = cap.read_bytes(), study.read_bytes()
    with pytest.raises(DamagedTable, match='study.csv, line 3'):
        append_tables({'capability': [dict(scheme='fp8')], 'study': [dict(scheme='fp8')]}, root=tmp_path, device='cpu')
    assert (cap.read_bytes(), study.read_bytes()) == before


def test_a_table_that_is_a_folder_stops_the_study(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('DIFFQ_LAB_RESULTS', str(tmp_path/'results'))
    (tmp_path/'results'/'study.csv').mkdir(parents=True)
    code, err = run_main(['study', '--device', 'cpu', '--schemes', 'int8', '--seeds', '0', '--record', '--out', str(tmp_path/'out')], capsys)
    assert code == 2 and one_line_error(err) and 'is a folder' in err and not (tmp_path/'out').exists()


@contextlib.contextmanager
def disk_full_renaming(monkeypatch, name: str):
    "Within the block, renaming a file onto a path ending in `name` fails as a full disk does."
    real = os.replace
    def full(src, dst):
        if str(dst).endswith(name): raise OSError(28, 'No space left on device')
        return real(src, dst)
    monkeypatch.setattr(os, 'replace', full)
    try: yield
    finally: monkeypatch.setattr(os, 'replace', real)


def test_a_full_disk_mid_recording_leaves_every_table_as_it_was(tmp_path, monkeypatch):
    append_rows('a', dict(x=1), root=tmp_path, device='cpu')
    before = (tmp_path/'a.csv').read_bytes()
    with disk_full_renaming(monkeypatch, 'b.csv'), pytest.raises(OSError, match='No space'):
        append_tables({'b': [dict(x=2)], 'a': [dict(x=2)]}, root=tmp_path, device='cpu')
    # the rename of the first table failed: the second was never renamed, and no staged file is left behind
    assert not (tmp_path/'b.csv').exists() and (tmp_path/'a.csv').read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.suffix == '.tmp']


# ---------------------------------------------------------------- corrupted probe caches
@pytest.mark.parametrize('entry', [dict(ok='false'), dict(ok='true'), dict(ok=1), dict(rel_err='0.01'), dict(scheme='int8'),
                                   dict(transient=True), 'not an object', None])
def test_a_damaged_probe_cache_entry_is_never_valid(entry, tmp_path, monkeypatch):
    from diffq_lab.capability import smoke_probe, probe_key, clear_probe_cache, select_scheme, SchemeUnavailableError
    from diffq_lab.core import device_name
    monkeypatch.setenv('DIFFQ_LAB_CACHE', str(tmp_path))
    clear_probe_cache()
    key = probe_key('fp8', device_name('cpu'))
    base = dict(scheme='fp8', device_name=device_name('cpu'), ok=True, reason='ok')
    (tmp_path/'probes.json').write_text(json.dumps({key: {**base, **entry} if isinstance(entry, dict) else entry}))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        r = smoke_probe('fp8', 'cpu')
    assert not r.cached and r.ok is False  # measured again: fp8 dynamic has no CPU kernel
    assert entry is None or any('damaged probe cache entry' in str(x.message) for x in w)
    with pytest.raises(SchemeUnavailableError): select_scheme('fp8', 'cpu')  # fp8 is never selected on a CPU from a bad cache
    clear_probe_cache()


def test_an_unreadable_probe_cache_is_ignored_with_a_warning(tmp_path, monkeypatch):
    from diffq_lab.capability import smoke_probe, clear_probe_cache
    monkeypatch.setenv('DIFFQ_LAB_CACHE', str(tmp_path))
    clear_probe_cache()
    (tmp_path/'probes.json').write_text('{"cut sh')
    with pytest.warns(UserWarning, match='unreadable probe cache'): assert smoke_probe('int8', 'cpu').ok
    assert json.loads((tmp_path/'probes.json').read_text())  # rewritten whole
    clear_probe_cache()


# ---------------------------------------------------------------- failures inside quantisation: raise, restore
def _state(*mods):
    return [{k: v.clone() for k, v in m.state_dict().items()} for m in mods]


def _same(a, b) -> bool:
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_a_failure_at_the_third_linear_of_the_transformer_restores_it(pipes, fail_at_kth_linear):
    from diffq_lab.plan import QuantizationError
    from diffq_lab.transformer import quantize_transformer
    tr = copy.deepcopy(pipes['z-image'].transformer)
    before = _state(tr)
    rec = fail_at_kth_linear('int8', 'torchao', 3, within=[tr])
    with pytest.raises(QuantizationError, match='restored'): quantize_transformer(tr, 'int8', min_features=0, backend='torchao')
    assert rec.fired and quantized_linears(tr) == [] and _same(_state(tr), before)


@pytest.mark.parametrize('k,backend,scheme', [(3, 'diffusers', 'fp8_layerwise'), (3, 'emulate', 'nvfp4')])
def test_a_failure_inside_the_encoders_restores_both(pipes, fail_at_kth_linear, k, backend, scheme):
    from diffq_lab.plan import QuantizationError
    from diffq_lab.export import quantize_text_encoders
    pipe = copy.deepcopy(pipes['flux.1-dev'])
    encs = (pipe.text_encoder, pipe.text_encoder_2)
    before = _state(*encs)
    rec = fail_at_kth_linear(scheme, backend, k, within=list(encs))
    with pytest.raises(QuantizationError, match='restored'):
        quantize_text_encoders(pipe, scheme, backend='emulate' if backend == 'emulate' else 'auto', keep=(0, 0))
    assert rec.fired and all(quantized_linears(e) == [] for e in encs) and _same(_state(*encs), before)


def test_a_failure_at_the_first_linear_of_flux1s_second_encoder_is_raised_never_logged(pipes, fail_at_kth_linear):
    "CLIP is converted first; T5 dies at its first Linear: the call raises and CLIP is dense again (never CLIP one way, T5 another)."
    from diffq_lab.plan import QuantizationError
    from diffq_lab.export import quantize_text_encoders
    pipe = copy.deepcopy(pipes['flux.1-dev'])
    before = _state(pipe.text_encoder, pipe.text_encoder_2)
    rec = fail_at_kth_linear('fp8_layerwise', 'diffusers', 1, within=[pipe.text_encoder_2])
    with pytest.raises(QuantizationError) as e: quantize_text_encoders(pipe, 'fp8_layerwise', keep=(0, 0))
    assert rec.fired and e.value.component == 'text_encoder_2'
    assert quantized_linears(pipe.text_encoder) == [] == quantized_linears(pipe.text_encoder_2)
    assert _same(_state(pipe.text_encoder, pipe.text_encoder_2), before)


def test_a_model_on_the_meta_device_is_refused_never_quantised(pipes):
    from diffq_lab.plan import quantize
    from diffq_lab.export import quantize_text_encoders
    from diffq_lab.transformer import quantize_transformer
    with torch.device('meta'): m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    for backend in ('auto', 'torchao', 'emulate'):
        with pytest.raises(ValueError, match='meta device'): quantize(m, 'int8', make_filter_fn(0), backend=backend)
    assert quantized_linears(m) == []
    pipe = copy.deepcopy(pipes['flux.1-dev'])
    pipe.text_encoder.to('meta')
    with pytest.raises(ValueError, match='meta device'): quantize_text_encoders(pipe, 'fp8_layerwise', keep=(0, 0))
    assert quantized_linears(pipe.text_encoder_2) == []  # the other encoder was not touched either
    tr = copy.deepcopy(pipes['z-image'].transformer).to('meta')
    with pytest.raises(ValueError, match='meta device'): quantize_transformer(tr, 'int8', min_features=0, device='cpu')


@pytest.mark.skipif(torch.cuda.is_available(), reason='the CPU case: mxfp8 converts on a CPU, then its forward fails')
def test_mxfp8_forced_to_torchao_on_a_cpu_is_refused_before_converting():
    from diffq_lab.capability import SchemeUnavailableError
    from diffq_lab.plan import quantize
    m = nn.Sequential(nn.Linear(64, 64, dtype=torch.bfloat16))
    with pytest.raises(SchemeUnavailableError, match="backend='emulate'"): quantize(m, 'mxfp8', make_filter_fn(0), backend='torchao')
    assert quantized_linears(m) == []
    p = quantize(m, 'mxfp8', make_filter_fn(0), backend='auto')  # the default emulates, and its forward runs
    assert p.backend == 'emulate' and torch.isfinite(m(torch.randn(4, 64, dtype=torch.bfloat16))).all()


def test_nvfp4_zero_weight_stays_dense_and_finite():
    from diffq_lab.plan import quantize
    m = nn.Sequential(nn.Linear(64, 64, dtype=torch.bfloat16), nn.Linear(64, 64, dtype=torch.bfloat16))
    with torch.no_grad(): m[0].weight.zero_()  # a zero-initialised gate
    p = quantize(m, 'nvfp4wo', make_filter_fn(0), backend='torchao')
    assert p.skipped == {'0': 'all-zero weight'} and p.quantized == ['1']
    assert torch.isfinite(m(torch.randn(4, 64, dtype=torch.bfloat16))).all()


@pytest.mark.parametrize('outlier,says', [(1e30, '63 of 64 rows'), (float('nan'), 'all 64 rows'), (float('inf'), 'all 64 rows')])
def test_nvfp4_outlier_tokens_are_said_out_loud(outlier, says):
    from diffq_lab.emulate import NVFP4ScaleWarning
    from diffq_lab.plan import quantize
    m = nn.Sequential(nn.Linear(64, 32, dtype=torch.bfloat16))
    quantize(m, 'nvfp4', make_filter_fn(0), backend='emulate')
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    x[0, 3] = outlier
    with pytest.warns(NVFP4ScaleWarning, match=says): m(x)


# ================================================================ the results store (issue 27, item 5): commits under signals
# A recording (several tables and a staged report) commits through a journal: one rename is the commit point, a cut
# commit is finished (or dropped) by the next reader. These cases kill or signal a real process mid-commit, from a thread.
COMMIT = """
import os, signal, sys, threading, time
from pathlib import Path
from diffq_lab import store
res, out, stage, sig, point = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
real = os.replace
def from_a_thread():
    t = threading.Thread(target=os.kill, args=(os.getpid(), sig)); t.start(); t.join()
    time.sleep(0.3)  # an undeferred SIGINT lands here, in the main thread
def replace(src, dst):
    if point == 'staged' and str(dst).endswith('.committed'): from_a_thread()  # everything staged, not committed
    real(src, dst)
    if point == 'report' and str(dst) == str(out/'report.md'): from_a_thread()  # the report moved, no table yet
    if point == 'mid' and str(dst).endswith('capability.csv'): from_a_thread()  # one table of three moved
os.replace = replace
stage.mkdir(); (stage/'report.md').write_text('new report')
store.append_tables({'capability': [dict(scheme='fp8', probe_ok=True)], 'study_numerics': [dict(scheme='fp8', rel_err=0.1)] * 4,
                     'study': [dict(scheme='fp8', ssim=0.5)]}, root=res, device='cpu', report=(stage, out),
                    report_files=('report.md', 'grid.png'))
print('recorded', flush=True)
"""


def _recorded_before(tmp_path):
    "Three tables of one row and an earlier report (with a grid) beside the user's notes: the state a cut commit must keep."
    res, out = tmp_path/'results', tmp_path/'out'
    append_tables({'capability': dict(scheme='int8', probe_ok=True), 'study_numerics': dict(scheme='int8', rel_err=0.01),
                   'study': dict(scheme='int8', ssim=0.9)}, root=res, device='cpu')
    out.mkdir(); (out/'report.md').write_text('old report'); (out/'grid.png').write_text('old grid'); (out/'notes.txt').write_text('mine')
    return res, out, {k: (res/f'{k}.csv').read_bytes() for k in ('capability', 'study_numerics', 'study')}


def _store_state(res, out) -> tuple:
    "(rows per table, files of out with their text), read through the store (which finishes a cut commit first)."
    rows = {k: len(load_table(k, res)) for k in ('capability', 'study_numerics', 'study')}
    return rows, {p.name: p.read_text() for p in sorted(out.iterdir())}


NOTHING = ({'capability': 1, 'study_numerics': 1, 'study': 1},
           {'grid.png': 'old grid', 'notes.txt': 'mine', 'report.md': 'old report'})
ALL = ({'capability': 2, 'study_numerics': 5, 'study': 2}, {'notes.txt': 'mine', 'report.md': 'new report'})


@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize('point', ['staged', 'report', 'mid'])
def test_a_signal_from_a_thread_mid_commit_records_all_or_nothing(tmp_path, sig, point):
    res, out, before = _recorded_before(tmp_path)
    p = _child(COMMIT, str(res), str(out), str(tmp_path/'.out.staging'), str(int(sig)), point)
    so, err = p.communicate(timeout=120)
    pending = sorted(q.suffix for q in res.iterdir() if q.name.startswith('.diffq-commit-'))
    if sig == signal.SIGKILL:  # killed where it stood: a journal is left, and the next reader settles it
        assert p.returncode == -9 and pending == (['.committed'] if point != 'staged' else ['.staging']), (pending, err[-800:])
        if point == 'mid':  # the raw files show the cut: one table moved, the others not yet
            assert (res/'capability.csv').read_bytes() != before['capability'] and (res/'study.csv').read_bytes() == before['study']
        assert _store_state(res, out) == (NOTHING if point == 'staged' else ALL)
    else:  # held until the commit was whole, then delivered: the raw files are whole before any reader runs
        assert 'recorded' not in so and p.returncode in ((1, -2) if sig == signal.SIGINT else (-15,)), (p.returncode, err[-800:])
        assert sig != signal.SIGINT or 'KeyboardInterrupt' in err
        assert pending == [] and {k: (res/f'{k}.csv').read_bytes() != v for k, v in before.items()} == dict.fromkeys(before, True)
        assert _store_state(res, out) == ALL
    assert sorted(q.name for q in tmp_path.iterdir()) == ['out', 'results']  # no staged report, no journal, no .tmp
    assert sorted(q.name for q in res.iterdir()) == ['capability.csv', 'study.csv', 'study_numerics.csv']


LOOP = """
import os, random, signal, sys, threading, time
from pathlib import Path
from diffq_lab.store import append_tables
res, out, sig, seed = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
delay = random.Random(seed).uniform(0.2, 0.8)  # tens of recordings: the signal lands inside one of them
for i in range(10**6):
    stage = out.parent/f'.out.staging-{i}'; stage.mkdir(); (stage/'report.md').write_text(str(i))
    append_tables({'a': dict(i=i), 'b': [dict(i=i)] * 2}, root=res, device='cpu', report=(stage, out), report_files=('report.md',))
    if i == 0:  # the clock starts after the first recording: a slow import on a loaded machine cannot leave nothing recorded
        threading.Thread(target=lambda: (time.sleep(delay), os.kill(os.getpid(), sig)), daemon=True).start()
"""


@pytest.mark.parametrize('sig,seed', [(signal.SIGKILL, 0), (signal.SIGKILL, 1), (signal.SIGINT, 2), (signal.SIGTERM, 3)])
def test_a_signal_at_a_random_moment_of_a_stream_of_recordings_keeps_tables_and_report_together(tmp_path, sig, seed):
    "A thread of the recorder signals it at a (seeded) random moment: every table and the report end at the same recording."
    res, out = tmp_path/'results', tmp_path/'out'
    p = _child(LOOP, str(res), str(out), str(int(sig)), str(seed))
    _, err = p.communicate(timeout=120)
    assert p.returncode in (-9, -2, 1, -15) and (sig != signal.SIGINT or 'KeyboardInterrupt' in err), err[-800:]
    a, b = load_table('a', res), load_table('b', res)  # a cut commit is finished or dropped here
    assert len(a) > 0 and list(a.i) == list(range(len(a))) and list(b.i) == sorted(list(range(len(a))) * 2)
    assert (out/'report.md').read_text() == str(len(a) - 1) and set(a.run) == set(b.run)
    assert not [q for q in res.iterdir() if q.name.startswith('.')]


def test_nul_bytes_in_a_quoted_cell_are_refused_and_never_rewritten(tmp_path):
    res, out, before = _recorded_before(tmp_path)
    cap = res/'capability.csv'
    cap.write_bytes(cap.read_bytes().replace(b',int8,', b',"in\0t8",'))
    damaged = cap.read_bytes()
    with pytest.raises(DamagedTable, match=r'capability\.csv, line 2: a NUL byte') as e:
        append_tables({'capability': dict(scheme='fp8'), 'study': dict(scheme='fp8')}, root=res, device='cpu')
    assert '\n' not in str(e.value) and cap.read_bytes() == damaged and (res/'study.csv').read_bytes() == before['study']


@pytest.mark.parametrize('foreign', ['name,age\nann,3\n', 'study'], ids=['not-a-results-table', 'another-kinds-table'])
def test_a_table_of_foreign_columns_is_refused_and_never_merged_into(tmp_path, foreign):
    res, out, before = _recorded_before(tmp_path)
    cap = res/'capability.csv'
    cap.write_bytes(before['study'] if foreign == 'study' else foreign.encode())
    damaged = cap.read_bytes()
    with pytest.raises(DamagedTable, match=r'capability\.csv, line 1: .*(foreign|not a diffq_lab results table)'):
        append_tables({'capability': dict(scheme='fp8', arch='cpu', gate_ok=True, probe_ok=True, runs_as='emulated'),
                       'study': dict(scheme='fp8', ssim=0.5)}, root=res, device='cpu')
    assert cap.read_bytes() == damaged and (res/'study.csv').read_bytes() == before['study']


def test_a_foreign_capability_table_stops_the_study_in_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('DIFFQ_LAB_RESULTS', str(tmp_path/'results'))
    (tmp_path/'results').mkdir(); (tmp_path/'results'/'capability.csv').write_text('name,age\nann,3\n')
    code, err = run_main(['study', '--device', 'cpu', '--schemes', 'int8', '--seeds', '0', '--record', '--out', str(tmp_path/'out')], capsys)
    assert code == 2 and one_line_error(err) and 'capability.csv, line 1' in err and not (tmp_path/'out').exists()
    assert (tmp_path/'results'/'capability.csv').read_text() == 'name,age\nann,3\n'


def test_a_rename_failing_after_the_commit_point_puts_every_table_and_the_report_back(tmp_path, monkeypatch):
    "The report moved and one table renamed, then the disk fails: this process undoes it all, backups put back."
    res, out, before = _recorded_before(tmp_path)
    stage = tmp_path/'.out.staging'; stage.mkdir(); (stage/'report.md').write_text('new report')
    with disk_full_renaming(monkeypatch, 'study_numerics.csv'), pytest.raises(OSError, match='No space'):
        append_tables({'capability': dict(scheme='fp8'), 'study_numerics': dict(scheme='fp8'), 'study': dict(scheme='fp8')},
                      root=res, device='cpu', report=(stage, out), report_files=('report.md', 'grid.png'))
    assert {k: (res/f'{k}.csv').read_bytes() for k in before} == before and _store_state(res, out) == NOTHING
    assert sorted(q.name for q in tmp_path.iterdir()) == ['out', 'results'] and len(list(res.iterdir())) == 3
