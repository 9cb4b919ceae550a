"""Pure: the repetition policy. How many measured repetitions a workload gets in a cell.

Fixed n (`[suite] repetitions`; a repetition flagged for its host's or client's load is measured
again, at most `remeasure_flagged` times per cell and workload, so that n unflagged ones remain
when the busy spell passes), or adaptive (`target_ci_pct`): at least `repetitions` (and at
least ADAPTIVE_MIN_N before the CI counts), then one more at a time until the 95 % bootstrap CI
of the median (lab.stats.ci_width_ok) of every throughput-like metric of the workload (higher is
better, not flagged) lies within +-target_ci_pct % of its median, or a budget is spent:
`max_repetitions`, or `max_seconds` of measured time (each cell and workload has its own budget).
Why each one stopped is recorded in the run's manifest ("repetitions").

Only throughput-like metrics steer it: latencies' tails and error counters are noisy by nature
and would spend the whole budget every time; they are measured as often as the throughputs.
Stopping when the CI is narrow enough is optional stopping: it makes the reported CI slightly
optimistic. The minimum n and the target being a width (not a verdict) keep that effect small;
comparisons still require the rank test to agree (lab.compare).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lab import flags, stats
from lab.model import Sample

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
    reason: str = ""  # why it stopped; "" while it goes on

    @property
    def stopped(self) -> bool:
        return bool(self.reason)

    def add(self, samples: Iterable[Sample], seconds: float) -> None:
        samples = list(samples)
        self.n += 1
        self.seconds += max(seconds, 0.0)
        self.load_flagged += any(flags.load_flagged(s.labels) for s in samples)
        for s in samples:
            if target_metric(s):
                self.values.setdefault(s.metric, []).append(float(s.value))

    def stop(self, reason: str) -> None:
        self.reason = reason

    def update(self, suite: Any, *, seed: int = 0) -> None:
        """Decide after a repetition whether this workload has enough (sets `reason`)."""
        self.reason = stop_reason(suite, self, seed=seed) or ""


def target_metric(s: Sample) -> bool:
    """Metrics that steer adaptive repetition: throughput-like ones from unflagged repetitions
    (a flag of the parser or of the host: lab.flags)."""
    return s.higher_is_better is True and not flags.is_flagged(s.labels) and not s.metric.startswith("cpu_")


def stop_reason(suite: Any, tally: Tally, *, seed: int = 0) -> str | None:
    """None to go on, or why to stop. `suite` is a lab.config.SuiteSection."""
    if suite.target_ci_pct is None:
        return fixed_reason(suite, tally)
    if tally.n < suite.repetitions:
        return None
    if tally.n >= ADAPTIVE_MIN_N and not tally.values:
        return f"no throughput-like metric to steer by; stopped at n = {tally.n}"
    target = suite.target_ci_pct / 100.0
    wide = [
        m for m, v in sorted(tally.values.items()) if not stats.ci_width_ok(v, target, min_n=ADAPTIVE_MIN_N, seed=seed)
    ]
    if tally.n >= ADAPTIVE_MIN_N and not wide:
        return f"95 % CI of the median within ±{suite.target_ci_pct:g} % at n = {tally.n}"
    still = f"CI still wider than ±{suite.target_ci_pct:g} % for {', '.join(wide) or 'every metric'}"
    if tally.n >= suite.max_repetitions:
        return f"budget: {suite.max_repetitions} repetitions ({still})"
    if suite.max_seconds is not None and tally.seconds >= suite.max_seconds:
        return f"budget: {suite.max_seconds:g} s measured at n = {tally.n} ({still})"
    return None


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
