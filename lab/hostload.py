"""The host's CPU while a sample is measured: how much of it went to anything that is not the lab.

A guest's numbers are only as good as the host under it: an unrelated compile on the same two
cores made one run's http 2.9x slower than the next, and nothing in the results said so. So
every measured repetition runs inside a *load window* of its host (Backend.load_meter): the window
is started before the load and stopped after it, and says how many cores' worth of CPU the host
spent on anything that is not the lab (the cell's VM, its load generator, the lab itself) and how
much CPU steal it saw, where the host reports steal. Figures are "% of one core": 100 is one core
busy the whole window, whatever the host's size.

Readings come in two kinds, and each has its window here, so a backend only reads:
- cumulative counters (CpuTimes: a Linux /proc/stat, a BSD kern.cp_time, the lab's processes or
  domains): CounterWindow reads once at start and once at stop, and divides the difference by the time;
- rates (CpuRates: Proxmox VE's node and VM status, each a usage over its last few seconds):
  PollingWindow polls in a thread during the window and averages the polls.
A backend that cannot tell returns an UnknownWindow saying why; a reading that fails mid-run is
"cannot tell" for that window, never a failed cell.

What a window found is stored with every sample of its repetition (labels[HOST_LOAD], see
`label`), and a sample whose window exceeded `[suite] foreign_load_pct` is flagged (lab.flags):
shown, never averaged in. Before a repetition the runner may wait until the host has been quiet
for a while (`wait_quiet`, `[suite] quiet_host = "wait"`), bounded, then flag and go on.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lab.errors import LabError

TICK = os.sysconf("SC_CLK_TCK")  # USER_HZ: /proc/<pid>/stat counts in it
HOST_LOAD = "host_load"  # the label of every measured sample: what its repetition's window found


@dataclass(frozen=True)
class CpuTimes:
    """One reading of a host's cumulative CPU counters (seconds of CPU time, all CPUs together)."""

    at: float  # this machine's monotonic clock when it was read
    busy_s: float  # every CPU's busy time (not idle, not iowait, not steal)
    lab_s: float  # the part of it that is the lab's own (its processes, VMs or domains)
    steal_s: float | None  # time the host's own hypervisor ran something else; None where not reported
    cpus: int

    @classmethod
    def of(cls, reading: CpuTimes | Mapping[str, Any]) -> CpuTimes:
        """A backend's reading as a dict ({"at", "busy_s", "lab_s", "steal_s", "cpus"}) or as is."""
        if isinstance(reading, CpuTimes):
            return reading
        steal = reading.get("steal_s")
        return cls(
            float(reading["at"]),
            float(reading["busy_s"]),
            float(reading["lab_s"]),
            None if steal is None else float(steal),
            int(reading["cpus"]),
        )


@dataclass(frozen=True)
class CpuRates:
    """One poll of a host that reports rates: cores' worth of CPU in use over its last few seconds."""

    at: float
    busy_cores: float
    lab_cores: float
    steal_cores: float | None
    cpus: int


@dataclass(frozen=True)
class HostLoad:
    """What one window found. Percentages are of one core; None where the host cannot tell."""

    seconds: float = 0.0
    foreign_pct: float | None = None  # CPU used by anything that is not the lab
    steal_pct: float | None = None
    lab_pct: float | None = None
    cpus: int | None = None
    unknown: str = ""  # why the host's load cannot be told ("" when it can)

    @property
    def known(self) -> bool:
        return self.foreign_pct is not None

    def too_busy(self, threshold_pct: float) -> str:
        """ "" if the window stayed at or below the threshold, else what exceeded it, in words."""
        over = [
            f"{what} {pct:.0f} % of one core"
            for what, pct in (("foreign load", self.foreign_pct), ("CPU steal", self.steal_pct))
            if pct is not None and pct > threshold_pct
        ]
        return f"{' and '.join(over)} on the host (> {threshold_pct:g} %)" if over else ""


class LoadWindow(Protocol):
    """Started when it is made; `stop()` ends it and says what it found (never raises)."""

    def stop(self) -> HostLoad: ...


@dataclass
class UnknownWindow:
    """A host whose load cannot be read: every window says so, and why."""

    why: str
    started: float = field(default_factory=time.monotonic)

    def stop(self) -> HostLoad:
        return HostLoad(seconds=time.monotonic() - self.started, unknown=self.why)


class CounterWindow:
    """Over cumulative counters: one reading at start, one at stop, the difference over the time."""

    def __init__(self, read: Callable[[], CpuTimes | Mapping[str, Any]]):
        self.read = read
        self.first, self.why = self._read()

    def _read(self) -> tuple[CpuTimes | None, str]:
        try:
            return CpuTimes.of(self.read()), ""
        except (LabError, OSError, KeyError, TypeError, ValueError) as exc:
            return None, f"the host's CPU could not be read: {exc}"

    def stop(self) -> HostLoad:
        last, why = self._read()
        if self.first is None or last is None:
            return HostLoad(unknown=self.why or why)
        return between(self.first, last)


def between(a: CpuTimes, b: CpuTimes) -> HostLoad:
    """Pure: the load between two readings of the same host's counters."""
    dt = b.at - a.at
    if dt <= 0:
        return HostLoad(seconds=0.0, unknown="no time passed between the two readings")
    lab = max(b.lab_s - a.lab_s, 0.0)
    # The lab's processes are accounted separately from the host's CPU counters (and a little
    # late: a process's time lands when it is sampled), so the difference can dip below zero.
    foreign = max((b.busy_s - a.busy_s) - lab, 0.0)
    steal = None if a.steal_s is None or b.steal_s is None else max(b.steal_s - a.steal_s, 0.0)
    return HostLoad(
        seconds=dt,
        foreign_pct=100.0 * foreign / dt,
        lab_pct=100.0 * lab / dt,
        steal_pct=None if steal is None else 100.0 * steal / dt,
        cpus=b.cpus,
    )


class PollingWindow:
    """Over rates: a thread polls every `interval` seconds while the window is open, and once more
    at stop; the window is the mean of those polls. The poll made at start is not counted: a rate
    read then describes the seconds before the window."""

    def __init__(self, poll: Callable[[], CpuRates], interval: float = 2.0):
        self.poll, self.interval = poll, interval
        self.started = time.monotonic()
        self.polls: list[CpuRates] = []
        self.errors: list[str] = []
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._one()  # primes the host's rate (PVE computes it since the previous call)
        self.polls.clear()
        self._thread = threading.Thread(target=self._loop, name="lab-host-load", daemon=True)
        self._thread.start()

    def _one(self) -> None:
        try:
            rates = self.poll()
        except (LabError, OSError, KeyError, TypeError, ValueError) as exc:
            with self._lock:
                self.errors.append(str(exc))
            return
        with self._lock:
            self.polls.append(rates)

    def _loop(self) -> None:
        while not self._done.wait(self.interval):
            self._one()

    def stop(self) -> HostLoad:
        self._done.set()
        self._thread.join(timeout=self.interval + 30)
        self._one()
        seconds = time.monotonic() - self.started
        with self._lock:
            polls = list(self.polls)
        if not polls:
            why = self.errors[-1] if self.errors else "no poll answered"
            return HostLoad(seconds=seconds, unknown=f"the host's CPU could not be read: {why}")
        return mean_of(polls, seconds)


def mean_of(polls: list[CpuRates], seconds: float) -> HostLoad:
    """Pure: the mean of rate polls as one window's load."""
    n = len(polls)
    foreign = sum(max(p.busy_cores - p.lab_cores, 0.0) for p in polls) / n
    lab = sum(p.lab_cores for p in polls) / n
    steals = [p.steal_cores for p in polls if p.steal_cores is not None]
    return HostLoad(
        seconds=seconds,
        foreign_pct=100.0 * foreign,
        lab_pct=100.0 * lab,
        steal_pct=100.0 * sum(steals) / len(steals) if steals else None,
        cpus=polls[-1].cpus,
    )


# -- what is stored with a sample ---------------------------------------------------------------


def label(load: HostLoad, threshold_pct: float, *, waited_s: float = 0.0, not_quiet: str = "") -> dict[str, Any]:
    """labels[HOST_LOAD] of a repetition's samples: the figures, and `flag` (why the samples are
    kept out of medians and verdicts) when the window exceeded the threshold or the host was not
    quiet before it (`not_quiet`)."""
    out: dict[str, Any] = {"seconds": round(load.seconds, 2)}
    if load.known:
        out["foreign_pct"] = round(load.foreign_pct or 0.0, 1)
        out["lab_pct"] = round(load.lab_pct or 0.0, 1)
        if load.steal_pct is not None:
            out["steal_pct"] = round(load.steal_pct, 1)
    else:
        out["unknown"] = load.unknown
    if round(waited_s, 1) > 0:
        out["waited_s"] = round(waited_s, 1)
    flag = "; ".join(filter(None, (load.too_busy(threshold_pct), not_quiet)))
    if flag:
        out["flag"] = flag
    return out


# -- waiting for a quiet host -------------------------------------------------------------------


@dataclass(frozen=True)
class Quiet:
    """How waiting for a quiet host ended."""

    waited_s: float  # time spent waiting
    quiet: bool  # quiet for the time asked (or the host's load cannot be told: nothing to wait for)
    why: str = ""  # when not quiet: the last probe's load, in words; when unknown: why


def wait_quiet(
    open_window: Callable[[], LoadWindow],
    *,
    threshold_pct: float,
    quiet_s: float,
    timeout_s: float,
    on_wait: Callable[[str], None] = lambda _: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Quiet:
    """Probe the host in short windows until it has stayed at or below the threshold for `quiet_s`
    seconds in a row, at most `timeout_s` seconds. `on_wait(why)` after each busy probe (progress)."""
    probe_s = min(1.0, quiet_s)
    start = clock()
    quiet_for = 0.0
    last = ""
    while True:
        window = open_window()
        sleep(probe_s)
        load = window.stop()
        if not load.known:
            return Quiet(clock() - start, True, load.unknown)
        busy = load.too_busy(threshold_pct)
        if busy:
            quiet_for, last = 0.0, busy
        else:
            quiet_for += max(load.seconds, probe_s)
        waited = clock() - start
        if quiet_for >= quiet_s:
            return Quiet(waited - quiet_for if waited > quiet_for else 0.0, True)
        if waited >= timeout_s:
            return Quiet(waited, False, last or f"quiet for only {quiet_for:.0f} s")
        if busy:
            on_wait(f"{busy}; waited {waited:.0f} s of at most {timeout_s:g} s")


# -- a Linux host's /proc/stat (the local backend reads it here, libvirt over its link) --------------


@dataclass(frozen=True)
class HostCpu:
    busy_s: float  # all CPUs together: time not idle (and not stolen)
    steal_s: float | None  # time a hypervisor under the host took (None: not reported)
    cpus: int


def parse_proc_stat(text: str, ticks_per_s: float = 100.0) -> HostCpu:
    """Linux /proc/stat: the aggregate "cpu" line (user nice system idle iowait irq softirq steal
    guest guest_nice, in USER_HZ ticks; guest time is already inside user and nice) and one
    "cpuN" line per online CPU."""
    total: list[int] | None = None
    cpus = 0
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if fields[0] == "cpu":
            total = [int(f) for f in fields[1:]]
        elif re.fullmatch(r"cpu\d+", fields[0]):
            cpus += 1
    if total is None or len(total) < 4:
        raise ValueError("no aggregate cpu line in /proc/stat")
    user, nice, system, _idle = total[:4]
    irq, softirq = (total[5], total[6]) if len(total) >= 7 else (0, 0)
    steal = total[7] if len(total) >= 8 else None
    busy = user + nice + system + irq + softirq
    return HostCpu(busy_s=busy / ticks_per_s, steal_s=None if steal is None else steal / ticks_per_s, cpus=cpus or 1)


# -- this machine's processes: the lab's own work on it (the orchestrator and its children) --------


def parse_pid_stat(text: str) -> tuple[int, int]:
    """Pure: /proc/<pid>/stat -> (parent pid, utime + stime + cutime + cstime ticks). The command
    name may hold spaces and parentheses: the fields start after the last ")"."""
    rest = text[text.rindex(")") + 2 :].split()
    # rest[0] is the state, rest[1] the parent; utime, stime, cutime, cstime are fields 14-17 of stat
    return int(rest[1]), sum(int(x) for x in rest[11:15])


def lab_pids(parents: dict[int, int], roots: Iterable[int], members: Iterable[int]) -> set[int]:
    """Pure: the `roots` and `members` and every descendant of either (parents: pid -> ppid)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = [p for p in (*roots, *members) if p in parents]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, ()))
    return out


def read_processes(proc_dir: Path = Path("/proc")) -> dict[int, tuple[int, int]]:
    """pid -> (ppid, ticks) of every process (those gone meanwhile are skipped)."""
    out = {}
    for entry in proc_dir.iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = parse_pid_stat((entry / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
    return out


def tree_seconds(root: int | None = None, proc_dir: Path = Path("/proc")) -> float:
    """CPU seconds used so far by `root` (this process by default) and its descendants, reaped
    children included: the lab's load generators and ssh, when its host is this machine."""
    procs = read_processes(proc_dir)
    ours = lab_pids({pid: ppid for pid, (ppid, _) in procs.items()}, [os.getpid() if root is None else root], [])
    return sum(procs[pid][1] for pid in ours) / TICK
