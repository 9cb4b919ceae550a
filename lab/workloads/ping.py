"""ping: the round-trip time between the guest and the client side, and the packets lost.

The guest pings the client side's address (`ping -c COUNT -i INTERVAL -s SIZE -q`, between two CPU
snapshots in one SSH command, as sysbench runs), so what is timed is the guest's NIC, its driver and
the host's bridge or network both ways: the latency the NIC-model and offload axes change, where
iperf3 measures only throughput. The client side needs nothing but its kernel, which answers.

Rows: rtt_min_ms, rtt_avg_ms, rtt_max_ms, rtt_mdev_ms (iputils' mean deviation), loss_pct, and the
guest's CPU busy %. A run in which no reply came back measured no round trip: its rtt rows are an
`unmeasured` row, flagged, and loss_pct is 100. The parser reads iputils' ping (the Debian image's;
tests/data/ping/), whose summary is "rtt min/avg/max/mdev = ... ms".
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from lab.errors import LabError, UsageError
from lab.model import RawOutput, Sample
from lab.workloads import Param, PrimaryMetrics, Traits, WorkloadContext, register
from lab.workloads.cpu import cpu_samples
from lab.workloads.toolkit import (
    RUN_OVERHEAD_S,
    UNMEASURED,
    GuestCommand,
    Parsed,
    effective_params,
    exit_status_problem,
    first_line,
    flag,
    int_param,
    segment_samples,
    with_run_context,
)

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_SENT = re.compile(r"^(\d+) packets transmitted, (\d+) received,.*?" + _NUM + r"% packet loss", re.MULTILINE)
# iputils ends the line with ", pipe N" when N pings were in flight at once (a slow guest under
# TCG) and ", ipg/ewma ..." when flooding: the figures are the same
_RTT = re.compile(r"^rtt min/avg/max/mdev = " + "/".join([_NUM] * 4) + r" ms(?:, .*)?$", re.MULTILINE)
RTT_ROWS = [(f"rtt_{k}_ms", k, "ms", False) for k in ("min", "avg", "max", "mdev")]


def parse_ping_output(text: str, workload: str = "ping") -> Parsed:
    """iputils' `ping -q` summary -> sent, received, loss_pct, min, avg, max, mdev (ms). With no
    reply there is no rtt line: the round trip is left out, with the reason under UNMEASURED."""
    m = _SENT.search(text or "")
    if not m:
        raise LabError(
            f"{workload}: no 'packets transmitted, ... received' line; first line of output: {first_line(text)!r}",
            hint="the raw output is stored; fix the parser and run `lab reparse`",
        )
    out: dict[str, Any] = {"sent": float(m.group(1)), "received": float(m.group(2)), "loss_pct": float(m.group(3))}
    rtt = _RTT.search(text)
    if rtt:
        out |= dict(zip(("min", "avg", "max", "mdev"), (float(v) for v in rtt.groups())))
    elif out["received"] == 0:
        out[UNMEASURED] = f"no reply to the {out['sent']:.0f} pings sent"
    else:
        raise LabError(f"{workload}: {out['received']:.0f} replies but no 'rtt min/avg/max/mdev' line")
    return out


def ping_command(address: str, count: int, interval: float, size: int) -> str:
    # -w: a deadline, so a client side that answers nothing cannot keep the load waiting
    deadline = int(count * interval) + 5
    return shlex.join(
        ["ping", "-q", "-c", str(count), "-i", f"{interval:g}", "-s", str(size), "-w", str(deadline), address]
    )


class Ping(GuestCommand):
    name = "ping"
    traits = Traits(
        summary="round-trip time and loss between the guest and the client side (ping)",
        params=(
            Param("count", 20, "pings per repetition (1..10000)"),
            Param("interval", 0.2, "seconds between pings (0.01..10; below 0.2 ping needs root, which the lab is)"),
            Param("size", 56, "bytes of payload per ping (ping -s, 0..65507)"),
        ),
        primary_metrics=PrimaryMetrics(("rtt_avg_ms",)),  # the mean round trip (loss and spread are exploratory)
        network=True,  # the client side answers: its lanes take turns on it, its load is recorded
        tools=("ping",),
    )

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        p = effective_params(self.defaults, ctx.params)
        int_param(self.name, "count", p["count"], 1, 10000)
        int_param(self.name, "size", p["size"], 0, 65507)
        i = p["interval"]
        if isinstance(i, bool) or not isinstance(i, (int, float)) or not 0.01 <= i <= 10:
            raise UsageError(f"{self.name}: interval must be a number of seconds in 0.01..10, got {i!r}")
        return p

    def estimate_seconds(self, p: dict[str, Any]) -> float:
        return p["count"] * float(p["interval"]) + RUN_OVERHEAD_S

    def command(self, ctx: WorkloadContext) -> str:
        p = self.params(ctx)
        return ping_command(ctx.client.address, p["count"], float(p["interval"]), p["size"])

    def timeout(self, params: dict[str, Any]) -> float:
        return params["count"] * float(params["interval"]) + 60

    def recorded(self, ctx: WorkloadContext) -> dict[str, Any]:
        return {"to": ctx.client.address}

    def parse(self, raw: RawOutput) -> list[Sample]:
        try:
            r = parse_ping_output(raw.stdout, self.name)
        except LabError as exc:
            raise with_run_context(exc, "ping", raw.returncode, raw.stderr) from None
        labels = {"size": raw.params.get("size"), "interval": raw.params.get("interval")}
        # ping exits 1 when a reply is missing: the loss row says so, the run's figures still count
        rc = raw.returncode if raw.returncode != 1 else 0
        labels = flag(labels, exit_status_problem("ping", rc), r.get(UNMEASURED, ""))
        rows = [*RTT_ROWS, ("loss_pct", "loss_pct", "%", False)]
        return segment_samples("", r, rows, labels) + cpu_samples(raw, labels=labels)


PING = register(Ping())
