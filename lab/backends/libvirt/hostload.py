"""How busy a libvirt host is: its cumulative CPU time (Linux /proc/stat, FreeBSD kern.cp_time) and
the CPU time of the lab's own domains on it, read over the backend's own link (here, or over SSH).
The verdict work (issue 24) takes two readings and compares what the host did with what the lab's
guests did (LoadMeter, the backend's part). The parsers are pure: they are tested on captured text."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from typing import Any

from lab.backends.libvirt.connection import Connection, libvirt_module
from lab.backends.libvirt.hostshell import HostShell
from lab.backends.libvirt.settings import Host
from lab.errors import BackendError

# Linux /proc/stat: the one parser, shared with local; re-exported (the `as`) beside parse_cp_time
from lab.hostload import CounterWindow, HostCpu, LoadWindow, parse_proc_stat as parse_proc_stat, tree_seconds
from lab.model import Vm


def parse_cp_time(text: str) -> HostCpu:
    """FreeBSD `sysctl -n kern.cp_time kern.smp.cpus kern.clockrate`: "user nice sys intr idle" in
    stathz ticks, the CPU count, and "{ hz = 1000, tick = 1000, profhz = 8128, stathz = 127 }"."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if len(lines) < 3:
        raise ValueError("expected kern.cp_time, kern.smp.cpus and kern.clockrate")
    ticks = [int(f) for f in lines[0].split()]
    if len(ticks) != 5:
        raise ValueError(f"kern.cp_time has 5 counters, got {lines[0]!r}")
    stathz = re.search(r"stathz\s*=\s*(\d+)", lines[2])
    if not stathz or not int(stathz.group(1)):
        raise ValueError(f"no stathz in kern.clockrate {lines[2]!r}")
    user, nice, system, intr, _idle = ticks
    return HostCpu(busy_s=(user + nice + system + intr) / int(stathz.group(1)), steal_s=None, cpus=int(lines[1]))


class LoadMeter:
    """The libvirt host's LoadMeter part (lab.backends.base)."""

    def __init__(self, host: Host, connection: Connection, shell: HostShell):
        self.host, self.connection, self.shell = host, connection, shell

    def cpu_times(self, vms: Sequence[Vm]) -> dict[str, Any]:
        """The host's cumulative CPU time and the lab's domains' share, read now over the
        backend's own link: {"at": this machine's monotonic seconds, "busy_s", "lab_s",
        "steal_s" (None where not reported), "cpus"}. Two readings make a rate."""
        libvirt = libvirt_module()
        at = time.monotonic()
        if self.host.driver == "bhyve":
            cpu = parse_cp_time(
                self.shell.run(
                    ["sysctl", "-n", "kern.cp_time", "kern.smp.cpus", "kern.clockrate"], what="sysctl", timeout=30
                ).stdout
            )
        else:
            text = self.shell.read("/proc/stat")
            if text is None:
                raise BackendError(f"cannot read /proc/stat on {self.host.name!r}")
            # USER_HZ: this machine's, else Linux's fixed 100 (the userspace ABI on every arch lab meets)
            cpu = parse_proc_stat(text, os.sysconf("SC_CLK_TCK") if not self.shell.remote else 100)
        lab_ns = 0
        for vm in vms:
            dom = self.connection.lookup(vm.name)
            try:
                lab_ns += dom.info()[4] if dom is not None and dom.isActive() else 0
            except libvirt.libvirtError:
                pass  # gone meanwhile: it used no more CPU
        lab_s = lab_ns / 1e9
        if not self.shell.remote:
            # the host is this machine: the lab's load generators and ssh run on it too, and are the lab's
            lab_s += tree_seconds()
        return {"at": at, "busy_s": cpu.busy_s, "lab_s": lab_s, "steal_s": cpu.steal_s, "cpus": cpu.cpus}

    def window(self, vms: Sequence[Vm]) -> LoadWindow:
        """Two readings of cpu_times over the backend's own link, at the window's start and stop."""
        vms = list(vms)
        return CounterWindow(lambda: self.cpu_times(vms))
