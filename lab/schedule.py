"""Pure: the repetition policy. How many measured repetitions a workload gets in a cell.

Fixed n (`[suite] repetitions`; a repetition flagged for its host's or client's load is measured
again, at most `remeasure_flagged` times per cell and workload, so that n unflagged ones remain
when the busy spell passes), or adaptive (`target_ci_pct`): at least `repetitions` (and at
least ADAPTIVE_MIN_N before the CI counts), then one more at a time until the 95 % bootstrap CI
of the median (lab.stats.ci_width_ok) of every throughput-like metric of the workload (higher is
better, not flagged) lies within +-target_ci_pct % of its median, or a budget is spent:
`max_repetitions`, or `max_seconds` of measured time (each cell and workload has its own budget).
Why each one stopped is recorded in the run's manifest ("repetitions").

Only throughput-like metrics steer the CI rule: latencies' tails and error counters are noisy by
nature and would spend the whole budget every time; they are measured as often as the throughputs.

Unknown gets more data. A cell alone has nothing to be better, worse or the same as; the run knows
which comparisons it will be asked (`Asked`, from lab.plan.comparison_pairs: every two matrix cells
that differ in one axis). So with adaptive repetition a workload also goes on while one of its
primary metrics (lab.workloads.PrimaryMetrics) is still "unknown" (lab.verdicts) against a partner
cell that has measured it, within the same budget. "Decided" is judged as `lab compare` will judge
it, pair by pair: the margin is the A/A band of the run's twins where they measured the metric
(never narrower than lab.verdicts.DEFAULT_MARGIN_PCT), and the p-value is Bonferroni-corrected over
the primary rows a comparison of two cells tests (a bound on compare's Benjamini-Hochberg q). A
partner measured later (sequential order) cannot be waited for: the later cell of a pair is the
one that goes on; interleaved rounds give both cells of a pair more repetitions.

Stopping when the CI is narrow enough, or when a comparison is decided, is optional stopping: it
makes the reported CI slightly optimistic and gives a null difference more looks at p < alpha. The
minimum n, the margin a verdict must clear (a null's estimate seldom leaves it) and the budget keep
that small: tests/unit/test_schedule.py measures the false better/worse rate of A/A pairs measured this
way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from lab import flags, stats, verdicts
from lab.model import Sample
from lab.workloads import PrimaryMetrics

# Below 5 repetitions the percentile bootstrap of a median is too narrow to steer by: at n = 3 it
# is [min, max], which holds the true median only 75 % of the time, so a lucky tight trio would
# stop the repetitions. Adaptive repetition therefore never stops on the CI before n = 5.
ADAPTIVE_MIN_N = 5


@dataclass
class Tally:
    """What has been measured of one workload in one cell, and whether it is enough."""

    n: int = 0  # measured repetitions
    load_flagged: int = 0  # of which flagged for the host's or client's load (lab.flags.load_flagged)
    seconds: float = 0.0  # measured time (warm-ups excluded)
    values: dict[str, list[float]] = field(default_factory=dict)  # target metric -> values
    primary: dict[str, list[float]] = field(default_factory=dict)  # primary metric -> its unflagged values
    higher: dict[str, bool] = field(default_factory=dict)  # primary metric -> higher is better
    reason: str = ""  # why it stopped; "" while it goes on

    @property
    def stopped(self) -> bool:
        return bool(self.reason)

    def add(self, samples: Iterable[Sample], seconds: float, primary: PrimaryMetrics | None = None) -> None:
        """One repetition's samples; `primary`: the workload's headline metrics, kept for `Asked`."""
        samples = list(samples)
        self.n += 1
        self.seconds += max(seconds, 0.0)
        self.load_flagged += any(flags.load_flagged(s.labels) for s in samples)
        for s in samples:
            if target_metric(s):
                self.values.setdefault(s.metric, []).append(float(s.value))
            headline = primary is not None and primary.pattern_of(s.metric) is not None
            if headline and s.higher_is_better is not None and not flags.is_flagged(s.labels):
                self.primary.setdefault(s.metric, []).append(float(s.value))
                self.higher[s.metric] = s.higher_is_better

    def stop(self, reason: str) -> None:
        self.reason = reason

    def update(self, suite: Any, *, seed: int = 0, unknown: Callable[[], list[str] | None] | None = None) -> None:
        """Decide after a repetition whether this workload has enough (sets `reason`). `unknown`:
        its primary rows still unknown against a partner cell (`Asked.unknown`)."""
        self.reason = stop_reason(suite, self, seed=seed, unknown=unknown) or ""


def target_metric(s: Sample) -> bool:
    """Metrics that steer adaptive repetition: throughput-like ones from unflagged repetitions
    (a flag of the parser or of the host: lab.flags)."""
    return s.higher_is_better is True and not flags.is_flagged(s.labels) and not s.metric.startswith("cpu_")


def stop_reason(
    suite: Any, tally: Tally, *, seed: int = 0, unknown: Callable[[], list[str] | None] | None = None
) -> str | None:
    """None to go on, or why to stop. `suite` is a lab.config.SuiteSection; `unknown` (adaptive
    only): the primary rows still unknown against a partner ("metric vs cell"), None when no
    partner has measured anything to compare with yet."""
    if suite.target_ci_pct is None:
        return fixed_reason(suite, tally)
    if tally.n < suite.repetitions:
        return None
    target = suite.target_ci_pct / 100.0
    wide = [
        m for m, v in sorted(tally.values.items()) if not stats.ci_width_ok(v, target, min_n=ADAPTIVE_MIN_N, seed=seed)
    ]
    open_rows = unknown() if unknown is not None and tally.n >= ADAPTIVE_MIN_N else None
    if tally.n >= ADAPTIVE_MIN_N and not wide and not open_rows:
        decided = ", every primary row decided against its partners" if open_rows is not None else ""
        if not tally.values:
            return f"no throughput-like metric to steer by; stopped at n = {tally.n}{decided}"
        return f"95 % CI of the median within ±{suite.target_ci_pct:g} % at n = {tally.n}{decided}"
    still = (
        "; ".join(
            ([f"CI still wider than ±{suite.target_ci_pct:g} % for {', '.join(wide)}"] if wide else [])
            + ([f"unknown: {', '.join(open_rows)}"] if open_rows else [])
        )
        or f"CI still wider than ±{suite.target_ci_pct:g} % for every metric"
    )
    if tally.n >= suite.max_repetitions:
        return f"budget: {suite.max_repetitions} repetitions ({still})"
    if suite.max_seconds is not None and tally.seconds >= suite.max_seconds:
        return f"budget: {suite.max_seconds:g} s measured at n = {tally.n} ({still})"
    return None


@dataclass(frozen=True)
class Asked:
    """The comparisons a run will be asked, as adaptive repetition sees them: the pairs of cells
    (lab.plan.comparison_pairs, the earlier cell as side A), each cell's A/A twin, and how many
    primary rows a comparison of two cells tests (lab.plan.primary_rows: its correction)."""

    pairs: tuple[tuple[str, str], ...] = ()
    twins: tuple[tuple[str, str], ...] = ()  # (cell id, its twin's id)
    rows: int = 1
    n_resamples: int = stats.DEFAULT_N_RESAMPLES  # of each bootstrap CI a decision takes

    @functools.cached_property
    def partners(self) -> dict[str, tuple[tuple[str, bool], ...]]:
        """cell id -> (the other cell, whether this one is side A) for each of its pairs."""
        out: dict[str, list[tuple[str, bool]]] = {}
        for a, b in self.pairs:
            out.setdefault(a, []).append((b, True))
            out.setdefault(b, []).append((a, False))
        return {k: tuple(v) for k, v in out.items()}

    def unknown(
        self, tallies: dict[tuple[str, str], Tally], cell: str, workload: str, *, seed: int = 0
    ) -> list[str] | None:
        """ "metric vs partner" for each primary metric of `cell`'s `workload` still unknown against a
        partner cell that has measured it (at least lab.verdicts.MIN_SAMPLES unflagged values);
        None when no partner has."""
        mine = tallies.get((cell, workload))
        if mine is None:
            return None
        out: list[str] = []
        compared = False
        bands = self.bands(tallies, workload, seed=seed)
        for other, first in self.partners.get(cell, ()):
            theirs = tallies.get((other, workload))
            for metric, values in sorted(mine.primary.items()):
                partner = theirs.primary.get(metric, []) if theirs is not None else []
                if len(partner) < verdicts.MIN_SAMPLES:
                    continue  # nothing to compare with yet
                compared = True
                a, b = (values, partner) if first else (partner, values)
                j = verdicts.judge(
                    a,
                    b,
                    higher_is_better=mine.higher[metric],
                    margin=verdicts.margin_for(bands.get(metric)),
                    tested=self.rows,
                    seed=seed,
                    n_resamples=self.n_resamples,
                )
                if not j.answer.decided:
                    out.append(f"{metric} vs {other}")
        return out if compared else None

    def bands(self, tallies: dict[tuple[str, str], Tally], workload: str, *, seed: int = 0) -> dict[str, tuple]:
        """Primary metric -> the widest A/A band the run's twins have measured for this workload."""
        found: dict[str, stats.RatioCI] = {}
        for cell, twin in self.twins:
            first, second = tallies.get((cell, workload)), tallies.get((twin, workload))
            if first is None or second is None:
                continue
            for metric, values in first.primary.items():
                again = second.primary.get(metric, [])
                if len(values) >= 2 and len(again) >= 2:
                    aa = stats.noise_floor(values, again, seed=seed, n_resamples=self.n_resamples)
                    found[metric] = stats.widest(found.get(metric), aa)
        return {m: ci.band() for m, ci in found.items()}


def fixed_reason(suite: Any, tally: Tally) -> str | None:
    """Fixed n: stop at n repetitions not flagged for load, or when the repetitions measured again
    for that (beyond n) reach remeasure_flagged."""
    n, flagged = suite.repetitions, tally.load_flagged
    again = tally.n - n  # measured beyond n: one per flagged repetition, while the budget lasts
    if tally.n - flagged < n and (tally.n < n or again < suite.remeasure_flagged):
        return None
    if not flagged:
        return f"fixed n = {n}"
    if tally.n - flagged >= n:
        return f"fixed n = {n}: {flagged} flagged for load, measured again"
    if not suite.remeasure_flagged:
        return f"fixed n = {n}: {flagged} flagged for load, {tally.n - flagged} unflagged"
    return (
        f"fixed n = {n}: {flagged} flagged for load, {again} measured again "
        f"(remeasure_flagged = {suite.remeasure_flagged}), {tally.n - flagged} unflagged"
    )


def minimum_n(suite: Any) -> int:
    """The fewest measured repetitions a workload can end with in a cell (before any is flagged):
    fixed n; adaptive, its minimum when a time budget can stop it there, else the first n at
    which the CI may stop it (ADAPTIVE_MIN_N), within max_repetitions."""
    if suite.target_ci_pct is None or suite.max_seconds is not None:
        return suite.repetitions
    return min(max(suite.repetitions, ADAPTIVE_MIN_N), suite.max_repetitions)


def planned(suite: Any) -> str:
    """How many repetitions the progress line announces: "5", or "3-30" when adaptive."""
    if suite.target_ci_pct is None:
        return str(suite.repetitions)
    return f"{suite.repetitions}-{suite.max_repetitions}"


def progress(suite: Any, tally: Tally) -> str:
    """The next repetition as the progress line shows it: "3/5", or "6/5 (again: 1 flagged for load)"."""
    text = f"{tally.n + 1}/{planned(suite)}"
    if suite.target_ci_pct is None and tally.n >= suite.repetitions:
        text += f" (again: {tally.load_flagged} flagged for load)"
    return text


def describe(suite: Any, seed: int) -> dict[str, Any]:
    """The policy, as the run's manifest records it."""
    out: dict[str, Any] = {"order": suite.order, "seed": seed, "repetitions": suite.repetitions, "warmup": suite.warmup}
    if suite.order == "interleaved":
        out["repetitions_per_boot"] = suite.repetitions_per_boot
    if suite.target_ci_pct is None:
        out["remeasure_flagged"] = suite.remeasure_flagged
    else:
        out.update(
            {
                "target_ci_pct": suite.target_ci_pct,
                "max_repetitions": suite.max_repetitions,
                "max_seconds": suite.max_seconds,
                # and until the primary rows are decided against their partners (Asked), judged so
                "decide": {"margin_pct": verdicts.DEFAULT_MARGIN_PCT, "alpha": verdicts.DEFAULT_ALPHA},
            }
        )
    out["foreign_load_pct"] = suite.foreign_load_pct  # the threshold samples were flagged at
    out["client_saturated_pct"] = suite.client_saturated_pct
    out["quiet"] = {"seconds": suite.quiet_seconds, "timeout_s": suite.quiet_timeout_s}
    return out


def outcome(tallies: dict[tuple[str, str], Tally]) -> dict[str, dict[str, dict[str, Any]]]:
    """cell -> workload -> {n, seconds, stopped}: what the policy did, for the manifest."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (cell, workload), t in sorted(tallies.items()):
        out.setdefault(cell, {})[workload] = {
            "n": t.n,
            "load_flagged": t.load_flagged,
            "seconds": round(t.seconds, 2),
            "stopped": t.reason or "not finished",
        }
    return out


def skipped(tallies: dict[tuple[str, str], Tally], cell_id: str) -> dict[str, str]:
    """The workloads a cell skipped (the bare-metal cell: a tool the host lacks), and why."""
    return {
        w: t.reason.removeprefix("skipped: ")
        for (c, w), t in sorted(tallies.items())
        if c == cell_id and t.reason.startswith("skipped: ")
    }
