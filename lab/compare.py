"""Pure comparison of two result sets: one row per metric with ratio, CI, p-value and a verdict.

No I/O, no printing. The caller (lab.cli / lab.report) builds the two sides from the store as
`{key: MetricSeries}`, where a key is any hashable identity of cell + workload + metric, e.g.
`("debian12/virtio/tuned", "iperf3-tcp", "throughput")`, and renders the rows.

Significance rule: a difference counts only when BOTH
  - the two-sided Mann-Whitney p-value (exact at small n) is below `alpha`, and
  - the bootstrap CI of median(B)/median(A), at confidence 1 - alpha, excludes 1.
The rank test keeps the false-positive rate at or below alpha whatever the bootstrap does at small
n (the percentile bootstrap is a little narrow there); the CI requirement keeps a verdict from
resting on a rank shift that the medians do not show. Either alone is weaker with 3-10 repetitions.

Sample size: "not enough samples" when either side has fewer than 3 values, or when the exact
test cannot reach p < alpha at all with these sizes (3 vs 3 can never go below p = 0.10), so that
"no significant difference" is never shown for a comparison that could not have found one.

Flagged samples (lab.flags) are not in `values`: a MetricSeries carries only how many there were
(`flagged`), so a row can say so; a side whose every sample is flagged is "only flagged samples".

Noise floor: optionally, per key, the ratio CI of an A/A comparison (the same cell run twice,
lab.stats.noise_floor). A significant difference whose ratio lies inside that A/A band is reported
as "no significant difference (within noise)": identical setups differ that much too.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lab import stats
from lab.errors import LabError

DEFAULT_ALPHA = 0.05
MIN_SAMPLES = 3


class Verdict(enum.StrEnum):
    BETTER = "better"  # B is better than A
    WORSE = "worse"  # B is worse than A
    NO_DIFFERENCE = "no significant difference"
    WITHIN_NOISE = "no significant difference (within noise)"
    NOT_ENOUGH = "not enough samples"
    MISSING_A = "missing in A"
    MISSING_B = "missing in B"
    ONLY_FLAGGED = "only flagged samples"  # a side has samples, but every one is flagged (lab.flags)
    INFORMATIONAL = "informational"  # the metric has no better direction (higher_is_better None)


@dataclass(frozen=True)
class MetricSeries:
    """The repetitions of one metric in one cell. `values` is stored as a tuple."""

    values: Sequence[float]  # the samples that count
    unit: str
    higher_is_better: bool | None
    flagged: int = 0  # samples left out: flagged (shown, never averaged in)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))


@dataclass(frozen=True)
class Row:
    # The caller's identity of the metric, returned as given (hashable): Any, not Hashable, so that a
    # caller can unpack the tuple it built ((cell, workload, metric) in lab.analysis and lab.report)
    key: Any
    unit: str
    higher_is_better: bool | None
    n_a: int
    n_b: int
    median_a: float | None  # None when that side is missing
    median_b: float | None
    ratio: float | None  # median_b / median_a (x/0 = inf, 0/0 = 1); None if a side is missing
    ratio_ci: tuple[float, float] | None  # bootstrap CI of the ratio at `confidence` (1 - alpha)
    p_value: float | None  # two-sided Mann-Whitney; None if a side has < 2 values
    significant: bool | None  # p < alpha and ratio CI excludes 1; None if not enough samples
    verdict: Verdict
    noise_band: tuple[float, float] | None = None  # A/A noise band (ratio) for this key, if given
    summary_a: stats.Summary | None = None  # spread, CI of each median, min/max
    summary_b: stats.Summary | None = None
    flagged_a: int = 0  # samples of each side left out, flagged
    flagged_b: int = 0


def _sorted_keys(keys: set[Hashable]) -> list[Hashable]:
    try:
        return sorted(keys)  # type: ignore[type-var]
    except TypeError:  # keys of mixed, unorderable types: still deterministic
        return sorted(keys, key=lambda k: (type(k).__name__, repr(k)))


def _check_same_metric(key: Hashable, sa: MetricSeries, sb: MetricSeries) -> None:
    if sa.unit != sb.unit:
        raise LabError(
            f"{key!r}: the unit differs between the two sides: A has {sa.unit!r}, B has {sb.unit!r}",
            hint="re-parse the older run (lab reparse) so both sides use the same unit",
        )
    if sa.higher_is_better != sb.higher_is_better:
        raise LabError(
            f"{key!r}: higher_is_better differs between the two sides: "
            f"A has {sa.higher_is_better!r}, B has {sb.higher_is_better!r}",
            hint="re-parse the older run (lab reparse) so both sides describe the metric the same way",
        )


def compare_one(
    key: Hashable,
    sa: MetricSeries | None,
    sb: MetricSeries | None,
    *,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    confidence: float | None = None,
    n_resamples: int = stats.DEFAULT_N_RESAMPLES,
    noise: stats.RatioCI | None = None,
) -> Row:
    """One row; `compare` calls this for every key. Raises LabError if the sides disagree on unit."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be between 0 and 1 (exclusive), got {alpha}")
    conf = 1.0 - alpha if confidence is None else confidence
    a = sa if sa is not None and len(sa.values) > 0 else None  # no values counts as missing
    b = sb if sb is not None and len(sb.values) > 0 else None
    if a is not None and b is not None:
        _check_same_metric(key, a, b)
    meta = a or b or sa or sb
    if meta is None:
        raise ValueError(f"{key!r}: neither side has this key")
    summary_a = stats.summarize(a.values, seed=seed, confidence=conf, n_resamples=n_resamples) if a else None
    summary_b = stats.summarize(b.values, seed=seed, confidence=conf, n_resamples=n_resamples) if b else None

    rci: stats.RatioCI | None = None
    p: float | None = None
    significant: bool | None = None
    if (a is None and sa is not None and sa.flagged) or (b is None and sb is not None and sb.flagged):
        verdict = Verdict.ONLY_FLAGGED
    elif a is None:
        verdict = Verdict.MISSING_A
    elif b is None:
        verdict = Verdict.MISSING_B
    else:
        assert summary_a is not None and summary_b is not None
        n_a, n_b = summary_a.n, summary_b.n
        rci = stats.ratio_ci(a.values, b.values, seed=seed, confidence=conf, n_resamples=n_resamples)
        p = stats.mann_whitney(a.values, b.values, seed=seed)
        enough = n_a >= MIN_SAMPLES and n_b >= MIN_SAMPLES and stats.min_exact_p(n_a, n_b) < alpha
        if enough:
            significant = p is not None and p < alpha and not rci.contains(1.0)
        if meta.higher_is_better is None:
            verdict = Verdict.INFORMATIONAL
        elif not enough:
            verdict = Verdict.NOT_ENOUGH
        elif not significant or summary_b.median == summary_a.median:
            verdict = Verdict.NO_DIFFERENCE
        elif noise is not None and noise.band()[0] <= rci.ratio <= noise.band()[1]:
            verdict = Verdict.WITHIN_NOISE
        elif (summary_b.median > summary_a.median) == meta.higher_is_better:
            verdict = Verdict.BETTER
        else:
            verdict = Verdict.WORSE

    return Row(
        key=key,
        unit=meta.unit,
        higher_is_better=meta.higher_is_better,
        n_a=summary_a.n if summary_a else 0,
        n_b=summary_b.n if summary_b else 0,
        median_a=summary_a.median if summary_a else None,
        median_b=summary_b.median if summary_b else None,
        ratio=rci.ratio if rci else None,
        ratio_ci=(rci.ci_low, rci.ci_high) if rci else None,
        p_value=p,
        significant=significant,
        verdict=verdict,
        noise_band=noise.band() if noise is not None else None,
        summary_a=summary_a,
        summary_b=summary_b,
        flagged_a=sa.flagged if sa is not None else 0,
        flagged_b=sb.flagged if sb is not None else 0,
    )


def compare(
    a: Mapping[Any, MetricSeries],  # keys: any hashable identity (a Mapping is invariant in its key)
    b: Mapping[Any, MetricSeries],
    *,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    confidence: float | None = None,
    n_resamples: int = stats.DEFAULT_N_RESAMPLES,
    noise_floor: Mapping[Any, stats.RatioCI] | None = None,
) -> list[Row]:
    """Side A (baseline) against side B: one Row per key present on either side, sorted by key.

    "better"/"worse" are about B relative to A, using each metric's higher_is_better. A key on one
    side only (or with no values) is a "missing in A/B" row, never dropped. `confidence` for the
    CIs defaults to 1 - alpha. `noise_floor` maps keys to A/A ratio CIs (lab.stats.noise_floor).
    Deterministic for a given seed.
    """
    noise_floor = noise_floor or {}
    return [
        compare_one(
            key,
            a.get(key),
            b.get(key),
            alpha=alpha,
            seed=seed,
            confidence=confidence,
            n_resamples=n_resamples,
            noise=noise_floor.get(key),
        )
        for key in _sorted_keys(set(a) | set(b))
    ]
