"""The Workload seam: prepare(ctx), run(ctx, rep) -> RawOutput, parse(raw) -> [Sample].

`parse` is pure: it sees only the RawOutput (stdout, stderr, params, extra), so `lab reparse`
can rebuild samples from stored raw outputs after a parser fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from lab.backends import Client
from lab.guest import Guest
from lab.model import RawOutput, Sample


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


class Workload(Protocol):
    name: str
    defaults: dict[str, Any]  # parameter defaults; [suite.params.<name>] overrides them

    def prepare(self, ctx: WorkloadContext) -> None: ...

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput: ...

    def parse(self, raw: RawOutput) -> list[Sample]: ...


WORKLOADS: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    WORKLOADS[workload.name] = workload
    return workload


def load_all() -> dict[str, Workload]:
    """Import every workload module so each registers itself."""
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")
    return WORKLOADS
