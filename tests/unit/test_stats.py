"""lab.stats on seeded synthetic data: exact values, edge cases, and coverage of the bootstrap CI."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from scipy import stats as sst

from lab import stats

# Any numpy/scipy warning (NaN, degenerate data, division by zero) is a failure here.
pytestmark = pytest.mark.filterwarnings("error")

R = 2000  # bootstrap resamples in tests: modest, fast, still stable


def normal(seed: int, n: int, mean: float = 100.0, cv: float = 0.03) -> np.ndarray:
    return np.random.default_rng(seed).normal(mean, mean * cv, n)


# --- summarize -------------------------------------------------------------------------------


def test_summarize_matches_plain_statistics():
    values = [10.0, 12.0, 11.0, 13.0, 50.0]
    s = stats.summarize(values, n_resamples=R)
    assert s.n == 5
    assert s.median == 12.0
    assert s.mean == pytest.approx(statistics.fmean(values))
    assert (s.min, s.max) == (10.0, 50.0)
    assert s.stdev == pytest.approx(statistics.stdev(values))
    assert s.cv == pytest.approx(statistics.stdev(values) / statistics.fmean(values))
    assert s.confidence == 0.95
    assert s.min <= s.ci_low <= s.median <= s.ci_high <= s.max


def test_summarize_one_value_collapses_ci():
    s = stats.summarize([42.5], n_resamples=R)
    assert (s.n, s.median, s.mean, s.min, s.max) == (1, 42.5, 42.5, 42.5, 42.5)
    assert s.stdev is None and s.cv is None
    assert (s.ci_low, s.ci_high) == (42.5, 42.5)


@pytest.mark.parametrize("n", [2, 3, 10])
def test_summarize_identical_values_collapse_ci(n):
    s = stats.summarize([7.0] * n, n_resamples=R)
    assert (s.median, s.ci_low, s.ci_high) == (7.0, 7.0, 7.0)
    assert s.stdev == 0.0 and s.cv == 0.0


def test_summarize_two_values_and_ties():
    s2 = stats.summarize([1.0, 3.0], n_resamples=R)
    assert s2.median == 2.0 and s2.ci_low == 1.0 and s2.ci_high == 3.0
    s = stats.summarize([5, 5, 5, 5, 6, 6, 9], n_resamples=R)  # heavy ties
    assert s.median == 5.0
    assert 5.0 <= s.ci_low <= s.ci_high <= 9.0
    assert all(map(math.isfinite, (s.ci_low, s.ci_high)))


def test_summarize_cv_none_for_zero_mean():
    s = stats.summarize([-1.0, 1.0, -2.0, 2.0], n_resamples=R)
    assert s.mean == 0.0 and s.cv is None and s.stdev is not None


def test_summarize_is_deterministic_given_seed():
    x = normal(1, 12)
    assert stats.summarize(x, seed=3, n_resamples=R) == stats.summarize(x, seed=3, n_resamples=R)
    assert stats.summarize(list(x), seed=3, n_resamples=R) == stats.summarize(tuple(x), seed=3, n_resamples=R)


def test_summarize_confidence_widens_interval():
    x = normal(2, 20)
    s80 = stats.summarize(x, confidence=0.80, n_resamples=R)
    s99 = stats.summarize(x, confidence=0.99, n_resamples=R)
    assert s99.ci_low <= s80.ci_low and s80.ci_high <= s99.ci_high
    assert s99.confidence == 0.99


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [1.0, float("inf")], [[1.0, 2.0]]])
def test_summarize_rejects_empty_and_non_finite(bad):
    with pytest.raises(ValueError):
        stats.summarize(bad, n_resamples=R)


@pytest.mark.parametrize("confidence", [0.0, 1.0, 1.5])
def test_confidence_must_be_a_fraction(confidence):
    with pytest.raises(ValueError):
        stats.summarize([1.0, 2.0], confidence=confidence)


def test_median_ci_covers_true_median_at_roughly_nominal_rate():
    # Skewed data (lognormal, true median 1.0), n = 15, 200 seeded trials at 95 %.
    covered = 0
    for seed in range(200):
        x = np.random.default_rng(seed).lognormal(0.0, 0.3, 15)
        lo, hi = stats.median_ci(x, seed=seed, n_resamples=R)
        covered += lo <= 1.0 <= hi
    rate = covered / 200
    assert rate >= 0.85, rate
    assert rate <= 0.99, f"{rate}: suspiciously wide (the [min, max] range would cover ~100 %)"


# --- ratio_ci --------------------------------------------------------------------------------


def test_ratio_ci_brackets_the_ratio_of_medians():
    a, b = normal(10, 10), normal(11, 10, mean=110.0)
    r = stats.ratio_ci(a, b, seed=0, n_resamples=R)
    assert r.ratio == pytest.approx(np.median(b) / np.median(a))
    assert r.ci_low <= r.ratio <= r.ci_high
    assert r.ci_low > 1.0  # a 10 % shift at CV 3 %, n = 10, is clearly resolved
    assert not r.contains(1.0)
    assert r == stats.ratio_ci(a, b, seed=0, n_resamples=R)  # deterministic


def test_ratio_ci_same_distribution_contains_one():
    a, b = normal(20, 10), normal(21, 10)
    assert stats.ratio_ci(a, b, seed=0, n_resamples=R).contains(1.0)


def test_ratio_ci_constant_and_single_sides():
    both = stats.ratio_ci([4.0, 4.0, 4.0], [5.0], n_resamples=R)
    assert (both.ratio, both.ci_low, both.ci_high) == (1.25, 1.25, 1.25)
    one_fixed = stats.ratio_ci([5.0], [1.0, 2.0, 3.0], n_resamples=R)
    assert one_fixed.ratio == pytest.approx(0.4)
    assert 0.2 <= one_fixed.ci_low <= 0.4 <= one_fixed.ci_high <= 0.6
    other_fixed = stats.ratio_ci([1.0, 2.0, 3.0], [6.0, 6.0], n_resamples=R)
    assert other_fixed.ratio == 3.0 and 2.0 <= other_fixed.ci_low <= 3.0 <= other_fixed.ci_high <= 6.0


def test_ratio_ci_zero_medians():
    # A's median is 0: the ratio is unbounded above, never NaN, and no warning escapes.
    r = stats.ratio_ci([0.0, 0.0, 0.0, 1.0, 2.0], [1.0, 2.0, 3.0, 4.0, 5.0], n_resamples=R)
    assert r.ratio == math.inf and r.ci_high == math.inf
    assert not math.isnan(r.ci_low)
    # B's median is 0 while A's is not: ratio 0.
    r0 = stats.ratio_ci([1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 1.0], n_resamples=R)
    assert r0.ratio == 0.0 and r0.ci_low == 0.0 and math.isfinite(r0.ci_high)
    # Both all zero (e.g. a retransmit count): 0/0 is "no change".
    rz = stats.ratio_ci([0.0, 0.0, 0.0], [0.0, 0.0], n_resamples=R)
    assert (rz.ratio, rz.ci_low, rz.ci_high) == (1.0, 1.0, 1.0)
    # Zeros inside resamples only (medians non-zero): still no NaN.
    rm = stats.ratio_ci([0.0, 0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 2.0, 2.0], n_resamples=R)
    assert not any(map(math.isnan, (rm.ratio, rm.ci_low, rm.ci_high)))


def test_noise_floor_band_is_symmetric_and_contains_one():
    nf = stats.noise_floor(normal(30, 10), normal(31, 10), seed=0, n_resamples=R)
    lo, hi = nf.band()
    assert lo <= 1.0 <= hi
    assert lo <= nf.ci_low and nf.ci_high <= hi
    assert lo == pytest.approx(min(nf.ci_low, 1 / nf.ci_high))
    assert hi == pytest.approx(max(nf.ci_high, 1 / nf.ci_low))
    # A CI entirely above 1 still gives a band around 1.
    assert stats.RatioCI(1.05, 1.02, 1.08, 0.95).band() == pytest.approx((1 / 1.08, 1.08))
    assert stats.RatioCI(math.inf, 1.0, math.inf, 0.95).band() == (0.0, math.inf)


# --- mann_whitney ----------------------------------------------------------------------------


def test_mann_whitney_small_n_is_exact():
    assert stats.mann_whitney([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == pytest.approx(0.1)  # 2 / C(6, 3)
    assert stats.mann_whitney([1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]) == pytest.approx(2 / 70)
    a, b = normal(40, 10), normal(41, 10)
    expected = sst.mannwhitneyu(a, b, alternative="two-sided", method="exact").pvalue
    assert stats.mann_whitney(a, b) == pytest.approx(expected)


def test_mann_whitney_needs_two_per_side():
    assert stats.mann_whitney([1.0], [2.0, 3.0, 4.0]) is None
    assert stats.mann_whitney([1.0, 2.0, 3.0], [2.0]) is None


def test_mann_whitney_ties_and_constants():
    assert stats.mann_whitney([3.0, 3.0, 3.0], [3.0, 3.0]) == 1.0
    # All of A below all of B with ties inside each side: as extreme as it gets (exact permutation).
    p = stats.mann_whitney([1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0])
    assert p == pytest.approx(2 / 70)
    # Rounded benchmark output with ties across sides, n = 10: seeded permutation, deterministic.
    a, b = np.round(normal(50, 10)), np.round(normal(51, 10))
    p1, p2 = stats.mann_whitney(a, b, seed=1), stats.mann_whitney(a, b, seed=1)
    assert p1 == p2 and 0.0 < p1 <= 1.0
    assert p1 == pytest.approx(sst.mannwhitneyu(a, b).pvalue, abs=0.05)  # close to the asymptotic


def test_mann_whitney_large_n_without_ties():
    a, b = normal(60, 150), normal(61, 150, mean=101.0)
    p = stats.mann_whitney(a, b)
    assert p == pytest.approx(sst.mannwhitneyu(a, b, method="asymptotic").pvalue)


def test_min_exact_p():
    assert stats.min_exact_p(3, 3) == pytest.approx(0.1)
    assert stats.min_exact_p(3, 5) == pytest.approx(2 / 56)
    assert stats.min_exact_p(4, 4) == pytest.approx(2 / 70)
    assert stats.min_exact_p(1, 1) == 1.0
    assert stats.min_exact_p(0, 5) == 1.0


# --- ci_width_ok -----------------------------------------------------------------------------


def test_ci_width_ok_for_adaptive_repetition():
    tight = normal(70, 10, cv=0.005)
    noisy = normal(71, 10, cv=0.10)
    assert stats.ci_width_ok(tight, 0.02, n_resamples=R)
    assert not stats.ci_width_ok(noisy, 0.02, n_resamples=R)
    assert stats.ci_width_ok(noisy, 0.50, n_resamples=R)
    # The CI narrows as repetitions accumulate: some n reaches +-2 % at CV 5 %.
    x = normal(72, 60, cv=0.05)
    reached = [n for n in range(3, 61) if stats.ci_width_ok(x[:n], 0.02, n_resamples=R)]
    assert reached and reached[0] > 3


def test_ci_width_ok_edge_cases():
    assert not stats.ci_width_ok([100.0], 0.05)  # one value says nothing about precision
    assert not stats.ci_width_ok([100.0, 100.0], 0.05)  # below min_n
    assert stats.ci_width_ok([100.0, 100.0, 100.0], 0.0)
    assert stats.ci_width_ok([100.0, 100.0], 0.05, min_n=2)
    assert stats.ci_width_ok([0.0, 0.0, 0.0], 0.05)  # collapses exactly to 0
    assert not stats.ci_width_ok([0.0, 0.0, 0.0, 1.0, -1.0], 0.05, n_resamples=R)  # median 0, CI not
    with pytest.raises(ValueError):
        stats.ci_width_ok([1.0, 2.0, 3.0], -0.1)
