"""Pure: stored samples -> per (cell, workload, metric) series, and table rows for `lab show`.

A series keeps its flagged samples apart (lab.flags): `values` are the ones that count (medians,
CIs, verdicts), `flagged_values` are shown beside them, never averaged in. The host's load under
the samples (lab.hostload) is summed up per repetition: `flagged_repetitions`, `host_load`.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lab import axes, flags, stats
from lab.model import BARE_METAL, TWIN_SUFFIX
from lab.store import CellRow, SampleRow

CPU_METRIC = "cpu_busy_pct"


@dataclass(frozen=True)
class Series:
    cell: str  # the cell's label (axes), which is what matches across runs
    workload: str
    metric: str
    unit: str
    higher_is_better: bool | None
    values: tuple[float, ...]  # the samples that count: no flag holds them (lab.flags)
    flagged_values: tuple[float, ...] = ()  # shown, never averaged in
    reasons: tuple[str, ...] = ()  # why they are flagged, each reason once

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.cell, self.workload, self.metric)

    @property
    def flagged(self) -> int:
        return len(self.flagged_values)


def series(samples: Iterable[SampleRow], cells: Iterable[CellRow]) -> list[Series]:
    labels = {c.cell_id: c.label for c in cells}
    groups: dict[tuple[str, str, str], list[SampleRow]] = {}
    for s in samples:
        groups.setdefault((labels.get(s.cell_id, s.cell_id), s.workload, s.metric), []).append(s)
    out = []
    for (cell, wl, metric), rows in groups.items():
        why = [flags.reasons(r.labels) for r in rows]
        out.append(
            Series(
                cell,
                wl,
                metric,
                rows[0].unit,
                rows[0].higher_is_better,
                tuple(r.value for r, w in zip(rows, why) if not w),
                tuple(r.value for r, w in zip(rows, why) if w),
                tuple(dict.fromkeys(x for w in why for x in w)),
            )
        )
    out.sort(key=lambda s: (s.workload, s.cell, s.metric))
    return out


@dataclass(frozen=True)
class FlaggedRepetition:
    """One repetition of a workload in a cell whose samples (all or some) are flagged."""

    cell: str  # label
    cell_id: str
    workload: str
    repetition: int
    round: int | None
    reasons: tuple[str, ...]
    metrics: int  # how many of its samples are flagged


def flagged_repetitions(samples: Iterable[SampleRow], cells: Iterable[CellRow]) -> list[FlaggedRepetition]:
    labels = {c.cell_id: c.label for c in cells}
    found: dict[tuple[str, str, int], tuple[dict[str, None], int, int | None]] = {}
    for s in samples:
        why = flags.reasons(s.labels)
        if not why:
            continue
        key = (s.cell_id, s.workload, s.repetition)
        reasons, n, rnd = found.get(key, ({}, 0, s.labels.get("round")))
        reasons.update(dict.fromkeys(why))
        found[key] = (reasons, n + 1, rnd)
    return [
        FlaggedRepetition(labels.get(cid, cid), cid, wl, rep, rnd, tuple(reasons), n)
        for (cid, wl, rep), (reasons, n, rnd) in sorted(found.items())
    ]


@dataclass(frozen=True)
class HostLoadSummary:
    """The host's load under a set of samples, one figure per repetition (lab.hostload)."""

    repetitions: int  # repetitions whose load was measured
    median_pct: float | None  # foreign load, % of one core
    max_pct: float | None
    max_steal_pct: float | None
    flagged: int  # repetitions flagged by the host
    unknown: int  # repetitions whose host could not tell

    def text(self) -> str:
        if not self.repetitions and not self.unknown:
            return "not measured"
        if not self.repetitions:
            return f"cannot tell ({self.unknown} repetitions)"
        out = (
            f"foreign load median {self.median_pct:.0f} %, max {self.max_pct:.0f} % of one core over "
            f"{self.repetitions} repetitions"
        )
        if self.max_steal_pct is not None:
            out += f", steal max {self.max_steal_pct:.0f} %"
        return out + (f", {self.flagged} flagged" if self.flagged else "")


def host_load(samples: Iterable[SampleRow]) -> HostLoadSummary:
    per_rep: dict[tuple[str, str, int], dict] = {}
    for s in samples:
        host = s.labels.get(flags.HOST_LOAD)
        if isinstance(host, dict):
            per_rep.setdefault((s.cell_id, s.workload, s.repetition), host)
    foreign = [h["foreign_pct"] for h in per_rep.values() if isinstance(h.get("foreign_pct"), (int, float))]
    steal = [h["steal_pct"] for h in per_rep.values() if isinstance(h.get("steal_pct"), (int, float))]
    return HostLoadSummary(
        len(foreign),
        statistics.median(foreign) if foreign else None,
        max(foreign) if foreign else None,
        max(steal) if steal else None,
        sum(1 for h in per_rep.values() if h.get("flag")),
        sum(1 for h in per_rep.values() if h.get("unknown")),
    )


@dataclass(frozen=True)
class ShowRow:
    workload: str
    cell: str
    metric: str
    unit: str
    n: int  # samples that count
    median: float | None  # None: every sample is flagged
    low: float | None
    high: float | None
    cpu_busy: float | None  # median guest CPU busy % during this workload in this cell
    flagged: int
    direction: str  # "↑" higher is better, "↓" lower is better, "" informational
    ci_low: float = math.nan  # 95 % bootstrap CI of the median (lab.stats.summarize)
    ci_high: float = math.nan
    cv: float | None = None  # coefficient of variation (stdev / |mean|), None if n < 2 or mean 0


def _variant(metric: str) -> str:
    """The variant suffix a workload puts on a metric (e.g. _c10 for 10 connections, _1t for one
    thread, _rx/_tx for a direction, _podman-host for a container network), or "". A candidate only:
    callers use it when a `cpu_busy_pct_<variant>` was measured, else the workload's overall one."""
    head, _, tail = metric.rpartition("_")
    return tail if head and re.fullmatch(r"[a-z0-9][a-z0-9.-]*", tail) else ""


def _hidden(s: Series) -> bool:
    """Rows `lab show` leaves out by default: CPU figures (they have their own column) and error
    counters that stayed at zero (non-zero ones are shown and flagged)."""
    if s.metric.startswith("cpu_"):
        return True
    return (
        s.unit == "count"
        and s.higher_is_better is False
        and not any(s.values + s.flagged_values)
        and "retrans" not in s.metric
    )


def show_rows(
    all_series: list[Series], *, everything: bool = False, seed: int = 0, spread: bool = False
) -> list[ShowRow]:
    """One row per shown metric. `spread`: also the bootstrap CI of the median and the CV (costs a
    bootstrap per row, a millisecond or two), seeded with `seed` (the run's) so they repeat."""
    cpu = {
        (s.cell, s.workload, s.metric): statistics.median(s.values)
        for s in all_series
        if s.metric.startswith(CPU_METRIC) and s.values
    }
    rows = []
    for s in all_series:
        if not everything and _hidden(s):
            continue
        v = _variant(s.metric)
        busy = cpu.get(
            (s.cell, s.workload, f"{CPU_METRIC}_{v}" if v else CPU_METRIC), cpu.get((s.cell, s.workload, CPU_METRIC))
        )
        if s.unit == "n/a":  # a variant that could not run (na_<variant>) had no load
            busy = None
        direction = {True: "↑", False: "↓", None: ""}[s.higher_is_better]
        extra: dict[str, Any] = {}
        if spread and s.values:
            summ = stats.summarize(s.values, seed=seed)
            extra = {"ci_low": summ.ci_low, "ci_high": summ.ci_high, "cv": summ.cv}
        counted = s.values
        rows.append(
            ShowRow(
                s.workload,
                s.cell,
                s.metric,
                s.unit,
                len(counted),
                statistics.median(counted) if counted else None,
                min(counted) if counted else None,
                max(counted) if counted else None,
                busy,
                s.flagged,
                direction,
                **extra,
            )
        )
    return rows


def short_labels(cells: list[str]) -> dict[str, str]:
    """Drop the axes that are the same in every cell, so tables show only what varies. An A/A
    twin is its cell's short label + " A/A"; a bare-metal cell is "bare-metal" (with its host when
    the cells span several hosts), plus its isolation when it is not the host itself."""
    base = {c: c.removesuffix(TWIN_SUFFIX) for c in cells}
    bare = {c for c in cells if c.split("/")[1:2] == [BARE_METAL]}
    vms = sorted({b for c, b in base.items() if c not in bare})
    hosts = {c.split("/")[0] for c in cells}
    short_vm = _short(vms)
    out = {}
    for c in cells:
        if c in bare:
            out[c] = c.split("/", 1)[1] if len(hosts) == 1 else c
        else:
            out[c] = short_vm[base[c]] + (" A/A" if c != base[c] else "")
    return out


MANDATORY = sum(1 for a in axes.AXES_TABLE if not a.optional)  # the positional parts of a label


def _parts(label: str) -> list[str]:
    """A VM cell's label as parts that line up across cells: the mandatory axes by position, then
    every optional axis as name=value, its default where the label leaves it out (lab.axes)."""
    parts = label.split("/")
    named = dict(p.split("=", 1) for p in parts[MANDATORY:] if "=" in p)
    value = {a.name: named.get(a.name, a.plain(a.default)) for a in axes.AXES_TABLE if a.optional}
    # an axis that means nothing for the cell (a VM cell's container runtime) is an empty part
    moot = axes.moot(value)
    return parts[:MANDATORY] + [f"{n}={v}" if n not in moot else "" for n, v in value.items()]


def _short(cells: list[str]) -> dict[str, str]:
    parts = [_parts(c) for c in cells]
    if not parts:
        return {}
    width = max(len(p) for p in parts)
    # an empty part (an axis moot for its cell) differs from nothing
    varying = [i for i in range(width) if len({p[i] if i < len(p) else "" for p in parts} - {""}) > 1]
    if not varying:
        return {c: c.split("/")[2] if c.count("/") >= 2 else c for c in cells}
    return {c: "/".join(p[i] for i in varying if i < len(p) and p[i]) for c, p in zip(cells, parts)}


def fmt(v: float | None) -> str:
    """A number as every table shows it (`lab show`, `lab compare`, the report)."""
    if v is None:
        return "–"
    if isinstance(v, float) and math.isinf(v):
        return "∞" if v > 0 else "−∞"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    if a == 0:
        return "0"
    return f"{v:.3g}"
