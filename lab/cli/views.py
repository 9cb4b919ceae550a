"""The commands that read results: ls, show, compare, report, reparse."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import time

import click
from rich.text import Text

from lab import analysis, axes, report, results
from lab.cli import shapes
from lab.cli.group import cli, closing, config_option, open_store, results_dir as find_results, results_option
from lab.cli.printing import VERDICT_STYLES, clock, duration, fmt, line, out, say, styled, table
from lab.errors import UsageError
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
    store = closing(Store(where))
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
    store = open_store(config_path, results_dir)
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
            click.echo(buf.getvalue(), nl=False)
        return
    print_show(store, run, everything)


def _asdict(record: object) -> dict | None:
    return dataclasses.asdict(record) if record is not None else None  # type: ignore[call-overload]


def _verdict(verdict: str, style: str) -> Text | str:
    return styled(verdict, style) if style else verdict


@cli.command("compare")
@click.argument("run_a")
@click.argument("run_b", required=False)
@click.option(
    "--a",
    "sel_a",
    multiple=True,
    metavar="AXIS=VALUE",
    help="side A: only the cells of RUN_A with these axes (repeatable, or comma-separated)",
)
@click.option(
    "--b",
    "sel_b",
    multiple=True,
    metavar="AXIS=VALUE",
    help="side B: only the cells of RUN_B (or of RUN_A when RUN_B is not given) with these axes",
)
@click.option(
    "--baseline",
    "baseline",
    default=None,
    is_flag=False,
    flag_value="kind=bare-metal",
    metavar="[AXIS=VALUE]",
    help="every cell of RUN_A against the baseline cell of its host: "
    "the bare-metal cell, or the cell these axes select",
)
@click.option("--all", "everything", is_flag=True, help="every metric (CPU breakdowns, zero error counters)")
@config_option
@results_option
@click.option("--json", "as_json", is_flag=True)
def compare_cmd(run_a, run_b, sel_a, sel_b, baseline, everything, config_path, results_dir, as_json):
    """Two runs, two hosts or any two cell selections side by side: ratio of medians (B/A) with
    its 95 % CI, Mann-Whitney p, the A/A noise floor, a verdict per metric, and the host facts
    that differ. `lab compare A B`, `lab compare RUN --a nic=virtio --b nic=e1000`,
    `lab compare RUN --a host=pve1 --b host=bsd1`, `lab compare RUN --baseline`."""
    store = open_store(config_path, results_dir)
    ra = store.run(run_a)
    if baseline is not None:
        if run_b or sel_a or sel_b:
            raise UsageError(
                "--baseline compares the cells of one run with its baseline cell; it takes no RUN_B, --a or --b"
            )
        _print_overheads(store, ra, analysis.parse_selector([baseline], "--baseline"), everything, as_json)
        return
    if run_b is None and not (sel_a or sel_b):
        raise UsageError("lab compare needs two runs (A B), or --a/--b selections of one run's cells, or --baseline")
    rb = store.run(run_b) if run_b else ra
    sides = []
    for r, sel, opt in ((ra, sel_a, "--a"), (rb, sel_b, "--b")):
        selector = analysis.parse_selector(sel, opt)
        sd = analysis.side(
            r.id, r.seed, store.cells(r.id), store.samples(r.id), store.host_facts.of_run(r.id), selector
        )
        if not sd.cells:
            raise UsageError(
                f"{opt} {','.join(sel)}: no cell of run {r.id} matches"
                f" (cells: {', '.join(c.label for c in store.cells(r.id))})"
            )
        sides.append(sd)
    noise = {}  # (workload, metric) -> the widest A/A band of the two runs
    for r in {ra.id: ra, rb.id: rb}.values():
        for k, v in analysis.noise_floor(
            results.series(store.samples(r.id), store.cells(r.id)), seed=r.seed or 0
        ).items():
            noise[k] = analysis.widest(noise.get(k), v)
    cmp = analysis.compare_sides(
        sides[0],
        sides[1],
        noise=noise,
        everything=everything,
        threshold_pct=analysis.threshold_of(ra.manifest, rb.manifest),
    )
    if as_json:
        shapes.emit(
            "compare",
            {
                "a": {"run": ra.id, "selector": sides[0].selector},
                "b": {"run": rb.id, "selector": sides[1].selector},
                "rows": [r.__dict__ for r in cmp.rows],
                "host_differences": [dict(zip(("host", "fact", "a", "b"), d)) for d in cmp.host_diffs],
                "host_load": {
                    "a": _asdict(sides[0].load),
                    "b": _asdict(sides[1].load),
                    "difference": cmp.load_diff,
                },
            },
        )
        return
    title = (
        f"A = {ra.id}"
        + (f" [{','.join(sel_a)}]" if sel_a else "")
        + f"   B = {rb.id}"
        + (f" [{','.join(sel_b)}]" if sel_b else "")
    )
    t = table(
        ("cell", "workload", "metric", "median A", "median B", "B/A", "95 % CI", "p", "A/A band", "verdict"),
        title=title,
        right=("median A", "median B", "B/A", "95 % CI", "p", "A/A band"),
    )
    short = results.short_labels(sorted({r.key[0] for r in cmp.rows}))
    for r in cmp.rows:
        cell, wl, metric = r.key
        ci = f"{fmt(r.ratio_ci[0])}–{fmt(r.ratio_ci[1])}" if r.ratio_ci else "–"
        band = f"{fmt(r.noise_band[0])}–{fmt(r.noise_band[1])}" if r.noise_band else "–"
        style = VERDICT_STYLES.get(r.verdict, "yellow" if r.verdict.startswith(("missing", "only")) else "")
        t.add_row(
            short.get(cell, cell),
            wl,
            f"{metric} ({r.unit})",
            line(fmt(r.median_a), flag_mark(r.flagged_a)),
            line(fmt(r.median_b), flag_mark(r.flagged_b)),
            fmt(r.ratio),
            ci,
            fmt(r.p_value),
            band,
            _verdict(r.verdict, style),
        )
    out.print(t)
    if any(r.flagged_a or r.flagged_b for r in cmp.rows):
        say(
            styled("⚑n", "red"),
            ": n flagged samples of that side, shown in `lab show`, left out of the median and the verdict",
        )
    if not cmp.noise:
        say("A/A band: not measured ([suite] noise_floor = true runs the first cell twice to measure it)")
    _print_host_diffs(cmp.host_diffs, ra.id == rb.id and not (set(sides[0].hosts) ^ set(sides[1].hosts)))
    for name, sd in (("A", sides[0]), ("B", sides[1])):
        say(f"host load under {name}: {sd.load.text() if sd.load else 'not measured'}")
    if cmp.load_diff:
        say(styled("host load differs: ", "yellow"), cmp.load_diff)


def _print_host_diffs(diffs, same_run: bool) -> None:
    if not diffs:
        say("host facts: " + ("one run, the same hosts" if same_run else "no difference between the two sides"))
        return
    t = table(("host", "fact", "A", "B"), title=f"host facts that differ ({len(diffs)})")
    for host, fact, va, vb in diffs:
        t.add_row(host, fact, va, vb)
    out.print(t)


def _print_overheads(store: Store, run: RunRow, selector: dict, everything: bool, as_json: bool) -> None:
    cells = store.cells(run.id)
    rows = analysis.overheads(cells, store.samples(run.id), selector, seed=run.seed or 0, everything=everything)
    if as_json:
        shapes.emit(
            "compare.baseline",
            {
                "run": run.id,
                "selector": selector,
                "rows": [
                    {
                        "cell": o.cell,
                        "baseline": o.reference,
                        "change_pct": o.change_pct,
                        "change_ci_pct": o.change_ci_pct,
                        **o.row.__dict__,
                    }
                    for o in rows
                ],
            },
        )
        return
    short = results.short_labels([c.label for c in cells])
    refs = sorted({short.get(o.reference, o.reference) for o in rows})
    t = table(
        ("cell", "workload", "metric", "baseline", "cell median", "change vs baseline", "p", "verdict"),
        title=f"run {run.id}: overhead vs {', '.join(refs) or 'baseline'} (change of the median, 95 % CI)",
        right=("baseline", "cell median", "change vs baseline", "p"),
    )
    for o in rows:
        r = o.row
        t.add_row(
            short.get(o.cell, o.cell),
            r.key[1],
            f"{r.key[2]} ({r.unit})",
            fmt(r.median_a),
            fmt(r.median_b),
            analysis.fmt_change(o.change_pct, o.change_ci_pct),
            fmt(r.p_value),
            _verdict(r.verdict, VERDICT_STYLES.get(r.verdict, "")),
        )
    out.print(t)


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
def report_cmd(run_ref, config_path, results_dir, vs_ref, output):
    """One self-contained HTML file: charts, results and comparison tables, hosts, manifest."""
    store = open_store(config_path, results_dir)
    say(str(report.write(store, run_ref, vs_ref, output)), soft_wrap=True)


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
