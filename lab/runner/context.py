"""What every part of a run shares: the lab, the store, the backends and clients of its hosts, and
the state the cells of a run build up (repetition tallies, rounds, signatures, teardown failures).

With several hosts each lane (lab.runner.lanes) works on its own copy of the per-cell state
(tallies, rounds, signatures, busy streaks, spans), merged back when the lanes end; what stays
shared is either locked (the store, the reporter, the client locks) or only appended to / written
under a key of the lane's own host (teardown failures, clients, host fingerprints, lost hosts)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from lab import schedule, workloads
from lab.backends import Backend
from lab.labconfig import LabConfig
from lab.lifecycle import LeaseKeeper, Reporter
from lab.model import Client
from lab.store import Store


@dataclass
class RunContext:
    cfg: LabConfig
    store: Store
    run_id: str
    reporter: Reporter
    backends: dict[str, Backend] = field(default_factory=dict)
    clients: dict[str, Client] = field(default_factory=dict)  # host -> this machine's side of its run network
    # host -> where its load generators run when that is not `clients` (client = "vm": lab.runner.clientvm)
    generators: dict[str, Client] = field(default_factory=dict)
    host_fp: dict[str, int] = field(default_factory=dict)
    teardown_failures: list[str] = field(default_factory=list)
    # repetition policy state per (cell id, workload): what was measured, why it stopped
    tallies: dict[tuple[str, str], schedule.Tally] = field(default_factory=dict)
    rounds: list[list[str]] = field(default_factory=list)  # interleaved: the cells of each round, in order
    # equivalent cells: plan-time {later id: earlier id}; read-back signatures -> the first cell with it
    duplicates: dict[str, str] = field(default_factory=dict)
    signatures: dict[str, str] = field(default_factory=dict)
    busy_streaks: dict[str, int] = field(default_factory=dict)  # host -> times in a row it was not quiet (lab.hostload)
    seed: int = 0
    # Each boot of a cell: (cell id, lane, wall-clock start, end), lease to teardown: what overlapped
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)
    # Set by the main thread on SIGINT/SIGTERM: every lane stops at its next stage or repetition
    cancel: threading.Event = field(default_factory=threading.Event)
    # host -> why it was lost mid-run (a cell failed with HostUnreachable): its lane ends there
    lost_hosts: dict[str, str] = field(default_factory=dict)
    # One lock per load-generator machine ("local": this one; "vm:HOST": a host's client VM):
    # network measurements of different lanes never share a client at once (lab.runner.measure)
    client_locks: dict[str, threading.Lock] = field(default_factory=lambda: {"local": threading.Lock()})
    # The place on its host (Capabilities.places, e.g. a PVE node) this lane's VMs are pinned to; "" none
    place: str = ""
    # whose machines this attempt makes (lab.lease), written in every lease
    owner: str = ""
    # renews the leases of the machines that stand (lab.runner.renewal); None: not renewed
    leases: LeaseKeeper | None = None
    # The comparisons the run will be asked (pairs of cells, twins, primary rows): lab.schedule.Asked
    asked: schedule.Asked = field(default_factory=schedule.Asked)


def workload_params(cfg: LabConfig, name: str) -> dict[str, Any]:
    """A workload's parameters in this lab: its defaults, overridden by [suite.params.<name>]."""
    return {**workloads.get(name).defaults, **cfg.suite.params.get(name, {})}
