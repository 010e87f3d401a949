"""The GPU run's preparation, checked fast and offline: the carried wheels against the image, the stage budgets, the
files the script leaves, a stage killed mid-way, and the import of a returned tarball. The full rehearsal (a venv of the
image's packages, the dry run end to end) needs PyPI once and minutes: `make gpu-rehearsal`, not part of this file."""
import copy, importlib.util, io, json, os, subprocess, sys, tarfile
from pathlib import Path
import pandas as pd
import pytest

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO/'tools'


def _load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS/f'{name}.py')
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


sys.path.insert(0, str(TOOLS))
stages, wheels, gimport, rehearsal = (_load(n) for n in ('gpu_stages', 'gpu_wheels', 'gpu_import', 'gpu_rehearsal'))


# ---------------------------------------------------------------------------------------------------- the wheels
def test_carried_wheels_close_over_the_image():
    meta, image = wheels.load_meta(), wheels.read_image()
    assert wheels.check(meta=meta, image=image, tree=wheels.tree_bytes()) == []
    names = {wheels.norm(w['name']): w['version'] for w in meta}
    assert names['torchao'] == '0.18.0'  # the torchao the lab is tested with
    assert all(n in names for n in ('diffusers', 'ipywidgets', 'ipython', 'traitlets', 'comm', 'gguf'))
    assert not {'nbdev', 'execnb', 'fastcore', 'ghapi'} & set(names)  # the run calls the lab's functions: no nbdev_test


def test_pins_match_the_metadata():
    pins = [l.split()[0] for l in wheels.PINS.read_text().splitlines() if l and not l.startswith('#')]
    hashes = [l.split('--hash=sha256:')[1] for l in wheels.PINS.read_text().splitlines() if '--hash=' in l]
    meta = wheels.load_meta()
    assert pins == [f"{w['name']}=={w['version']}" for w in meta]
    assert hashes == [w['sha256'] for w in meta]


def test_closure_finds_what_is_missing():
    meta, image = wheels.load_meta(), wheels.read_image()
    no_traitlets = [w for w in meta if wheels.norm(w['name']) != 'traitlets']
    problems = wheels.closure(no_traitlets, image)[0]
    assert any('traitlets' in p and 'neither on the image nor carried' in p for p in problems)
    no_regex = {k: v for k, v in image.items() if k != 'regex'}
    assert any(p.startswith('diffusers') and 'regex' in p for p in wheels.closure(meta, no_regex)[0])
    old_hub = copy.deepcopy(image); old_hub['huggingface-hub']['version'] = '1.20.0'
    assert any('huggingface-hub' in p and '1.20.0' in p for p in wheels.closure(meta, old_hub)[0])
    old_ao = [dict(w, version='0.17.0') if w['name'] == 'torchao' else w for w in meta]
    assert any('torchao carried 0.17.0' in p for p in wheels.check(meta=old_ao, image=image, tree=0))
    assert any('MiB >' in p for p in wheels.check(meta=meta, image=image, tree=60 * 2**20))


def test_shadowed_image_packages_still_suit_the_image():
    meta, image = wheels.load_meta(), wheels.read_image()
    low = [dict(w, version='2.10.0') if wheels.norm(w['name']) == 'pygments' else w for w in meta]  # pytest: >= 2.15
    assert any('shadows' in p and 'pygments' in p for p in wheels.closure(low, image)[0])


def test_wheel_tags():
    for py in (wheels.GPU_PYTHON, wheels.REHEARSAL_PYTHON):
        assert wheels.tag_ok('py3-none-any', py)
        assert wheels.tag_ok('cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64', py)
    assert wheels.tag_ok('cp312-cp312-manylinux_2_28_x86_64', wheels.GPU_PYTHON)
    assert not wheels.tag_ok('cp312-cp312-manylinux_2_28_x86_64', wheels.REHEARSAL_PYTHON)
    assert not wheels.tag_ok('cp312-abi3-macosx_11_0_arm64', wheels.GPU_PYTHON)
    # the same files serve the GPU's Python 3.12 and the rehearsal's 3.11: pure python or abi3 only
    assert all(wheels.tag_ok(w['tags'], wheels.GPU_PYTHON) and wheels.tag_ok(w['tags'], wheels.REHEARSAL_PYTHON)
               for w in wheels.load_meta())


def test_image_list_and_rehearsal_requirements():
    image = wheels.read_image()
    assert image['torch']['version'] == '2.11.0+cu130' and image['transformers']['version'] == '5.17.0'
    absent = {n for n, e in image.items() if e['source'] == 'absent'}
    assert {'ipython', 'traitlets', 'comm', 'torchao', 'diffusers', 'ipywidgets', 'gguf'} <= absent
    reqs = rehearsal.image_requirements(image)
    assert 'transformers==5.17.0' in reqs and 'torch==2.13.0' in reqs and 'huggingface-hub==1.33.0' in reqs
    assert not any(r.split('==')[0] in absent | {'torchvision'} for r in reqs)


# ---------------------------------------------------------------------------------------------------- the stages
def _budgets(**env):
    e = {k: v for k, v in os.environ.items() if not k.startswith('GPU_')}
    r = subprocess.run([sys.executable, str(TOOLS/'gpu_stages.py'), 'budgets', *env.pop('args', ())],
                       capture_output=True, text=True, env={**e, **env})
    return r.returncode, dict(l.split(' ', 1) for l in r.stdout.splitlines())


def test_two_commands_fit_the_device():
    # each command within its limit, the limits within one command's 10 minutes and, with a start-up, the session's 15
    for c in stages.COMMANDS:
        assert stages.total_budget(command=c) <= stages.COMMAND_LIMIT_S[c] <= stages.TOTAL_BUDGET_S <= 600
    assert stages.STARTUP_S + sum(stages.COMMAND_LIMIT_S.values()) <= stages.DEVICE_BUDGET_S == 900
    assert sorted(n for c in stages.COMMANDS.values() for n in c) == sorted(stages.RUN_STAGES)  # each stage once
    assert stages.COMMANDS[2][-1] == stages.ELASTIC == stages.RUN_STAGES[-1] == 'headline'
    assert set(stages.STAGE_FNS) == set(stages.RUN_STAGES) == set(stages.TABLES)
    assert stages.total_budget(dry=True) <= stages.DRY_LIMIT_S
    rc, lines = _budgets()
    assert rc == 0 and {k: int(v) for k, v in lines.items() if k in stages.BUDGETS} == stages.BUDGETS
    assert lines['stages'].split() == list(stages.COMMANDS[1]) and int(lines['limit']) == stages.COMMAND_LIMIT_S[1]
    rc, lines = _budgets(GPU_COMMAND='2', GPU_LIMIT_S='333')
    assert lines['stages'].split() == ['headline'] and lines['limit'] == '333'
    rc, lines = _budgets(args=('--dry-run',), GPU_COMMAND='2')
    assert lines['stages'].split() == list(stages.RUN_STAGES) and int(lines['limit']) == stages.DRY_LIMIT_S
    assert _budgets(GPU_COMMAND='3')[0] == 2  # a command that is not one: refused, naming the valid ones
    plan = stages.plan_table()
    assert plan.count('**total**') == 2 and '| all | **device** | **895** |' in plan


def _script(tmp_path, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith('GPU_')}
    e.update(OUT=str(tmp_path/'out'), GPU_WORK=str(tmp_path/'work'), GPU_PYTHON=sys.executable, GPU_SKIP_INSTALL='1',
             GPU_FAKE='0', **env)
    return subprocess.run(['bash', str(TOOLS/'gpu_check.sh'), '--dry-run'], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=120)


def test_a_killed_stage_keeps_the_rows_before_it(tmp_path):
    r = _script(tmp_path, GPU_STAGES='probe headline gemm_eager', GPU_FAKE_headline='60', GPU_BUDGET_headline='2')
    assert r.returncode == 1, r.stdout + r.stderr  # a stage did not finish: the run says so
    out = tmp_path/'out'
    files = sorted(p.name for p in out.rglob('*') if p.is_file())
    assert files == ['results.tar.gz', 'run.log', 'summary.md'] and len(files) <= stages.MAX_OUT_FILES
    with tarfile.open(out/'results.tar.gz') as tar:
        names = set(tar.getnames())
        status = tar.extractfile('status.tsv').read().decode()
    assert {'results/fake_probe.csv', 'results/fake_gemm_eager.csv'} <= names  # before and after the killed stage
    assert 'results/fake_headline.csv' not in names
    st = {l.split('\t')[0]: l.split('\t')[4] for l in status.splitlines()}
    assert st == {'install': 'skipped', 'probe': 'ok', 'headline': 'killed at its budget', 'gemm_eager': 'ok'}
    summary = (out/'summary.md').read_text()
    assert '| headline | 2 |' in summary and 'killed at its budget' in summary
    assert r.stdout.rstrip().endswith(summary.rstrip().splitlines()[-1])  # the summary is printed last


def test_the_last_stage_takes_what_is_left(tmp_path):
    r = _script(tmp_path, GPU_STAGES='headline')
    assert r.returncode == 0, r.stdout + r.stderr
    took = [l for l in r.stdout.splitlines() if 'budgeted,' in l]
    assert len(took) == 1 and int(took[0].split()[-1]) > stages.DRY_BUDGETS['headline']
    assert int(took[0].split()[-1]) <= stages.DRY_LIMIT_S


def test_rehearsal_check_reads_the_out_folder(tmp_path):
    work = tmp_path/'work'
    (work/'results').mkdir(parents=True)
    (work/'status.tsv').write_text(''.join(f'{s}\t1\t1\t0\tok\n' for s in ('install', *stages.RUN_STAGES)))
    for kinds in stages.TABLES.values():
        for k in kinds:
            ok = pd.DataFrame([dict(run='r', utc='u', config='dense', status='ok', error='')])
            ok.to_csv(work/'results'/f'{k}.csv', index=False)
    stages.pack(work, tmp_path/'out')
    assert rehearsal.check_out(tmp_path/'out') == []
    pd.DataFrame([dict(run='r', utc='u', config='int8', status='failed', error='ValueError: boom')]
                 ).to_csv(work/'results'/'transformer_bench.csv', index=False)
    status = (work/'status.tsv').read_text()
    (work/'status.tsv').write_text(status.replace('trained\t1\t1\t0\tok', 'trained\t1\t1\t124\tkilled'))
    stages.pack(work, tmp_path/'out')
    for i in range(8): (tmp_path/'out'/f'extra{i}').write_text('x')
    problems = rehearsal.check_out(tmp_path/'out')
    assert any('transformer_bench: int8 failed: ValueError: boom' in p for p in problems)
    assert any(p == 'stage trained: killed' for p in problems) and any('10 files' in p for p in problems)



def test_a_skipped_stage_is_a_problem_and_a_note_is_shown(tmp_path):
    work = tmp_path/'work'
    (work/'results').mkdir(parents=True)
    rows = ''.join(f"{s}\t1\t1\t{3 if s == 'trained' else 0}\t{'skipped' if s == 'trained' else 'ok'}\n"
                   for s in ('install', *stages.RUN_STAGES))
    (work/'status.tsv').write_text(rows)
    for s, kinds in stages.TABLES.items():
        for k in kinds if s != 'trained' else ():
            pd.DataFrame([dict(run='r', utc='u', config='dense', status='ok', error='')]).to_csv(work/'results'/f'{k}.csv')
    out = tmp_path/'out'
    stages.pack(work, out)
    (out/'run.log').write_text('stage trained skipped: no disk\n')
    assert 'stage trained: skipped' in rehearsal.check_out(out)  # the trained stage runs on every image now
    (work/'notes.tsv').write_text('emulation\tonly 4 schemes\n')
    stages.pack(work, out)
    assert '| emulation | 1 | 1 | 0 | ok (only 4 schemes) |' in (out/'summary.md').read_text()


def test_summary_names_the_device_without_the_probe(tmp_path):
    # a rerun of some stages (no probe): the device a stage read from torch.cuda, not '?'
    work = tmp_path/'work'
    (work/'results').mkdir(parents=True)
    (work/'status.tsv').write_text('install\t15\t3\t0\tok\n')
    (work/'device.json').write_text(json.dumps(dict(device='cuda', device_name='NVIDIA H200', capability='9.0',
                                                    torch_cuda='13.0', gpu_count=1)))
    (work/'running').write_text('gemm_eager\t35\n')  # a pack from inside a stage, part-way
    stages.pack(work, tmp_path/'out')
    summary = (tmp_path/'out'/'summary.md').read_text()
    assert 'device: NVIDIA H200 (capability 9.0)' in summary
    assert '| gemm_eager | 35 |  |  | running when this was packed |' in summary
    with tarfile.open(tmp_path/'out'/'results.tar.gz') as tar:
        prov = json.loads(tar.extractfile('provenance.json').read())
    assert gimport.check_provenance(prov)['device_name'] == 'NVIDIA H200'  # what the import accepts


def test_carried_prompt_states_are_checked(tmp_path):
    import torch
    states = stages.carried_prompt_states('cpu')
    import diffq_lab.trained as T
    assert list(states) == ['', *T.heldout_prompts(), 'a photo of a cat']
    assert all(t.dtype == torch.bfloat16 and t.ndim == 2 and t.shape[1] == 576 for t in states.values())
    meta = json.loads(stages.TRAINED_STATES_META.read_text())
    assert meta['encoder']['digest'] == json.loads((T.trained_dir()/'training.json').read_text())['text_encoder']['digest']
    bad = tmp_path/stages.TRAINED_STATES.name
    data = bytearray(stages.TRAINED_STATES.read_bytes()); data[-1] ^= 1; bad.write_bytes(bytes(data))
    bad.with_suffix('.json').write_text(stages.TRAINED_STATES_META.read_text())
    with pytest.raises(ValueError, match='sha256'): stages.carried_prompt_states('cpu', bad)
    bad.write_bytes(stages.TRAINED_STATES.read_bytes())
    bad.with_suffix('.json').write_text(json.dumps({**meta, 'encoder': {**meta['encoder'], 'digest': 'other'}}))
    with pytest.raises(ValueError, match='trained against'): stages.carried_prompt_states('cpu', bad)
    pipe = stages._serve_states(type('P', (), {})(), states)  # the lookup alone: a prompt not carried is refused
    assert pipe._encode_prompt(['', 'a photo of a cat'])[1] is states['a photo of a cat']
    with pytest.raises(KeyError, match='no carried prompt states'): pipe._encode_prompt('a blue dog')


# ---------------------------------------------------------------------------------------------------- the import
def _plan():
    from diffq_lab.plan import ComponentPlan, LinearPlan, QuantPlan
    return QuantPlan({'': ComponentPlan({'lin': LinearPlan(None, None, 'too narrow', (8, 8))})})


PLAN = _plan()  # a real plan: the import loads each one as a QuantPlan named by its digest


def _gpu_work(tmp_path, dry=False):
    work = tmp_path/'work'
    (work/'results'/'plans').mkdir(parents=True)
    prov = dict(dry_run=dry, python='3.12.3', device='cuda', device_name='NVIDIA H200', capability='9.0',
                git_sha='abc123def456', code_matches_source=True, utc='2026-12-02T10:00:00Z', host='gpu',
                packages=dict(torch='2.11.0+cu130', torchao='0.18.0', diffusers='0.42.1', transformers='5.17.0'))
    if dry: prov.update(device='cpu', device_name='CPU AMD EPYC', capability=None)  # a dry run says it ran on a CPU
    (work/'provenance.json').write_text(json.dumps(prov))
    (work/'status.tsv').write_text('probe\t40\t12\t0\tok\ngemm_eager\t25\t9\t0\tok\n')
    pd.DataFrame([dict(run='2026-12-02T10:01:00Z-aaaaaa', device='cuda', device_name='NVIDIA H200', capability='9.0',
                       torch='2.11.0+cu130', git_sha=None, utc='2026-12-02T10:01:00Z', M=8192, K=8192, N=8192, scheme=s,
                       median_s=t) for s, t in (('bf16', 1.4e-3), ('int8', 0.8e-3))]
                 ).to_csv(work/'results'/'gemm_bench.csv', index=False)
    (work/'results'/'plans'/f'{PLAN.digest()}.json').write_text(PLAN.to_json(compact=True))
    stages.pack(work, tmp_path/'out')
    return tmp_path/'out'/'results.tar.gz'


def test_import_brings_rows_home_once(tmp_path):
    tarball = _gpu_work(tmp_path)
    into = tmp_path/'results'
    into.mkdir()
    pd.DataFrame([dict(run='cpu-run', device='cpu', device_name='CPU AMD EPYC', git_sha='111',
                       utc='2026-11-30T00:00:00Z', M=128, K=1024, N=1024, scheme='bf16', median_s=0.01)]
                 ).to_csv(into/'gemm_bench.csv', index=False)
    added = gimport.import_tarball(tarball, into)
    assert added == {'gemm_bench': 2, 'gpu_runs': 1, 'plans': 1}
    g = pd.read_csv(into/'gemm_bench.csv')
    assert list(g.device_name) == ['CPU AMD EPYC', 'NVIDIA H200', 'NVIDIA H200']  # GPU rows beside the CPU one
    assert list(g.git_sha.astype(str)) == ['111', 'abc123def456', 'abc123def456']  # the stamped sha fills the blank
    runs = pd.read_csv(into/'gpu_runs.csv')
    assert runs.device_name.tolist() == ['NVIDIA H200'] and 'gemm_eager ok 9/25 s' in runs.stages[0]
    assert (into/'plans'/f'{PLAN.digest()}.json').read_text() == PLAN.to_json(compact=True)
    assert gimport.import_tarball(tarball, into) == {'gemm_bench': 0, 'plans': 0}  # twice: nothing added
    assert len(pd.read_csv(into/'gemm_bench.csv')) == 3 and len(pd.read_csv(into/'gpu_runs.csv')) == 1


def test_import_refuses_what_is_not_a_gpu_run(tmp_path, capsys):
    dry = _gpu_work(tmp_path/'dry', dry=True)
    assert gimport.main([str(dry), '--into', str(tmp_path/'r')]) == 2
    assert 'a dry run' in capsys.readouterr().err and not (tmp_path/'r'/'gemm_bench.csv').exists()
    evil = tmp_path/'evil.tar.gz'
    with tarfile.open(evil, 'w:gz') as tar:
        info = tarfile.TarInfo('../escape.csv'); data = b'a\n1\n'; info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert gimport.main([str(evil), '--into', str(tmp_path/'r')]) == 2
    assert 'unsafe member' in capsys.readouterr().err
    assert gimport.main([str(tmp_path/'missing.tar.gz')]) == 2
    assert not (tmp_path/'r').exists() or not any((tmp_path/'r').iterdir())
