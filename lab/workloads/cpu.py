"""Guest CPU utilisation around a load, and the plumbing every workload shares to take it.

Pure parts (tested on captured outputs):
  parse_ticks(text)          one line of cumulative CPU ticks -> CpuTicks. Understands Linux
                             `/proc/stat` ("cpu  user nice system idle iowait irq softirq steal ..."),
                             FreeBSD `sysctl [-n] kern.cp_time` ("user nice sys intr idle", spaces),
                             NetBSD (`user = N, nice = N, sys = N, intr = N, idle = N`) and OpenBSD
                             (comma separated; 6 fields "user,nice,sys,spin,intr,idle" since 6.4, 5 before).
  usage(before, after)       percentages over the window; busy_pct(before, after) the headline number.
  guest_script(...)          the one shell line a guest-side load runs in: ticks, load, ticks, with markers.
  split_guest_output(...)    that line's stdout -> (cpu_before, load stdout, cpu_after, load exit status).
  cpu_samples(raw)           RawOutput.extra -> cpu_busy_pct (+ user/sys split) samples.

Segments: a workload that runs several loads in one repetition (sysbench-cpu 1 thread and N threads,
iperf3 tx and rx, wrk with 10 and 50 connections) stores each load's output in RawOutput.stdout under
a header line `@@lab-segment <tag> rc=<status>@@`, and each load's snapshots in RawOutput.extra as
`cpu_before.<tag>` / `cpu_after.<tag>`. `cpu_before` / `cpu_after` always hold the snapshots around the
whole run (first before, last after), as every workload's RawOutput carries them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterator

from lab.errors import LabError
from lab.model import RawOutput, Sample

MARK_BEFORE = "@@lab-cpu-before@@"
MARK_LOAD = "@@lab-load@@"
MARK_AFTER = "@@lab-cpu-after@@"
_RC_RE = re.compile(r"^@@lab-rc=(-?\d+)@@$")
SEGMENT_RE = re.compile(r"^@@lab-segment (?P<tag>[A-Za-z0-9_.-]+) rc=(?P<rc>-?\d+)@@$")


@dataclass(frozen=True)
class CpuTicks:
    """Cumulative CPU time counters (ticks, summed over all CPUs)."""

    user: int = 0  # user + nice
    system: int = 0  # kernel: system, irq, softirq (Linux); sys, intr, spin (BSD)
    idle: int = 0  # idle + iowait
    steal: int = 0  # Linux only: time the hypervisor ran something else
    source: str = ""  # "linux" | "freebsd" | "netbsd" | "openbsd"

    @property
    def total(self) -> int:
        return self.user + self.system + self.idle + self.steal


def _bad(text: str, why: str) -> LabError:
    first = (text or "").strip().splitlines()[0] if (text or "").strip() else "(empty)"
    return LabError(f"cpu ticks: {why}; got {first!r}",
                    hint="the guest's osfacts cpu_ticks_cmd should print one line of CPU counters")


def parse_ticks(text: str) -> CpuTicks:
    """Parse one snapshot of cumulative CPU ticks, whatever OS printed it."""
    line = ""
    for candidate in (text or "").splitlines():
        if candidate.strip():
            line = candidate.strip()
            break
    if not line:
        raise _bad(text, "no output")
    if line.startswith("cpu ") or line.startswith("cpu\t"):
        return parse_proc_stat(line)
    return parse_cp_time(line)


def parse_proc_stat(text: str) -> CpuTicks:
    """Linux /proc/stat aggregate line: cpu user nice system idle iowait irq softirq steal guest guest_nice.

    guest/guest_nice are already included in user/nice, so they are not added again."""
    fields = text.split()
    if not fields or fields[0] != "cpu":
        raise _bad(text, "not a /proc/stat 'cpu' line")
    try:
        nums = [int(f) for f in fields[1:]]
    except ValueError:
        raise _bad(text, "non-numeric /proc/stat field") from None
    if len(nums) < 4:
        raise _bad(text, f"/proc/stat line has {len(nums)} counters, need at least 4")
    nums += [0] * (8 - len(nums))
    user, nice, system, idle, iowait, irq, softirq, steal = nums[:8]
    return CpuTicks(user=user + nice, system=system + irq + softirq, idle=idle + iowait, steal=steal,
                    source="linux")


_NETBSD_RE = re.compile(r"(user|nice|sys|spin|intr|idle)\s*=\s*(\d+)")


def parse_cp_time(text: str) -> CpuTicks:
    """BSD kern.cp_time, with or without the `kern.cp_time:` / `kern.cp_time=` prefix."""
    line = text.strip().splitlines()[0].strip() if text.strip() else ""
    named = dict(_NETBSD_RE.findall(line))
    if named:  # NetBSD: "user = 1, nice = 2, sys = 3, intr = 4, idle = 5" (OpenBSD may name them too)
        missing = {"user", "nice", "sys", "intr", "idle"} - set(named)
        if missing:
            raise _bad(text, f"kern.cp_time lacks {', '.join(sorted(missing))}")
        v = {k: int(x) for k, x in named.items()}
        return CpuTicks(user=v["user"] + v["nice"], system=v["sys"] + v["intr"] + v.get("spin", 0),
                        idle=v["idle"], source="netbsd" if "spin" not in v else "openbsd")
    if line.startswith("kern.cp_time"):
        line = re.sub(r"^kern\.cp_time\s*[:=]\s*", "", line)
    comma = "," in line
    parts = [p for p in re.split(r"[,\s]+", line) if p]
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise _bad(text, "not a kern.cp_time value") from None
    if len(nums) == 5:  # user nice sys intr idle (FreeBSD, NetBSD -n, OpenBSD < 6.4)
        user, nice, sys_, intr, idle = nums
        spin = 0
    elif len(nums) == 6:  # OpenBSD >= 6.4: user nice sys spin intr idle
        user, nice, sys_, spin, intr, idle = nums
    else:
        raise _bad(text, f"kern.cp_time has {len(nums)} counters, expected 5 (user nice sys intr idle) "
                         "or 6 (OpenBSD: user nice sys spin intr idle)")
    source = "openbsd" if (comma or len(nums) == 6) else "freebsd"
    return CpuTicks(user=user + nice, system=sys_ + intr + spin, idle=idle, source=source)


def _as_ticks(x: CpuTicks | str) -> CpuTicks:
    return x if isinstance(x, CpuTicks) else parse_ticks(x)


def usage(before: CpuTicks | str, after: CpuTicks | str) -> dict[str, float]:
    """Percent of CPU time over the window: busy (everything but idle/iowait), user, sys, steal."""
    b, a = _as_ticks(before), _as_ticks(after)
    d = {k: getattr(a, k) - getattr(b, k) for k in ("user", "system", "idle", "steal")}
    if any(v < 0 for v in d.values()):
        raise LabError("cpu ticks went backwards between the two snapshots "
                       f"(before total {b.total}, after total {a.total}): the guest rebooted or the "
                       "snapshots came from different machines")
    total = sum(d.values())
    if total <= 0:
        raise LabError("cpu ticks did not advance between the two snapshots; the load took no measurable time")
    return {
        "busy_pct": 100.0 * (total - d["idle"]) / total,
        "user_pct": 100.0 * d["user"] / total,
        "sys_pct": 100.0 * d["system"] / total,
        "steal_pct": 100.0 * d["steal"] / total,
    }


def busy_pct(before: CpuTicks | str, after: CpuTicks | str) -> float:
    """Guest CPU busy percent (all CPUs together: 50 = one of two vCPUs saturated)."""
    return usage(before, after)["busy_pct"]


def _sum_usage(pairs: list[tuple[str, str]]) -> dict[str, float]:
    """Tick-weighted usage over several windows (the gaps between them are left out)."""
    acc = {"user": 0, "system": 0, "idle": 0, "steal": 0}
    for before, after in pairs:
        b, a = parse_ticks(before), parse_ticks(after)
        usage(b, a)  # raises if the counters went backwards or did not move
        for k in acc:
            acc[k] += getattr(a, k) - getattr(b, k)
    total = sum(acc.values())
    return {
        "busy_pct": 100.0 * (total - acc["idle"]) / total,
        "user_pct": 100.0 * acc["user"] / total,
        "sys_pct": 100.0 * acc["system"] / total,
        "steal_pct": 100.0 * acc["steal"] / total,
    }


def _usage_samples(u: dict[str, float], suffix: str, labels: dict, linux: bool) -> list[Sample]:
    out = [
        Sample(f"cpu_busy_pct{suffix}", u["busy_pct"], "%", False, dict(labels)),
        Sample(f"cpu_user_pct{suffix}", u["user_pct"], "%", None, dict(labels)),
        Sample(f"cpu_sys_pct{suffix}", u["sys_pct"], "%", None, dict(labels)),
    ]
    if linux:
        out.append(Sample(f"cpu_steal_pct{suffix}", u["steal_pct"], "%", None, dict(labels)))
    return out


def cpu_samples(raw: RawOutput, tags: list[str] | None = None, labels: dict | None = None,
                tag_labels: dict[str, dict] | None = None) -> list[Sample]:
    """Samples from the CPU snapshots in raw.extra.

    Without tags: cpu_busy_pct etc. from cpu_before/cpu_after. With tags: cpu_busy_pct_<tag> per
    segment from cpu_before.<tag>/cpu_after.<tag>, and cpu_busy_pct over all segments (tick-weighted,
    so the pauses between segments do not count)."""
    labels = dict(labels or {})
    extra = raw.extra or {}
    where = f"{raw.workload}: "
    try:
        if not tags:
            before, after = extra.get("cpu_before"), extra.get("cpu_after")
            if before is None or after is None:
                raise LabError("no cpu_before/cpu_after snapshot in the raw output's extra")
            linux = parse_ticks(before).source == "linux"
            return _usage_samples(usage(before, after), "", labels, linux)
        pairs, out = [], []
        for tag in tags:
            before, after = extra.get(f"cpu_before.{tag}"), extra.get(f"cpu_after.{tag}")
            if before is None or after is None:
                raise LabError(f"no cpu_before.{tag}/cpu_after.{tag} snapshot in the raw output's extra")
            pairs.append((before, after))
            seg_labels = dict((tag_labels or {}).get(tag, labels))  # a segment's own labels, else the run's
            out += _usage_samples(usage(before, after), f"_{tag}", seg_labels,
                                  parse_ticks(before).source == "linux")
        linux = parse_ticks(pairs[0][0]).source == "linux"
        return _usage_samples(_sum_usage(pairs), "", labels, linux) + out
    except LabError as exc:
        raise LabError(where + exc.message, exc.hint) from None


# ---------------------------------------------------------------------------------------------
# Running a load between two snapshots


def guest_script(load: str, ticks_cmd: str) -> str:
    """One command line for Guest.run: snapshot, load, snapshot, with markers, run by /bin/sh so it
    does not matter whether root's login shell is sh, ksh or csh. The load's stderr is merged into
    the stream between the markers only if the load itself asks for it."""
    inner = (f"echo {MARK_BEFORE}; {ticks_cmd}; echo {MARK_LOAD}; {load}; rc=$?; "
             f"echo {MARK_AFTER}; {ticks_cmd}; echo @@lab-rc=$rc@@; exit $rc")
    return "sh -c " + shlex.quote(inner)


def split_guest_output(stdout: str, workload: str = "") -> tuple[str, str, str, int | None]:
    """guest_script's stdout -> (cpu_before, load_stdout, cpu_after, load_rc or None if cut short)."""
    lines = stdout.splitlines(keepends=True)
    idx = {MARK_BEFORE: None, MARK_LOAD: None, MARK_AFTER: None}
    rc: int | None = None
    for i, line in enumerate(lines):
        s = line.strip()
        if s in idx and idx[s] is None:
            idx[s] = i
        elif (m := _RC_RE.match(s)) and idx[MARK_AFTER] is not None:
            rc = int(m.group(1))
            rc_line = i
    if idx[MARK_BEFORE] is None or idx[MARK_LOAD] is None:
        first = stdout.strip().splitlines()[0] if stdout.strip() else "(no output)"
        raise LabError(f"{workload or 'workload'}: the guest did not run the load script "
                       f"(no CPU snapshot markers); first line: {first!r}")
    before = "".join(lines[idx[MARK_BEFORE] + 1: idx[MARK_LOAD]]).strip()
    if idx[MARK_AFTER] is None:  # the load was cut short (timeout, ssh dropped)
        return before, "".join(lines[idx[MARK_LOAD] + 1:]), "", None
    load_out = "".join(lines[idx[MARK_LOAD] + 1: idx[MARK_AFTER]])
    end = rc_line if rc is not None else len(lines)
    after = "".join(lines[idx[MARK_AFTER] + 1: end]).strip()
    return before, load_out, after, rc


def snapshot(guest, ticks_cmd: str, timeout: float = 30.0) -> str:
    """One CPU snapshot taken in the guest by its own SSH command (for client-side loads)."""
    return guest.run("sh -c " + shlex.quote(ticks_cmd), timeout=timeout).stdout.strip()


# ---------------------------------------------------------------------------------------------
# Segments: several loads in one RawOutput


def join_segments(segments: list[tuple[str, int, str]]) -> str:
    """[(tag, rc, output)] -> stdout with a header line before each segment's output."""
    parts = []
    for tag, rc, text in segments:
        if not SEGMENT_RE.match(f"@@lab-segment {tag} rc={rc}@@"):
            raise ValueError(f"bad segment tag {tag!r}")
        if text and not text.endswith("\n"):
            text += "\n"
        parts.append(f"@@lab-segment {tag} rc={rc}@@\n{text}")
    return "".join(parts)


def split_segments(stdout: str) -> list[tuple[str, int, str]]:
    """Inverse of join_segments. Output without any header is one segment with tag ''."""
    segs: list[tuple[str, int, str]] = []
    tag, rc, buf = None, 0, []
    for line in stdout.splitlines(keepends=True):
        m = SEGMENT_RE.match(line.strip())
        if m:
            if tag is not None:
                segs.append((tag, rc, "".join(buf)))
            tag, rc, buf = m.group("tag"), int(m.group("rc")), []
        else:
            buf.append(line)
    if tag is None:
        return [("", 0, stdout)]
    segs.append((tag, rc, "".join(buf)))
    return segs


def with_run_context(exc: LabError, tool: str, rc: int, stderr: str) -> LabError:
    """A parse error, completed with the exit status and stderr of the run (when there are any)."""
    msg = exc.message
    if rc:
        msg += f" ({tool} exit status {rc})"
    if stderr and stderr.strip():
        msg += f"; stderr: {first_line(stderr)!r}"
    return LabError(msg, exc.hint)


def first_line(text: str) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:200]
    return "(no output)"


# ---------------------------------------------------------------------------------------------
# Helpers the workload modules share


def effective_params(defaults: dict, given: dict | None) -> dict:
    """Defaults overridden by [suite.params.<workload>] (unknown keys were refused by lab.config)."""
    out = dict(defaults)
    out.update(given or {})
    return out


def tool_check_command(tool: str, also_in: tuple[str, ...] = ()) -> str:
    """`command -v tool`, then (for daemons in sbin directories a non-login PATH may lack) the
    executable in each of `also_in`; prints where it was found, exits 1 when nowhere."""
    script = f"command -v {shlex.quote(tool)}"
    if also_in:
        dirs = " ".join(shlex.quote(d) for d in also_in)
        script += (f" || {{ for d in {dirs}; do if [ -x \"$d/{tool}\" ]; then echo \"$d/{tool}\"; exit 0; fi; "
                   "done; exit 1; }")
    return "sh -c " + shlex.quote(script)


def require_guest_tool(ctx, tool: str, workload: str, also_in: tuple[str, ...] = ()) -> None:
    """Fail early, with the package to add, when a tool is missing in the guest."""
    from lab import osfacts

    res = ctx.guest.run(tool_check_command(tool, also_in), timeout=30, check=False)
    if res.returncode != 0 or not res.stdout.strip():
        pkg = osfacts.facts(ctx.os).packages.get(tool, tool)
        raise LabError(f"{workload}: {tool} is not installed in the guest ({ctx.os})",
                       hint=f"add the package {pkg!r} to the {ctx.os} golden image (packer/) and rebuild it")


def choices(workload: str, key: str, value, allowed: tuple[str, ...]) -> list[str]:
    """A list parameter whose entries come from `allowed`, each once (a scalar is a list of one)."""
    from lab.errors import UsageError

    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items or len(set(items)) != len(items) or any(x not in allowed for x in items):
        raise UsageError(f"{workload}: {key} must list distinct entries of {', '.join(allowed)}, got {value!r}")
    return items


def int_param(workload: str, key: str, value, low: int, high: int) -> int:
    """An integer parameter in low..high (booleans are not integers here)."""
    from lab.errors import UsageError

    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{workload}: {key} must be an integer {low}..{high}, got {value!r}")
    return value


@dataclass
class SegmentLog:
    """Collects a run's segments (one load each) into the RawOutput every workload returns: the
    outputs under segment headers, the CPU snapshots per segment and around the whole run."""

    workload: str
    segments: list[tuple[str, int, str]] = field(default_factory=list)
    extra: dict[str, str] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    started: float = 0.0
    seconds: float = 0.0

    def add(self, tag: str, rc: int, text: str, cpu_before: str, cpu_after: str, *, started: float,
            seconds: float, command: str, stderr: str = "") -> None:
        self.segments.append((tag, rc, text))
        self.extra[f"cpu_before.{tag}"], self.extra[f"cpu_after.{tag}"] = cpu_before, cpu_after
        self.extra.setdefault("cpu_before", cpu_before)
        self.extra["cpu_after"] = cpu_after
        self.started = self.started or started
        self.seconds += seconds
        self.commands.append(command)
        self.stderr.append(stderr)

    def add_load(self, tag: str, r: "GuestLoad", command: str) -> None:
        self.add(tag, r.returncode, r.stdout, r.cpu_before, r.cpu_after, started=r.started, seconds=r.seconds,
                 command=command, stderr=r.stderr)

    def raw(self, params: dict) -> RawOutput:
        rc_all = next((rc for _, rc, _ in self.segments if rc != 0), 0)
        return RawOutput(workload=self.workload, command=" ; ".join(self.commands),
                         stdout=join_segments(self.segments), stderr="".join(self.stderr), returncode=rc_all,
                         started=self.started, seconds=self.seconds, params=params, extra=self.extra)


@dataclass(frozen=True)
class GuestLoad:
    """What one load run between two CPU snapshots in the guest produced."""

    cpu_before: str
    stdout: str
    cpu_after: str
    returncode: int
    stderr: str
    started: float
    seconds: float


def run_guest_load(ctx, workload: str, load: str, timeout: float, prefix: str = "") -> GuestLoad:
    """Run `load` in the guest between two CPU snapshots in one SSH command.

    `prefix` runs the whole script somewhere else in the guest: `podman run --rm IMAGE ` or
    `jexec JAIL ` puts snapshots and load inside a container or jail (the CPU counters are the
    kernel's, the same inside and out), so container start and removal stay outside the window."""
    import time

    from lab import osfacts

    ticks_cmd = osfacts.facts(ctx.os).cpu_ticks_cmd
    started = time.time()
    res = ctx.guest.run(prefix + guest_script(load, ticks_cmd), timeout=timeout, check=False)
    try:
        before, out, after, rc = split_guest_output(res.stdout, workload)
    except LabError:
        if res.returncode != 255:  # the guest's own fault; a lost connection is said below
            raise
        rc = None
    if rc is None:
        tail = " | ".join((res.stderr or "").strip().splitlines()[-3:]) or (
            "the SSH connection to the guest was lost" if res.returncode == 255 else "no error output")
        raise LabError(f"{workload}: the load in the guest ended before its closing CPU snapshot "
                       f"(ssh exit {res.returncode}: {tail})")
    return GuestLoad(before, out, after, rc, res.stderr or "", started, res.seconds)


# ---------------------------------------------------------------------------------------------
# A server on the client side for the length of one load (iperf3 -s, git daemon)


@dataclass(frozen=True)
class ClientServer:
    process: subprocess.Popen
    log: Callable[[], str]  # its output so far


@contextlib.contextmanager
def client_server(ctx, argv: list[str], *, ready: str, what: str, hint: str = "",
                  timeout: float = 15.0) -> Iterator[ClientServer]:
    """Run `argv` on the client side (ctx.client.argv: the run's network namespace) while the block
    runs: in its own session, ready once `ready` appears in its output (read from a log file, so
    the server's port is never touched to test it), and at the end its whole process group is
    stopped (servers that fork per connection, like git daemon, leave nothing behind)."""
    from lab import proc
    from lab.wait import wait_until

    fd, log_path = tempfile.mkstemp(prefix="lab-server-", suffix=".log")
    os.close(fd)
    server: subprocess.Popen | None = None

    def log_text() -> str:
        with open(log_path, errors="replace") as f:
            return f.read()

    try:
        with open(log_path, "w") as log:
            server = proc.spawn(ctx.client.argv(argv), stdout=log, stderr=subprocess.STDOUT)

        def listening() -> bool:
            text = log_text()
            if ready in text:
                return True
            if server.poll() is not None:
                raise LabError(f"{what} exited with status {server.returncode}: {first_line(text)}",
                               hint=hint or None)
            return False

        wait_until(listening, timeout=timeout, what=what, detail=lambda: first_line(log_text()))
        yield ClientServer(server, log_text)
    finally:
        if server is not None and server.poll() is None:
            try:
                os.killpg(server.pid, signal.SIGTERM)  # its own session: only this server
                server.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait(timeout=5)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        os.unlink(log_path)
