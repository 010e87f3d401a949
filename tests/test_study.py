"diffq_lab.study's transformer benchmark: recorded rows, the CLI job, a GGUF file given as is, bad inputs."
import argparse, os, warnings
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import numpy as np
import pytest

import diffq_lab.study as S
from diffq_lab.core import load_table
from diffq_lab.gguf import write_gguf
from diffq_lab.pipelines import tiny_pipeline
from diffq_lab.transformer import denoisers, plan_transformer

warnings.filterwarnings('ignore', message='.*Tensor objects.*')


def n_planned(pipe, scheme, min_features=0):
    return sum(plan_transformer(m, scheme, min_features=min_features).n_quantized for m in denoisers(pipe).values())


def test_bench_rows_and_record(tmp_path):
    df = S.record_transformer_bench(root=tmp_path, pipe_or_family='flux.1-schnell', schemes=('int8', 'nvfp4'), runs=1, min_features=0)
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


def test_cli_transformer_bench_runs_from_flags(capsys):
    args = argparse.Namespace(model=None, family='sana', transformer_quant=['int8'], steps=1, size=32, runs=1, compile=False,
                              device='cpu', gguf='none', dims='tiny', min_features=None, no_record=True)
    df = S.cli_transformer_bench(args)
    assert list(df.config) == ['dense', 'int8'] and 'median_s' in capsys.readouterr().out
    assert df.set_index('config').loc['int8', 'quantized'] == '11/14'  # tiny: min_features 0; the 2 + 1 time Linears stay bf16


def test_bench_takes_a_gguf_file_and_refuses_nonsense(tmp_path):
    sd3 = tiny_pipeline('sd3')
    g = write_gguf(sd3.transformer, tmp_path/'sd3-q4.gguf', 'Q4_0')
    df = S.transformer_bench(sd3, schemes=(), runs=1, gguf=str(g), min_features=0)
    assert list(df.config) == ['gguf-sd3-q4', 'dense'] and df.set_index('config').loc['gguf-sd3-q4', 'path'] == 'gguf'
    with pytest.raises(ValueError, match='gguf must be'): S.transformer_bench(sd3, gguf='Q3_K')
    with pytest.raises(ValueError, match='runs'): S.transformer_bench(sd3, runs=0)
    with pytest.raises(ValueError, match='dims'): S.transformer_bench('sd3', dims='huge')


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
