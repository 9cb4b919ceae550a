"""bulk-http: download a large file (default /bulk/64m.bin, 64 MiB, incompressible) from nginx in the
guest with curl on the client side, `count` times per repetition over one keep-alive connection.

`scheme` lists http and/or https. `network` says where nginx runs: "guest" (the image's nginx), or
on FreeBSD "default" — nginx in the vnet jail behind pf NAT (lab/workloads/containers.py), reached
through the guest's port 8080 — the study's routed-to-a-jail path, where LRO matters (`lro`, as in
git-clone). The Debian image's base container has no nginx, so "default" is FreeBSD-only.

Rows per segment (tag `<network>-<scheme>`, e.g. `guest-http`): download_mb_s_<tag> (bytes of all
downloads / 10^6 / their total time), first_byte_ms_<tag> (median time to the first byte) and the
guest's CPU busy % around the downloads (snapshots by the guest's own SSH command).
"""

from __future__ import annotations

import json
import shlex
import statistics
import time
from typing import Any

from lab import osfacts, proc
from lab.errors import LabError, UsageError
from lab.model import RawOutput, Sample
from lab.workloads import Param, PrimaryMetrics, Traits, Workload, WorkloadContext, containers, register
from lab.workloads.cpu import cpu_samples, snapshot
from lab.workloads.http import url
from lab.workloads.toolkit import (
    UNMEASURED,
    Parsed,
    SegmentLog,
    choices,
    effective_params,
    first_line,
    flag,
    flag_run,
    int_param,
    segment_samples,
    split_segments,
)

SCHEMES = ("http", "https")


def curl_argv(target: str, count: int, max_time: int = 900) -> list[str]:
    """One curl, `count` transfers of the same URL (kept alive), a JSON line written per transfer."""
    argv = ["curl", "-sS", "-k", "--max-time", str(max_time), "-w", "%{json}\\n"]
    for _ in range(count):
        argv += ["-o", "/dev/null", target]
    return argv


def parse_curl_json(text: str, workload: str = "bulk-http") -> Parsed:
    """curl -w '%{json}' lines -> transfers, bytes, seconds, download_mb_s, first_byte_ms."""
    docs = []
    for line in (text or "").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                docs.append(json.loads(line))
            except json.JSONDecodeError:
                raise LabError(f"{workload}: a curl -w %{{json}} line is not JSON: {line[:120]!r}") from None
    if not docs:
        raise LabError(
            f"{workload}: no curl -w %{{json}} line; first line of output: {first_line(text)!r}",
            hint="the raw output is stored; fix the parser and run `lab reparse`",
        )
    bad = [d for d in docs if d.get("http_code") != 200 or d.get("exitcode", 0) != 0]
    if bad:
        d = bad[0]
        raise LabError(
            f"{workload}: {len(bad)} of {len(docs)} downloads failed (HTTP {d.get('http_code')}, "
            f"curl exit {d.get('exitcode')}: {d.get('errormsg') or 'no message'}) for {d.get('url_effective')}"
        )
    size = sum(float(d["size_download"]) for d in docs)
    seconds = sum(float(d["time_total"]) for d in docs)
    out = {
        "transfers": len(docs),
        "bytes": size,
        "seconds": seconds,
        "first_byte_ms": statistics.median(float(d["time_starttransfer"]) * 1000 for d in docs),
        "connects": sum(int(d.get("num_connects", 0)) for d in docs),
    }
    if seconds <= 0 or size <= 0:  # no rate, rather than 0 or an infinite one
        return out | {UNMEASURED: f"curl reports {size:.0f} bytes in {seconds:g} s for the downloads"}
    return out | {"download_mb_s": size / 1e6 / seconds}


class BulkHttp(Workload):
    name = "bulk-http"
    traits = Traits(
        summary="download speed of a large file from nginx in the guest (or a FreeBSD jail), curl on the client side",
        params=(
            Param("path", "/bulk/64m.bin", "the file downloaded (the image's site has /bulk/1m.bin and /bulk/64m.bin)"),
            Param("count", 3, "downloads per repetition, over one kept-alive connection (1..1000)"),
            Param("scheme", ["http"], "http and/or https"),
            Param(
                "network", ["guest"], '"guest" (the guest\'s nginx) and/or "default" (a vnet jail behind NAT: FreeBSD)'
            ),
            Param("lro", ["as-is"], 'LRO on the guest\'s uplink for each download: "as-is", "on", "off"'),
        ),
        primary_metrics=PrimaryMetrics(("download_mb_s_*",), per=("scheme", "network", "lro")),
        network=True,  # curl runs on the client side
        container_places="network",
    )

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        p = effective_params(self.defaults, ctx.params)
        if not isinstance(p["path"], str) or not p["path"].startswith("/") or any(c.isspace() for c in p["path"]):
            raise UsageError(f"{self.name}: path must start with / and contain no spaces, got {p['path']!r}")
        int_param(self.name, "count", p["count"], 1, 1000)
        for key, allowed in (("scheme", SCHEMES), ("network", ("guest", "default")), ("lro", containers.LRO)):
            p[key] = choices(self.name, key, p[key], allowed)
        if "default" in p["network"] and containers.family(ctx.os) != "freebsd":
            raise UsageError(
                f'{self.name}: network "default" (nginx in a vnet jail) is FreeBSD-only; '
                f"the {ctx.os} image has nginx in the guest only"
            )
        return p

    def estimate_seconds(self, p: dict[str, Any]) -> float:
        """For `lab plan`: the 64 MiB file at ~40 MB/s under TCG."""
        return len(p["scheme"]) * len(p["network"]) * len(p["lro"]) * (p["count"] * 2 + 1)

    def target(self, ctx: WorkloadContext, scheme: str, place: str) -> str:
        if not ctx.guest_address:
            raise UsageError(f"{self.name}: the workload context has no guest_address")
        p = self.params(ctx)
        if place == "guest":
            return url(scheme, ctx.guest_address, p["path"])
        host = f"[{ctx.guest_address}]" if ":" in ctx.guest_address else ctx.guest_address
        return f"{scheme}://{host}:{containers.JAIL_HTTP_PORT}{p['path']}"

    def plan(self, ctx: WorkloadContext) -> list[tuple[str, str, str, str]]:
        p = self.params(ctx)
        out = []
        for place in p["network"]:
            for scheme in p["scheme"]:
                if place == "default" and scheme == "https":
                    raise UsageError(
                        f"{self.name}: the jail forwards plain HTTP (port {containers.JAIL_HTTP_PORT}) only"
                    )
                for lro in p["lro"]:
                    tag = f"{place}-{scheme}" + ("" if lro == "as-is" else f"-lro{lro}")
                    out.append((tag, place, scheme, lro))
        return out

    def commands(self, ctx: WorkloadContext) -> list[tuple[str, list[str]]]:
        p = self.params(ctx)
        return [
            (tag, curl_argv(self.target(ctx, scheme, place), p["count"])) for tag, place, scheme, _ in self.plan(ctx)
        ]

    def prepare(self, ctx: WorkloadContext) -> None:
        p = self.params(ctx)
        if "default" in p["network"]:
            containers.prepare_places(ctx, self.name, ["default"])
            ctx.guest.run(f"jexec {containers.JAILS['default']} sh -c 'pgrep -q nginx || nginx'", timeout=60)
        for _tag, place, scheme, _ in self.plan(ctx):
            target = self.target(ctx, scheme, place)
            res = proc.run(
                ctx.client.argv(
                    ["curl", "-sSk", "-o", "/dev/null", "-r", "0-0", "-w", "%{http_code}", "--max-time", "30", target]
                ),
                timeout=60,
                check=False,
                what="curl",
            )
            if res.stdout.strip() not in ("200", "206"):
                raise LabError(
                    f"{self.name}: {target} answers HTTP {res.stdout.strip() or '000'}: {first_line(res.stderr)}",
                    hint="check the path param and nginx in the guest",
                )

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput:
        p = self.params(ctx)
        ticks_cmd = osfacts.facts(ctx.os).cpu_ticks_cmd
        log = SegmentLog(self.name, started=time.time())
        for tag, place, scheme, lro in self.plan(ctx):
            argv = curl_argv(self.target(ctx, scheme, place), p["count"])
            with containers.lro_setting(ctx, lro) as state:
                before = snapshot(ctx.guest, ticks_cmd)
                res = proc.run(ctx.client.argv(argv), timeout=900 * p["count"] + 60, check=False, what="curl")
                after = snapshot(ctx.guest, ticks_cmd)
            log.add(
                tag,
                res.returncode,
                res.stdout + res.stderr,
                before,
                after,
                started=log.started,
                seconds=res.seconds,
                command=shlex.join(argv),
            )
            log.extra[f"lro.{tag}"] = state["effective"]
        return log.raw({**p, "vcpus": ctx.vcpus, "repetition": repetition, "os": ctx.os})

    def parse(self, raw: RawOutput) -> list[Sample]:
        samples: list[Sample] = []
        tags: list[str] = []
        tag_labels: dict[str, dict] = {}
        run_labels: dict = {}
        for tag, rc, text in split_segments(raw.stdout):
            place, scheme, *rest = tag.split("-")
            try:
                r = parse_curl_json(text, self.name)
            except LabError as exc:
                msg = exc.message + (f" (curl exit status {rc})" if rc else "")
                raise LabError(f"{msg} [{tag}]", exc.hint) from None
            labels = flag(
                {
                    "network": place,
                    "scheme": scheme,
                    "lro": rest[0][3:] if rest else "as-is",
                    "lro_effective": raw.extra.get(f"lro.{tag}", "unknown"),
                    "transfers": r["transfers"],
                    "path": raw.params.get("path"),
                },
                r.get(UNMEASURED, ""),
            )
            run_labels = flag_run(run_labels, tag, labels)
            tags.append(tag)
            tag_labels[tag] = labels
            samples += segment_samples(
                tag,
                r,
                [
                    (f"download_mb_s_{tag}", "download_mb_s", "MB/s", True),
                    (f"first_byte_ms_{tag}", "first_byte_ms", "ms", False),
                ],
                labels,
            )
        return samples + cpu_samples(raw, tags=tags, tag_labels=tag_labels, labels=run_labels)


BULK_HTTP = register(BulkHttp())
