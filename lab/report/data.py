"""What the report shows of one run, read from the store once, and how its numbers read."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from lab import compare as compare_mod, flags, results
from lab.store import CellRow, RunRow, SampleRow, Store

RUN_COLOURS = ("#4878a8", "#e08a2c")  # side A, side B (colour-blind safe pair)
CPU_COLOURS = ("#8fb0d0", "#f0c08a")
FLAG_COLOUR = "#c0392b"
VERDICT_CLASS = {
    compare_mod.Verdict.BETTER: "better",
    compare_mod.Verdict.WORSE: "worse",
    compare_mod.Verdict.SAME: "same",
    compare_mod.Verdict.UNKNOWN: "unknown",
    compare_mod.Verdict.EXPLORATORY: "info",
    compare_mod.Verdict.NOT_ENOUGH: "notenough",
    compare_mod.Verdict.MISSING_A: "missing",
    compare_mod.Verdict.MISSING_B: "missing",
    compare_mod.Verdict.INFORMATIONAL: "info",
    compare_mod.Verdict.ONLY_FLAGGED: "missing",
}


# -- formatting ----------------------------------------------------------------------------------


def pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:.1f} %"


def p_text(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.3f}" if v >= 0.001 else f"{v:.1e}"


def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts)) if ts else "–"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def direction(higher_is_better: bool | None) -> str:
    return {True: "↑", False: "↓", None: ""}[higher_is_better]


# -- what the store holds, per run ---------------------------------------------------------------

Key = tuple[str, str, str]  # (cell label, workload, metric): what matches across runs


@dataclass
class RunData:
    run: RunRow
    side: str  # "A" or "B"
    colour: str
    cells: list[CellRow]
    samples: list[SampleRow]
    series: dict[Key, results.Series]
    points: dict[Key, list[tuple[float, bool]]]  # every repetition: (value, flagged)
    config_text: str
    lab_version: str
    hosts: dict[str, dict[str, Any]]
    cell_status: dict[str, CellRow] = field(default_factory=dict)  # by label
    executions: list = field(default_factory=list)  # the executed order (Store.timings.executions)


def _lab_version(store: Store, run_id: str) -> str:
    # RunRow has no lab_version; the column is in the schema since migration 1.
    row = store.db.execute("SELECT lab_version FROM runs WHERE id = ?", (run_id,)).fetchone()
    return (row[0] or "") if row else ""


def load(store: Store, run: RunRow, side: str) -> RunData:
    cells = store.cells(run.id)
    samples = store.samples(run.id)
    labels = {c.cell_id: c.label for c in cells}
    points: dict[Key, list[tuple[float, bool]]] = {}
    for s in samples:
        points.setdefault((labels.get(s.cell_id, s.cell_id), s.workload, s.metric), []).append(
            (s.value, flags.is_flagged(s.labels))
        )
    all_series = results.series(samples, cells)
    return RunData(
        run=run,
        side=side,
        colour=RUN_COLOURS[0 if side == "A" else 1],
        cells=cells,
        samples=samples,
        series={s.key: s for s in all_series},
        points=points,
        config_text=store.config_text(run.id),
        lab_version=_lab_version(store, run.id),
        hosts=store.host_facts.of_run(run.id),
        cell_status={c.label: c for c in cells},
        executions=store.timings.executions(run.id),
    )


def visible(s: results.Series) -> bool:
    """The metrics `lab show` shows by default (CPU figures go in their own column)."""
    return bool(results.show_rows([s]))


def cpu_metric_for(metric: str, available: set[str]) -> str | None:
    """The guest CPU busy % metric measured with `metric` (same rule as lab.results.show_rows)."""
    v = results._variant(metric)
    if v and f"{results.CPU_METRIC}_{v}" in available:
        return f"{results.CPU_METRIC}_{v}"
    return results.CPU_METRIC if results.CPU_METRIC in available else None


def categories(sides: list[RunData]) -> list[str]:
    cats: list[str] = []
    for rd in sides:
        for c in rd.cells:
            if c.label not in cats:
                cats.append(c.label)
        for key in rd.series:  # samples of a cell the cells table does not know (should not happen)
            if key[0] not in cats:
                cats.append(key[0])
    return cats
