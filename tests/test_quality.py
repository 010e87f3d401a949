"Quality metrics: SSIM against an independent implementation, exact PSNR, LPIPS availability paths, bootstrap statistics, the recorded pairs."
import importlib.util, math, os, sys, types
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import numpy as np
import pytest
import torch

import diffq_lab.quality as Q
from diffq_lab.core import load_table
from diffq_lab.lab import QUALITY_PROMPTS, quality_pairs, record_quality

G = torch.Generator().manual_seed(0)


def smooth_image(c=3, h=32, w=32, seed=0):
    "A render-like image: smooth structure plus fine texture, in [0, 1]."
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing='ij')
    base = torch.stack([torch.sin(6 * xx + k) * torch.cos(4 * yy - k) for k in range(c)]) * 0.35 + 0.5
    return (base + 0.08 * torch.randn(c, h, w, generator=g)).clamp(0, 1).double()


def ssim_reference(x: np.ndarray, y: np.ndarray, data_range=1.0) -> float:
    "SSIM as skimage computes it (gaussian_weights=True, sigma=1.5, use_sample_covariance=False), with scipy: per channel, cropped, averaged."
    nd = pytest.importorskip('scipy.ndimage')
    c1, c2, pad = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2, 5
    out = []
    for a, b in zip(x, y):  # channels
        f = lambda t: nd.gaussian_filter(t, sigma=1.5, truncate=3.5)  # radius int(3.5*1.5+0.5) = 5: an 11x11 window
        ux, uy = f(a), f(b)
        vx, vy, vxy = f(a * a) - ux * ux, f(b * b) - uy * uy, f(a * b) - ux * uy
        s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux ** 2 + uy ** 2 + c1) * (vx + vy + c2))
        out.append(s[pad:-pad, pad:-pad].mean())
    return float(np.mean(out))


# ---- SSIM ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('shape,noise', [((3, 32, 32), 0.05), ((3, 24, 40), 0.2), ((1, 16, 16), 0.1), ((3, 11, 11), 0.3)])
def test_ssim_matches_independent_reference(shape, noise):
    x = smooth_image(*shape)
    y = (x + noise * torch.randn(shape, generator=G, dtype=torch.float64)).clamp(0, 1)
    assert Q.ssim(y, x) == pytest.approx(ssim_reference(y.numpy(), x.numpy()), abs=1e-10)


def test_ssim_data_range_scales():
    x = smooth_image(); y = (x + 0.1 * torch.randn(x.shape, generator=G, dtype=torch.float64)).clamp(0, 1)
    assert Q.ssim(255 * y, 255 * x, data_range=255) == pytest.approx(Q.ssim(y, x), abs=1e-12)
    assert Q.ssim((255 * y).round().to(torch.uint8), (255 * x).round().to(torch.uint8), data_range=255) == pytest.approx(
        ssim_reference((255 * y).round().numpy(), (255 * x).round().numpy(), 255), abs=1e-10)


def test_ssim_properties():
    x = smooth_image()
    assert Q.ssim(x, x) == pytest.approx(1.0, abs=1e-12)
    n = torch.randn(x.shape, generator=G, dtype=torch.float64)
    s = [Q.ssim((x + k * n).clamp(0, 1), x) for k in (0.005, 0.02, 0.05, 0.1, 0.2, 0.4)]
    assert all(a > b for a, b in zip(s, s[1:])), s  # strictly falls as noise grows
    assert all(v <= 1 for v in s)
    y = (x + 0.1 * n).clamp(0, 1)
    assert Q.ssim(x, y) == pytest.approx(Q.ssim(y, x), abs=1e-12)
    # inverting an image is the worst kind of structure: negative correlation gives SSIM below 0
    assert Q.ssim(1 - x, x) < 0
    # a constant shift keeps the structure term at 1: SSIM only pays the luminance term
    m = Q.ssim_map((x * 0.5 + 0.25) + 0.1, x * 0.5 + 0.25)
    assert 0.9 < m.min() and m.max() < 1


def test_ssim_constant_images_analytic():
    c1 = 1e-4
    for a, b in [(0.0, 0.0), (0.3, 0.6), (1.0, 0.0), (0.25, 0.75)]:
        x, y = torch.full((2, 3, 12, 12), a, dtype=torch.float64), torch.full((2, 3, 12, 12), b, dtype=torch.float64)
        assert Q.ssim(x, y) == pytest.approx((2 * a * b + c1) / (a * a + b * b + c1), abs=1e-12)


def test_video_frames_are_scored_separately():
    x = smooth_image()
    frames = torch.stack([(x + k * 0.05 * torch.randn(x.shape, generator=G, dtype=torch.float64)).clamp(0, 1) for k in range(4)])
    ref = torch.stack([x] * 4)
    per = Q.ssim(frames, ref, per_frame=True)
    assert per.shape == (4,) and per[0] == pytest.approx(1.0)
    assert [round(v, 12) for v in per.tolist()] == [round(Q.ssim(f, x), 12) for f in frames]
    assert Q.ssim(frames, ref) == pytest.approx(per.mean().item())
    p = Q.psnr(frames[1:], ref[1:], per_frame=True)
    assert Q.psnr(frames[1:], ref[1:]) == pytest.approx(p.mean().item())


# ---- PSNR ---------------------------------------------------------------------------------------------------------

def test_psnr_exact_for_known_mse():
    ref = torch.zeros(3, 8, 8, dtype=torch.float64)
    for mse in (1e-1, 1e-2, 1e-4, 2.5e-3):
        img = ref + math.sqrt(mse)
        assert Q.psnr(img, ref) == pytest.approx(10 * math.log10(1 / mse), abs=1e-9)
    # half the pixels off by 0.2: MSE 0.02
    img = ref.clone(); img[:, :4] = 0.2
    assert Q.psnr(img, ref) == pytest.approx(10 * math.log10(1 / 0.02), abs=1e-9)
    assert Q.psnr(ref, ref) == math.inf
    x = smooth_image(); y = (x + 0.05 * torch.randn(x.shape, generator=G, dtype=torch.float64)).clamp(0, 1)
    mse = ((x - y) ** 2).mean().item()
    assert Q.psnr(y, x) == pytest.approx(10 * math.log10(1 / mse), abs=1e-9)
    assert Q.psnr(y.float(), x.float()) == pytest.approx(Q.psnr(y, x), abs=1e-4)  # float32 input is promoted


@pytest.mark.parametrize('fn', [Q.psnr, Q.ssim, Q.quality_metrics])
def test_metrics_reject_bad_input(fn):
    x = smooth_image()
    with pytest.raises(ValueError, match='differ in shape'): fn(x, x[:, :16])
    with pytest.raises(ValueError, match='data_range'): fn(x * 3, x)
    with pytest.raises(ValueError, match=r'\(F,C,H,W\)'): fn(x[None, None], x[None, None])
    with pytest.raises(ValueError, match='empty'): fn(torch.zeros(0, 3, 16, 16), torch.zeros(0, 3, 16, 16))


def test_psnr_ssim_refuse_nan_but_quality_metrics_reports_it():
    x = smooth_image(); bad = x.clone(); bad[0, 0, 0] = float('nan')
    with pytest.raises(ValueError, match='NaN'): Q.psnr(bad, x)
    with pytest.raises(ValueError, match='NaN'): Q.ssim(bad, x)
    m = Q.quality_metrics(bad, x)
    assert m['finite'] is False and math.isnan(m['psnr']) and math.isnan(m['ssim']) and 'lpips' not in m


# ---- hidden-state cosine ------------------------------------------------------------------------------------------

def test_hidden_cosine_is_the_text_encoder_one():
    from diffq_lab.text_encoder import embedding_cosine
    d = torch.randn(2, 9, 32, generator=G); q = d + 0.3 * torch.randn(2, 9, 32, generator=G)
    assert Q.hidden_cosine(d, q) == embedding_cosine([d], [q])
    z = d.clone(); z[0, 0] = 0  # an all-zero dense token carries no direction and is skipped
    assert Q.hidden_cosine(z, q)['cosine'] != Q.hidden_cosine(d, q)['cosine']
    assert 'embedding_cosine' in Q.hidden_cosine.__code__.co_names  # delegates; no second implementation


# ---- LPIPS --------------------------------------------------------------------------------------------------------

def test_lpips_unavailable_here_says_why():
    try:
        import lpips  # noqa: F401
        pytest.skip('lpips imports on this machine')
    except Exception: pass
    ok, why = Q.lpips_available()
    assert not ok and 'does not import' in why and 'torchvision' in why
    with pytest.raises(Q.MetricUnavailable, match='LPIPS unavailable: the lpips package does not import'):
        Q.lpips_distance(smooth_image(), smooth_image())
    m = Q.quality_metrics(smooth_image(), smooth_image(seed=1))
    assert 'lpips' not in m and 'does not import' in m['lpips_unavailable']
    assert isinstance(Q.MetricUnavailable('x'), RuntimeError)


def test_lpips_import_failure_of_torchvision_is_reported(monkeypatch, tmp_path):
    "lpips that installed but dies importing torchvision (what PyPI torchvision does beside CPU torch 2.13)."
    (tmp_path/'lpips').mkdir()
    (tmp_path/'lpips'/'__init__.py').write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, 'lpips', raising=False)
    ok, why = Q.lpips_available('vgg')
    assert not ok and 'RuntimeError: operator torchvision::nms does not exist' in why
    with pytest.raises(Q.MetricUnavailable, match='torchvision::nms'): Q.lpips_distance(smooth_image(), smooth_image(), net='vgg')


def _stub_lpips(tmp_path, heads=True):
    "A stand-in `lpips` package, only to exercise the plumbing: it records what the model is given."
    pkg = tmp_path/'lpips'; (pkg/'weights'/'v0.1').mkdir(parents=True)
    if heads: (pkg/'weights'/'v0.1'/'alex.pth').write_bytes(b'')
    seen = []
    class LPIPS(torch.nn.Module):
        def __init__(self, net='alex', verbose=True): super().__init__(); self.net = net
        def forward(self, a, b):
            seen.append((a.min().item(), a.max().item(), tuple(a.shape)))
            return (a - b).abs().mean(dim=(1, 2, 3), keepdim=True)
    mod = types.ModuleType('lpips'); mod.__file__ = str(pkg/'__init__.py'); mod.LPIPS = LPIPS
    return mod, seen


def test_lpips_paths_with_a_stub(monkeypatch, tmp_path):
    mod, seen = _stub_lpips(tmp_path, heads=False)
    monkeypatch.setitem(sys.modules, 'lpips', mod)
    ok, why = Q.lpips_available()
    assert not ok and 'linear heads' in why
    mod, seen = _stub_lpips(tmp_path/'2')
    monkeypatch.setitem(sys.modules, 'lpips', mod)
    trunk = tmp_path/'hub'/'checkpoints'/'alexnet-owt-7be5be79.pth'
    monkeypatch.setattr(Q, '_lpips_trunk_checkpoint', lambda net: trunk)
    ok, why = Q.lpips_available()
    assert not ok and 'not in the torch hub cache' in why and 'internet' in why
    assert Q.lpips_available(allow_download=True)[0]
    trunk.parent.mkdir(parents=True); trunk.write_bytes(b'')
    Q._lpips_model.cache_clear()
    try:
        assert Q.lpips_available() == (True, f'lpips None, alex trunk at {trunk}')
        x = torch.zeros(2, 3, 16, 16); y = torch.ones(2, 3, 16, 16); y[1] = 0
        assert Q.lpips_distance(x, y, device='cpu', per_frame=True).tolist() == [2.0, 0.0]  # inputs mapped to [-1, 1]
        assert seen[-1] == (-1.0, -1.0, (2, 3, 16, 16))
        assert Q.lpips_distance(x, y, device='cpu') == 1.0
        with pytest.raises(ValueError, match='RGB'): Q.lpips_distance(x[:, :1], y[:, :1], device='cpu')
        m = Q.quality_metrics(x[0], y[0])
        assert m['lpips'] == 2.0 and 'lpips_unavailable' not in m
    finally: Q._lpips_model.cache_clear()


def test_lpips_trunk_location_follows_torchvision():
    "Notices when torchvision renames the weights enums lpips' trunks come from (runs where torchvision imports)."
    try: import torchvision.models  # noqa: F401
    except Exception as e: pytest.skip(f'torchvision does not import here: {type(e).__name__}')
    assert Q._lpips_trunk_checkpoint('alex').name.startswith('alexnet-')
    assert Q._lpips_trunk_checkpoint('vgg').name.startswith('vgg16-')


# ---- statistics: moved to 00a_stats, still importable from quality ------------------------------------------

# ---- the measured pairs -------------------------------------------------------------------------------------------

def test_record_quality_into_tmp_root(tmp_path):
    t = record_quality(root=tmp_path, schemes=('fp8wo', 'nvfp4wo'), seeds=(0, 1), prompts=QUALITY_PROMPTS[:1])
    assert len(t) == 4 and set(t.scheme) == {'fp8wo', 'nvfp4wo'} and t.finite.all()
    assert ((t.ssim > 0.9) & (t.ssim < 1)).all() and (t.psnr > 20).all()
    assert t[t.scheme == 'fp8wo'].ssim.mean() > t[t.scheme == 'nvfp4wo'].ssim.mean()  # 8 bits beat 4
    stored = load_table('quality_pairs', tmp_path)
    assert len(stored) == 4 and {'device_name', 'torch', 'run', 'psnr', 'ssim', 'cosine'} <= set(stored.columns)
    assert ('lpips' in stored) != ('lpips_unavailable' in stored)  # a score or the reason, never both, never neither


def test_quality_pairs_records_a_failing_scheme(monkeypatch):
    import diffq_lab.export as ex  # quality_pairs imports it from there when it runs
    real = ex.quantize_text_encoders
    def flaky(pipe, scheme, **kw):
        if scheme == 'mxfp8': raise RuntimeError('kernel exploded')
        return real(pipe, scheme, **kw)
    monkeypatch.setattr(ex, 'quantize_text_encoders', flaky)
    t = quality_pairs(schemes=('mxfp8', 'fp8wo'), seeds=(0,), prompts=QUALITY_PROMPTS[:1])
    assert list(t.requested) == ['mxfp8', 'fp8wo'] and list(t.status) == ['failed', 'ok']
    assert t.scheme.iloc[1] == 'fp8wo'  # keyed by what ran, read from the applied plan
    assert t.error.iloc[0] == 'RuntimeError: kernel exploded' and math.isnan(t.ssim.iloc[0]) and t.ssim.iloc[1] > 0.9


def test_quality_pairs_bad_input():
    with pytest.raises(ValueError, match='fp8'): quality_pairs(schemes=('fp7',))
    with pytest.raises(ValueError, match='at least one seed'): quality_pairs(schemes=('fp8wo',), seeds=())


# ---- ST-LPIPS -----------------------------------------------------------------------------------------------------

HAVE_STLPIPS = importlib.util.find_spec('stlpips_pytorch') is not None


def _package_stlpips(monkeypatch):
    "The package's own ST-LPIPS module, imported with its unused imports (torchvision, IPython, torchsummary) stubbed."
    for name in ('torchvision', 'torchvision.models', 'IPython', 'torchsummary'):
        stub = types.ModuleType(name)
        stub.models, stub.embed, stub.summary = stub, (lambda *a, **k: None), (lambda *a, **k: None)
        monkeypatch.setitem(sys.modules, name, stub)
    for name in [n for n in sys.modules if n.startswith('stlpips_pytorch')]: monkeypatch.delitem(sys.modules, name)
    from stlpips_pytorch import stlpips
    return stlpips


@pytest.mark.skipif(not HAVE_STLPIPS, reason='stlpips-pytorch is not installed (pip install --no-deps stlpips-pytorch)')
@pytest.mark.parametrize('net', Q.ST_LPIPS_NETS)
def test_st_lpips_equals_the_package_network(monkeypatch, net):
    S = _package_stlpips(monkeypatch)
    theirs = S.LPIPS(net=net, variant='shift_tolerant', verbose=False)
    g = torch.Generator().manual_seed(11)
    for shape in ((2, 3, 40, 56), (1, 3, 33, 29)):
        a = torch.rand(shape, generator=g)
        for b in (torch.rand(shape, generator=g), (a + 0.04 * torch.randn(shape, generator=g)).clamp(0, 1),
                  torch.roll(a, 2, dims=-1), smooth_image(3, *shape[-2:], seed=3).float().expand(shape)):
            with torch.no_grad(): want = theirs(a, b, normalize=True).flatten().double()
            got = Q.st_lpips(a, b, net=net, device='cpu', per_frame=True)
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (net, shape, got, want)
    assert Q.st_lpips(a, a, net=net) == 0.0


def test_st_lpips_unavailable_says_why(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'stlpips_pytorch' else real(name, *a))
    Q._st_lpips_model.cache_clear()
    with pytest.raises(Q.MetricUnavailable, match='pip install --no-deps stlpips-pytorch'): Q.st_lpips(smooth_image(), smooth_image())
    m = Q.quality_metrics(smooth_image(seed=1), smooth_image(), with_lpips=False)
    assert 'st_lpips' not in m and 'stlpips-pytorch' in m['st_lpips_unavailable'] and m['psnr'] > 0
    Q._st_lpips_model.cache_clear()
    with pytest.raises(ValueError, match="choose one of \\('alex', 'vgg'\\)"): Q.st_lpips_weights('squeeze')
    assert 'RGB' in Q.quality_metrics(smooth_image(1), smooth_image(1), with_lpips=False)['st_lpips_unavailable']
