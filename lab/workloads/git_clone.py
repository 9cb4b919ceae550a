"""git-clone: clone a generated repository (lab/workloads/gitrepo.py) from `git daemon` on the
client side, on the guest itself and inside a container in the guest.

`network` lists where the clone runs (lab/workloads/containers.py): "guest", "default" (podman's
default bridge network / a FreeBSD vnet jail behind NAT), "host" (podman --network=host / a jail
sharing the guest's stack). `lro` lists LRO settings for the guest's uplink to run each place with
("as-is" leaves it; "on"/"off" set it for that clone and put it back after), the FreeBSD study's knob.
Each (place, lro) is one segment with its own rows: clone_seconds_<tag>, clone_mb_s_<tag> and the
guest's CPU busy % over the clone (tag = place, plus "-lroon"/"-lrooff" when LRO is set).

Inside the container the CPU snapshots, `time -p` and the clone all run in one `sh -c` (the kernel's
CPU counters are the same inside), so container start and removal are outside both measurements.
MB/s = bytes of the pack the clone received (10^6 bytes) / `time -p` real seconds.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from lab import proc
from lab.errors import LabError
from lab.model import RawOutput, Sample
from lab.workloads import WorkloadContext, register
from lab.workloads import containers, gitrepo
from lab.workloads.cpu import (SegmentLog, choices, cpu_samples, effective_params, first_line, int_param,
                               require_guest_tool, run_guest_load, split_segments)


def clone_load(url: str) -> str:
    """The guest-side load (POSIX sh, in a subshell so its exit does not end the CPU script)."""
    return ("(d=$(mktemp -d /var/tmp/lab-clone.XXXXXX) || exit 1; "
            f"{containers.TIMER} git clone -q {shlex.quote(url)} \"$d/r\" 2>&1; rc=$?; "
            "if [ $rc -eq 0 ]; then echo \"pack_bytes $(cat \"$d\"/r/.git/objects/pack/*.pack | wc -c)\"; fi; "
            "rm -rf \"$d\"; exit $rc)")


def parse_clone_output(text: str, workload: str = "git-clone") -> dict[str, float]:
    """clone_load's output -> seconds, pack_bytes, mb_s."""
    seconds = containers.parse_time_p(text, workload)
    m = re.search(r"^pack_bytes\s+(\d+)\s*$", text or "", re.MULTILINE)
    if not m:
        raise LabError(f"{workload}: no 'pack_bytes' line (the clone failed?); first line of output: "
                       f"{first_line(text)!r}")
    pack = float(m.group(1))
    if seconds <= 0:
        raise LabError(f"{workload}: `time -p` says the clone took {seconds} s")
    return {"seconds": seconds, "pack_bytes": pack, "mb_s": pack / 1e6 / seconds}


def segment_tag(place: str, lro: str) -> str:
    return place if lro == "as-is" else f"{place}-lro{lro}"


class GitClone:
    name = "git-clone"
    defaults: dict[str, Any] = {"files": 2000, "file_kib": 16, "commits": 4,
                                "network": ["guest", "default", "host"], "lro": ["as-is"],
                                "port": 9418, "timeout": 3600}

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
        from lab import osfacts
        from lab.workloads.cpu import guest_script

        p = self.params(ctx)
        load = clone_load(gitrepo.url(ctx.client.address, p["port"]))
        ticks = osfacts.facts(ctx.os).cpu_ticks_cmd
        return [(tag, containers.place_prefix(ctx.os, place) + guest_script(load, ticks))
                for tag, place, _ in self.plan(ctx)]

    def prepare(self, ctx: WorkloadContext) -> None:
        p = self.params(ctx)
        require_guest_tool(ctx, "git", self.name)
        prepare_places(ctx, self.name, p["network"])
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
            with lro_setting(ctx, lro) as state:
                with gitrepo.serve(ctx, repo, p["port"], self.name) as server:
                    r = run_guest_load(ctx, self.name, load, timeout=p["timeout"] + 120, prefix=prefix)
                    log.extra[f"server_log.{tag}"] = server.log()
            log.extra[f"lro.{tag}"] = state["effective"]
            log.add_load(tag, r, prefix + load)
        return log.raw({**p, "vcpus": ctx.vcpus, "repetition": repetition, "os": ctx.os,
                        "engine": _engine_or_none(ctx.os, p["network"]),
                        "url": gitrepo.url(ctx.client.address, p["port"]), **repo.facts()})

    def parse(self, raw: RawOutput) -> list[Sample]:
        samples: list[Sample] = []
        tags: list[str] = []
        tag_labels: dict[str, dict] = {}
        engine = raw.params.get("engine")
        for tag, rc, text in split_segments(raw.stdout):
            place, _, lro = tag.partition("-lro")
            try:
                r = parse_clone_output(text, self.name)
            except LabError as exc:
                msg = exc.message + (f" (exit status {rc})" if rc else "")
                raise LabError(f"{msg} [{tag}]", exc.hint) from None
            labels: dict[str, Any] = {"network": place, "lro": lro or "as-is",
                                      "lro_effective": raw.extra.get(f"lro.{tag}", "unknown"),
                                      "container": engine if place != "guest" else None}
            tags.append(tag)
            tag_labels[tag] = labels
            samples += [Sample(f"clone_seconds_{tag}", r["seconds"], "s", False, dict(labels)),
                        Sample(f"clone_mb_s_{tag}", r["mb_s"], "MB/s", True, dict(labels))]
        return samples + cpu_samples(raw, tags=tags, tag_labels=tag_labels)


def _engine_or_none(os_name: str, places: list[str]) -> str | None:
    return containers.engine(os_name) if any(p != "guest" for p in places) else None


def prepare_places(ctx: WorkloadContext, workload: str, places: list[str]) -> None:
    """What the places need in the guest: `time`, and podman with the base image (Linux) or the
    jails (FreeBSD, made here unless they exist)."""
    res = ctx.guest.run(f"test -x {containers.TIMER.split()[0]}", timeout=30, check=False)
    if res.returncode != 0:
        raise LabError(f"{workload}: {containers.TIMER.split()[0]} is not in the guest ({ctx.os})",
                       hint="add the `time` package to the golden image")
    if all(p == "guest" for p in places):
        return
    if containers.engine(ctx.os) == "podman":
        require_guest_tool(ctx, "podman", workload)
        res = ctx.guest.run(f"podman image exists {containers.BASE_IMAGE}", timeout=120, check=False)
        if res.returncode != 0:
            raise LabError(f"{workload}: the guest has no {containers.BASE_IMAGE} in podman's store",
                           hint="rebuild the golden image (`make images`): provisioning imports it")
        return
    for place in places:
        if place != "guest":
            res = ctx.guest.run("sh -c " + shlex.quote(containers.jail_setup_script(place)), timeout=120, check=False)
            if res.returncode != 0:
                raise LabError(f"{workload}: could not make the {place!r} jail: "
                               f"{first_line(res.stderr or res.stdout)}",
                               hint=f"the FreeBSD image must provide a userland with git at {containers.JAIL_ROOT}")


class lro_setting:
    """Set LRO on the guest's uplink for the block and put the previous state back after."""

    def __init__(self, ctx: WorkloadContext, setting: str):
        self.ctx, self.setting = ctx, setting
        self.state = {"before": "unknown", "effective": "unknown"}

    def _apply(self, setting: str) -> str:
        res = self.ctx.guest.run("sh -c " + shlex.quote(containers.lro_script(self.ctx.os, setting)),
                                 timeout=60, check=False)
        return containers.parse_lro(res.stdout)

    def __enter__(self) -> dict[str, str]:
        self.state["before"] = self._apply("as-is")
        if self.setting == "as-is":
            self.state["effective"] = self.state["before"]
        else:
            self.state["effective"] = self._apply(self.setting)
            if self.state["effective"] != self.setting:
                raise LabError(f"lro: asked for {self.setting}, the uplink reports {self.state['effective']}",
                               hint="the NIC or its driver cannot change LRO; drop that lro setting")
        return self.state

    def __exit__(self, *exc) -> None:
        if self.setting != "as-is" and self.state["before"] in ("on", "off") \
                and self.state["before"] != self.state["effective"]:
            self._apply(self.state["before"])


GIT_CLONE = register(GitClone())
