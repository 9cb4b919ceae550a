"""The report's charts: inline SVG rendered by matplotlib (no pyplot, no GUI backend, nothing fetched)."""

from __future__ import annotations

import io
import re
import statistics
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lab import results
from lab.report.data import CPU_COLOURS, FLAG_COLOUR, RUN_COLOURS, RunData
from lab.results import fmt

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _matplotlib() -> ModuleType:
    """matplotlib on first use: it takes about a second to import, and every `lab` command but
    `report` starts without it."""
    import matplotlib
    import matplotlib.figure
    import matplotlib.ticker

    matplotlib.use("Agg")  # headless, whatever MPLBACKEND says; pyplot is never imported here
    return matplotlib


# -- charts ----------------------------------------------------------------------------------------


def _tick(v: float, _pos: Any = None) -> str:
    return f"{v:,.6g}"


def _svg(fig: Figure, salt: str) -> str:
    """The figure as an inline <svg> element: no XML prolog, no metadata, unique ids per chart."""
    buf = io.StringIO()
    with _matplotlib().rc_context({"svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    # Inline SVG in HTML needs no namespace declarations; dropping them keeps the file free of
    # any http:// string (they are names, not fetched, but a reviewer should not have to know).
    text = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", text)
    # matplotlib numbers its ids per figure (figure_1, patch_1, ...): prefix them, and every
    # reference to them, so the charts can share one document.
    ids = set(re.findall(r'\sid="([^"]+)"', text))
    text = re.sub(
        r'(\sid="|href="#|url\(#)([^")]+)',
        lambda m: f"{m.group(1)}{salt}-{m.group(2)}" if m.group(2) in ids else m.group(0),
        text,
    )
    text = text.replace("<svg ", '<svg role="img" class="chart" ', 1)
    return text


# How many characters of x labels fit side by side under each panel before they must be rotated,
# and how many bars leave room for a value above each.
ROOM = {"main": (56, 10), "cpu": (24, 5)}


def _crowded(cats: list[str], short: dict[str, str], panel: str) -> bool:
    return sum(len(short.get(c, c)) + 2 for c in cats) > ROOM[panel][0]


def _panel(
    ax,
    sides: list[RunData],
    cats: list[str],
    short: dict[str, str],
    workload: str,
    metric: str | None,
    colours: tuple[str, ...],
    title: str,
    percent: bool,
    panel: str = "main",
) -> None:
    """Bars at the median, min–max whiskers, a dot per repetition; one call per kind of mark (each
    matplotlib artist costs time to lay out, and a report has dozens of charts)."""
    width = 0.8 / len(sides)
    top = 0.0
    for j, rd in enumerate(sides):
        xs: list[float] = []
        meds: list[float] = []
        los: list[float] = []
        his: list[float] = []
        dots: tuple[list[float], list[float]] = ([], [])
        flags: tuple[list[float], list[float]] = ([], [])
        for i, cat in enumerate(cats):
            x = i - 0.4 + width * (j + 0.5)
            pts = rd.points.get((cat, workload, metric), []) if metric else []
            if not pts:
                cell = rd.cell_status.get(cat)
                why = "missing" if cell is None else ("failed" if cell.status == "failed" else "no data")
                ax.text(
                    x,
                    0,
                    f" {why}",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    color=FLAG_COLOUR if why == "failed" else "#777777",
                )
                continue
            top = max(top, max(v for v, _ in pts))
            values = [v for v, flagged in pts if not flagged]  # a flagged one is a red x, never in the bar
            med = statistics.median(values) if values else None
            k = len(pts)
            step = width * 0.5 / max(k - 1, 1)
            for m, (v, flagged) in enumerate(pts):
                target = flags if flagged else dots
                target[0].append(x + (m - (k - 1) / 2) * step)
                target[1].append(v)
            if med is None:
                ax.text(x, 0, " all flagged", rotation=90, ha="center", va="bottom", fontsize=8, color=FLAG_COLOUR)
                continue
            xs.append(x)
            meds.append(med)
            los.append(med - min(values))
            his.append(max(values) - med)
            if len(cats) * len(sides) <= ROOM[panel][1]:  # a value above each bar, when they do not collide
                ax.annotate(
                    fmt(med),
                    (x, max(values)),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="#333333",
                )
        if xs:
            ax.bar(xs, meds, width * 0.9, color=colours[j], edgecolor="none", zorder=2, label=f"{rd.side} {rd.run.id}")
            ax.errorbar(xs, meds, yerr=[los, his], fmt="none", ecolor="#333333", elinewidth=1, capsize=3, zorder=3)
        if dots[0]:
            ax.scatter(dots[0], dots[1], s=9, color="#222222", alpha=0.75, zorder=4, linewidths=0)
        if flags[0]:
            ax.scatter(flags[0], flags[1], s=30, marker="x", color=FLAG_COLOUR, zorder=5, linewidths=1.5)
    ax.set_xticks(range(len(cats)))
    long = _crowded(cats, short, panel)
    ax.set_xticklabels(
        [short.get(c, c) for c in cats],
        fontsize=8,
        rotation=25 if long else 0,
        ha="right" if long else "center",
        rotation_mode="anchor",
    )
    ax.set_xlim(-0.6, len(cats) - 0.4)
    ax.set_ylim(0, max(100.0, top * 1.12) if percent else (top * 1.15 or 1.0))
    ticker = _matplotlib().ticker
    ax.yaxis.set_major_locator(ticker.MaxNLocator(5))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(_tick))
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(title, fontsize=9, loc="left", y=1.02)  # a fixed y skips matplotlib's costly auto-placement
    ax.grid(axis="y", color="#e4e4e4", zorder=0)
    ax.set_axisbelow(True)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)


def chart(
    sides: list[RunData],
    cats: list[str],
    short: dict[str, str],
    workload: str,
    metric: str,
    unit: str,
    cpu_metric: str | None,
    salt: str,
) -> str:
    """One figure: the metric by cell (per run) and, beside it, the matching guest CPU busy %."""
    variant = cpu_metric[len(results.CPU_METRIC) + 1 :] if cpu_metric and cpu_metric != results.CPU_METRIC else ""
    cpu_title = "guest CPU busy %" + (f" ({variant})" if variant else "") if cpu_metric else "CPU not measured"
    rotate = _crowded(cats, short, "cpu")
    mpl = _matplotlib()
    with mpl.rc_context({"svg.fonttype": "none", "text.parse_math": False, "font.size": 8}):
        fig = mpl.figure.Figure(figsize=(7.2, 2.8 if rotate else 2.6))
        grid = fig.add_gridspec(1, 2, width_ratios=(2, 1), wspace=0.25)
        _panel(
            fig.add_subplot(grid[0, 0]),
            sides,
            cats,
            short,
            workload,
            metric,
            RUN_COLOURS,
            f"{metric} ({unit})",
            percent=unit == "%",
        )
        _panel(
            fig.add_subplot(grid[0, 1]),
            sides,
            cats,
            short,
            workload,
            cpu_metric,
            CPU_COLOURS,
            cpu_title,
            percent=True,
            panel="cpu",
        )
        fig.subplots_adjust(left=0.08, right=0.99, top=0.88, bottom=0.25 if rotate else 0.12)
        return _svg(fig, salt)
