"""The commands that read results: ls, show, report, reparse (compare: lab.cli.comparing)."""

from __future__ import annotations

import csv
import io
import json
import time

import click

from lab import analysis, axes, plaintext, report, results
from lab.cli import shapes
from lab.cli.group import (
    cli,
    closing,
    config_option,
    load_or_default,
    open_store,
    read_store,
    results_dir as find_results,
    results_option,
)
from lab.cli.printing import clock, duration, fmt, line, out, say, styled, table
from lab.explain import record as explain_record
from lab.reparse import reparse
from lab.store import RunRow, Store


@cli.command("ls")
@config_option
@results_option
@click.option("--json", "as_json", is_flag=True, help="the runs as JSON (shape lab.ls/1)")
def ls_cmd(config_path, results_dir, as_json):
    """List stored runs."""
    where = find_results(config_path, results_dir)
    if not (where / Store.FILENAME).exists():
        if as_json:
            shapes.emit("ls", shapes.ls_document(where, None))
        else:
            say(f"no runs in {where} yet; `lab run` makes one")  # an answer, not an error
        return
    store = closing(Store(where, readonly=True))
    if as_json:
        shapes.emit("ls", shapes.ls_document(where, store))
        return
    t = table(("run", "name", "started", "duration", "status", "cells", "samples"))
    for r in store.runs():
        cells = store.cells(r.id)
        done = sum(1 for c in cells if c.status == "done")
        t.add_row(
            r.id,
            r.name,
            clock(r.started_at),
            duration((r.finished_at or time.time()) - r.started_at),
            r.status,
            f"{done}/{len(cells)}",
            str(len(store.samples(r.id))),
        )
    out.print(t)


def print_show(store: Store, run: RunRow, everything: bool = False) -> None:
    """A run's results: how it was scheduled, cells that did not finish, what was in effect, and a
    table per workload."""
    cells = store.cells(run.id)
    samples = store.samples(run.id)
    all_series = results.series(samples, cells)
    rows = results.show_rows(all_series, everything=everything, seed=run.seed or 0, spread=True)
    short = results.short_labels([c.label for c in cells])
    say("run ", styled(run.id, "bold"), f" ({run.name}), {run.status}")
    print_family(store, run)
    sched = run.manifest.get("schedule") or {}
    if sched:
        policy = (
            f"adaptive: ±{sched['target_ci_pct']:g} % CI target, {sched['repetitions']}–{sched['max_repetitions']}"
            " repetitions"
            if sched.get("target_ci_pct")
            else f"{sched.get('repetitions')} repetitions"
        )
        say(
            f"order {sched.get('order')} (seed {sched.get('seed')}), {policy}, {sched.get('warmup')} warm-up"
            + (
                f" per boot, {sched['repetitions_per_boot']} repetition(s) per boot"
                if "repetitions_per_boot" in sched
                else ""
            )
        )
    if run.manifest.get("rounds"):
        executed = store.timings.executions(run.id)
        say(
            f"executed: {len(executed)} workload runs in {len(run.manifest['rounds'])} rounds: "
            + " | ".join(f"{i}: {' '.join(r)}" for i, r in enumerate(run.manifest["rounds"], start=1)),
            soft_wrap=True,
        )
    lanes = run.manifest.get("lanes") or {}
    if len(lanes) > 1:  # several hosts, or slots of one, ran at once (lab.runner.lanes)
        pairs = run.manifest.get("overlaps") or []
        say(
            f"lanes: {len(lanes)} at once: "
            + " | ".join(f"{h}: {' '.join(ids)}" for h, ids in lanes.items())
            + f"; {len(pairs)}{'+' if run.manifest.get('overlaps_cut_at') else ''} pairs of cells up at the same time",
            soft_wrap=True,
        )
    for host, vm in (run.manifest.get("client_vms") or {}).items():  # client = "vm" (lab.runner.clientvm)
        say(f"client VM of host {host}: {vm.get('name')} at {vm.get('address')} ran its load generators")
    for host, machine in (run.manifest.get("client_machines") or {}).items():  # client = "ssh:"
        target, address = machine.get("target"), machine.get("address")
        say(f"client machine of host {host}: {target} at {address} ran its load generators")
    for c in cells:
        if c.status != "done":
            say(f"  {c.cell_id} {c.label}: ", styled(c.status, "red"), f" at {c.stage}: {c.error}" if c.error else "")
        if axes.knobs_set(c.axes) and (c.facts.get("tuning") or {}).get("effective") is not None:
            say(f"  {c.cell_id} in effect: {_in_effect(c.facts['tuning'])}", soft_wrap=True)
        for wl, why in (c.facts.get("skipped_workloads") or {}).items():
            say(f"  {c.cell_id} {short.get(c.label, c.label)}: {wl} skipped: {why}")
    stopped = run.manifest.get("repetitions") or {}
    if sched.get("target_ci_pct"):
        for cid, wls in stopped.items():
            for wl, o in wls.items():
                say(f"  {cid} {wl}: n = {o['n']}, {o['stopped']}")
    by_wl: dict[str, list] = {}
    for row in rows:
        by_wl.setdefault(row.workload, []).append(row)
    for wl, wrows in by_wl.items():
        t = table(
            ("cell", "metric", "median", "95 % CI", "min–max", "CV", "n", "CPU busy %"),
            title=wl,
            right=("median", "95 % CI", "min–max", "CV", "n", "CPU busy %"),
        )
        for r in wrows:
            metric = f"{r.metric} ({r.unit}) {r.direction}".rstrip()
            median = line(fmt(r.median), flag_mark(r.flagged))
            t.add_row(
                short.get(r.cell, r.cell),
                metric,
                median,
                f"{fmt(r.ci_low)}–{fmt(r.ci_high)}",
                f"{fmt(r.low)}–{fmt(r.high)}",
                "–" if r.cv is None else f"{r.cv * 100:.1f} %",
                str(r.n),
                fmt(r.cpu_busy),
            )
        out.print(t)
    print_host_load(run, cells, samples)


def print_family(store: Store, run: RunRow) -> None:
    """A follow-up run of `lab explain` says whose, and a parent run names its follow-ups."""
    own = run.manifest.get(explain_record.KEY)
    if isinstance(own, dict):
        r = explain_record.Record.from_dict(own)
        mine = next((p for p in r.phases if run.id in [x["run"] for x in p.get("runs") or []]), None)
        say(
            f"follow-up run of {', '.join(r.parents)} (lab explain: A {r.a.cell} vs B {r.b.cell}; knobs "
            + ", ".join(k.name for k in r.knobs)
            + (f"; {mine['note']}" if mine else "")
            + f"; `lab explain {r.a.run}"
            + (f" {r.b.run}" if r.b.run != r.a.run else "")
            + "` with the same selections shows the answer)",
            soft_wrap=True,
        )
    children = explain_record.follow_ups(store, run)
    if children:
        say(f"follow-up runs (lab explain): {', '.join(c.id for c in children)}", soft_wrap=True)


def flag_mark(flagged: int) -> object:
    """ " ⚑n" in red beside a figure n flagged samples were left out of ("" if none)."""
    return styled(f" ⚑{flagged}", "red") if flagged else ""


def print_host_load(run: RunRow, cells: list, samples: list) -> None:
    """The host under the run's samples: per cell, and every flagged repetition with its reason."""
    modes = run.manifest.get("quiet_host") or {}
    threshold = analysis.threshold_of(run.manifest)
    short = results.short_labels([c.label for c in cells])
    if modes:
        say(
            f"host load: flagged above {threshold:g} % of one core; "
            + ", ".join(f"{h}: {m}" for h, m in sorted(modes.items()))
        )
        for c in cells:
            mine = [s for s in samples if s.cell_id == c.cell_id]
            if mine:
                say(f"  {c.cell_id} {short.get(c.label, c.label)}: {results.host_load(mine).text()}")
    flagged = results.flagged_repetitions(samples, cells)
    if flagged:
        say(styled(f"flagged, not counted in any median or verdict ({len(flagged)} repetitions):", "red"))
    for f in flagged:
        where = f" (round {f.round})" if f.round and run.manifest.get("rounds") else ""
        say(
            f"  {f.cell_id} {short.get(f.cell, f.cell)} {f.workload} repetition {f.repetition + 1}{where}: "
            + "; ".join(f.reasons),
            soft_wrap=True,
        )


def _in_effect(t: dict) -> str:
    """One line of what the tune stage read back: sysctls, cc, offloads, qdisc."""
    parts = [f"cc {t['cc']['effective']}"] if (t.get("cc") or {}).get("effective") else []
    if (t.get("offloads") or {}).get("effective"):
        parts.append("offloads " + " ".join(f"{k}={v}" for k, v in sorted(t["offloads"]["effective"].items())))
    w = t.get("wan") or {}
    if w.get("netem"):
        parts.append(f"netem ({w['where']}, {w['dev']}) " + " ".join(f"{k}={v:g}" for k, v in w["netem"].items()))
    parts.append("sysctl " + ", ".join(f"{k}={v}" for k, v in (t.get("effective") or {}).items()))
    return "; ".join(parts)


@cli.command("show")
@click.argument("run_ref", default="latest")
@config_option
@results_option
@click.option("--json", "as_json", is_flag=True, help="every sample as JSON")
@click.option("--csv", "as_csv", is_flag=True, help="every sample as CSV")
@click.option("--all", "everything", is_flag=True, help="also CPU breakdowns and zero error counters")
def show_cmd(run_ref, config_path, results_dir, as_json, as_csv, everything):
    """The results of one run: a table per workload (median, min–max, n, guest CPU busy %)."""
    store = read_store(config_path, results_dir)
    run = store.run(run_ref)
    if as_json or as_csv:
        cells = {c.cell_id: c for c in store.cells(run.id)}
        rows = [
            {
                "run": s.run_id,
                "cell": s.cell_id,
                "cell_label": cells[s.cell_id].label if s.cell_id in cells else "",
                "workload": s.workload,
                "metric": s.metric,
                "value": s.value,
                "unit": s.unit,
                "higher_is_better": s.higher_is_better,
                "repetition": s.repetition,
                "labels": s.labels,
            }
            for s in store.samples(run.id)
        ]
        if as_json:
            shapes.emit("show", {"run": run.__dict__, "cells": [c.__dict__ for c in cells.values()], "samples": rows})
        else:
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()) if rows else ["run"])
            w.writeheader()
            for r in rows:
                w.writerow({**r, "labels": json.dumps(r["labels"], sort_keys=True)})
            click.echo(plaintext.printable(buf.getvalue()), nl=False)  # a label's ESC is no terminal's
        return
    print_show(store, run, everything)


@cli.command("report")
@click.argument("run_ref", default="latest")
@config_option
@results_option
@click.option(
    "--vs",
    "vs_ref",
    default=None,
    metavar="RUN",
    help="compare against this run: A = RUN_REF, B = this run, as in `lab compare A B`",
)
@click.option(
    "-o",
    "--output",
    "output",
    default=None,
    type=click.Path(dir_okay=False),
    help="HTML file to write (default: report-<run>.html next to the results store)",
)
@click.option("--history", "with_history", is_flag=True, help="add a trend chart per series of the run (lab history)")
def report_cmd(run_ref, config_path, results_dir, vs_ref, output, with_history):
    """One self-contained HTML file: charts, results and comparison tables, hosts, manifest."""
    mode = load_or_default(config_path).lab.file_mode  # [lab] results_mode: 0600 unless it says otherwise
    store = read_store(config_path, results_dir)
    say(str(report.write(store, run_ref, vs_ref, output, history=with_history, mode=mode)), soft_wrap=True)


@cli.command("reparse")
@click.argument("run_ref")
@config_option
@results_option
def reparse_cmd(run_ref, config_path, results_dir):
    """Rebuild a run's samples from its stored raw outputs (after a parser fix)."""
    store = open_store(config_path, results_dir)
    run = store.run(run_ref)
    n = reparse(store, run.id)
    say(f"run {run.id}: {n} samples rebuilt from raw outputs")
