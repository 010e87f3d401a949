"""Hermetic test session: offline hub, a probe cache of its own (never the user's ~/.cache/diffq_lab), one torch thread,
and every test's random draws seeded (`$DIFFQ_LAB_SEED`, default 0; tools/seed_sweep.py sweeps it)."""
import os, random, sys, tempfile
from pathlib import Path
import numpy as np
import pytest
import torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ['DIFFQ_LAB_CACHE'] = tempfile.mkdtemp(prefix='diffq_lab_test_cache_')
# The real encoders (SmolLM2, Gemma3) are the one thing shared with the user's cache: each is a deterministic build of
# an installed wheel (about a minute of CPU), checked against its sha256 manifest on every load, so a session reuses
# what nbdev_test or an earlier session built instead of building it again; the probes stay this session's own.
_SHARED = Path(os.environ.get('XDG_CACHE_HOME') or Path.home()/'.cache')/'diffq_lab'/'encoders'
_SHARED.mkdir(parents=True, exist_ok=True)
(Path(os.environ['DIFFQ_LAB_CACHE'])/'encoders').symlink_to(_SHARED, target_is_directory=True)

SEED = int(os.environ.get('DIFFQ_LAB_SEED', '0'))  # seed 0 is the suite's; a sweep runs it under others
_TESTS = str(Path(__file__).resolve().parent)
_REAL = dict(torch=torch.manual_seed, random=random.seed, numpy=np.random.seed, rng=np.random.default_rng)


def _offset(real):
    "`real(seed)`, with `seed + SEED` when a test in tests/ sets the seed itself: a sweep varies those draws too."
    def seed(s=None, *args, **kwargs):
        mine = sys._getframe(1).f_code.co_filename.startswith(_TESTS)
        return real(s + SEED if mine and isinstance(s, int) and not isinstance(s, bool) else s, *args, **kwargs)
    return seed


if SEED:  # only under a sweep: the suite itself runs with torch's, numpy's and random's own functions
    torch.manual_seed, random.seed = _offset(_REAL['torch']), _offset(_REAL['random'])
    np.random.seed, np.random.default_rng = _offset(_REAL['numpy']), _offset(_REAL['rng'])


@pytest.fixture(autouse=True)
def seeded():
    "Every test starts from the same generator states (seed `SEED`): its draws are reproducible, never the order's luck."
    _REAL['torch'](SEED); _REAL['random'](SEED); _REAL['numpy'](SEED % 2**32)
    yield

@pytest.fixture(scope='session')
def pipes():
    "Every tiny family's pipeline, built once for the session: tests that change one work on a copy (or put it back)."
    from diffq_lab.pipelines import TINY_FAMILIES, tiny_pipeline
    return {f: tiny_pipeline(f) for f in TINY_FAMILIES}


@pytest.fixture(scope='session')
def dense_images(pipes):
    "One-step dense renders of `pipes`."
    from diffq_lab.pipelines import render
    return {f: render(p, steps=1) for f, p in pipes.items()}


@pytest.fixture(autouse=True, scope='session')
def one_thread():
    "Tiny models run 10-70x slower when torch's threads contend for a busy 2-core machine's cores."
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------- fault injection at the library level
class FaultRecord:
    "What an armed fault saw: conversions counted so far, the module it fired on, the state captured when it fired."
    def __init__(self, k):
        self.k, self.calls, self.fired_on, self.at_fault = k, 0, None, None
    @property
    def fired(self) -> bool: return self.fired_on is not None


@pytest.fixture
def fail_at_kth_linear(monkeypatch):
    """Arm a fault: the `k`-th Linear conversion that `backend`'s real library makes raises `exc`.

    `arm(scheme, backend, k, exc=None, within=None, when='before', on_fault=None, persist=False) -> FaultRecord`
    - backend 'torchao': wraps torchao's handler of the scheme's config type in `_QUANTIZE_CONFIG_HANDLER`
      (what `quantize_` calls once per selected Linear); 'emulate': wraps `EmulatedLinear.from_linear`;
      'diffusers' (fp8_layerwise): wraps `diffusers.hooks.apply_layerwise_casting_hook`.
      A tuple of backends wraps each with ONE counter: k counts across libraries in call order (e.g. a loader whose
      encoders go through diffusers and whose transformer goes through torchao).
    - `persist=False`: the fault fires once, at the k-th call, and later calls (a second apply) pass. `persist=True`: the
      Linear it fired on fails again at every later conversion of it (a Linear the library cannot convert).
    - `within`: modules whose Linears count (others, e.g. a smoke probe's, pass through uncounted); None: all.
    - `when='after'`: the k-th conversion is made first, then the fault fires (a conversion that dies half-way).
    - `on_fault(record)`: called just before raising, e.g. to capture how many Linears were converted by then.
    Any entry point that converts Linears (text encoders, transformer, pipeline loaders) can be checked with it."""
    def arm(scheme, backend, k, exc=None, within=None, when='before', on_fault=None, persist=False) -> FaultRecord:
        from diffq_lab.schemes import get_scheme
        assert when in ('before', 'after') and k >= 1
        rec = FaultRecord(k)
        ids = None if within is None else {id(m) for root in within for m in root.modules()}
        libs = backend if isinstance(backend, str) else '+'.join(dict.fromkeys(backend))

        def step(module, convert):
            if ids is not None and id(module) not in ids: return convert()
            rec.calls += 1
            if rec.calls != k and not (persist and module is rec.fired_on): return convert()
            out = convert() if when == 'after' else None
            rec.fired_on = module
            if on_fault is not None: rec.at_fault = on_fault(rec)
            raise exc if exc is not None else RuntimeError(f'injected fault at Linear #{k} ({libs})')

        s = get_scheme(scheme)
        for b in dict.fromkeys((backend,) if isinstance(backend, str) else backend): wrap(b, s, step)
        return rec

    def wrap(backend, s, step):
        if backend == 'torchao':
            from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER
            cfg_type = type(s.make_config())
            real = _QUANTIZE_CONFIG_HANDLER[cfg_type]
            def handler(module, *args, **kwargs): return step(module, lambda: real(module, *args, **kwargs))
            monkeypatch.setitem(_QUANTIZE_CONFIG_HANDLER, cfg_type, handler)
        elif backend == 'emulate':
            from diffq_lab.emulate import EmulatedLinear
            real = EmulatedLinear.from_linear.__func__
            def from_linear(cls, linear, *args, **kwargs): return step(linear, lambda: real(cls, linear, *args, **kwargs))
            monkeypatch.setattr(EmulatedLinear, 'from_linear', classmethod(from_linear))
        elif backend == 'diffusers':
            import diffusers.hooks
            real = diffusers.hooks.apply_layerwise_casting_hook
            def hook(module, *args, **kwargs): return step(module, lambda: real(module, *args, **kwargs))
            monkeypatch.setattr(diffusers.hooks, 'apply_layerwise_casting_hook', hook)
        else: raise ValueError(f'unknown backend {backend!r}')
    return arm
