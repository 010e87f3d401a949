"""A new metric is its registry entry: registered here, it reaches `quality_metrics`, the study's rows and report columns,
the bench's columns and the comparison captions with no other edit."""
import os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from diffq_lab.quality import METRICS, Metric, get_metric, quality_metrics, register_metric, unregister_metric

NAME = 'mae_twin'


def _mae(x, y, data_range=1.0, per_frame=False, **_):
    "Mean absolute difference, a throwaway distance."
    d = (x - y).abs().mean(dim=(1, 2, 3)) / data_range
    return d if per_frame else d.mean().item()


@pytest.fixture(scope='module')
def mae():
    m = register_metric(Metric(NAME, _mae, higher_is_better=False, fmt='.3f', caption='MAE'))
    yield m
    unregister_metric(NAME)


def test_measured_with_every_render(mae):
    x, y = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0)), torch.zeros(3, 16, 16)
    q = quality_metrics(x, y, with_lpips=False, with_st_lpips=False)
    assert q[NAME] == pytest.approx(float(x.double().mean())) and list(q)[-1] == NAME  # after the built-in ones
    assert NAME not in quality_metrics(x, y, metrics=['psnr'])  # measured only when asked, once names are given


def test_the_study_row_and_its_report_columns_carry_it(mae):
    from diffq_lab.report import study_cols
    from diffq_lab.study import STUDY_PROMPTS, run_study
    assert NAME in study_cols() and study_cols().index(NAME) < study_cols().index('fallback_reason')
    st = run_study(schemes=['int8wo'], seeds=(0,), prompts=STUDY_PROMPTS[:1], device='cpu', progress=False,
                   control=False, parts=('transformer',))
    row = st.set_index('requested').loc['int8wo']
    shown, ref = st.attrs['renders']['int8wo'], st.attrs['reference']
    assert row.status == 'ok' and row[NAME] == pytest.approx(_mae(shown.double()[None], ref.double()[None]))


def test_the_bench_and_the_captions_show_it(mae):
    from diffq_lab.bench import bench_cols
    from diffq_lab.compare import compare_html, metric_caption
    assert NAME in bench_cols()
    assert metric_caption({'psnr': 40.0, NAME: 0.01234}) == 'PSNR 40.00 dB · MAE 0.012'
    assert metric_caption({NAME: 0.5, 'other': 2}) == 'MAE 0.500 · other 2'  # a metric before any unregistered number
    img = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(1))
    assert 'MAE 0.000' in compare_html({'same': img}, img)  # measured where not given


def test_unregistering_takes_it_away():
    register_metric(Metric('gone_twin', _mae, higher_is_better=False))
    unregister_metric('gone_twin')
    assert 'gone_twin' not in METRICS
    with pytest.raises(ValueError, match="choose one of .*'psnr'"): get_metric('gone_twin')
    with pytest.raises(ValueError, match='choose one of'): unregister_metric('gone_twin')
    with pytest.raises(TypeError, match='Metric'): register_metric('psnr')
