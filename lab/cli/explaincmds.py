"""`lab explain`: which knob makes the difference between two cells (lab.explain)."""

from __future__ import annotations

import re
import sys

import click

from lab import verdicts
from lab.cli import shapes
from lab.cli.comparing import _margin_pct
from lab.cli.group import (
    cli,
    config_option,
    install_signal_handlers,
    open_store,
    restore_signal_handlers,
    results_option,
)
from lab.cli.printing import duration, err, fmt, line, out, say, styled, table
from lab.cli.progress import PlainReporter, RichReporter
from lab.errors import UsageError
from lab.explain import design, explanation as expl, followup, question, record as rec, session as ses
from lab.explain.effects import MetricAnswer

QUESTION_KEYS = (
    "a",
    "b",
    "metrics",
    "knobs",
    "untestable",
    "same_in_effect",
    "method",
)  # of the record, in --plan --json
VERDICT_STYLE = {"matters": "red", "does not matter": "cyan", "unknown": "yellow"}


def parse_budget(text: str | None) -> tuple[int | None, float | None]:
    """--budget 12 (follow-up cells) or 30m / 90s / 2h / 1h30m (estimated time): (cells, seconds)."""
    if text is None:
        return None, None
    t = text.strip().lower()
    m = re.fullmatch(r"(\d+)\s*(cells?)?", t)
    if m:
        return int(m.group(1)), None
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m(?:in)?)?\s*(?:(\d+(?:\.\d+)?)s)?", t)
    if parts and any(parts.groups()):
        h, mi, s = (float(x) if x else 0.0 for x in parts.groups())
        return None, h * 3600 + mi * 60 + s
    raise UsageError(f"--budget {text!r}: expected a number of cells (12) or a duration (30m, 90s, 1h30m)")


@cli.command("explain")
@click.argument("run_a")
@click.argument("run_b", required=False)
@click.option("--a", "sel_a", multiple=True, metavar="AXIS=VALUE", help="cell A: the cell of RUN_A with these axes")
@click.option(
    "--b", "sel_b", multiple=True, metavar="AXIS=VALUE", help="cell B: of RUN_B (or of RUN_A when RUN_B is not given)"
)
@click.option("--workload", "workloads", multiple=True, help="explain this workload's primary metrics (repeatable)")
@click.option("--metric", "metrics", multiple=True, help="explain this metric (repeatable)")
@click.option(
    "--method",
    type=click.Choice(design.METHODS),
    default="factorial",
    show_default=True,
    help="factorial: 2^k cells for up to 3 knobs, else a resolution-IV fraction then the active knobs' "
    "factorial; revert: B with one knob back at A's value at a time (k cells, no interactions)",
)
@click.option("--plan", "plan_only", is_flag=True, help="print the follow-up cells and the estimate; run nothing")
@click.option("--budget", default=None, metavar="CELLS|DURATION", help="refuse a design over this (12, 30m, 1h)")
@click.option(
    "--rounds",
    type=click.IntRange(0, 10),
    default=2,
    show_default=True,
    help="at most this many rounds of more repetitions while a knob is unknown",
)
@click.option(
    "--repetitions", type=click.IntRange(1, 1000), default=None, help="per follow-up cell (default: the lab's)"
)
@click.option(
    "--margin",
    type=float,
    default=verdicts.DEFAULT_MARGIN_PCT,
    show_default=True,
    metavar="PCT",
    help="a knob whose effect stays within this (or the A/A band) does not matter",
)
@config_option
@results_option
@click.option("--json", "as_json", is_flag=True, help="the explanation as JSON (shape lab.explain/1)")
def explain_cmd(
    run_a,
    run_b,
    sel_a,
    sel_b,
    workloads,
    metrics,
    method,
    plan_only,
    budget,
    rounds,
    repetitions,
    margin,
    config_path,
    results_dir,
    as_json,
):
    """Which knob makes the difference between cell A and cell B: the follow-up cells that flip the
    knobs they differ in, measured as a run of their own (a child of RUN), then each knob's effect
    with its 95 % CI, its share of the gap and a verdict: matters, does not matter, or unknown.
    `lab explain RUN --a nic=virtio --b nic=e1000,wan=cap20`, `lab explain RUN_A RUN_B`."""
    margin = _margin_pct(margin)
    budget_cells, budget_s = parse_budget(budget)
    store = open_store(config_path, results_dir)
    cells = question.pick(store, run_a, run_b, sel_a, sel_b)
    chosen, why_metrics = question.metrics(store, cells, workloads, metrics, margin)
    workload_list = list(dict.fromkeys(w for w, _ in chosen))
    knobs, untestable = question.knobs_of(store, cells, workload_list)
    if not knobs:
        raise question.nothing_to_explain(cells, untestable)
    fresh = question.record(cells, chosen, knobs, untestable, method=method, margin_pct=margin, max_rounds=rounds)
    base = followup.base(store, cells.run_b, followup_axes(cells), cells.run_a.manifest.get("workloads") or {})
    session = ses.Session(store, fresh, base, cells.run_b.name, repetitions=repetitions)
    cfg = session.check()  # a knob no host can flip: one line, exit 2, nothing created
    same = followup.same_in_effect(cfg, base, knobs)
    if same:
        fresh.knobs = [k for k in knobs if k not in {s for s, _ in same}]
        fresh.same_in_effect = [{**k.as_dict(), "why": why} for k, why in same]
        if not fresh.knobs:
            raise question.nothing_to_explain(cells, untestable, " in effect (" + "; ".join(w for _, w in same) + ")")
    if method == "factorial" and len(fresh.knobs) > design.MAX_KNOBS:
        raise UsageError(
            f"{len(fresh.knobs)} knobs: a factorial design here carries at most {design.MAX_KNOBS}; use --method revert"
        )
    session.record = ses.resumed_record(store, fresh)
    record = session.record
    ex = expl.explain(store, record) if record.phases else None
    phase = session.next_phase(ex)
    if phase is not None:
        ses.refuse_budget(phase, budget_cells, budget_s, "the design")
    if plan_only:
        _plan(record, phase, why_metrics, as_json)
        return
    ran_cells, ran_s, skipped = 0, 0.0, []
    reporter = None
    while phase is not None:
        if (budget_cells is not None and ran_cells + phase.cells > budget_cells) or (
            budget_s is not None and ran_s + phase.estimate_s > budget_s
        ):
            skipped.append(f"{phase.design.note}: {phase.cells} cells, over the budget: not run")
            break
        if phase.cells:
            err.print(line("lab explain: ", _phase_line(phase)), soft_wrap=True)
            reporter = reporter or (RichReporter() if err.is_terminal else PlainReporter())
            previous = install_signal_handlers()
            try:
                session.run(phase, reporter)
            finally:
                restore_signal_handlers(previous)
        ran_cells += phase.cells
        ran_s += phase.estimate_s
        ex = expl.explain(store, record)
        phase = session.next_phase(ex)
    if reporter is not None:
        reporter.close()
    ex = ex or expl.explain(store, record)
    session.save()
    failed = _failed(store, record)
    if as_json:
        shapes.emit("explain", {**expl.document(ex), "why_metrics": why_metrics, "not_run": skipped, "failed": failed})
    else:
        print_explanation(ex, why_metrics, skipped, failed)
    if failed:
        err.print(f"{len(failed)} follow-up cells failed; see `lab show` of their runs")
        sys.exit(1)


def followup_axes(cells: question.Cells) -> dict:
    from lab.explain.knobs import full_axes

    return full_axes(cells.a)


def _failed(store, record: rec.Record) -> list[dict]:
    known = {r.id for r in store.runs()}
    return [
        {"run": rid, "cell": c.cell_id, "label": c.label, "status": c.status, "stage": c.stage, "error": c.error}
        for rid in record.runs
        if rid in known
        for c in store.cells(rid)
        if c.status not in ("done", "n/a", "duplicate")
    ]


def _phase_line(phase: ses.Phase) -> str:
    runs = ", ".join(g.run_id for g in phase.groups if g.run_id)
    what = "continuing" if phase.resumed else "measuring"
    return (
        f"{phase.design.note}; {what} {phase.cells} follow-up cell{'s' if phase.cells != 1 else ''}"
        + (f" ({len(phase.reused)} already measured)" if phase.reused and phase.design.kind != "more" else "")
        + (f", run {runs}" if runs else "")
        + f", about {duration(phase.estimate_s)}"
    )


# -- --plan --------------------------------------------------------------------------------------------


def _plan(record: rec.Record, phase: ses.Phase | None, why_metrics: str, as_json: bool) -> None:
    later = _later(record, phase)
    if as_json:
        whole = record.as_dict()
        shapes.emit(
            "explain.plan",
            {
                **{key: whole[key] for key in QUESTION_KEYS},
                "design": None if phase is None else phase.design.as_dict(),
                "cells": [] if phase is None else _plan_cells(record, phase),
                "new_cells": 0 if phase is None else phase.cells,
                "reused_cells": 0 if phase is None else len(phase.reused),
                "full_factorial": 2**record.k,
                "estimate_s": None if phase is None else round(phase.estimate_s, 1),
                "later": later,
            },
        )
        return
    _head(record, why_metrics)
    if phase is None:
        say("nothing left to measure: every follow-up cell of this question is in the store")
        return
    t = table(["cell", *(k.name for k in record.knobs), "measured"], title=phase.design.note)
    for c in _plan_cells(record, phase):
        t.add_row(c["cell"] or "–", *(str(v) for v in c["axes"].values()), c["measured"])
    out.print(t)
    say(
        f"{phase.cells} follow-up cell{'s' if phase.cells != 1 else ''} to measure, {len(phase.reused)} already "
        f"measured (the full factorial is {2**record.k}); estimated {duration(phase.estimate_s)}"
    )
    for text in later:
        say(f"then: {text}", soft_wrap=True)


def _plan_cells(record: rec.Record, phase: ses.Phase) -> list[dict]:
    cell_of = {lv: c for g in phase.groups for lv, c in g.cells.items()}
    rows = []
    for levels in phase.design.points:
        found = phase.reused.get(levels) or []
        cell = cell_of.get(levels)
        rows.append(
            {
                "levels": list(levels),
                "axes": expl.point_values(record, levels),
                "cell": cell.id if cell is not None else None,
                "label": cell.label if cell is not None else None,
                "measured": ", ".join(f"{r} {c}" for r, c in found) if found else "no: measured now",
                "reused": [{"run": r, "cell": c} for r, c in found],
            }
        )
    return rows


def _later(record: rec.Record, phase: ses.Phase | None) -> list[str]:
    out_ = []
    if phase is not None and phase.design.kind == "screening":
        out_.append(
            "the full factorial of the knobs found to matter (every other knob at A's value), for their "
            "interactions: up to " + str(2**record.k // max(len(phase.design.points), 1)) + "x fewer cells than all"
        )
    if record.max_rounds:
        out_.append(
            f"while a knob is unknown, its deciding cells measured again: at most {record.max_rounds} "
            "more round(s) (--rounds)"
        )
    return out_


# -- the explanation -----------------------------------------------------------------------------------


def _head(record: rec.Record, why_metrics: str) -> None:
    say(
        "A = ",
        styled(f"{record.a.run} {record.a.cell}", "bold"),
        f" {record.a.label}   B = ",
        styled(f"{record.b.run} {record.b.cell}", "bold"),
        f" {record.b.label}",
        soft_wrap=True,
    )
    say(f"knobs ({record.k}): " + "; ".join(k.text() for k in record.knobs), soft_wrap=True)
    for s in record.same_in_effect:
        say(f"same in effect, not a knob: {s['why']}", soft_wrap=True)
    if record.untestable:
        say(styled("cannot be tested here: ", "yellow"), soft_wrap=True)
        for u in record.untestable:
            say(f"  {u.what}: {u.a} → {u.b} ({u.why})", soft_wrap=True)
    else:
        say("cannot be tested here: nothing (no host fact, image build or accelerator differs)")
    say("metrics: " + ", ".join(f"{w} {m}" for w, m in record.metrics) + f" ({why_metrics})", soft_wrap=True)


def print_explanation(ex: expl.Explanation, why_metrics: str, skipped: list[str], failed: list[dict]) -> None:
    r = ex.record
    _head(r, why_metrics)
    for a in ex.answers:
        _metric_table(ex, a)
    for u in ex.host_changes:
        say(styled("host changed since the parent run: ", "yellow"), f"{u.what}: {u.a} → {u.b}", soft_wrap=True)
    reused = sum(1 for p in ex.points for s in p.sources if s[0] in r.parents)
    say(
        f"cells: {len(ex.points)} of the {2**r.k} of the full factorial ({reused} from the parent run"
        + (f"s {', '.join(r.parents)}" if len(r.parents) > 1 else f" {r.parents[0]}")
        + ")"
        + (f"; follow-up runs: {', '.join(r.runs)}" if r.runs else "; no follow-up run was needed")
        + "; phases: "
        + "; ".join(p["note"] for p in r.phases),
        soft_wrap=True,
    )
    for text in skipped:
        say(styled("not run: ", "yellow"), text, soft_wrap=True)
    for f in failed:
        say(
            styled("failed: ", "red"),
            f"run {f['run']} {f['cell']} {f['label']}: {f['status']} at {f['stage']}: {f['error']}",
        )


def _metric_table(ex: expl.Explanation, a: MetricAnswer) -> None:
    r = ex.record
    gap = a.gap
    title = (
        f"{a.workload} {a.metric} ({a.unit}, {'higher' if a.higher_is_better else 'lower'} is better): "
        f"A {fmt(a.median_a)} → B {fmt(a.median_b)}"
        + (f", {expl.ratio_text(gap.ratio)} [{fmt(gap.ci[0])}–{fmt(gap.ci[1])}] {a.gap_answer.value}" if gap else "")
        + f"; margin {a.margin.text()}"
    )
    t = table(
        ("knob", "A → B", "effect", "95 % CI", "share of gap", "q", "verdict"),
        title=title,
        right=("effect", "95 % CI", "share of gap", "q"),
    )
    for k in sorted(a.knobs, key=lambda k: -abs(k.share or 0.0)):
        knob = r.knobs[k.knob]
        t.add_row(
            knob.name,
            f"{knob.a} → {knob.b}",
            expl.ratio_text(k.ratio),
            f"{fmt(k.ci[0])}–{fmt(k.ci[1])}" if k.ci else "–",
            "–" if k.share is None else f"{k.share * 100:.0f} %",
            fmt(k.q),
            styled(k.verdict + (f" ({k.why})" if k.why else ""), VERDICT_STYLE.get(k.verdict, "")),
        )
    out.print(t)
    named = [x for x in a.interactions if x.answer.differs]
    if named:
        for x in named:
            say(
                styled("interaction: ", "bold"),
                expl.interaction_text(ex, x),
                f" ({expl.ratio_text(x.ratio)} [{fmt(x.ci[0])}–{fmt(x.ci[1])}]): matters",
                soft_wrap=True,
            )
            if (x.first, x.second) in ex.run_aliased:
                say("  " + expl.aliased_text(ex, (x.first, x.second)), soft_wrap=True)
    elif a.interactions:
        say(f"interactions: none of the {len(a.interactions)} pair(s) measured matters")
    else:
        say(
            "interactions: not measured ("
            + ("reverted one at a time" if r.method == "revert" else "no full factorial of two knobs that matter")
            + ")"
        )
    top = a.top
    if top is not None and a.moved:
        parts = []
        for mv in a.moved:
            if mv.ratio is not None:
                parts.append(
                    f"{mv.metric} {expl.ratio_text(mv.ratio)} [{fmt(mv.ci[0])}–{fmt(mv.ci[1])}]" if mv.ci else mv.metric
                )
            else:
                parts.append(f"{mv.metric} {fmt(mv.median_a)} → {fmt(mv.median_b)} %")
        say(f"moved with {r.knobs[top.knob].name}: " + "; ".join(parts), soft_wrap=True)
    if a.step is not None:
        st = a.step
        say(
            f"the step that carries the gap: {st.metric} {fmt(st.median_a)} → {fmt(st.median_b)} {a.unit} "
            f"({st.share * 100:.0f} % of the total's difference)",
            soft_wrap=True,
        )
