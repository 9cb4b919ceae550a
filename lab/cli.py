"""The command line. The only module that prints, reads argv and the environment, and exits.

Exit status: 0 success, 1 a run or operation failed, 2 bad input (nothing was created),
130 interrupted.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from lab import PACKER_DIR, __version__, config, images, plan, results, runner, wan
from lab.errors import LabError, UsageError
from lab.store import Store

# Tables are wide; a pipe or CI log gets a fixed width rather than 80 columns of wrapping.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # a message is one line, never wrapped


def _fmt(v: float | None) -> str:
    if v is None:
        return "–"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# -- progress ----------------------------------------------------------------------------------

class Eta:
    """Time left in a run: the plan's estimate until the first cell ends; then the pace of the
    cells ended so far, less the time already spent on the cell under way (so it counts down
    within a cell instead of restarting at each line)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.start = self.last = clock()
        self.total = self.done = 0
        self.estimate = 0.0

    def begin(self, total: int, estimate_s: float) -> None:
        self.total, self.estimate = total, estimate_s

    def cell_ended(self) -> None:
        self.done += 1
        self.last = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def seconds(self) -> float:
        now = self.clock()
        if not self.done:
            return max(self.estimate - (now - self.start), 0.0)
        pace = (self.last - self.start) / self.done
        return max(pace * (self.total - self.done) - (now - self.last), 0.0)


class _EtaColumn(ProgressColumn):
    def __init__(self, eta: Eta):
        super().__init__()
        self.eta = eta

    def render(self, task):
        return Text(f"ETA {_duration(self.eta.seconds())}", style="progress.remaining")


class RichReporter:
    """Live progress on a terminal: a bar over cells (M/N, elapsed, ETA) and the current stage."""

    def __init__(self):
        self.eta = Eta()
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("cells"), TimeElapsedColumn(), _EtaColumn(self.eta),
                                 TextColumn("{task.fields[stage]}"), console=err, transient=False)
        self.task = None

    def run_started(self, run_id, cells, estimate_s):
        self.eta.begin(len(cells), estimate_s)
        err.print(f"run [bold]{run_id}[/]: {len(cells)} cells, estimated {_duration(estimate_s)}")
        self.progress.start()
        self.task = self.progress.add_task(run_id, total=len(cells), stage="")

    def cell_started(self, cell, position, total):
        self.progress.update(self.task, stage=f"{cell.id} {cell.label}")

    def stage(self, cell, stage, detail=""):
        self.progress.update(self.task, stage=f"{cell.id} {stage} {detail}".rstrip())

    def cell_finished(self, cell, status, error):
        self.eta.cell_ended()
        self.progress.advance(self.task)
        style = {"done": "green", "n/a": "yellow", "duplicate": "yellow"}.get(status, "red")
        self.progress.console.print(f"  {cell.id} {cell.label}: [{style}]{status}[/]" + (f" ({error})" if error else ""))

    def warn(self, message):
        self.progress.console.print(f"  [yellow]warning:[/] {message}")

    def close(self):
        self.progress.stop()


class PlainReporter:
    """Progress as plain lines (CI logs, pipes): cell, stage, elapsed, ETA."""

    def __init__(self):
        self.eta = Eta()

    def _line(self, text):
        err.print(f"[{_duration(self.eta.elapsed())} elapsed, ETA {_duration(self.eta.seconds())}] {text}",
                  markup=False)

    def run_started(self, run_id, cells, estimate_s):
        self.eta.begin(len(cells), estimate_s)
        self._line(f"run {run_id}: {len(cells)} cells, estimated {_duration(estimate_s)}")

    def cell_started(self, cell, position, total):
        self._line(f"cell {position}/{total} {cell.id} {cell.label}")

    def stage(self, cell, stage, detail=""):
        self._line(f"  {cell.id} {stage} {detail}".rstrip())

    def cell_finished(self, cell, status, error):
        self.eta.cell_ended()
        self._line(f"  {cell.id} {status}" + (f": {error}" if error else ""))

    def warn(self, message):
        self._line(f"  warning: {message}")

    def close(self):
        pass


# -- common options ------------------------------------------------------------------------------

RUN_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,15}")

config_option = click.option("-c", "--config", "config_path", default="lab.toml", show_default=True,
                             type=click.Path(dir_okay=False), help="the lab description")
results_option = click.option("--results", "results_dir", default=None, type=click.Path(file_okay=False),
                              help="results directory (default: [lab] results in lab.toml)")


def _results_dir(config_path: str, results_dir: str | None) -> Path:
    if results_dir:
        return Path(results_dir)
    if Path(config_path).exists():
        return config.load(config_path).results_dir
    return Path("results")


def _store(config_path: str, results_dir: str | None) -> Store:
    """The store of an existing results directory (reading commands never create one)."""
    where = _results_dir(config_path, results_dir)
    if not (where / Store.FILENAME).exists():
        raise UsageError(f"no runs in {where} (no {Store.FILENAME}); `lab run` makes one")
    return Store(where)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lab")
def cli():
    """lab: clean VMs from golden images, one knob at a time, measured and compared."""


@cli.command("plan")
@config_option
def plan_cmd(config_path):
    """Show the matrix cells, what will be created, and an estimate of time."""
    cfg = config.load(config_path)
    units = plan.units(cfg)
    dups = plan.equivalents(cfg, units)
    cells = [u for u in units if u.kind == "vm" and u.id not in dups]  # duplicates are not booted
    table = Table(title=f"{cfg.lab.name}: {len(units)} cells", show_lines=False)
    m = cfg.matrix
    net_cols = [a for a, dflt in (("cc", "default"), ("offloads", "default"), ("wan", "none"))
                if getattr(m, a) != [dflt]]  # shown only when the lab varies or sets them
    for col in ("cell", "host", "image", "nic", "vcpus", "memory", "disk", "clone", "tuning", *net_cols):
        table.add_column(col)
    for c in units:
        if c.kind == plan.BARE_METAL:
            table.add_row(c.id, c.host, "the host itself (bare metal: the baseline)", "veth", "all", "", "", "", "as is",
                          *[""] * len(net_cols))
            continue
        name = c.id + (" (A/A twin)" if c.replica != 1 else "") + (f" = {dups[c.id]}" if c.id in dups else "")
        table.add_row(name, c.host, c.image, c.nic.value, str(c.vcpus), f"{c.memory_mib} MiB", c.disk_bus.value,
                      c.clone.value, c.tuning, *[getattr(c, a) for a in net_cols])
    out.print(table)
    for later, first in dups.items():
        out.print(f"{later} is the same effective configuration as {first}: recorded as its duplicate, not run",
                  markup=False)
    for name, prof in cfg.wan.items():
        if name in m.wan:
            out.print(f"wan {name}: netem {' '.join(wan.netem_args(prof))} on one direction "
                      f"(delay_ms = added round-trip time)" + (" — all zeros: same as none" if prof.is_null else ""),
                      markup=False)
    suite = cfg.suite
    backends = {cfg.hosts[h].backend for h in {c.host for c in cells}}
    boots = len(plan.rounds(suite.repetitions, suite.repetitions_per_boot)) if suite.order == "interleaved" else 1
    out.print(f"creates: {len(cells) * boots} VM(s), one at a time, each destroyed after its "
              + (f"round ({boots} rounds)" if boots > 1 else "cell")
              + f" (backends: {', '.join(sorted(backends)) or 'none'}); the local backend also makes one network "
              "namespace" + (", and one namespace and cgroup for the bare-metal cell" if suite.bare_metal else ""))
    reps = (f"{suite.repetitions}–{suite.max_repetitions} repetitions (until the 95 % CI is within "
            f"±{suite.target_ci_pct:g} %" + (f" or {suite.max_seconds:g} s" if suite.max_seconds else "") + ")"
            if suite.target_ci_pct is not None else f"{suite.repetitions} repetitions")
    out.print(f"workloads: {', '.join(suite.workloads)} × {reps} (+{suite.warmup} warm-up per boot); "
              f"order: {suite.order}" + (f", seed {suite.seed}" if suite.seed is not None else ", seed drawn and recorded"))
    out.print(f"estimated time: {'at least ' if suite.target_ci_pct is not None else ''}"
              f"{_duration(runner.estimate_seconds(cfg, units))}")


def _install_signal_handlers():
    def handler(signum, frame):
        # The first signal starts an orderly teardown; more signals must not cut it short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise runner.Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


@cli.command("run")
@config_option
@click.option("--run-id", default=None, help="use this run id (default: random)")
@click.option("--resume", "resume", default=None, metavar="RUN",
              help="continue RUN: cells that did not finish are run again, finished ones are kept")
def run_cmd(config_path, run_id, resume):
    """Clone -> boot -> verify -> tune -> workloads -> destroy, cell by cell. Results are saved."""
    cfg = config.load(config_path)
    text = Path(config_path).read_text()
    if run_id is not None and not RUN_ID.fullmatch(run_id):
        # it names namespaces, VMs, lock files: letters, digits and '-' only, short
        raise UsageError(f"--run-id {run_id!r}: use 1-16 lower-case letters, digits or '-' (not first)")
    if run_id is not None and resume:
        raise UsageError("--run-id and --resume exclude each other: a resumed run keeps its id")
    if run_id is not None and (cfg.results_dir / Store.FILENAME).exists() and \
            any(r.id == run_id for r in Store(cfg.results_dir).runs()):
        raise UsageError(f"--run-id {run_id!r}: {cfg.results_dir} already has a run of that id "
                         f"(`lab run --resume {run_id}` continues it)")
    prepared = runner.prepare(cfg)  # every check that can fail before anything is created
    if resume and not (cfg.results_dir / Store.FILENAME).exists():
        raise UsageError(f"cannot resume {resume!r}: no runs in {cfg.results_dir}")
    store = Store(cfg.results_dir)
    reporter = RichReporter() if err.is_terminal else PlainReporter()
    _install_signal_handlers()
    try:
        rid = runner.run_lab(cfg, store, reporter, run_id=run_id, config_text=text, prepared=prepared,
                             resume=resume)
    finally:
        reporter.close()
    _print_show(store, store.run(rid))
    failed = [c for c in store.cells(rid) if c.status == "failed"]
    if failed:
        err.print(f"{len(failed)} of {len(store.cells(rid))} cells failed; see `lab show {rid}`")
        sys.exit(1)


@cli.command("ls")
@config_option
@results_option
def ls_cmd(config_path, results_dir):
    """List stored runs."""
    where = _results_dir(config_path, results_dir)
    if not (where / Store.FILENAME).exists():
        out.print(f"no runs in {where} yet; `lab run` makes one", markup=False)  # an answer, not an error
        return
    store = Store(where)
    table = Table()
    for col in ("run", "name", "started", "duration", "status", "cells", "samples"):
        table.add_column(col)
    for r in store.runs():
        cells = store.cells(r.id)
        done = sum(1 for c in cells if c.status == "done")
        dur = _duration((r.finished_at or time.time()) - r.started_at)
        table.add_row(r.id, r.name, time.strftime("%Y-%m-%d %H:%M", time.localtime(r.started_at)), dur, r.status,
                      f"{done}/{len(cells)}", str(len(store.samples(r.id))))
    out.print(table)


def _print_show(store: Store, run, everything: bool = False) -> None:
    cells = store.cells(run.id)
    all_series = results.series(store.samples(run.id), cells)
    rows = results.show_rows(all_series, everything=everything, seed=run.seed or 0, spread=True)
    short = results.short_labels([c.label for c in cells])
    out.print(f"run [bold]{run.id}[/] ({run.name}), {run.status}")
    sched = run.manifest.get("schedule") or {}
    if sched:
        policy = (f"adaptive: ±{sched['target_ci_pct']:g} % CI target, {sched['repetitions']}–{sched['max_repetitions']}"
                  " repetitions" if sched.get("target_ci_pct") else f"{sched.get('repetitions')} repetitions")
        out.print(f"order {sched.get('order')} (seed {sched.get('seed')}), {policy}, {sched.get('warmup')} warm-up"
                  + (f" per boot, {sched['repetitions_per_boot']} repetition(s) per boot" if "repetitions_per_boot" in sched
                     else ""), markup=False)
    if run.manifest.get("rounds"):
        executed = store.executions(run.id)
        out.print(f"executed: {len(executed)} workload runs in {len(run.manifest['rounds'])} rounds: "
                  + " | ".join(f"{i}: {' '.join(r)}" for i, r in enumerate(run.manifest["rounds"], start=1)),
                  markup=False, soft_wrap=True)
    for c in cells:
        if c.status != "done":
            out.print(f"  {c.cell_id} {c.label}: [red]{c.status}[/]" + (f" at {c.stage}: {c.error}" if c.error else ""))
        knobs = set(c.axes) & {"cc", "offloads", "wan"} or c.axes.get("tuning", "default") != "default"
        if knobs and (c.facts.get("tuning") or {}).get("effective") is not None:
            out.print(f"  {c.cell_id} in effect: {_in_effect(c.facts['tuning'])}", markup=False, soft_wrap=True)
        for wl, why in (c.facts.get("skipped_workloads") or {}).items():
            out.print(f"  {c.cell_id} {short.get(c.label, c.label)}: {wl} skipped: {why}", markup=False)
    stopped = run.manifest.get("repetitions") or {}
    if sched.get("target_ci_pct"):
        for cid, wls in stopped.items():
            for wl, o in wls.items():
                out.print(f"  {cid} {wl}: n = {o['n']}, {o['stopped']}", markup=False)
    by_wl: dict[str, list] = {}
    for row in rows:
        by_wl.setdefault(row.workload, []).append(row)
    for wl, wrows in by_wl.items():
        table = Table(title=wl, title_justify="left")
        for col in ("cell", "metric", "median", "95 % CI", "min–max", "CV", "n", "CPU busy %"):
            table.add_column(col, justify="right" if col not in ("cell", "metric") else "left")
        for r in wrows:
            metric = f"{r.metric} ({r.unit}) {r.direction}".rstrip()
            flag = f" [red]⚑{r.flagged}[/]" if r.flagged else ""
            table.add_row(short.get(r.cell, r.cell), metric, _fmt(r.median) + flag, f"{_fmt(r.ci_low)}–{_fmt(r.ci_high)}",
                          f"{_fmt(r.low)}–{_fmt(r.high)}", "–" if r.cv is None else f"{r.cv * 100:.1f} %",
                          str(r.n), _fmt(r.cpu_busy))
        out.print(table)


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
    store = _store(config_path, results_dir)
    run = store.run(run_ref)
    if as_json or as_csv:
        cells = {c.cell_id: c for c in store.cells(run.id)}
        rows = [{"run": s.run_id, "cell": s.cell_id, "cell_label": cells[s.cell_id].label if s.cell_id in cells else "",
                 "workload": s.workload, "metric": s.metric, "value": s.value, "unit": s.unit,
                 "higher_is_better": s.higher_is_better, "repetition": s.repetition,
                 "labels": s.labels} for s in store.samples(run.id)]
        if as_json:
            click.echo(json.dumps({"run": run.__dict__, "cells": [c.__dict__ for c in cells.values()],
                                   "samples": rows}, indent=2, default=str))
        else:
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()) if rows else ["run"])
            w.writeheader()
            for r in rows:
                w.writerow({**r, "labels": json.dumps(r["labels"], sort_keys=True)})
            click.echo(buf.getvalue(), nl=False)
        return
    _print_show(store, run, everything)


@cli.command("compare")
@click.argument("run_a")
@click.argument("run_b", required=False)
@click.option("--a", "sel_a", multiple=True, metavar="AXIS=VALUE",
              help="side A: only the cells of RUN_A with these axes (repeatable, or comma-separated)")
@click.option("--b", "sel_b", multiple=True, metavar="AXIS=VALUE",
              help="side B: only the cells of RUN_B (or of RUN_A when RUN_B is not given) with these axes")
@click.option("--baseline", "baseline", default=None, is_flag=False, flag_value="kind=bare-metal",
              metavar="[AXIS=VALUE]", help="every cell of RUN_A against the baseline cell of its host: "
              "the bare-metal cell, or the cell these axes select")
@click.option("--all", "everything", is_flag=True, help="every metric (CPU breakdowns, zero error counters)")
@config_option
@results_option
@click.option("--json", "as_json", is_flag=True)
def compare_cmd(run_a, run_b, sel_a, sel_b, baseline, everything, config_path, results_dir, as_json):
    """Two runs, two hosts or any two cell selections side by side: ratio of medians (B/A) with
    its 95 % CI, Mann-Whitney p, the A/A noise floor, a verdict per metric, and the host facts
    that differ. `lab compare A B`, `lab compare RUN --a nic=virtio --b nic=e1000`,
    `lab compare RUN --a host=pve1 --b host=bsd1`, `lab compare RUN --baseline`."""
    from lab import analysis

    store = _store(config_path, results_dir)
    ra = store.run(run_a)
    if baseline is not None:
        if run_b or sel_a or sel_b:
            raise UsageError("--baseline compares the cells of one run with its baseline cell; "
                             "it takes no RUN_B, --a or --b")
        _print_overheads(store, ra, analysis.parse_selector([baseline], "--baseline"), everything, as_json)
        return
    if run_b is None and not (sel_a or sel_b):
        raise UsageError("lab compare needs two runs (A B), or --a/--b selections of one run's cells, or --baseline")
    rb = store.run(run_b) if run_b else ra
    sides = []
    for r, sel, opt in ((ra, sel_a, "--a"), (rb, sel_b, "--b")):
        selector = analysis.parse_selector(sel, opt)
        sd = analysis.side(r.id, r.seed, store.cells(r.id), store.samples(r.id), store.host_facts(r.id), selector)
        if not sd.cells:
            raise UsageError(f"{opt} {','.join(sel)}: no cell of run {r.id} matches"
                             f" (cells: {', '.join(c.label for c in store.cells(r.id))})")
        sides.append(sd)
    noise: dict = {}
    for r in {ra.id: ra, rb.id: rb}.values():
        for k, v in analysis.noise_floor(results.series(store.samples(r.id), store.cells(r.id)), seed=r.seed or 0).items():
            noise[k] = analysis.widest(noise.get(k), v)
    cmp = analysis.compare_sides(sides[0], sides[1], noise=noise, everything=everything)
    if as_json:
        click.echo(json.dumps({"a": {"run": ra.id, "selector": sides[0].selector},
                               "b": {"run": rb.id, "selector": sides[1].selector},
                               "rows": [r.__dict__ for r in cmp.rows],
                               "host_differences": [dict(zip(("host", "fact", "a", "b"), d)) for d in cmp.host_diffs]},
                              indent=2, default=str))
        return
    title = (f"A = {ra.id}" + (f" [{','.join(sel_a)}]" if sel_a else "")
             + f"   B = {rb.id}" + (f" [{','.join(sel_b)}]" if sel_b else ""))
    table = Table(title=title, title_justify="left")
    for col in ("cell", "workload", "metric", "median A", "median B", "B/A", "95 % CI", "p", "A/A band", "verdict"):
        table.add_column(col, justify="left" if col in ("cell", "workload", "metric", "verdict") else "right")
    short = results.short_labels(sorted({r.key[0] for r in cmp.rows}))
    for r in cmp.rows:
        cell, wl, metric = r.key
        ci = f"{_fmt(r.ratio_ci[0])}–{_fmt(r.ratio_ci[1])}" if r.ratio_ci else "–"
        band = f"{_fmt(r.noise_band[0])}–{_fmt(r.noise_band[1])}" if r.noise_band else "–"
        style = {"better": "green", "worse": "red"}.get(r.verdict, "yellow" if r.verdict.startswith("missing") else "")
        table.add_row(short.get(cell, cell), wl, f"{metric} ({r.unit})", _fmt(r.median_a), _fmt(r.median_b),
                      _fmt(r.ratio), ci, _fmt(r.p_value), band, f"[{style}]{r.verdict}[/]" if style else r.verdict)
    out.print(table)
    if not cmp.noise:
        out.print("A/A band: not measured ([suite] noise_floor = true runs the first cell twice to measure it)")
    _print_host_diffs(cmp.host_diffs, ra.id == rb.id and not (set(sides[0].hosts) ^ set(sides[1].hosts)))


def _print_host_diffs(diffs, same_run: bool) -> None:
    if not diffs:
        out.print("host facts: " + ("one run, the same hosts" if same_run else "no difference between the two sides"))
        return
    table = Table(title=f"host facts that differ ({len(diffs)})", title_justify="left")
    for col in ("host", "fact", "A", "B"):
        table.add_column(col)
    for host, fact, va, vb in diffs:
        table.add_row(host, fact, va, vb)
    out.print(table)


def _print_overheads(store: Store, run, selector: dict, everything: bool, as_json: bool) -> None:
    from lab import analysis

    cells = store.cells(run.id)
    rows = analysis.overheads(cells, store.samples(run.id), selector, seed=run.seed or 0, everything=everything)
    if as_json:
        click.echo(json.dumps([{"cell": o.cell, "baseline": o.reference, "change_pct": o.change_pct,
                                "change_ci_pct": o.change_ci_pct, **o.row.__dict__} for o in rows], indent=2, default=str))
        return
    short = results.short_labels([c.label for c in cells])
    refs = sorted({short.get(o.reference, o.reference) for o in rows})
    table = Table(title=f"run {run.id}: overhead vs {', '.join(refs) or 'baseline'} (change of the median, 95 % CI)",
                  title_justify="left")
    for col in ("cell", "workload", "metric", "baseline", "cell median", "change vs baseline", "p", "verdict"):
        table.add_column(col, justify="left" if col in ("cell", "workload", "metric", "verdict") else "right")
    for o in rows:
        r = o.row
        style = {"better": "green", "worse": "red"}.get(r.verdict, "")
        table.add_row(short.get(o.cell, o.cell), r.key[1], f"{r.key[2]} ({r.unit})", _fmt(r.median_a), _fmt(r.median_b),
                      analysis.fmt_change(o.change_pct, o.change_ci_pct), _fmt(r.p_value),
                      f"[{style}]{r.verdict}[/]" if style else r.verdict)
    out.print(table)


@cli.command("report")
@click.argument("run_ref", default="latest")
@config_option
@results_option
@click.option("--vs", "vs_ref", default=None, metavar="RUN",
              help="compare against this run: A = RUN_REF, B = this run, as in `lab compare A B`")
@click.option("-o", "--output", "output", default=None, type=click.Path(dir_okay=False),
              help="HTML file to write (default: report-<run>.html next to the results store)")
def report_cmd(run_ref, config_path, results_dir, vs_ref, output):
    """One self-contained HTML file: charts, results and comparison tables, hosts, manifest."""
    from lab import report

    store = _store(config_path, results_dir)
    path = report.write(store, run_ref, vs_ref, output)
    out.print(str(path), markup=False, soft_wrap=True)


@cli.command("reparse")
@click.argument("run_ref")
@config_option
@results_option
def reparse_cmd(run_ref, config_path, results_dir):
    """Rebuild a run's samples from its stored raw outputs (after a parser fix)."""
    store = _store(config_path, results_dir)
    run = store.run(run_ref)
    n = runner.reparse(store, run.id)
    out.print(f"run {run.id}: {n} samples rebuilt from raw outputs")


@cli.command("gc")
@config_option
@click.option("--dry-run", is_flag=True, help="list what would be removed")
@click.option("--force", is_flag=True, help="also remove unexpired leases on remote hosts, and live runs' VMs")
def gc_cmd(config_path, dry_run, force):
    """Destroy anything a crashed or killed run left behind (VMs, disks, taps, namespaces)."""
    from lab import gc as gc_mod

    cfg = config.load(config_path) if Path(config_path).exists() else config.parse({}, config_path)
    report = gc_mod.collect(cfg, dry_run=dry_run, force=force)
    for line in report.lines:
        out.print(line, markup=False)
    verb = "would remove" if dry_run else "removed"
    out.print(f"gc: {verb} {report.removed}, kept {report.kept} (owned by live runs)"
              + (f", {len(report.errors)} errors" if report.errors else ""))
    if report.errors:
        for e in report.errors:
            err.print(f"gc: {e}", markup=False)
        sys.exit(1)


@cli.command("doctor")
@config_option
def doctor_cmd(config_path):
    """Check prerequisites: QEMU, KVM usable or not, Packer, netns rights, disk space, images."""
    from lab import doctor

    checks = doctor.run_checks(config_path)
    table = Table()
    for col in ("check", "status", "detail"):
        table.add_column(col)
    for c in checks:
        style = {"ok": "green", "warn": "yellow", "fail": "red"}[c.status]
        table.add_row(c.name, f"[{style}]{c.status}[/]", c.detail)
    out.print(table)
    if any(c.status == "fail" for c in checks):
        sys.exit(1)


@cli.command("snapshot")
@click.argument("host", default="local")
@config_option
@results_option
@click.option("--json", "as_json", is_flag=True)
def snapshot_cmd(host, config_path, results_dir, as_json):
    """Fingerprint of a host (CPU, microcode, cores, governor, mitigations, kernel, hypervisor and
    tool versions, NIC drivers, bridge MTUs), stored with the results; runs on the host link to it."""
    from lab import hostinfo

    cfg = config.load(config_path) if Path(config_path).exists() else config.parse({}, config_path)
    if host not in cfg.hosts:
        raise UsageError(f"{config_path}: no host {host!r}; defined hosts: {', '.join(sorted(cfg.hosts))}")
    backend = runner.build_backends(cfg, {host})[host]
    facts = hostinfo.snapshot(host, backend)
    fp = hostinfo.fingerprint(facts)
    store = Store(Path(results_dir) if results_dir else cfg.results_dir)
    fid = store.save_host_facts(host, fp, facts)
    runs = store.runs_of_host_facts(fid)
    if as_json:
        click.echo(json.dumps({**facts, "fingerprint": fp, "stored_id": fid, "runs": runs},
                              indent=2, sort_keys=True, default=str))
        return
    table = Table(title=f"host {host}: fingerprint {fp}")
    table.add_column("fact")
    table.add_column("value")
    for k, v in hostinfo.flatten(facts).items():
        table.add_row(k, v)
    out.print(table)
    out.print(f"stored in {store.path} (host facts #{fid}); runs with this fingerprint: "
              f"{', '.join(runs) if runs else 'none yet'}", markup=False, soft_wrap=True)


@cli.group("images")
def images_cmd():
    """Golden images: build, list, render the answer files, publish."""


@images_cmd.command("build")
@click.argument("name", default="debian12")
@click.option("--force", is_flag=True, help="rebuild even if the recipe is unchanged")
@click.option("--iso", "iso", default=None, metavar="PATH",
              help="ISO-installed images: a local copy of the installer ISO (default: images/iso/<file>, "
                   "else the mirror)")
@click.option("--iso-checksum", "iso_checksum", default=None, metavar="SUM",
              help="sha256:HEX, sha512:HEX or file:PATH for --iso (default: the release's checksum file)")
def images_build(name, force, iso, iso_checksum):
    """Build a golden image (Debian from packages; the others from their installer ISO)."""
    started = time.monotonic()
    _install_signal_handlers()  # SIGTERM/Ctrl-C: the build's commands (packer and its QEMU) are stopped
    ref = images.build(name, force=force, iso=iso, iso_checksum=iso_checksum, progress=lambda stage: err.print(
        f"[{_duration(time.monotonic() - started)}] {name}: {stage}", markup=False))
    out.print(f"{ref.name}: {ref.path} (recipe {ref.digest[:12]}, sha256 {ref.sha256[:12]})", markup=False)


def _short_version(line: str) -> str:
    """The version in a tool's `--version` line: 'nginx version: nginx/1.22.1' -> '1.22.1'."""
    import re

    m = re.search(r"\d+(?:\.\d+)+[\w.+~-]*", line)
    return m.group(0) if m else line


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


@images_cmd.command("ls")
@click.option("--json", "as_json", is_flag=True)
def images_ls(as_json):
    """Every image the lab knows, built or not: state, recipe digest, age, tool versions."""
    rows = images.status()
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    table = Table()
    for col in ("image", "os", "state", "recipe", "built from", "age", "size", "tools"):
        table.add_column(col)
    for r in rows:
        tools = ", ".join(f"{k} {_short_version(v)}" for k, v in sorted(r["tools"].items()) if v)
        size = f"{r['size'] / 2**20:.0f} MiB" if r["size"] else "–"
        style = {"built": "green", "outdated": "yellow"}.get(r["state"], "dim")
        table.add_row(r["name"], f"{r['os']} {r['release']}", f"[{style}]{r['state']}[/]", r["recipe_digest"][:12],
                      r["built_digest"][:12] or "–", _age(r["age_s"]), size, tools or "–")
    out.print(table)


@images_cmd.command("render")
@click.argument("name")
@click.argument("directory", type=click.Path(file_okay=False))
def images_render(name, directory):
    """Write NAME's answer files (DIRECTORY/http) and upload stage (DIRECTORY/stage), e.g. for a
    hand-run `packer build -only=proxmox-iso.NAME`."""
    where = Path(directory)
    r = images.recipe(name)
    key = images.ensure_key()
    images.render_answers(name, where / "http", key.with_suffix(".pub").read_text().strip())
    if r.kind == "iso":
        images.render_upload(name, where / "stage")
    else:
        images.render_stage(name, where / "stage")
        if getattr(r, "container", None) is not None:  # provisioning imports it into podman's store
            images.stage_container_base(name, where / "stage", where / "container.log")
    out.print(f"{name}: answers in {where / 'http'}, upload stage in {where / 'stage'}", markup=False)
    out.print(f"PKR_VAR_proxmox_token=... packer build -only=proxmox-iso.{name} -var http_dir={where / 'http'} "
              f"-var stage_dir={where / 'stage'} -var ssh_key={key} -var proxmox_url=... -var proxmox_node=... "
              f"{PACKER_DIR / r.packer_template}", markup=False, soft_wrap=True)


@images_cmd.command("publish")
@click.argument("name")
@click.argument("host")
@config_option
def images_publish(name, host, config_path):
    """Publish a built image to HOST: a Proxmox template, a bhyve host's ZFS dataset, or the local store."""
    cfg = config.load(config_path) if Path(config_path).exists() else config.parse({}, config_path)
    if host not in cfg.hosts:
        raise UsageError(f"{config_path}: no host {host!r}; defined hosts: {', '.join(sorted(cfg.hosts))}")
    ref = images.load(name)
    backend = runner.build_backends(cfg, {host})[host]
    publish = getattr(backend, "publish_image", None)
    if publish is None:
        raise UsageError(f"host {host!r} (backend {backend.name}) cannot publish images: "
                         f"its backend has no publish_image")
    where = publish(ref)
    out.print(f"{name} ({ref.sha256[:12]}) published on {host}: {where}", markup=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="lab", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        # One line like every other error (click's own shows usage and a hint over three).
        ctx = getattr(exc, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        err.print(f"lab: error: {exc.format_message()}{where}", markup=False)
        sys.exit(2)
    except click.exceptions.Abort:
        err.print("lab: aborted")
        sys.exit(130)
    except runner.Interrupted as exc:
        err.print(f"lab: interrupted ({exc}); every VM created was destroyed", markup=False)
        sys.exit(130)
    except LabError as exc:
        # One line: what is wrong (file, key, value) and, if known, what to do.
        hint = f" (hint: {exc.hint})" if exc.hint else ""
        err.print(f"lab: error: {exc}{hint}", markup=False, soft_wrap=True)
        sys.exit(exc.exit_code)
