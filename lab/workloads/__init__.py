"""The Workload seam and the workload registry.

A workload is `prepare(ctx)`, `run(ctx, rep) -> RawOutput`, `parse(raw) -> [Sample]`. `parse` is
pure: it sees only the RawOutput (stdout, stderr, params, extra), so `lab reparse` can rebuild
samples from stored raw outputs after a parser fix.

A new workload is one module in this package that ends with `NAME = register(TheWorkload())`;
`load_all()` imports every module here, so nothing else lists it: the config accepts its name in
[suite] workloads and its `defaults` keys in [suite.params.<name>], and calls its `params(ctx)` to
check the values for every guest OS of the matrix before anything is made. One module may register a
family (sysbench-cpu and sysbench-memory). Build it from the toolkit, the modules here that register
nothing:

  cpu          guest CPU utilisation around a load (run_guest_load, snapshot, cpu_samples)
  toolkit      parameters, segments (SegmentLog), the guest tool check, a server on the client side
  containers   where a load runs in the guest: itself, a podman container or a FreeBSD jail; LRO
  gitrepo      the generated git repository and the git daemon that serves it
"""

from __future__ import annotations

import fnmatch
import importlib
import math
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lab.guest import Guest
from lab.model import Client, RawOutput, Sample


@dataclass
class WorkloadContext:
    guest: Guest  # the VM under test
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


class Workload(Protocol):
    """What the config and the runner call. A workload may also have `estimate_seconds(params)`
    (one repetition's length) for `lab plan`; without it the estimate is its "time" or "duration".
    `network = True` on a workload whose load goes through the client side (a load generator or a
    server there): the runner lets one lane at a time use a client (lab.runner.measure).
    `client_files = True` on one whose client side uses files of this machine (a repository, the
    lab's key): it runs only with the "local" client (lab.check), never on a client VM."""

    name: str
    defaults: dict[str, Any]  # parameter defaults; [suite.params.<name>] overrides them
    primary_metrics: PrimaryMetrics  # its headline metrics (the others are exploratory in a comparison)

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        """The effective parameters, checked (UsageError) for this guest OS and vCPU count."""
        ...

    def prepare(self, ctx: WorkloadContext) -> None: ...

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput: ...

    def parse(self, raw: RawOutput) -> list[Sample]: ...


WORKLOADS: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    WORKLOADS[workload.name] = workload
    return workload


_imported = False  # every module imported once: the package's files do not change under a run


def load_all() -> dict[str, Workload]:
    """Import every module of this package, so each workload registers itself. Called per cell and
    workload: after the first call it only returns the registry (listing the package's files each
    time was half of the orchestrator's CPU per cell of a many-host run)."""
    global _imported
    if not _imported:
        for mod in pkgutil.iter_modules(__path__):
            if not mod.name.startswith("_"):
                importlib.import_module(f"{__name__}.{mod.name}")
        _imported = True
    return WORKLOADS
