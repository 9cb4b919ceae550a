"""container-start: hyperfine over `podman run --rm IMAGE true`, per OCI runtime, network and store
(and `docker run --rm IMAGE true` where `engines` lists docker).

Axes inside the workload (each combination one segment, its own rows, tag
`<runtime>-<network>-<store>`, e.g. `crun-host-transient`):
  engines  podman (the default) and/or docker: docker's rows start the same base image with `docker
           run --runtime=<runtime>` (the golden image registers crun beside runc in
           /etc/docker/daemon.json). Docker keeps its containers in its daemon's store, its only one:
           its rows' last part is `docker` where podman's names its store (`crun-none-docker`), so
           `lab compare RUN --a variant=persistent --b variant=docker` pairs each podman start with
           docker's of the same runtime and network
  runtime  OCI runtimes to measure with `--runtime` (crun, runc; ocijail on FreeBSD); one the guest
           lacks gives an `na_<tag>` row instead
  network  default (podman's bridge: netavark sets up a veth and firewall rules per start), host, none
  store    persistent, or transient (`podman --transient-store`: container state on tmpfs, no
           database sync; Podman >= 4.4 — the Debian 12 image has 4.3.1, so those rows are n/a)

Rows: start_ms_<tag> (hyperfine's mean over `runs` starts, after `warmup` discarded starts),
start_stddev_ms_<tag> (with runs = 1 hyperfine reports none: an `unmeasured_<tag>` row says so),
start_min_ms_<tag>, and the guest's CPU busy % over the hyperfine run.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from lab.errors import LabError, UsageError
from lab.model import RawOutput, Sample
from lab.workloads import Param, PrimaryMetrics, Traits, Workload, WorkloadContext, containers, register
from lab.workloads.cpu import cpu_samples, run_guest_load
from lab.workloads.toolkit import (
    UNMEASURED,
    SegmentLog,
    choices,
    effective_params,
    first_line,
    int_param,
    require_tools,
    segment_samples,
    split_segments,
)

NETWORKS = ("default", "host", "none")
STORES = ("persistent", "transient")
RUNTIMES = ("crun", "runc", "ocijail")
ENGINES = ("podman", "docker")
DOCKER_SOCKET = "/var/run/docker.sock"
# Each measurement writes hyperfine's JSON in a directory of its own, made by mktemp (a fresh name,
# mode 0700): never a fixed path another user of the machine (the bare-metal cell's host) could
# plant a symbolic link at. $LAB_SCRATCH is the bare-metal cell's private directory; a guest's /var/tmp.
SCRATCH = 'd=$(mktemp -d "${LAB_SCRATCH:-/var/tmp}/lab-hyperfine.XXXXXX") || exit 1'


def start_argv(
    runtime: str, network: str, store: str, image: str = containers.BASE_IMAGE, engine: str = "podman"
) -> list[str]:
    if engine == "docker":  # "default" passes no --network (docker's bridge), as for podman
        net = [f"--network={network}"] if network != "default" else []
        return ["docker", "run", "--rm", f"--runtime={runtime}", *net, image, "true"]
    return containers.podman_run(network, runtime=runtime, transient=store == "transient", image=image) + ["true"]


def split_tag(tag: str) -> tuple[str, str, str, str]:
    """Pure: a combination's tag -> (engine, runtime, network, store); docker's store is "docker"."""
    parts = tag.split("-")
    if len(parts) != 3:
        raise LabError(f"container-start: not a combination tag: {tag!r}")
    return ("docker" if parts[2] == "docker" else "podman", parts[0], parts[1], parts[2])


def parse_docker_runtimes(text: str) -> list[str]:
    """Pure: `docker info --format '{{json .Runtimes}}'` -> the names of the OCI runtimes docker has."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, TypeError, ValueError):
        return []
    return sorted(doc) if isinstance(doc, dict) else []


def hyperfine_load(command: list[str], runs: int, warmup: int) -> str:
    """hyperfine without a shell (-N) exporting JSON, which the load then prints."""
    argv = ["hyperfine", "-N", "--style", "none", "--runs", str(runs), "--warmup", str(warmup)]
    return (
        f'({SCRATCH}; {shlex.join(argv)} --export-json "$d/out.json" {shlex.quote(shlex.join(command))} '
        '>/dev/null 2>"$d/err"; rc=$?; '
        'if [ -s "$d/out.json" ]; then cat "$d/out.json"; else cat "$d/err"; fi; rm -rf "$d"; exit $rc)'
    )


def parse_hyperfine_json(text: str, workload: str = "container-start") -> dict[str, Any]:
    """hyperfine --export-json (one command) -> mean/stddev/median/min/max in ms, runs, exit codes.
    hyperfine's null stddev (one run) is left out, with the reason under UNMEASURED."""
    try:
        doc = json.loads(text)
        res = doc["results"]
    except (json.JSONDecodeError, TypeError, KeyError, ValueError):
        raise LabError(
            f"{workload}: not hyperfine JSON; first line of output: {first_line(text)!r}",
            hint="the raw output is stored; fix the parser and run `lab reparse`",
        ) from None
    if len(res) != 1:
        raise LabError(f"{workload}: expected one hyperfine result, got {len(res)}")
    r = res[0]
    times = r.get("times") or []
    codes = r.get("exit_codes") or []
    if not times:
        raise LabError(f"{workload}: hyperfine measured no run of {r.get('command')!r}")
    if any(c != 0 for c in codes):
        raise LabError(
            f"{workload}: {r.get('command')!r} failed in {sum(1 for c in codes if c)} of "
            f"{len(codes)} runs (exit codes {sorted(set(codes))})"
        )
    out: dict[str, Any] = {
        k: float(r[k]) * 1000 for k in ("mean", "median", "min", "max", "stddev") if isinstance(r.get(k), (int, float))
    }
    if "mean" not in out or "min" not in out:
        raise LabError(f"{workload}: hyperfine reported no mean/min for {r.get('command')!r}")
    if "stddev" not in out:  # null for a single run: there is no spread to report, not a spread of 0
        out[UNMEASURED] = f"hyperfine reports no standard deviation for {len(times)} run(s)"
    out["runs"] = len(times)
    out["command"] = r.get("command", "")
    return out


class ContainerStart(Workload):
    name = "container-start"
    traits = Traits(
        summary="container start time (hyperfine) per engine, OCI runtime, network and store",
        params=(
            Param("runtime", ["crun", "runc"], "OCI runtimes to start with (crun, runc; ocijail on FreeBSD)"),
            Param("engines", ["podman"], "the engines that start them: podman, docker (one the guest lacks is n/a)"),
            Param("network", ["default", "host", "none"], "the container's network: default (a bridge), host, none"),
            Param("store", ["persistent", "transient"], "podman's container store: persistent, or transient (tmpfs)"),
            Param("runs", 5, "measured starts per combination (1..1000)"),
            Param("warmup", 1, "discarded starts before them (0..1000)"),
        ),
        # the mean start time of each runtime x network x store
        primary_metrics=PrimaryMetrics(("start_ms_*",), per=("engines", "runtime", "network", "store")),
        makes_containers=True,
        tools=("podman", "hyperfine"),
    )

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        p = effective_params(self.defaults, ctx.params)
        for key, allowed in (("runtime", RUNTIMES), ("engines", ENGINES), ("network", NETWORKS), ("store", STORES)):
            p[key] = choices(self.name, key, p[key], allowed)
        int_param(self.name, "runs", p["runs"], 1, 1000)
        int_param(self.name, "warmup", p["warmup"], 0, 1000)
        return p

    def estimate_seconds(self, p: dict[str, Any]) -> float:
        """For `lab plan`: ~2 s per start under TCG (transient rows are n/a on podman < 4.4)."""
        stores = len(p["store"]) * ("podman" in p["engines"]) + ("docker" in p["engines"])
        starts = len(p["runtime"]) * len(p["network"]) * stores
        return starts * (p["runs"] + p["warmup"]) * 2 + 5 + (20 if "docker" in p["engines"] else 0)  # dockerd's start

    def plan(self, ctx: WorkloadContext) -> list[tuple[str, str, str, str, str]]:
        """(tag, engine, runtime, network, store) of every combination."""
        p = self.params(ctx)
        return [
            (f"{rt}-{net}-{st}", e, rt, net, st)
            for e in p["engines"]
            for rt in p["runtime"]
            for net in p["network"]
            for st in (p["store"] if e == "podman" else ["docker"])
        ]

    def commands(self, ctx: WorkloadContext) -> list[tuple[str, str]]:
        p = self.params(ctx)
        return [
            (tag, hyperfine_load(start_argv(rt, net, st, engine=e), p["runs"], p["warmup"]))
            for tag, e, rt, net, st in self.plan(ctx)
        ]

    def prepare(self, ctx: WorkloadContext) -> None:
        p = self.params(ctx)
        if containers.family(ctx.os) not in ("linux", "freebsd"):
            raise UsageError(f"{self.name}: no podman on {ctx.os}")
        require_tools(ctx, self)
        res = ctx.guest.run(f"podman image exists {containers.BASE_IMAGE}", timeout=120, check=False)
        if res.returncode != 0:
            raise LabError(
                f"{self.name}: the guest has no {containers.BASE_IMAGE} in podman's store",
                hint="rebuild the golden image (`make images`): provisioning imports it",
            )
        have: dict[str, str] = {}
        for rt in p["runtime"]:
            r = ctx.guest.run(f"sh -c {shlex.quote(f'command -v {rt}')}", timeout=30, check=False)
            if r.returncode != 0 or not r.stdout.strip():
                have[rt] = ""
                continue
            v = ctx.guest.run(f"{rt} --version", timeout=30, check=False)
            have[rt] = first_line(v.stdout) if v.returncode == 0 else rt
        ctx.facts["runtimes"] = have
        # podman refuses a global flag it does not know: that is how a release without
        # --transient-store (< 4.4) shows.
        t = ctx.guest.run("podman --transient-store version --format '{{.Client.Version}}'", timeout=120, check=False)
        ctx.facts["transient"] = "" if t.returncode == 0 else first_line(t.stderr or t.stdout)
        v = ctx.guest.run("podman version --format '{{.Client.Version}}'", timeout=120, check=False)
        ctx.facts["podman"] = v.stdout.strip()
        if "docker" in p["engines"]:
            ctx.facts["docker"] = probe_docker(ctx)

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput:
        p = self.params(ctx)
        if "runtimes" not in ctx.facts:
            self.prepare(ctx)
        log = SegmentLog(self.name)
        for tag, engine, rt, net, st in self.plan(ctx):
            if not ctx.facts["runtimes"].get(rt):
                log.extra[f"na.{tag}"] = f"OCI runtime {rt} is not installed in the guest"
                continue
            if engine == "docker" and (why := docker_na(ctx.facts["docker"], rt)):
                log.extra[f"na.{tag}"] = why
                continue
            if engine == "podman" and st == "transient" and ctx.facts.get("transient"):
                log.extra[f"na.{tag}"] = (
                    f"podman {ctx.facts.get('podman') or '?'} has no --transient-store ({ctx.facts['transient']})"
                )
                continue
            load = hyperfine_load(start_argv(rt, net, st, engine=engine), p["runs"], p["warmup"])
            timeout = (p["runs"] + p["warmup"]) * 120 + 60
            log.add_load(tag, run_guest_load(ctx, self.name, load, timeout=timeout), load)
            log.extra[f"runtime_version.{tag}"] = ctx.facts["runtimes"][rt]
        return log.raw(
            {
                **p,
                "vcpus": ctx.vcpus,
                "repetition": repetition,
                "os": ctx.os,
                "podman": ctx.facts.get("podman", ""),
                "docker": (ctx.facts.get("docker") or {}).get("version", ""),
                "image": containers.BASE_IMAGE,
            }
        )

    def parse(self, raw: RawOutput) -> list[Sample]:
        samples: list[Sample] = []
        tags: list[str] = []
        tag_labels: dict[str, dict] = {}
        if raw.stdout.strip():
            for tag, rc, text in split_segments(raw.stdout):
                engine, rt, net, st = split_tag(tag)
                try:
                    r = parse_hyperfine_json(text, self.name)
                except LabError as exc:
                    msg = exc.message + (f" (hyperfine exit status {rc})" if rc else "")
                    raise LabError(f"{msg} [{tag}]", exc.hint) from None
                labels = {
                    "engine": engine,
                    "runtime": rt,
                    "runtime_version": raw.extra.get(f"runtime_version.{tag}", ""),
                    "network": net,
                    "store": st,
                    "runs": r["runs"],
                }
                tags.append(tag)
                tag_labels[tag] = labels
                # A missing stddev flags its own row only: the mean of one run is still a measurement.
                samples += segment_samples(
                    tag,
                    r,
                    [
                        (f"start_ms_{tag}", "mean", "ms", False),
                        (f"start_stddev_ms_{tag}", "stddev", "ms", None),
                        (f"start_min_ms_{tag}", "min", "ms", False),
                    ],
                    labels,
                )
        for key, reason in sorted(raw.extra.items()):
            if key.startswith("na."):
                tag = key[3:]
                engine, rt, net, st = split_tag(tag)
                labels = {"engine": engine, "runtime": rt, "network": net, "store": st, "na": reason}
                samples.append(Sample(f"na_{tag}", 1.0, "n/a", None, labels))
        if tags:
            samples += cpu_samples(raw, tags=tags, tag_labels=tag_labels)
        return samples


def probe_docker(ctx: WorkloadContext) -> dict[str, Any]:
    """Docker where the guest has it: {"missing": why not} or its server version, the OCI runtimes
    it has registered and whether its store has the base image. Asking starts a socket-activated
    daemon (~15 s under TCG): prepare pays it, never a measurement."""
    if ctx.guest.run("sh -c 'command -v docker'", timeout=30, check=False).returncode != 0:
        return {"missing": "docker is not installed in the guest"}
    if ctx.guest.run(f"test -S {DOCKER_SOCKET}", timeout=30, check=False).returncode != 0:
        return {"missing": f"docker has no daemon socket here ({DOCKER_SOCKET})"}
    info = ctx.guest.run("docker info --format '{{json .Runtimes}}'", timeout=300, check=False)
    if info.returncode != 0:
        return {"missing": f"docker's daemon does not answer: {first_line(info.stderr or info.stdout)}"}
    version = ctx.guest.run("docker version --format '{{.Server.Version}}'", timeout=120, check=False)
    image = ctx.guest.run(f"docker image inspect {containers.BASE_IMAGE} >/dev/null", timeout=120, check=False)
    return {
        "version": version.stdout.strip(),
        "runtimes": parse_docker_runtimes(info.stdout),
        "image": image.returncode == 0,
    }


def docker_na(docker: dict[str, Any], runtime: str) -> str:
    """Pure: why docker cannot start a container with this runtime ("" if it can)."""
    if docker.get("missing"):
        return docker["missing"]
    if not docker.get("image"):
        return f"docker's store has no {containers.BASE_IMAGE} (rebuild the golden image)"
    if runtime not in docker.get("runtimes", []):
        return f"docker has no OCI runtime {runtime!r} registered (its daemon.json `runtimes`)"
    return ""


CONTAINER_START = register(ContainerStart())
