"""The results store's journal (issue 36 item 1, issue 35 item 1): a planted journal replays nothing outside its store,
a journal that cannot be read or checked is set aside with one warning, and every path the store writes is the
caller's."""
import json, os, warnings
from pathlib import Path
import pytest
from diffq_lab import core, store
from diffq_lab.core import JournalWarning, load_table, recover_commits
from diffq_lab.store import append_tables

TABLE = 'scheme,utc\nint8,2026-01-01T00:00:00Z\n'
J = '.diffq-commit-99-evil'  # the planted journal's name, without its state
PWNED = {'0.table': 'pwned'}  # a staged "table" a planted journal would move somewhere


def _world(tmp_path):
    "A results folder with one table, and an outside folder (a user's files, a folder, a link into it) none may touch."
    res, outside = tmp_path/'results', tmp_path/'outside'
    res.mkdir(); outside.mkdir(); (outside/'dir').mkdir()
    (res/'study.csv').write_text(TABLE)
    for f, text in (('victim.txt', 'keep me'), ('other.txt', 'mine'), ('dir/inner.txt', 'deep')):
        (outside/f).write_text(text)
    (res/'link').symlink_to(outside, target_is_directory=True)  # a link in the store that points out
    return res, outside


def _snapshot(folder: Path) -> dict:
    "Every file and link under `folder` (links not followed): {relative path: bytes or 'link -> target'}."
    out = {}
    for d, dirs, files in os.walk(folder):
        for n in dirs + files:
            p = Path(d)/n
            out[str(p.relative_to(folder))] = f'link -> {os.readlink(p)}' if p.is_symlink() else (
                'dir' if p.is_dir() else p.read_bytes())
    return out


def _plant(res: Path, state: str, ops, report=None, files=(), raw: str | None = None) -> Path:
    "A journal `J.<state>` in `res` holding `files` ({name: text}), whose journal.json lists `ops` (or is `raw`)."
    j = res/f'{J}.{state}'; j.mkdir()
    for name, text in dict(files).items(): (j/name).write_text(text)
    (j/'journal.json').write_text(raw if raw is not None else json.dumps(dict(ops=ops, report=report)))
    return j


def _reads_after_quarantine(res: Path, planted: Path, outside: Path, before: dict):
    "A plain read warns once, naming the journal, sets it aside, and changes nothing outside; later reads are quiet."
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter('always')
        table = load_table('study', res)
    assert _snapshot(outside) == before  # first of all: nothing outside the store changed
    assert len(table) == 1 and (res/'study.csv').read_text() == TABLE
    msgs = [str(w.message) for w in got if issubclass(w.category, JournalWarning)]
    assert len(msgs) == 1 and planted.name in msgs[0] and '\n' not in msgs[0], msgs
    assert not os.path.lexists(planted) and os.path.lexists(planted.with_suffix('.quarantined'))
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # nothing left to act on: no warning, no lock
        assert len(load_table('study', res)) == 1 and recover_commits(res) == []
    assert _snapshot(outside) == before


def _cases(res: Path, outside: Path) -> dict:
    "Planted committed journals, each asking replay to touch something outside the store: {id: (ops, report, files)}."
    j, rep = res/f'{J}.committed', res/f'{J}.report'
    return {
        'unlink-outside-file': ([['unlink', str(outside/'victim.txt'), str(j/'.diffq-old-0')]], None, {}),
        'unlink-outside-with-a-report': ([['unlink', str(outside/'victim.txt'), str(rep/'.diffq-old-0')]],
                                         str(rep), {}),
        'overwrite-outside-as-a-table': ([['move', '0.table', str(outside/'other.txt'), None]], None, PWNED),
        'overwrite-outside-as-a-csv': ([['move', '0.table', str(outside/'other.csv'), None]], None, PWNED),
        'report-into-outside': ([['move', str(rep/'report.md'), str(outside/'other.txt'), str(rep/'.diffq-old-0')]],
                                str(rep), {}),
        'mkdir-outside': ([['mkdir', str(outside/'new')]], str(rep), {}),
        'dotdot-table': ([['move', '0.table', str(res/'..'/'outside'/'x.csv'), None]], None, PWNED),
        'dotdot-source': ([['move', str(j/'..'/'..'/'outside'/'victim.txt'), str(res/'study.csv'), None]], None, {}),
        'dotdot-report': ([['unlink', str(outside/'victim.txt'), str(rep/'.diffq-old-0')]],
                          str(res/'..'/'outside'/f'{J}.report'), {}),
        'symlink-table': ([['move', '0.table', str(res/'link'/'x.csv'), None]], None, PWNED),
        'symlink-out-folder': ([['move', str(rep/'report.md'), str(res/'link'/'other.txt'), str(rep/'.diffq-old-0')]],
                               str(rep), {}),
        'relative-table': ([['move', '0.table', 'study.csv', None]], None, PWNED),
        'not-an-op': ([['rmtree', str(outside)]], None, {}),
        'wrong-arity': ([['move', '0.table']], None, PWNED),
    }


CASES = list(_cases(Path('/r'), Path('/o')))


@pytest.mark.parametrize('case', CASES)
def test_a_planted_committed_journal_touches_nothing_outside_its_store(tmp_path, case):
    res, outside = _world(tmp_path)
    ops, report, files = _cases(res, outside)[case]
    if report and Path(report).name == f'{J}.report' and '..' not in report:  # a planted staged report beside it
        (res/f'{J}.report').mkdir(); (res/f'{J}.report'/'report.md').write_text('pwned')
    before = _snapshot(outside)
    _reads_after_quarantine(res, _plant(res, 'committed', ops, report, files), outside, before)


def test_a_staged_file_that_is_a_link_out_is_never_moved_into_a_table(tmp_path):
    res, outside = _world(tmp_path)
    j = _plant(res, 'committed', [['move', '0.table', str(res/'study.csv'), None]])
    (j/'0.table').symlink_to(outside/'victim.txt')
    _reads_after_quarantine(res, j, outside, _snapshot(outside))


@pytest.mark.parametrize('state', ['staging', 'committed', 'abandoned', 'done'])
@pytest.mark.parametrize('where', ['outside-folder', 'outside-journal-named', 'dotdot'])
def test_a_journal_naming_an_outside_report_never_deletes_it(tmp_path, state, where):
    res, outside = _world(tmp_path)
    named = outside/f'{J}.report'; named.mkdir(); (named/'x').write_text('a report of someone else')
    report = {'outside-folder': str(outside/'dir'), 'dotdot': str(res/'..'/'outside'/'dir'),
              # right name, wrong place: only the folder a legit journal could own, yet not reached through '..'
              'outside-journal-named': str(res/'link'/f'{J}.report')}[where]
    before = _snapshot(outside)
    _reads_after_quarantine(res, _plant(res, state, [], report), outside, before)


@pytest.mark.parametrize('raw', ['{"ops": [', '[]', '{"ops": "x", "report": null}', '\udcff', '{"ops": [1]}'],
                         ids=['cut', 'a-list', 'ops-not-a-list', 'not-utf8', 'op-not-a-list'])
def test_a_committed_journal_that_does_not_parse_is_quarantined_and_reads_go_on(tmp_path, raw):
    res, outside = _world(tmp_path)
    j = res/f'{J}.committed'; j.mkdir()
    (j/'journal.json').write_bytes(raw.encode('utf-8', 'surrogateescape'))
    _reads_after_quarantine(res, j, outside, _snapshot(outside))
    append_tables({'study': dict(scheme='fp8')}, root=res, device='cpu')  # and recording goes on
    assert list(load_table('study', res).scheme) == ['int8', 'fp8']


def test_a_journal_json_that_is_a_link_or_a_journal_that_is_a_link_is_never_followed(tmp_path):
    res, outside = _world(tmp_path)
    (outside/'journal.json').write_text(json.dumps(dict(ops=[['unlink', str(outside/'victim.txt'),
                                                              str(outside/'.diffq-old-0')]], report=None)))
    j = res/f'{J}.committed'; j.mkdir(); (j/'journal.json').symlink_to(outside/'journal.json')
    _reads_after_quarantine(res, j, outside, _snapshot(outside))
    linked = res/'.diffq-commit-98-evil.committed'; linked.symlink_to(outside, target_is_directory=True)
    _reads_after_quarantine(res, linked, outside, _snapshot(outside))


def test_a_quarantined_journal_is_kept_beside_an_earlier_one_and_other_names_are_left_alone(tmp_path):
    res, outside = _world(tmp_path)
    (res/f'{J}.quarantined').mkdir()  # an earlier one of the same name
    (res/'.diffq-commit-7.bogus').mkdir()  # not a journal state: never touched
    j = _plant(res, 'committed', [], raw='{')
    with pytest.warns(JournalWarning, match='renamed aside'): load_table('study', res)
    assert len(list(res.glob(f'{J}*.quarantined'))) == 2 and (res/'.diffq-commit-7.bogus').is_dir() and not j.exists()


def test_a_planted_journal_whose_name_holds_a_newline_is_still_named_in_one_line(tmp_path):
    res, outside = _world(tmp_path)
    j = res/'.diffq-commit-1\nx.committed'; j.mkdir(); (j/'journal.json').write_text('{')
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter('always'); load_table('study', res)
    msgs = [str(w.message) for w in got if issubclass(w.category, JournalWarning)]
    assert len(msgs) == 1 and '\n' not in msgs[0] and '1\\nx' in msgs[0] and not j.exists()


def test_a_legit_journal_cut_after_its_commit_point_passes_the_checks_and_is_finished(tmp_path, monkeypatch):
    "What `_commit` writes (tables; a report beside its stage, in another folder) passes recovery's checks: redone."
    res, out, stage = tmp_path/'results', tmp_path/'out', tmp_path/'.out.staging'
    res.mkdir(); (res/'study.csv').write_text(TABLE); stage.mkdir(); (stage/'report.md').write_text('new')
    out.mkdir(); (out/'report.md').write_text('old'); (out/'grid.png').write_text('stale')
    def killed(ops, again=True): raise SystemExit('killed')  # a SIGKILL right after the commit point: nothing moved
    real_retire = core._retire
    for m in (core, store):  # the commit (store) and the recovery (core) each hold these by name
        monkeypatch.setattr(m, '_redo', killed); monkeypatch.setattr(m, '_undo', lambda ops: None)
        monkeypatch.setattr(m, '_retire', lambda j, state, rep=None: state == 'abandoned' or real_retire(j, state, rep))
    with pytest.raises(SystemExit):
        append_tables({'study': dict(scheme='fp8')}, root=res, device='cpu', report=(stage, out),
                      report_files=('report.md', 'grid.png'))
    monkeypatch.undo()
    assert [p.suffix for p in res.glob('.diffq-commit-*')] == ['.committed'] and (out/'report.md').read_text() == 'old'
    with warnings.catch_warnings():
        warnings.simplefilter('error', JournalWarning)
        assert list(load_table('study', res).scheme) == ['int8', 'fp8']
    assert sorted(p.name for p in out.iterdir()) == ['report.md'] and (out/'report.md').read_text() == 'new'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['out', 'results'] and not list(res.glob('.diffq-*'))


def test_a_report_folder_not_beside_its_stage_is_refused_before_anything_is_written(tmp_path):
    res, stage, out = tmp_path/'results', tmp_path/'a'/'.stage', tmp_path/'b'/'out'
    stage.mkdir(parents=True); (stage/'report.md').write_text('new')
    with pytest.raises(ValueError, match='must be the folder of its staged report'):
        append_tables({'study': dict(scheme='int8')}, root=res, device='cpu', report=(stage, out))
    assert not out.exists() and not (res/'study.csv').exists() and (stage/'report.md').read_text() == 'new'
    assert not [p for p in tmp_path.rglob('.diffq-commit-*')]


def test_a_move_that_fails_says_so_in_one_line_and_puts_everything_back(tmp_path, monkeypatch):
    res, out, stage = tmp_path/'results', tmp_path/'out', tmp_path/'.out.staging'
    res.mkdir(); (res/'study.csv').write_text(TABLE); out.mkdir(); (out/'report.md').write_text('old')
    stage.mkdir(); (stage/'report.md').write_text('new')
    real = os.replace
    def full(src, dst):
        if str(dst).endswith('study.csv'): raise OSError(28, 'No space left on device')
        return real(src, dst)
    monkeypatch.setattr(os, 'replace', full)
    with pytest.raises(OSError) as e:
        append_tables({'study': dict(scheme='fp8')}, root=res, device='cpu', report=(stage, out))
    msg = str(e.value)
    assert '\n' not in msg and 'could not move' in msg and 'study.csv' in msg and 'No space' in msg
    assert 'nothing was recorded' in msg
    monkeypatch.setattr(os, 'replace', real)
    assert (res/'study.csv').read_text() == TABLE and (out/'report.md').read_text() == 'old'
    assert not [p for p in tmp_path.rglob('.diffq-commit-*')]


# ---------------------------------------------------------------- issue 35: every path is the caller's
def _base(kind: str, tmp_path: Path) -> tuple:
    "(the path as a caller writes it, where it really is) for a relative, an absolute and a `~` path."
    return {'relative': (Path('work'), tmp_path/'work'), 'absolute': (tmp_path/'work', tmp_path/'work'),
            'home': (Path('~/work'), tmp_path/'home'/'work')}[kind]


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    "The working folder is `tmp_path`, HOME is `tmp_path/home`: a relative or `~` path must land there."
    (tmp_path/'home').mkdir()
    monkeypatch.chdir(tmp_path); monkeypatch.setenv('HOME', str(tmp_path/'home'))
    return tmp_path


@pytest.mark.parametrize('kind', ['relative', 'absolute', 'home'])
def test_record_tables_with_a_report_writes_where_the_caller_said(elsewhere, kind):
    given, real = _base(kind, elsewhere)
    (real/'.out.staging').mkdir(parents=True); (real/'.out.staging'/'report.md').write_text('new')
    append_tables({'study': dict(scheme='int8')}, root=given/'results', device='cpu',
                  report=(given/'.out.staging', given/'out'), report_files=('report.md',))
    assert (real/'out'/'report.md').read_text() == 'new' and len(load_table('study', real/'results')) == 1
    assert len(load_table('study', given/'results')) == 1  # read back through the same path
    assert not [p for p in elsewhere.rglob('.diffq-commit-*')] and not (elsewhere/'~').exists()


@pytest.mark.parametrize('kind', ['relative', 'absolute', 'home'])
def test_a_report_alone_into_its_stages_folder_lands_there(elsewhere, kind):
    "write_plan's commit: the stage sits in the out folder itself (report=(stage, stage's folder))."
    given, real = _base(kind, elsewhere)
    (real/'.diffq-plan-x').mkdir(parents=True); (real/'.diffq-plan-x'/'plan.json').write_text('{}')
    append_tables({}, report=(given/'.diffq-plan-x', given))
    assert (real/'plan.json').read_text() == '{}' and not (real/'.diffq-plan-x').exists()
    assert not [p for p in elsewhere.rglob('.diffq-commit-*')]


@pytest.mark.parametrize('kind', ['relative', 'absolute', 'home'])
def test_the_clis_report_and_plan_writers_put_files_where_out_says(elsewhere, kind):
    "`study`'s staged report and `export`/`recommend`'s plan file, through the cli's own --out resolution."
    from diffq_lab import cli_jobs as cli
    from diffq_lab.plan import QuantPlan
    from diffq_lab.snippet import write_plan
    given, real = _base(kind, elsewhere)
    with cli._staged_report(cli._out_path(str(given/'study'))) as stage: (stage/'report.md').write_text('new')
    assert (real/'study'/'report.md').read_text() == 'new'
    out = cli._out_path(str(given/'plans'/'plan.json'))
    assert Path(out).is_absolute()
    write_plan(QuantPlan(), out)
    assert sorted(p.name for p in (real/'plans').iterdir()) == ['plan.json', 'plan.py']
    assert not [p for p in elsewhere.rglob('.diffq-*')] and not (elsewhere/'~').exists()
