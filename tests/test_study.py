"diffq_lab.bench's transformer benchmark (recorded rows, the tiny floor, a GGUF file given as is, bad inputs) and the study's runner and report."
import os, warnings
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import numpy as np
import pytest

import diffq_lab.bench as B
import diffq_lab.study as S
from diffq_lab.core import load_table
from diffq_lab.lab import record_transformer_bench
from diffq_lab.gguf import write_gguf
from diffq_lab.pipelines import tiny_pipeline
from diffq_lab.transformer import denoisers, plan_transformer

warnings.filterwarnings('ignore', message='.*Tensor objects.*')


def n_planned(pipe, scheme, min_features=0):
    return sum(plan_transformer(m, scheme, min_features=min_features).n_quantized for m in denoisers(pipe).values())


def test_bench_rows_and_record(tmp_path):
    df = record_transformer_bench(root=tmp_path, pipe_or_family='flux.1-schnell', schemes=('int8', 'nvfp4'), runs=1, min_features=0)
    table = load_table('transformer_bench', tmp_path)
    assert len(table) == 4 and list(table.config) == ['gguf-Q8_0', 'dense', 'int8', 'nvfp4']
    assert {'device_name', 'torch', 'torchao', 'run'} <= set(table.columns)
    d = df.set_index('config')
    assert d.loc['dense', 'vs_dense'] == 1 and d.loc['gguf-Q8_0', 'vs_gguf'] == 1 and np.isinf(d.loc['dense', 'psnr'])
    assert d.loc['int8', 'psnr'] > d.loc['nvfp4', 'psnr'] > 10  # 8 bits stay closer to dense than 4
    assert d.loc['int8', 'quantized'] == f"{n_planned(tiny_pipeline('flux.1-schnell'), 'int8')}/28"
    assert df.finite.all() and (df.recompiles == 0).all() and df.peak_gen_MiB.notna().all()  # the resident set's peak on a CPU
    assert d.loc['nvfp4', 'speed'] == 'emulated: numerics only, not a speed claim' and d.loc['dense', 'speed'] == 'baseline'
    assert d.loc['int8', 'speed'].startswith('noise: 1 rounds')  # one round: no speed claim either way
    assert d.loc['dense', 'ssim'] == 1 and d.loc['nvfp4', 'ssim'] < d.loc['int8', 'ssim'] < 1
    assert 'lpips' in df or df.lpips_unavailable.str.len().gt(0).all()  # a score, or the reason there is none


def test_bench_on_a_tiny_pipeline_takes_the_tiny_floor():
    "No min_features given: the policy's floor for the tiny 32-64-wide DiT is 0, decided from the model itself."
    df = B.transformer_bench('sana', schemes=['int8'], steps=1, runs=1, gguf=None)
    assert list(df.config) == ['dense', 'int8'] and df.median_s.notna().all()
    assert df.set_index('config').loc['int8', 'quantized'] == '11/14'  # the 2 + 1 time Linears stay bf16
    assert set(df.attrs['plans']) == set(df.plan.dropna())  # every row's plan travels with the table


def test_bench_takes_a_gguf_file_and_refuses_nonsense(tmp_path):
    sd3 = tiny_pipeline('sd3')
    g = write_gguf(sd3.transformer, tmp_path/'sd3-q4.gguf', 'Q4_0')
    df = B.transformer_bench(sd3, schemes=(), runs=1, gguf=str(g), min_features=0)
    assert list(df.config) == ['gguf-sd3-q4', 'dense'] and df.set_index('config').loc['gguf-sd3-q4', 'path'] == 'gguf'
    with pytest.raises(ValueError, match='gguf must be'): B.transformer_bench(sd3, gguf='Q3_K')
    with pytest.raises(ValueError, match='runs'): B.transformer_bench(sd3, runs=0)
    with pytest.raises(ValueError, match='dims'): B.transformer_bench('sd3', dims='huge')


def test_a_failing_scheme_is_a_row_and_the_others_still_run(monkeypatch):
    "The study's per-scheme runner turns one scheme's failure into its row; the rows key on the applied plan."
    import diffq_lab.study as S
    real = S.load_pipeline_quantized
    def dies_for_fp8wo(pipe, **kw):
        if kw.get('transformer_quant') == 'fp8wo': raise RuntimeError('no kernel (forced)')
        return real(pipe, **kw)
    monkeypatch.setattr(S, 'load_pipeline_quantized', dies_for_fp8wo)
    st = S.run_study(schemes=['int8wo', 'fp8wo'], seeds=(0,), prompts=S.STUDY_PROMPTS[:1], device='cpu', progress=False,
                     control=False)
    assert list(st.requested) == ['dense', 'int8wo', 'fp8wo'] and list(st.status) == ['ok', 'ok', 'failed']
    assert st.error.iloc[2] == 'RuntimeError: no kernel (forced)' and st.transformer_scheme.iloc[1] == 'int8wo'
    assert st.plan.iloc[1] and len(st.plan.iloc[1]) == 12  # the applied plan's digest travels with the row


def _git(cwd, *args):
    import subprocess
    return subprocess.run(['git', *args], cwd=cwd, capture_output=True, text=True, check=True)


def test_a_recording_says_which_tracked_files_it_changed(tmp_path):
    "A routine study changes tracked tables: the last lines of its output name each one and its new rows."
    res = tmp_path/'data'/'results'
    res.mkdir(parents=True)
    (res/'study.csv').write_text('a\n1\n'); (res/'capability.csv').write_text('a\n1\n')
    _git(tmp_path, 'init', '-q'); _git(tmp_path, 'add', '.')
    _git(tmp_path, '-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-qm', 'tables')
    (res/'study.csv').write_text('a\n1\n2\n3\n'); (res/'plans').mkdir(); (res/'plans'/'abc.json').write_text('{}')
    note = S.recorded_note({'study': 2, 'capability': 0}, root=res)
    assert 'changed tracked files' in note and 'M data/results/study.csv (+2 rows)' in note
    assert 'capability.csv' not in note and '1 plan file(s)' in note   # unchanged tables are not listed
    assert max(map(len, note.splitlines())) <= S.WIDTH
    outside = S.recorded_note({'study': 3}, root=tmp_path.parent/'elsewhere')
    assert 'no git checkout tracks it' in outside and 'study.csv +3 rows' in outside


def test_short_table_fits_120_columns_with_failures_and_a_legend():
    import pandas as pd
    rows = [dict(requested='dense', scheme='dense', vs_dense=1.0, te_MiB=0.5, transformer_MiB=26.0, status='ok'),
            dict(requested='fp8_layerwise', te_backend='diffusers', transformer_backend='torchao+emulate', transformer_quantized='27/29',
                 vs_dense=0.27, vs_dense_lo=0.23, vs_dense_hi=0.30, ci_level=0.995, speed='slower: the whole interval below 1',
                 psnr=46.5, ssim=0.987, te_MiB=0.2, transformer_MiB=13.7, status='ok', fallback_reason='x' * 400),
            dict(requested='int4wo', status='failed', error='ImportError: ' + 'y' * 300)]
    out = S.short_table(pd.DataFrame(rows))
    assert max(map(len, out.splitlines())) <= 120, max(out.splitlines(), key=len)
    assert '0.27 [0.23, 0.30] slower' in out and '99.5% interval' in out and 'reference' in out
    assert 'int4wo: ImportError' in out and 'fp8_layerwise: xxx' in out and 'nan' not in out.lower()


def test_forked_arms_give_the_rows_one_process_gives():
    "workers=2 runs the arms in forked children on dense's shared modules: the same plans, renders and quality columns."
    kw = dict(schemes=['int8', 'nvfp4'], seeds=(0,), device='cpu', progress=False, min_features=0)
    one, two = S.run_study(workers=1, **kw), S.run_study(workers=2, **kw)
    cols = ['requested', 'scheme', 'plan', 'te_scheme', 'transformer_quantized', 'psnr', 'ssim', 'te_MiB', 'status']
    assert one[cols].equals(two[cols]), (one[cols], two[cols])
    assert (two.status == 'ok').all() and np.isinf(two.psnr.iloc[1])  # the control still renders exactly what dense does
    assert set(two.attrs['renders']) == {'int8', 'nvfp4'} and two.latency_s.notna().all()


def test_the_shared_encoder_is_given_back_dense_after_every_arm():
    "Arms quantise dense's own text encoder in place and restore it: after a study it is bit-identical, with no hooks."
    import torch
    from diffq_lab.weights import weights_digest
    pipe = tiny_pipeline('z-image')
    before = {k: v.clone() for k, v in pipe.text_encoder.state_dict().items()}
    job = S._StudyJob(lambda: pipe, S.Renders(seeds=(0,)).resolved(False), S.as_policy(None, min_features=0),
                      dict(S._STUDY_RUN, progress=False), torch.device('cpu'), False, None)
    S._study(job, ['fp8_layerwise', 'int8'])
    after = pipe.text_encoder.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert not any(hasattr(m, '_diffusers_hook') for m in pipe.text_encoder.modules())
