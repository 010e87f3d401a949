"""Integration, property and bad-input tests for diffq_lab.gpus and diffq_lab.crossover (no timings, no downloads).

The notebook (nbs/12_crossover.ipynb) holds the worked examples and their assertions; these tests add the properties,
faults and end-to-end runs it does not make."""
import math
import numpy as np
import pandas as pd
import pytest
import torch

from diffq_lab import crossover as cx
from diffq_lab import gpus
from diffq_lab.core import TERM_WIDTH
from diffq_lab.meta import get_model, latent_grid
from diffq_lab.capability import KNOWN_GPUS


# ---- the spec table -------------------------------------------------------------------------------

def test_spec_table_has_required_gpus_with_sources():
    s = gpus.gpu_specs()
    assert set(gpus.REQUIRED_GPUS) <= set(s.gpu)
    assert s.gpu.is_unique
    assert (s.source.str.len() > 40).all() and s.source.str.contains('datasheet|whitepaper').all()
    assert (s.mem_bw_tbs > 0).all() and (s.bf16_tflops > 0).all()


def test_spec_table_is_physically_consistent():
    s = gpus.gpu_specs().set_index('gpu')
    has8 = s.fp8_tflops.notna()
    assert (s.fp8_tflops[has8] >= s.bf16_tflops[has8]).all()           # fp8 never slower than bf16
    assert (s.int8_tops >= s.bf16_tflops).all()
    has4 = s.fp4_tflops.notna()
    assert set(s.index[has4]) == set(s.index[s.arch == 'Blackwell'])   # fp4 tensor cores: Blackwell only
    assert (s.fp4_tflops[has4] >= 2 * s.fp8_tflops[has4]).all()
    assert s.loc['b200', 'fp4_tflops'] == 2 * s.loc['b200', 'fp8_tflops'] == 4 * s.loc['b200', 'bf16_tflops']
    assert s.loc['h100', 'bf16_tflops'] == s.loc['h200', 'bf16_tflops'] and s.loc['h200', 'mem_bw_tbs'] > s.loc['h100', 'mem_bw_tbs']
    assert s.fp8_tflops.isna()['a100']                                 # no fp8 on Ampere


def test_spec_capabilities_agree_with_capability_module():
    "Each device name capability.KNOWN_GPUS knows resolves to a spec row with the same compute capability."
    seen = 0
    for name, cap in KNOWN_GPUS.items():
        try: spec = gpus.gpu_spec(name)
        except ValueError: continue
        seen += 1
        assert float(spec['capability']) == pytest.approx(cap[0] + cap[1] / 10), name
    assert seen >= 6


@pytest.mark.parametrize('name,key', [('NVIDIA H200', 'h200'), ('h100 sxm', 'h100'), ('NVIDIA A100-SXM4-80GB', 'a100'),
                                      ('NVIDIA GeForce RTX 5090', 'rtx5090'), ('rtx-4090', 'rtx4090'), ('B200', 'b200'), ('L40S', 'l40s')])
def test_gpu_aliases(name, key):
    assert gpus.gpu_spec(name)['gpu'] == key


@pytest.mark.parametrize('bad', ['tpu', '', 'H300', None])
def test_unknown_gpu_names_the_choices(bad):
    with pytest.raises(ValueError, match='h200'): gpus.gpu_spec(bad)


# ---- the roofline: one Linear on its format's kernel path (11b_kernels) -----------------------------

@pytest.mark.parametrize('shape', [(1, 2), (1, 2, 3, 4), (0, 64, 64), (64, -1, 64), (64.0, 64, 64), (True, 64, 64), '64x64x64', None])
def test_bad_shapes(shape):
    with pytest.raises(ValueError, match='M, K, N'): cx.roofline('b200', shape, 'fp8')


@pytest.mark.parametrize('scheme', ['int4', 'fp8wo', 'FP8', None, 'w8a8'])
def test_bad_roofline_schemes_name_the_choices(scheme):
    with pytest.raises(ValueError, match='bf16, int8, fp8, mxfp8, nvfp4'): cx.roofline('b200', (64, 64, 64), scheme)


@pytest.mark.parametrize('gpu,scheme', [('h200', 'nvfp4'), ('h100', 'mxfp8'), ('a100', 'fp8'), ('l40s', 'nvfp4')])
def test_scheme_the_gpu_lacks(gpu, scheme):
    with pytest.raises(ValueError, match=f'no {scheme} tensor cores'): cx.roofline(gpu, (1024,) * 3, scheme)


@pytest.mark.parametrize('gpu', ['b200', 'h200', 'rtx4090'])
def test_time_is_monotone_in_every_dimension(gpu):
    rng = np.random.default_rng(0)
    for scheme in gpus.gpu_schemes(gpu):
        for _ in range(25):
            M, K, N = (int(v) for v in rng.integers(1, 20000, size=3))
            t = cx.predict_time(gpu, M, K, N, scheme)
            for bigger in [(M * 2, K, N), (M, K * 2, N), (M, K, N * 2)]:
                assert cx.predict_time(gpu, *bigger, scheme) >= t, (gpu, scheme, (M, K, N), bigger)


def test_vectorised_and_scalar_predictions_agree():
    M, K, N = np.array([64, 4096, 16384.0]), np.array([512, 3840, 16384.0]), np.array([512, 10240, 16384.0])
    for s in cx.roofline_formats():
        vec = cx.predict_time('b200', M, K, N, s)
        for i in range(3):
            assert vec[i] == pytest.approx(cx.roofline('b200', (int(M[i]), int(K[i]), int(N[i])), s)['time_s'], rel=1e-12)


def test_asymptotes_follow_the_peak_ratios():
    "Huge GEMMs approach the tensor-core peak ratio times the measured shares (fp8-class GEMMs reach less of theirs)."
    for scheme, ratio in [('nvfp4', 4.0), ('fp8', 2.0), ('mxfp8', 2.0)]:
        sp = cx.roofline('b200', (2 ** 17,) * 3, scheme)['speedup_vs_bf16']
        assert 0.75 * ratio < sp <= ratio, (scheme, sp)
    # one token: the weight's bytes decide (NVFP4 reads under a third of bf16's), less its cast and amax kernels' floors
    assert cx.roofline('b200', (1, 8192, 8192), 'nvfp4')['speedup_vs_bf16'] > 1.2


def test_the_crossover_times_are_the_speed_models():
    "One model: a format's crossover time is `kernels.linear_time` on the kernel path `predict` uses in that mode."
    from diffq_lab.kernels import default_path, linear_time
    for mode in ('none', 'inductor'):
        for s in ('bf16', 'int8', 'fp8', 'mxfp8', 'nvfp4'):
            t = float(linear_time('b200', 4096, 3072, 12288, default_path(s, mode), compiled=mode != 'none',
                                  cal=__import__('diffq_lab.kernels', fromlist=['x'])._calibration()))
            assert cx.predict_time('b200', 4096, 3072, 12288, s, mode) == pytest.approx(t, rel=1e-12)
    r = cx.roofline('h200', (4096, 3840, 10240), 'fp8', 'none')
    assert r['path'] == default_path('fp8', 'none') and r['time_s'] == pytest.approx(sum(r['passes'].values()), rel=1e-12)


def test_predict_crossover_and_recommend_give_one_number():
    "Z-Image, H200, 1024 px, compiled, every Linear in fp8: crossover's Linears, recommend's patterns, predict's forward."
    from diffq_lab.speed import Workload, forward_time
    from diffq_lab.recommend import pattern_times
    w = Workload(size=1024, compile='inductor', rules='all')
    lay = cx.analyse_layers(cx.model_linear_shapes('z-image', latent_grid('z-image', 1024)), 'h200', compile='inductor')
    pat = pattern_times('z-image', 'h200', w)
    for s in ('bf16', 'fp8', 'int8'):
        fwd = forward_time('h200', 'z-image', s, w)
        assert fwd['quantised_linears'] == (0 if s == 'bf16' else len(lay))   # 'all': every Linear, as the crossover
        assert lay[f't_{s}'].sum() == pytest.approx(fwd['linear_s'], rel=1e-9), s
        assert pat[s].sum() == pytest.approx(fwd['linear_s'], rel=1e-9), s

# ---- crossovers -----------------------------------------------------------------------------------

def test_crossovers_are_ordered():
    b200 = {(a, b): cx.find_crossover('b200', a, b).cube for a, b in
            [('nvfp4', 'bf16'), ('nvfp4', 'fp8'), ('fp8', 'bf16'), ('mxfp8', 'bf16')]}
    assert b200[('fp8', 'bf16')] < b200[('nvfp4', 'bf16')] < b200[('nvfp4', 'fp8')]
    assert 2048 < b200[('nvfp4', 'bf16')] <= 4096                    # the published curve: 0.76x at 2048^3, 1.37x at 4096^3
    # published MXFP8: 1.20x at 2048^3; the kernel paths (fitted on the ReLU->Linear curve) put its crossover just above
    assert 2048 < b200[('mxfp8', 'bf16')] <= 2560 and b200[('mxfp8', 'bf16')] < b200[('nvfp4', 'bf16')]
    assert cx.find_crossover('b200', 'bf16', 'fp8').cube is None                       # bf16 never overtakes fp8 at scale


def test_m_star_means_a_wins_from_there_on():
    c = cx.find_crossover('b200', 'nvfp4', 'fp8', K=(3840, 10240), N=(3840, 10240))
    for r in c.m_star.itertuples():
        g = c.surface[(c.surface.K == r.K) & (c.surface.N == r.N)].sort_values('M')
        if math.isnan(r.M_star): assert not g.a_wins.iloc[-1]
        else:
            assert g[g.M >= r.M_star].a_wins.all()
            below = g[g.M < r.M_star]
            assert below.empty or not below.a_wins.iloc[-1]              # the size just below still loses


def test_crossover_bad_inputs():
    with pytest.raises(ValueError, match='no nvfp4'): cx.find_crossover('h200', 'nvfp4', 'fp8')
    with pytest.raises(ValueError, match='nvfp4'): cx.find_crossover('b200', 'fp4x', 'fp8')
    with pytest.raises(ValueError, match='positive'): cx.find_crossover('b200', 'nvfp4', 'fp8', K=(-1,))
    with pytest.raises(ValueError, match='at least one'): cx.find_crossover('b200', 'nvfp4', 'fp8', M=())


# ---- model shapes and the per-layer analysis ---------------------------------------------------

@pytest.fixture(scope='module')
def zimage():
    return cx.model_linear_shapes('z-image', latent_grid('z-image', 1024))


def test_tokens_scale_the_rows_not_the_weights():
    a, b = cx.model_linear_shapes('z-image', (32, 32)), cx.model_linear_shapes('z-image', (64, 64))
    assert list(a.fqn) == list(b.fqn) and (a.K == b.K).all() and (a.N == b.N).all()
    img = b.fqn.str.startswith('noise_refiner.') & ~b.fqn.str.contains('adaLN')
    assert set(a[img].M) == {1024} and set(b[img].M) == {4096}


def test_text_tokens_and_batch():
    s = cx.model_linear_shapes('flux.1-dev', (16, 16), text_tokens=64, batch=2)
    ctx = s[s.fqn.str.contains(r'transformer_blocks\.\d+\.attn\.add_q_proj')]
    assert set(ctx.M) == {128}                                      # text stream: 64 tokens x batch 2
    assert len(s) == 504 and s.gflop.gt(0).all()


def test_model_shape_bad_inputs():
    with pytest.raises(ValueError, match='z-image'): cx.model_linear_shapes('sdxl', 4096)
    with pytest.raises(ValueError, match='square'): cx.model_linear_shapes('z-image', 4095)
    with pytest.raises(ValueError, match='tokens must be'): cx.model_linear_shapes('z-image', (0, 4))
    with pytest.raises(ValueError, match='text_tokens'): cx.model_linear_shapes('z-image', 64, text_tokens=0)
    with pytest.raises(ValueError, match='batch'): cx.model_linear_shapes('z-image', 64, batch=0)
    with pytest.raises(ValueError, match='nn.Module'): cx.model_linear_shapes(42, 64)
    with pytest.raises(ValueError, match='no input recipe'): cx.model_linear_shapes(torch.nn.Linear(4, 4), 4, text_tokens=4)


def test_zimage_analysis_on_the_b200(zimage):
    "Z-Image's Linears at 1024px on a B200 (compiled kernel paths): NVFP4's GEMMs ahead of fp8's; the policy follows the times."
    la = cx.analyse_layers(zimage, 'b200')
    s = cx.summarise_layers(la)
    assert s['time_s']['nvfp4'] < s['time_s']['fp8'] < s['time_s']['bf16'] and s['best_uniform'] == 'nvfp4'
    assert s['flop_share_above_nvfp4_crossover'] > 0.9
    pol = la.set_index(la.fqn.map(cx.layer_pattern)).policy
    assert (pol['layers.*.feed_forward.w2'] == 'nvfp4').all()       # the 10240 -> 3840 down projection: past the margin
    assert (la[la.M == 1].policy == 'bf16').all()                    # one-row adaLN projections: nothing beats bf16
    # the policy's pick is never slower than the fastest format by more than its margins allow
    assert (la.t_policy <= la[[f't_{x}' for x in s['time_s']]].min(axis=1) * 1.1 + 1e-12).all()
    h = cx.summarise_layers(cx.analyse_layers(zimage, 'h200'))
    assert h['best_uniform'] == 'fp8' and math.isnan(h['nvfp4_vs_fp8_total'])


def test_layer_policy_rules():
    assert cx.layer_policy(dict(bf16=10, fp8=5, nvfp4=4)) == 'nvfp4'
    assert cx.layer_policy(dict(bf16=10, fp8=5, nvfp4=4.8)) == 'fp8'     # < 10% over fp8: keep fp8 (quality)
    assert cx.layer_policy(dict(bf16=10, fp8=9.8)) == 'bf16'               # < 5% over bf16: not worth the error
    assert cx.layer_policy(dict(bf16=10, int8=6, fp8=7)) == 'int8'
    assert cx.layer_policy(dict(bf16=10)) == 'bf16'


@pytest.mark.parametrize('model', ['flux.2-dev', 'sd3.5', 'wan2.1'])
def test_other_families_build_and_run_on_meta(model):
    s = cx.model_linear_shapes(model, latent_grid(model, 512, 5) if get_model(model).video else latent_grid(model, 512))
    assert len(s) > 100 and (s.M >= 1).all()
    la = cx.analyse_layers(s, 'rtx5090')
    assert {'t_nvfp4', 'policy', 'above_crossover'} <= set(la.columns)


def test_cli_crossover():
    out = cx.cli_crossover('b200', 'z-image', 1024)
    assert 'roofline prediction, not a measurement' in out and 'layers.*.feed_forward.w2' in out
    assert 'best uniform scheme: nvfp4' in out and 'kernel paths (inductor): bf16 bf16, int8 int8_compiled_t018' in out
    full = cx.cli_crossover('b200', 'z-image', 256, group=False)
    assert 'layers.29.feed_forward.w2' in full
    h = cx.cli_crossover('h200', 'zimage', 1024)
    assert 'no fp4 tensor cores' in h and 'nvfp4_us' not in h
    for text in (out, full, h):                                       # issue 35: a terminal is 120 columns, no nan
        assert max(map(len, text.splitlines())) <= TERM_WIDTH and 'nan' not in text.lower()
    for bad, match in [(dict(gpu='v100'), 'b200'), (dict(model='sdxl'), 'z-image'), (dict(size=1000), 'multiple of 16'),
                       (dict(size='1024'), 'multiple of 16')]:
        with pytest.raises(ValueError, match=match): cx.cli_crossover(**(dict(gpu='b200', model='z-image', size=1024) | bad))


def test_crossover_fits_the_terminal_and_json_keeps_every_name():
    "The widest table (five schemes, FLUX.2's long names, one row per Linear) fits; --json has the names whole."
    import json
    from diffq_lab.cli_jobs import strict_json
    out = cx.cli_crossover('rtx5090', 'flux.2-dev', 1024, group=False)
    assert max(map(len, out.splitlines())) <= TERM_WIDTH and '~' in out and 'fp4/fp8' in out
    d = json.loads(strict_json(cx.crossover_data('rtx5090', 'flux.2-dev', 1024, group=False)))
    names = [r['layer'] for r in d['layers']]
    assert 'single_transformer_blocks.47.attn.to_qkv_mlp_proj' in names and not any('~' in n for n in names)
    assert d['summary']['best_uniform'] in out


def test_short_name_cuts_the_longest_part_first():
    assert cx.short_name('single_transformer_blocks.*.attn.to_q', 30) == 'single_transforme~.*.attn.to_q'
    assert cx.short_name('a.b', 2) == 'a~' and cx.short_name('proj_out', 40) == 'proj_out'
    assert all(len(cx.short_name('time_text_embed.timestep_embedder.linear_1', n)) <= n for n in range(40))


def test_plot_has_the_layers():
    import matplotlib
    matplotlib.use('Agg')
    s = cx.model_linear_shapes('z-image', (16, 16))
    fig = cx.plot_crossover('b200', 'nvfp4', 'fp8', cx.analyse_layers(s, 'b200'))
    ax = fig.axes[0]
    assert len(ax.collections) >= 2 and ax.get_xscale() == 'log'
    with pytest.raises(ValueError, match='no nvfp4'): cx.plot_crossover('h200', 'nvfp4', 'fp8')


def test_every_compiled_configuration_shares_the_compiler_settings():
    "The private APIs same_compiler_settings reaches into are still there, are set inside, and are all put back after."
    import torch._dynamo.config as dc
    import torch._inductor.config as ic
    before = ic.get_config_copy(), dc.recompile_limit
    with gpus.same_compiler_settings() as said:
        assert ic.coordinate_descent_tuning and ic.force_fuse_int_mm_with_mul and dc.recompile_limit >= 64
        assert 'dense included' in said
    assert ic.get_config_copy() == before[0] and dc.recompile_limit == before[1]
