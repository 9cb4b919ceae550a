"""git-clone: clone a generated repository (lab/workloads/gitrepo.py) from `git daemon` on the
client side, on the guest itself and inside a container in the guest.

`network` lists where the clone runs (lab/workloads/containers.py): "guest", "default" (podman's
default bridge network / a FreeBSD vnet jail behind NAT), "host" (podman --network=host / a jail
sharing the guest's stack). `lro` lists LRO settings for the guest's uplink to run each place with
("as-is" leaves it; "on"/"off" set it for that clone and put it back after), the FreeBSD study's knob.
Each (place, lro) is one segment with its own rows: clone_seconds_<tag>, clone_mb_s_<tag> and the
guest's CPU busy % over the clone (tag = place, plus "-lroon"/"-lrooff" when LRO is set), labelled
with the place's `engine` (podman or jail).

Inside the container the CPU snapshots, `time -p` and the clone all run in one `sh -c` (the kernel's
CPU counters are the same inside), so container start and removal are outside both measurements.
MB/s = bytes of the pack the clone received (10^6 bytes) / `time -p` real seconds.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from lab import osfacts, proc
from lab.errors import LabError
from lab.model import RawOutput, Sample
from lab.workloads import Param, PrimaryMetrics, Traits, Workload, WorkloadContext, containers, gitrepo, register
from lab.workloads.cpu import cpu_samples, guest_script, run_guest_load
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
    require_tools,
    segment_samples,
    split_segments,
)


def clone_load(url: str) -> str:
    """The guest-side load (POSIX sh, in a subshell so its exit does not end the CPU script)."""
    return (
        '(d=$(mktemp -d "${LAB_SCRATCH:-/var/tmp}/lab-clone.XXXXXX") || exit 1; '
        f'{containers.TIMER} git clone -q {shlex.quote(url)} "$d/r" 2>&1; rc=$?; '
        'if [ $rc -eq 0 ]; then echo "pack_bytes $(cat "$d"/r/.git/objects/pack/*.pack | wc -c)"; fi; '
        'rm -rf "$d"; exit $rc)'
    )


def parse_clone_output(text: str, workload: str = "git-clone") -> Parsed:
    """clone_load's output -> seconds, pack_bytes, mb_s. A time below `time -p`'s resolution (0.00)
    or a clone without a pack file gives no rate: left out, with the reason under UNMEASURED."""
    seconds = containers.parse_time_p(text, workload)
    m = re.search(r"^pack_bytes\s+(\d+)\s*$", text or "", re.MULTILINE)
    if not m:
        raise LabError(
            f"{workload}: no 'pack_bytes' line (the clone failed?); first line of output: {first_line(text)!r}"
        )
    out: dict = {"pack_bytes": float(m.group(1))}
    if seconds <= 0:
        out[UNMEASURED] = "`time -p` measured 0.00 s, below its 0.01 s resolution: use a larger repository"
    elif out["pack_bytes"] == 0:
        out |= {"seconds": seconds, UNMEASURED: "the clone left no pack file to measure its size by"}
    else:
        out |= {"seconds": seconds, "mb_s": out["pack_bytes"] / 1e6 / seconds}
    return out


def segment_tag(place: str, lro: str) -> str:
    return place if lro == "as-is" else f"{place}-lro{lro}"


class GitClone(Workload):
    name = "git-clone"
    traits = Traits(
        summary="cloning a generated repository from git daemon on the client side, in the guest and in containers",
        params=(
            *gitrepo.PARAMS,
            Param(
                "network",
                ["guest", "default", "host"],
                'where the clone runs: "guest", "default" (a container on the engine\'s bridge) and/or "host"',
            ),
            Param("lro", ["as-is"], 'LRO on the guest\'s uplink for each place: "as-is", "on", "off"'),
            Param("port", 9418, "git daemon's port on the client side"),
            Param("timeout", 3600, "seconds a clone may take before it fails"),
        ),
        primary_metrics=PrimaryMetrics(("clone_seconds_*",), per=("network", "lro")),  # the clone's time per place
        network=True,  # git daemon runs on the client side
        client_files=True,  # it serves a repository of this machine
        container_places="network",
        tools=("git",),
    )

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        p = effective_params(self.defaults, ctx.params)
        gitrepo.check_shape(self.name, p)
        p["network"] = containers.check_places(self.name, p["network"], ctx.os)
        p["lro"] = choices(self.name, "lro", p["lro"], containers.LRO)
        int_param(self.name, "port", p["port"], 1, 65535)
        int_param(self.name, "timeout", p["timeout"], 1, 86400)
        return p

    def estimate_seconds(self, p: dict[str, Any]) -> float:
        """For `lab plan`: ~5 MB/s under TCG, ~5 s per container start."""
        mb = p["files"] * p["file_kib"] / 1024
        places = p["network"] if isinstance(p["network"], list) else [p["network"]]
        lros = p["lro"] if isinstance(p["lro"], list) else [p["lro"]]
        return len(lros) * sum(mb / 5 + (5 if pl != "guest" else 1) for pl in places)

    def plan(self, ctx: WorkloadContext) -> list[tuple[str, str, str]]:
        """[(tag, place, lro)] in the order they run."""
        p = self.params(ctx)
        return [(segment_tag(place, lro), place, lro) for place in p["network"] for lro in p["lro"]]

    def commands(self, ctx: WorkloadContext) -> list[tuple[str, str]]:
        """[(tag, the whole guest command line)] (pure: what run() sends, CPU snapshots included)."""
        p = self.params(ctx)
        load = clone_load(gitrepo.url(ctx.client.address, p["port"]))
        ticks = osfacts.facts(ctx.os).cpu_ticks_cmd
        return [
            (tag, containers.place_prefix(ctx.os, place) + guest_script(load, ticks))
            for tag, place, _ in self.plan(ctx)
        ]

    def prepare(self, ctx: WorkloadContext) -> None:
        p = self.params(ctx)
        require_tools(ctx, self)
        containers.prepare_places(ctx, self.name, p["network"])
        res = proc.run(ctx.client.argv(["git", "--version"]), timeout=30, check=False, what="git on the client side")
        if not res.ok:
            raise LabError(f"{self.name}: git does not run on the client side", hint="run `make setup`")
        ctx.facts["repo"] = gitrepo.ensure(gitrepo.check_shape(self.name, p))

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput:
        p = self.params(ctx)
        repo = ctx.facts.get("repo") or gitrepo.ensure(gitrepo.check_shape(self.name, p))
        load = clone_load(gitrepo.url(ctx.client.address, p["port"]))
        log = SegmentLog(self.name)
        for tag, place, lro in self.plan(ctx):
            prefix = containers.place_prefix(ctx.os, place)
            with containers.lro_setting(ctx, lro) as state:
                with gitrepo.serve(ctx, repo, p["port"], self.name) as server:
                    r = run_guest_load(ctx, self.name, load, timeout=p["timeout"] + 120, prefix=prefix)
                    log.extra[f"server_log.{tag}"] = server.log()
            log.extra[f"lro.{tag}"] = state["effective"]
            log.add_load(tag, r, prefix + load)
        return log.raw(
            {
                **p,
                "vcpus": ctx.vcpus,
                "repetition": repetition,
                "os": ctx.os,
                "engine": _engine_or_none(ctx.os, p["network"]),
                "url": gitrepo.url(ctx.client.address, p["port"]),
                **repo.facts(),
            }
        )

    def parse(self, raw: RawOutput) -> list[Sample]:
        samples: list[Sample] = []
        tags: list[str] = []
        tag_labels: dict[str, dict] = {}
        run_labels: dict = {}
        engine = raw.params.get("engine")
        for tag, rc, text in split_segments(raw.stdout):
            place, _, lro = tag.partition("-lro")
            try:
                r = parse_clone_output(text, self.name)
            except LabError as exc:
                msg = exc.message + (f" (exit status {rc})" if rc else "")
                raise LabError(f"{msg} [{tag}]", exc.hint) from None
            labels = flag(
                {
                    "network": place,
                    "lro": lro or "as-is",
                    "lro_effective": raw.extra.get(f"lro.{tag}", "unknown"),
                    # "engine" as podman-build's: "container" is the cell's own (lab.runner.cells)
                    "engine": engine if place != "guest" else None,
                },
                r.get(UNMEASURED, ""),
            )
            run_labels = flag_run(run_labels, tag, labels)
            tags.append(tag)
            tag_labels[tag] = labels
            samples += segment_samples(
                tag,
                r,
                [(f"clone_seconds_{tag}", "seconds", "s", False), (f"clone_mb_s_{tag}", "mb_s", "MB/s", True)],
                labels,
            )
        return samples + cpu_samples(raw, tags=tags, tag_labels=tag_labels, labels=run_labels)


def _engine_or_none(os_name: str, places: list[str]) -> str | None:
    return containers.engine(os_name) if any(p != "guest" for p in places) else None


GIT_CLONE = register(GitClone())
