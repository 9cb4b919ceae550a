"""The workloads stage of a cell.

Warm-ups are discarded; measured repetitions follow the repetition policy (lab.schedule), or a
quota per boot in interleaved rounds. Every execution is recorded in the store as it starts and
ends (the executed order); raw output is stored before it is parsed, and each repetition's
samples are committed before the next one starts, so nothing measured is lost when a later
repetition, workload or cell fails.

The host under each measured repetition (lab.hostload): unless `[suite] quiet_host = "off"`, the
repetition runs inside a load window of its host, and what the window found is stamped on every
sample of it (labels["host_load"]), flagged when foreign load or steal exceeded the threshold. In
"wait" mode the runner first waits, bounded, until the host has been quiet for a few seconds.

The client: a network workload (its traits' `network`: its load generator or server
runs on the client side) holds its client's lock (RunContext.client_locks: this machine's, or the
host's own client VM's, lab.runner.clientvm) for its prepare and each of its runs, so two lanes
never measure through one client at once; its samples carry the placement (labels["client"],
"local": this machine, "vm") and how busy the client was during each measured repetition
(labels["client_load"], lab.clientload: flagged when it was saturated).
Every workload of a cell on this machine (Capabilities.local_host) holds the "local" lock too:
another lane's load generator would be foreign load under its figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

from lab import clientload, clients, hostload, lifecycle, schedule, workloads
from lab.errors import LabError
from lab.guest import Machine
from lab.lifecycle import CellLife, Interrupted
from lab.model import Client
from lab.runner.context import RunContext, workload_params
from lab.workloads import WorkloadContext


def run_workloads(
    ctx: RunContext,
    life: CellLife,
    guest: Machine,
    client: Client,
    os_name: str,
    address: str,
    labels_base: dict[str, Any],
    *,
    vcpus: int,
    round_no: int = 1,
    quota: int | None = None,
    skipped: dict[str, str] | None = None,
) -> None:
    """Each workload of the suite in this boot of the cell. `skipped`: a workload whose prepare
    fails is recorded there and skipped instead of failing the cell (the bare-metal cell: a tool
    the host lacks)."""
    cfg, store, rid, cell = ctx.cfg, ctx.store, ctx.run_id, life.cell
    watch = HostWatch.of(ctx, life)
    # this machine is the "local" client: a cell measured on it (local QEMU, its bare-metal cell) must
    # not share it with another lane's load generator either
    on_this_machine = life.backend.capabilities(life.backend.settings).local_host
    for name in cfg.suite.workloads:
        tally = ctx.tallies.setdefault((cell.id, name), schedule.Tally())
        if tally.stopped:
            continue  # measured enough in an earlier round, or skipped
        wl = workloads.get(name)
        wctx = WorkloadContext(
            guest=guest,
            client=client,
            os=os_name,
            vcpus=vcpus,
            params=workload_params(cfg, name),
            guest_address=address,
            known_hosts=guest.known_hosts,
        )
        life.enter("workloads", f"{name}: prepare")
        placement = ctx.cfg.hosts[str(cell.host)].client
        network = wl.traits.network
        keys = ([clients.turn_key(str(cell.host), placement)] if network else []) + (
            [clients.LOCAL] if on_this_machine else []
        )
        turn = client_turn(ctx, life, keys, name) if keys else contextlib.nullcontext
        client_labels = {"client": placement} if network else {}
        # a client VM is judged by its own vCPUs; this machine only when it is not the cell's host
        judged = placement != clients.LOCAL or not on_this_machine
        client_watch = ClientWatch(ctx, life, placement, client, judged=judged) if network else None
        started = lifecycle.clock()
        try:
            with turn():
                wl.prepare(wctx)
            life.timed("prepare", lifecycle.clock() - started, workload=name)  # per boot: part of the estimate
        except LabError as exc:
            if skipped is None:
                raise
            skipped[name] = str(exc)
            tally.stop(f"skipped: {exc}")
            continue
        where = f" (round {round_no})" if quota is not None else ""

        def execute(rep: int, detail: str) -> None:
            life.enter("workloads", f"{name} {detail}{where}")
            # warm-ups are discarded: no need to wait for a quiet host, nor to watch it or the client
            host: HostWatch | None = watch if rep >= 0 else None
            if host is not None:
                started = lifecycle.clock()
                host.before(f"{name} {detail}{where}")
                if host.mode == "wait":  # the wait is part of what a repetition costs (lab.estimate)
                    life.timed("quiet", lifecycle.clock() - started, workload=name)
            eid = store.timings.start_execution(rid, cell.id, round_no, name, rep)
            try:
                with turn():
                    watched = client_watch if rep >= 0 else None
                    raw, load = run_watched(wl, wctx, rep, host, watched, f"{name} {detail}")
                # the host's figures are the workload's own (idle): kept with its raw output too
                if hostload.HOST_LOAD in load and wl.traits.records_host_load:
                    raw = dataclasses.replace(
                        raw, extra={**raw.extra, hostload.HOST_LOAD: json.dumps(load[hostload.HOST_LOAD])}
                    )
                raw_id = store.add_raw(rid, cell.id, rep, raw)  # stored before parsing: nothing is lost
                if rep >= 0:
                    samples = wl.parse(raw)
                    stamped = [
                        type(s)(
                            s.metric,
                            s.value,
                            s.unit,
                            s.higher_is_better,
                            {**labels_base, **client_labels, **s.labels, "repetition": rep, "round": round_no, **load},
                        )
                        for s in samples
                    ]
                    store.add_samples(rid, cell.id, raw_id, name, rep, stamped)
                    tally.add(stamped, raw.seconds, wl.primary_metrics)
            except BaseException as exc:
                store.timings.finish_execution(eid, "failed", error=str(exc) or type(exc).__name__)
                raise
            store.timings.finish_execution(eid, "ok", raw_id=raw_id)

        for w in range(cfg.suite.warmup):
            execute(w - cfg.suite.warmup, "warm-up")  # warm-ups are negative and yield no samples
        done = 0
        while not tally.stopped and (quota is None or done < quota):
            execute(tally.n, schedule.progress(cfg.suite, tally))
            done += 1
            # adaptive: also until its primary rows are decided against the cells it will be compared with
            unknown = functools.partial(ctx.asked.unknown, ctx.tallies, cell.id, name, seed=ctx.seed)
            tally.update(cfg.suite, seed=ctx.seed, unknown=unknown)


CLIENT_POLL_S = 0.5  # a lane waiting for the client looks at the run's cancel this often


def client_turn(ctx: RunContext, life: CellLife, keys: list[str], what: str):
    """A context manager factory: hold the locks of these clients (RunContext.client_locks, taken
    in sorted order: no cycle) for one step. A lane that has to wait says so on its progress, and
    stops waiting when the run is cancelled."""

    @contextlib.contextmanager
    def turn() -> Iterator[None]:
        held: list[threading.Lock] = []
        try:
            for key in sorted(set(keys)):
                lock: threading.Lock = ctx.client_locks[key]
                if not lock.acquire(blocking=False):
                    life.progress(f"{what}: waiting for the {key} client (another host's network measurement)")
                    while not lock.acquire(timeout=CLIENT_POLL_S):
                        if ctx.cancel.is_set():
                            raise Interrupted("cancelled: the run was interrupted")
                held.append(lock)
            yield
        finally:
            for lock in reversed(held):
                lock.release()

    return turn


def run_watched(
    wl: Any, wctx: WorkloadContext, rep: int, host: HostWatch | None, client: ClientWatch | None, what: str
) -> tuple[Any, dict[str, Any]]:
    """One run of a workload, inside a load window of its host and of its client, each when
    watched: (raw output, the windows' labels)."""
    host_window = host.open() if host is not None else None
    client_window = client.open() if client is not None else None
    try:
        raw = wl.run(wctx, rep)
    except BaseException:
        if host_window is not None:
            host_window.stop()  # a polling window's thread ends with it
        raise
    labels = host.after(host_window, what) if host is not None else {}
    if client is not None and client_window is not None:
        labels.update(client.after(client_window, what))
    return raw, labels


class ClientWatch:
    """The client under one cell's network repetitions (lab.clientload): a window around each, and
    what to stamp on its samples; a saturated client (judged: not the cell's host) is said."""

    def __init__(self, ctx: RunContext, life: CellLife, placement: str, client: Client, *, judged: bool):
        self.placement, self.client, self.judged, self.life = placement, client, judged, life
        self.threshold, self.reporter = ctx.cfg.suite.client_saturated_pct, ctx.reporter

    def open(self) -> hostload.LoadWindow:
        return clientload.open_window(self.client)

    def after(self, window: hostload.LoadWindow, what: str) -> dict[str, Any]:
        label = clientload.label(self.placement, window.stop(), self.threshold, judged=self.judged)
        if "flag" in label:
            self.reporter.warn(f"{self.life.cell.id} {what}: flagged: {label['flag']}")
        return {clientload.CLIENT_LOAD: label}


WAIT_SHOWN_EVERY_S = 5.0
GIVE_UP_AFTER = 3  # times in a row a host was not quiet within the timeout; then the run only records it


class HostWatch:
    """The host under one cell's measured repetitions (lab.hostload): waits for it to be quiet
    ("wait"), opens a load window around each repetition and says what to stamp on its samples."""

    def __init__(self, ctx: RunContext, life: CellLife, mode: str):
        self.suite, self.life, self.mode = ctx.cfg.suite, life, mode
        self.reporter, self.backend = ctx.reporter, life.backend
        self.waited_s, self.not_quiet = 0.0, ""
        self.host = str(life.cell.host)
        self.busy_streaks = ctx.busy_streaks  # the run's: host -> repetitions in a row it was not quiet before

    @classmethod
    def of(cls, ctx: RunContext, life: CellLife) -> HostWatch | None:
        b = life.backend
        mode = ctx.cfg.suite.quiet_mode(b.capabilities(b.settings).local_host)
        return None if mode == "off" else cls(ctx, life, mode)

    def _vms(self) -> list[Any]:
        return [self.life.vm] if self.life.vm is not None else []

    def open(self) -> hostload.LoadWindow:
        meter = self.backend.load_meter
        if meter is None:
            why = f"host {self.backend.host_name!r} ({self.backend.name} backend) does not report its CPU load"
            return hostload.UnknownWindow(why)
        return meter.window(self._vms())

    def before(self, what: str) -> None:
        """In "wait" mode: until the host has been quiet for quiet_seconds (at most quiet_timeout_s)."""
        self.waited_s, self.not_quiet = 0.0, ""
        if self.mode != "wait" or self.busy_streaks.get(self.host, 0) >= GIVE_UP_AFTER:
            return  # a host that stays busy is waited for a few times, not before every repetition
        s = self.suite
        shown = [-WAIT_SHOWN_EVERY_S]

        def show(why: str) -> None:  # the first busy probe, then every few seconds (plain logs get a line each)
            if time.monotonic() - shown[0] >= WAIT_SHOWN_EVERY_S:
                shown[0] = time.monotonic()
                self.life.progress(f"{what}: waiting for a quiet host: {why}")

        quiet = hostload.wait_quiet(
            self.open,
            threshold_pct=s.foreign_load_pct,
            quiet_s=s.quiet_seconds,
            timeout_s=s.quiet_timeout_s,
            on_wait=show,
        )
        self.waited_s = quiet.waited_s
        streak = self.busy_streaks[self.host] = 0 if quiet.quiet else self.busy_streaks.get(self.host, 0) + 1
        if not quiet.quiet:
            self.not_quiet = (
                f"host not quiet for {s.quiet_seconds:g} s within {s.quiet_timeout_s:g} s before it ({quiet.why})"
            )
            self.reporter.warn(
                f"{self.life.cell.id} {what}: {self.not_quiet}; measuring it anyway, flagged"
                + (
                    f"; host {self.host} stayed busy {streak} times in a row: not waiting for it any "
                    "more in this run (its load is still recorded and flagged)"
                    if streak >= GIVE_UP_AFTER
                    else ""
                )
            )
        self.life.progress(what)

    def after(self, window: hostload.LoadWindow | None, what: str) -> dict[str, Any]:
        """The labels of the repetition's samples; a flagged repetition is said on the progress."""
        load = window.stop() if window is not None else hostload.HostLoad(unknown="no window")
        label = hostload.label(load, self.suite.foreign_load_pct, waited_s=self.waited_s, not_quiet=self.not_quiet)
        if "flag" in label and not self.not_quiet:
            self.reporter.warn(f"{self.life.cell.id} {what}: flagged: {label['flag']}")
        return {hostload.HOST_LOAD: label}
