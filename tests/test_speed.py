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
