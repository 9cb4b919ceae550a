"""Guest CPU utilisation around a load: every workload records it next to its own numbers.

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

Taking them: run_guest_load runs a load in the guest between two snapshots in one SSH command;
snapshot takes one on its own (around a load that runs on the client side). A workload with several
loads per repetition keeps each load's snapshots as `cpu_before.<tag>` / `cpu_after.<tag>` (see
lab.workloads.toolkit.SegmentLog); cpu_samples(raw, tags=...) reads them back.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass

from lab import osfacts
from lab.errors import LabError
from lab.guest import Machine
from lab.model import RawOutput, Sample
from lab.workloads import WorkloadContext

MARK_BEFORE = "@@lab-cpu-before@@"
MARK_LOAD = "@@lab-load@@"
MARK_AFTER = "@@lab-cpu-after@@"
_RC_RE = re.compile(r"^@@lab-rc=(-?\d+)@@$")


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
    return LabError(
        f"cpu ticks: {why}; got {first!r}",
        hint="the guest's osfacts cpu_ticks_cmd should print one line of CPU counters",
    )


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
    return CpuTicks(user=user + nice, system=system + irq + softirq, idle=idle + iowait, steal=steal, source="linux")


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
        return CpuTicks(
            user=v["user"] + v["nice"],
            system=v["sys"] + v["intr"] + v.get("spin", 0),
            idle=v["idle"],
            source="netbsd" if "spin" not in v else "openbsd",
        )
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
        raise _bad(
            text,
            f"kern.cp_time has {len(nums)} counters, expected 5 (user nice sys intr idle) "
            "or 6 (OpenBSD: user nice sys spin intr idle)",
        )
    source = "openbsd" if (comma or len(nums) == 6) else "freebsd"
    return CpuTicks(user=user + nice, system=sys_ + intr + spin, idle=idle, source=source)


def _as_ticks(x: CpuTicks | str) -> CpuTicks:
    return x if isinstance(x, CpuTicks) else parse_ticks(x)


def usage(before: CpuTicks | str, after: CpuTicks | str) -> dict[str, float]:
    """Percent of CPU time over the window: busy (everything but idle/iowait), user, sys, steal."""
    b, a = _as_ticks(before), _as_ticks(after)
    d = {k: getattr(a, k) - getattr(b, k) for k in ("user", "system", "idle", "steal")}
    if any(v < 0 for v in d.values()):
        raise LabError(
            "cpu ticks went backwards between the two snapshots "
            f"(before total {b.total}, after total {a.total}): the guest rebooted or the "
            "snapshots came from different machines"
        )
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


def cpu_samples(
    raw: RawOutput, tags: list[str] | None = None, labels: dict | None = None, tag_labels: dict[str, dict] | None = None
) -> list[Sample]:
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
            out += _usage_samples(usage(before, after), f"_{tag}", seg_labels, parse_ticks(before).source == "linux")
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
    inner = (
        f"echo {MARK_BEFORE}; {ticks_cmd}; echo {MARK_LOAD}; {load}; rc=$?; "
        f"echo {MARK_AFTER}; {ticks_cmd}; echo @@lab-rc=$rc@@; exit $rc"
    )
    return "sh -c " + shlex.quote(inner)


def split_guest_output(stdout: str, workload: str = "") -> tuple[str, str, str, int | None]:
    """guest_script's stdout -> (cpu_before, load_stdout, cpu_after, load_rc or None if cut short)."""
    lines = stdout.splitlines(keepends=True)
    idx: dict[str, int | None] = {MARK_BEFORE: None, MARK_LOAD: None, MARK_AFTER: None}
    rc: int | None = None
    for i, line in enumerate(lines):
        s = line.strip()
        if s in idx and idx[s] is None:
            idx[s] = i
        elif (m := _RC_RE.match(s)) and idx[MARK_AFTER] is not None:
            rc = int(m.group(1))
            rc_line = i
    at_before, at_load, at_after = idx[MARK_BEFORE], idx[MARK_LOAD], idx[MARK_AFTER]
    if at_before is None or at_load is None:
        first = stdout.strip().splitlines()[0] if stdout.strip() else "(no output)"
        raise LabError(
            f"{workload or 'workload'}: the guest did not run the load script "
            f"(no CPU snapshot markers); first line: {first!r}"
        )
    before = "".join(lines[at_before + 1 : at_load]).strip()
    if at_after is None:  # the load was cut short (timeout, ssh dropped)
        return before, "".join(lines[at_load + 1 :]), "", None
    load_out = "".join(lines[at_load + 1 : at_after])
    end = rc_line if rc is not None else len(lines)
    after = "".join(lines[at_after + 1 : end]).strip()
    return before, load_out, after, rc


def snapshot(guest: Machine, ticks_cmd: str, timeout: float = 30.0) -> str:
    """One CPU snapshot taken in the guest by its own SSH command (for client-side loads)."""
    return guest.run("sh -c " + shlex.quote(ticks_cmd), timeout=timeout).stdout.strip()


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

    def raw(self, workload: str, command: str, params: dict) -> RawOutput:
        """The stored raw output of a workload whose whole run was this one load."""
        return RawOutput(
            workload=workload,
            command=command,
            stdout=self.stdout,
            stderr=self.stderr,
            returncode=self.returncode,
            started=self.started,
            seconds=self.seconds,
            params=params,
            extra={"cpu_before": self.cpu_before, "cpu_after": self.cpu_after},
        )


def run_guest_load(ctx: WorkloadContext, workload: str, load: str, timeout: float, prefix: str = "") -> GuestLoad:
    """Run `load` in the guest between two CPU snapshots in one SSH command.

    `prefix` runs the whole script somewhere else in the guest: `podman run --rm IMAGE ` or
    `jexec JAIL ` puts snapshots and load inside a container or jail (the CPU counters are the
    kernel's, the same inside and out), so container start and removal stay outside the window."""
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
            "the SSH connection to the guest was lost" if res.returncode == 255 else "no error output"
        )
        raise LabError(
            f"{workload}: the load in the guest ended before its closing CPU snapshot "
            f"(ssh exit {res.returncode}: {tail})"
        )
    return GuestLoad(before, out, after, rc, res.stderr or "", started, res.seconds)
