"Render comparisons: the widget driven headless, the static PNG grid and HTML, clips, bad input."
import base64, html, io, math, os, re
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import matplotlib.image as mpimg
import numpy as np
import pytest
import torch

import diffq_lab.compare as C
from diffq_lab.quality import quality_metrics

G = torch.Generator().manual_seed(0)
REF = torch.rand(3, 24, 24, generator=G)
RENDERS = {'int8': (REF + 0.01 * torch.randn(3, 24, 24, generator=G)).clamp(0, 1),
           'fp8': (REF + 0.03 * torch.randn(3, 24, 24, generator=G)).clamp(0, 1),
           'nvfp4': (REF + 0.10 * torch.randn(3, 24, 24, generator=G)).clamp(0, 1)}


def decode(png: bytes) -> np.ndarray:
    return mpimg.imread(io.BytesIO(bytes(png)))


# ---- the widget ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('control', ['toggle', 'slider'])
def test_widget_follows_the_selector(control):
    v = C.compare_widget(RENDERS, REF, control=control)
    assert list(v.selector.options) == list(RENDERS) and v.selector.value == 'int8'
    shown = {}
    for name in RENDERS:
        v.selector.value = name  # what clicking the toggle / dragging the slider does
        img, heat, cap = bytes(v.image.value), bytes(v.heat.value), v.caption.value
        assert img == C.png_bytes(C.image_array(RENDERS[name]))
        assert heat == C.png_bytes(C.diff_heatmap(RENDERS[name], REF, 8.0))
        assert f'<b>{name}</b>' in cap and html.escape(C.metric_caption(quality_metrics(RENDERS[name], REF))) in cap
        shown[name] = (img, heat, cap)
    assert len({s[0] for s in shown.values()}) == 3 and len({s[1] for s in shown.values()}) == 3
    assert len({s[2] for s in shown.values()}) == 3
    assert bytes(v.ref_image.value) == C.png_bytes(C.image_array(REF))  # the reference never changes with the scheme


def test_widget_heatmap_brightens_with_noise_and_gain():
    v = C.compare_widget(RENDERS, REF)
    brightness = {}
    for name in RENDERS:
        v.selector.value = name
        brightness[name] = decode(v.heat.value)[..., :3].mean()
    assert brightness['int8'] < brightness['fp8'] < brightness['nvfp4']
    v.selector.value = 'int8'
    low = decode(v.heat.value)[..., :3].mean()
    v.gain.value = 64
    assert decode(v.heat.value)[..., :3].mean() > low and '× 64' in v.heat_caption.value


def test_widget_metrics_given_and_lpips_reason_in_tooltip():
    mets = {'int8': dict(psnr=40.0, ssim=0.99, lpips_unavailable='no "lpips" here', latency_ms=12.0)}
    v = C.compare_widget(RENDERS, REF, metrics=mets)
    assert 'PSNR 40.00 dB' in v.caption.value and 'latency_ms 12' in v.caption.value and 'LPIPS n/a' in v.caption.value
    assert 'title="no &quot;lpips&quot; here"' in v.caption.value
    v.selector.value = 'fp8'  # no metrics given: measured
    assert 'PSNR 40.00' not in v.caption.value and 'SSIM 0.9' in v.caption.value


def test_widget_on_a_clip_has_a_frame_slider():
    clip_ref = torch.rand(5, 3, 16, 16, generator=G)
    clips = {'a': (clip_ref + 0.05).clamp(0, 1), 'b': (clip_ref * 0.9).clamp(0, 1)}
    v = C.compare_widget(clips, clip_ref)
    assert v.frame is not None and v.frame.max == 4
    before = (bytes(v.image.value), bytes(v.ref_image.value))
    v.frame.value = 3
    assert bytes(v.image.value) == C.png_bytes(C.image_array(clips['a'][3]))
    assert bytes(v.ref_image.value) == C.png_bytes(C.image_array(clip_ref[3]))
    assert (bytes(v.image.value), bytes(v.ref_image.value)) != before
    v.selector.value = 'b'  # keeps the frame
    assert bytes(v.image.value) == C.png_bytes(C.image_array(clips['b'][3]))
    assert C.compare_widget(RENDERS, REF).frame is None


def test_widget_displays_as_its_box():
    v = C.compare_widget(RENDERS, REF)
    bundle = v._repr_mimebundle_()
    assert 'application/vnd.jupyter.widget-view+json' in bundle
    assert bundle['application/vnd.jupyter.widget-view+json']['model_id'] == v.box.model_id


# ---- static fallback ----------------------------------------------------------------------------------------------

def test_grid_png_writes_and_changes_with_input(tmp_path):
    png = C.compare_grid_png(RENDERS, REF, path=tmp_path/'a'/'grid.png')
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and (tmp_path/'a'/'grid.png').read_bytes() == png
    assert [p.name for p in (tmp_path/'a').iterdir()] == ['grid.png']  # no temp file left
    h, w = decode(png).shape[:2]
    assert w > 1.5 * h  # four columns, two rows
    fewer = C.compare_grid_png({'int8': RENDERS['int8']}, REF)
    assert decode(fewer).shape[1] < w
    assert C.compare_grid_png(RENDERS, REF) == png  # deterministic
    assert C.compare_grid_png(RENDERS, REF, gain=32) != png


def test_figure_captions_carry_the_metrics():
    mets = {k: dict(psnr=30.0 + i, ssim=0.9) for i, k in enumerate(RENDERS)}
    fig = C.compare_figure(RENDERS, REF, mets, title='T')
    labels = [ax.get_xlabel() for ax in fig.axes]
    for i, k in enumerate(RENDERS): assert f'PSNR {30 + i:.2f} dB\nSSIM 0.9000' in labels
    assert fig._suptitle.get_text() == 'T'
    titles = [ax.get_title() for ax in fig.axes]
    assert {'dense', *RENDERS} <= set(titles) and '|nvfp4 − dense| × 8' in titles


def test_html_has_every_image_and_the_metrics_table():
    page = C.compare_html(RENDERS, REF, title='run <1>')
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(imgs) == 1 + 2 * len(RENDERS)
    assert base64.b64decode(imgs[1]) == C.png_bytes(C.image_array(RENDERS['int8']), min_height=1)
    assert 'run &lt;1&gt;' in page and '<th>psnr</th>' in page and '<th>ssim</th>' in page
    rows = re.findall(r'<tr>\s*<td>(\w+)</td>', page)
    assert rows == list(RENDERS)
    if 'lpips' not in quality_metrics(RENDERS['int8'], REF): assert page.count('LPIPS not measured') == 1  # one footnote, not per scheme


def test_clip_strip_in_static_outputs():
    clip_ref = torch.rand(8, 3, 16, 16, generator=G)
    clips = {'a': (clip_ref + 0.05).clamp(0, 1)}
    assert C.image_array(clip_ref).shape == (16, 4 * 16 + 3 * 2, 3)
    assert C.image_array(clip_ref, max_frames=8).shape == (16, 8 * 16 + 7 * 2, 3)
    assert C.diff_heatmap(clips['a'], clip_ref, max_frames=2).shape == (16, 2 * 16 + 2, 3)
    page = C.compare_html(clips, clip_ref, max_frames=3)
    assert page.count('data:image/png') == 3


def test_nan_render_is_shown_not_hidden():
    bad = RENDERS['fp8'].clone(); bad[:, :4] = float('nan')
    page = C.compare_html({'bad': bad}, REF)
    assert 'NaN/inf in render' in page
    heat = C.diff_heatmap(bad, REF)
    top = np.array(C.matplotlib.colormaps['inferno'](1.0)[:3]) * 255
    assert (heat[0, 0] == top.round()).all()  # NaN pixels at full scale in the heat-map
    assert (C.image_array(bad)[0, 0] == 0).all()


# ---- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('fn', [C.compare_widget, C.compare_grid_png, C.compare_html, C.compare_figure])
def test_bad_input(fn):
    with pytest.raises(ValueError, match='non-empty dict'): fn({}, REF)
    with pytest.raises(ValueError, match='same size'): fn({'a': REF[:, :8]}, REF)
    with pytest.raises(ValueError, match=r"without a render: \['zz'\]"): fn(RENDERS, REF, {'zz': {}})
    with pytest.raises(ValueError, match='positive'): fn(RENDERS, REF, gain=0)
    with pytest.raises(ValueError, match='colormap'): fn(RENDERS, REF, cmap='no-such-map')
    with pytest.raises(ValueError, match='outside'): fn({'a': REF * 2}, REF)
    with pytest.raises(ValueError, match='NaN'): fn(RENDERS, REF * float('nan'))  # a broken reference is refused


def test_bad_control():
    with pytest.raises(ValueError, match="'toggle', 'slider'"): C.compare_widget(RENDERS, REF, control='knob')
