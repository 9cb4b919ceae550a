"""scp: copy a large file between the client side and the guest, in both directions (in a container
cell, the container's own sshd: its traits say serves_ssh, lab.isolation).

Directions as iperf3's: "tx" = the guest sends (client copies guest:FILE to /dev/null), "rx" = the
guest receives (client copies a local file to guest:/dev/null), so neither side's disk is timed on
the receiving end. Each copy is a fresh SSH connection (no ControlMaster), run in the client's
network namespace, with LogLevel=VERBOSE so ssh prints, when the session ends,

    Transferred: sent N, received M bytes, in T seconds

T runs from the end of authentication to the end of the session (OpenSSH clientloop.c), so the key
exchange and login — 1-2 s under TCG — are left out; T has 0.1 s resolution, so size the file for
several seconds. Rows per direction: throughput_mb_s_<dir> (file bytes / 10^6 / T), seconds_<dir>
(T), wall_seconds_<dir> (the whole scp, login included) and the guest's CPU busy % around the copy.
"""

from __future__ import annotations

import os
import re
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from lab import osfacts, proc
from lab.errors import LabError, UsageError
from lab.guest import SshLogin
from lab.model import RawOutput, Sample
from lab.workloads import Param, PrimaryMetrics, Traits, Workload, WorkloadContext, register
from lab.workloads.cpu import cpu_samples, snapshot
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

DIRECTIONS = ("tx", "rx")
GUEST_FILE = "/var/tmp/lab-scp.bin"
_TRANSFERRED = re.compile(r"Transferred: sent (\d+), received (\d+) bytes, in ([0-9]+(?:\.[0-9]+)?) seconds")


def scp_argv(
    *,
    key: str,
    user: str,
    address: str,
    port: int,
    direction: str,
    local: str,
    remote: str,
    cipher: str = "",
    known_hosts: Path | None = None,
    host_key_alias: str | None = None,
) -> list[str]:
    """`known_hosts`: the file with the guest's host keys (lab.images.known_hosts); the guest must
    present one of them. Without it the host key is not checked (a guest whose image predates them).
    `host_key_alias`: the name the keys are under there, when the sshd is not the one the file names
    (a container cell's: the machine's keys on another port)."""
    host = f"[{address}]" if ":" in address else address
    checked = (
        ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}"]
        if known_hosts
        else ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    )
    if known_hosts and host_key_alias:
        checked += ["-o", f"HostKeyAlias={host_key_alias}"]
    argv = [
        "scp",
        "-i",
        str(key),
        "-P",
        str(port),
        "-o",
        "BatchMode=yes",
        "-o",
        "IdentitiesOnly=yes",
        *checked,
        "-o",
        "ControlPath=none",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "LogLevel=VERBOSE",
    ]
    if cipher:
        argv += ["-c", cipher]
    if direction == "tx":
        return argv + [f"{user}@{host}:{remote}", local]
    return argv + [local, f"{user}@{host}:{remote}"]


def parse_scp_output(text: str, file_bytes: int, direction: str, workload: str = "scp") -> Parsed:
    """ssh's VERBOSE "Transferred:" line -> seconds, throughput_mb_s, sent, received (a time of 0.0 s
    gives neither seconds nor a rate: the reason is under UNMEASURED)."""
    found = _TRANSFERRED.findall(text or "")
    if not found:
        raise LabError(
            f"{workload}: no 'Transferred: sent ..., received ... bytes, in ... seconds' line "
            f"(did the copy fail?); first line of output: {first_line(text)!r}",
            hint="the raw output is stored; fix the parser and run `lab reparse`",
        )
    sent, received, seconds = (float(x) for x in found[-1])
    moved = received if direction == "tx" else sent
    if moved < file_bytes:
        raise LabError(f"{workload}: the session moved {moved:.0f} bytes, less than the {file_bytes} bytes file")
    if seconds <= 0:  # ssh's 0.1 s resolution: no rate, not an infinite one
        return {
            "sent": sent,
            "received": received,
            UNMEASURED: "ssh reports the copy took 0.0 s (0.1 s resolution): use a larger size_mib",
        }
    return {"seconds": seconds, "throughput_mb_s": file_bytes / 1e6 / seconds, "sent": sent, "received": received}


class Scp(Workload):
    name = "scp"
    traits = Traits(
        summary="copying a large file over SSH between the client side and the guest's sshd, per direction",
        params=(
            Param("size_mib", 64, "the file's size in MiB (1..65536): big enough for several seconds"),
            Param("directions", ["tx", "rx"], '"tx" (the guest sends) and/or "rx" (the guest receives)'),
            Param("cipher", "", 'the OpenSSH cipher (scp -c); "" for its default'),
        ),
        primary_metrics=PrimaryMetrics(("seconds_*",), per=("directions",)),  # the copy's time per direction
        network=True,  # scp runs on the client side
        client_files=True,  # it sends this machine's files with the lab's key
        serves_ssh=True,
    )

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        p = effective_params(self.defaults, ctx.params)
        int_param(self.name, "size_mib", p["size_mib"], 1, 65536)
        p["directions"] = choices(self.name, "directions", p["directions"], DIRECTIONS)
        if not isinstance(p["cipher"], str) or not re.fullmatch(r"[A-Za-z0-9@.+-]*", p["cipher"]):
            raise UsageError(f'{self.name}: cipher must be an OpenSSH cipher name (or ""), got {p["cipher"]!r}')
        return p

    def estimate_seconds(self, p: dict[str, Any]) -> float:
        """For `lab plan`: ~20 MB/s under TCG plus 2 s of login per copy."""
        return len(p["directions"]) * (p["size_mib"] / 20 + 3)

    def commands(self, ctx: WorkloadContext, local: str = "LOCAL") -> list[tuple[str, list[str]]]:
        """[(direction, scp argv before the client wrapper)]."""
        p = self.params(ctx)
        login = self.login(ctx)
        out = []
        for d in p["directions"]:
            out.append(
                (
                    d,
                    scp_argv(
                        key=str(login.key),
                        user=login.user,
                        address=login.address,
                        port=login.port,
                        direction=d,
                        local="/dev/null" if d == "tx" else local,
                        remote=GUEST_FILE if d == "tx" else "/dev/null",
                        cipher=p["cipher"],
                        known_hosts=ctx.known_hosts,
                        host_key_alias=login.host_key_alias,  # a container cell's sshd
                    ),
                )
            )
        return out

    def login(self, ctx: WorkloadContext) -> SshLogin:
        """The guest's sshd, which is the load; LabError where the machine is not reached by SSH (the
        bare-metal cell: its commands run on this host directly)."""
        login = ctx.guest.ssh_login()
        if login is None:
            raise LabError(f"{self.name}: its load is an sshd, and this machine is not reached by SSH")
        return login

    def prepare(self, ctx: WorkloadContext) -> None:
        p = self.params(ctx)
        self.login(ctx)
        size = p["size_mib"] * 1048576
        if "tx" in p["directions"]:
            # dd with a byte count (bs=1048576) so GNU and BSD dd read it alike.
            ctx.guest.run(
                "sh -c "
                + shlex.quote(
                    f'[ -f {GUEST_FILE} ] && [ "$(wc -c < {GUEST_FILE})" -eq {size} ] || '
                    f"dd if=/dev/urandom of={GUEST_FILE} bs=1048576 count={p['size_mib']} 2>/dev/null"
                ),
                timeout=600,
            )
        res = proc.run(ctx.client.argv(["scp", "-h"]), timeout=30, check=False, what="scp on the client side")
        if "usage" not in (res.stdout + res.stderr).lower():
            raise LabError(f"{self.name}: scp does not run on the client side", hint="run `make setup`")

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput:
        p = self.params(ctx)
        size = p["size_mib"] * 1048576
        ticks_cmd = osfacts.facts(ctx.os).cpu_ticks_cmd
        log = SegmentLog(self.name, started=time.time())
        with tempfile.TemporaryDirectory(prefix="lab-scp-") as tmp:
            local = os.path.join(tmp, "lab-scp.bin")
            if "rx" in p["directions"]:
                with open(local, "wb") as f:
                    for _ in range(p["size_mib"]):
                        f.write(os.urandom(1048576))
            for d, argv in self.commands(ctx, local):
                before = snapshot(ctx.guest, ticks_cmd)
                res = proc.run(ctx.client.argv(argv), timeout=3600, check=False, what="scp")
                after = snapshot(ctx.guest, ticks_cmd)
                log.add(
                    d,
                    res.returncode,
                    res.stderr + res.stdout,
                    before,
                    after,
                    started=log.started,
                    seconds=res.seconds,
                    command=shlex.join(argv),
                )
                log.extra[f"wall_seconds.{d}"] = f"{res.seconds:.3f}"
        return log.raw({**p, "vcpus": ctx.vcpus, "repetition": repetition, "file_bytes": size})

    def parse(self, raw: RawOutput) -> list[Sample]:
        samples: list[Sample] = []
        tags: list[str] = []
        tag_labels: dict[str, dict] = {}
        run_labels: dict = {}
        size = int(raw.params.get("file_bytes") or raw.params.get("size_mib", 0) * 1048576)
        for tag, rc, text in split_segments(raw.stdout):
            try:
                r = parse_scp_output(text, size, tag, self.name)
            except LabError as exc:
                msg = exc.message + (f" (scp exit status {rc})" if rc else "")
                raise LabError(f"{msg} [{tag}]", exc.hint) from None
            labels = flag(
                {"direction": tag, "size_mib": size // 1048576, "cipher": raw.params.get("cipher") or "default"},
                r.get(UNMEASURED, ""),
            )
            run_labels = flag_run(run_labels, tag, labels)
            tags.append(tag)
            tag_labels[tag] = labels
            samples += segment_samples(
                tag,
                r,
                [
                    (f"throughput_mb_s_{tag}", "throughput_mb_s", "MB/s", True),
                    (f"seconds_{tag}", "seconds", "s", False),
                ],
                labels,
            )
            if f"wall_seconds.{tag}" in raw.extra:
                samples.append(
                    Sample(f"wall_seconds_{tag}", float(raw.extra[f"wall_seconds.{tag}"]), "s", False, dict(labels))
                )
        return samples + cpu_samples(raw, tags=tags, tag_labels=tag_labels, labels=run_labels)


SCP = register(Scp())
