"""The client under a network sample: how busy the machine that ran its load generator was.

A network figure measures the guest only while the load generator keeps up: an iperf3 or wrk with
no CPU left measures its own machine. So every measured repetition of a network workload
(`network = True`) runs inside a window of its client (`[hosts.NAME] client`: "local", this
machine, or "vm", a VM of the run on the cell's host), and its samples carry labels[CLIENT_LOAD]:
the placement, how busy the client machine was (% of one core, all its processes) and its CPUs.

When the client is not the cell's host (a Proxmox, libvirt, SmartOS or Vagrant host measured
through this machine) or is a client VM (its own vCPUs are read), a window in which the client was
busy at or above `[suite] client_saturated_pct` % of all its CPUs flags the samples (lab.flags):
shown, never averaged in. Where the client is the host itself (the local backend, client "local")
the figures are recorded, not judged here: the cell's VM runs on the same CPUs, and lab.hostload
already tells foreign load from the lab's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lab.hostload import TICK, CounterWindow, HostLoad, LoadWindow, parse_proc_stat
from lab.model import Client

CLIENT_LOAD = "client_load"  # the label of every measured sample of a network workload
PROC = Path("/proc")


def reading(proc_stat: str) -> dict[str, Any]:
    """One reading of a client's CPU counters from its /proc/stat, in lab.hostload.CpuTimes' shape:
    everything busy counts (`lab_s` 0): a client saturated by the lab's own processes is saturated
    all the same."""
    at = time.monotonic()
    cpu = parse_proc_stat(proc_stat, TICK)
    return {"at": at, "busy_s": cpu.busy_s, "lab_s": 0.0, "steal_s": cpu.steal_s, "cpus": cpu.cpus}


def this_machine(proc_dir: Path = PROC) -> dict[str, Any]:
    """One reading of this machine's CPU counters."""
    return reading((proc_dir / "stat").read_text())


def open_window(client: Client) -> LoadWindow:
    """A window on the machine of `client` (this one, or the run's client VM: lab.runner.clientvm)."""
    return CounterWindow(lambda: reading(client.proc_stat()))


def label(placement: str, load: HostLoad, saturated_pct: float, *, judged: bool) -> dict[str, Any]:
    """labels[CLIENT_LOAD] of a repetition's samples. `judged`: the client is not the cell's host,
    so a busy client flags the samples (`flag`, in words)."""
    out: dict[str, Any] = {"placement": placement, "seconds": round(load.seconds, 2)}
    if not load.known:
        out["unknown"] = load.unknown
        return out
    busy = load.foreign_pct or 0.0  # lab_s is 0: "foreign" is everything busy on the client
    out["busy_pct"] = round(busy, 1)
    out["cpus"] = load.cpus
    if not judged:
        out["shares_host"] = True  # the cell's VM is on these CPUs too: see the host's load
        return out
    flag = saturated(busy, load.cpus or 1, saturated_pct)
    if flag:
        out["flag"] = flag
    return out


def saturated(busy_pct: float, cpus: int, threshold_pct: float) -> str:
    """Pure: "" when the client kept headroom, else why its samples are flagged, in words."""
    capacity = 100.0 * cpus
    if busy_pct < threshold_pct / 100.0 * capacity:
        return ""
    return (
        f"client saturated: {busy_pct:.0f} % of one core busy on the load generator's machine "
        f"({cpus} CPUs, >= {threshold_pct:g} % of them)"
    )
