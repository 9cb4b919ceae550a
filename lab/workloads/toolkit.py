"""What every workload is built from, besides the CPU snapshots (lab.workloads.cpu): parameters,
segments, flagged rows, the guest tool check, and a server on the client side for the length of one load.

Segments: a workload that runs several loads in one repetition (sysbench-cpu 1 thread and N threads,
iperf3 tx and rx, wrk with 10 and 50 connections) stores each load's output in RawOutput.stdout under
a header line `@@lab-segment <tag> rc=<status>@@`, and each load's snapshots in RawOutput.extra as
`cpu_before.<tag>` / `cpu_after.<tag>`. `cpu_before` / `cpu_after` always hold the snapshots around the
whole run (first before, last after), as every workload's RawOutput carries them. SegmentLog collects
all of that while a workload runs.

Flagged rows: a parser never makes up a value the tool did not measure (0 events/s when sysbench
completed no event, 0 ms latencies when wrk recorded none, 0.0 for the stddev hyperfine reports as
null). The pure parsers leave such a value out and say why (the `UNMEASURED` key of their result);
`segment_samples` puts an `unmeasured_<tag>` row where the values would be (value 1, unit "flagged",
the missing metrics and the reason in its labels). A load that failed or measured nothing has every
sample flagged (`flag(labels, why)`: labels `flagged=1`, `flagged_why`), and so do the repetition's
overall samples (`flag_run`): they are stored and shown, and must never be averaged in. A value that
is only undefined (the stddev of one run) flags its own row, not the load.
"""

from __future__ import annotations

import abc
import contextlib
import os
import re
import shlex
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from lab import osfacts, proc
from lab.errors import LabError, UsageError
from lab.model import RawOutput, Sample
from lab.wait import wait_until
from lab.workloads import Workload, WorkloadContext
from lab.workloads.cpu import GuestLoad, run_guest_load

SEGMENT_RE = re.compile(r"^@@lab-segment (?P<tag>[A-Za-z0-9_.-]+) rc=(?P<rc>-?\d+)@@$")


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
    tag, rc, buf = None, 0, list[str]()
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

    def add(
        self,
        tag: str,
        rc: int,
        text: str,
        cpu_before: str,
        cpu_after: str,
        *,
        started: float,
        seconds: float,
        command: str,
        stderr: str = "",
    ) -> None:
        self.segments.append((tag, rc, text))
        self.extra[f"cpu_before.{tag}"], self.extra[f"cpu_after.{tag}"] = cpu_before, cpu_after
        self.extra.setdefault("cpu_before", cpu_before)
        self.extra["cpu_after"] = cpu_after
        self.started = self.started or started
        self.seconds += seconds
        self.commands.append(command)
        self.stderr.append(stderr)

    def add_load(self, tag: str, r: GuestLoad, command: str) -> None:
        self.add(
            tag,
            r.returncode,
            r.stdout,
            r.cpu_before,
            r.cpu_after,
            started=r.started,
            seconds=r.seconds,
            command=command,
            stderr=r.stderr,
        )

    def raw(self, params: dict) -> RawOutput:
        rc_all = next((rc for _, rc, _ in self.segments if rc != 0), 0)
        return RawOutput(
            workload=self.workload,
            command=" ; ".join(self.commands),
            stdout=join_segments(self.segments),
            stderr="".join(self.stderr),
            returncode=rc_all,
            started=self.started,
            seconds=self.seconds,
            params=params,
            extra=self.extra,
        )


# ---------------------------------------------------------------------------------------------
# Flagged rows: what a load did not measure

FLAGGED = "flagged"  # label: 1 on every sample of a load that failed in part or measured nothing
FLAGGED_WHY = "flagged_why"  # label: why, in words
UNMEASURED = "unmeasured"  # key of a pure parser's result: why it left values out; also the row's name
UNMEASURED_UNIT = "flagged"  # the unit of that row (value 1), as "n/a" is the unit of an na_<variant> row
# What a pure parser returns: metric key -> value (float), and UNMEASURED -> why it left some out (str)
Parsed = dict[str, Any]


def flag(labels: dict, *reasons: str) -> dict:
    """A copy of `labels` marking its sample flagged for each reason given ("" is no reason: a
    copy of `labels` as they are), the reasons added to any earlier ones."""
    given = [r for r in reasons if r]
    if not given:
        return dict(labels)
    known = [r for r in (labels.get(FLAGGED_WHY) or "").split("; ") if r]
    return {**labels, FLAGGED: 1, FLAGGED_WHY: "; ".join(dict.fromkeys(known + given))}


def flag_run(run_labels: dict, tag: str, segment_labels: dict) -> dict:
    """The labels of a repetition's overall samples: flagged when one of its segments is."""
    return flag(run_labels, f"{tag}: {segment_labels[FLAGGED_WHY]}" if segment_labels.get(FLAGGED) else "")


def unmeasured(tag: str, metrics: list[str], why: str, labels: dict) -> Sample:
    """The row that stands where `metrics` would be when the tool measured none of them: value 1,
    flagged, the reason and the missing metrics in its labels. Never a zero in their place."""
    return Sample(
        f"{UNMEASURED}_{tag}" if tag else UNMEASURED,
        1.0,
        UNMEASURED_UNIT,
        None,
        {**flag(labels, why), UNMEASURED: " ".join(metrics)},
    )


def segment_samples(tag: str, r: dict, rows: Sequence[tuple[str, str, str, bool | None]], labels: dict) -> list[Sample]:
    """One load's samples: a Sample per row (metric, key in the parser's result `r`, unit,
    higher_is_better) whose key the parser found, and the `unmeasured` row for those it left out."""
    out = [Sample(metric, r[key], unit, better, dict(labels)) for metric, key, unit, better in rows if key in r]
    missing = [metric for metric, key, *_ in rows if key not in r]
    if missing and UNMEASURED in r:
        out.append(unmeasured(tag, missing, r[UNMEASURED], labels))
    return out


def exit_status_problem(tool: str, rc: int) -> str:
    """Why a load whose output still parsed is flagged: the tool said it failed ("" when it did not)."""
    return f"{tool} exited with status {rc}" if rc else ""


# ---------------------------------------------------------------------------------------------
# Parameters ([suite.params.<workload>] over the workload's defaults)


def as_list(value) -> list:
    """A parameter that takes one value or a list of them (directions, threads, connections): a
    scalar is a list of one. Its length is how many runs a repetition makes (estimate_seconds)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


# Around a repetition's runs: SSH, the tools' start and exit, parsing and storing. Measured in the
# default lab under TCG: 11.1 s for iperf3's 2 x 5 s and sysbench's 2 x 5 s, 5.7 s for wrk's 5 s.
RUN_OVERHEAD_S = 1.0


def effective_params(defaults: dict, given: dict | None) -> dict:
    """Defaults overridden by [suite.params.<workload>] (unknown keys were refused by lab.config)."""
    out = dict(defaults)
    out.update(given or {})
    return out


def choices(workload: str, key: str, value, allowed: tuple[str, ...]) -> list[str]:
    """A list parameter whose entries come from `allowed`, each once (a scalar is a list of one)."""
    items = as_list(value)
    if not items or len(set(items)) != len(items) or any(x not in allowed for x in items):
        raise UsageError(f"{workload}: {key} must list distinct entries of {', '.join(allowed)}, got {value!r}")
    return items


def int_param(workload: str, key: str, value, low: int, high: int) -> int:
    """An integer parameter in low..high (booleans are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{workload}: {key} must be an integer {low}..{high}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# The guest's tools


def tool_check_command(tool: str, also_in: tuple[str, ...] = ()) -> str:
    """`command -v tool`, then (for daemons in sbin directories a non-login PATH may lack) the
    executable in each of `also_in`; prints where it was found, exits 1 when nowhere."""
    script = f"command -v {shlex.quote(tool)}"
    if also_in:
        dirs = " ".join(shlex.quote(d) for d in also_in)
        script += (
            f' || {{ for d in {dirs}; do if [ -x "$d/{tool}" ]; then echo "$d/{tool}"; exit 0; fi; done; exit 1; }}'
        )
    return "sh -c " + shlex.quote(script)


# a load generator missing on the client side: this machine's packages, or a client VM's image
CLIENT_TOOL_HINT = "run `make setup` (this machine), or `lab images build` (a client VM's golden image)"


def require_tools(ctx: WorkloadContext, workload: Workload) -> None:
    """Each tool the workload's traits name, in the guest (require_guest_tool)."""
    for tool in workload.traits.tools:
        require_guest_tool(ctx, tool, workload.name)


def require_guest_tool(ctx: WorkloadContext, tool: str, workload: str) -> None:
    """Fail early, with the package to add, when a tool is missing in the guest (looked for where
    lab.osfacts.TOOLS says it may be, too)."""
    also_in = osfacts.TOOLS[tool].dirs if tool in osfacts.TOOLS else ()
    res = ctx.guest.run(tool_check_command(tool, also_in), timeout=30, check=False)
    if res.returncode != 0 or not res.stdout.strip():
        pkg = osfacts.package(ctx.os, tool)
        raise LabError(
            f"{workload}: {tool} is not installed in the guest ({ctx.os})",
            hint=f"add the package {pkg!r} to the {ctx.os} golden image (packer/) and rebuild it",
        )


# ---------------------------------------------------------------------------------------------
# A repetition that is one command line in the guest


class GuestCommand(Workload):
    """A workload whose repetition is one command line run in the guest between two CPU snapshots
    (sysbench-memory, idle, ping): it says the command and how long it may take; its prepare checks
    the parameters and the tools its traits name."""

    @abc.abstractmethod
    def command(self, ctx: WorkloadContext) -> str: ...

    @abc.abstractmethod
    def timeout(self, params: dict[str, Any]) -> float:
        """Seconds the command may take before it fails."""

    def recorded(self, ctx: WorkloadContext) -> dict[str, Any]:
        """What the raw output's params carry besides the parameters, the vCPUs and the repetition."""
        return {}

    def prepare(self, ctx: WorkloadContext) -> None:
        self.params(ctx)
        require_tools(ctx, self)

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput:
        p = self.params(ctx)
        cmd = self.command(ctx)
        r = run_guest_load(ctx, self.name, cmd, timeout=self.timeout(p))
        return r.raw(self.name, cmd, {**p, "vcpus": ctx.vcpus, "repetition": repetition, **self.recorded(ctx)})


# ---------------------------------------------------------------------------------------------
# Error messages


def first_line(text: str) -> str:
    """The first non-blank line of `text` (200 characters at most), for an error message."""
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:200]
    return "(no output)"


def with_run_context(exc: LabError, tool: str, rc: int, stderr: str) -> LabError:
    """A parse error, completed with the exit status and stderr of the run (when there are any)."""
    msg = exc.message
    if rc:
        msg += f" ({tool} exit status {rc})"
    if stderr and stderr.strip():
        msg += f"; stderr: {first_line(stderr)!r}"
    return LabError(msg, exc.hint)


# ---------------------------------------------------------------------------------------------
# A server on the client side for the length of one load (iperf3 -s, git daemon)


@dataclass(frozen=True)
class ClientServer:
    process: subprocess.Popen
    log: Callable[[], str]  # its output so far


@contextlib.contextmanager
def client_server(
    ctx: WorkloadContext, argv: list[str], *, ready: str, what: str, hint: str = "", timeout: float = 15.0
) -> Iterator[ClientServer]:
    """Run `argv` on the client side (ctx.client.argv: the run's network namespace) while the block
    runs: in its own session, ready once `ready` appears in its output (read from a log file, so
    the server's port is never touched to test it), and at the end its whole process group is
    stopped (servers that fork per connection, like git daemon, leave nothing behind)."""
    fd, log_path = tempfile.mkstemp(prefix="lab-server-", suffix=".log")
    os.close(fd)
    server: subprocess.Popen | None = None

    def log_text() -> str:
        return proc.read_bounded(log_path)  # a server that prints without end fills no memory

    try:
        with open(log_path, "w") as log:
            server = proc.spawn(ctx.client.server_argv(argv), stdout=log, stderr=subprocess.STDOUT)

        def listening() -> bool:
            text = log_text()
            if ready in text:
                return True
            if server.poll() is not None:
                raise LabError(f"{what} exited with status {server.returncode}: {first_line(text)}", hint=hint or None)
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
