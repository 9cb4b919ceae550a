"""http and https: wrk on the client side against nginx in the guest.

One segment per connection count (`c10`, `c50`); the guest's CPU is snapshotted by its own SSH
command right before and right after each wrk run. A segment with socket errors or non-2xx/3xx
answers is not dropped: it gets an `errors_<tag>` sample > 0 and `flagged=1` (with `flagged_why`) in
every sample's labels. What wrk did not measure (rates without a completed request, latencies when
every request timed out) is an `unmeasured_<tag>` row instead of a 0.
"""

from __future__ import annotations

import re
import shlex
import time
from typing import Any

from lab import osfacts, proc
from lab.errors import LabError, UsageError
from lab.model import RawOutput, Sample
from lab.wait import wait_until
from lab.workloads import Param, PrimaryMetrics, Traits, Workload, WorkloadContext, register
from lab.workloads.cpu import cpu_samples, snapshot
from lab.workloads.toolkit import (
    CLIENT_TOOL_HINT,
    RUN_OVERHEAD_S,
    UNMEASURED,
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

_TIME_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
# wrk's format_binary divides by 1024 and prints K/M/G/T/P followed by B.
_BYTES_MIB = {"B": 1 / 1048576, "KB": 1 / 1024, "MB": 1.0, "GB": 1024.0, "TB": 1048576.0, "PB": 1073741824.0}
_NUM = r"([0-9]+(?:\.[0-9]+)?)"
LATENCIES = tuple(f"latency_p{p}_ms" for p in ("50", "75", "90", "99"))


def _fail(workload: str, text: str, why: str) -> LabError:
    return LabError(
        f"{workload}: {why}; first line of output: {first_line(text)!r}",
        hint="the raw output is stored; fix the parser and run `lab reparse`",
    )


def parse_wrk_output(text: str, workload: str = "http") -> Parsed:
    """`wrk --latency` output -> requests_per_s, transfer_mib_s, latency_p50/75/90/99_ms, requests,
    duration_s, socket_errors_connect/read/write/timeout, non_2xx, errors (the sum of those five).

    wrk prints 0.00 where it measured nothing; those are left out, with the reason under UNMEASURED:
    the rates when no request completed, the latencies when its histogram is empty (every completed
    request timed out: wrk counts a timeout instead of recording the latency, and its stdev column
    then reads nan). The error counters are counts: wrk prints their lines only when they are not 0."""
    if not text or not text.strip():
        raise _fail(workload, text, "wrk printed nothing")
    out: dict = {}
    m = re.search(r"^Requests/sec:\s*" + _NUM + r"\s*$", text, re.MULTILINE)
    if not m:
        raise _fail(workload, text, "no 'Requests/sec:' line in wrk output")
    out["requests_per_s"] = float(m.group(1))
    m = re.search(r"^Transfer/sec:\s*" + _NUM + r"\s*([KMGTP]?B)\s*$", text, re.MULTILINE)
    if not m:
        raise _fail(workload, text, "no 'Transfer/sec:' line in wrk output")
    out["transfer_mib_s"] = float(m.group(1)) * _BYTES_MIB[m.group(2)]
    m = re.search(
        r"^\s*(\d+) requests in " + _NUM + r"(us|ms|s|m|h), " + _NUM + r"([KMGTP]?B) read", text, re.MULTILINE
    )
    if not m:
        raise _fail(workload, text, "no '<n> requests in <t>, <bytes> read' line in wrk output")
    out["requests"] = float(m.group(1))
    out["duration_s"] = float(m.group(2)) * _TIME_MS[m.group(3)] / 1000
    out["read_mib"] = float(m.group(4)) * _BYTES_MIB[m.group(5)]
    dist = dict(re.findall(r"^\s*(50|75|90|99)%\s+" + r"([0-9]+(?:\.[0-9]+)?(?:us|ms|s|m|h))\s*$", text, re.MULTILINE))
    if set(dist) != {"50", "75", "90", "99"}:
        raise _fail(workload, text, "no 'Latency Distribution' (was wrk run without --latency?)")
    for pct, val in dist.items():
        m = re.match(_NUM + r"(us|ms|s|m|h)", val)
        if m is None:
            raise _fail(workload, text, f"latency {val!r} is not a number with a unit")
        num, unit = m.groups()
        out[f"latency_p{pct}_ms"] = float(num) * _TIME_MS[unit]
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    for i, kind in enumerate(("connect", "read", "write", "timeout"), start=1):
        out[f"socket_errors_{kind}"] = float(m.group(i)) if m else 0.0
    m = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", text)
    out["non_2xx"] = float(m.group(1)) if m else 0.0
    out["errors"] = sum(out[f"socket_errors_{k}"] for k in ("connect", "read", "write", "timeout")) + out["non_2xx"]
    seconds = f"{out['duration_s']:g} s"
    if out["requests"] == 0:
        for key in ("requests_per_s", "transfer_mib_s", *LATENCIES):
            out.pop(key)
        out[UNMEASURED] = f"wrk completed no request in {seconds}"
    elif re.search(r"^[ \t]*Latency(?:[ \t]+\S+){3}[ \t]+-?nan%", text, re.MULTILINE | re.IGNORECASE):
        for key in LATENCIES:
            out.pop(key)
        out[UNMEASURED] = (
            f"wrk recorded no latency: all {out['requests']:.0f} completed requests timed out in {seconds}"
        )
    return out


# ---------------------------------------------------------------------------------------------
# Commands (pure)


def url(scheme: str, address: str, path: str = "/") -> str:
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"{scheme}://{host}{path}"


def wrk_argv(target: str, connections: int, duration_s: int, threads: int = 4) -> list[str]:
    """wrk refuses fewer connections than threads, so threads is capped at connections."""
    return ["wrk", f"-t{min(threads, connections)}", f"-c{connections}", f"-d{duration_s}s", "--latency", target]


def curl_argv(target: str) -> list[str]:
    """One probe: prints the HTTP status (000 when nothing answered). -k: the guest's cert is self-signed."""
    return ["curl", "-sk", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "3", target]


def _traits(scheme: str) -> Traits:
    return Traits(
        summary=f"{scheme.upper()} requests/s and latencies of the guest's nginx, wrk on the client side",
        params=(
            Param("connections", [10, 50], "open connections, one wrk run each"),
            Param("duration", 10, "seconds each wrk run lasts"),
            Param("path", "/", "the URL path requested (from the image's site)"),
            Param("threads", 4, "wrk's threads (at most the connections)"),
        ),
        primary_metrics=PrimaryMetrics(("requests_per_s_*",), per=("connections",)),  # per connection count
        network=True,  # wrk runs on the client side
        serves_web=True,
        tools=("nginx",),
    )


class _Http(Workload):
    scheme = ""

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        p = effective_params(self.defaults, ctx.params)
        conns = as_list(p["connections"])
        if (
            not conns
            or len(set(conns)) != len(conns)
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in conns)
        ):
            raise UsageError(f"{self.name}: connections must list distinct positive integers, got {p['connections']!r}")
        p["connections"] = list(conns)
        for key in ("duration", "threads"):
            if isinstance(p[key], bool) or not isinstance(p[key], int) or p[key] < 1:
                raise UsageError(f"{self.name}: {key} must be a positive integer, got {p[key]!r}")
        if not isinstance(p["path"], str) or not p["path"].startswith("/") or any(c.isspace() for c in p["path"]):
            raise UsageError(f"{self.name}: path must start with / and contain no spaces, got {p['path']!r}")
        return p

    def target(self, ctx: WorkloadContext) -> str:
        if not ctx.guest_address:
            raise UsageError(f"{self.name}: the workload context has no guest_address")
        return url(self.scheme, ctx.guest_address, self.params(ctx)["path"])

    def estimate_seconds(self, p: dict[str, Any]) -> float:
        """For `lab plan`: a wrk run of `duration` per connection count."""
        return float(p["duration"]) * len(as_list(p["connections"])) + RUN_OVERHEAD_S

    def commands(self, ctx: WorkloadContext) -> list[tuple[str, list[str]]]:
        """[(segment tag, wrk argv before the client wrapper)]."""
        p = self.params(ctx)
        t = self.target(ctx)
        return [(f"c{c}", wrk_argv(t, c, p["duration"], p["threads"])) for c in p["connections"]]

    def prepare(self, ctx: WorkloadContext) -> None:
        self.params(ctx)
        require_tools(ctx, self)
        res = proc.run(ctx.client.argv(["wrk", "-v"]), timeout=30, check=False, what="wrk on the client side")
        if "wrk" not in (res.stdout + res.stderr):
            raise LabError(f"{self.name}: wrk does not run on the client side", hint=CLIENT_TOOL_HINT)
        target = self.target(ctx)
        last = {"code": "000"}

        def answers() -> bool:
            r = proc.run(ctx.client.argv(curl_argv(target)), timeout=10, check=False, what="curl")
            last["code"] = (r.stdout.strip() or "000")[-3:]
            return last["code"] != "000"

        wait_until(
            answers,
            timeout=60,
            what=f"nginx to answer {target}",
            interval=0.2,
            detail=lambda: f"last HTTP status {last['code']}",
        )
        if not last["code"].startswith(("2", "3")):
            raise LabError(
                f"{self.name}: nginx answers {target} with HTTP {last['code']}",
                hint="check the path param and the guest's nginx.conf (templates/)",
            )

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput:
        p = self.params(ctx)
        ticks_cmd = osfacts.facts(ctx.os).cpu_ticks_cmd
        log = SegmentLog(self.name, started=time.time())
        for tag, argv in self.commands(ctx):
            before = snapshot(ctx.guest, ticks_cmd)
            res = proc.run(ctx.client.argv(argv), timeout=p["duration"] + 60, check=False, what="wrk")
            after = snapshot(ctx.guest, ticks_cmd)
            text = res.stdout
            if res.stderr.strip():  # wrk prints why it could not start ("unable to connect ...") there
                text = text + ("\n" if text and not text.endswith("\n") else "") + res.stderr
            log.add(
                tag,
                res.returncode,
                text,
                before,
                after,
                started=log.started,
                seconds=res.seconds,
                command=shlex.join(argv),
            )
        return log.raw({**p, "vcpus": ctx.vcpus, "repetition": repetition, "url": self.target(ctx)})

    def parse(self, raw: RawOutput) -> list[Sample]:
        samples: list[Sample] = []
        tags: list[str] = []
        tag_labels: dict[str, dict] = {}
        run_labels: dict = {}
        total_errors = 0.0
        for tag, rc, text in split_segments(raw.stdout):
            try:
                r = parse_wrk_output(text, self.name)
            except LabError as exc:
                raise with_run_context(exc, "wrk", rc or raw.returncode, "") from None
            if not tag:
                m = re.search(r"(\d+) threads and (\d+) connections", text)
                tag = f"c{m.group(2)}" if m else "c"
            labels: dict[str, Any] = {"connections": int(tag[1:]) if tag[1:].isdigit() else None}
            total_errors += r["errors"]
            # A load with errors, or one that measured nothing (no request completed, e.g. TLS
            # handshakes outlasting the duration), is flagged rather than averaged in silently.
            labels = flag(labels, exit_status_problem("wrk", rc), _errors_problem(r), r.get(UNMEASURED, ""))
            run_labels = flag_run(run_labels, tag, labels)
            tags.append(tag)
            tag_labels[tag] = labels
            samples += segment_samples(
                tag,
                r,
                [
                    (f"requests_per_s_{tag}", "requests_per_s", "req/s", True),
                    (f"transfer_mib_s_{tag}", "transfer_mib_s", "MiB/s", True),
                    *[(f"{key}_{tag}", key, "ms", False) for key in LATENCIES],
                    (f"errors_{tag}", "errors", "count", False),
                    (f"non_2xx_{tag}", "non_2xx", "count", False),
                    *[
                        (f"socket_errors_{k}_{tag}", f"socket_errors_{k}", "count", False)
                        for k in ("connect", "read", "write", "timeout")
                    ],
                ],
                labels,
            )
        samples.append(Sample("errors", total_errors, "count", False, dict(run_labels)))
        if any(f"cpu_before.{t}" in raw.extra for t in tags):
            cpu = cpu_samples(raw, tags=tags, tag_labels=tag_labels, labels=run_labels)
        else:
            cpu = cpu_samples(raw, labels=run_labels)
        return samples + cpu


def _errors_problem(r: dict[str, float]) -> str:
    """Why a wrk load with errors is flagged ("" without errors)."""
    kinds = [
        f"{r[f'socket_errors_{k}']:.0f} {k}" for k in ("connect", "read", "write", "timeout") if r[f"socket_errors_{k}"]
    ]
    if r["non_2xx"]:
        kinds.append(f"{r['non_2xx']:.0f} non-2xx/3xx answers")
    return f"wrk counted {r['errors']:.0f} errors ({', '.join(kinds)})" if kinds else ""


class Http(_Http):
    name = "http"
    scheme = "http"
    traits = _traits("http")


class Https(_Http):
    name = "https"
    scheme = "https"
    traits = _traits("https")


HTTP = register(Http())
HTTPS = register(Https())
