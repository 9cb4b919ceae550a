"""An explanation from question to answer: its phases, each a normal run of follow-up cells.

1. The first design (lab.explain.design): the 2^k factorial, a resolution-IV fraction, or B with one
   knob reverted at a time. Points the store already holds (the parent's two corners, cells of an
   earlier follow-up or of another run of the lab with the same configuration) are reused.
2. While a knob's main effect is unknown: more repetitions of the points that decide it (another
   run of the same cells), at most `max_rounds` times in all (Pinpoint's "measure more").
3. After a fraction: the full factorial of the knobs found to matter, every other knob at A.

Each run is lab.runner's, handed the follow-up cells (lab.explain.followup): the same lifecycle,
store, host-load flags, remeasure, progress, lanes; its manifest records the question and the
design so far (lab.explain.record), so the run is a child of its parent (`lab show` says so).
Asking the same question again continues where the last follow-up run stopped: an interrupted
run is resumed (`lab run --resume`'s machinery), a finished question is only analysed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lab import plan, runner
from lab.errors import UsageError
from lab.explain import design as dsn, explanation as expl, followup, record as rec
from lab.explain.design import Levels
from lab.labconfig import LabConfig
from lab.lifecycle import Reporter
from lab.store import Store


@dataclass
class Group:
    """The cells of a phase that share the workloads' parameters: one follow-up run."""

    params: dict[str, dict[str, Any]]
    cfg: LabConfig
    cells: dict[Levels, plan.Cell]
    estimate_s: float = 0.0
    run_id: str = ""
    resume: bool = False  # the run exists and did not finish: continued (lab run --resume's machinery)


@dataclass
class Phase:
    design: dsn.Design
    reused: dict[Levels, list[rec.Source]]  # points already measured, and where
    todo: list[Levels]  # points measured now
    groups: list[Group]
    active: list[int] = field(default_factory=list)  # the knobs an "active" phase factorialises
    resumed: bool = False  # the last phase again: its runs that did not finish

    @property
    def cells(self) -> int:
        return len(self.todo)

    @property
    def estimate_s(self) -> float:
        return sum(g.estimate_s for g in self.groups)


class Session:
    def __init__(
        self,
        store: Store,
        record: rec.Record,
        base: followup.Base,
        lab_name: str,
        *,
        repetitions: int | None = None,
    ):
        self.store, self.record, self.base, self.lab_name = store, record, base, lab_name
        self.repetitions = repetitions
        self.reused_said: dict[Levels, list[rec.Source]] = {}

    # -- planning ---------------------------------------------------------------------------------------
    def check(self) -> LabConfig:
        """The follow-up lab of A's parameters, checked: a knob a host cannot flip fails here."""
        return self._lab(followup.point_params(self.base, self.record.knobs, (0,) * self.record.k, self.workloads))

    @property
    def workloads(self) -> list[str]:
        return self.record.workloads

    def _lab(self, params: dict[str, dict[str, Any]]) -> LabConfig:
        return followup.lab_for(
            self.base, self.record.knobs, params, workloads=self.workloads, repetitions=self.repetitions
        )

    def next_phase(self, ex: expl.Explanation | None) -> Phase | None:
        """What to measure next, from what the record holds and the explanation so far (None:
        the explanation is complete, or no more measuring can help)."""
        r = self.record
        unfinished = self._unfinished()
        if unfinished is not None:
            return unfinished
        stuck = ex.stuck() if ex else []
        d = dsn.next_design(
            r.k,
            r.method,
            [(p["kind"], [tuple(x) for x in p["points"]]) for p in r.phases],
            stuck=stuck,
            mattering=ex.mattering() if ex else [],
            max_rounds=r.max_rounds,
        )
        if d is None:
            return None
        if d.kind == "more":
            names = ", ".join(r.knobs[j].name for j in stuck)
            d = dsn.Design(d.kind, d.k, d.points, f"{len(d.points)} cells again: {names} still unknown")
        return self._phase(d, d.points, again=d.kind == "more", active=_active_of(d))

    def _phase(
        self, d: dsn.Design, points: tuple[Levels, ...] | list[Levels], *, again: bool = False, active=None
    ) -> Phase:
        runs = followup.candidate_runs(self.store, self.record, self.lab_name)
        reused: dict[Levels, list[rec.Source]] = {}
        todo: list[Levels] = []
        for levels in points:
            axes = followup.point_axes(self.base, self.record.knobs, levels)
            params = followup.point_params(self.base, self.record.knobs, levels, self.workloads)
            found = followup.reusable(self.store, runs, axes, params, followup.image_digest(str(axes["image"])))
            if found:
                reused[levels] = found
            if again or not found:
                todo.append(levels)
        return Phase(d, reused, todo, self._groups(todo), list(active or []))

    def _groups(self, todo: list[Levels]) -> list[Group]:
        by_params: dict[str, tuple[dict[str, dict[str, Any]], list[Levels]]] = {}
        for levels in todo:
            params = followup.point_params(self.base, self.record.knobs, levels, self.workloads)
            key = repr(sorted((w, sorted(p.items(), key=str)) for w, p in params.items()))
            by_params.setdefault(key, (params, []))[1].append(levels)
        groups = []
        for params, points in by_params.values():
            cfg = self._lab(params)
            cells = followup.cells_for(cfg, self.base, self.record.knobs, points)
            seconds = runner.estimate_seconds(cfg, units_of(cells), plan.equivalents(cfg, units_of(cells)), self.store)
            groups.append(Group(params, cfg, cells, seconds))
        return groups

    def _unfinished(self) -> Phase | None:
        """The last phase again when one of its runs did not finish (interrupted, or never
        started): those runs, continued or started; None when every run of it ended."""
        if not self.record.phases:
            return None
        entry = self.record.phases[-1]
        known = {r.id: r for r in self.store.runs()}
        left: list[Group] = []
        todo: list[Levels] = []
        for made in entry.get("runs") or []:
            found = known.get(made["run"])
            if found is not None and found.status not in ("interrupted", "running"):
                continue  # done, or failed: its failed cells are said, not retried forever
            points = [tuple(p) for p in made["points"]]
            for g in self._groups(points):
                g.run_id, g.resume = made["run"], found is not None
                left.append(g)
            todo += points
        if not left:
            return None
        d = dsn.Design(entry["kind"], self.record.k, tuple(tuple(p) for p in entry["points"]), entry["note"])
        return Phase(d, {}, todo, left, list(entry.get("active") or []), resumed=True)

    # -- running ----------------------------------------------------------------------------------------
    def run(self, phase: Phase, reporter: Reporter) -> list[str]:
        """Measure a phase's cells, one normal run per parameter group; the runs' ids. The record
        names every run of the phase and its cells before the first one starts, so an interrupted
        phase is found and continued by asking again."""
        r = self.record
        if not phase.resumed:
            for g in phase.groups:
                g.run_id = runner.new_run_id()
                r.runs.append(g.run_id)
                for levels, cell in g.cells.items():
                    r.add_sources(levels, [(g.run_id, cell.id)])
            for levels, found in phase.reused.items():
                r.add_sources(levels, found)
            r.phases.append(
                {
                    "kind": phase.design.kind,
                    "note": phase.design.note,
                    "points": [list(p) for p in phase.design.points],
                    "todo": [list(p) for p in phase.todo],
                    "active": phase.active,
                    "runs": [{"run": g.run_id, "points": [list(p) for p in g.cells]} for g in phase.groups],
                }
            )
        made = []
        for g in phase.groups:
            prepared = runner.prepare(g.cfg, units_of(g.cells))
            runner.run_lab(
                g.cfg,
                self.store,
                reporter,
                run_id=None if g.resume else g.run_id,
                config_text=followup.config_text(self.base, r.parents),
                prepared=prepared,
                resume=g.run_id if g.resume else None,
                record={rec.KEY: r.as_dict()},
            )
            made.append(g.run_id)
        self.save()
        return made

    def save(self) -> None:
        """Put the record as it stands in the newest follow-up run's manifest: the last one names
        every phase, point and cell of the question."""
        known = {r.id: r for r in self.store.runs()}
        last = next((known[rid] for rid in reversed(self.record.runs) if rid in known), None)
        if last is not None:
            self.store.update_manifest(last.id, {**last.manifest, rec.KEY: self.record.as_dict()})


def _active_of(d: dsn.Design) -> list[int]:
    """The knobs an "active" design factorialises: those that take both values in it."""
    if d.kind != "active":
        return []
    return [j for j in range(d.k) if len({p[j] for p in d.points}) == 2]


def units_of(cells: dict[Levels, plan.Cell]) -> list[plan.Unit]:
    """A group's cells as the runner's plan, in matrix order (two points may share a cell)."""
    return sorted(set(cells.values()), key=lambda c: c.index)


def resumed_record(store: Store, fresh: rec.Record) -> rec.Record:
    """The record of the same question stored by an earlier `lab explain`, else `fresh`: asking
    again continues (and the cells measured for it stay its cells)."""
    for found in reversed(rec.follow_ups(store)):
        raw = found.manifest.get(rec.KEY) or {}
        if raw.get("question_id") == fresh.question_id:
            old = rec.Record.from_dict(raw)
            old.max_rounds = fresh.max_rounds
            return old
    return fresh


def refuse_budget(phase: Phase, budget_cells: int | None, budget_s: float | None, what: str) -> None:
    """One line when a phase does not fit the budget (exit 2, nothing created)."""
    if budget_cells is not None and phase.cells > budget_cells:
        raise UsageError(
            f"--budget {budget_cells} cells: {what} needs {phase.cells} follow-up cells ({phase.design.note}"
            + (f"; {len(phase.reused)} of its cells already measured" if phase.reused else "")
            + ")"
        )
    if budget_s is not None and phase.estimate_s > budget_s:
        raise UsageError(
            f"--budget {budget_s / 60:.3g} min: {what} needs an estimated {phase.estimate_s / 60:.1f} min "
            f"({phase.cells} follow-up cells: {phase.design.note})"
        )
