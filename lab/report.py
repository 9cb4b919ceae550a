"""`lab report`: one self-contained HTML file for a run, optionally against a second run.

The file needs nothing but itself to be read: CSS is inline, charts are inline SVG rendered by
matplotlib (no pyplot, no GUI backend, no fonts or scripts fetched), and there is no JavaScript.
Contents, in order:

- failed cells (stage and error), then with ``vs`` the comparison: which cells each run has, and
  a row per metric from lab.compare (ratio B/A, its CI, p, verdict, coloured by verdict);
- a chart per workload metric by cell: a bar at the median, min–max whiskers and a dot for every
  repetition (flagged ones as a red x), beside it the guest CPU busy % that goes with the metric
  (``cpu_busy_pct_<variant>``, the convention of lab.results);
- the results table per workload, like ``lab show``: median, 95 % bootstrap CI of the median
  (lab.stats.summarize), min–max, CV, n, CPU busy %, flagged repetitions marked;
- cell facts (accelerator, verified NIC driver / vCPUs / memory, tuning in effect, boot seconds),
  host fingerprints (with ``vs``: the facts that differ between the two runs' hosts highlighted),
  and the exact manifest JSON and lab.toml text of each run.

Side A is ``run_id``, side B is ``vs``: ``lab report A --vs B`` shows what ``lab compare A B``
shows, plus everything above for both runs.

`render` only reads the store and returns the HTML; `write` puts it in a file.
"""

from __future__ import annotations

import io
import json
import math
import re
import statistics
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import matplotlib

matplotlib.use("Agg")  # headless, whatever MPLBACKEND says; pyplot is never imported here

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402
from markupsafe import Markup  # noqa: E402

import lab  # noqa: E402
from lab import compare as compare_mod  # noqa: E402
from lab import analysis, hostinfo, results, stats  # noqa: E402
from lab import plan  # noqa: E402
from lab.store import CellRow, RunRow, SampleRow, Store  # noqa: E402

TEMPLATE = "report/report.html.j2"
RUN_COLOURS = ("#4878a8", "#e08a2c")  # side A, side B (colour-blind safe pair)
CPU_COLOURS = ("#8fb0d0", "#f0c08a")
FLAG_COLOUR = "#c0392b"
VERDICT_CLASS = {
    compare_mod.Verdict.BETTER: "better",
    compare_mod.Verdict.WORSE: "worse",
    compare_mod.Verdict.NO_DIFFERENCE: "nodiff",
    compare_mod.Verdict.WITHIN_NOISE: "nodiff",
    compare_mod.Verdict.NOT_ENOUGH: "notenough",
    compare_mod.Verdict.MISSING_A: "missing",
    compare_mod.Verdict.MISSING_B: "missing",
    compare_mod.Verdict.INFORMATIONAL: "info",
}


# -- formatting ----------------------------------------------------------------------------------

def fmt(v: float | None) -> str:
    """A number as the tables show it (the same rules as `lab show`)."""
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


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:.1f} %"


def _p(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.3f}" if v >= 0.001 else f"{v:.1e}"


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts)) if ts else "–"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _direction(higher_is_better: bool | None) -> str:
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
    executions: list = field(default_factory=list)  # the executed order (Store.executions)


def _lab_version(store: Store, run_id: str) -> str:
    # RunRow has no lab_version; the column is in the schema since migration 1.
    row = store.db.execute("SELECT lab_version FROM runs WHERE id = ?", (run_id,)).fetchone()
    return (row[0] or "") if row else ""


def _load(store: Store, run: RunRow, side: str) -> RunData:
    cells = store.cells(run.id)
    samples = store.samples(run.id)
    labels = {c.cell_id: c.label for c in cells}
    points: dict[Key, list[tuple[float, bool]]] = {}
    for s in samples:
        points.setdefault((labels.get(s.cell_id, s.cell_id), s.workload, s.metric), []).append(
            (s.value, bool(s.labels.get("flagged"))))
    all_series = results.series(samples, cells)
    return RunData(run=run, side=side, colour=RUN_COLOURS[0 if side == "A" else 1], cells=cells, samples=samples,
                   series={s.key: s for s in all_series}, points=points, config_text=store.config_text(run.id),
                   lab_version=_lab_version(store, run.id), hosts=store.host_facts(run.id),
                   cell_status={c.label: c for c in cells}, executions=store.executions(run.id))


def _visible(s: results.Series) -> bool:
    """The metrics `lab show` shows by default (CPU figures go in their own column)."""
    return bool(results.show_rows([s]))


def cpu_metric_for(metric: str, available: set[str]) -> str | None:
    """The guest CPU busy % metric measured with `metric` (same rule as lab.results.show_rows)."""
    v = results._variant(metric)
    if v and f"{results.CPU_METRIC}_{v}" in available:
        return f"{results.CPU_METRIC}_{v}"
    return results.CPU_METRIC if results.CPU_METRIC in available else None


# -- charts ----------------------------------------------------------------------------------------

def _tick(v: float, _pos: Any = None) -> str:
    return f"{v:,.6g}"


def _svg(fig: Figure, salt: str) -> str:
    """The figure as an inline <svg> element: no XML prolog, no metadata, unique ids per chart."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    # Inline SVG in HTML needs no namespace declarations; dropping them keeps the file free of
    # any http:// string (they are names, not fetched, but a reviewer should not have to know).
    text = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", text)
    # matplotlib numbers its ids per figure (figure_1, patch_1, ...): prefix them, and every
    # reference to them, so the charts can share one document.
    ids = set(re.findall(r'\sid="([^"]+)"', text))
    text = re.sub(r'(\sid="|href="#|url\(#)([^")]+)',
                  lambda m: f"{m.group(1)}{salt}-{m.group(2)}" if m.group(2) in ids else m.group(0), text)
    text = text.replace("<svg ", '<svg role="img" class="chart" ', 1)
    return text


# How many characters of x labels fit side by side under each panel before they must be rotated,
# and how many bars leave room for a value above each.
ROOM = {"main": (56, 10), "cpu": (24, 5)}


def _crowded(cats: list[str], short: dict[str, str], panel: str) -> bool:
    return sum(len(short.get(c, c)) + 2 for c in cats) > ROOM[panel][0]


def _panel(ax, sides: list[RunData], cats: list[str], short: dict[str, str], workload: str, metric: str | None,
           colours: tuple[str, ...], title: str, percent: bool, panel: str = "main") -> None:
    """Bars at the median, min–max whiskers, a dot per repetition; one call per kind of mark (each
    matplotlib artist costs time to lay out, and a report has dozens of charts)."""
    width = 0.8 / len(sides)
    top = 0.0
    for j, rd in enumerate(sides):
        xs, meds, los, his, dots, flags = [], [], [], [], ([], []), ([], [])
        for i, cat in enumerate(cats):
            x = i - 0.4 + width * (j + 0.5)
            pts = rd.points.get((cat, workload, metric), []) if metric else []
            if not pts:
                cell = rd.cell_status.get(cat)
                why = "missing" if cell is None else ("failed" if cell.status == "failed" else "no data")
                ax.text(x, 0, f" {why}", rotation=90, ha="center", va="bottom", fontsize=8,
                        color=FLAG_COLOUR if why == "failed" else "#777777")
                continue
            values = [v for v, _ in pts]
            med = statistics.median(values)
            xs.append(x)
            meds.append(med)
            los.append(med - min(values))
            his.append(max(values) - med)
            top = max(top, max(values))
            k = len(pts)
            step = width * 0.5 / max(k - 1, 1)
            for m, (v, flagged) in enumerate(pts):
                target = flags if flagged else dots
                target[0].append(x + (m - (k - 1) / 2) * step)
                target[1].append(v)
            if len(cats) * len(sides) <= ROOM[panel][1]:  # a value above each bar, when they do not collide
                ax.annotate(fmt(med), (x, max(values)), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=7, color="#333333")
        if xs:
            ax.bar(xs, meds, width * 0.9, color=colours[j], edgecolor="none", zorder=2, label=f"{rd.side} {rd.run.id}")
            ax.errorbar(xs, meds, yerr=[los, his], fmt="none", ecolor="#333333", elinewidth=1, capsize=3, zorder=3)
        if dots[0]:
            ax.scatter(dots[0], dots[1], s=9, color="#222222", alpha=0.75, zorder=4, linewidths=0)
        if flags[0]:
            ax.scatter(flags[0], flags[1], s=30, marker="x", color=FLAG_COLOUR, zorder=5, linewidths=1.5)
    ax.set_xticks(range(len(cats)))
    long = _crowded(cats, short, panel)
    ax.set_xticklabels([short.get(c, c) for c in cats], fontsize=8, rotation=25 if long else 0,
                       ha="right" if long else "center", rotation_mode="anchor")
    ax.set_xlim(-0.6, len(cats) - 0.4)
    ax.set_ylim(0, max(100.0, top * 1.12) if percent else (top * 1.15 or 1.0))
    ax.yaxis.set_major_locator(MaxNLocator(5))
    ax.yaxis.set_major_formatter(FuncFormatter(_tick))
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(title, fontsize=9, loc="left", y=1.02)  # a fixed y skips matplotlib's costly auto-placement
    ax.grid(axis="y", color="#e4e4e4", zorder=0)
    ax.set_axisbelow(True)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)


def chart(sides: list[RunData], cats: list[str], short: dict[str, str], workload: str, metric: str, unit: str,
          cpu_metric: str | None, salt: str) -> str:
    """One figure: the metric by cell (per run) and, beside it, the matching guest CPU busy %."""
    variant = cpu_metric[len(results.CPU_METRIC) + 1:] if cpu_metric and cpu_metric != results.CPU_METRIC else ""
    cpu_title = "guest CPU busy %" + (f" ({variant})" if variant else "") if cpu_metric else "CPU not measured"
    rotate = _crowded(cats, short, "cpu")
    with matplotlib.rc_context({"svg.fonttype": "none", "text.parse_math": False, "font.size": 8}):
        fig = Figure(figsize=(7.2, 2.8 if rotate else 2.6))
        grid = fig.add_gridspec(1, 2, width_ratios=(2, 1), wspace=0.25)
        _panel(fig.add_subplot(grid[0, 0]), sides, cats, short, workload, metric, RUN_COLOURS, f"{metric} ({unit})",
               percent=unit == "%")
        _panel(fig.add_subplot(grid[0, 1]), sides, cats, short, workload, cpu_metric, CPU_COLOURS, cpu_title,
               percent=True, panel="cpu")
        fig.subplots_adjust(left=0.08, right=0.99, top=0.88, bottom=0.25 if rotate else 0.12)
        return _svg(fig, salt)


# -- the page --------------------------------------------------------------------------------------

def _categories(sides: list[RunData]) -> list[str]:
    cats: list[str] = []
    for rd in sides:
        for c in rd.cells:
            if c.label not in cats:
                cats.append(c.label)
        for key in rd.series:  # samples of a cell the cells table does not know (should not happen)
            if key[0] not in cats:
                cats.append(key[0])
    return cats


def _results_rows(rd: RunData, short: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    by_wl: dict[str, list[dict[str, Any]]] = {}
    seed = rd.run.seed or 0
    all_series = list(rd.series.values())
    index = {s.key: s for s in all_series}
    cat_order = {label: i for i, label in enumerate(short)}
    order = {True: 0, False: 1, None: 2}
    rows = sorted(results.show_rows(all_series),
                  key=lambda r: (r.workload, order[index[(r.cell, r.workload, r.metric)].higher_is_better], r.metric,
                                 cat_order.get(r.cell, len(cat_order)), r.cell))
    previous = None
    for r in rows:
        s = index[(r.cell, r.workload, r.metric)]
        summ = stats.summarize(s.values, seed=seed)
        by_wl.setdefault(r.workload, []).append({
            "cell": short.get(r.cell, r.cell), "label": r.cell, "metric": r.metric, "unit": r.unit,
            "direction": r.direction, "median": fmt(summ.median), "ci": f"{fmt(summ.ci_low)} – {fmt(summ.ci_high)}",
            "range": f"{fmt(summ.min)} – {fmt(summ.max)}", "cv": _pct(summ.cv), "n": summ.n,
            "cpu": fmt(r.cpu_busy), "flagged": r.flagged, "first": (r.workload, r.metric) != previous,
        })
        previous = (r.workload, r.metric)
    return by_wl


def _side(rd: RunData) -> analysis.Side:
    return analysis.side(rd.run.id, rd.run.seed, rd.cells, rd.samples, rd.hosts)


def _noise(sides: list[RunData]) -> dict[tuple[str, str], stats.RatioCI]:
    out: dict[tuple[str, str], stats.RatioCI] = {}
    for rd in sides:
        for k, v in analysis.noise_floor(list(rd.series.values()), seed=rd.run.seed or 0).items():
            out[k] = analysis.widest(out.get(k), v)
    return out


def _band(band: tuple[float, float] | None) -> str:
    return f"{fmt(band[0])} – {fmt(band[1])}" if band else "–"


def _comparison(a: RunData, b: RunData, short: dict[str, str], wl_order: dict[str, int]) -> dict[str, Any]:
    noise = _noise([a, b])
    rows = analysis.compare_sides(_side(a), _side(b), noise=noise).rows
    cat_order = {label: i for i, label in enumerate(short)}
    order = {True: 0, False: 1, None: 2}
    # Grouped like the charts: workload, then throughput-like metrics first, CPU last, cells in run order.
    rows.sort(key=lambda r: (wl_order.get(r.key[1], len(wl_order)), r.key[1], r.key[2].startswith(results.CPU_METRIC),
                             order[r.higher_is_better],
                             r.key[2], cat_order.get(r.key[0], len(cat_order))))
    out = []
    counts: dict[str, int] = {}
    previous = None
    for r in rows:
        cell, wl, metric = r.key
        counts[r.verdict.value] = counts.get(r.verdict.value, 0) + 1
        out.append({
            "cell": short.get(cell, cell), "label": cell, "workload": wl, "metric": metric, "unit": r.unit,
            "direction": _direction(r.higher_is_better), "median_a": fmt(r.median_a), "median_b": fmt(r.median_b),
            "n_a": r.n_a, "n_b": r.n_b, "ratio": fmt(r.ratio),
            "ci": f"{fmt(r.ratio_ci[0])} – {fmt(r.ratio_ci[1])}" if r.ratio_ci else "–",
            "p": _p(r.p_value), "band": _band(r.noise_band), "verdict": r.verdict.value, "cls": VERDICT_CLASS[r.verdict],
            "is_cpu": metric.startswith(results.CPU_METRIC), "first": (wl, metric) != previous,
        })
        previous = (wl, metric)
    cells = []
    for label in _categories([a, b]):
        ca, cb = a.cell_status.get(label), b.cell_status.get(label)
        cells.append({"cell": short.get(label, label), "label": label,
                      "a": ca.status if ca else "missing", "b": cb.status if cb else "missing"})
    ns = [r.n_a for r in rows if r.n_a] + [r.n_b for r in rows if r.n_b]
    n_min = min(ns) if ns else 0
    return {"rows": out, "counts": counts, "cells": cells, "noise": bool(noise),
            "min_p": _p(stats.min_exact_p(n_min, n_min)) if n_min else "–", "n_min": n_min,
            "alpha": compare_mod.DEFAULT_ALPHA}


def _overhead(rd: RunData, short: dict[str, str], wl_order: dict[str, int]) -> dict[str, Any] | None:
    """Every cell against the bare-metal cell of its host, if the run has one."""
    if not any(analysis.kind(c) == plan.BARE_METAL for c in rd.cells):
        return None
    found = analysis.overheads(rd.cells, rd.samples, analysis.parse_selector([analysis.BASELINE_DEFAULT]),
                               seed=rd.run.seed or 0)
    noise = _noise([rd])
    order = {True: 0, False: 1, None: 2}
    cat_order = {label: i for i, label in enumerate(short)}
    found.sort(key=lambda o: (wl_order.get(o.row.key[1], len(wl_order)), o.row.key[1],
                              o.row.key[2].startswith(results.CPU_METRIC),
                              order[o.row.higher_is_better], o.row.key[2], cat_order.get(o.cell, len(cat_order))))
    rows, previous = [], None
    for o in found:
        r = o.row
        _, wl, metric = r.key
        nf = noise.get((wl, metric))
        rows.append({
            "cell": short.get(o.cell, o.cell), "label": o.cell, "reference": short.get(o.reference, o.reference),
            "workload": wl, "metric": metric, "unit": r.unit, "direction": _direction(r.higher_is_better),
            "base": fmt(r.median_a), "median": fmt(r.median_b), "n": f"{r.n_a}/{r.n_b}",
            "change": analysis.fmt_change(o.change_pct, o.change_ci_pct), "p": _p(r.p_value),
            "band": _band(nf.band()) if nf else "–", "verdict": r.verdict.value, "cls": VERDICT_CLASS[r.verdict],
            "is_cpu": metric.startswith(results.CPU_METRIC), "first": (wl, metric) != previous,
        })
        previous = (wl, metric)
    return {"rows": rows, "run": rd.run.id}


def _hosts(sides: list[RunData]) -> dict[str, Any]:
    """Host facts as rows; with two runs, paired by host name (or the only host of each run)."""
    a = sides[0].hosts
    if len(sides) == 1:
        return {"pairs": [{"name": h, "rows": [{"fact": k, "a": v, "b": None, "diff": False}
                                               for k, v in hostinfo.flatten(f).items()]} for h, f in a.items()],
                "ndiff": 0, "diffs": []}
    b = sides[1].hosts
    if set(a) != set(b) and len(a) == 1 and len(b) == 1:
        pairs = [(f"{next(iter(a))} / {next(iter(b))}", next(iter(a.values())), next(iter(b.values())))]
    else:
        pairs = [(h, a.get(h), b.get(h)) for h in sorted(set(a) | set(b), key=lambda h: (h not in a, h))]
    out, diffs = [], []
    for name, fa, fb in pairs:
        flat_a, flat_b = hostinfo.flatten(fa or {}), hostinfo.flatten(fb or {})
        keys = list(flat_a) + [k for k in flat_b if k not in flat_a]
        rows = []
        for k in keys:
            va = flat_a.get(k, "missing" if fa is None else "–")
            vb = flat_b.get(k, "missing" if fb is None else "–")
            diff = va != vb
            rows.append({"fact": k, "a": va, "b": vb, "diff": diff})
            if diff:
                diffs.append(f"{name}: {k}")
        out.append({"name": name, "rows": rows})
    return {"pairs": out, "ndiff": len(diffs), "diffs": diffs}


def _cell_rows(rd: RunData, short: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for c in rd.cells:
        f = c.facts
        ver = f.get("verified") or {}
        tun = f.get("tuning") or {}
        effective = tun.get("effective") or {}
        mem = ver.get("mem_kib")
        tuning = tun.get("profile", c.axes.get("tuning", "–"))
        if tun and not tun.get("applicable", True):
            tuning += f" (n/a: {tun.get('reason') or 'not applicable'})"
        rows.append({
            "id": c.cell_id, "cell": short.get(c.label, c.label), "label": c.label, "status": c.status,
            "stage": c.stage or "–", "error": c.error, "accel": f.get("accel", "–"),
            "nic": f"{ver['nic_driver']}" if "nic_driver" in ver else "–", "nic_asked": c.axes.get("nic", ""),
            "vcpus": ver.get("vcpus", "–"), "vcpus_asked": c.axes.get("vcpus", "–"), "memory": f"{mem / 1024:.0f} MiB" if isinstance(mem, (int, float)) else "–",
            "memory_asked": c.axes.get("memory_mib", ""), "kernel": ver.get("kernel", "–"),
            "tuning": tuning, "effective": [f"{k} = {v}" for k, v in effective.items()],
            "boot": fmt(f.get("boot_seconds")) if f.get("boot_seconds") is not None else "–",
            "clone": f.get("clone", c.axes.get("clone", "–")),
            "image": (f.get("image_digest") or "–")[:12], "image_full": f.get("image_digest") or "",
            "facts_json": json.dumps(f, indent=2, sort_keys=True),
            "skipped": [f"{w}: {why}" for w, why in (f.get("skipped_workloads") or {}).items()],
        })
    return rows


def _run_info(rd: RunData) -> dict[str, Any]:
    r = rd.run
    return {
        "side": rd.side, "colour": rd.colour, "id": r.id, "name": r.name, "status": r.status, "error": r.error,
        "started": _when(r.started_at), "finished": _when(r.finished_at),
        "duration": _duration((r.finished_at - r.started_at) if r.finished_at else None),
        "seed": r.seed, "lab_version": rd.lab_version or "–", "config_path": r.config_path or "–",
        "config_text": rd.config_text or "", "manifest_json": json.dumps(r.manifest, indent=2, sort_keys=True),
        "cells_done": sum(1 for c in rd.cells if c.status == "done"), "cells_total": len(rd.cells),
        "samples": len(rd.samples), "schedule": _schedule(r.manifest),
        "executions": len(rd.executions),
    }


def _schedule(manifest: dict[str, Any]) -> str:
    """The repetition policy and order, in words (from the manifest lab.schedule.describe wrote)."""
    sch = manifest.get("schedule") or {}
    if not sch:
        return "–"
    text = f"{sch.get('order')}"
    if sch.get("repetitions_per_boot"):
        text += f" in {len(manifest.get('rounds', []))} round(s), {sch['repetitions_per_boot']} repetition(s) per boot"
    if sch.get("target_ci_pct"):
        text += (f"; adaptive: until the 95 % CI is within ±{sch['target_ci_pct']:g} %, "
                 f"{sch.get('repetitions')}–{sch.get('max_repetitions')} repetitions"
                 + (f", at most {sch['max_seconds']:g} s" if sch.get("max_seconds") else ""))
    else:
        text += f"; {sch.get('repetitions')} repetitions"
    return text + f", {sch.get('warmup')} warm-up per boot"


def _workload_order(sides: list[RunData]) -> list[str]:
    """Workloads in the order lab.toml lists them ([suite] workloads), then any others by name."""
    listed: list[str] = []
    for rd in sides:
        try:
            wls = tomllib.loads(rd.config_text).get("suite", {}).get("workloads", [])
        except (tomllib.TOMLDecodeError, AttributeError):
            wls = []
        listed += [w for w in wls if isinstance(w, str) and w not in listed]
    present = {k[1] for rd in sides for k in rd.series}
    return [w for w in listed if w in present] + sorted(present - set(listed))


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(lab.TEMPLATES_DIR)),
                             autoescape=jinja2.select_autoescape(["html", "j2"], default=True),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env


def render(store: Store, run_id: str, vs: str | None = None, *, generated_at: float | None = None) -> str:
    """The report of `run_id` (side A), against `vs` (side B) if given, as one HTML string.

    Reads the store only. `run_id`/`vs` may be anything `Store.run` accepts (id, prefix, latest).
    Raises lab.errors.UsageError for an unknown run and LabError when the two runs disagree on a
    metric's unit (lab.compare).
    """
    sides = [_load(store, store.run(run_id), "A")]
    if vs is not None:
        sides.append(_load(store, store.run(vs), "B"))
    cats = _categories(sides)
    short = results.short_labels(cats)

    workloads: list[dict[str, Any]] = []
    wl_names = _workload_order(sides)
    wl_rank = {w: i for i, w in enumerate(wl_names)}  # tables follow [suite] workloads, like the charts
    n_chart = 0
    for wl in wl_names:
        metrics: dict[str, results.Series] = {}
        cpu_available: set[str] = set()
        for rd in sides:
            for (cell, w, m), s in rd.series.items():
                if w != wl:
                    continue
                if m.startswith(results.CPU_METRIC):
                    cpu_available.add(m)
                if _visible(s):
                    metrics.setdefault(m, s)
        charts = []
        order = {True: 0, False: 1, None: 2}
        for m, s in sorted(metrics.items(), key=lambda kv: (order[kv[1].higher_is_better], kv[0])):
            cpu_m = cpu_metric_for(m, cpu_available)
            n_chart += 1
            charts.append({
                "metric": m, "unit": s.unit, "direction": _direction(s.higher_is_better),
                "better": {True: "higher is better", False: "lower is better", None: "informational"}[
                    s.higher_is_better],
                "cpu_metric": cpu_m, "anchor": f"chart-{wl}-{m}",
                "svg": Markup(chart(sides, cats, short, wl, m, s.unit, cpu_m, salt=f"lab-report-{n_chart}")),
            })
        workloads.append({"name": wl, "charts": charts,
                          "tables": [{"run": _run_info(rd), "rows": _results_rows(rd, short).get(wl, [])}
                                     for rd in sides]})

    failed = [{"side": rd.side, "run": rd.run.id, "id": c.cell_id, "cell": short.get(c.label, c.label),
               "label": c.label, "status": c.status, "stage": c.stage or "–", "error": c.error or ""}
              for rd in sides for c in rd.cells if c.status not in ("done", "n/a", "duplicate")]
    ctx = {
        "title": f"lab report: {sides[0].run.id}" + (f" vs {sides[1].run.id}" if len(sides) > 1 else ""),
        "runs": [_run_info(rd) for rd in sides],
        "short": [{"short": short.get(c, c), "label": c} for c in cats],
        "failed": failed,
        "comparison": _comparison(sides[0], sides[1], short, wl_rank) if len(sides) > 1 else None,
        "overhead": _overhead(sides[0], short, wl_rank),
        "workloads": workloads,
        "cells": [{"run": _run_info(rd), "rows": _cell_rows(rd, short)} for rd in sides],
        "hosts": _hosts(sides),
        "generated": _when(generated_at if generated_at is not None else time.time()),
        "lab_version": lab.__version__,
        "colours": {"A": RUN_COLOURS[0], "B": RUN_COLOURS[1], "flag": FLAG_COLOUR},
    }
    return _env().get_template(TEMPLATE).render(**ctx)


def default_path(store: Store, run_id: str, vs: str | None = None) -> Path:
    """results/report-<run>.html (or report-<a>-vs-<b>.html) next to the store."""
    name = f"report-{run_id}" + (f"-vs-{vs}" if vs else "") + ".html"
    return store.dir / name


def write(store: Store, run_id: str, vs: str | None = None, out: Path | str | None = None) -> Path:
    """Render and write the report; returns the path written. Resolves run references first so
    the default file name carries the full run ids."""
    a = store.run(run_id).id
    b = store.run(vs).id if vs is not None else None
    html = render(store, a, b)
    path = Path(out) if out is not None else default_path(store, a, b)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(path)
    return path
