"""The Workload seam and the workload registry.

A workload is `prepare(ctx)`, `run(ctx, rep) -> RawOutput`, `parse(raw) -> [Sample]`. `parse` is
pure: it sees only the RawOutput (stdout, stderr, params, extra), so `lab reparse` can rebuild
samples from stored raw outputs after a parser fix.

What a workload is and can do is declared, never probed: each one's `traits` (a Traits record) says
what it measures, its parameters (each with its default and a one-line meaning: the config accepts
exactly those keys in [suite.params.<name>], and the docs' reference is made from them), its
headline metrics, and what the runner, the plan and the checks must know of it (its load goes
through the client side, it starts containers, it is served by the machine's sshd or nginx, ...).

A new workload is one module in this package, a subclass of Workload with its traits, ending with
`NAME = register(TheWorkload())`, and one line in REGISTRY below (as a backend is one line in
lab.backends.REGISTRY): the module is imported the first time its name is asked for. The config
calls its `params(ctx)` to check the values for every guest OS of the matrix before anything is
made. One module may register a family (sysbench-cpu and sysbench-memory). Build it from the
toolkit, the modules here that register nothing:

  cpu          guest CPU utilisation around a load (run_guest_load, snapshot, cpu_samples)
  toolkit      parameters, segments (SegmentLog), the guest tool check, a server on the client side,
               GuestCommand (a workload whose repetition is one command line in the guest: ping)
  containers   where a load runs in the guest: itself, a podman container or a FreeBSD jail; LRO
  gitrepo      the generated git repository and the git daemon that serves it
"""

from __future__ import annotations

import abc
import fnmatch
import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from lab.errors import UsageError
from lab.guest import Machine
from lab.model import Client, RawOutput, Sample

# name -> the module that registers it, imported on first use
REGISTRY: dict[str, str] = {
    "bulk-http": "lab.workloads.bulk_http",
    "container-start": "lab.workloads.container_start",
    "git-clone": "lab.workloads.git_clone",
    "http": "lab.workloads.http",
    "https": "lab.workloads.http",
    "idle": "lab.workloads.idle",
    "iperf3-tcp": "lab.workloads.iperf3",
    "iperf3-udp": "lab.workloads.iperf3",
    "ping": "lab.workloads.ping",
    "podman-build": "lab.workloads.podman_build",
    "scp": "lab.workloads.scp",
    "sysbench-cpu": "lab.workloads.sysbench",
    "sysbench-memory": "lab.workloads.sysbench",
}

REP_OVERHEAD_S = 3.0  # SSH, parsing and storing around a workload's own length (Workload.estimate_seconds)


@dataclass
class WorkloadContext:
    guest: Machine  # the machine under test (lab.guest: a VM, the bare-metal host, a container)
    client: Client  # where the load generator runs
    os: str  # guest OS key in lab.osfacts ("debian", "freebsd", ...)
    vcpus: int
    params: dict[str, Any] = field(default_factory=dict)  # from [suite.params.<workload>]
    guest_address: str = ""
    # What prepare() found out about the guest (features, versions) for run() to use and record.
    facts: dict[str, Any] = field(default_factory=dict)
    # The guest's host keys as a known_hosts file (the one the Guest checks with): workloads that open
    # their own SSH connection (scp) check the guest with it. None: not checked.
    known_hosts: Path | None = None


@dataclass(frozen=True)
class PrimaryMetrics:
    """A workload's headline metrics: the rows a comparison answers (better / worse / same /
    unknown, corrected together for multiple testing: lab.compare); its other metrics are shown as
    exploratory. `patterns` are shell-style patterns of metric names ("throughput_mbit_s_*": one
    per direction); `per` names the list-valued parameters that make one such metric per value (the
    directions, the connection counts), so `lab plan` can count the rows a comparison will test."""

    patterns: tuple[str, ...]
    per: tuple[str, ...] = ()
    # patterns of the metrics that add up to a primary one, with the same "*" (a build's steps:
    # "clone_seconds_*" for "build_seconds_*"): `lab explain` names the step that carries a gap
    parts: tuple[str, ...] = ()

    def pattern_of(self, metric: str) -> str | None:
        """The pattern this metric is primary by, or None: exploratory."""
        return next((p for p in self.patterns if fnmatch.fnmatchcase(metric, p)), None)

    def count(self, params: dict[str, Any]) -> int:
        """How many primary metrics a repetition makes with these (effective) parameters."""
        sizes = (len(v) if isinstance(v := params.get(k), (list, tuple)) else 1 for k in self.per)
        return len(self.patterns) * math.prod(sizes)


@dataclass(frozen=True)
class Param:
    """One key of [suite.params.<workload>]: its default and what it means, in one line. A value
    given in lab.toml must have the default's type (an integer where a float is the default)."""

    name: str
    default: Any
    meaning: str

    @property
    def type(self) -> type:
        return type(self.default)


@dataclass(frozen=True)
class Traits:
    """What a workload is and can do, declared once beside its code."""

    summary: str  # what it measures, one line
    params: tuple[Param, ...]
    # its headline metrics: the rows a comparison answers (the rest, CPU busy % and latencies, are
    # exploratory)
    primary_metrics: PrimaryMetrics
    # its load goes through the client side (a load generator or a server there): lanes sharing a
    # client take turns on it (lab.runner.measure), and its samples carry the client's load
    network: bool = False
    # its client side uses files of this machine (a repository, the lab's key): it runs only with
    # the "local" client, never on a client VM (lab.check)
    client_files: bool = False
    # its samples are the host's load over the repetition: the runner folds the host's load window
    # into the raw output, so that `lab reparse` rebuilds them too (idle)
    records_host_load: bool = False
    # it starts containers of its own (nested podman in a container cell; none in a zone)
    makes_containers: bool = False
    # the parameter that lists where its load runs: a place other than "guest" is a container (or
    # jail) of its own, as makes_containers (git-clone's network)
    container_places: str = ""
    # its load is the machine's sshd, reached with an SSH connection of its own: a container cell
    # runs an sshd for it (lab.isolation); the bare-metal host is not reached by SSH
    serves_ssh: bool = False
    # its load is the machine's nginx serving the image's site (http, https): the bare-metal cell
    # starts one for it (lab.runner.cells)
    serves_web: bool = False
    # what it runs in the guest (keys of lab.osfacts.TOOLS): its prepare checks each is there, and
    # says which package brings a missing one (toolkit.require_tools)
    tools: tuple[str, ...] = ()

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)


class Workload(abc.ABC):
    """What the config and the runner call. Subclasses set `name` and `traits`."""

    name: ClassVar[str]
    traits: ClassVar[Traits]

    @property
    def defaults(self) -> dict[str, Any]:
        """The parameters' defaults; [suite.params.<name>] overrides them."""
        return {p.name: p.default for p in self.traits.params}

    @property
    def primary_metrics(self) -> PrimaryMetrics:
        """Its headline metrics, as its traits declare them."""
        return self.traits.primary_metrics

    @abc.abstractmethod
    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        """The effective parameters, checked (UsageError) for this guest OS and vCPU count."""

    def estimate_seconds(self, params: dict[str, Any]) -> float:
        """One repetition's length for `lab plan` (before any run measured it): by default its
        "time" or "duration" parameter and the overhead around a run."""
        return float(params.get("time", params.get("duration", 10))) + REP_OVERHEAD_S

    def own_containers(self, params: dict[str, Any]) -> str:
        """Why this workload with `params` starts containers of its own ("" when it does not)."""
        if self.traits.makes_containers:
            return "it starts containers itself"
        places = params.get(self.traits.container_places) if self.traits.container_places else None
        places = places if isinstance(places, list) else [places] if isinstance(places, str) else []
        return "its network places are containers of its own" if any(p != "guest" for p in places) else ""

    @abc.abstractmethod
    def prepare(self, ctx: WorkloadContext) -> None: ...

    @abc.abstractmethod
    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput: ...

    @abc.abstractmethod
    def parse(self, raw: RawOutput) -> list[Sample]: ...


_loaded: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    """A workload module's last line. A name REGISTRY lacks is added (tests register their fakes)."""
    if not isinstance(workload, Workload) or not isinstance(workload.traits, Traits):
        raise TypeError(f"{workload!r} is not a Workload with declared traits")
    _loaded[workload.name] = workload
    REGISTRY.setdefault(workload.name, type(workload).__module__)
    return workload


def unregister(name: str) -> None:
    """Forget a workload registered outside REGISTRY's modules (a test's fake)."""
    _loaded.pop(name, None)
    if not REGISTRY.get(name, "").startswith(f"{__name__}."):
        REGISTRY.pop(name, None)


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> Workload:
    """The workload called `name`, its module imported on first use."""
    if name not in _loaded:
        if name not in REGISTRY:
            raise UsageError(f"unknown workload {name!r}; known: {', '.join(sorted(REGISTRY))}")
        importlib.import_module(REGISTRY[name])
        if name not in _loaded:
            raise LookupError(f"{REGISTRY[name]} does not register workload {name!r}")
    return _loaded[name]


def load_all() -> dict[str, Workload]:
    """Every workload of the registry, by name."""
    return {name: get(name) for name in REGISTRY}
