"""iperf3-tcp and iperf3-udp: server on the client side (one-shot, `-s -1`), client in the guest.

Directions: "tx" = guest -> client (guest sends), "rx" = client -> guest (`-R`, guest receives).
Each direction is one segment of the RawOutput: its own server, its own SSH command with the
guest's CPU snapshots around the iperf3 client, its own `--json` document.

Numbers come from the client's JSON: throughput is what the receiver counted (end.sum_received);
TCP retransmits come from end.sum_sent and are absent when the sending side cannot count them
(NetBSD/OpenBSD senders: iperf3 omits the key when `sender_has_retransmits` is false). UDP jitter and
loss come from end.sum_received (iperf3 >= 3.10) or end.sum (older releases, which have only that).
A test in which the receiver got nothing measured no throughput (and, for UDP, no jitter): iperf3's
0 there is left out, and the segment gets an `unmeasured_<dir>` row and its samples are flagged.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from typing import Any

from lab import proc
from lab.errors import LabError, UsageError
from lab.model import RawOutput, Sample
from lab.workloads import Param, PrimaryMetrics, Traits, Workload, WorkloadContext, register
from lab.workloads.cpu import cpu_samples, run_guest_load
from lab.workloads.toolkit import (
    CLIENT_TOOL_HINT,
    RUN_OVERHEAD_S,
    UNMEASURED,
    SegmentLog,
    as_list,
    client_server,
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

DIRECTIONS = {"tx": False, "rx": True}  # direction -> iperf3 -R


def parse_iperf3_json(text: str, workload: str = "iperf3") -> dict[str, Any]:
    """One `iperf3 -c ... -J` document -> {protocol, reverse, streams, throughput_mbit_s,
    retransmits (TCP, if the sender counts them), jitter_ms, loss_pct, lost_packets, packets (UDP)}."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, TypeError, ValueError):
        raise LabError(
            f"{workload}: output is not iperf3 JSON; first line of output: {first_line(text)!r}",
            hint="the raw output is stored; fix the parser and run `lab reparse`",
        ) from None
    if not isinstance(doc, dict):
        raise LabError(f"{workload}: iperf3 JSON is not an object; first line of output: {first_line(text)!r}")
    if doc.get("error"):
        raise LabError(f"{workload}: iperf3 reported an error: {doc['error']}")
    start, end = doc.get("start") or {}, doc.get("end") or {}
    ts = start.get("test_start") or {}
    protocol = str(ts.get("protocol", "")).upper()
    out: dict[str, Any] = {
        "protocol": protocol.lower(),
        "reverse": bool(ts.get("reverse", 0)),
        "streams": int(ts.get("num_streams", 0) or 0),
        "version": start.get("version", ""),
    }
    recv, sent, legacy = end.get("sum_received"), end.get("sum_sent"), end.get("sum")

    def bps(obj: dict | None) -> float | None:
        if isinstance(obj, dict) and isinstance(obj.get("bits_per_second"), (int, float)):
            return float(obj["bits_per_second"])
        return None

    if protocol == "UDP":
        legacy_only = not (isinstance(recv, dict) and "lost_percent" in recv)
        stats = legacy if legacy_only else recv
        udp_rate = bps(stats) if isinstance(stats, dict) else None
        if not isinstance(stats, dict) or udp_rate is None:
            raise LabError(
                f"{workload}: iperf3 UDP JSON has no end.sum_received/end.sum; "
                f"first line of output: {first_line(text)!r}"
            )
        if legacy_only:
            # iperf3 < 3.10 has only end.sum, whose bits_per_second is the sender's rate; take out what
            # the receiver lost to approximate the received rate.
            out["throughput_mbit_s"] = udp_rate * (1 - float(stats.get("lost_percent", 0)) / 100) / 1e6
        else:
            out["throughput_mbit_s"] = udp_rate / 1e6
        for key, name in (
            ("jitter_ms", "jitter_ms"),
            ("lost_percent", "loss_pct"),
            ("lost_packets", "lost_packets"),
            ("packets", "packets"),
        ):
            if key in stats:
                out[name] = float(stats[key])
        if "jitter_ms" not in out or "loss_pct" not in out:
            raise LabError(f"{workload}: iperf3 UDP JSON lacks jitter_ms/lost_percent")
        if out.get("packets", 1) - out.get("lost_packets", 0) <= 0:
            # The receiver got no datagram: its 0 rate, 0 jitter and 0 % loss (it cannot count gaps
            # between datagrams it never saw) measure nothing.
            for key in ("throughput_mbit_s", "jitter_ms", "loss_pct", "lost_packets", "packets"):
                out.pop(key, None)
            sent_packets = sent.get("packets") if isinstance(sent, dict) else None
            out[UNMEASURED] = "the iperf3 receiver got no datagram" + (
                f" of the {sent_packets} sent" if sent_packets else ""
            )
        return out
    if protocol not in ("TCP", "SCTP"):
        raise LabError(
            f"{workload}: iperf3 JSON has no start.test_start.protocol; first line of output: {first_line(text)!r}"
        )
    rate = bps(recv)
    if rate is None or not isinstance(recv, dict):  # bps() is None unless recv is a dict
        raise LabError(
            f"{workload}: iperf3 TCP JSON has no end.sum_received (test cut short?); "
            f"first line of output: {first_line(text)!r}"
        )
    if recv.get("bytes") == 0:  # iperf3's rate of an empty transfer is 0, not a measurement
        out[UNMEASURED] = f"the iperf3 receiver got no data in {float(recv.get('seconds', 0)):g} s"
    else:
        out["throughput_mbit_s"] = rate / 1e6
    sender_rate = bps(sent)
    if sender_rate is not None:
        out["sender_mbit_s"] = sender_rate / 1e6
    if isinstance(sent, dict) and isinstance(sent.get("retransmits"), (int, float)):
        out["retransmits"] = float(sent["retransmits"])
    return out


def _reports_error(text: str) -> bool:
    """True when the client's JSON carries an error (iperf3 -J may exit 0 even then)."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, TypeError, ValueError):
        return True
    return not isinstance(doc, dict) or bool(doc.get("error"))


# ---------------------------------------------------------------------------------------------
# Commands (pure)


def server_argv(address: str, port: int) -> list[str]:
    """The one-shot server on the client side. --forceflush so its "Server listening" line reaches
    the log file at once (readiness is read from there, without touching the one-shot port)."""
    return ["iperf3", "-s", "-1", "-B", address, "-p", str(port), "--forceflush"]


def client_command(
    address: str, port: int, time_s: int, streams: int, reverse: bool, udp: bool = False, bitrate: str | None = None
) -> str:
    argv = ["iperf3", "-c", address, "-p", str(port), "-J", "-t", str(time_s), "-P", str(streams)]
    if udp:
        argv += ["-u", "-b", str(bitrate)]
    if reverse:
        argv.append("-R")
    return shlex.join(argv)


def _positive_int(workload: str, name: str, value: Any, upper: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper and value > upper):
        rng = f"1..{upper}" if upper else ">= 1"
        raise UsageError(f"{workload}: {name} must be an integer {rng}, got {value!r}")
    return value


def _traits(udp: bool) -> Traits:
    kind = "UDP" if udp else "TCP"
    return Traits(
        summary=f"{kind} throughput between the guest and the client side, per direction (iperf3)"
        + (", with jitter and loss" if udp else ""),
        params=(
            Param("time", 10, "seconds each direction's test lasts"),
            Param("streams", 1, "parallel streams (iperf3 -P, 1..128)"),
            *((Param("bitrate", "100M", "the rate the sender offers (iperf3 -b), e.g. 100M"),) if udp else ()),
            Param("directions", ["tx", "rx"], '"tx" (the guest sends) and/or "rx" (the guest receives)'),
            Param("port", 5201, "the iperf3 server's port on the client side"),
        ),
        primary_metrics=PrimaryMetrics(("throughput_mbit_s_*",), per=("directions",)),  # per direction
        network=True,  # its server is on the client side
        tools=("iperf3",),
    )


class _Iperf3(Workload):
    udp = False

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        p = effective_params(self.defaults, ctx.params)
        _positive_int(self.name, "time", p["time"])
        _positive_int(self.name, "streams", p["streams"], 128)
        _positive_int(self.name, "port", p["port"], 65535)
        dirs = as_list(p["directions"])
        if not dirs or any(d not in DIRECTIONS for d in dirs) or len(set(dirs)) != len(dirs):
            raise UsageError(f'{self.name}: directions must list "tx" and/or "rx" once each, got {p["directions"]!r}')
        p["directions"] = list(dirs)
        if self.udp and (not isinstance(p["bitrate"], str) or not p["bitrate"].strip()):
            raise UsageError(f'{self.name}: bitrate must be a string such as "100M", got {p["bitrate"]!r}')
        return p

    def estimate_seconds(self, p: dict[str, Any]) -> float:
        """For `lab plan`: a run of `time` per direction."""
        return float(p["time"]) * len(as_list(p["directions"])) + RUN_OVERHEAD_S

    def commands(self, ctx: WorkloadContext) -> list[tuple[str, list[str], str]]:
        """[(direction, server argv on the client side (unwrapped), guest command)]."""
        p = self.params(ctx)
        addr = ctx.client.address
        return [
            (
                d,
                server_argv(addr, p["port"]),
                client_command(addr, p["port"], p["time"], p["streams"], DIRECTIONS[d], self.udp, p.get("bitrate")),
            )
            for d in p["directions"]
        ]

    def prepare(self, ctx: WorkloadContext) -> None:
        self.params(ctx)
        require_tools(ctx, self)
        res = proc.run(
            ctx.client.argv(["iperf3", "--version"]), timeout=30, check=False, what="iperf3 on the client side"
        )
        if not res.ok:
            raise LabError(
                f"{self.name}: iperf3 does not run on the client side: {first_line(res.stderr or res.stdout)}",
                hint=CLIENT_TOOL_HINT,
            )

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput:
        p = self.params(ctx)
        log = SegmentLog(self.name)
        for direction, srv, cmd in self.commands(ctx):
            r, server_log = self._one(ctx, srv, cmd, p["time"])
            log.add_load(direction, r, cmd)
            log.extra[f"server_log.{direction}"] = server_log
        return log.raw({**p, "vcpus": ctx.vcpus, "repetition": repetition, "client_address": ctx.client.address})

    def _one(self, ctx: WorkloadContext, srv: list[str], cmd: str, time_s: int):
        """Start the one-shot server, wait until it listens, run the guest client, reap the server."""
        addr, port = srv[srv.index("-B") + 1], srv[srv.index("-p") + 1]
        with client_server(
            ctx,
            srv,
            ready="Server listening",
            what=f"{self.name}: the iperf3 server on {addr}",
            hint=f"is port {port} on {addr} in use?",
        ) as server:
            r = run_guest_load(ctx, self.name, cmd, timeout=time_s + 60)
            if r.returncode == 0 and not _reports_error(r.stdout):
                try:
                    server.process.wait(timeout=10)  # -1: it exits by itself once the test is over
                except subprocess.TimeoutExpired:
                    pass
            return r, server.log()

    def parse(self, raw: RawOutput) -> list[Sample]:
        samples: list[Sample] = []
        tags: list[str] = []
        tag_labels: dict[str, dict] = {}
        run_labels: dict = {}
        for tag, rc, text in split_segments(raw.stdout):
            try:
                r = parse_iperf3_json(text, self.name)
            except LabError as exc:
                raise with_run_context(exc, "iperf3", rc or raw.returncode, raw.stderr) from None
            if not tag:
                tag = "rx" if r["reverse"] else "tx"
            if (r["protocol"] == "udp") != self.udp:
                raise LabError(f"{self.name}: the JSON is a {r['protocol'].upper()} test")
            labels: dict[str, Any] = {"direction": tag, "streams": r["streams"]}
            if self.udp and raw.params.get("bitrate"):
                labels["bitrate"] = raw.params["bitrate"]
            labels = flag(labels, exit_status_problem("iperf3", rc), r.get(UNMEASURED, ""))
            run_labels = flag_run(run_labels, tag, labels)
            tags.append(tag)
            tag_labels[tag] = labels
            rows = [(f"throughput_mbit_s_{tag}", "throughput_mbit_s", "Mbit/s", True)]
            if self.udp:
                rows += [(f"jitter_ms_{tag}", "jitter_ms", "ms", False), (f"loss_pct_{tag}", "loss_pct", "%", False)]
            elif "retransmits" in r:  # absent where the sender cannot count them (BSD): unknown, not a failure
                rows.append((f"retransmits_{tag}", "retransmits", "count", False))
            samples += segment_samples(tag, r, rows, labels)
        if any(f"cpu_before.{t}" in raw.extra for t in tags):
            samples += cpu_samples(raw, tags=tags, tag_labels=tag_labels, labels=run_labels)
        else:
            samples += cpu_samples(raw, labels=run_labels)
        return samples


class Iperf3Tcp(_Iperf3):
    name = "iperf3-tcp"
    udp = False
    traits = _traits(udp=False)


class Iperf3Udp(_Iperf3):
    name = "iperf3-udp"
    udp = True
    traits = _traits(udp=True)


IPERF3_TCP = register(Iperf3Tcp())
IPERF3_UDP = register(Iperf3Udp())
