"""Pure: per knob, its effect on a metric, the share of the A-to-B gap it carries, and a verdict.

Input: the design's points (lab.explain.design: levels 0 = A's value, 1 = B's, per knob), each with
the samples that count (unflagged: lab.flags) of the metric measured there.

Factorial designs (full, or fractional then the active knobs' full factorial): the model is the
one of two-level DOE on the log of the metric, log y = mu + sum_j beta_j x_j + sum_jl beta_jl x_j x_l,
x in {-1, +1}, fitted by least squares to each point's log median (the interactions only for the
pairs the points can tell apart: lab.explain.design.interactions_estimable). For one term, every
sample is then corrected for the other terms' fitted effects, and the corrected samples at the
term's two levels are compared as two sides of a comparison (lab.verdicts.evidence): the ratio of
their medians is the effect (a knob's main effect: its B value against its A value, averaged
over the other knobs), its 95 % CI is the percentile bootstrap over those samples, its p the
Mann-Whitney test. In a balanced design both sides hold the same mix of the other knobs' levels,
so a knob without effect has the same distribution on both sides whatever the others do.

Revert designs: each knob's effect is B against B with that knob back at A's value, the two
cells compared directly.

Verdicts are lab.verdicts' decision, with the p-values of every term (each knob's main effect and
each interaction measured, of every metric explained) corrected together (Benjamini-Hochberg):
*matters* (better/worse: q < alpha, the CI excludes 1,
the effect beyond the margin), *does not matter* (same: the 90 % CI inside the margin: the A/A
band where the parent run measured one, never narrower than the stated minimum effect), or
*unknown*. An interaction's ratio is how much the second knob's effect changes between the first
knob's two values (e1000 costs x0.40 without a WAN cap and x0.99 under it: 2.5); it matters
when that ratio lies beyond the margin.

Share of the gap: log(effect) / log(median B / median A) of the corners, so the main effects'
shares add up to 1 less the odd-order interactions (and, across two runs, whatever is not a knob).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lab import stats, verdicts
from lab.explain.design import Levels
from lab.verdicts import Answer, Evidence, Margin

Term = tuple[int, ...]  # (j,): knob j's main effect; (j, l): their interaction


@dataclass(frozen=True)
class Point:
    levels: Levels
    values: tuple[float, ...]  # the samples that count, of one metric


@dataclass(frozen=True)
class KnobEffect:
    knob: int
    ratio: float | None  # the metric with the knob at B's value against A's (None: no estimate)
    ci: tuple[float, float] | None
    share: float | None  # of the A-to-B gap (log scale); None without a gap
    answer: Answer
    evidence: Evidence | None = None
    q: float | None = None
    why: str = ""  # why there is no estimate

    @property
    def verdict(self) -> str:
        return verdict_word(self.answer, self.evidence is not None)


@dataclass(frozen=True)
class Interaction:
    first: int  # the knob whose two values the second one's effect is compared at
    second: int
    ratio: float  # the second knob's effect with the first at B, over its effect with the first at A
    ci: tuple[float, float]
    effect_at_a: float  # the second knob's effect with the first at A's value
    effect_at_b: float
    answer: Answer
    evidence: Evidence
    q: float | None = None

    @property
    def verdict(self) -> str:
        return verdict_word(self.answer, True)


@dataclass(frozen=True)
class Moved:
    """A figure measured beside the metric, and how it moved with the top knob."""

    metric: str
    unit: str
    ratio: float | None  # its main effect (None: a load figure, medians only)
    ci: tuple[float, float] | None
    median_a: float | None  # at the knob's A value (every point with it), and at B's
    median_b: float | None


@dataclass(frozen=True)
class Step:
    """The step of a workload's total (podman build's steps) that carries the gap."""

    metric: str
    median_a: float
    median_b: float
    share: float  # of the total's difference between the corners


@dataclass
class MetricAnswer:
    workload: str
    metric: str
    unit: str
    higher_is_better: bool
    margin: Margin
    gap: Evidence | None  # corner B against corner A
    gap_answer: Answer
    knobs: list[KnobEffect]
    interactions: list[Interaction] = field(default_factory=list)
    moved: list[Moved] = field(default_factory=list)
    step: Step | None = None
    median_a: float | None = None  # of the corners' samples
    median_b: float | None = None

    @property
    def top(self) -> KnobEffect | None:
        """The knob that matters with the largest share (or effect) of the gap."""
        mattering = [k for k in self.knobs if k.answer.differs and k.ratio is not None]
        if not mattering:
            return None
        return max(mattering, key=lambda k: abs(k.share) if k.share is not None else abs(math.log(k.ratio or 1.0)))


def verdict_word(answer: Answer, estimated: bool = True) -> str:
    if not estimated:
        return "unknown"
    return {Answer.BETTER: "matters", Answer.WORSE: "matters", Answer.SAME: "does not matter"}.get(answer, "unknown")


# -- the model ---------------------------------------------------------------------------------------


def column(levels: Levels, term: Term) -> int:
    return math.prod(2 * levels[j] - 1 for j in term)


def _positive(values: Sequence[float]) -> np.ndarray:
    """log needs positive values: a zero (nothing measured) is held at a tiny fraction of the largest."""
    arr = np.asarray(values, dtype=float)
    top = float(np.max(np.abs(arr))) if arr.size else 1.0
    return np.maximum(arr, (top or 1.0) * 1e-9)


def fit(points: Sequence[Point], terms: Sequence[Term]) -> tuple[dict[Term, float], set[Term]]:
    """Least squares of the points' log medians on the terms (±1 coding): each term's coefficient,
    and the terms the points cannot estimate (their column is in the span of the others)."""
    used = [p for p in points if p.values]
    if not used:
        return {t: 0.0 for t in terms}, set(terms)
    x = np.array([[1.0] + [float(column(p.levels, t)) for t in terms] for p in used])
    y = np.array([math.log(float(np.median(_positive(p.values)))) for p in used])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    rank = np.linalg.matrix_rank(x)
    lost = {t for i, t in enumerate(terms) if np.linalg.matrix_rank(np.delete(x, i + 1, axis=1)) == rank}
    return {t: float(coef[i + 1]) for i, t in enumerate(terms)}, lost


def pools(points: Sequence[Point], terms: Sequence[Term], beta: dict[Term, float], term: Term):
    """The samples at the term's -1 and +1 sides, each corrected for every other term's effect."""
    lo: list[float] = []
    hi: list[float] = []
    for p in points:
        if not p.values:
            continue
        shift = sum(beta[t] * column(p.levels, t) for t in terms if t != term)
        corrected = np.exp(np.log(_positive(p.values)) - shift)
        (hi if column(p.levels, term) > 0 else lo).extend(float(v) for v in corrected)
    return lo, hi


def _evidence(lo: Sequence[float], hi: Sequence[float], *, alpha: float, seed: int, n_resamples: int):
    if not lo or not hi:
        return None
    return verdicts.evidence(lo, hi, alpha=alpha, seed=seed, n_resamples=n_resamples)


def by_levels(points: Sequence[Point]) -> dict[Levels, tuple[float, ...]]:
    """Samples per point (points listed twice pool their samples)."""
    out: dict[Levels, list[float]] = {}
    for p in points:
        out.setdefault(p.levels, []).extend(p.values)
    return {lv: tuple(v) for lv, v in out.items()}


@dataclass
class Estimates:
    """One metric's evidence before the verdicts (which are corrected across metrics)."""

    k: int
    main: dict[int, Evidence | None]
    why: dict[int, str]
    pairs: dict[tuple[int, int], tuple[Evidence, float, float]]  # evidence of the contrast, effect at A, at B
    gap: Evidence | None


def estimate(
    k: int,
    points: Sequence[Point],
    *,
    method: str = "factorial",
    pairs: Sequence[tuple[int, int]] = (),
    alpha: float = verdicts.DEFAULT_ALPHA,
    seed: int = 0,
    n_resamples: int = stats.DEFAULT_N_RESAMPLES,
) -> Estimates:
    """Each knob's main effect (and the pairs' interactions) as evidence, and the gap."""
    merged = [Point(lv, v) for lv, v in by_levels(points).items()]
    at = dict((p.levels, p.values) for p in merged)
    lo_corner, hi_corner = at.get((0,) * k, ()), at.get((1,) * k, ())

    def ev_of(lo: Sequence[float], hi: Sequence[float]) -> Evidence | None:
        return _evidence(lo, hi, alpha=alpha, seed=seed, n_resamples=n_resamples)

    gap = ev_of(lo_corner, hi_corner)
    main: dict[int, Evidence | None] = {}
    why: dict[int, str] = {}
    found: dict[tuple[int, int], tuple[Evidence, float, float]] = {}
    if method == "revert":
        for j in range(k):
            back = at.get(tuple(0 if i == j else 1 for i in range(k)), ())
            main[j] = ev_of(back, hi_corner)
            if main[j] is None:
                why[j] = "B or B with it reverted has no samples"
        return Estimates(k, main, why, found, gap)
    terms: list[Term] = [(j,) for j in range(k)] + [tuple(p) for p in pairs]
    terms += nuisance(merged, terms, k, alpha=alpha, seed=seed, n_resamples=n_resamples)
    beta, lost = fit(merged, terms)
    for j in range(k):
        if (j,) in lost:
            main[j], why[j] = None, "not estimable from the cells measured"
            continue
        main[j] = ev_of(*pools(merged, terms, beta, (j,)))
        if main[j] is None:
            why[j] = "no samples on one side"
    for pair in pairs:
        if tuple(pair) in lost:
            continue
        ev = ev_of(*pools(merged, terms, beta, tuple(pair)))
        if ev is None:
            continue
        # said as the weaker knob's effect at the stronger one's two values
        first, second = sorted(pair, key=lambda j: -abs(beta[(j,)]))
        b2, b12 = beta[(second,)], beta[tuple(pair)]
        found[(first, second)] = (ev, math.exp(2 * (b2 - b12)), math.exp(2 * (b2 + b12)))
    return Estimates(k, main, why, found, gap)


def nuisance(
    points: Sequence[Point], terms: list[Term], k: int, *, alpha: float, seed: int, n_resamples: int
) -> list[Term]:
    """Pairs of clearly active knobs the design cannot name (a resolution-IV fraction aliases them
    with other pairs) but whose pattern would blur every other knob's two sides: fitted as nuisance
    terms, never reported (effect heredity: an interaction goes with knobs that act on their own).
    Each only where the points can still tell it from the terms before it."""
    beta, lost = fit(points, terms)
    strong = []
    for j in range(k):
        if (j,) in lost:
            continue
        ev = _evidence(*pools(points, terms, beta, (j,)), alpha=alpha, seed=seed, n_resamples=min(n_resamples, 999))
        if ev is not None and ev.p is not None and ev.p < alpha:
            strong.append(j)
    added: list[Term] = []
    used = [p for p in points if p.values]
    for pair in itertools.combinations(strong, 2):
        if pair in terms:
            continue
        cols = [*terms, *added]
        x_before = np.array([[1.0] + [float(column(p.levels, t)) for t in cols] for p in used])
        x_after = np.array([[1.0] + [float(column(p.levels, t)) for t in (*cols, pair)] for p in used])
        if np.linalg.matrix_rank(x_after) > np.linalg.matrix_rank(x_before):
            added.append(pair)
    return added


# -- verdicts -------------------------------------------------------------------------------------------


def contrast_margin(margin: Margin) -> Margin:
    """An interaction's contrast is half its effect on a log scale: judged against the square root."""
    return Margin(math.sqrt(margin.low), math.sqrt(margin.high), margin.source)


def judge(
    estimates: Sequence[Estimates],
    *,
    higher_is_better: Sequence[bool],
    margins: Sequence[Margin],
    alpha: float = verdicts.DEFAULT_ALPHA,
) -> list[tuple[list[KnobEffect], list[Interaction], Answer]]:
    """The verdicts of several metrics' estimates, every term tested (each metric's main effects
    and interactions) corrected together (Benjamini-Hochberg); per metric: knobs, interactions,
    the gap's answer."""
    tested: list[tuple[int, Any, float | None]] = [
        (i, j, ev.p) for i, e in enumerate(estimates) for j, ev in e.main.items() if ev is not None and ev.enough
    ]
    tested += [(i, pr, ev.p) for i, e in enumerate(estimates) for pr, (ev, _, _) in e.pairs.items() if ev.enough]
    qs = dict(zip([(i, t) for i, t, _ in tested], verdicts.adjust([p for *_, p in tested]), strict=True))
    main_q, pair_q = qs, qs
    out = []
    for i, e in enumerate(estimates):
        hib, margin = higher_is_better[i], margins[i]
        gap_answer = (
            verdicts.decide(e.gap, higher_is_better=hib, margin=margin, alpha=alpha) if e.gap else Answer.UNKNOWN
        )
        log_gap = math.log(e.gap.ratio) if e.gap and 0 < e.gap.ratio < math.inf else 0.0
        knobs = []
        for j in range(e.k):
            ev = e.main.get(j)
            if ev is None:
                knobs.append(KnobEffect(j, None, None, None, Answer.UNKNOWN, why=e.why.get(j, "no estimate")))
                continue
            q = main_q.get((i, j))
            answer = verdicts.decide(ev, higher_is_better=hib, margin=margin, q=q, alpha=alpha)
            share = (
                math.log(ev.ratio) / log_gap
                if log_gap and gap_answer is not Answer.SAME and 0 < ev.ratio < math.inf
                else None
            )
            knobs.append(KnobEffect(j, ev.ratio, ev.ci, share, answer, ev, q))
        inter = []
        for (first, second), (ev, at_a, at_b) in e.pairs.items():
            q = pair_q.get((i, (first, second)))
            answer = verdicts.decide(ev, higher_is_better=hib, margin=contrast_margin(margin), q=q, alpha=alpha)
            sq = (ev.ratio**2, (ev.ci[0] ** 2, ev.ci[1] ** 2))
            inter.append(Interaction(first, second, sq[0], sq[1], at_a, at_b, answer, ev, q))
        out.append((knobs, inter, gap_answer))
    return out


# -- beside the top knob --------------------------------------------------------------------------------


def moved_with(
    k: int,
    knob: int,
    series: Mapping[str, tuple[str, Sequence[Point]]],
    loads: Mapping[str, Sequence[Point]],
    *,
    method: str = "factorial",
    seed: int = 0,
    n_resamples: int = stats.DEFAULT_N_RESAMPLES,
) -> list[Moved]:
    """How the figures measured beside the metric moved with one knob: each series' (metric ->
    (unit, points)) main effect of the knob, and each load figure's (name -> points) medians at
    the knob's two values."""
    out = []
    for metric, (unit, points) in sorted(series.items()):
        est = estimate(k, points, method=method, seed=seed, n_resamples=n_resamples)
        ev = est.main.get(knob)
        if ev is None:
            continue
        lo, hi = _sides(points, knob, k, method)
        out.append(Moved(metric, unit, ev.ratio, ev.ci, _median(lo), _median(hi)))
    for name, points in loads.items():
        lo, hi = _sides(points, knob, k, method)
        if lo or hi:
            out.append(Moved(name, "%", None, None, _median(lo), _median(hi)))
    return out


def _sides(points: Sequence[Point], knob: int, k: int, method: str) -> tuple[list[float], list[float]]:
    if method == "revert":
        at = by_levels(points)
        return list(at.get(tuple(0 if i == knob else 1 for i in range(k)), ())), list(at.get((1,) * k, ()))
    lo = [v for p in points if not p.levels[knob] for v in p.values]
    hi = [v for p in points if p.levels[knob] for v in p.values]
    return lo, hi


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def step_of(k: int, parts: dict[str, Sequence[Point]], total: Sequence[Point]) -> Step | None:
    """The part (a step's time) whose medians differ most between the corners, with its share of the
    total's difference; None when the corners lack the total or its parts."""
    a, b = (0,) * k, (1,) * k
    tot = by_levels(total)
    if not tot.get(a) or not tot.get(b):
        return None
    diff = statistics.median(tot[b]) - statistics.median(tot[a])
    best: Step | None = None
    for metric, points in parts.items():
        at = by_levels(points)
        if not at.get(a) or not at.get(b):
            continue
        ma, mb = statistics.median(at[a]), statistics.median(at[b])
        if best is None or abs(mb - ma) > abs(best.median_b - best.median_a):
            best = Step(metric, ma, mb, (mb - ma) / diff if diff else 0.0)
    return best
