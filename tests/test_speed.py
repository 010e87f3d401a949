"The kernel paths (11b_kernels) and the whole-pipeline speed and memory model (12a_speed)."
import numpy as np, pandas as pd, pytest
from diffq_lab.speed import Workload, fuse_qkv, memory_fit, denoiser_calls, predict
import math
from diffq_lab import gpus, kernels as kp, lab_speed as ls, speed as sp
from diffq_lab.core import TERM_WIDTH


def test_a_plan_naming_every_linear_a_scheme_takes_is_that_scheme():
    "memory_fit: recommend's per-Linear plan and predict's scheme give one number, allocated and reserved."
    fqns = denoiser_calls('z-image', Workload())[0].fqn
    one = memory_fit('rtx4090', 'z-image', 'fp8', load='at-load')
    assert memory_fit('rtx4090', 'z-image', dict.fromkeys(fqns, 'fp8'), load='at-load') == one
    assert one['reserved_peak_GiB'] >= one['peak_GiB'] >= one['resident_GiB'] and one['fits']


def test_fused_qkv_is_one_linear_of_the_summed_width():
    shapes = pd.DataFrame(dict(fqn=['a.to_q', 'a.to_k', 'a.to_v', 'a.to_out.0'], M=[8] * 4, K=[16] * 4, N=[16] * 4))
    out, assigned = fuse_qkv(shapes, np.array(['int8'] * 4, dtype=object))
    assert list(out.N) == [48, 16] and list(assigned) == ['int8', 'int8']


@pytest.mark.parametrize('kw, match', [(dict(te_scheme='fp7'), 'choose one of bf16, int8'),
                                       (dict(fuse_qkv=1), 'True or False'), (dict(compile_vae='no'), 'True or False')])
def test_workload_bad_values_name_the_choices(kw, match):
    with pytest.raises(ValueError, match=match): Workload(**kw)


def test_fused_qkv_and_a_quantised_encoder_reach_the_prediction():
    base, fused = (predict('h100', 'z-image', 'bf16,fp8', intervals=False, fuse_qkv=f) for f in (False, True))
    assert fused[1]['seconds'] < base[1]['seconds'] and fused[1]['fuse_qkv']
    te = predict('h100', 'z-image', 'bf16', intervals=False, te_scheme='fp8')[0]
    assert te['resident_GiB'] < base[0]['resident_GiB'] and te['te_scheme'] == 'fp8'


def test_lowrank_schemes_have_a_fused_and_an_unfused_path_priced_per_gpu():
    "nvfp4_lr / int4_lr (SVDQuant): the branch's cost over the W4A4 GEMM, fused < unfused; FP4 or INT4 cores needed."
    from diffq_lab.kernels import default_path, linear_time
    assert default_path('nvfp4_lr', 'none') == 'nvfp4_lr_fused'
    assert default_path('int4_lr', 'cudagraphs', 'unfused') == 'int4_lr_unfused'
    t = lambda gpu, path, rank: float(linear_time(gpu, 4608, 3072, 3072, path, rank=rank))
    for gpu, fmt in (('b200', 'nvfp4'), ('rtx5090', 'nvfp4'), ('rtx4090', 'int4')):
        base, fused, naive = (t(gpu, f'{fmt}_lr_{h}', r) for h, r in (('fused', 0), ('fused', 32), ('unfused', 32)))
        assert base < fused < naive and fused < 1.15 * base, (gpu, base, fused, naive)
        assert t(gpu, f'{fmt}_lr_fused', 16) < fused                   # the branch grows with its rank
    with pytest.raises(ValueError, match='no int4 tensor cores'): t('b200', 'int4_lr_fused', 32)
    with pytest.raises(ValueError, match='no nvfp4 tensor cores'): t('rtx4090', 'nvfp4_lr_fused', 32)
    with pytest.raises(ValueError, match='fused, unfused'): Workload(lowrank='half')


def test_the_benchmark_only_passes_and_the_nvfp4_paths_runs_name():
    "The alone_* passes are torchao NVFP4's (calibration only); every published NVFP4 run names a kernel path it ran."
    from diffq_lab.kernels import kernel_paths
    from diffq_lab.lab_speed import published_runs
    p = kernel_paths().set_index('path')
    alone = p[['alone_in_bytes', 'alone_out_bytes', 'alone_kernels']].sum(axis=1) > 0
    assert set(p.index[alone]) == {'nvfp4_compiled', 'nvfp4_static_compiled'}
    nv = published_runs().query('scheme == "nvfp4"')
    assert nv.path.isin(p.index).all() and not nv.path.eq('nvfp4_cutlass_vllm').any()


def test_the_h200_kernel_points_are_what_the_recorded_rows_give():
    "data/kernel_points.csv's lab-h200-gemm rows: measured_kernel_points of the recorded gemm_bench GPU rows, to the digit."
    from diffq_lab.core import repo_root
    from diffq_lab.kernels import kernel_points
    from diffq_lab.lab_speed import measured_kernel_points
    b = pd.read_csv(repo_root()/'data'/'results'/'gemm_bench.csv')
    got = measured_kernel_points(b[b.device.eq('cuda')])
    kp = kernel_points().query("source == 'lab-h200-gemm'")
    assert len(got) == len(kp) > 0 and list(got.point) == list(kp.point)
    np.testing.assert_allclose(got.value.to_numpy(), kp.value.to_numpy(), rtol=1e-12)
    # int4wo's rows are tinygemm's times; compiled int8wo (inductor's decomposition, 0.003x) is never a point
    assert got.query("kind == 'gemm_ms'").path.str.startswith('int4wo_tinygemm').all() and len(got.query("kind == 'gemm_ms'"))
    assert not got.path.eq("int8wo").any() and got.path.eq("int8wo_eager_t018").any()


def test_a_run_takes_the_paths_of_its_torchao():
    "torchao 0.18's paths (measured on the H200) are the default; an older run, or predict(torchao=), gets its own."
    from diffq_lab.kernels import default_path
    assert default_path('int8', 'inductor') == 'int8_compiled_t018'
    assert default_path('int8', 'inductor', torchao='0.17') == 'int8_compiled'
    new, old = (predict('h100', 'z-image', 'int8', intervals=False, compile='cudagraphs', torchao=v)[0]
                for v in (None, '0.6-era nightly'))
    # torchao 0.18 under inductor: int8 no faster than bf16 on Hopper (the H200's lone Linears); the 2024 path ~1.3x
    assert new['speedup'] < 1 < 1.2 < old['speedup'] and new['path'] == 'int8_compiled_t018'


def test_a_quantised_row_is_paired_with_the_bf16_row_timed_before_it():
    "gemm_bench's 4096^3 eager rows hold two bf16 arms (the cubes', the weight-only kernels'): each kernel takes its own."
    from diffq_lab.core import repo_root
    from diffq_lab.lab_speed import measured_kernel_points
    b = pd.read_csv(repo_root()/'data'/'results'/'gemm_bench.csv')
    b = b[b.device.eq('cuda') & b.M.eq(4096) & b.K.eq(4096) & ~b.compiled.astype(bool)]
    b = b[b.run.eq(b[b.scheme.eq('int8wo')].run.iloc[0])]
    bf = b[b.scheme.eq('bf16')]
    assert len(bf) == 2 and bf.median_s.nunique() == 2
    got = measured_kernel_points(b).set_index('path')
    wo = b[b.scheme.eq('int8wo')].iloc[0]
    assert got.loc['int8wo_eager_t018'].value == wo.median_s - bf.median_s.iloc[1]
    i8 = b[b.scheme.eq('int8')].iloc[0]
    assert got.query("kind == 'gemm_speedup_noquant'").loc['int8_eager_t018'].value == bf.gemm_only_s.iloc[0] / i8.gemm_only_s


def test_the_labs_own_runs_are_validation_rows_that_name_their_source():
    "lab_runs: the H200 headline in published_runs' columns, with the bench's call (CFG: 2 forwards a step)."
    from diffq_lab.lab_speed import lab_runs, published_runs
    l = lab_runs()
    assert list(l.columns) == list(published_runs().columns) and {'bf16', 'fp8'} <= set(l.scheme)
    assert l.source.eq('lab-h200-transformer-bench').all() and l.url.str.contains('transformer_bench.csv').all()
    assert (l.forwards_per_step == 2).all() and l.use.eq('validate').all()


def test_other_backends_dequantise_per_matmul_priced_from_their_bytes_and_kernel_figures():
    "GGUF / bitsandbytes NF4 (issue 37): the dequantise passes cost their bytes at kernel-level shares, never end to end."
    from diffq_lab.speed import WEIGHT_BACKENDS
    from diffq_lab.kernels import HOST_SYNC_CALLS, _path_params, calibrate, cpu_per_kernel, gpu_spec, kernel_points, linear_time
    cal, pts = calibrate(), kernel_points().set_index('path')
    share = float(pts.loc['dequant_kernel'].value)
    for q in set(WEIGHT_BACKENDS) - {'bnb_int8'}:   # bnb: one fused kernel's share; GGUF's torch chains: torchao's eager chain's (LLM.int8: its own GEMM)
        cb = _path_params(q, gpu_spec('h100'), cal)[2]
        assert cb == pytest.approx(share if q.startswith('bnb') else cal['int8wo_eager_t018']['cast_bw']), q
    t = lambda path, M, compiled=False, **kw: float(linear_time('h100', M, 3072, 3072, path, cal, compiled, **kw))
    extra = lambda q: t(q, 64) - t(q, 64, quant=False)     # the dequantise alone
    assert extra('gguf_q4_0') > extra('gguf_q8_0') > 0      # the nibble unpacking writes more than Q8_0's two passes
    # an eager Q4_0 chain's blocking copy idles the GPU for its calls up to the first kernel; Q8_0 has none, compiled none
    assert t('gguf_q4_0', 64) - t('gguf_q4_0', 64, True) == pytest.approx(HOST_SYNC_CALLS['gguf_q4_0'] * cpu_per_kernel('eager', cal))
    assert t('gguf_q8_0', 64) == pytest.approx(t('gguf_q8_0', 64, True))
    # LLM.int8's outlier search, casts and unfused rescale outweigh its int8 GEMM's gain; its two host syncs idle the GPU
    assert t('bnb_int8', 4096) > t('bf16', 4096) and t('bnb_int8', 4096) - t('bnb_int8', 4096, True) > 0
    assert t('bnb_nf4', 1) < t('bf16', 1) < t('bnb_nf4', 64)  # bnb's 4-bit GEMV at one row; dequantise + bf16 GEMM above
    with pytest.raises(ValueError, match='gguf_q8_0'): predict('h100', 'z-image', 'gguf_q9')


def test_sage_attention_is_an_attention_path_of_its_own():
    from diffq_lab.kernels import arch_efficiency, kernel_points
    e, x = arch_efficiency('rtx4090'), float(kernel_points().set_index('point').value['sg1'])
    assert e['attention_sage'] == pytest.approx(x * e['attention']) and Workload(attention='sage').attention == 'sage'
    with pytest.raises(ValueError, match='sage'): Workload(attention='int4')


# ---- moved from test_crossover: the kernel paths and the whole-pipeline model ---------------------


def test_kernel_tables_carry_sources_and_cover_every_scheme():
    pts, paths, runs = kp.kernel_points(), kp.kernel_paths(), ls.published_runs()
    assert pts.source.str.len().gt(3).all() and pts.url.str.len().gt(10).all()
    assert paths.source.str.len().gt(40).all() and runs.url.str.len().gt(10).all()
    assert set(sp.PREDICT_SCHEMES) <= set(paths.scheme)
    for s in sp.PREDICT_SCHEMES:
        for c in sp.COMPILE_MODES: assert kp.default_path(s, c) in set(paths.path)
    assert set(runs.use) <= {'validate', 'old-path', 'excluded'} and runs.run.is_unique


def test_calibration_never_reads_end_to_end_runs(monkeypatch):
    base = kp.calibrate()
    monkeypatch.setattr(ls, 'published_runs', lambda: (_ for _ in ()).throw(AssertionError('read a run')))
    assert kp.calibrate() == base
    # never more numbers than the kernel points they came from (eager_dispatch: one measured CPU time, one number);
    # nunchaku's FP4 GEMM borrows a fit: no points
    fitted = lambda v: sum(isinstance(x, (int, float)) and not isinstance(x, bool) for k, x in v.items() if k != 'points')
    assert all(v['points'] >= max(1, fitted(v)) for v in base.values() if 'points' in v), base
    dropped = kp.calibrate(drop_sources=('torchao-inference-doc', 'torchao-inference-doc-2026-02'))
    # with torchao's curves (today's and February 2026's) gone, its paths (and the FP4 GEMM nunchaku's paths borrow) are not fitted; the others stay
    assert not {'mxfp8_compiled', 'nvfp4_compiled', 'nvfp4_static_compiled', 'nvfp4_lr_fused'} & set(dropped)
    assert {'int4wo_tinygemm', 'nvfp4_cutlass_vllm', 'lowrank'} <= set(dropped)


@pytest.mark.parametrize('scheme', ['int8', 'fp8'])
def test_eager_paths_cost_more_than_compiled(scheme):
    M, K, N = 4608, 3072, 12288
    eager = float(kp.linear_time('h100', M, K, N, kp.default_path(scheme, 'none'), compiled=False))
    comp = float(kp.linear_time('h100', M, K, N, kp.default_path(scheme, 'inductor')))
    assert eager > comp


def test_weight_only_is_memory_bound_at_small_m():
    t = lambda p, M: float(kp.linear_time('h100', M, 3072, 12288, p))
    assert t('int8wo', 1) < t('bf16', 1) and t('nvfp4wo', 1) < t('int8wo', 1)
    assert t('int8wo', 4096) > t('bf16', 4096)                       # at DiT M the dequantise is extra work
    Ms = np.array([1, 16, 256, 4096, 16384])
    assert np.all(np.diff(kp.linear_time('b200', Ms, 3072, 3072, 'nvfp4_compiled')) > 0)


def test_execution_modes_order_a_pipeline():
    t = {c: sp.pipeline_time('h100', 'flux.1-dev', 1024, 1, 28, 1, 'bf16', c)['seconds'] for c in sp.COMPILE_MODES}
    assert t['none'] > t['inductor'] >= t['cudagraphs'] > 0
    w = sp.Workload(size=1024, compile='inductor', torch_version='2.8')   # before 2.9 SDPA runs FlashAttention-2 first
    f = sp.forward_time('h100', 'flux.1-dev', 'bf16', w)
    f8 = sp.forward_time('h100', 'flux.1-dev', 'bf16', w, attention='fp8')
    fc = sp.forward_time('h100', 'flux.1-dev', 'bf16', w, attention='cudnn')
    assert f8['attention_s'] < f['attention_s'] and fc['attention_s'] < f['attention_s'] and f8['linear_s'] == f['linear_s']
    # from torch 2.9 SDPA puts cuDNN first on the H100: the default is the cuDNN kernel's time
    assert sp.forward_time('h100', 'flux.1-dev', 'bf16', w, torch_version='2.9')['attention_s'] == fc['attention_s']


def test_blackwell_sdpa_runs_flash_attention_2():
    "Before torch 2.9 SDPA's default FA2 kernel has no tcgen05 path on sm_100: ~355 TFLOPS of 2250, cuDNN (chosen) ~1240."
    w = sp.Workload(compile='cudagraphs', torch_version='2.8')
    sdpa = sp.forward_time('b200', 'flux.1-dev', 'bf16', w)['attention_s']
    cudnn = sp.forward_time('b200', 'flux.1-dev', 'bf16', w, attention='cudnn')['attention_s']
    assert 3.0 < sdpa / cudnn < 3.8
    e = kp.arch_efficiency('b200')
    assert e['attention'] == pytest.approx(355 / 2250) and 'flashinfer' in e['source']


def test_steps_and_batch_scale_the_denoiser():
    a = sp.pipeline_time('h100', 'z-image', 1024, 1, 8, 1, 'fp8', 'cudagraphs')
    b = sp.pipeline_time('h100', 'z-image', 1024, 1, 16, 2, 'fp8', 'cudagraphs')
    assert b['denoise_s'] == pytest.approx(4 * a['denoise_s']) and b['vae_s'] == a['vae_s']
    assert b['text_encoder_s'] == pytest.approx(2 * a['text_encoder_s'])   # CFG encodes the negative prompt too


def test_predict_records_and_intervals():
    recs = sp.predict('b200', 'flux.1-dev', 'bf16,fp8,mxfp8,nvfp4,int8wo,nvfp4wo', sp.Workload(batch=2, compile='cudagraphs'))
    assert [r['scheme'] for r in recs] == ['bf16', 'fp8', 'mxfp8', 'nvfp4', 'int8wo', 'nvfp4wo']
    keys = {'scheme', 'seconds', 'seconds_lo', 'seconds_hi', 'speedup', 'speedup_lo', 'speedup_hi', 'resident_GiB', 'peak_GiB'}
    for r in recs:
        assert keys <= set(r) and r['seconds_lo'] <= r['seconds'] <= r['seconds_hi']
        assert r['speedup_lo'] <= r['speedup'] <= r['speedup_hi'] and r['peak_GiB'] >= r['resident_GiB'] > 0
    by = {r['scheme']: r for r in recs}
    assert by['bf16']['speedup'] == 1.0 and by['nvfp4']['resident_GiB'] < by['fp8']['resident_GiB'] < by['bf16']['resident_GiB']
    assert 'prediction' in sp.format_predictions(recs) and 'nvfp4' in sp.format_predictions(recs)


def test_predict_on_a_gpu_without_the_format_says_so():
    r = {x['scheme']: x for x in sp.predict('a100', 'z-image', ('bf16', 'fp8', 'int8wo'), sp.Workload(steps=8))}
    assert math.isnan(r['fp8']['seconds']) and 'tensor cores' in r['fp8']['note'] and r['int8wo']['seconds'] > 0
    t = sp.format_predictions(list(r.values()))                      # issue 35: a reason, never nan; 120 columns
    assert 'cannot run: no fp8 tensor cores' in t and 'nan' not in t.lower()
    assert max(map(len, t.splitlines())) <= TERM_WIDTH and r['fp8']['fits_with'] is None


def test_predict_says_whether_it_fits_and_what_does():
    "FLUX.1-dev on a 24 GiB RTX 4090: the dense-load peak (31.5 GiB) fits nowhere; quantised at load, int4wo does."
    r = {x['scheme']: x for x in sp.predict('rtx4090', 'flux.1-dev', 'bf16,int8,int4wo', intervals=False)}
    assert r['int8']['gpu_GiB'] == 24 and not r['int8']['fits'] and r['int8']['peak_GiB'] > 24
    assert r['int8']['fit'].startswith(f"does not fit: peak {r['int8']['peak_GiB']:.1f} GiB > 24 GiB")
    assert r['int4wo']['fits_with'] == 'at-load' and r['int4wo']['fit_peak_GiB'] <= 24 < r['int4wo']['peak_GiB']
    assert r['bf16']['fits_with'] == 'cpu-offload' and 'CPU offload' in r['bf16']['fit']
    t = sp.format_predictions(list(r.values()))
    assert 'fits 24 GiB' in t and 'need CPU offload: bf16, int8' in t and 'int4wo (16.7 GiB)' in t
    assert max(map(len, t.splitlines())) <= TERM_WIDTH
    big = sp.predict('h200', 'flux.1-dev', 'bf16', intervals=False)[0]
    assert big['fits'] and big['fit'] == f"fits ({big['peak_GiB']:.1f} of 141 GiB)"


@pytest.mark.parametrize('gpu', ['l4', 'a10g', 'rtx6000ada', 'gb200', 'rtxpro6000'])
def test_new_gpus_predict(gpu):
    r = sp.predict(gpu, 'z-image', ('bf16', 'int8'), sp.Workload(steps=8, compile='cudagraphs'), intervals=False)
    assert all(x['seconds'] > 0 for x in r)
    assert gpu in gpus.REQUIRED_GPUS and len(gpus.gpu_spec(gpu)['source']) > 40


@pytest.mark.parametrize('kw,match', [(dict(schemes=('fp4',)), 'nvfp4'), (dict(compile='jit'), 'cudagraphs'),
                                      (dict(gpu='tpu'), 'h200'), (dict(model='sdxl'), 'z-image'), (dict(steps=0), 'steps'),
                                      (dict(rules='some'), 'selective'), (dict(attention='flash'), 'cudnn'),
                                      (dict(min_features=-1), 'min_features'), (dict(wrong=1), 'QuantPolicy fields')])
def test_predict_bad_inputs(kw, match):
    args = dict(gpu='b200', model='z-image', size=1024, batch=1, steps=8, forwards_per_step=1, schemes=('bf16',),
                compile='inductor', intervals=False) | kw
    with pytest.raises(ValueError, match=match): sp.predict(**args)


def test_the_cli_keyword_call_and_the_workload_agree():
    "cli.py's `predict(gpu, fam, size=, batch=, steps=, forwards_per_step=, schemes=, compile=)` is the Workload call."
    a = sp.predict('h100', 'flux.1-dev', size=1024, batch=1, steps=28, forwards_per_step=1, schemes=('bf16', 'fp8'),
                   compile='none', intervals=False)
    b = sp.predict('h100', 'flux.1-dev', ('bf16', 'fp8'), sp.Workload(compile='none'), intervals=False)
    assert a == b


def test_min_features_is_a_policy_setting():
    from diffq_lab.policy import QuantPolicy
    w = sp.Workload(steps=8)
    lo = sp.forward_time('b200', 'z-image', 'fp8', w, min_features=0)['quantised_linears']
    hi = sp.forward_time('b200', 'z-image', 'fp8', w, policy=QuantPolicy(min_features=4096))['quantised_linears']
    assert lo > sp.forward_time('b200', 'z-image', 'fp8', w)['quantised_linears'] > hi >= 0


@pytest.mark.parametrize('model,size,height,tokens', [('cogvideox-5b', 720, 480, 13 * 30 * 45 + 226),
                                                      ('ltx-2', 768, 512, 16 * 16 * 24)])
def test_video_families_from_their_public_configs(model, size, height, tokens):
    w = sp.Workload(size=size, height=height, steps=30, forwards_per_step=2, compile='cudagraphs')
    shapes, trace = sp.denoiser_calls(model, w)
    assert tokens in set(shapes.M) and not trace.attention.empty
    r = {x['scheme']: x for x in sp.predict('h100', model, ('bf16', 'fp8', 'int8wo'), w, intervals=False)}
    assert r['fp8']['speedup'] > 1 > r['int8wo']['speedup'] * 0.9 and 'transformer only' not in r['fp8']['note']
    assert r['fp8']['resident_GiB'] < r['bf16']['resident_GiB'] <= r['bf16']['peak_GiB']
    # the whole pipeline: its text encoders and decode (`11c_video_parts`) beside the forwards
    p = sp.pipeline_time('h100', model, size, scheme='bf16', height=height, steps=30, forwards_per_step=2, compile='cudagraphs')
    assert p['text_encoder_s'] > 0 and p['vae_s'] > 0
    with pytest.raises(ValueError, match='k\\+1'): sp.token_grid(model, sp.Workload(size=size, height=height, frames=50))


def test_non_square_pictures_scale_the_tokens():
    sq = sp.forward_time('h100', 'flux.1-dev', 'bf16', sp.Workload(size=1024))
    wide = sp.forward_time('h100', 'flux.1-dev', 'bf16', sp.Workload(size=1024, height=512))
    assert 0.3 < wide['linear_s'] / sq['linear_s'] < 0.6
    assert sp.token_grid('flux.1-dev', sp.Workload(size=1024, height=512)) == (1, 32, 64)
    with pytest.raises(ValueError, match='multiple of 16'): sp.token_grid('flux.1-dev', sp.Workload(size=1024, height=500))
