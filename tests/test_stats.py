"Statistics and timing: bootstrap intervals, the inf-aware mean, paired ABBA timing and the speed verdicts."
import dataclasses, math, os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import numpy as np
import pytest
import torch

import diffq_lab.stats as S


def test_summarise_interval_and_determinism():
    v = np.random.default_rng(0).normal(5, 1, 40)
    e = S.summarise(v)
    assert e.lo < e.mean < e.hi and e.n == 40 and e.mean == pytest.approx(v.mean())
    # the percentile interval of a mean of 40 normals is about +-1.96 * sd / sqrt(n)
    assert (e.hi - e.lo) / 2 == pytest.approx(1.96 * v.std() / math.sqrt(40), rel=0.2)
    assert S.summarise(v) == e and S.summarise(v, seed=1) != e
    assert S.summarise(v, level=0.5).hi - S.summarise(v, level=0.5).lo < e.hi - e.lo
    assert S.summarise(torch.tensor(v)).mean == pytest.approx(e.mean)
    assert '95% CI, n=40' in str(e)


def test_paired_bootstrap_sign_and_pairing():
    rng = np.random.default_rng(3)
    base = rng.normal(30, 3, 16)  # PSNR per (seed, prompt): large shared variation
    a, b = base + 0.5 + rng.normal(0, 0.1, 16), base + rng.normal(0, 0.1, 16)
    d = S.paired_bootstrap(a, b)
    assert d.excludes_zero and 0.3 < d.lo < d.mean < d.hi < 0.7
    assert S.paired_bootstrap(b, a).hi < 0
    assert S.paired_bootstrap(a, a).mean == 0 and not S.paired_bootstrap(a, a).excludes_zero
    sa, sb = S.summarise(a), S.summarise(b)
    assert sa.lo < sb.hi  # unpaired intervals overlap: only the paired one resolves the 0.5 dB
    with pytest.raises(ValueError, match='paired'): S.paired_bootstrap(a, b[:3])
    with pytest.raises(ValueError, match='NaN'): S.paired_bootstrap(a, np.r_[b[:-1], np.nan])


def test_rank_schemes():
    rng = np.random.default_rng(4)
    base = rng.normal(0.95, 0.02, 12)
    vals = {'nvfp4': base - 0.02, 'fp8': base - 0.001 + rng.normal(0, 1e-4, 12), 'int8': base - 0.0011 + rng.normal(0, 1e-4, 12)}
    r = S.rank_schemes(vals)
    assert list(r.scheme) == ['fp8', 'int8', 'nvfp4'] and list(r['rank']) == [1, 2, 3]
    assert r.ahead_of_next.iloc[1] and r.next.iloc[0] == 'int8'
    lower = S.rank_schemes({k: -v for k, v in vals.items()}, higher_is_better=False)
    assert list(lower.scheme) == ['fp8', 'int8', 'nvfp4'] and bool(lower.ahead_of_next.iloc[1])
    tie = S.rank_schemes({'a': base, 'b': base})
    assert not tie.ahead_of_next.iloc[0] and tie.vs_next.iloc[0] == 0
    with pytest.raises(ValueError, match='at least one'): S.rank_schemes({})
    with pytest.raises(ValueError, match='counts differ'): S.rank_schemes({'a': [1., 2.], 'b': [1., 2., 3.]})


def test_inf_mean_counts_inf_apart():
    assert S.inf_mean([30., 32., math.inf, math.inf]) == (31.0, 2)
    assert S.inf_mean(torch.tensor([math.inf, math.inf])) == (math.inf, 2)
    assert S.inf_mean([1.5]) == (1.5, 0)
    for bad in ([math.nan], [1., -math.inf], []):
        with pytest.raises(ValueError, match='NaN|empty'): S.inf_mean(bad)


def test_summarise_allow_inf_is_the_inf_mean_convention():
    v = np.r_[np.random.default_rng(5).normal(30, 2, 10), [math.inf] * 3]
    e = S.summarise(v, allow_inf=True)
    assert (e.mean, e.n, e.n_inf) == (pytest.approx(S.inf_mean(v)[0]), 10, 3) and e.lo < e.mean < e.hi
    assert e == dataclasses.replace(S.summarise(v[np.isfinite(v)]), n_inf=3)   # the interval of the finite values
    assert '+3 inf' in str(e) and '+' not in str(S.summarise(v[:10]))
    same = S.summarise([math.inf] * 4, allow_inf=True)
    assert (same.mean, same.lo, same.hi, same.n_inf) == (math.inf, math.inf, math.inf, 4)
    with pytest.raises(ValueError, match='inf'): S.summarise(v)
    with pytest.raises(ValueError, match='level'): S.summarise([math.inf], allow_inf=True, level=2)


def test_interleaved_times_abba_and_speed_verdicts():
    order = []
    S.interleaved_times({'a': lambda: order.append('a'), 'b': lambda: order.append('b')}, rounds=3)
    assert order == ['a', 'b', 'b', 'a', 'a', 'b']
    with pytest.raises(ValueError, match='>= 1'): S.interleaved_times({'a': lambda: None}, rounds=True)
    with pytest.raises(ValueError, match='nothing'): S.interleaved_times({}, rounds=2)
    assert S.time_once(lambda: None) >= 0 and S.warm_up({'a': lambda: None}, most=2)['a'] <= 2
    base = np.full(8, 1.0) + np.random.default_rng(0).normal(0, 0.005, 8)
    assert S.speed_vs(base, base / 2)['verdict'] == 'faster' and S.speed_vs(base, base * 2)['verdict'] == 'slower'
    assert S.speed_vs(base, base / 2, emulated=True)['verdict'] == S.EMULATED_SPEED
    assert S.speed_vs(base[:3], base[:3] / 2)['verdict'].startswith('noise: 3 rounds')
