"""The report's section on `lab explain`: for a parent run, each question its follow-up runs answered
(for a follow-up run, its own), rebuilt from the stored record and samples (lab.explain.explanation):
per metric a chart of each knob's effect with its 95 % CI against the margin, and the table."""

from __future__ import annotations

import math
from typing import Any

from markupsafe import Markup

from lab.explain import explanation as expl, record as rec
from lab.report.charts import _matplotlib, _svg
from lab.report.data import FLAG_COLOUR, RUN_COLOURS
from lab.results import fmt
from lab.store import RunRow, Store

VERDICT_COLOUR = {"matters": FLAG_COLOUR, "does not matter": RUN_COLOURS[0], "unknown": RUN_COLOURS[1]}
VERDICT_CLASS = {"matters": "worse", "does not matter": "same", "unknown": "unknown"}


def section(store: Store, run: RunRow) -> list[dict[str, Any]]:
    """The explanations of a run, as the template shows them ([] when it has none)."""
    out = []
    for n, record in enumerate(rec.of_run(store, run), start=1):
        ex = expl.explain(store, record)
        metrics = []
        for m, a in enumerate(ex.answers, start=1):
            rows = []
            for k in sorted(a.knobs, key=lambda k: -abs(k.share or 0.0)):
                knob = record.knobs[k.knob]
                rows.append(
                    {
                        "knob": knob.name,
                        "change": f"{knob.a} → {knob.b}",
                        "effect": expl.ratio_text(k.ratio),
                        "ci": f"{fmt(k.ci[0])}–{fmt(k.ci[1])}" if k.ci else "–",
                        "share": "–" if k.share is None else f"{k.share * 100:.0f} %",
                        "q": fmt(k.q),
                        "verdict": k.verdict + (f" ({k.why})" if k.why else ""),
                        "class": VERDICT_CLASS.get(k.verdict, "unknown"),
                    }
                )
            gap = a.gap
            metrics.append(
                {
                    "title": f"{a.workload} {a.metric} ({a.unit})",
                    "gap": (
                        f"A {fmt(a.median_a)} → B {fmt(a.median_b)}"
                        + (f": {expl.ratio_text(gap.ratio)} [{fmt(gap.ci[0])}–{fmt(gap.ci[1])}]" if gap else "")
                        + f", {a.gap_answer.value}; margin {a.margin.text()}"
                    ),
                    "rows": rows,
                    "interactions": [
                        f"{expl.interaction_text(ex, x)}: {x.verdict}"
                        + (
                            f" ({expl.aliased_text(ex, (x.first, x.second))})"
                            if (x.first, x.second) in ex.run_aliased
                            else ""
                        )
                        for x in a.interactions
                        if x.answer.differs
                    ],
                    "moved": _moved(ex, a),
                    "step": (
                        ""
                        if a.step is None
                        else f"{a.step.metric}: {fmt(a.step.median_a)} → {fmt(a.step.median_b)} {a.unit} "
                        f"({a.step.share * 100:.0f} % of the difference)"
                    ),
                    "svg": Markup(effects_chart(ex, a, salt=f"lab-explain-{n}-{m}")),
                }
            )
        out.append(
            {
                "anchor": f"explain-{record.question_id}",
                "a": f"{record.a.run} {record.a.cell} ({record.a.label})",
                "b": f"{record.b.run} {record.b.cell} ({record.b.label})",
                "knobs": "; ".join(k.text() for k in record.knobs),
                "untestable": [f"{u.what}: {u.a} → {u.b} ({u.why})" for u in record.untestable + ex.host_changes],
                "same": [s["why"] for s in record.same_in_effect],
                "phases": [p["note"] for p in record.phases],
                "runs": ", ".join(record.runs) or "none",
                "cells": f"{len(ex.points)} of the {2**record.k} cells of the full factorial",
                "metrics": metrics,
            }
        )
    return out


def _moved(ex: expl.Explanation, a) -> str:
    top = a.top
    if top is None or not a.moved:
        return ""
    parts = []
    for mv in a.moved:
        if mv.ratio is not None:
            parts.append(f"{mv.metric} {expl.ratio_text(mv.ratio)}")
        else:
            parts.append(f"{mv.metric} {fmt(mv.median_a)} → {fmt(mv.median_b)} %")
    return f"moved with {ex.record.knobs[top.knob].name}: " + "; ".join(parts)


def effects_chart(ex: expl.Explanation, a, *, salt: str) -> str:
    """Each knob's effect (a dot) with its 95 % CI (a bar) on a log scale, the margin shaded, 1 marked."""
    knobs = [k for k in sorted(a.knobs, key=lambda k: abs(k.share or 0.0)) if k.ratio and 0 < k.ratio < math.inf]
    mpl = _matplotlib()
    with mpl.rc_context({"svg.fonttype": "none", "text.parse_math": False, "font.size": 8}):
        fig = mpl.figure.Figure(figsize=(9.0, 0.9 + 0.3 * max(len(knobs), 1)))
        ax = fig.add_subplot(1, 1, 1)
        ax.axvspan(a.margin.low, a.margin.high, color="#e8eef5", zorder=0, label="margin")
        ax.axvline(1.0, color="#555555", linewidth=0.8, zorder=1)
        values = [1.0, a.margin.low, a.margin.high]
        for y, k in enumerate(knobs):
            lo, hi = k.ci if k.ci else (k.ratio, k.ratio)
            colour = VERDICT_COLOUR.get(k.verdict, "#777777")
            ax.plot([lo, hi], [y, y], color=colour, linewidth=2.5, solid_capstyle="butt", zorder=2)
            ax.scatter([k.ratio], [y], color=colour, s=22, zorder=3)
            values += [v for v in (lo, hi, k.ratio) if v and 0 < v < math.inf]
        ax.set_xscale("log")
        low, high = min(values), max(values)
        ax.set_xlim(low / 1.15, high * 1.15)
        ax.set_yticks(range(len(knobs)))
        ax.set_yticklabels([ex.record.knobs[k.knob].name for k in knobs], fontsize=8)
        ax.set_ylim(-0.6, max(len(knobs), 1) - 0.4)
        ticker = mpl.ticker
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"×{v:.3g}"))
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.grid(axis="x", color="#e4e4e4", zorder=0)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(
            f"{a.metric}: each knob's effect, B's value against A's, with its 95 % CI",
            fontsize=8,
            loc="left",
            y=1.0,
        )
        for spine in ("top", "right"):
            ax.spines[spine].set_visible(False)
        fig.subplots_adjust(left=0.16, right=0.98, top=0.8 if len(knobs) > 2 else 0.7, bottom=0.22)
        return _svg(fig, salt)
