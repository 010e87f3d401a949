"""A throwaway tensor-core format, registered once, reaches the GPU spec lookup, the crossover and the speed model's
kernel paths with no other edit (in the style of tests/test_new_scheme.py); it is unregistered after."""
import pytest

from diffq_lab import crossover as cx
from diffq_lab import gpus, kernels
from diffq_lab.speed import Workload, forward_time

# a 6-bit activation-and-weight format on the fp8 tensor cores: three quarters of fp8's bytes, one cast kernel
PATH = dict(path='fp6x_any', scheme='fp6x', mode='any', torchao='any', gemm='fp6x', act_bytes=0.75, w_bytes=0.75,
            cast_kernels=1, cast_bytes=2.75, cast_bw='elementwise', amax_pass=0, epilogue_bytes=0, epilogue_kernels=0,
            dequant=0, alone_in_bytes=0, alone_out_bytes=0, alone_kernels=0, cpu_us_per_linear=0,
            source='a throwaway test format: fp6 operands on the fp8 tensor cores, bytes from its packing, no point')


@pytest.fixture
def fp6():
    f = gpus.register_format(gpus.Format('fp6x', 'fp8_tflops', paths=(PATH,)))
    yield f
    gpus.unregister_format('fp6x')


def test_the_spec_lookup_sees_it(fp6):
    assert 'fp6x' in gpus.gpu_schemes('h200') and 'fp6x' not in gpus.gpu_schemes('a100')   # Ampere: no fp8 cores
    assert gpus.format_peak(gpus.gpu_spec('h200'), 'fp6x') == gpus.format_peak(gpus.gpu_spec('h200'), 'fp8')
    with pytest.raises(ValueError, match='no fp6x tensor cores'): gpus.format_peak(gpus.gpu_spec('a100'), 'fp6x')
    with pytest.raises(ValueError, match='already registered'): gpus.register_format(fp6)


def test_the_kernel_paths_time_it(fp6):
    assert kernels.default_path('fp6x', 'inductor') == kernels.default_path('fp6x', 'none') == 'fp6x_any'
    assert kernels.arch_efficiency('h200')['fp6x'] == kernels.arch_efficiency('h200')['fp8']   # `Format.rate`
    t6, t8 = (float(kernels.linear_time('h200', 1, 8192, 8192, p)) for p in ('fp6x_any', 'fp8_compiled'))
    assert t6 < t8                                               # one token: the weight's bytes decide, 0.75 of fp8's


def test_the_crossover_compares_it(fp6):
    r = cx.roofline('h200', (4096, 3840, 10240), 'fp6x')
    assert r['path'] == 'fp6x_any' and r['time_s'] == pytest.approx(sum(r['passes'].values()))
    la = cx.analyse_layers(cx.model_linear_shapes('z-image', (16, 16)), 'h200')
    assert 't_fp6x' in la and la.attrs['schemes'][-1] == 'fp6x'
    assert cx.find_crossover('h200', 'fp6x', 'fp8', M=(64, 4096), K=(3840,), N=(3840,)).surface.t_a.gt(0).all()


def test_the_speed_model_runs_its_path(fp6):
    w = Workload(steps=8)
    f6 = forward_time('h200', 'z-image', 'fp8', w, path='fp6x_any')
    f8 = forward_time('h200', 'z-image', 'fp8', w)
    assert f6['path'] == 'fp6x_any' and f6['quantised_linears'] == f8['quantised_linears'] and f6['linear_s'] != f8['linear_s']


def test_unregistered_it_is_gone():
    gpus.register_format(gpus.Format('fp6x', 'fp8_tflops', paths=(PATH,)))
    gpus.unregister_format('fp6x')
    assert 'fp6x' not in gpus.gpu_schemes('h200')
    with pytest.raises(ValueError, match='no kernel path'): kernels.default_path('fp6x', 'inductor')
    with pytest.raises(ValueError, match='choose one of bf16'): gpus.get_format('fp6x')
