"The whole-pipeline speed and memory model (12a_speed): per-Linear plans, fused QKV, the workload's settings."
import numpy as np, pandas as pd, pytest
from diffq_lab.speed import Workload, fuse_qkv, memory_fit, denoiser_calls, predict


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
    from diffq_lab.speed import default_path, linear_time
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
    from diffq_lab.speed import kernel_paths, published_runs
    p = kernel_paths().set_index('path')
    alone = p[['alone_in_bytes', 'alone_out_bytes', 'alone_kernels']].sum(axis=1) > 0
    assert set(p.index[alone]) == {'nvfp4_compiled', 'nvfp4_static_compiled'}
    nv = published_runs().query('scheme == "nvfp4"')
    assert nv.path.isin(p.index).all() and not nv.path.eq('nvfp4_cutlass_vllm').any()


def test_the_h200_kernel_points_are_what_the_recorded_rows_give():
    "data/kernel_points.csv's lab-h200-gemm rows: measured_kernel_points of the recorded gemm_bench GPU rows, to the digit."
    from diffq_lab.core import repo_root
    from diffq_lab.speed import kernel_points, measured_kernel_points
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
    from diffq_lab.speed import default_path
    assert default_path('int8', 'inductor') == 'int8_compiled_t018'
    assert default_path('int8', 'inductor', torchao='0.17') == 'int8_compiled'
    new, old = (predict('h100', 'z-image', 'int8', intervals=False, compile='cudagraphs', torchao=v)[0]
                for v in (None, '0.6-era nightly'))
    # torchao 0.18 under inductor: int8 no faster than bf16 on Hopper (the H200's lone Linears); the 2024 path ~1.3x
    assert new['speedup'] < 1 < 1.2 < old['speedup'] and new['path'] == 'int8_compiled_t018'


def test_a_quantised_row_is_paired_with_the_bf16_row_timed_before_it():
    "gemm_bench's 4096^3 eager rows hold two bf16 arms (the cubes', the weight-only kernels'): each kernel takes its own."
    from diffq_lab.core import repo_root
    from diffq_lab.speed import measured_kernel_points
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
    from diffq_lab.speed import lab_runs, published_runs
    l = lab_runs()
    assert list(l.columns) == list(published_runs().columns) and {'bf16', 'fp8'} <= set(l.scheme)
    assert l.source.eq('lab-h200-transformer-bench').all() and l.url.str.contains('transformer_bench.csv').all()
    assert (l.forwards_per_step == 2).all() and l.use.eq('validate').all()


def test_other_backends_dequantise_per_matmul_priced_from_their_bytes_and_kernel_figures():
    "GGUF / bitsandbytes NF4 (issue 37): the dequantise pass costs stored + bf16 bytes at a kernel-fitted share, never end to end."
    from diffq_lab.speed import BACKENDS, DEQUANT_LIKE, calibrate, kernel_points, linear_time
    cal, pts = calibrate(), kernel_points().set_index('path')
    share = float(pts.loc['dequant_kernel'].value)
    for q in BACKENDS:                  # one fused kernel's share over the PyTorch chain's published slowdown (bnb: one kernel)
        slow = pts.value.get(q, pts.value.get(DEQUANT_LIKE.get(q), 1.0))
        assert cal[q]['cast_bw'] == pytest.approx(share / float(slow)), q
    t = lambda path, M, **kw: float(linear_time('h100', M, 3072, 3072, path, cal, False, **kw))
    extra = lambda q: t(q, 64) - t(q, 64, quant=False)     # the dequantise alone
    assert extra('gguf_q8_0') > extra('gguf_q4_0') > 0      # more stored bytes, a slower chain
    assert t('bnb_nf4', 1) < t('bf16', 1) < t('bnb_nf4', 64)  # bnb's 4-bit GEMV at one row; dequantise + bf16 GEMM above
    with pytest.raises(ValueError, match='gguf_q8_0'): predict('h100', 'z-image', 'gguf_q9')


def test_sage_attention_is_an_attention_path_of_its_own():
    from diffq_lab.speed import arch_efficiency, kernel_points
    e, x = arch_efficiency('rtx4090'), float(kernel_points().set_index('point').value['sg1'])
    assert e['attention_sage'] == pytest.approx(x * e['attention']) and Workload(attention='sage').attention == 'sage'
    with pytest.raises(ValueError, match='sage'): Workload(attention='int4')
