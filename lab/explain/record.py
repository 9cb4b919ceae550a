"""What a follow-up run keeps of its explanation, and the explanation read back from the store.

A follow-up run's manifest holds, under "explain", the whole question and what has been measured
for it so far: the two cells, the knobs, what cannot be tested, each phase's design, and for every
point of the design the cells that hold its samples (cells of the parent run, of earlier follow-up
runs, of this run). The last follow-up run of a question therefore says everything `lab explain`
printed, and `lab report` (and `lab explain` run again) rebuild the analysis from it and the
stored samples, the same figures for the same seed.

Reading the store only: no configuration, runner or backend.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lab import analysis, flags, results, stats, verdicts
from lab.clientload import CLIENT_LOAD
from lab.explain import effects
from lab.explain.design import Levels, interactions_estimable
from lab.explain.knobs import Knob, Untestable
from lab.store import CellRow, RunRow, SampleRow, Store
from lab.workloads import load_all

KEY = "explain"  # the manifest key of a follow-up run
Source = tuple[str, str]  # (run id, cell id)


@dataclass(frozen=True)
class Side:
    run: str
    cell: str  # cell id
    label: str
    selector: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Record:
    a: Side
    b: Side
    metrics: list[tuple[str, str]]  # (workload, metric) explained
    knobs: list[Knob]
    untestable: list[Untestable]
    same_in_effect: list[dict[str, Any]]  # knobs whose two values give one configuration here
    method: str  # factorial | revert
    margin_pct: float
    seed: int
    max_rounds: int
    phases: list[dict[str, Any]] = field(default_factory=list)  # kind, note, points, run
    sources: dict[Levels, list[Source]] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)  # the follow-up runs, oldest first

    @property
    def k(self) -> int:
        return len(self.knobs)

    @property
    def parents(self) -> list[str]:
        return list(dict.fromkeys([self.a.run, self.b.run]))

    @property
    def question_id(self) -> str:
        """The same question (cells, knobs, metrics, method) asked again has the same id."""
        text = json.dumps(
            [self.a.run, self.a.cell, self.b.run, self.b.cell, self.metrics, [k.as_dict() for k in self.knobs]]
            + [self.method],
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def workloads(self) -> list[str]:
        return list(dict.fromkeys(w for w, _ in self.metrics))

    def kinds(self) -> list[str]:
        return [p["kind"] for p in self.phases]

    def active(self) -> list[int]:
        """The knobs the active phase measured in full factorial (empty before it)."""
        found = [p.get("active") for p in self.phases if p["kind"] == "active"]
        return list(found[-1]) if found and found[-1] else []

    def pairs(self) -> list[tuple[int, int]]:
        if self.method == "revert":
            return []
        return interactions_estimable(self.kinds(), self.k, self.active())

    def rounds_used(self) -> int:
        return sum(1 for p in self.phases if p["kind"] == "more")

    def as_dict(self) -> dict[str, Any]:
        return {
            "question_id": self.question_id,
            "parent": self.a.run,
            "parents": self.parents,
            "a": self.a.as_dict(),
            "b": self.b.as_dict(),
            "metrics": [list(m) for m in self.metrics],
            "knobs": [k.as_dict() for k in self.knobs],
            "untestable": [u.as_dict() for u in self.untestable],
            "same_in_effect": self.same_in_effect,
            "method": self.method,
            "margin_pct": self.margin_pct,
            "seed": self.seed,
            "max_rounds": self.max_rounds,
            "phases": self.phases,
            "points": [{"levels": list(lv), "sources": [list(s) for s in src]} for lv, src in self.sources.items()],
            "runs": self.runs,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        return cls(
            a=Side(**d["a"]),
            b=Side(**d["b"]),
            metrics=[(w, m) for w, m in d["metrics"]],
            knobs=[Knob.from_dict(k) for k in d["knobs"]],
            untestable=[Untestable.from_dict(u) for u in d["untestable"]],
            same_in_effect=list(d.get("same_in_effect") or []),
            method=d["method"],
            margin_pct=float(d["margin_pct"]),
            seed=int(d["seed"]),
            max_rounds=int(d.get("max_rounds", 0)),
            phases=list(d.get("phases") or []),
            sources={tuple(p["levels"]): [(r, c) for r, c in p["sources"]] for p in d.get("points") or []},
            runs=list(d.get("runs") or []),
        )

    def add_sources(self, levels: Levels, found: Iterable[Source]) -> None:
        mine = self.sources.setdefault(levels, [])
        for s in found:
            if tuple(s) not in mine:
                mine.append(tuple(s))  # type: ignore[arg-type]


# -- reading it back -----------------------------------------------------------------------------------


def follow_ups(store: Store, run: RunRow | None = None) -> list[RunRow]:
    """Every follow-up run of `run` (or every follow-up run of the store), oldest first."""
    out = []
    for r in store.runs():
        rec = r.manifest.get(KEY)
        if isinstance(rec, dict) and (run is None or run.id in (rec.get("parents") or [])):
            out.append(r)
    return out


def latest(store: Store, runs: Iterable[RunRow]) -> list[Record]:
    """The newest record of each question the runs hold, in the order the questions were asked."""
    found: dict[str, Record] = {}
    for r in runs:
        raw = r.manifest.get(KEY)
        if isinstance(raw, dict):
            rec = Record.from_dict(raw)
            found.pop(rec.question_id, None)
            found[rec.question_id] = rec
    return list(found.values())


def of_run(store: Store, run: RunRow) -> list[Record]:
    """The explanations a run is part of: its own (a follow-up run), or its follow-ups' (a parent)."""
    if isinstance(run.manifest.get(KEY), dict):
        own = Record.from_dict(run.manifest[KEY])
        family = [r for r in follow_ups(store) if (r.manifest[KEY].get("question_id") == own.question_id)]
        return latest(store, family)
    return latest(store, follow_ups(store, run))


class Samples:
    """The samples of the cells a record names, read once per run."""

    def __init__(self, store: Store):
        self.store = store
        self._cells: dict[str, dict[str, CellRow]] = {}
        self._samples: dict[str, list[SampleRow]] = {}

    def cells(self, run_id: str) -> dict[str, CellRow]:
        if run_id not in self._cells:
            self._cells[run_id] = {c.cell_id: c for c in self.store.cells(run_id)}
        return self._cells[run_id]

    def resolve(self, source: Source) -> Source | None:
        """The cell that holds a source's samples: itself when done, the earlier cell a duplicate
        points at (same effective configuration), None when it has none (failed, n/a, pending)."""
        run_id, cell_id = source
        cell = self.cells(run_id).get(cell_id)
        if cell is None:
            return None
        if cell.status == "duplicate" and cell.facts.get("duplicate_of"):
            return self.resolve((run_id, str(cell.facts["duplicate_of"])))
        return source if cell.status == "done" else None

    def rows(self, source: Source, workload: str) -> list[SampleRow]:
        found = self.resolve(source)
        if found is None:
            return []
        run_id, cell_id = found
        if run_id not in self._samples:
            self._samples[run_id] = self.store.samples(run_id)
        return [s for s in self._samples[run_id] if s.cell_id == cell_id and s.workload == workload]


def points(record: Record, samples: Samples, workload: str, metric: str) -> list[effects.Point]:
    """Per point, the samples of one metric that count (lab.flags), pooled over its sources."""
    out = []
    for levels, sources in record.sources.items():
        values = [
            s.value
            for src in dict.fromkeys(samples.resolve(x) for x in sources)
            if src is not None
            for s in samples.rows(src, workload)
            if s.metric == metric and not flags.is_flagged(s.labels)
        ]
        out.append(effects.Point(levels, tuple(values)))
    return out


def load_points(record: Record, samples: Samples, workload: str, which: str) -> list[effects.Point]:
    """Per point, one value per measured repetition of a load figure: "host" (foreign load on the
    host, % of one core) or "client" (the load generator's machine busy %)."""
    out = []
    for levels, sources in record.sources.items():
        per_rep: dict[tuple[Source, int], float] = {}
        for src in dict.fromkeys(samples.resolve(x) for x in sources):
            if src is None:
                continue
            for s in samples.rows(src, workload):
                value = flags.foreign_pct(s.labels) if which == "host" else _client_busy(s.labels)
                if value is not None:
                    per_rep.setdefault((src, s.repetition), value)
        out.append(effects.Point(levels, tuple(per_rep.values())))
    return out


def _client_busy(labels: dict[str, Any]) -> float | None:
    window = labels.get(CLIENT_LOAD)
    value = window.get("busy_pct") if isinstance(window, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def metric_facts(samples: Samples, record: Record, workload: str, metric: str) -> tuple[str, bool | None]:
    """(unit, higher_is_better) of a metric, from its first sample in the record's cells."""
    for sources in record.sources.values():
        for src in sources:
            for s in samples.rows(src, workload):
                if s.metric == metric:
                    return s.unit, s.higher_is_better
    return "", None


def margins(store: Store, record: Record) -> dict[tuple[str, str], verdicts.Margin]:
    """(workload, metric) -> the margin its verdicts are judged against: the parent runs' A/A band
    (their twins) where measured, never narrower than the stated minimum effect."""
    bands: dict[tuple[str, str], stats.RatioCI] = {}
    for rid in record.parents:
        run = store.run(rid)
        series = results.series(store.samples(run.id), store.cells(run.id))
        for wm, ci in analysis.noise_floor(series, seed=run.seed or 0).items():
            bands[wm] = stats.widest(bands.get(wm), ci)
    return {
        wm: verdicts.margin_for(bands[wm].band() if wm in bands else None, record.margin_pct) for wm in record.metrics
    }


def context_metrics(samples: Samples, record: Record, workload: str, metric: str) -> dict[str, str]:
    """The figures measured beside a metric (its guest CPU busy %, retransmits, the workload's
    other secondary metrics of the same variant): metric -> unit. Primary metrics are not among
    them; zero counters are left out as `lab show` leaves them out."""
    known = load_all().get(workload)
    variant = results._variant(metric)
    seen: dict[str, list[SampleRow]] = {}
    for sources in record.sources.values():
        for src in sources:
            for s in samples.rows(src, workload):
                seen.setdefault(s.metric, []).append(s)
    out = {}
    for m, rows in sorted(seen.items()):
        if m == metric or m.startswith("na_") or (known and known.primary_metrics.pattern_of(m)):
            continue
        if variant and results._variant(m) != variant and m != results.CPU_METRIC:
            continue
        if m.startswith("cpu_") and not m.startswith(results.CPU_METRIC):
            continue
        if rows[0].unit == "count" and not any(r.value for r in rows) and "retrans" not in m:
            continue
        out[m] = rows[0].unit
    if variant and f"{results.CPU_METRIC}_{variant}" in out:
        out.pop(results.CPU_METRIC, None)  # the variant's own CPU figure stands for it
    return out


def parts_of(workload: str, metric: str, available: Iterable[str]) -> list[str]:
    """The part metrics (a build's steps) whose sum is `metric`, as its workload declares them
    (lab.workloads.PrimaryMetrics.parts), among the metrics measured."""
    known = load_all().get(workload)
    if known is None:
        return []
    pattern = known.primary_metrics.pattern_of(metric)
    if not pattern or not known.primary_metrics.parts or "*" not in pattern:
        return []
    head, _, tail = pattern.partition("*")
    match = re.fullmatch(re.escape(head) + "(.*)" + re.escape(tail), metric)
    if match is None:
        return []
    wild = match.group(1)
    wanted = [p.replace("*", wild, 1) for p in known.primary_metrics.parts]
    have = set(available)
    return [m for m in wanted if m in have and not fnmatch.fnmatchcase(m, pattern)]
