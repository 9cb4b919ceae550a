"""sysbench-cpu and sysbench-memory: run in the guest, between two CPU snapshots, in one SSH command.

Parsers understand sysbench 1.0.x as Debian and the BSD ports build it (the output differs only in
the banner), 1.1.x builds that print no "CPU speed:" block (events/s is then total events / total
time) and the old 0.4.x format ("per-request statistics", "approx.  95 percentile", "MB/sec").
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from lab.errors import LabError, UsageError
from lab.model import RawOutput, Sample
from lab.workloads import Param, PrimaryMetrics, Traits, Workload, WorkloadContext, register
from lab.workloads.cpu import cpu_samples, run_guest_load
from lab.workloads.toolkit import (
    RUN_OVERHEAD_S,
    UNMEASURED,
    GuestCommand,
    Parsed,
    SegmentLog,
    as_list,
    effective_params,
    exit_status_problem,
    first_line,
    flag,
    flag_run,
    require_tools,
    segment_samples,
    split_segments,
    with_run_context,
)

_NUM = r"([0-9]+(?:\.[0-9]+)?)"


def _find(pattern: str, text: str) -> str | None:
    m = re.search(pattern, text, re.MULTILINE)
    return m.group(1) if m else None


def _fail(workload: str, text: str, why: str) -> LabError:
    fatal = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("FATAL")), None)
    shown = fatal or first_line(text)
    return LabError(
        f"{workload}: {why}; first line of output: {shown!r}",
        hint="the raw output is stored; fix the parser and run `lab reparse`",
    )


def _common(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    if (v := _find(r"^\s*total time:\s*" + _NUM + r"s", text)) is not None:
        out["total_time_s"] = float(v)
    if (v := _find(r"^\s*total number of events:\s*" + _NUM, text)) is not None:
        out["total_events"] = float(v)
    if (v := _find(r"^Number of threads:\s*(\d+)", text)) is not None:
        out["threads"] = float(v)
    # 1.x: "Latency (ms):" block with bare numbers; 0.4: "per-request statistics:" with "ms" suffixes
    if (v := _find(r"^\s*avg:\s*" + _NUM + r"(?:ms)?\s*$", text)) is not None:
        out["latency_avg_ms"] = float(v)
    if (v := _find(r"^\s*(?:95th percentile|approx\.\s+95 percentile):\s*" + _NUM + r"(?:ms)?\s*$", text)) is not None:
        out["latency_p95_ms"] = float(v)
    return out


def _nothing_measured(out: dict, what: str) -> dict:
    """`out` without the latencies sysbench prints as 0.00 when nothing ran, and with the reason."""
    for key in ("latency_avg_ms", "latency_p95_ms"):
        out.pop(key, None)
    out[UNMEASURED] = f"sysbench {what}" + (f" in {out['total_time_s']:g} s" if "total_time_s" in out else "")
    return out


def parse_cpu_output(text: str, workload: str = "sysbench-cpu") -> Parsed:
    """`sysbench cpu run` output -> events_per_s, latency_avg_ms, latency_p95_ms, total_time_s, ...

    A run that completed no event (a rate limit, a time too short for one event) measured no rate and
    no latency: sysbench prints 0.00 for both, which are left out, with the reason under UNMEASURED."""
    if not text or not text.strip():
        raise _fail(workload, text, "sysbench printed nothing")
    out: dict = _common(text)
    eps = _find(r"events per second:\s*" + _NUM, text)
    if eps is None and not (out.get("total_time_s") and "total_events" in out):
        raise _fail(workload, text, "no 'events per second' and no total events/time in sysbench cpu output")
    if out.get("total_events") == 0 or (eps is not None and float(eps) == 0 and "total_events" not in out):
        return _nothing_measured(out, "completed no event")
    if eps is not None and float(eps) > 0:
        out["events_per_s"] = float(eps)
    else:  # 1.1 builds / 0.4 print no "CPU speed:" block; 1.0 prints 0.00 below 0.005 events/s
        out["events_per_s"] = out["total_events"] / out["total_time_s"]
    if "latency_avg_ms" not in out or "latency_p95_ms" not in out:
        raise _fail(workload, text, "no latency avg/95th percentile in sysbench cpu output")
    return out


def parse_memory_output(text: str, workload: str = "sysbench-memory") -> Parsed:
    """`sysbench memory run` output -> mib_per_s, operations_per_s, total_time_s, ...

    sysbench 0.4 says "MB" but means 2^20 bytes (it divides by 1024*1024), so it is MiB too. A run of
    no operation (a total size below one block) measured no rate: its 0.00 MiB/sec is left out, with
    the reason under UNMEASURED."""
    if not text or not text.strip():
        raise _fail(workload, text, "sysbench printed nothing")
    out: dict = _common(text)
    m = re.search(_NUM + r"\s+Mi?B transferred \(\s*" + _NUM + r"\s+Mi?B/sec\)", text)
    if not m:
        raise _fail(workload, text, "no 'MiB transferred (... MiB/sec)' line in sysbench memory output")
    out["mib_transferred"] = float(m.group(1))
    ops = re.search(
        r"(?:Total operations|Operations performed):\s*(\d+)\s*\(\s*" + _NUM + r"\s*(?:per second|ops/sec)\)", text
    )
    if ops:
        out["operations"] = float(ops.group(1))
    if out.get("operations", out["mib_transferred"]) == 0:
        return _nothing_measured(out, "did no memory operation")
    out["mib_per_s"] = float(m.group(2))
    if ops:
        out["operations_per_s"] = float(ops.group(2))
    return out


# ---------------------------------------------------------------------------------------------
# Commands (pure)


def cpu_command(threads: int, time_s: int, max_prime: int = 20000) -> str:
    return shlex.join(
        ["sysbench", "cpu", f"--cpu-max-prime={max_prime}", f"--threads={threads}", f"--time={time_s}", "run"]
    )


def memory_command(block_size: str, operation: str, time_s: int, threads: int = 1) -> str:
    # --memory-total-size=0: no byte limit, so --time alone ends the run (the default 100G would
    # end a fast host's run early and make runs of different lengths).
    return shlex.join(
        [
            "sysbench",
            "memory",
            f"--memory-block-size={block_size}",
            f"--memory-oper={operation}",
            "--memory-total-size=0",
            f"--threads={threads}",
            f"--time={time_s}",
            "run",
        ]
    )


def thread_plan(spec: Any, vcpus: int) -> list[tuple[str, int]]:
    """threads param -> [(metric suffix, thread count)].

    1 -> ("1t", 1); "vcpus" -> ("nt", vcpus); another integer k -> ("<k>t", k). The suffix names the
    setting, not the number, so events_per_s_nt compares across cells with different vCPU counts."""
    items = as_list(spec)
    plan: list[tuple[str, int]] = []
    for item in items:
        if item == "vcpus":
            plan.append(("nt", int(vcpus)))
        elif isinstance(item, int) and not isinstance(item, bool) and item >= 1:
            plan.append(("1t" if item == 1 else f"{item}t", item))
        else:
            raise UsageError(f'sysbench-cpu: threads entry {item!r} must be a positive integer or "vcpus"')
    if not plan:
        raise UsageError("sysbench-cpu: threads must list at least one setting")
    tags = [t for t, _ in plan]
    if len(set(tags)) != len(tags):
        raise UsageError(f"sysbench-cpu: threads lists a setting twice: {items!r}")
    if vcpus < 1:
        raise UsageError(f"sysbench-cpu: vcpus must be >= 1, got {vcpus}")
    return plan


_BLOCK_RE = re.compile(r"^[1-9][0-9]*[KMG]?$")


def _check_positive_int(workload: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{workload}: {name} must be a positive integer, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# Workloads


class SysbenchCpu(Workload):
    name = "sysbench-cpu"
    traits = Traits(
        summary="CPU: sysbench's prime search, events per second at each thread count",
        params=(
            Param("threads", [1, "vcpus"], 'thread counts, one run each: integers, or "vcpus" for the cell\'s vCPUs'),
            Param("time", 10, "seconds each run lasts"),
            Param("max_prime", 20000, "sysbench's --cpu-max-prime: the primes each event searches up to"),
        ),
        primary_metrics=PrimaryMetrics(("events_per_s_*",), per=("threads",)),  # per thread count
        tools=("sysbench",),
    )

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        p = effective_params(self.defaults, ctx.params)
        _check_positive_int(self.name, "time", p["time"])
        _check_positive_int(self.name, "max_prime", p["max_prime"])
        thread_plan(p["threads"], ctx.vcpus)
        return p

    def estimate_seconds(self, p: dict[str, Any]) -> float:
        """For `lab plan`: a run of `time` per thread count (at most: counts the vCPUs make equal are one)."""
        return float(p["time"]) * len(as_list(p["threads"])) + RUN_OVERHEAD_S

    def commands(self, ctx: WorkloadContext) -> list[tuple[str, int, str]]:
        """[(tag, threads, command)] this workload runs in the guest, in order."""
        p = self.params(ctx)
        return [(tag, n, cpu_command(n, p["time"], p["max_prime"])) for tag, n in thread_plan(p["threads"], ctx.vcpus)]

    def prepare(self, ctx: WorkloadContext) -> None:
        self.params(ctx)
        require_tools(ctx, self)

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput:
        p = self.params(ctx)
        log = SegmentLog(self.name)
        for tag, _n, cmd in self.commands(ctx):
            log.add_load(tag, run_guest_load(ctx, self.name, cmd, timeout=p["time"] + 120), cmd)
        return log.raw({**p, "vcpus": ctx.vcpus, "repetition": repetition})

    def parse(self, raw: RawOutput) -> list[Sample]:
        samples: list[Sample] = []
        tags: list[str] = []
        tag_labels: dict[str, dict] = {}
        run_labels: dict = {}
        for tag, rc, text in split_segments(raw.stdout):
            try:
                r = parse_cpu_output(text, self.name)
            except LabError as exc:
                raise with_run_context(exc, "sysbench", rc or raw.returncode, raw.stderr) from None
            threads = int(r["threads"]) if "threads" in r else None
            if not tag:  # output stored without segment headers: name it from the thread count
                vcpus = raw.params.get("vcpus")
                tag = "1t" if threads == 1 else ("nt" if threads == vcpus else f"{threads or ''}t")
            labels = flag({"threads": threads}, exit_status_problem("sysbench", rc), r.get(UNMEASURED, ""))
            run_labels = flag_run(run_labels, tag, labels)
            samples += segment_samples(
                tag,
                r,
                [
                    (f"events_per_s_{tag}", "events_per_s", "events/s", True),
                    (f"latency_avg_ms_{tag}", "latency_avg_ms", "ms", False),
                    (f"latency_p95_ms_{tag}", "latency_p95_ms", "ms", False),
                ],
                labels,
            )
            tags.append(tag)
            tag_labels[tag] = labels
        if any(f"cpu_before.{t}" in raw.extra for t in tags):
            samples += cpu_samples(raw, tags=tags, tag_labels=tag_labels, labels=run_labels)
        else:
            samples += cpu_samples(raw, labels=run_labels)
        return samples


class SysbenchMemory(GuestCommand):
    name = "sysbench-memory"
    traits = Traits(
        summary="memory: sysbench's memory test, MiB/s and operations/s",
        params=(
            Param("block_size", "1K", "the block each operation moves (1K, 4K, 1M)"),
            Param("operation", "write", "read, write or none"),
            Param("time", 10, "seconds the run lasts"),
            Param("threads", 1, "threads moving memory at once"),
        ),
        primary_metrics=PrimaryMetrics(("throughput_mib_s",)),
        tools=("sysbench",),
    )

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        p = effective_params(self.defaults, ctx.params)
        if not isinstance(p["block_size"], str) or not _BLOCK_RE.match(p["block_size"]):
            raise UsageError(f"{self.name}: block_size must look like 1K, 4K, 1M, got {p['block_size']!r}")
        if p["operation"] not in ("read", "write", "none"):
            raise UsageError(f"{self.name}: operation must be read, write or none, got {p['operation']!r}")
        _check_positive_int(self.name, "time", p["time"])
        _check_positive_int(self.name, "threads", p["threads"])
        return p

    def command(self, ctx: WorkloadContext) -> str:
        p = self.params(ctx)
        return memory_command(p["block_size"], p["operation"], p["time"], p["threads"])

    def timeout(self, params: dict[str, Any]) -> float:
        return params["time"] + 120

    def parse(self, raw: RawOutput) -> list[Sample]:
        try:
            r = parse_memory_output(raw.stdout, self.name)
        except LabError as exc:
            raise with_run_context(exc, "sysbench", raw.returncode, raw.stderr) from None
        labels: dict[str, Any] = {k: raw.params[k] for k in ("block_size", "operation") if k in raw.params}
        if "threads" in r:
            labels["threads"] = int(r["threads"])
        labels = flag(labels, exit_status_problem("sysbench", raw.returncode), r.get(UNMEASURED, ""))
        rows = [
            ("throughput_mib_s", "mib_per_s", "MiB/s", True),
            ("operations_per_s", "operations_per_s", "ops/s", True),
        ]
        return segment_samples("", r, rows, labels) + cpu_samples(raw, labels=labels)


SYSBENCH_CPU = register(SysbenchCpu())
SYSBENCH_MEMORY = register(SysbenchMemory())
