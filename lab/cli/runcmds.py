"""The commands that plan, run and clean up: plan, run, gc, doctor, snapshot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from lab import (
    axes,
    backends,
    changepoints,
    check,
    clients,
    config,
    doctor,
    estimate,
    gc,
    history,
    hostinfo,
    names,
    plan,
    runner,
    schedule,
    stats,
    verdicts,
    wan,
    workloads,
)
from lab.cli import shapes
from lab.cli.group import (
    cli,
    closing,
    config_option,
    install_signal_handlers,
    load_or_default,
    new_store,
    require_host,
    restore_signal_handlers,
    results_option,
    set_option,
)
from lab.cli.printing import duration, err, out, say, styled, table, warn
from lab.cli.progress import PlainReporter, QuietReporter, RichReporter
from lab.cli.views import print_show
from lab.errors import LabError, UsageError
from lab.labconfig import LabConfig
from lab.model import Isolation
from lab.store import Store, StoreError


def _axis_text(a: axes.Axis, c: plan.Unit) -> str:
    """A cell's value in a `lab plan` column. A bare-metal cell's missing axes say what stands in;
    an axis that means nothing for the cell (a VM cell's container runtime) reads "-"."""
    if not hasattr(c, a.name):
        return a.bare_metal
    return a.text(getattr(c, a.name)) if axes.applies(a.name, c) else "-"


@cli.command("plan")
@config_option
@set_option
@click.option(
    "--check",
    "check_hosts",
    is_flag=True,
    help="also reach every host: credentials, privileges, images/templates (nothing is created)",
)
@click.option("--json", "as_json", is_flag=True, help="the plan as JSON (shape lab.plan/1)")
def plan_cmd(config_path, sets, check_hosts, as_json):
    """Show the matrix cells, what will be created, and an estimate of time."""
    cfg = config.load(config_path, sets)
    for text in check.setting_warnings(cfg):
        warn("lab: warning: ", text)
    units = plan.units(cfg)
    dups = plan.equivalents(cfg, units)
    cells = [u for u in units if u.kind == "vm" and u.id not in dups]  # duplicates are not booted
    suite = cfg.suite
    kinds = sorted({cfg.hosts[h].backend for h in {c.host for c in cells}})
    boots = len(plan.rounds(suite.repetitions, suite.repetitions_per_boot)) if suite.order == "interleaved" else 1
    est = _estimate(cfg, units, dups)
    reach = _verdict_reach(cfg, [u for u in units if u.id not in dups])
    watch = _host_watch(cfg)
    checked = runner.image_lines(runner.prepare(cfg)) if check_hosts else None
    if as_json:
        shapes.emit(
            "plan",
            plan_document(
                cfg,
                units,
                dups,
                vms=len(cells) * boots,
                boots=boots,
                backends=kinds,
                est=est,
                reach=reach,
                host_watch=watch,
                images=checked,
            ),
        )
        return
    m = cfg.matrix
    columns = axes.shown_columns(m)  # optional axes only when the lab sets them
    t = table(
        ["cell", *(a.column for a in columns)], title=f"{cfg.lab.name}: {len(units)} cells", title_justify="center"
    )
    for c in units:
        if c.kind == plan.BARE_METAL:
            t.add_row(c.id, c.host, *(_axis_text(a, c) for a in columns[1:]))
            continue
        name = c.id + (" (A/A twin)" if c.replica != 1 else "") + (f" = {dups[c.id]}" if c.id in dups else "")
        t.add_row(name, *(_axis_text(a, c) for a in columns))
    out.print(t)
    for later, first in dups.items():
        say(f"{later} is the same effective configuration as {first}: recorded as its duplicate, not run")
    for name, prof in cfg.wan.items():
        if name in m.wan:
            say(
                f"wan {name}: netem {' '.join(wan.netem_args(prof))} on one direction "
                f"(delay_ms = added round-trip time)" + (" — all zeros: same as none" if prof.is_null else "")
            )
    zones = sum(1 for c in cells if c.isolation == Isolation.ZONE)
    made = f"{(len(cells) - zones) * boots} VM(s)" + (f" and {zones * boots} zone(s)" if zones else "")
    say(
        f"creates: {made}, one at a time"
        + (" on each host" if len(est.lanes) > 1 else "")
        + ", each destroyed after its "
        + (f"round ({boots} rounds)" if boots > 1 else "cell")
        + f" (backends: {', '.join(kinds) or 'none'})"
        + ("; the bare-metal cell gets its own network namespace and cgroup" if suite.bare_metal else "")
    )
    reps = (
        f"{suite.repetitions}–{suite.max_repetitions} repetitions (until the 95 % CI is within "
        f"±{suite.target_ci_pct:g} %"
        + (" and every primary row is decided against the cells it is compared with" if plan.comparisons(units) else "")
        + (f", or {suite.max_seconds:g} s" if suite.max_seconds else "")
        + ")"
        if suite.target_ci_pct is not None
        else f"{suite.repetitions} repetitions"
    )
    say(
        f"workloads: {', '.join(suite.workloads)} × {reps} (+{suite.warmup} warm-up per boot); "
        f"order: {suite.order}" + (f", seed {suite.seed}" if suite.seed is not None else ", seed drawn and recorded")
    )
    say(
        f"estimated time: {'at least ' if suite.target_ci_pct is not None else ''}{duration(est.seconds)} "
        f"({est.describe()})",
        soft_wrap=True,
    )
    if len(est.lanes) > 1 or any(len(backends.host_lanes(h, cfg.hosts[h])) > 1 for h in est.lanes):
        say_lanes(cfg, units, dups, est)
    ok, text, setting, _ = reach
    if ok and text:
        say(f"verdicts: {text}" + (f"; {setting}" if suite.target_ci_pct is not None else ""), soft_wrap=True)
    elif text:
        say(styled("warning: ", "yellow"), text, soft_wrap=True)
    words = {
        "wait": f"waits until it has been quiet for {suite.quiet_seconds:g} s (at most {suite.quiet_timeout_s:g} s) "
        "before each repetition, records and flags",
        "record": "records and flags",
        "off": "is not watched",
    }
    for h in cfg.matrix.host:
        hs = cfg.hosts[h]
        where = clients.describe(
            h, hs.client, vcpus=hs.client_vcpus, memory_mib=hs.client_memory_mib, port=hs.client_port
        )
        if where:
            say(where, soft_wrap=True)
    for h, mode in watch.items():
        say(
            f"host {h}: its load {words[mode]}"
            + (
                ""
                if mode == "off"
                else f" (a repetition is flagged above {suite.foreign_load_pct:g} % of one core"
                " of foreign load or steal)"
            )
        )
    if suite.remeasure_flagged and any(m != "off" for m in watch.values()):
        say(
            f"a repetition flagged for its host's or client's load is measured again, at most "
            f"{suite.remeasure_flagged} times per cell and workload (remeasure_flagged; not in the estimate)"
        )
    if checked is not None:
        for line in checked:
            say(line, soft_wrap=True)
        say("hosts checked: reachable, credentials and privileges, images in place")


def lanes_at(cfg: LabConfig, host: str, n: int) -> str:
    """What of a host runs at once, in words ("" for one cell at a time)."""
    if n <= 1:
        return ""
    settings = cfg.hosts[host]
    places = backends.capabilities(settings).places
    if places and settings.slots == 1:
        return f", {n} at a time, one on each node ({', '.join(places[:n])})"
    why = "its measured VMs share the host" if not places else f"{settings.slots} on each node ({', '.join(places)})"
    return f", {n} at a time (slots: {why}; the manifest records overlaps)"


def say_lanes(cfg: LabConfig, units: list[plan.Unit], dups: dict[str, str], est: estimate.Estimate) -> None:
    """The lanes of a run on several hosts (lab.runner.lanes): one line each, what runs at once,
    and that network measurements take turns on their client."""
    count: dict[str, int] = {}
    for u in units:
        if u.id not in dups:
            count[str(u.host)] = count.get(str(u.host), 0) + 1
    bound = (
        "the longest lane's"
        if est.seconds <= max(est.lanes.values())
        else f"the network measurements' turns on the client ({duration(est.client_s)}), longer than any lane"
    )
    hosts = f"{len(est.lanes)} hosts at once" if len(est.lanes) > 1 else "1 host"
    at = {h: backends.lanes_at_once(h, cfg.hosts[h], count.get(h, 0)) for h in est.lanes}
    at_once = "each one cell at a time" if all(n == 1 for n in at.values()) else "as many cells as lanes"
    say(f"lanes: {hosts}, {at_once}; the estimate is {bound}")
    for host, seconds in est.lanes.items():
        what = f"{count.get(host, 0)} cells{lanes_at(cfg, host, at[host])}"
        say(f"  lane {host}: {what}, {duration(seconds)}", soft_wrap=True)
    network = [w for w in cfg.suite.workloads if workloads.get(w).traits.network]
    sharing: dict[str, list[str]] = {}
    for h in est.lanes:
        sharing.setdefault(clients.turn_key(h, cfg.hosts[h].client), []).append(h)
    for key, hosts_of in sharing.items():
        if network and len(hosts_of) > 1:
            machine = (
                "local client" if key == clients.LOCAL else f"client machine {key.removeprefix(clients.SSH_PREFIX)}"
            )
            say(
                f"network measurements ({', '.join(network)}) of lanes {', '.join(hosts_of)} take turns on the "
                f"{machine} (never two at once through one client)",
                soft_wrap=True,
            )
    for host in est.lanes:
        if backends.capabilities(cfg.hosts[host]).local_host:
            say(
                f"host {host} is this machine: its measurements take turns with the other lanes' network "
                "measurements (their load generators run here)",
                soft_wrap=True,
            )


def _estimate(cfg: LabConfig, units: list[plan.Unit], dups: dict[str, str]) -> estimate.Estimate:
    """The plan's estimate, from the runs already in the lab's results store (none: first-run defaults)."""
    params = {w: runner.workload_params(cfg, w) for w in cfg.suite.workloads}
    if not (cfg.results_dir / Store.FILENAME).exists():  # planning never creates a store
        return estimate.estimate(cfg, units, params, dups)
    try:
        return estimate.estimate(cfg, units, params, dups, closing(Store(cfg.results_dir, readonly=True)))
    except StoreError as exc:  # a plan is still a plan when the earlier runs cannot be read
        err.print(f"lab: warning: {exc}; the estimate uses the first-run defaults")
        return estimate.estimate(cfg, units, params, dups)


def _verdict_reach(cfg, units) -> tuple[bool, str, str, dict]:
    """Whether the run's comparisons can give verdicts: (they can, what to say ("": nothing), the
    setting, the figures for --json)."""
    suite = cfg.suite
    n = schedule.minimum_n(suite)
    if suite.target_ci_pct is None:
        setting = f"suite.repetitions = {n}"
    else:
        setting = (
            f"adaptive repetitions can stop at n = {n} (suite.repetitions = {suite.repetitions}"
            + (
                f", suite.max_seconds = {suite.max_seconds:g}"
                if suite.max_seconds is not None
                else f", suite.max_repetitions = {suite.max_repetitions}"
            )
            + ")"
        )
    rows = plan.primary_rows(cfg)
    ok, text = plan.verdict_reach(units, n, rows=rows, setting=setting)
    figures = {
        "n": n,
        "primary_rows": rows,
        "best_p": stats.min_exact_p(n, n),
        "best_q": verdicts.best_q(n, rows),
        "margin_pct": verdicts.DEFAULT_MARGIN_PCT,
        "same_cv_pct": round(verdicts.same_reach_cv(n) * 100, 2),
    }
    return ok, text, setting, figures


def _host_watch(cfg) -> dict[str, str]:
    """What each host's load does to the samples ([suite] quiet_host): host -> wait | record | off."""
    return {
        h: cfg.suite.quiet_mode(backends.capabilities(cfg.hosts[h]).local_host) for h in sorted(set(cfg.matrix.host))
    }


@cli.command("run")
@config_option
@set_option
@click.option("--run-id", default=None, help="use this run id (default: random)")
@click.option(
    "--resume",
    "resume",
    default=None,
    metavar="RUN",
    help="continue RUN: cells that did not finish are run again, finished ones are kept",
)
@click.option(
    "--quiet",
    is_flag=True,
    help="for cron: no progress and no results table; only warnings, failed cells and regressions "
    "the run shows in its history (lab history), one line each",
)
def run_cmd(config_path, sets, run_id, resume, quiet):
    """Clone -> boot -> verify -> tune -> workloads -> destroy, cell by cell. Results are saved."""
    cfg, text = config.loaded(config_path, sets)
    for warning in check.setting_warnings(cfg):
        warn("lab: warning: ", warning)
    if run_id is not None and names.RUN_ID.problem(run_id):  # it names namespaces, VMs, lock files
        raise UsageError(f"--run-id {run_id!r}: {names.RUN_ID.problem(run_id)}")
    if run_id is not None and resume:
        raise UsageError("--run-id and --resume exclude each other: a resumed run keeps its id")
    stored = cfg.results_dir / Store.FILENAME
    if run_id is not None and stored.exists() and any(r.id == run_id for r in closing(Store(cfg.results_dir)).runs()):
        raise UsageError(
            f"--run-id {run_id!r}: {cfg.results_dir} already has a run of that id "
            f"(`lab run --resume {run_id}` continues it)"
        )
    if resume:  # what is wrong with the arguments comes before what the hosts say
        if not stored.exists():
            raise UsageError(f"cannot resume {resume!r}: no runs in {cfg.results_dir}")
        resumed = closing(Store(cfg.results_dir)).run(resume).id  # known, and not ambiguous
        if names.RUN_ID.problem(resumed):  # a run of an older lab: its VMs' names would be ambiguous
            raise UsageError(
                f"cannot resume run {resumed!r}: its id {names.RUN_ID.problem(resumed)}, and the names of its "
                "machines would be taken for another run's; start a new run"
            )
    prepared = runner.prepare(cfg)  # every check that can fail before anything is created
    for line in [] if quiet else runner.image_lines(prepared):
        err.print(line, soft_wrap=True)
    warn_capacity(cfg, prepared[2])
    store = new_store(cfg)
    reporter = QuietReporter() if quiet else RichReporter() if err.is_terminal else PlainReporter()
    previous = install_signal_handlers()
    try:
        rid = runner.run_lab(cfg, store, reporter, run_id=run_id, config_text=text, prepared=prepared, resume=resume)
    finally:
        reporter.close()
        restore_signal_handlers(previous)
    if quiet:  # what a nightly run should make someone look at: the run's series that it made worse
        for host in sorted(set(cfg.matrix.host)):
            for h in history.histories(store, host=host, settings=changepoints.Settings()):
                if h.regression is not None and h.points[-1].run_id == rid:
                    err.print(history.regression_line(h, h.regression), soft_wrap=True)
    else:
        print_show(store, store.run(rid))
    failed = [c for c in store.cells(rid) if c.status == "failed"]
    if failed:
        err.print(f"{len(failed)} of {len(store.cells(rid))} cells failed; see `lab show {rid}`")
        sys.exit(1)


def warn_capacity(cfg, backends: dict) -> None:
    """One warning line per host whose cells ask for more vCPUs or memory than it has (its facts,
    after its checks); a host whose facts cannot be read is not warned about."""
    facts = {}
    for host, backend in backends.items():
        try:
            facts[host] = backend.host_facts()
        except LabError:
            continue
    for text in check.capacity_warnings(cfg, facts):
        warn("lab: warning: ", text)


@cli.command("gc")
@config_option
@click.option("--dry-run", is_flag=True, help="list what would be removed")
@click.option("--force", is_flag=True, help="also remove unexpired leases on remote hosts, and live runs' VMs")
@click.option("--json", "as_json", is_flag=True, help="what was found and done as JSON (shape lab.gc/1)")
def gc_cmd(config_path, dry_run, force, as_json):
    """Destroy anything a crashed or killed run left behind (VMs, disks, taps, namespaces)."""
    report = gc.collect(load_or_default(config_path), dry_run=dry_run, force=force)
    if as_json:
        shapes.emit("gc", gc_document(report, dry_run))
        if report.errors:  # each error is in the document; one line here says so
            err.print(f'gc: {len(report.errors)} errors (see "errors"): {report.errors[0]}')
            sys.exit(1)
        return
    for line in report.lines:
        say(line)
    verb = "would remove" if dry_run else "removed"
    say(
        f"gc: {verb} {report.removed}, kept {report.kept} (owned by live runs)"
        + (f", {len(report.errors)} errors" if report.errors else "")
    )
    if report.errors:
        for e in report.errors:
            err.print(f"gc: {e}")
        sys.exit(1)


@cli.command("doctor")
@config_option
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='the checks as JSON (shape lab.doctor/1): "ok" is false when any check failed',
)
def doctor_cmd(config_path, as_json):
    """Check prerequisites: QEMU, KVM usable or not, Packer, netns rights, disk space, images."""
    checks = doctor.run_checks(config_path)
    if as_json:
        shapes.emit("doctor", doctor_document(checks, doctor.probed_accel()))
    else:
        t = table(("check", "status", "detail"), title_justify="center")
        for c in checks:
            t.add_row(c.name, styled(c.status, {"ok": "green", "warn": "yellow", "fail": "red"}[c.status]), c.detail)
        out.print(t)
    failed = [c.name for c in checks if c.status == "fail"]
    if failed:
        if as_json:  # the table said it; here stdout is for machines
            err.print(f"doctor: failed: {', '.join(failed)}")
        sys.exit(1)


@cli.command("snapshot")
@click.argument("host", default="local")
@config_option
@results_option
@click.option("--json", "as_json", is_flag=True, help="the fingerprint as JSON (shape lab.snapshot/1)")
def snapshot_cmd(host, config_path, results_dir, as_json):
    """Fingerprint of a host (CPU, microcode, cores, governor, mitigations, kernel, hypervisor and
    tool versions, NIC drivers, bridge MTUs), stored with the results; runs on the host link to it."""
    cfg = load_or_default(config_path)
    require_host(cfg, config_path, host)
    backend = cfg.open_backends({host})[host]
    with check.reaching(cfg, host):  # nothing is stored unless the host answered
        facts = hostinfo.snapshot(host, backend)
    fp = hostinfo.fingerprint(facts)
    store = new_store(cfg, Path(results_dir) if results_dir else None)
    fid = store.host_facts.save(host, fp, facts)
    runs = store.host_facts.runs_of(fid)
    if as_json:  # the facts at the top level, as `lab snapshot` has always printed them
        shapes.emit("snapshot", {**dict(sorted(facts.items())), "fingerprint": fp, "stored_id": fid, "runs": runs})
        return
    t = table(("fact", "value"), title=f"host {host}: fingerprint {fp}", title_justify="center")
    for k, v in hostinfo.flatten(facts).items():
        t.add_row(k, v)
    out.print(t)
    say(
        f"stored in {store.path} (host facts #{fid}); runs with this fingerprint: "
        f"{', '.join(runs) if runs else 'none yet'}",
        soft_wrap=True,
    )


# ---------------------------------------------------------------------------------------------
# The --json documents of plan, doctor and gc (their shapes: lab.cli.shapes)


def plan_document(
    cfg: LabConfig,
    units: list[plan.Unit],
    dups: dict[str, str],
    *,
    vms: int,
    boots: int,
    backends: list[str],
    est: estimate.Estimate,
    reach: tuple[bool, str, str, dict[str, Any]],
    host_watch: dict[str, str],
    images: list[str] | None,
) -> dict[str, Any]:
    suite = cfg.suite
    cells = [
        {"id": u.id, "label": u.label, "kind": u.kind, "host": u.host, "axes": u.axes(), "duplicate_of": dups.get(u.id)}
        for u in units
    ]
    return {
        "lab": cfg.lab.name,
        "cells": cells,
        "creates": {"vms": vms, "boots_per_cell": boots, "backends": backends, "bare_metal": suite.bare_metal},
        "suite": {
            "workloads": list(suite.workloads),
            "repetitions": suite.repetitions,
            "max_repetitions": suite.max_repetitions if suite.target_ci_pct is not None else suite.repetitions,
            "target_ci_pct": suite.target_ci_pct,
            "warmup": suite.warmup,
            "order": suite.order,
            "seed": suite.seed,
        },
        "estimate": {**est.as_dict(), "at_least": suite.target_ci_pct is not None},
        "verdicts": {"reachable": reach[0], "text": reach[1], "setting": reach[2], **reach[3]},
        "host_watch": host_watch,
        "checked": images is not None,
        "images": images or [],
    }


def doctor_document(checks: list[doctor.Check], accel: str | None) -> dict[str, Any]:
    return {
        "ok": not any(c.status == "fail" for c in checks),
        "accel": accel,
        "checks": [{"name": c.name, "status": c.status, "ok": c.status != "fail", "detail": c.detail} for c in checks],
    }


def gc_document(report: gc.GcReport, dry_run: bool) -> dict[str, Any]:
    return {
        "dry_run": dry_run,
        "ok": not report.errors,
        "removed": report.removed,
        "kept": report.kept,
        "items": [i.__dict__ for i in report.items],
        "marked_failed": report.marked_failed,
        "errors": report.errors,
    }
