"""`lab report`: one self-contained HTML file for a run, optionally against a second run.

The file needs nothing but itself to be read: CSS is inline, charts are inline SVG rendered by
matplotlib (no pyplot, no GUI backend, no fonts or scripts fetched), and there is no JavaScript.
Contents, in order:

- failed cells (stage and error), then with ``vs`` the comparison: which cells each run has, and
  a row per metric from lab.compare (ratio B/A, its CI, p, verdict, coloured by verdict);
- with `lab explain` follow-up runs (or for one of them): each knob's effect with its CI as a chart,
  its share of the gap and verdict, the interactions that matter (lab.report.explain);
- a chart per workload metric by cell: a bar at the median, min–max whiskers and a dot for every
  repetition (flagged ones as a red x), beside it the guest CPU busy % that goes with the metric
  (``cpu_busy_pct_<variant>``, the convention of lab.results);
- the results table per workload, like ``lab show``: median, 95 % bootstrap CI of the median
  (lab.stats.summarize), min–max, CV, n, CPU busy %, flagged repetitions marked;
- the host's load under each run's samples (lab.hostload): foreign load per cell and every
  flagged repetition with its reason (flagged samples are marked everywhere, never averaged in);
- with ``history``, a trend chart per series of the run (lab.report.history): every stored run of
  the same configuration on the same host, with its change points and the host facts that changed;
- cell facts (accelerator, verified NIC driver / vCPUs / memory, tuning in effect, boot seconds),
  host fingerprints (with ``vs``: the facts that differ between the two runs' hosts highlighted),
  and the exact manifest JSON and lab.toml text of each run.

Side A is ``run_id``, side B is ``vs``: ``lab report A --vs B`` shows what ``lab compare A B``
shows, plus everything above for both runs.

`render` only reads the store and returns the HTML; `write` puts it in a file.
"""

from __future__ import annotations

import time
import tomllib
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

import lab
from lab import outfiles, results
from lab.report import history as history_charts, tables
from lab.report.charts import chart
from lab.report.data import (
    FLAG_COLOUR,
    RUN_COLOURS,
    RunData,
    categories,
    cpu_metric_for,
    direction,
    load,
    visible,
    when,
)
from lab.report.explain import section as explain_section
from lab.results import fmt  # noqa: F401  (the one number format, for callers and tests)
from lab.store import Store

TEMPLATE = "report/report.html.j2"


# -- the page --------------------------------------------------------------------------------------


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
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(lab.TEMPLATES_DIR)),
        autoescape=jinja2.select_autoescape(["html", "j2"], default=True),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env


def render(
    store: Store, run_id: str, vs: str | None = None, *, generated_at: float | None = None, history: bool = False
) -> str:
    """The report of `run_id` (side A), against `vs` (side B) if given, as one HTML string.

    Reads the store only. `run_id`/`vs` may be anything `Store.run` accepts (id, prefix, latest).
    Raises lab.errors.UsageError for an unknown run and LabError when the two runs disagree on a
    metric's unit (lab.compare).
    """
    sides = [load(store, store.run(run_id), "A")]
    if vs is not None:
        sides.append(load(store, store.run(vs), "B"))
    cats = categories(sides)
    short = results.short_labels(cats)

    workloads: list[dict[str, Any]] = []
    wl_names = _workload_order(sides)
    wl_rank = {w: i for i, w in enumerate(wl_names)}  # tables follow [suite] workloads, like the charts
    n_chart = 0
    for wl in wl_names:
        metrics: dict[str, results.Series] = {}
        cpu_available: set[str] = set()
        for rd in sides:
            for (_cell, w, m), s in rd.series.items():
                if w != wl:
                    continue
                if m.startswith(results.CPU_METRIC):
                    cpu_available.add(m)
                if visible(s):
                    metrics.setdefault(m, s)
        charts = []
        order = {True: 0, False: 1, None: 2}
        for m, s in sorted(metrics.items(), key=lambda kv: (order[kv[1].higher_is_better], kv[0])):
            cpu_m = cpu_metric_for(m, cpu_available)
            n_chart += 1
            charts.append(
                {
                    "metric": m,
                    "unit": s.unit,
                    "direction": direction(s.higher_is_better),
                    "better": {True: "higher is better", False: "lower is better", None: "informational"}[
                        s.higher_is_better
                    ],
                    "cpu_metric": cpu_m,
                    "anchor": f"chart-{wl}-{m}",
                    "svg": Markup(chart(sides, cats, short, wl, m, s.unit, cpu_m, salt=f"lab-report-{n_chart}")),
                }
            )
        workloads.append(
            {
                "name": wl,
                "charts": charts,
                "tables": [
                    {"run": tables.run_info(rd), "rows": tables.results_rows(rd, short).get(wl, [])} for rd in sides
                ],
            }
        )

    failed = [
        {
            "side": rd.side,
            "run": rd.run.id,
            "id": c.cell_id,
            "cell": short.get(c.label, c.label),
            "label": c.label,
            "status": c.status,
            "stage": c.stage or "–",
            "error": c.error or "",
        }
        for rd in sides
        for c in rd.cells
        if c.status not in ("done", "n/a", "duplicate")
    ]
    ctx = {
        "title": f"lab report: {sides[0].run.id}" + (f" vs {sides[1].run.id}" if len(sides) > 1 else ""),
        "runs": [tables.run_info(rd) for rd in sides],
        "short": [{"short": short.get(c, c), "label": c} for c in cats],
        "failed": failed,
        "comparison": tables.comparison(sides[0], sides[1], short, wl_rank) if len(sides) > 1 else None,
        "overhead": tables.overhead(sides[0], short, wl_rank),
        "explained": [e for rd in sides for e in explain_section(store, rd.run)],
        "workloads": workloads,
        "cells": [{"run": tables.run_info(rd), "rows": tables.cell_rows(rd, short)} for rd in sides],
        "hosts": tables.hosts(sides),
        "host_load": [tables.host_load(rd, short) for rd in sides],
        "history": history_charts.sections(store, sides[0].run.id, short) if history else None,
        "generated": when(generated_at if generated_at is not None else time.time()),
        "lab_version": lab.__version__,
        "colours": {"A": RUN_COLOURS[0], "B": RUN_COLOURS[1], "flag": FLAG_COLOUR},
    }
    return _env().get_template(TEMPLATE).render(**ctx)


def default_path(store: Store, run_id: str, vs: str | None = None) -> Path:
    """results/report-<run>.html (or report-<a>-vs-<b>.html) next to the store."""
    name = f"report-{run_id}" + (f"-vs-{vs}" if vs else "") + ".html"
    return store.dir / name


def write(
    store: Store,
    run_id: str,
    vs: str | None = None,
    out: Path | str | None = None,
    *,
    history: bool = False,
    mode: int = 0o600,
) -> Path:
    """Render and write the report (lab.outfiles: never over a link, a device or a directory; whole
    or not at all), with permission bits `mode` ([lab] results_mode without x: 0600 by default);
    returns the path written. Resolves run references first so the default file name carries the
    full run ids."""
    a = store.run(run_id).id
    b = store.run(vs).id if vs is not None else None
    path = outfiles.check(Path(out) if out is not None else default_path(store, a, b))
    return outfiles.write(path, render(store, a, b, history=history), mode=mode)
