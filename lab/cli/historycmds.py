"""The commands that follow hosts over time: history, import, prune (issue 36)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from lab import analysis, changepoints, history, storeimport, storeprune
from lab.cli import shapes
from lab.cli.group import (
    cli,
    config_option,
    load_or_default,
    new_store,
    read_store,
    results_dir as find_results,
    results_option,
)
from lab.cli.printing import clock, fmt, out, say, styled, table
from lab.errors import UsageError
from lab.history import History
from lab.store import Store

VERDICT_STYLES = {"worse": "red", "better": "green", "too short": "yellow"}


@cli.command("history")
@click.argument("host", required=False)
@click.option("--cell", "cell_sel", multiple=True, metavar="AXIS=VALUE", help="only the cells with these axes")
@click.option("--workload", default=None, help="only this workload")
@click.option("--metric", default=None, help="only this metric")
@click.option("--all", "everything", is_flag=True, help="every metric (CPU breakdowns, zero error counters)")
@click.option("--last", type=click.IntRange(min=2), default=None, help="search only the newest N runs of each series")
@click.option(
    "--min-runs",
    type=click.IntRange(min=2),
    default=changepoints.Settings.min_runs,
    show_default=True,
    help="runs needed on each side of a change",
)
@click.option(
    "--fail-on-regression",
    is_flag=True,
    help="print only regressions (the newest run past a change for the worse on a primary metric), "
    "one line each; exit 1 if there is one",
)
@config_option
@results_option
@click.option("--json", "as_json", is_flag=True, help="the series as JSON (shape lab.history/1)")
def history_cmd(
    host, cell_sel, workload, metric, everything, last, min_runs, fail_on_regression, config_path, results_dir, as_json
):
    """Every stored run of each configuration on a host, as a series: median and CI per run, the
    host's facts and load, and the change points with what changed on the host across each."""
    store = read_store(config_path, results_dir)
    settings = changepoints.Settings(min_runs=min_runs, last=last)
    found = history.histories(
        store,
        host=host,
        selector=analysis.parse_selector(cell_sel, "--cell"),
        workload=workload,
        metric=metric,
        everything=everything,
        settings=settings,
    )
    if not found:
        hosts = sorted({str(c.axes.get("host")) for r in store.runs() for c in store.cells(r.id)})
        asked = " ".join(
            filter(None, (host and f"host {host}", *cell_sel, workload and f"workload {workload}", metric))
        )
        raise UsageError(f"no series of {asked or 'any run'} in {store.path} (hosts: {', '.join(hosts) or 'none'})")
    regressions = [(h, h.regression) for h in found if h.regression is not None]
    if as_json:
        shapes.emit("history", history_document(store, found, settings))
    elif fail_on_regression:
        for h, c in regressions:
            say(history.regression_line(h, c), soft_wrap=True)
    else:
        for h in found:
            print_history(h)
    if fail_on_regression and regressions:
        sys.exit(1)


def print_history(h: History) -> None:
    k = h.key
    direction = {True: "↑", False: "↓", None: ""}[h.higher_is_better]
    measured = sum(1 for p in h.points if p.median is not None)
    title = f"{k.cell} · {k.workload} {k.metric} ({h.unit}) {direction} · {measured} runs"
    t = table(
        ("run", "started", "median", "95 % CI", "n", "flagged", "host load", "host"),
        title=f"{title}  {history.sparkline(h.points)}",
        right=("median", "95 % CI", "n", "flagged"),
    )
    starts = {c.run_id for c in h.changes}
    for p in h.points:
        t.add_row(
            styled(p.run_id, "bold") if p.run_id in starts else p.run_id,
            clock(p.started_at),
            fmt(p.median),
            f"{fmt(p.ci[0])}–{fmt(p.ci[1])}" if p.ci else "–",
            str(p.n),
            str(p.flagged or "–"),
            p.load.text() if p.load.repetitions else "not measured",
            p.fingerprint[:8] or "–",
        )
    out.print(t)
    if h.result.verdict != "changed":
        style = VERDICT_STYLES.get(h.result.verdict, "")
        say(styled(h.result.verdict, style), f": {h.result.why}")
    for c in h.changes:
        say(
            "change: ",
            styled(c.verdict, VERDICT_STYLES.get(c.verdict, "")),
            " ",
            history.change_text(h, c)[len(c.verdict) + 1 :],
            soft_wrap=True,
        )
    say("")


def history_document(store, found: list[History], settings: changepoints.Settings) -> dict[str, Any]:
    facts: dict[str, dict[str, Any]] = {}
    series = []
    for h in found:
        k = h.key
        series.append(
            {
                "host": k.host,
                "machine": k.machine,
                "cell": k.cell,
                "image_digest": k.image_digest,
                "workload": k.workload,
                "metric": k.metric,
                "params": json.loads(k.params),
                "unit": h.unit,
                "higher_is_better": h.higher_is_better,
                "primary": h.primary,
                "verdict": h.result.verdict,
                "why": h.result.why,
                "noise_pct": None if h.result.noise is None else round(h.result.noise * 100, 3),
                "runs": [
                    {
                        "run": p.run_id,
                        "started_at": p.started_at,
                        "median": p.median,
                        "ci": list(p.ci) if p.ci else None,
                        "n": p.n,
                        "flagged": p.flagged,
                        "host_load": {
                            "repetitions": p.load.repetitions,
                            "median_pct": p.load.median_pct,
                            "max_pct": p.load.max_pct,
                            "max_steal_pct": p.load.max_steal_pct,
                            "flagged": p.load.flagged,
                        },
                        "fingerprint": p.fingerprint,
                        **{k.replace(" ", "_"): p.context.get(k) for k in history.RUN_FACTS},
                    }
                    for p in h.points
                ],
                "change_points": [
                    {
                        "run": c.run_id,
                        "before_run": c.before_run,
                        "index": c.at.index,
                        "verdict": c.verdict,
                        "size_pct": round(c.at.size * 100, 3),
                        "ci_pct": [round(c.at.ci[0] * 100, 3), round(c.at.ci[1] * 100, 3)],
                        "p_value": c.at.p_value,
                        "runs_before": c.at.runs_before,
                        "runs_after": c.at.runs_after,
                        "before": c.at.before,
                        "after": c.at.after,
                        "rechecked": c.at.rechecked,
                        "facts_changed": [{"fact": f, "before": a, "after": b} for f, a, b in c.facts],
                    }
                    for c in h.changes
                ],
                "regression": h.regression is not None,
            }
        )
        for p in h.points:
            if p.fingerprint and p.fingerprint not in facts:
                facts[p.fingerprint] = p.host_facts
    return {
        "results": str(store.dir.resolve()),
        "settings": {
            "min_runs": settings.min_runs,
            "alpha": settings.alpha,
            "min_effect_noise": settings.min_effect_noise,
            "min_effect_pct": settings.min_effect_pct,
            "last": settings.last,
        },
        "series": series,
        "regressions": [history.regression_line(h, c) for h in found if (c := h.regression) is not None],
        "host_facts": facts,
    }


@cli.command("import")
@click.argument("source", type=click.Path())
@config_option
@results_option
@click.option("--json", "as_json", is_flag=True, help="what was imported as JSON (shape lab.import/1)")
def import_cmd(source, config_path, results_dir, as_json):
    """Merge the runs of another results store (a directory, or its lab.db) into this one: runs
    already here are skipped, so importing again changes nothing."""
    cfg = load_or_default(config_path)
    src = storeimport.source_store(source)
    click.get_current_context().call_on_close(src.close)
    dst = new_store(cfg, Path(results_dir) if results_dir else None)
    done = storeimport.import_store(dst, src)
    if as_json:
        shapes.emit(
            "import",
            {
                "source": str(src.dir.resolve()),
                "results": str(dst.dir.resolve()),
                "added": [{"id_there": a, "id_here": b} for a, b in done.added],
                "replaced": done.replaced,
                "already_here": done.present,
                "still_running": done.running,
                "samples": done.samples,
            },
        )
        return
    say(
        f"imported {len(done.added)} run(s) ({done.samples} samples) from {src.dir} into {dst.path}"
        + (f"; {done.present} already here" if done.present else "")
        + (f"; brought up to date: {', '.join(done.replaced)}" if done.replaced else ""),
        soft_wrap=True,
    )
    for a, b in done.renamed:
        say(f"  run {a} is {b} here (its id was taken)")
    if done.running:
        say(f"  skipped, still running there (import again once they end): {', '.join(done.running)}")


@cli.command("prune")
@click.option("--keep", type=click.IntRange(min=1), required=True, help="keep the newest N runs")
@click.option("--dry-run", is_flag=True, help="list what would be removed")
@config_option
@results_option
def prune_cmd(keep, dry_run, config_path, results_dir):
    """Remove all but the newest N runs from the results store (it keeps every run until told)."""
    cfg = load_or_default(config_path)
    where = find_results(config_path, results_dir)
    if not (where / Store.FILENAME).exists():
        raise UsageError(f"no runs in {where} (no {Store.FILENAME})")
    store = new_store(cfg, where)
    done = storeprune.prune(store, keep, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    say(f"{verb} {len(done.removed)} run(s) ({done.samples} samples), kept the newest {keep}")
    if done.removed:
        say(f"  {', '.join(done.removed)}", soft_wrap=True)
    if done.kept_live:
        say(f"  kept, still running or holding a lease (`lab gc` first): {', '.join(done.kept_live)}")
