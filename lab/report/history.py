"""`lab report --history`: a trend chart per series the run belongs to (lab.history): every stored
run of the same configuration on the same host, its median with the 95 % CI, the segments'
levels between change points, each change point marked with its size, the report's run
highlighted, and the change points with the facts that changed, in words beside the chart."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from lab import history as history_mod
from lab.history import History
from lab.report.charts import _matplotlib, _svg, _tick
from lab.report.data import FLAG_COLOUR, RUN_COLOURS
from lab.store import Store

CHANGE_COLOURS = {"worse": FLAG_COLOUR, "better": "#1e7b34", "changed": "#5f6b7a"}
LABELLED_RUNS = 16  # x tick labels (run ids) shown at most; beyond, every k-th


def sections(store: Store, run_id: str, short: dict[str, str]) -> list[dict[str, Any]]:
    """One entry per series of the run (its cells x metrics shown by default), for the template."""
    out = []
    for n, h in enumerate(h for h in history_mod.histories(store) if any(p.run_id == run_id for p in h.points)):
        out.append(
            {
                "anchor": f"history-{n}",
                "cell": short.get(h.key.cell, h.key.cell),
                "label": h.key.cell,
                "workload": h.key.workload,
                "metric": h.key.metric,
                "unit": h.unit,
                "verdict": h.result.verdict,
                "why": h.result.why,
                "changes": [{"verdict": c.verdict, "text": history_mod.change_text(h, c)} for c in h.changes],
                "svg": Markup(trend_chart(h, run_id, salt=f"lab-history-{n}")),
            }
        )
    return out


def trend_chart(h: History, run_id: str, salt: str) -> str:
    """Medians (95 % CI whiskers) by run, oldest left; segment levels; change points as dashed lines."""
    mpl = _matplotlib()
    with mpl.rc_context({"svg.fonttype": "none", "text.parse_math": False, "font.size": 8}):
        fig = mpl.figure.Figure(figsize=(7.2, 2.6))
        ax = fig.add_subplot()
        measured = [(x, p) for x, p in enumerate(h.points) if p.median is not None]
        for mine in (False, True):
            pts = [(x, p) for x, p in measured if (p.run_id == run_id) == mine]
            if not pts:
                continue
            xs = [x for x, _ in pts]
            meds = [p.median for _, p in pts if p.median is not None]
            lo = [max(m - (p.ci[0] if p.ci else m), 0.0) for m, (_, p) in zip(meds, pts)]
            hi = [max((p.ci[1] if p.ci else m) - m, 0.0) for m, (_, p) in zip(meds, pts)]
            ax.errorbar(
                xs,
                meds,
                yerr=[lo, hi],
                fmt="D" if mine else "o",
                markersize=6 if mine else 4,
                color=RUN_COLOURS[1] if mine else RUN_COLOURS[0],
                ecolor="#333333",
                elinewidth=1,
                capsize=2,
                zorder=3,
                label="this run" if mine else "other runs",
            )
        for x, p in enumerate(h.points):
            if p.median is None:  # every sample flagged: a mark on the axis, no point
                ax.axvline(x, color=FLAG_COLOUR, linewidth=0.8, linestyle=":", zorder=1)
        xs_measured = [x for x, _ in measured]
        edges = [0, *(c.at.index for c in h.changes), len(measured)]
        levels = [c.at.before for c in h.changes] + ([h.changes[-1].at.after] if h.changes else [])
        for (a, b), level in zip(zip(edges, edges[1:]), levels):
            ax.hlines(level, xs_measured[a] - 0.3, xs_measured[b - 1] + 0.3, color="#888888", linewidth=1.5, zorder=2)
        for c in h.changes:
            between = (xs_measured[c.at.index - 1] + xs_measured[c.at.index]) / 2
            colour = CHANGE_COLOURS[c.verdict]
            ax.axvline(between, color=colour, linestyle="--", linewidth=1.2, zorder=1)
            ax.annotate(
                history_mod.pct(c.at.size),
                (between, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -10),
                textcoords="offset points",
                fontsize=8,
                color=colour,
                fontweight="bold",
            )
        step = max(1, -(-len(h.points) // LABELLED_RUNS))
        ax.set_xticks(range(0, len(h.points), step))
        ax.set_xticklabels([p.run_id for p in h.points][::step], fontsize=7, rotation=30, ha="right")
        ax.set_xlim(-0.6, len(h.points) - 0.4)
        ticker = mpl.ticker
        ax.yaxis.set_major_locator(ticker.MaxNLocator(5))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(_tick))
        ax.set_ylabel(h.unit, fontsize=8)
        ax.grid(axis="y", color="#e4e4e4", zorder=0)
        ax.set_axisbelow(True)
        for spine in ("top", "right"):
            ax.spines[spine].set_visible(False)
        fig.subplots_adjust(left=0.1, right=0.99, top=0.92, bottom=0.26)
        return _svg(fig, salt)
