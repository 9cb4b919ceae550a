"""Pure: stored samples -> per (cell, workload, metric) series, and table rows for `lab show`."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Iterable

from lab import stats
from lab.plan import BARE_METAL, TWIN_SUFFIX
from lab.store import CellRow, SampleRow

CPU_METRIC = "cpu_busy_pct"


@dataclass(frozen=True)
class Series:
    cell: str  # the cell's label (axes), which is what matches across runs
    workload: str
    metric: str
    unit: str
    higher_is_better: bool | None
    values: tuple[float, ...]
    flagged: int = 0  # repetitions whose labels say flagged (errors during the load)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.cell, self.workload, self.metric)


def series(samples: Iterable[SampleRow], cells: Iterable[CellRow]) -> list[Series]:
    labels = {c.cell_id: c.label for c in cells}
    groups: dict[tuple[str, str, str], list[SampleRow]] = {}
    for s in samples:
        groups.setdefault((labels.get(s.cell_id, s.cell_id), s.workload, s.metric), []).append(s)
    out = []
    for (cell, wl, metric), rows in groups.items():
        out.append(Series(cell, wl, metric, rows[0].unit, rows[0].higher_is_better,
                          tuple(r.value for r in rows), sum(1 for r in rows if r.labels.get("flagged"))))
    out.sort(key=lambda s: (s.workload, s.cell, s.metric))
    return out


@dataclass(frozen=True)
class ShowRow:
    workload: str
    cell: str
    metric: str
    unit: str
    n: int
    median: float
    low: float
    high: float
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
    return s.unit == "count" and s.higher_is_better is False and not any(s.values) and "retrans" not in s.metric


def show_rows(all_series: list[Series], *, everything: bool = False, seed: int = 0,
              spread: bool = False) -> list[ShowRow]:
    """One row per shown metric. `spread`: also the bootstrap CI of the median and the CV (costs a
    bootstrap per row, a millisecond or two), seeded with `seed` (the run's) so they repeat."""
    cpu = {(s.cell, s.workload, s.metric): statistics.median(s.values)
           for s in all_series if s.metric.startswith(CPU_METRIC)}
    rows = []
    for s in all_series:
        if not everything and _hidden(s):
            continue
        v = _variant(s.metric)
        busy = cpu.get((s.cell, s.workload, f"{CPU_METRIC}_{v}" if v else CPU_METRIC),
                       cpu.get((s.cell, s.workload, CPU_METRIC)))
        if s.unit == "n/a":  # a variant that could not run (na_<variant>) had no load
            busy = None
        direction = {True: "↑", False: "↓", None: ""}[s.higher_is_better]
        extra = {}
        if spread:
            summ = stats.summarize(s.values, seed=seed)
            extra = {"ci_low": summ.ci_low, "ci_high": summ.ci_high, "cv": summ.cv}
        rows.append(ShowRow(s.workload, s.cell, s.metric, s.unit, len(s.values), statistics.median(s.values),
                            min(s.values), max(s.values), busy, s.flagged, direction, **extra))
    return rows


def short_labels(cells: list[str]) -> dict[str, str]:
    """Drop the axes that are the same in every cell, so tables show only what varies. An A/A
    twin is its cell's short label + " A/A"; a bare-metal cell is "bare-metal" (with its host when
    the cells span several hosts)."""
    base = {c: c.removesuffix(TWIN_SUFFIX) for c in cells}
    bare = {c for c in cells if c.endswith("/" + BARE_METAL)}
    vms = sorted({b for c, b in base.items() if c not in bare})
    hosts = {c.split("/")[0] for c in cells}
    short_vm = _short(vms)
    out = {}
    for c in cells:
        if c in bare:
            out[c] = BARE_METAL if len(hosts) == 1 else c
        else:
            out[c] = short_vm[base[c]] + (" A/A" if c != base[c] else "")
    return out


def _short(cells: list[str]) -> dict[str, str]:
    parts = [c.split("/") for c in cells]
    if not parts:
        return {}
    width = max(len(p) for p in parts)
    varying = [i for i in range(width) if len({p[i] if i < len(p) else "" for p in parts}) > 1]
    if not varying:
        return {c: c.split("/")[2] if c.count("/") >= 2 else c for c in cells}
    return {c: "/".join(p[i] for i in varying if i < len(p)) for c, p in zip(cells, parts)}
