"""How busy a libvirt host is: its cumulative CPU time (Linux /proc/stat, FreeBSD kern.cp_time) and
the CPU time of the lab's own domains on it, read over the backend's own link (here, or over SSH).
The verdict work (issue 24) takes two readings and compares what the host did with what the lab's
guests did. The parsers are pure: they are tested on captured text."""

from __future__ import annotations

import re

# Linux /proc/stat: the one parser, shared with local; re-exported (the `as`) beside parse_cp_time
from lab.hostload import HostCpu, parse_proc_stat as parse_proc_stat


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
