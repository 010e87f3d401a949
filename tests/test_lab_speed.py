"""The speed model's lab wing (23_lab_speed): the GEMM bench (tiny CPU shapes, no timing asserted), its recorder,
and the recorded validation of the speed model on published runs."""
import math
import pandas as pd
import pytest
import torch

from diffq_lab import lab_speed as ls
from diffq_lab import speed as sp
from diffq_lab.core import load_table
from diffq_lab.schemes import SCHEMES, get_scheme


# ---- the benchmark (tiny CPU shapes; no timing is asserted) -------------------------------------

@pytest.fixture(scope='module')
def tiny_bench():
    return ls.gemm_bench([(32, 256, 256), (48, 256, 512)], schemes=('int8', 'fp8', 'int8wo', 'nvfp4', 'mxfp8'),
                         device='cpu', repeats=2, warmup=1, emulated=True)


def test_bench_rows(tiny_bench):
    b = tiny_bench
    assert set(b.scheme) == {'bf16', 'int8', 'fp8', 'int8wo', 'nvfp4', 'mxfp8'}        # bf16 added as the baseline
    ok = b[b.status == 'ok']
    assert set(ok.scheme) == {'bf16', 'int8', 'fp8', 'int8wo'}
    assert (ok.median_s > 0).all() and (ok.tflops > 0).all() and ok.speedup_vs_bf16.notna().all()
    assert (ok[ok.scheme == 'bf16'].speedup_vs_bf16 == 1).all()
    assert ok[ok.scheme.isin(['bf16', 'int8', 'fp8'])].gemm_only_s.notna().all()
    assert (b.timer == 'wall clock').all() and (b.copy_tbs > 0).all()
    assert ok[ok.scheme == 'fp8'].path.str.contains('gate bypassed').all()


def test_bench_never_times_emulation_as_the_kernel(tiny_bench):
    b = tiny_bench
    nr = b[b.status == 'not run']
    assert set(nr.scheme) == {'nvfp4', 'mxfp8'} and nr.median_s.isna().all() and nr.reason.str.contains('sm_100').all()
    em = b[b.status == 'emulated']
    assert set(em.scheme) == {'nvfp4', 'mxfp8'} and (em.path == ls.EMULATED_LABEL).all() and em.gemm_only_s.isna().all()
    assert not b[b.status == 'ok'].path.str.contains('emulat').any()


def test_bench_follows_the_registry():
    "Every registered scheme is benched, beside a bare GEMM the bench can build (its Scheme.gemm), through its library's path."
    # a snapshot of the registry when crossover was imported: a prefix of it now (a test may have built rank variants since)
    assert ls.BENCH_SCHEMES == ('bf16', *tuple(SCHEMES)[:len(ls.BENCH_SCHEMES) - 1])
    for name in SCHEMES:
        s = get_scheme(name)
        assert s.gemm in ('', 'bf16', 'int8', 'fp8'), (name, s.gemm)
        if s.gemm: assert callable(ls._raw_gemm(s.gemm, 16, 32, 32, torch.device('cpu')))
        status, path, reason = ls._bench_path(name, torch.device('cpu'))
        if s.gate.cpu or name == 'fp8': assert status == 'ok' and path.startswith(s.library + ' '), (name, path)  # fp8: gate bypassed
        else: assert (status, path) == ('not run', 'not run') and reason, name


def test_bench_scheme_without_a_bare_gemm_leaves_it_nan(monkeypatch):
    "A scheme whose Scheme.gemm is '' is timed, and its gemm_only_s stays NaN (no bare kernel is guessed for it)."
    real = ls._gemm_kind
    monkeypatch.setattr(ls, '_gemm_kind', lambda s: '' if s == 'int8wo' else real(s))
    b = ls.gemm_bench([(32, 256, 256)], schemes=('int8wo',), device='cpu', repeats=1, warmup=0).set_index('scheme')
    assert b.loc['int8wo', 'status'] == 'ok' and b.loc['int8wo', 'median_s'] > 0
    assert math.isnan(b.loc['int8wo', 'gemm_only_s']) and not math.isnan(b.loc['bf16', 'gemm_only_s'])


@pytest.mark.parametrize('kwargs,match', [(dict(shapes=[(32, 256)]), 'M, K, N'), (dict(schemes=('int4',)), 'nvfp4wo'),
                                          (dict(schemes=('auto',)), 'nvfp4wo'), (dict(repeats=0), 'repeats'),
                                          (dict(warmup=-1), 'warmup'), (dict(shapes=[]), 'at least one')])
def test_bench_bad_inputs(kwargs, match):
    args = dict(shapes=[(32, 256, 256)], device='cpu', repeats=1, warmup=0) | kwargs
    with pytest.raises(ValueError, match=match): ls.gemm_bench(**args)


def test_record_gemm_bench_writes_only_where_told(tmp_path):
    df = ls.record_gemm_bench(root=tmp_path, device='cpu', shapes=[(32, 128, 128)], schemes=('int8', 'nvfp4'), repeats=1, warmup=0)
    t = load_table('gemm_bench', tmp_path)
    assert len(t) == len(df) == 4                                    # bf16, int8, nvfp4 not run + its emulated row
    assert {'run', 'device_name', 'torchao', 'git_sha'} <= set(t.columns) and t.run.nunique() == 1


def test_committed_cpu_rows_if_present():
    "The committed CPU sweep (if recorded) holds real measurements and no emulated row claims to be a kernel."
    t = load_table('gemm_bench')
    if t.empty: pytest.skip('no gemm_bench rows committed yet')
    cpu = t[t.device == 'cpu']
    ok = cpu[cpu.status == 'ok']
    assert {'bf16', 'int8', 'fp8', 'int8wo', 'fp8wo'} <= set(ok.scheme)
    # nvfp4wo: measured where the capability gate lets it run on a CPU, else a 'not run' row with the reason
    assert 'nvfp4wo' in set(ok.scheme) | set(cpu[cpu.status == 'not run'].scheme)
    assert (ok.median_s > 0).all() and set(cpu[cpu.status == 'not run'].scheme) >= {'nvfp4', 'mxfp8'}
    assert (cpu[cpu.status == 'emulated'].path == ls.EMULATED_LABEL).all()


def test_bench_speedups_are_paired_with_intervals(tiny_bench):
    ok = tiny_bench[tiny_bench.status.isin(['ok', 'emulated'])]
    assert (ok.speedup_lo <= ok.speedup_vs_bf16).all() and (ok.speedup_vs_bf16 <= ok.speedup_hi).all()
    assert (ok[ok.status == 'emulated'].speed == 'emulated: numerics only, not a speed claim').all()
    real = ok[(ok.status == 'ok') & (ok.scheme != 'bf16')]
    assert real.speed.str.startswith('noise: 2 rounds').all()  # the fixture's 2 rounds: no claim either way
    assert (tiny_bench.timing.str.contains('interleaved')).all()


def test_recorded_validation_covers_the_runs_and_meets_its_bounds():
    v, runs = sp.validation_table(), pd.concat([ls.published_runs(), ls.lab_runs()])
    assert set(v.run) == set(runs.run[runs.use != 'excluded'])
    q = v[(v.use == 'validate') & (v.scheme != 'bf16')]
    err = lambda mode: q[q['mode'] == mode].speedup_err.abs()
    # int4 weight-only (tinygemm): its seconds and speedups within the 25%
    i4 = q[q['mode'] == 'int4wo']
    assert len(i4) >= 6 and i4.seconds_err.abs().max() < 0.25 and err('int4wo').max() < 0.25
    assert err('compiled').median() < 0.05 and err('eager').max() < 0.15 and err('backend').max() < 0.15
    # the 12% on every compiled run but the seed's second-hand Z-Image fp8 / NVFP4 rows (sd43 +16%)
    comp = q[q['mode'] == 'compiled']
    assert comp[~comp.source.eq('seed-zimage')].speedup_err.abs().max() < 0.12 and err('compiled').max() < 0.20
    # memory as each source measured it: allocated (diffusers-torchao) and reserved (the HF blog, the allocator replay)
    mem = v.dropna(subset=['published_resident'])
    al, rs = mem[mem.memory.eq('allocated')], mem[mem.memory.eq('reserved')]
    assert len(al) and al.resident_err.abs().max() < 0.01 and al.peak_err.abs().max() < 0.05
    # reserved: hb7 quantises on the GPU while loading (device_map), its transients unmodelled: -13% resident, -15% peak
    assert len(rs) and rs.resident_err.abs().median() < 0.01 and rs.peak_err.abs().median() < 0.10
    assert rs.resident_err.abs().max() < 0.15 and rs.peak_err.abs().max() < 0.16
    fl = q[q.model.str.startswith('flux') & q.scheme.isin(['mxfp8', 'nvfp4'])].pivot_table(
        index=['source', 'batch'], columns='scheme', values=['published_speedup', 'predicted_speedup'])
    assert ((fl['published_speedup']['nvfp4'] > fl['published_speedup']['mxfp8'])
            == (fl['predicted_speedup']['nvfp4'] > fl['predicted_speedup']['mxfp8'])).all()
