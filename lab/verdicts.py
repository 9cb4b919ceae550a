"""Pure: the answer a comparison of two sample sets gives, and the margin it is judged against.

One decision, used by `lab compare` (every primary row), by adaptive repetition (lab.schedule: is
a comparison decided yet?) and by anything else that holds two sample sets and a margin (`lab
explain`: "matters" for better/worse, "does not matter" for same, "unknown"):

- **better / worse**: the (adjusted) p-value `q` is below `alpha`, the ratio's CI at 1 - alpha
  excludes 1, and the effect is outside the margin (the point estimate of median(B)/median(A) lies
  beyond it). Firecracker's A/B rule: a small p *and* a minimum effect.
- **same**: equivalence by two one-sided tests at level alpha (TOST), in its CI form: the ratio's
  CI at 1 - 2 alpha (90 % for alpha = 0.05) lies inside the margin. It needs no rank test, only a
  CI narrow enough, and a significant but smaller-than-the-margin difference is still "same".
- **unknown**: neither; more data would tell (adaptive repetition goes on while it is unknown).

The margin: the ratios two setups may differ by and still count as the same. Where an A/A band
was measured (the same cell run twice: lab.stats.noise_floor) it is that band, widened to at least
the stated minimum effect (`DEFAULT_MARGIN_PCT` unless the caller states one): the band is itself
estimated from a few repetitions and can come out narrower than anything worth a verdict by
chance. With no band it is the stated margin, symmetric on a log scale ([1/1.075, 1.075]).

Why 7.5 %: the default lab (5 primary rows, n = 5) has to call a 10 % shift at CV 3 % and show a
true null at CV 3 % as "same", each in at least 80 % of trials. Over 1,000 seeded trials
(tests/support/verdictrates.py) ±7.5 % gives 84.8 % and 80.7 % (81.7 % and 86.9 % with an A/A twin); ±5 %
leaves "same" at 32 %, ±8 % calls the shift in 79 % with a twin, ±10 % in 66 %. At n = 5 the
margin has little room: one repetition overlapping the other side already keeps a lone row's q
above 0.05.

Multiple testing (`adjust`): Benjamini-Hochberg over the primary rows a comparison tests
(scipy.stats.false_discovery_control). Under a complete null (A/A) it bounds the chance of any
false better/worse by alpha, like a family-wise correction, and when several rows really move (a
NIC change moves every network row) it keeps more of them than Holm or Bonferroni would. The rows
of one comparison come from the same VMs on the same host, so their tests are positively dependent,
the case BH is proven for; Benjamini-Yekutieli (any dependence) would cost a factor of 2.3 at
5 rows for a dependence that is not the one here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lab import stats

DEFAULT_ALPHA = 0.05
DEFAULT_MARGIN_PCT = 7.5  # the stated minimum effect: see the module docstring for why 7.5
MIN_SAMPLES = 3  # below this a side's bootstrap CI is [min, max] of a handful: no answer


class Answer(enum.StrEnum):
    BETTER = "better"  # B is better than A, by more than the margin
    WORSE = "worse"
    SAME = "same"  # B is within the margin of A
    UNKNOWN = "unknown"  # neither: more data would tell

    @property
    def decided(self) -> bool:
        return self is not Answer.UNKNOWN

    @property
    def differs(self) -> bool:
        """better or worse: "matters", in `lab explain`'s words."""
        return self in (Answer.BETTER, Answer.WORSE)


@dataclass(frozen=True)
class Margin:
    """The ratios (median B / median A) that count as the same: [low, high], low <= 1 <= high."""

    low: float
    high: float
    source: str  # "A/A band" or "stated": where it came from

    @classmethod
    def stated(cls, pct: float = DEFAULT_MARGIN_PCT) -> Margin:
        """±pct %, symmetric on a log scale: [1 / (1 + pct/100), 1 + pct/100]."""
        if not 0.0 < pct < 100.0:
            raise ValueError(f"a margin must be between 0 and 100 %, got {pct}")
        up = 1.0 + pct / 100.0
        return cls(1.0 / up, up, "stated")

    def holds(self, ratio: float) -> bool:
        return self.low <= ratio <= self.high

    def covers(self, low: float, high: float) -> bool:
        """The interval [low, high] lies inside the margin."""
        return self.low <= low and high <= self.high

    def text(self) -> str:
        """ "A/A 0.82–1.22" or "±7.5 %"."""
        if self.source == "stated":
            return f"±{(self.high - 1.0) * 100:.3g} %"
        return f"A/A {self.low:.3g}–{self.high:.3g}"

    def as_dict(self) -> dict[str, float | str]:
        return {"low": self.low, "high": self.high, "source": self.source}


def margin_for(band: tuple[float, float] | None, minimum_pct: float = DEFAULT_MARGIN_PCT) -> Margin:
    """The margin a row is judged against: the A/A band where one was measured, never narrower
    than ±minimum_pct on either side; the stated ±minimum_pct where there is no band."""
    floor = Margin.stated(minimum_pct)
    if band is None:
        return floor
    low, high = band
    if low >= floor.low and high <= floor.high:
        return floor  # a band narrower than the minimum effect on both sides: the minimum counts
    return Margin(min(low, floor.low), max(high, floor.high), "A/A band")


@dataclass(frozen=True)
class Evidence:
    """What the samples of two sides say, before any correction or margin."""

    n_a: int
    n_b: int
    ratio: float  # median(B) / median(A) (lab.stats.RatioCI conventions for zeros)
    ci: tuple[float, float]  # bootstrap CI of the ratio at 1 - alpha (shown)
    equivalence_ci: tuple[float, float]  # at 1 - 2 alpha: the TOST interval
    p: float | None  # two-sided Mann-Whitney; None with fewer than 2 values a side
    enough: bool  # n >= MIN_SAMPLES a side and the exact test can reach p < alpha at all

    @property
    def effect(self) -> float:
        """The relative change of the median, B against A: -0.62 is 62 % lower."""
        return self.ratio - 1.0


def enough(n_a: int, n_b: int, alpha: float = DEFAULT_ALPHA) -> bool:
    """Can these sample sizes give an answer at all? (3 vs 3 can never go below p = 0.10.)"""
    return n_a >= MIN_SAMPLES and n_b >= MIN_SAMPLES and stats.min_exact_p(n_a, n_b) < alpha


def evidence(
    a: stats.Values,
    b: stats.Values,
    *,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    n_resamples: int = stats.DEFAULT_N_RESAMPLES,
) -> Evidence:
    """The ratio of medians with its two CIs and the rank test's p. Deterministic for a seed."""
    check_alpha(alpha)
    shown = stats.ratio_ci(a, b, seed=seed, confidence=1.0 - alpha, n_resamples=n_resamples)
    tost = stats.ratio_ci(a, b, seed=seed, confidence=1.0 - 2.0 * alpha, n_resamples=n_resamples)
    n_a, n_b = len(a), len(b)
    return Evidence(
        n_a=n_a,
        n_b=n_b,
        ratio=shown.ratio,
        ci=(shown.ci_low, shown.ci_high),
        equivalence_ci=(tost.ci_low, tost.ci_high),
        p=stats.mann_whitney(a, b, seed=seed),
        enough=enough(n_a, n_b, alpha),
    )


def decide(
    ev: Evidence, *, higher_is_better: bool, margin: Margin, q: float | None = None, alpha: float = DEFAULT_ALPHA
) -> Answer:
    """better / worse / same / unknown for B against A. `q`: the row's p after correction for the
    other rows tested with it (`adjust`); None: the row was tested alone (q = p)."""
    check_alpha(alpha)
    if not ev.enough:
        return Answer.UNKNOWN
    q = ev.p if q is None else q
    lo, hi = ev.ci
    if q is not None and q < alpha and not lo <= 1.0 <= hi and not margin.holds(ev.ratio):
        return Answer.BETTER if (ev.ratio > 1.0) == higher_is_better else Answer.WORSE
    if margin.covers(*ev.equivalence_ci):
        return Answer.SAME
    return Answer.UNKNOWN


@dataclass(frozen=True)
class Judgement:
    """One comparison, decided: the answer and what it rests on."""

    answer: Answer
    evidence: Evidence
    q: float | None
    margin: Margin


def judge(
    a: stats.Values,
    b: stats.Values,
    *,
    higher_is_better: bool,
    margin: Margin | None = None,
    tested: int = 1,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    n_resamples: int = stats.DEFAULT_N_RESAMPLES,
) -> Judgement:
    """Two sample sets, one answer: the whole rule in one call, for a caller that tests one row
    at a time. `tested`: how many such rows the caller is asking about at once; the p-value is
    then Bonferroni-corrected (q = p * tested), a bound on what `adjust` would give over them
    all. `margin` defaults to the stated ±DEFAULT_MARGIN_PCT."""
    if tested < 1:
        raise ValueError(f"tested must be >= 1, got {tested}")
    ev = evidence(a, b, alpha=alpha, seed=seed, n_resamples=n_resamples)
    m = margin or Margin.stated()
    q = None if ev.p is None else min(1.0, ev.p * tested)
    return Judgement(decide(ev, higher_is_better=higher_is_better, margin=m, q=q, alpha=alpha), ev, q, m)


def adjust(ps: Sequence[float | None]) -> list[float | None]:
    """Benjamini-Hochberg adjusted p-values (q) of the rows tested together; None stays None and
    is not counted as a test."""
    tested = [(i, p) for i, p in enumerate(ps) if p is not None]
    out: list[float | None] = [None] * len(ps)
    if not tested:
        return out
    from scipy.stats import false_discovery_control  # imported on first use: ~1 s (see lab.stats)

    qs = false_discovery_control([p for _, p in tested], method="bh")
    for (i, _), q in zip(tested, qs, strict=True):
        out[i] = float(min(1.0, max(0.0, q)))
    return out


# -- what a plan can reach -------------------------------------------------------------------------


def best_q(n: int, rows: int) -> float:
    """The smallest q one changed primary row can reach alone among `rows` tested, n a side: the
    exact test's smallest p times the rows (BH with a single discovery)."""
    return min(1.0, stats.min_exact_p(n, n) * max(rows, 1))


def n_for_q(rows: int, alpha: float = DEFAULT_ALPHA, limit: int = 100) -> int | None:
    """The fewest repetitions a side at which one changed row among `rows` can reach q < alpha."""
    return next((n for n in range(MIN_SAMPLES, limit) if best_q(n, rows) < alpha), None)


_Z_80 = 1.2816  # |estimate| stays within this many standard errors in 80 % of trials ("reachable")
_MEDIAN_SE = math.sqrt(math.pi / 2.0)  # a normal sample's median: its standard error is 1.2533 sigma / sqrt(n)


def same_reach_cv(n: int, margin_pct: float = DEFAULT_MARGIN_PCT, alpha: float = DEFAULT_ALPHA) -> float:
    """The largest CV (a fraction) at which two identical setups measured n times each are called
    "same" within ±margin_pct in about 80 % of comparisons, by the normal approximation of the
    log ratio of two medians (the seeded bootstrap does a little better: tests/unit/test_verdicts.py)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(1.0 - alpha)  # one side of the TOST interval
    half = math.log1p(margin_pct / 100.0)
    return half / ((z + _Z_80) * _MEDIAN_SE * math.sqrt(2.0 / max(n, 1)))


def check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha must be between 0 and 0.5 (exclusive), got {alpha}")
