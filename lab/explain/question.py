"""From a command line to a question: the two cells, the metrics to explain, the knobs.

Every refusal is one line (UsageError, exit 2) before anything is created: a selection that
matches no cell or several, A and B the same cell or the same configuration, a workload or metric
that one of them did not measure, two runs of different labs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lab import analysis, compare as compare_mod, results, stats
from lab.errors import UsageError
from lab.explain import record as rec
from lab.explain.knobs import Knob, axis_knobs, param_knobs, untestable
from lab.store import CellRow, RunRow, Store
from lab.workloads import load_all


@dataclass
class Cells:
    run_a: RunRow
    run_b: RunRow
    a: CellRow
    b: CellRow
    sel_a: dict[str, str]
    sel_b: dict[str, str]


def pick(store: Store, run_a: str, run_b: str | None, sel_a: Sequence[str], sel_b: Sequence[str]) -> Cells:
    """The two cells: one per side, each a VM cell that measured something."""
    ra = store.run(run_a)
    rb = store.run(run_b) if run_b else ra
    if rb.id != ra.id and rb.name != ra.name:
        raise UsageError(
            f"runs {ra.id} ({ra.name}) and {rb.id} ({rb.name}) are of two labs; "
            "lab explain takes two runs of one lab.toml"
        )
    if rb.id == ra.id and not (sel_a and sel_b):
        raise UsageError(
            "lab explain RUN needs --a and --b: the two cells to explain (e.g. --a nic=virtio --b nic=e1000)"
        )
    chosen = []
    for run, items, opt in ((ra, sel_a, "--a"), (rb, sel_b, "--b")):
        selector = analysis.parse_selector(items, opt)
        cells = store.cells(run.id)
        found = analysis.select(cells, selector)
        shown = ",".join(items) or "(no selection)"
        if not found:
            raise UsageError(
                f"{opt} {shown}: no cell of run {run.id} matches (cells: {', '.join(c.label for c in cells)})"
            )
        if len(found) > 1:
            raise UsageError(
                f"{opt} {shown} matches {len(found)} cells of run {run.id} "
                f"({', '.join(f'{c.cell_id} {c.label}' for c in found)}); name more axes"
            )
        cell = found[0]
        if analysis.kind(cell) != "vm":
            raise UsageError(
                f"{opt} {shown}: {cell.cell_id} is a {analysis.kind(cell)} cell; lab explain takes VM cells"
            )
        if cell.status == "duplicate":
            raise UsageError(
                f"{opt} {shown}: cell {cell.cell_id} of run {run.id} is a duplicate of "
                f"{cell.facts.get('duplicate_of')} (the same effective configuration): select that one"
            )
        if cell.status != "done":
            raise UsageError(
                f"{opt} {shown}: cell {cell.cell_id} of run {run.id} is {cell.status}: it measured nothing to explain"
            )
        chosen.append((cell, selector))
    (a, sa), (b, sb) = chosen
    if ra.id == rb.id and a.cell_id == b.cell_id:
        raise UsageError(f"--a and --b select the same cell, {a.cell_id} ({a.label}): nothing to explain")
    return Cells(ra, rb, a, b, sa, sb)


def metrics(
    store: Store, cells: Cells, workloads: Sequence[str], wanted: Sequence[str], margin_pct: float
) -> tuple[list[tuple[str, str]], str]:
    """The (workload, metric) rows to explain and why those: --metric names them; else the primary
    metrics (of --workload's workloads, or of every workload both cells measured) whose comparison
    of A and B is better or worse (lab.compare); none of them: every primary metric."""
    sa = analysis.side(cells.run_a.id, cells.run_a.seed, [cells.a], store.samples(cells.run_a.id), {})
    sb = analysis.side(cells.run_b.id, cells.run_b.seed, [cells.b], store.samples(cells.run_b.id), {})
    have_a = {(s.workload, s.metric) for s in sa.series if s.values}
    have_b = {(s.workload, s.metric) for s in sb.series if s.values}
    both = have_a & have_b
    measured = sorted({w for w, _ in both})
    for w in workloads:
        if w not in measured:
            raise UsageError(
                f"--workload {w}: not measured in both cells (both measured: {', '.join(measured) or 'nothing'})"
            )
    chosen_w = list(workloads) or measured
    if wanted:
        out = []
        for m in wanted:
            hits = [(w, m) for w in chosen_w if (w, m) in both]
            if not hits:
                known = sorted({mm for w, mm in both if w in chosen_w})
                raise UsageError(f"--metric {m}: not measured in both cells (metrics: {', '.join(known)})")
            out += hits
        return out, "asked for"
    registry = load_all()
    primary = [
        (w, m)
        for w, m in sorted(both)
        if w in chosen_w and w in registry and registry[w].primary_metrics.pattern_of(m) is not None
    ]
    if not primary:
        raise UsageError(
            f"no primary metric of {', '.join(chosen_w)} was measured in both cells; name one with --metric"
        )
    noise: dict[tuple[str, str], stats.RatioCI] = {}
    for run in {cells.run_a.id: cells.run_a, cells.run_b.id: cells.run_b}.values():
        for key, ci in analysis.noise_floor(results.series(store.samples(run.id), store.cells(run.id))).items():
            noise[key] = stats.widest(noise.get(key), ci)
    cmp = analysis.compare_sides(sa, sb, noise=noise, margin_pct=margin_pct)
    moved = [
        (w, m)
        for _, w, m in (r.key for r in cmp.rows if r.verdict in (compare_mod.Verdict.BETTER, compare_mod.Verdict.WORSE))
        if (w, m) in primary
    ]
    if moved:
        return moved, "the primary metrics whose comparison of A and B is better or worse"
    return primary, "every primary metric (none of them differs between A and B by the comparison's verdicts)"


def knobs_of(store: Store, cells: Cells, workloads: list[str]) -> tuple[list[Knob], list]:
    """The knobs (axes, then the explained workloads' parameters) and what cannot be tested."""
    params_a = cells.run_a.manifest.get("workloads") or {}
    params_b = cells.run_b.manifest.get("workloads") or {}
    knobs = axis_knobs(cells.a, cells.b) + param_knobs(params_a, params_b, workloads)
    out = untestable(
        cells.a,
        cells.b,
        store.host_facts.of_run(cells.run_a.id),
        store.host_facts.of_run(cells.run_b.id),
        same_run=cells.run_a.id == cells.run_b.id,
    )
    return knobs, out


def record(
    cells: Cells,
    metrics_: list[tuple[str, str]],
    knobs: list[Knob],
    untestable_: list,
    *,
    method: str,
    margin_pct: float,
    max_rounds: int,
) -> rec.Record:
    return rec.Record(
        a=rec.Side(cells.run_a.id, cells.a.cell_id, cells.a.label, cells.sel_a),
        b=rec.Side(cells.run_b.id, cells.b.cell_id, cells.b.label, cells.sel_b),
        metrics=metrics_,
        knobs=knobs,
        untestable=untestable_,
        same_in_effect=[],
        method=method,
        margin_pct=margin_pct,
        seed=int(cells.run_a.seed or 0),
        max_rounds=max_rounds,
    )


def nothing_to_explain(cells: Cells, untestable_: list, why: str = "") -> UsageError:
    """A and B with no knob between them."""
    only = "; they differ only in what the lab cannot flip: " + "; ".join(
        f"{u.what} {u.a} → {u.b}" for u in untestable_
    )
    return UsageError(
        f"A ({cells.a.cell_id} {cells.a.label}) and B ({cells.b.cell_id} {cells.b.label}) are the same "
        f"configuration{why}: no knob to explain" + (only if untestable_ else "")
    )
