"""The `diffq-lab` command end to end: sub-commands print their tables and write their files. Bad input (one line, exit 2,
nothing written) is one table, `cli.BAD_INPUTS`, run by tests/test_faults.py."""
import json, subprocess, sys
from pathlib import Path
import pytest
import torch
from diffq_lab.cli import main

def test_probe_prints_report(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv('DIFFQ_LAB_CACHE', str(tmp_path/'probes.json'))
    assert main(['probe', '--device', 'cpu']) == 0
    out = capsys.readouterr().out
    assert '| scheme' in out and 'int8' in out and 'nvfp4' in out and '`auto` ->' in out

def test_study_writes_report_and_rows(capsys, tmp_path, monkeypatch):
    "The default study (the trained pipeline), at its smallest: one scheme, one seed, two held-out prompts."
    from diffq_lab.trained import heldout_prompts
    monkeypatch.setenv('DIFFQ_LAB_RESULTS', str(tmp_path/'results'))
    (tmp_path/'prompts.txt').write_text('\n'.join(heldout_prompts()[:2]))
    assert main(['study', '--device', 'cpu', '--schemes', 'int8', '--seeds', '0', '--prompts', str(tmp_path/'prompts.txt'),
                 '--out', str(tmp_path/'out'), '--record']) == 0
    out = capsys.readouterr().out
    assert 'Scheme numerics' in out and 'encoder + transformer quantised per scheme' in out
    assert sorted(p.name for p in (tmp_path/'out').iterdir()) == ['grid.png', 'report.html', 'report.md']
    assert sorted(p.name for p in (tmp_path/'results').iterdir() if not p.name.startswith('.')) == ['capability.csv', 'plans', 'study.csv', 'study_numerics.csv']
def test_console_script_installed():
    exe = Path(sys.executable).parent/'diffq-lab'
    r = subprocess.run([str(exe), '--help'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and 'study' in r.stdout and 'probe' in r.stdout

def test_study_on_a_saved_pipeline_folder(tmp_path, monkeypatch, capsys):
    "--model takes a local folder, loaded with diffusers from_pretrained, studied like the embedded default."
    from diffq_lab.pipelines import tiny_pipeline
    tiny_pipeline('z-image').save_pretrained(tmp_path/'zimage')
    monkeypatch.setenv('DIFFQ_LAB_RESULTS', str(tmp_path/'results'))
    assert main(['study', '--device', 'cpu', '--model', str(tmp_path/'zimage'), '--schemes', 'int8wo', '--seeds', '0',
                 '--out', str(tmp_path/'out'), '--min-features', '0']) == 0
    out = capsys.readouterr().out
    assert str(tmp_path/'zimage') in out and '\nint8wo ' in out


def test_a_damaged_table_stops_the_study_before_any_work(tmp_path, monkeypatch, capsys):
    "A table cut mid-line: the recording run exits 2 naming it, and the file stays byte for byte as it was."
    monkeypatch.setenv('DIFFQ_LAB_RESULTS', str(tmp_path/'results'))
    from diffq_lab.store import append_rows
    append_rows('study', dict(scheme='int8', ssim=0.9983), device='cpu')
    path = tmp_path/'results'/'study.csv'
    path.write_text(path.read_text()[:-5])
    before = path.read_bytes()
    with pytest.raises(SystemExit) as e: main(['study', '--device', 'cpu', '--schemes', 'int8', '--seeds', '0', '--out', str(tmp_path/'out'), '--record'])
    assert e.value.code == 2 and 'study.csv, line 2' in capsys.readouterr().err
    assert path.read_bytes() == before and not (tmp_path/'out').exists()


@pytest.mark.parametrize('out', ['/proc/diffq-lab-report', ''])
def test_an_unwritable_out_exits_2_before_any_row(tmp_path, monkeypatch, out, capsys):
    monkeypatch.setenv('DIFFQ_LAB_RESULTS', str(tmp_path/'results'))
    with pytest.raises(SystemExit) as e: main(['study', '--device', 'cpu', '--schemes', 'int8', '--seeds', '0', '--out', out])
    assert e.value.code == 2 and ('cannot write' in capsys.readouterr().err or out == '')
    assert not (tmp_path/'results').exists() or not list((tmp_path/'results').glob('*.csv'))


def test_export_writes_the_plan_and_a_snippet(tmp_path, capsys):
    out = tmp_path/'z'/'plan.json'
    assert main(['export', '--family', 'z-image', '--scheme', 'int8', '--out', str(out)]) == 0
    from diffq_lab.plan import QuantPlan
    plan = QuantPlan.load(out)
    assert plan.components['transformer'].n_quantized == 239 and 'text_encoder' not in plan.components  # encoders dense by default
    snippet = out.with_suffix('.py').read_text()
    compile(snippet, 'snippet', 'exec')
    printed = capsys.readouterr().out
    assert "DiffusersTorchAoConfig(make_config('int8')" in snippet and str(out.with_suffix('.py')) in printed
    assert snippet not in printed and 'FqnToConfig' not in snippet  # the paths are printed, the code stays in its file
    assert main(['export', '--family', 'z-image', '--scheme', 'fp8', '--out', str(out)]) == 0  # its own files: rewritten
    assert QuantPlan.load(out).components['transformer'].scheme == 'fp8'


def test_export_never_overwrites_a_users_file(tmp_path, capsys):
    notes, code = tmp_path/'notes.json', tmp_path/'notes.py'
    notes.write_text('my notes'); code.write_text('print("mine")')
    for argv in (['--out', str(notes)], ['--out', str(tmp_path/'plan.py')], ['--out', str(tmp_path/'x.json'), '--model', str(code)],
                 ['--out', str(tmp_path/'y.json'), '--model', str(tmp_path)]):
        with pytest.raises(SystemExit) as e: main(['export', *argv])
        assert e.value.code == 2, argv
    assert notes.read_text() == 'my notes' and code.read_text() == 'print("mine")'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['notes.json', 'notes.py']  # nothing else written


def test_bench_is_its_own_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('DIFFQ_LAB_RESULTS', str(tmp_path/'results'))
    assert main(['bench', '--schemes', 'int8', '--gguf', 'none', '--runs', '1', '--device', 'cpu', '--no-record']) == 0
    out = capsys.readouterr().out
    assert '| dense' in out and '| int8' in out and not (tmp_path/'results').exists()
    with pytest.raises(SystemExit) as e: main(['study', '--transformer-quant', 'int8'])  # the two jobs no longer share flags
    assert e.value.code == 2

def test_export_expresses_per_linear_what_modules_to_not_convert_cannot(tmp_path):
    "flux.1's top-level proj_out stays dense under fp8wo; diffusers would match 'proj_out.' anywhere: exported per Linear instead."
    out = tmp_path/'plan.json'
    assert main(['export', '--family', 'flux.1-dev', '--scheme', 'fp8wo', '--out', str(out)]) == 0
    assert 'FqnToConfig({' in out.with_suffix('.py').read_text()


def test_recommend_writes_a_plan_that_clears_its_bar(tmp_path, capsys):
    out = tmp_path/'rec'/'plan.json'
    assert main(['recommend', '--gpu', 'h200', '--bar', '30', '--random-weights', '--seeds', '0', '--device', 'cpu', '--out', str(out)]) == 0
    from diffq_lab.plan import QuantPlan
    plan = QuantPlan.load(out)
    assert plan.components['transformer'].n_quantized > 0 and 'nvfp4' not in {l.scheme for l in plan.components['transformer'].linears.values()}
    from diffq_lab.export import plan_pipeline
    real = plan_pipeline('z-image', 'int8').components['transformer']
    assert set(plan.components['transformer'].linears) == set(real.linears)  # the real Z-Image's 276 Linears, not the tiny one's
    compile(out.with_suffix('.py').read_text(), 'snippet', 'exec')
    assert '>= bar 30.0 dB' in capsys.readouterr().out

def test_python_dash_m_diffq_lab_is_the_command():
    import subprocess, sys
    ok = subprocess.run([sys.executable, '-m', 'diffq_lab', '--help'], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and 'recommend' in ok.stdout
    bad = subprocess.run([sys.executable, '-m', 'diffq_lab', 'probe', '--device', 'gpu'], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "unknown device 'gpu'" in bad.stderr


def test_predict_prints_records_as_json(capsys):
    import json
    assert main(['predict', '--gpu', 'h100', '--family', 'flux.1-dev', '--schemes', 'int8', '--compile', 'inductor', '--json']) == 0
    recs = json.loads(capsys.readouterr().out)
    assert [r['scheme'] for r in recs] == ['bf16', 'int8']
    r = recs[1]
    assert r['speedup_lo'] <= r['speedup'] <= r['speedup_hi'] and r['resident_GiB'] < recs[0]['resident_GiB']


def test_recommend_on_a_model_folder_measures_that_model(tmp_path, capsys):
    "--model: sensitivity measured on the model itself, and the plan names its own Linears (nothing carried over)."
    from diffq_lab.pipelines import tiny_pipeline
    from diffq_lab.plan import QuantPlan
    from diffq_lab.transformer import denoisers
    pipe = tiny_pipeline('z-image'); pipe.save_pretrained(tmp_path/'mine')
    out = tmp_path/'rec'/'plan.json'
    assert main(['recommend', '--model', str(tmp_path/'mine'), '--bar', '30', '--seeds', '0', '--device', 'cpu', '--out', str(out)]) == 0
    plan = QuantPlan.load(out)
    mine = {f for f, m in denoisers(pipe)['transformer'].named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(plan.components['transformer'].linears) == mine
    assert str(tmp_path/'mine') in out.with_suffix('.py').read_text() and str(tmp_path/'mine') in capsys.readouterr().out


def test_predict_takes_every_setting_a_published_run_names(capsys):
    "predict --height/--frames/--rules/--load/--attention reach the speed model: a video clip, torchao's FLUX recipe, a saved folder."
    from diffq_lab.cli import main
    assert main(['predict', '--gpu', 'h100', '--family', 'cogvideox-5b', '--size', '720', '--height', '480', '--frames', '49',
                 '--schemes', 'int4wo', '--steps', '2', '--rules', 'flux-recipe', '--load', 'saved', '--json']) == 0
    recs = json.loads(capsys.readouterr().out)
    assert [(r['size'], r['height'], r['frames'], r['load']) for r in recs] == [(720, 480, 49, 'saved')] * 2
    assert recs[1]['path'] == 'int4wo_tinygemm' and recs[1]['speedup'] < 0.5       # tinygemm at DiT M


def test_predict_takes_the_encoder_scheme_fused_qkv_and_a_compiled_vae(capsys):
    "predict --te-scheme/--fuse-qkv/--compile-vae reach the model; the records say them back."
    assert main(['predict', '--gpu', 'h100', '--schemes', 'fp8', '--te-scheme', 'fp8', '--fuse-qkv', '--compile-vae',
                 '--json']) == 0
    recs = json.loads(capsys.readouterr().out)
    assert [(r['te_scheme'], r['fuse_qkv'], r['compile_vae']) for r in recs] == [('fp8', True, True)] * 2
    assert recs[1]['reserved_peak_GiB'] >= recs[1]['peak_GiB']
