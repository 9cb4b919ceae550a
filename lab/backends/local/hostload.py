"""How busy this machine is, and how much of it is the lab's own work (issue 24: measure the host).

Counters, not rates: a sample's foreign load is the difference of two readings,
(Δbusy_s - Δlab_s) / Δat cores (and Δsteal_s / Δat where the kernel reports steal).

- busy: every CPU's user + nice + system + irq + softirq time from /proc/stat (guest time is
  already inside user and nice; iowait counts as idle; steal is reported on its own);
- the lab's processes: the orchestrator and all its descendants (QEMU, ssh, iperf3/wrk, the
  bare-metal cell's nginx), every process in the network namespaces of the given machines (the
  run's: it also holds the daemonised ssh control masters, which leave the process tree) and in
  their cgroups (the bare-metal cell's). Each counts utime + stime + cutime + cstime: a child's
  time moves into its parent's c-fields when the parent reaps it, so the sum runs on smoothly
  while processes come and go. (A process outside the tree that dies, reaped by init, takes its
  time with it: the lab's share then reads low, never high.)

The parsers are pure (lab.hostload) and tested on captured /proc text.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lab.hostload import TICK, CounterWindow, LoadWindow, lab_pids, parse_proc_stat, read_processes
from lab.model import Vm

PROC = Path("/proc")


def netns_members(namespaces: Iterable[str], pids: Iterable[int], proc_dir: Path = PROC) -> set[int]:
    """The pids living in any of the named network namespaces (/run/netns/<name>)."""
    wanted = set()
    for ns in namespaces:
        try:
            st = os.stat(f"/run/netns/{ns}")
            wanted.add((st.st_dev, st.st_ino))
        except OSError:
            continue
    if not wanted:
        return set()
    out = set()
    for pid in pids:
        try:
            st = os.stat(proc_dir / str(pid) / "ns" / "net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in wanted:
            out.add(pid)
    return out


def cgroup_members(cgroups: Iterable[str]) -> set[int]:
    out: set[int] = set()
    for cg in cgroups:
        try:
            out.update(int(x) for x in (Path(cg) / "cgroup.procs").read_text().split())
        except (OSError, ValueError):
            continue
    return out


def lab_processes(
    vms: Iterable[Vm], procs: dict[int, tuple[int, int]], *, root: int | None = None, proc_dir: Path = PROC
) -> set[int]:
    """The lab's pids among `procs` (read_processes): the tree of `root` (this process by default),
    and whatever lives in the machines' namespaces and cgroups, with its children."""
    handles = [vm.handle for vm in vms if vm is not None]
    parents = {pid: ppid for pid, (ppid, _) in procs.items()}
    members = netns_members({h["netns"] for h in handles if h.get("netns")}, procs, proc_dir) | cgroup_members(
        h["cgroup"] for h in handles if h.get("cgroup")
    )
    return lab_pids(parents, [os.getpid() if root is None else root], members)


def cpu_times(vms: Iterable[Vm], *, root: int | None = None, proc_dir: Path = PROC) -> dict[str, Any]:
    """One reading: {"at": monotonic s, "busy_s", "steal_s" (None where not reported), "cpus",
    "lab_s"}; `root` is the orchestrator (this process by default)."""
    vms = list(vms)
    at = time.monotonic()
    host = parse_proc_stat((proc_dir / "stat").read_text(), TICK)
    procs = read_processes(proc_dir)
    ours = lab_processes(vms, procs, root=root, proc_dir=proc_dir)
    return {
        "at": at,
        "busy_s": host.busy_s,
        "steal_s": host.steal_s,
        "cpus": host.cpus,
        "lab_s": sum(procs[pid][1] for pid in ours) / TICK,
    }


class LoadMeter:
    """The local host's LoadMeter part (lab.backends.base): a window over this machine's CPU
    counters, busy time and the lab's own share of it, so foreign load and steal show (issue 24)."""

    def window(self, vms: Sequence[Vm]) -> LoadWindow:
        vms = list(vms)
        return CounterWindow(lambda: cpu_times(vms))
