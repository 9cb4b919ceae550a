"""Lanes: a run on several hosts runs one lane per host, the lanes at once.

A lane is a host (`lane_of`): its cells run one after the other, as a run on that host alone
would, so a host never has two measured VMs of the lab up at once and they cannot disturb each
other's figures (`[hosts.NAME] slots`, 1). A host with more slots has as many lanes ("pve1/2" is
the second), and a host with places (Capabilities.places: the nodes of a Proxmox cluster with
`placement = "spread"`) as many per place ("pve1@node2"), each lane's VMs pinned to its place
(VmSpec.place, from RunContext.place): lab.backends.host_lanes names them. A host's cells are
dealt to its lanes in the run's order; its set-up for the run is made once, by whichever of its
lanes comes first, and losing it ends all of them.

Order within a lane is the run's: the ordered cells are split by lane, order kept; an interleaved
run has its rounds per lane, and since plan.round_order draws each cell's place from the seed, the
round and the cell's id alone, a lane's round is the run's round without the other lanes' cells.

Threads: one per lane; the main thread only waits. SIGINT/SIGTERM raise Interrupted in the main
thread alone (lab.cli.group): it sets the run's cancel event, every lane stops at its next stage,
repetition or cell (lab.lifecycle.CellLife.enter), its cell's teardown destroys the VM, and the
main thread waits for every lane before it raises Interrupted on. A lane that loses its host (a
LabError out of the host's set-up, or a cell failing with HostUnreachable) ends there: its cells
not yet run are recorded failed with the reason, and the other lanes go on.

Each lane works on its own copy of the run's per-cell state (lab.runner.context), merged back
into the run's when every lane has ended.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lab.errors import LabError
from lab.lifecycle import Interrupted, shielded
from lab.model import CellStatus
from lab.runner.context import RunContext

JOIN_POLL_S = 0.2  # the main thread wakes this often while it waits, so a signal is handled at once


def lane_of(unit: Any) -> str:
    """The host of a cell: what a lost host ends (every lane of it)."""
    return str(unit.host)


def host_of(lane: str) -> str:
    return lane.split("/", 1)[0].split("@", 1)[0]


def place_of(lane: str) -> str:
    """The place a lane's VMs are pinned to ("pve1@node2/2" -> "node2"), "" for none."""
    return lane.split("/", 1)[0].partition("@")[2]


def split(ordered: list[Any], named: dict[str, list[str]] | None = None) -> dict[str, list[Any]]:
    """The run's ordered cells by lane, each lane's in the run's order; lanes in order of first cell.
    A host with several lanes (`named[host]`, lab.backends.host_lanes) has its cells dealt to them
    round-robin in order, as many lanes as it has cells at most."""
    by_host: dict[str, list[Any]] = {}
    for unit in ordered:
        by_host.setdefault(lane_of(unit), []).append(unit)
    lanes: dict[str, list[Any]] = {}
    for host, units in by_host.items():
        names = ((named or {}).get(host) or [host])[: len(units)]
        for k, name in enumerate(names):
            lanes[name] = units[k :: len(names)]
    return lanes


OVERLAPS_KEPT = 20_000  # pairs kept in the manifest; beyond, the spans of every boot tell the rest


def overlaps(spans: list[tuple[str, str, float, float]], limit: int = OVERLAPS_KEPT) -> tuple[list[list[str]], bool]:
    """Pairs of cell ids (each pair in id order, the list sorted) whose boots were up at the same
    time, from a sweep over the spans by start time; and whether that is all of them (False: cut
    at `limit` pairs)."""
    pairs: set[tuple[str, str]] = set()
    live: list[tuple[str, str, float, float]] = []
    for span in sorted(spans, key=lambda s: s[2]):
        live = [s for s in live if s[3] > span[2]]
        for other in live:
            if other[0] != span[0]:
                pairs.add((min(other[0], span[0]), max(other[0], span[0])))
                if len(pairs) > limit:
                    return [list(p) for p in sorted(pairs)[:limit]], False
        live.append(span)
    return [list(p) for p in sorted(pairs)], True


def spans_by_cell(spans: list[tuple[str, str, float, float]]) -> dict[str, list[list[float]]]:
    """Each cell's boots as [start, end] wall-clock times (several in an interleaved run)."""
    out: dict[str, list[list[float]]] = {}
    for cell_id, _lane, start, end in spans:
        out.setdefault(cell_id, []).append([round(start, 3), round(end, 3)])
    return out


@dataclass
class Lane:
    name: str
    units: list[Any]
    ctx: RunContext
    ended: str = ""  # why the lane ended before its cells did (its host lost)
    failure: BaseException | None = None  # anything else out of the lane: re-raised in the main thread
    thread: threading.Thread | None = field(default=None, repr=False)
    # set by the lane's thread as it ends. Waited on instead of Thread.join: on Python 3.11 a join
    # interrupted by a signal handler's exception can mark a live thread stopped (CPython gh-90882)
    done: threading.Event = field(default_factory=threading.Event, repr=False)


def run_lanes(
    ctx: RunContext,
    lanes: dict[str, list[Any]],
    open_host: Callable[[RunContext, str], None],
    run_units: Callable[[RunContext, list[Any]], None],
) -> None:
    """Every lane in its own thread: `open_host(ctx, host)` sets up the lane's host for the run,
    then `run_units(ctx, units)` runs its cells in order. Returns when every lane has ended; raises
    Interrupted (after every lane's teardown) if the run was interrupted."""
    running = [
        Lane(
            name,
            units,
            dataclasses.replace(
                ctx, tallies={}, rounds=[], signatures={}, busy_streaks={}, spans=[], place=place_of(name)
            ),
        )
        for name, units in lanes.items()
    ]
    open_once = OpenOnce(open_host, {host_of(name) for name in lanes})
    interrupted: Interrupted | None = None
    # Started with SIGINT/SIGTERM held: the lanes inherit the mask, so those signals reach this
    # thread alone (where Interrupted is raised), and none arrives half-way through the starting.
    with shielded():
        for lane in running:
            lane.thread = threading.Thread(
                target=_lane_main, args=(lane, open_once, run_units), name=f"lane-{lane.name}", daemon=True
            )
            lane.thread.start()
    while True:
        try:  # all of the waiting inside the try: an interrupt anywhere in it never leaves a lane running
            for lane in running:
                while not lane.done.wait(JOIN_POLL_S):
                    pass
            break
        except Interrupted as exc:  # the lanes stop at their next step and tear down; the wait goes on
            interrupted = interrupted or exc
            ctx.cancel.set()
    for lane in running:
        if lane.thread is not None:
            lane.thread.join()  # ended already: its last bytecodes
    _merge(ctx, running)
    if interrupted is not None:
        raise interrupted
    for lane in running:
        if lane.failure is not None:
            raise lane.failure


class OpenOnce:
    """A host's set-up for the run, made once for all its lanes: the first lane makes it, the
    others wait for it and share it, or its error."""

    def __init__(self, open_host: Callable[[RunContext, str], None], hosts: set[str]):
        self.open_host = open_host
        self.locks = {host: threading.Lock() for host in hosts}
        self.done: dict[str, LabError | None] = {}

    def __call__(self, ctx: RunContext, host: str) -> None:
        with self.locks[host]:
            if host not in self.done:
                try:
                    self.open_host(ctx, host)
                except LabError as exc:
                    self.done[host] = exc
                    raise
                self.done[host] = None
            else:
                failed = self.done[host]
                if failed is not None:
                    raise failed


def _lane_main(lane: Lane, open_host: OpenOnce, run_units: Callable[[RunContext, list[Any]], None]) -> None:
    ctx = lane.ctx
    try:
        open_host(ctx, host_of(lane.name))
        run_units(ctx, lane.units)
    except Interrupted as exc:  # the run's cancel, or raised in the lane itself: every lane stops
        lane.failure = exc
        ctx.cancel.set()
    except LabError as exc:
        end_lane(lane, f"host {host_of(lane.name)} lost: {exc}")
    except BaseException as exc:  # a bug in one lane: the others end, the main thread raises it
        lane.failure = exc
        ctx.cancel.set()
    finally:
        lane.done.set()


class HostLost(LabError):
    """A cell of the lane failed with its host unreachable: the lane's other cells are not tried."""


def check_host(ctx: RunContext, unit: Any) -> None:
    """In a lane, after each cell: raise HostLost if the cell lost the lane's host."""
    if lane_of(unit) in ctx.lost_hosts:
        raise HostLost(ctx.lost_hosts[lane_of(unit)])


def end_lane(lane: Lane, reason: str) -> None:
    """The lane's cells that have not run (or are between rounds) are recorded failed with `reason`."""
    lane.ended = reason
    ctx = lane.ctx
    ctx.reporter.warn(f"lane {lane.name} ended: {reason}")
    units = {u.id: u for u in lane.units}
    for cell_id, status in ctx.store.cell_statuses(ctx.run_id).items():
        if cell_id in units and status in (CellStatus.PENDING, CellStatus.RUNNING):
            ctx.store.cell_update(ctx.run_id, cell_id, status=CellStatus.FAILED, error=reason, finished=True)
            ctx.reporter.cell_finished(units[cell_id], CellStatus.FAILED, reason)


def _merge(ctx: RunContext, lanes: list[Lane]) -> None:
    """Each lane's per-cell state into the run's: tallies, spans, busy streaks; the rounds as the
    run's rounds (round i: every lane's round i, lanes in order)."""
    for lane in lanes:
        ctx.tallies.update(lane.ctx.tallies)
        ctx.spans.extend(lane.ctx.spans)
        ctx.busy_streaks.update(lane.ctx.busy_streaks)
        ctx.signatures.update(lane.ctx.signatures)
    depth = max((len(lane.ctx.rounds) for lane in lanes), default=0)
    for i in range(depth):
        ctx.rounds.append([cid for lane in lanes if i < len(lane.ctx.rounds) for cid in lane.ctx.rounds[i]])
