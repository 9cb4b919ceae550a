"""Pure statistics for benchmark repetitions: medians, bootstrap CIs, Mann-Whitney, A/A noise floor.

No I/O, no printing, no globals: every function takes the numbers and returns frozen records.
The heavy lifting is scipy's (`scipy.stats.bootstrap`, `scipy.stats.mannwhitneyu`); this module
only chooses the methods and handles the small-n edge cases benchmarks produce (one repetition,
identical repetitions, zeros), so callers never see a NaN or a scipy warning.

Choices (see also lab/compare.py for the significance rule):

- Centre: the median. Benchmark repetitions are skewed and have outliers (a slow first run, a
  noisy neighbour); the median is what users read and what the CIs are about.
- CIs: percentile bootstrap (`method="percentile"`), not BCa. BCa's acceleration comes from a
  jackknife of the statistic; for the median with small n and ties the jackknife values are few and
  repeated, and for identical repetitions BCa returns NaN with a DegenerateDataWarning. The
  percentile interval never leaves the range of the bootstrap distribution (so it stays inside the
  observed data for a median), never goes NaN, and maps exactly through monotone transforms (the
  CI of a/b is the reciprocal of the CI of b/a). It is somewhat narrow at very small n, which is
  why a comparison also requires the exact Mann-Whitney test to agree (lab.compare).
- Degenerate inputs are answered without scipy: one value or identical values -> the CI collapses
  to that value (a bootstrap of a constant is that constant).
- Determinism: every resampling draws from `numpy.random.default_rng(seed)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Values = Sequence[float] | np.ndarray  # a flat sequence of finite numbers

DEFAULT_CONFIDENCE = 0.95


def _scipy_stats():
    """scipy.stats, imported on first use: it takes about 1 s, which every CLI call (and the
    bad-input tests' hundreds of them) would otherwise pay before parsing an argument."""
    from scipy import stats

    return stats


DEFAULT_N_RESAMPLES = 9999  # scipy's default; about 1-2 ms per CI at n = 10
_PERMUTATION_RESAMPLES = 9999  # Mann-Whitney with ties at small n (exact when fewer distinct splits)
_EXACT_MWU_MAX_CELLS = 10_000  # exact U distribution up to n_a * n_b = 100 x 100 (~15 ms)
_ASYMPTOTIC_TIES_MIN_N = 20  # with ties, the tie-corrected normal approximation from here on


@dataclass(frozen=True)
class Summary:
    """One set of repetitions. `ci_low`/`ci_high` bracket the median (bootstrap, `confidence`)."""

    n: int
    median: float
    mean: float
    min: float
    max: float
    stdev: float | None  # sample standard deviation (ddof=1); None if n < 2
    cv: float | None  # stdev / |mean| as a fraction (0.03 = 3 %); None if n < 2 or mean == 0
    ci_low: float
    ci_high: float
    confidence: float


@dataclass(frozen=True)
class RatioCI:
    """median(b) / median(a) with a bootstrap CI.

    Zeros: x/0 is +inf (or -inf) and 0/0 is 1.0 (both sides are zero: no change). An interval
    with an infinite end means "the data cannot bound the ratio on that side".
    """

    ratio: float
    ci_low: float
    ci_high: float
    confidence: float

    def contains(self, value: float = 1.0) -> bool:
        return self.ci_low <= value <= self.ci_high

    def band(self) -> tuple[float, float]:
        """As an A/A noise floor: the ratios two identical setups produce, in either direction.

        Which of two A/A repetition sets is "first" is arbitrary, so the band is the CI made
        symmetric around 1 on a log scale: [min(lo, 1/hi), max(hi, 1/lo)]. Always contains 1.
        """
        lo, hi = self.ci_low, self.ci_high
        return (min(lo, _inv(hi), 1.0), max(hi, _inv(lo), 1.0))


# ---------------------------------------------------------------------------------------------
# validation and small helpers


def _as_array(values: Values, what: str = "values") -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a flat sequence of numbers, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{what}: no values")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what}: contains NaN or infinity: {arr.tolist()}")
    return arr


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be between 0 and 1 (exclusive), got {confidence}")


def _is_constant(arr: np.ndarray) -> bool:
    return bool(arr.size == 1 or np.all(arr == arr[0]))


def _inv(x: float) -> float:
    if x == 0.0:
        return math.inf
    if math.isinf(x):
        return 0.0
    return 1.0 / x


def _median(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(x, axis=axis)


def _safe_ratio(num: np.ndarray | float, den: np.ndarray | float) -> np.ndarray:
    """num / den elementwise with the zero conventions of RatioCI (never NaN)."""
    num = np.asarray(num, dtype=float)
    den = np.asarray(den, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        plain = num / np.where(den == 0.0, 1.0, den)
    at_zero = np.where(num == 0.0, 1.0, np.copysign(np.inf, num))
    return np.where(den == 0.0, at_zero, plain)


def _percentile_ci(
    data: tuple[np.ndarray, ...],
    statistic: Callable[..., np.ndarray],
    *,
    confidence: float,
    n_resamples: int,
    seed: int,
) -> tuple[float, float]:
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    # Infinite resample ratios (a zero median in a resample) make scipy's standard-error
    # estimate compute inf - inf; the interval itself is fine, so silence only that.
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        res = _scipy_stats().bootstrap(
            data,
            statistic,
            n_resamples=n_resamples,
            vectorized=True,
            paired=False,
            axis=-1,
            confidence_level=confidence,
            method="percentile",
            rng=np.random.default_rng(seed),
        )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


# ---------------------------------------------------------------------------------------------
# public API


def median_ci(
    values: Values, *, seed: int = 0, confidence: float = DEFAULT_CONFIDENCE, n_resamples: int = DEFAULT_N_RESAMPLES
) -> tuple[float, float]:
    """Percentile-bootstrap CI of the median. One value or identical values -> (v, v)."""
    _check_confidence(confidence)
    arr = _as_array(values)
    if _is_constant(arr):
        return float(arr[0]), float(arr[0])
    return _percentile_ci((arr,), _median, confidence=confidence, n_resamples=n_resamples, seed=seed)


def summarize(
    values: Values, *, seed: int = 0, confidence: float = DEFAULT_CONFIDENCE, n_resamples: int = DEFAULT_N_RESAMPLES
) -> Summary:
    """Median, mean, range, spread and a bootstrap CI of the median of one set of repetitions.

    Raises ValueError for an empty sequence or non-finite values (a parser bug, not a result).
    """
    arr = _as_array(values)
    n = int(arr.size)
    mean = float(np.mean(arr))
    stdev = float(np.std(arr, ddof=1)) if n >= 2 else None
    cv = stdev / abs(mean) if stdev is not None and mean != 0.0 else None
    lo, hi = median_ci(arr, seed=seed, confidence=confidence, n_resamples=n_resamples)
    return Summary(
        n=n,
        median=float(np.median(arr)),
        mean=mean,
        min=float(arr.min()),
        max=float(arr.max()),
        stdev=stdev,
        cv=cv,
        ci_low=lo,
        ci_high=hi,
        confidence=confidence,
    )


def ratio_ci(
    a: Values,
    b: Values,
    *,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    n_resamples: int = DEFAULT_N_RESAMPLES,
) -> RatioCI:
    """median(b) / median(a) and its percentile-bootstrap CI, resampling a and b independently.

    A side with one value or identical values is held fixed (resampling it changes nothing);
    both fixed -> the CI collapses to the ratio. Zeros follow RatioCI's conventions.
    """
    _check_confidence(confidence)
    xa, xb = _as_array(a, "a"), _as_array(b, "b")
    ratio = float(_safe_ratio(np.median(xb), np.median(xa)))
    const_a, const_b = _is_constant(xa), _is_constant(xb)
    if const_a and const_b:
        return RatioCI(ratio, ratio, ratio, confidence)
    data: tuple[np.ndarray, ...]
    statistic: Callable[..., np.ndarray]
    if const_a:
        ma = float(xa[0])
        data, statistic = (xb,), (lambda sb, axis=-1: _safe_ratio(np.median(sb, axis=axis), ma))
    elif const_b:
        mb = float(xb[0])
        data, statistic = (xa,), (lambda sa, axis=-1: _safe_ratio(mb, np.median(sa, axis=axis)))
    else:
        data = (xa, xb)
        statistic = lambda sa, sb, axis=-1: _safe_ratio(np.median(sb, axis=axis), np.median(sa, axis=axis))  # noqa: E731 - one Callable, as in the branches above

    lo, hi = _percentile_ci(data, statistic, confidence=confidence, n_resamples=n_resamples, seed=seed)
    return RatioCI(ratio, lo, hi, confidence)


def noise_floor(
    first: Values,
    second: Values,
    *,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    n_resamples: int = DEFAULT_N_RESAMPLES,
) -> RatioCI:
    """A/A noise floor: two repetition sets of the *same* cell (e.g. the cell cloned twice).

    Returns their ratio and CI; `.band()` is the range of ratios that identical setups produce,
    which lab.compare uses to mark differences no larger than that as "within noise".
    """
    return ratio_ci(first, second, seed=seed, confidence=confidence, n_resamples=n_resamples)


def widest(x: RatioCI | None, y: RatioCI) -> RatioCI:
    """Of two A/A noise floors, the one whose band is wider on a log scale (x may be None): with
    several twins the floor is what identical setups can differ by anywhere in the run."""
    if x is None:
        return y
    return x if _log_width(x.band()) >= _log_width(y.band()) else y


def _log_width(band: tuple[float, float]) -> float:
    lo, hi = band
    if lo <= 0 or math.isinf(hi):
        return math.inf
    return math.log(hi) - math.log(lo)


def min_exact_p(n_a: int, n_b: int) -> float:
    """Smallest two-sided p-value an exact Mann-Whitney test can give for these sample sizes.

    2 / C(n_a + n_b, n_a): with 3 vs 3 repetitions it is 0.10, so no difference can ever be
    significant at alpha = 0.05; with 3 vs 5 it is 0.036, with 4 vs 4 it is 0.029.
    """
    if n_a < 1 or n_b < 1:
        return 1.0
    return min(1.0, 2.0 / math.comb(n_a + n_b, n_a))


def mann_whitney(a: Values, b: Values, *, seed: int = 0) -> float | None:
    """Two-sided Mann-Whitney U p-value, or None when either side has fewer than 2 values.

    Method: exact U distribution when there are no ties (up to 100 x 100 values); with ties
    (rounded integers are common in benchmark output) a permutation test, which is exact when the
    number of distinct splits is small and otherwise uses 9999 seeded permutations; for large
    samples the normal approximation (tie-corrected), which is accurate there.
    """
    xa, xb = _as_array(a, "a"), _as_array(b, "b")
    na, nb = xa.size, xb.size
    if na < 2 or nb < 2:
        return None
    pooled = np.concatenate([xa, xb])
    if _is_constant(pooled):
        return 1.0  # every value is the same: no evidence of any difference
    ties = np.unique(pooled).size < pooled.size
    if not ties and na * nb <= _EXACT_MWU_MAX_CELLS:
        method = "exact"
    elif ties and min(na, nb) < _ASYMPTOTIC_TIES_MIN_N:
        method = _scipy_stats().PermutationMethod(n_resamples=_PERMUTATION_RESAMPLES, rng=np.random.default_rng(seed))
    else:
        method = "asymptotic"
    res = _scipy_stats().mannwhitneyu(xa, xb, alternative="two-sided", method=method)
    return float(min(1.0, max(0.0, res.pvalue)))


def ci_width_ok(
    values: Values,
    target_rel_width: float,
    *,
    min_n: int = 3,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    n_resamples: int = DEFAULT_N_RESAMPLES,
) -> bool:
    """For adaptive repetition: is the median's CI within +-target_rel_width of the median?

    True when both CI ends are within target_rel_width * |median| of the median (0.02 = +-2 %).
    False with fewer than `min_n` values (two equal runs are luck, not precision) and when the
    median is 0 and the CI is not exactly [0, 0] (a relative width is then undefined).
    """
    if target_rel_width < 0:
        raise ValueError(f"target_rel_width must be >= 0, got {target_rel_width}")
    arr = _as_array(values)
    if arr.size < max(min_n, 1):
        return False
    med = float(np.median(arr))
    lo, hi = median_ci(arr, seed=seed, confidence=confidence, n_resamples=n_resamples)
    half_width = max(med - lo, hi - med)
    return half_width <= target_rel_width * abs(med)
