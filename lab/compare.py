"""Pure comparison of two result sets: one row per metric with ratio, CI, p, q and a verdict.

No I/O, no printing. The caller (lab.analysis / lab.report) builds the two sides from the store as
`{key: MetricSeries}`, where a key is any hashable identity of cell + workload + metric, e.g.
`("debian12/virtio/tuned", "iperf3-tcp", "throughput")`, and renders the rows.

Primary and exploratory rows. A series says whether its metric is one of its workload's headline
(primary) metrics (lab.workloads.PrimaryMetrics). Primary rows are the ones a comparison answers:
their Mann-Whitney p-values are corrected together for multiple testing (Benjamini-Hochberg, q)
and each gets one of lab.verdicts' answers, better / worse / same / unknown, against its margin
(the A/A band where measured, at least the stated minimum effect). Exploratory (secondary) rows
show their figures, p and CI, and no verdict word: with dozens of them, some would cross p < 0.05
by chance in every comparison.

Sample size: "not enough samples" when either side has fewer than 3 values, or when the exact
test cannot reach p < alpha at all with these sizes (3 vs 3 can never go below p = 0.10).

Flagged samples (lab.flags) are not in `values`: a MetricSeries carries only how many there were
(`flagged`), so a row can say so; a side whose every sample is flagged is "only flagged samples".

Siblings: rows of one family (the same primary metric under other parametrisations: connection
counts, thread counts, directions, other cells of the comparison) are checked for agreement; a
verdict that holds in one and reverses in another is flagged (Row.siblings).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lab import stats, verdicts
from lab.errors import LabError
from lab.verdicts import DEFAULT_ALPHA, DEFAULT_MARGIN_PCT, MIN_SAMPLES, Answer

__all__ = ["DEFAULT_ALPHA", "DEFAULT_MARGIN_PCT", "MIN_SAMPLES", "MetricSeries", "Row", "Siblings", "Verdict"]


class Verdict(enum.StrEnum):
    BETTER = Answer.BETTER.value  # B is better than A by more than the margin (primary rows)
    WORSE = Answer.WORSE.value
    SAME = Answer.SAME.value  # B is within the margin of A
    UNKNOWN = Answer.UNKNOWN.value  # neither yet
    EXPLORATORY = "exploratory"  # a secondary metric: figures, p and CI, no verdict
    NOT_ENOUGH = "not enough samples"
    MISSING_A = "missing in A"
    MISSING_B = "missing in B"
    ONLY_FLAGGED = "only flagged samples"  # a side has samples, but every one is flagged (lab.flags)
    INFORMATIONAL = "informational"  # the metric has no better direction (higher_is_better None)


ANSWERS = {Verdict.BETTER, Verdict.WORSE, Verdict.SAME, Verdict.UNKNOWN}


@dataclass(frozen=True)
class MetricSeries:
    """The repetitions of one metric in one cell. `values` is stored as a tuple."""

    values: Sequence[float]  # the samples that count
    unit: str
    higher_is_better: bool | None
    flagged: int = 0  # samples left out: flagged (shown, never averaged in)
    primary: bool = True  # a headline metric of its workload: tested and answered; else exploratory
    family: str | None = None  # its sibling group (primary rows): e.g. "http requests_per_s_*"

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))


@dataclass(frozen=True)
class Siblings:
    """How a primary row's family (the same metric in its sibling rows) moved, B against A."""

    family: str
    rows: int  # rows of the family with a ratio, this one included
    better: int  # of which B's point estimate is on the better side of 1
    worse: int
    verdicts: tuple[tuple[str, int], ...]  # (verdict, count) over the family's rows, sorted

    @property
    def agrees(self) -> bool:
        """Every point estimate of the family moves the same way (or not at all)."""
        return not (self.better and self.worse)

    @property
    def reverses(self) -> bool:
        """A better (worse) verdict in one row while a sibling's estimate goes the other way."""
        said = dict(self.verdicts)
        return bool((said.get(Verdict.BETTER) and self.worse) or (said.get(Verdict.WORSE) and self.better))

    def text(self) -> str:
        # the direction is of the point estimates, the words in brackets the verdicts: "all worse
        # (2 same)" read as two verdicts at once, so the estimates are said as a side, not a verdict
        said = "verdicts: " + ", ".join(f"{n} {v}" for v, n in self.verdicts)
        if self.agrees:
            way = "better" if self.better else "worse" if self.worse else ""
            where = f"every estimate on the {way} side" if way else "every estimate unchanged"
            return f"{self.family}: {self.rows} rows, {where} ({said})"
        head = "reverses" if self.reverses else "direction differs"
        return (
            f"{self.family}: {head}: estimates {self.better} on the better side, {self.worse} on the worse side"
            f" of {self.rows} rows ({said})"
        )


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
    ratio_ci: tuple[float, float] | None  # bootstrap CI of the ratio at 1 - alpha
    p_value: float | None  # two-sided Mann-Whitney; None if a side has < 2 values
    significant: bool | None  # q (exploratory: p) < alpha and ratio CI excludes 1; None if not enough samples
    verdict: Verdict
    noise_band: tuple[float, float] | None = None  # A/A noise band (ratio) for this key, if given
    summary_a: stats.Summary | None = None  # spread, CI of each median, min/max
    summary_b: stats.Summary | None = None
    flagged_a: int = 0  # samples of each side left out, flagged
    flagged_b: int = 0
    primary: bool = False  # a headline metric, answered (else exploratory)
    q_value: float | None = None  # p corrected over the comparison's primary rows (BH); None if not tested
    effect: float | None = None  # ratio - 1: the relative change of the median, B against A
    margin: verdicts.Margin | None = None  # what "same" and a minimum effect were judged against (answered rows)
    equivalence_ci: tuple[float, float] | None = None  # the ratio's CI at 1 - 2 alpha (TOST)
    siblings: Siblings | None = None  # its family's agreement (primary rows with siblings)

    def evidence(self) -> verdicts.Evidence | None:
        """What the row's samples said (None with a side missing): to judge it again against
        another margin (lab.verdicts.decide, with this row's q)."""
        if self.ratio is None or self.ratio_ci is None or self.equivalence_ci is None:
            return None
        n_a, n_b = self.n_a, self.n_b
        return verdicts.Evidence(
            n_a, n_b, self.ratio, self.ratio_ci, self.equivalence_ci, self.p_value, verdicts.enough(n_a, n_b)
        )

    def as_dict(self) -> dict[str, Any]:
        """The row as `lab compare --json` prints it."""
        out = dict(self.__dict__)
        out["margin"] = self.margin.as_dict() if self.margin else None
        for side in ("summary_a", "summary_b"):
            summary = out[side]
            out[side] = None if summary is None else summary.__dict__
        out["siblings"] = (
            None
            if self.siblings is None
            else {**self.siblings.__dict__, "agrees": self.siblings.agrees, "reverses": self.siblings.reverses}
        )
        return out


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


@dataclass(frozen=True)
class _Measured:
    """A row before its verdict: the figures of each side and, with both, the evidence."""

    row: Row
    meta: MetricSeries
    ev: verdicts.Evidence | None

    @property
    def tested(self) -> bool:
        """In the family corrected together: primary, with a direction, enough samples, a p."""
        ev = self.ev
        return self.row.primary and ev is not None and ev.enough and ev.p is not None


def _measure(
    key: Hashable, sa: MetricSeries | None, sb: MetricSeries | None, *, alpha: float, seed: int, n_resamples: int
) -> _Measured:
    a = sa if sa is not None and len(sa.values) > 0 else None  # no values counts as missing
    b = sb if sb is not None and len(sb.values) > 0 else None
    if a is not None and b is not None:
        _check_same_metric(key, a, b)
    meta = a or b or sa or sb
    if meta is None:
        raise ValueError(f"{key!r}: neither side has this key")
    conf = 1.0 - alpha
    summary_a = stats.summarize(a.values, seed=seed, confidence=conf, n_resamples=n_resamples) if a else None
    summary_b = stats.summarize(b.values, seed=seed, confidence=conf, n_resamples=n_resamples) if b else None
    ev = None
    if (a is None and sa is not None and sa.flagged) or (b is None and sb is not None and sb.flagged):
        verdict = Verdict.ONLY_FLAGGED
    elif a is None:
        verdict = Verdict.MISSING_A
    elif b is None:
        verdict = Verdict.MISSING_B
    else:
        ev = verdicts.evidence(a.values, b.values, alpha=alpha, seed=seed, n_resamples=n_resamples)
        verdict = Verdict.UNKNOWN  # decided with the other rows (compare)
    row = Row(
        key=key,
        unit=meta.unit,
        higher_is_better=meta.higher_is_better,
        n_a=summary_a.n if summary_a else 0,
        n_b=summary_b.n if summary_b else 0,
        median_a=summary_a.median if summary_a else None,
        median_b=summary_b.median if summary_b else None,
        ratio=ev.ratio if ev else None,
        ratio_ci=ev.ci if ev else None,
        p_value=ev.p if ev else None,
        significant=None,
        verdict=verdict,
        summary_a=summary_a,
        summary_b=summary_b,
        flagged_a=sa.flagged if sa is not None else 0,
        flagged_b=sb.flagged if sb is not None else 0,
        primary=meta.primary and meta.higher_is_better is not None,
        effect=ev.effect if ev else None,
        equivalence_ci=ev.equivalence_ci if ev else None,
    )
    return _Measured(row, meta, ev)


def _decided(m: _Measured, q: float | None, *, alpha: float, noise: stats.RatioCI | None, margin_pct: float) -> Row:
    """The row's verdict, its q and margin, once the family's p-values are corrected."""
    row, ev, meta = m.row, m.ev, m.meta
    band = noise.band() if noise is not None else None
    if ev is None:
        return replace(row, noise_band=band)
    excludes_one = not ev.ci[0] <= 1.0 <= ev.ci[1]
    significant = ev.p is not None and (ev.p if q is None else q) < alpha and excludes_one if ev.enough else None
    margin = None  # only where a row was judged against one
    if meta.higher_is_better is None:
        verdict = Verdict.INFORMATIONAL
    elif not ev.enough:
        verdict = Verdict.NOT_ENOUGH
    elif not meta.primary:
        verdict = Verdict.EXPLORATORY
    else:
        margin = verdicts.margin_for(band, margin_pct)
        answer = verdicts.decide(ev, higher_is_better=meta.higher_is_better, margin=margin, q=q, alpha=alpha)
        verdict = Verdict(answer.value)
    return replace(row, significant=significant, verdict=verdict, noise_band=band, q_value=q, margin=margin)


def compare_one(
    key: Hashable,
    sa: MetricSeries | None,
    sb: MetricSeries | None,
    *,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    n_resamples: int = stats.DEFAULT_N_RESAMPLES,
    noise: stats.RatioCI | None = None,
    margin_pct: float = DEFAULT_MARGIN_PCT,
) -> Row:
    """One row tested alone (its q is its p). Raises LabError if the sides disagree on unit."""
    return compare(
        {key: sa} if sa is not None else {},
        {key: sb} if sb is not None else {},
        alpha=alpha,
        seed=seed,
        n_resamples=n_resamples,
        noise_floor={key: noise} if noise is not None else None,
        margin_pct=margin_pct,
    )[0]


def compare(
    a: Mapping[Any, MetricSeries],  # keys: any hashable identity (a Mapping is invariant in its key)
    b: Mapping[Any, MetricSeries],
    *,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    n_resamples: int = stats.DEFAULT_N_RESAMPLES,
    noise_floor: Mapping[Any, stats.RatioCI] | None = None,
    margin_pct: float = DEFAULT_MARGIN_PCT,
) -> list[Row]:
    """Side A (baseline) against side B: one Row per key present on either side, sorted by key.

    "better"/"worse" are about B relative to A, using each metric's higher_is_better. A key on one
    side only (or with no values) is a "missing in A/B" row, never dropped. CIs are at 1 - alpha.
    `noise_floor` maps keys to A/A ratio CIs (lab.stats.noise_floor): the margin of those rows
    (lab.verdicts.margin_for, never narrower than ±margin_pct). The primary rows with a p-value
    are corrected together (lab.verdicts.adjust). Deterministic for a given seed.
    """
    verdicts.check_alpha(alpha)
    verdicts.Margin.stated(margin_pct)  # validates it
    noise_floor = noise_floor or {}
    measured = [
        _measure(key, a.get(key), b.get(key), alpha=alpha, seed=seed, n_resamples=n_resamples)
        for key in _sorted_keys(set(a) | set(b))
    ]
    tested = [i for i, m in enumerate(measured) if m.tested]
    qs = dict(zip(tested, verdicts.adjust([measured[i].row.p_value for i in tested]), strict=True))
    rows = [
        _decided(m, qs.get(i), alpha=alpha, noise=noise_floor.get(m.row.key), margin_pct=margin_pct)
        for i, m in enumerate(measured)
    ]
    return _with_siblings(rows, {m.row.key: m.meta.family for m in measured})


def _with_siblings(rows: list[Row], families: dict[Any, str | None]) -> list[Row]:
    """Each answered row of a family with two or more rows gets the family's agreement."""
    groups: dict[str, list[Row]] = {}
    for r in rows:
        family = families.get(r.key)
        if family and r.verdict in ANSWERS and r.ratio is not None and r.higher_is_better is not None:
            groups.setdefault(family, []).append(r)
    found: dict[Any, Siblings] = {}
    for family, members in groups.items():
        if len(members) < 2:
            continue
        ways = [_way(r) for r in members]
        counts: dict[str, int] = {}
        for r in members:
            counts[r.verdict.value] = counts.get(r.verdict.value, 0) + 1
        sib = Siblings(family, len(members), ways.count(1), ways.count(-1), tuple(sorted(counts.items())))
        found.update({r.key: sib for r in members})
    return [replace(r, siblings=found[r.key]) if r.key in found else r for r in rows]


def _way(r: Row) -> int:
    """+1: B's estimate is on the better side of 1; -1: the worse; 0: unchanged."""
    assert r.ratio is not None
    if r.ratio == 1.0:
        return 0
    return 1 if (r.ratio > 1.0) == r.higher_is_better else -1
