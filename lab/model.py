"""Small frozen records shared by every part of the lab. No behaviour, no I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable


class NicModel(enum.StrEnum):
    """The NIC models the lab knows: the one list of their names. Each backend offers those of its
    own device table (NicModel -> what its hypervisor calls the model), each OS drives those of its
    driver table (lab.osfacts)."""

    VIRTIO = "virtio"
    E1000 = "e1000"
    E1000E = "e1000e"
    RTL8139 = "rtl8139"
    VMXNET3 = "vmxnet3"


def named_as_lab(*models: NicModel) -> dict[NicModel, str]:
    """A device table whose entries the hypervisor (or driver) names as the lab does."""
    return {m: m.value for m in models}


# How a plan's cells are told apart in the results (lab.plan makes them, the views read them back):
# the kind of the cell that runs the suite on the host itself, and the label suffix of an A/A twin.
BARE_METAL: Final = "bare-metal"
TWIN_SUFFIX: Final = "#aa"


class DiskBus(enum.StrEnum):
    VIRTIO = "virtio"
    SCSI = "scsi"
    SATA = "sata"
    IDE = "ide"
    NVME = "nvme"


class CloneKind(enum.StrEnum):
    LINKED = "linked"
    FULL = "full"


class Isolation(enum.StrEnum):
    """Where a cell's workloads run (lab.isolation): the machine itself, or a container, jail or zone on it."""

    VM = "vm"
    CONTAINER = "container"
    JAIL = "jail"
    ZONE = "zone"


# Isolation kinds the cell's host makes as its machine in place of a VM (a SmartOS host's zones:
# VmSpec.isolation, Capabilities.machine_isolation); the others are made on the machine (lab.isolation).
MADE_BY_HOST = frozenset({Isolation.ZONE})


class Runtime(enum.StrEnum):
    """The container runtime of a container cell (lab.isolation.RUNTIMES)."""

    PODMAN = "podman"
    DOCKER = "docker"


class Accel(enum.StrEnum):
    KVM = "kvm"
    TCG = "tcg"


class CellStatus(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    NA = "n/a"  # a knob cannot apply on that OS/NIC
    DUPLICATE = "duplicate"  # same effective configuration as an earlier cell (facts: duplicate_of)


@dataclass(frozen=True)
class ImageRef:
    """A golden image as the manifest describes it."""

    name: str  # e.g. "debian12"
    os: str  # e.g. "debian"; keys lab.osfacts
    path: Path  # the qcow2 (local) or a backend-specific reference
    digest: str  # recipe digest: changes when what goes into the image changes
    sha256: str = ""  # of the built artifact
    manifest: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class VmSpec:
    """What a cell asks a backend to create."""

    name: str  # lab-<run>-<cell>: unique, carries the run id
    run_id: str
    cell_id: str
    image: ImageRef
    nic: NicModel
    vcpus: int
    memory_mib: int
    disk_bus: DiskBus = DiskBus.VIRTIO
    clone: CloneKind = CloneKind.LINKED
    start: str = "cold"  # "cold": boot; "warm": restore a post-boot snapshot of the same machine shape
    ip: str = ""  # static address the guest gets ("" = backend decides / DHCP)
    mac: str = ""
    expires_at: float = 0.0  # unix time after which `lab gc` may remove it
    owner: str = ""  # whose run made it (lab.lease: this machine's tag and the run's nonce); "" outside a run
    place: str = ""  # one of the host's Capabilities.places (its lane's) the VM must go to; "" = any
    # ZONE: the host makes an OS-virtualised machine instead of a VM (Capabilities.machine_isolation);
    # a container is made inside the guest (lab.isolation), so its spec says VM's default to backends
    isolation: Isolation = Isolation.VM
    labels: dict[str, str] = field(default_factory=dict, compare=False, hash=False)


@dataclass
class Vm:
    """A machine a backend created. `handle` holds the backend's own identifiers."""

    spec: VmSpec
    backend: str
    handle: dict[str, Any] = field(default_factory=dict)
    address: str = ""
    facts: dict[str, Any] = field(default_factory=dict)  # e.g. {"accel": "tcg"}
    control_dir: Path | None = None  # where this machine keeps the VM's SSH control sockets (None: a temp dir)

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class Owned:
    """Something a backend finds on its host that carries a lab run id (for `lab gc`)."""

    backend: str
    kind: str  # "vm", "disk", "tap", "netns", ...
    name: str
    run_id: str
    expires_at: float = 0.0
    detail: str = ""
    owner: str = ""  # the lease's owner (lab.lease), "" where the host keeps none or an old lease has none


@dataclass(frozen=True)
class RawOutput:
    """What a workload run printed, stored before parsing so `lab reparse` can redo it."""

    workload: str
    command: str
    stdout: str
    stderr: str = ""
    returncode: int = 0
    started: float = 0.0
    seconds: float = 0.0
    params: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)  # e.g. CPU snapshots


@dataclass(frozen=True)
class Sample:
    """One measured value. Everything a comparison needs travels in `labels`."""

    metric: str  # e.g. "events_per_s", "throughput_mbit_s", "cpu_busy_pct"
    value: float
    unit: str
    higher_is_better: bool | None  # None: informational (e.g. retransmits ambiguous)
    labels: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@runtime_checkable
class Client(Protocol):
    """Where load generators (iperf3 server, wrk, ssh) run for a host, and the address by which
    guests reach it. Backends make them (open_run) for this machine; a run makes one in a VM of
    its own for a host with `client = "vm"` (lab.runner.clientvm); workloads use them."""

    address: str  # as seen from the guests (iperf3 -c <address>)
    netns: str | None  # a network namespace of this machine the client side runs in, if any

    def argv(self, argv: list[str]) -> list[str]:
        """Wrap argv so it runs on the client side (e.g. inside the lab's network namespace)."""
        ...

    def server_argv(self, argv: list[str]) -> list[str]:
        """Wrap a server's argv (iperf3 -s): like argv, and it stops when its local process does."""
        ...

    def proc_stat(self) -> str:
        """The client machine's /proc/stat now (its CPU counters, for lab.clientload)."""
        ...
