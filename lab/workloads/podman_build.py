"""podman-build: a Containerfile of the study's shape, built with the time of every step.

Steps (Linux; FreeBSD's Containerfile has the same steps with pkg and cc):
  from      FROM the base image in the guest's store (localhost/lab-base, made at image build)
  packages  install packages offline: `dpkg -i` the .debs the base image carries (make, tcc, libc6-dev)
  clone     git clone the generated repository from git daemon on the client side
  make      make (compiles the C program, checksums every data file)
  install   make install
  copy      COPY a small extra source file from the build context
  extra     build and run it (the small extra build)
and `commit` (the final commit and tag) and `build` (the whole build).

`network` lists "default" (the engine's default for RUN steps) and "host" (--network=host); `engines`
lists "podman" and "docker": an engine the guest lacks gives an `na_<tag>` row (value 1) instead of
timings (the Debian image has both). Docker runs its legacy builder (DOCKER_BUILDKIT=0), whose
"Step k/N :" lines time the same way as podman's "STEP k/N:".

Every output line is stamped in the guest as it arrives (bash's $EPOCHREALTIME, no process per
line; where bash is missing, `date +%s`, 1 s resolution); a step lasts from its STEP line to the next
(the last one to COMMIT / "Successfully built"). The built image is removed after each build.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from lab.errors import LabError, UsageError
from lab.model import RawOutput, Sample
from lab.workloads import Param, PrimaryMetrics, Traits, Workload, WorkloadContext, containers, gitrepo, register
from lab.workloads.cpu import cpu_samples, run_guest_load
from lab.workloads.toolkit import SegmentLog, choices, effective_params, first_line, int_param, split_segments

STEPS = ("from", "packages", "clone", "make", "install", "copy", "extra")
# The build context: a directory of its own per cell, made by mktemp in the guest (a fresh name, mode
# 0700), never a fixed path: on the bare-metal cell the "guest" is this machine, whose /var/tmp any
# local user may write to (a symbolic link planted at a fixed name would take root's writes
# elsewhere). $LAB_SCRATCH is the bare-metal cell's private directory; a guest's /var/tmp.
MAKE_CONTEXT = 'mktemp -d "${LAB_SCRATCH:-/var/tmp}/lab-build.XXXXXX"'
CONTEXT_DIR = "/var/tmp/lab-build.XXXXXX"  # what the commands show before prepare() made the real one
BUILD_TAG = "localhost/lab-build:latest"
START, RC = "@@lab-build-start@@", re.compile(r"^@@lab-build-rc=(-?\d+)@@$")
EXTRA_C = (
    "#include <stdio.h>\n"
    "int main(void) { unsigned long s = 0; for (unsigned long i = 0; i < 3000000UL; i++) s += i % 7;\n"
    '    printf("lab-extra %lu\\n", s); return 0; }\n'
)
ENGINES = ("podman", "docker")
DOCKER_SOCKET = "/var/run/docker.sock"
NETWORKS = ("default", "host")


def containerfile(os_name: str, url: str) -> str:
    """The Containerfile for this OS, one instruction per entry of STEPS."""
    fam = containers.family(os_name)
    if fam == "linux":
        install, cc = f"dpkg -i {containers.CACHE_DIR}/*.deb", "tcc"
        make = "make -C /src CC=tcc"
    elif fam == "freebsd":  # podman on FreeBSD (ocijail): pkg add from the image's cache, base clang
        install, cc = "pkg add /var/cache/lab-pkgs/*.pkg", "cc"
        make = "make -C /src"
    else:
        raise UsageError(f"podman-build: no container engine on {os_name}")
    return (
        f"FROM {containers.BASE_IMAGE}\n"
        f"RUN {install}\n"
        f"RUN git clone -q {url} /src\n"
        f"RUN {make}\n"
        f"RUN {make} install PREFIX=/usr/local\n"
        "COPY extra.c /extra/extra.c\n"
        f"RUN {cc} -o /usr/local/bin/lab-extra /extra/extra.c && /usr/local/bin/lab-extra\n"
    )


def stamper(os_name: str) -> str:
    """A filter that prefixes every line with the time it arrived (seconds since the epoch)."""
    if containers.family(os_name) == "linux":
        return "bash -c " + shlex.quote('while IFS= read -r l; do printf "%s %s\\n" "$EPOCHREALTIME" "$l"; done')
    return "sh -c " + shlex.quote('while IFS= read -r l; do printf "%s %s\\n" "$(date +%s)" "$l"; done')


def build_load(os_name: str, engine: str, network: str, context: str = CONTEXT_DIR) -> str:
    """The guest-side load: build in `context`, stamped line by line, then remove the image."""
    argv = [engine, "build"]
    if engine == "podman":
        argv += ["--pull=never"]
    argv += ["--no-cache", "-t", BUILD_TAG, "-f", "Containerfile"]
    if network == "host":
        argv.append("--network=host")
    argv.append(".")
    env = "DOCKER_BUILDKIT=0 " if engine == "docker" else ""
    cleanup = f"{engine} rmi -f {BUILD_TAG} >/dev/null 2>&1; "
    if engine == "podman":
        cleanup += "podman image prune -f >/dev/null 2>&1; "
    return (
        f'(cd {shlex.quote(context)} && {{ echo {START}; {env}{shlex.join(argv)} 2>&1; echo "@@lab-build-rc=$?@@"; '
        f"{cleanup}}} | {stamper(os_name)})"
    )


_STEP = re.compile(r"^(?:STEP|Step) (\d+)/(\d+) ?: ?(.*)$")
_END = re.compile(r"^(?:COMMIT\b|Successfully built\b)")


def parse_build_output(text: str, steps: tuple[str, ...] = STEPS, workload: str = "podman-build") -> dict[str, float]:
    """Stamped build output -> {<step>_seconds, commit_seconds, build_seconds, rc}."""
    lines = []
    for raw_line in (text or "").splitlines():
        ts, _, rest = raw_line.partition(" ")
        try:
            lines.append((float(ts.replace(",", ".")), rest))
        except ValueError:
            continue  # not a stamped line
    if not lines or lines[0][1] != START:
        raise LabError(
            f"{workload}: no stamped build output; first line of output: {first_line(text)!r}",
            hint="the raw output is stored; fix the parser and run `lab reparse`",
        )
    t0 = lines[0][0]
    rc_at = next(((t, int(m.group(1))) for t, s in lines if (m := RC.match(s))), None)
    if rc_at is None:
        raise LabError(f"{workload}: the build output has no exit status line (cut short?)")
    starts: dict[int, float] = {}
    total_steps = None
    end_at = None
    for t, s in lines:
        m = _STEP.match(s)
        if m and int(m.group(1)) not in starts:
            starts[int(m.group(1))] = t
            total_steps = int(m.group(2))
        elif _END.match(s) and end_at is None and starts:
            end_at = t
    out: dict[str, float] = {"rc": float(rc_at[1]), "build_seconds": rc_at[0] - t0}
    if rc_at[1] != 0:
        tail = [s for _, s in lines if s and not RC.match(s)][-3:]
        raise LabError(f"{workload}: the build failed with exit status {rc_at[1]}: {' | '.join(tail)}")
    if total_steps != len(steps) or sorted(starts) != list(range(1, len(steps) + 1)):
        raise LabError(f"{workload}: expected {len(steps)} steps, the output shows {sorted(starts)} of {total_steps}")
    if end_at is None:
        raise LabError(f"{workload}: no COMMIT / 'Successfully built' line after the last step")
    for k, name in enumerate(steps, start=1):
        stop = starts.get(k + 1, end_at)
        out[f"{name}_seconds"] = stop - starts[k]
    out["commit_seconds"] = rc_at[0] - end_at
    return out


def probe_engines(ctx: WorkloadContext, engines: list[str]) -> dict[str, bool]:
    """Which engines the guest can build with; why not is put in ctx.facts["engines_missing"]."""
    have, missing = {}, {}
    for e in engines:
        res = ctx.guest.run(f"sh -c {shlex.quote(f'command -v {e}')}", timeout=30, check=False)
        have[e] = res.returncode == 0 and bool(res.stdout.strip())
        if not have[e]:
            missing[e] = f"{e} is not installed in the guest"
        # inside a container cell the machine's docker CLI is there (its /usr), not its daemon
        elif e == "docker" and ctx.guest.run(f"test -S {DOCKER_SOCKET}", timeout=30, check=False).returncode:
            have[e], missing[e] = False, f"docker has no daemon socket here ({DOCKER_SOCKET})"
    ctx.facts["engines_missing"] = missing
    return have


class PodmanBuild(Workload):
    name = "podman-build"
    traits = Traits(
        summary="a container image build of the study's shape, with the time of every step",
        params=(
            *gitrepo.PARAMS,
            Param("network", ["default", "host"], 'the RUN steps\' network: "default" (the engine\'s) and/or "host"'),
            Param("engines", ["podman", "docker"], "the engines to build with (one the guest lacks is n/a)"),
            Param("port", 9418, "git daemon's port on the client side (the clone step)"),
            Param("timeout", 3600, "seconds a build may take before it fails"),
        ),
        # the whole build's time per engine and network (its steps are exploratory)
        primary_metrics=PrimaryMetrics(
            ("build_seconds_*",), per=("engines", "network"), parts=tuple(f"{s}_seconds_*" for s in (*STEPS, "commit"))
        ),
        network=True,  # the clone step's git daemon runs on the client side
        client_files=True,  # it serves a repository of this machine
        makes_containers=True,
    )

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        p = effective_params(self.defaults, ctx.params)
        gitrepo.check_shape(self.name, p)
        p["network"] = choices(self.name, "network", p["network"], NETWORKS)
        p["engines"] = choices(self.name, "engines", p["engines"], ENGINES)
        int_param(self.name, "port", p["port"], 1, 65535)
        int_param(self.name, "timeout", p["timeout"], 1, 86400)
        containers.engine(ctx.os)
        return p

    def estimate_seconds(self, p: dict[str, Any]) -> float:
        """For `lab plan`: ~90 s of the engine and dpkg under TCG plus the clone and make at ~3 MB/s,
        per engine and network."""
        mb = p["files"] * p["file_kib"] / 1024
        return len(p["engines"]) * len(p["network"]) * (90 + mb / 3)

    def plan(self, ctx: WorkloadContext) -> list[tuple[str, str, str]]:
        p = self.params(ctx)
        return [(f"{e}-{n}", e, n) for e in p["engines"] for n in p["network"]]

    def commands(self, ctx: WorkloadContext) -> list[tuple[str, str]]:
        context = ctx.facts.get("context_dir", CONTEXT_DIR)
        return [(tag, build_load(ctx.os, e, n, context)) for tag, e, n in self.plan(ctx)]

    def prepare(self, ctx: WorkloadContext) -> None:
        p = self.params(ctx)
        containers.prepare_places(ctx, self.name, ["default"])
        have = probe_engines(ctx, p["engines"])
        if have.get("docker"):  # give Docker the same base image, from podman's store
            ctx.guest.run(
                f"docker image inspect {containers.BASE_IMAGE} >/dev/null 2>&1 || "
                f"podman save {containers.BASE_IMAGE} | docker load",
                timeout=600,
            )
        ctx.facts["engines"] = have
        ctx.facts["repo"] = gitrepo.ensure(gitrepo.check_shape(self.name, p))
        url = gitrepo.url(ctx.client.address, p["port"])
        context = ctx.guest.run(MAKE_CONTEXT, timeout=30).stdout.strip()
        if not re.fullmatch(r"/[A-Za-z0-9_./-]+", context):
            raise LabError(f"{self.name}: mktemp gave no directory for the build context: {context!r}")
        ctx.facts["context_dir"] = context
        ctx.guest.put_text(containerfile(ctx.os, url), f"{context}/Containerfile")
        ctx.guest.put_text(EXTRA_C, f"{context}/extra.c")

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput:
        p = self.params(ctx)
        if "engines" not in ctx.facts:
            self.prepare(ctx)
        repo = ctx.facts["repo"]
        log = SegmentLog(self.name)
        for tag, engine, network in self.plan(ctx):
            if not ctx.facts["engines"].get(engine):
                log.extra[f"na.{tag}"] = ctx.facts["engines_missing"][engine]
                continue
            load = build_load(ctx.os, engine, network, ctx.facts["context_dir"])
            with gitrepo.serve(ctx, repo, p["port"], self.name) as server:
                r = run_guest_load(ctx, self.name, load, timeout=p["timeout"] + 300)
                log.extra[f"server_log.{tag}"] = server.log()
            log.add_load(tag, r, load)
        return log.raw(
            {
                **p,
                "vcpus": ctx.vcpus,
                "repetition": repetition,
                "os": ctx.os,
                "steps": list(STEPS),
                "containerfile": containerfile(ctx.os, gitrepo.url(ctx.client.address, p["port"])),
                **repo.facts(),
            }
        )

    def parse(self, raw: RawOutput) -> list[Sample]:
        samples: list[Sample] = []
        tags: list[str] = []
        tag_labels: dict[str, dict] = {}
        steps = tuple(raw.params.get("steps") or STEPS)
        if raw.stdout.strip():
            for tag, _rc, text in split_segments(raw.stdout):
                engine, _, network = tag.partition("-")
                try:
                    r = parse_build_output(text, steps, self.name)
                except LabError as exc:
                    raise LabError(f"{exc.message} [{tag}]", exc.hint) from None
                labels = {"engine": engine, "network": network}
                tags.append(tag)
                tag_labels[tag] = labels
                for name in (*steps, "commit", "build"):
                    samples.append(Sample(f"{name}_seconds_{tag}", r[f"{name}_seconds"], "s", False, dict(labels)))
        for key, reason in sorted(raw.extra.items()):
            if key.startswith("na."):
                tag = key[3:]
                engine, _, network = tag.partition("-")
                samples.append(
                    Sample(f"na_{tag}", 1.0, "n/a", None, {"engine": engine, "network": network, "na": reason})
                )
        if tags:
            samples += cpu_samples(raw, tags=tags, tag_labels=tag_labels)
        return samples


PODMAN_BUILD = register(PodmanBuild())
