"""The Backend seam: make and remove machines, stop at an SSH address.

A backend is a small core every host has (check it, a run's set-up, clone / start / wait_ready /
destroy, list and remove what is the lab's) and optional parts, each an object of its own that a
backend makes only where its capabilities declare it: `publishing` (`lab images publish`,
Capabilities.publish), `warm` (warm start's snapshots, Capabilities.snapshots), `bare_metal` (the
host itself as a cell, Capabilities.bare_metal) and `load_meter` (the host's CPU under each
repetition, Capabilities.host_load). A part a host lacks is None; asking for it is NotSupported (a
UsageError: one line, exit status 2, `Backend.lacks`). A host's own way of making a machine (a
SmartOS host's zones) is a part of its package, used by its core.

A backend is a package `lab/backends/<name>/` with
- `settings.py`: its typed, frozen `HostSettings` model (the `[hosts.NAME]` table of lab.toml)
  and `capabilities(settings)`: what it can make, answered without touching the host;
- `backend.py`: the `Backend` subclass, built from those settings;
and one line in `lab.backends.REGISTRY`. lab.config builds the `[hosts.*]` union from the
registry; nothing outside the package names a backend.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from lab import clients, images, paths
from lab.backends import fields
from lab.errors import SettingError, UsageError
from lab.guest import Guest, Machine
from lab.hostload import LoadWindow
from lab.model import MADE_BY_HOST, Client, CloneKind, DiskBus, ImageRef, Isolation, NicModel, Owned, Vm, VmSpec


class HostSettings(BaseModel):
    """One `[hosts.NAME]` table. Subclasses add their keys with their defaults, once; lab.config
    validates them (errors name file, key and value) and hands the record to the backend."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    backend: str = Field(description="which backend drives this host: local, libvirt, proxmox, smartos or vagrant")
    # Measured VMs of the lab up at once on this host (lab.runner.lanes: one lane per slot). 1, the
    # default: one at a time, so the lab's VMs never disturb each other's figures; more trades that
    # for time, up to what the backend runs at once (Capabilities.max_slots; lab.config checks).
    slots: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "measured VMs of the lab up at once on this host (or node): a lane per slot; 1 keeps the lab's VMs from "
            "disturbing each other"
        ),
    )
    # Where this host's load generators (iperf3, wrk, curl) run: "local", this machine (network
    # measurements of different lanes take turns on it); "vm", a VM the run clones on this host
    # from the golden image of its first cell, on its cells' network, destroyed with the run
    # (lab.runner.clientvm): the figures are the guest's NIC and the host's bridge, not the path
    # from this machine to the host; or "ssh:USER@MACHINE", a machine of the user's reached over
    # SSH (lab.runner.clientssh): hosts naming the same machine take turns on it.
    client: str = Field(
        default="local",
        description=(
            'where this host\'s load generators run: "local" (this machine), "vm" (a client VM on the host) or '
            '"ssh:USER@MACHINE" (a Linux machine of yours)'
        ),
    )
    client_vcpus: int = Field(default=2, ge=1, le=64, description='vCPUs of the client VM (client = "vm")')
    client_memory_mib: int = Field(
        default=1024, ge=256, le=1024 * 1024, description='memory of the client VM, MiB (client = "vm")'
    )
    # client = "ssh:...": its SSH port, the private key (empty: ssh's own choice, agent or
    # ~/.ssh/id_*), the known_hosts file its host key is checked against (strictly: an unknown
    # key is refused, as TLS is verified), and its address as the cells' guests reach it (empty:
    # MACHINE itself).
    client_port: int = Field(default=22, ge=1, le=65535, description='client = "ssh:...": its SSH port')
    client_identity: str = Field(
        default="",
        description=(
            'client = "ssh:...": the private key to log in with (empty: ssh\'s own choice, agent or ~/.ssh/id_*)'
        ),
    )
    client_known_hosts: str = Field(
        default="~/.ssh/known_hosts",
        description='client = "ssh:...": the known_hosts file its host key is checked against, strictly',
    )
    client_machine_address: str = Field(
        default="",
        description='client = "ssh:...": the machine\'s address as the guests reach it (empty: MACHINE itself)',
    )
    # Seconds the runner waits for a guest's SSH login (a cell's VM, the client VM) once the
    # backend says it is ready: its sshd may still be starting, or its network still coming up.
    ssh_timeout: float = Field(
        default=90.0, gt=0, le=3600, description="seconds a guest's SSH login may take once the backend calls it ready"
    )

    @field_validator("client")
    @classmethod
    def _client(cls, v: str) -> str:
        if clients.valid(v):
            return v
        raise ValueError(
            'must be "local" (this machine), "vm" (a client VM the run makes on the host) '
            'or "ssh:USER@MACHINE" (a machine of yours, over SSH)'
        )

    @field_validator("client_identity", "client_known_hosts")
    @classmethod
    def _client_file(cls, v: str, info: ValidationInfo) -> str:
        if not v:
            return v
        try:
            paths.expand(v)
        except ValueError:  # no home to expand ~ to: an error only where the key is used
            if clients.ssh_target(info.data.get("client", "")) is None:
                return v
            raise
        if info.field_name == "client_identity":
            return fields.regular_file(v, info, "the private key to log in to the client machine with")
        # missing: `lab run` says so as it logs in; never a FIFO or a directory in its place
        return fields.regular_file(v, info, "the client machine's host key is checked against it", must_exist=False)

    @field_validator("client_machine_address")
    @classmethod
    def _client_address(cls, v: str) -> str:
        return fields.host(v)

    # Keys several backends have, each validated once here for every backend that has it
    # (check_fields=False: a backend without the key is fine); lab.backends.fields says why.
    @field_validator("gateway", "client_address", check_fields=False)
    @classmethod
    def _ip_address(cls, v: str | None) -> str | None:
        return v if v is None else fields.ip_address(v)

    @field_validator("client_netns", check_fields=False)
    @classmethod
    def _netns(cls, v: str) -> str:
        return fields.netns(v)

    @field_validator("bridge", check_fields=False)
    @classmethod
    def _bridge(cls, v: str | None) -> str | None:
        return fields.bridge(v)

    def problems(self) -> list[tuple[str, object, str]]:
        """Checks across keys: (key, value, problem) for each, first one reported."""
        return []

    def warnings(self) -> list[tuple[str, object, str]]:
        """(key, value, why) of settings that work but give up something the lab otherwise keeps (TLS
        checks): said in one line each by `lab plan` and `lab run`."""
        return []

    def client_problems(self) -> list[tuple[str, object, str]]:
        """Keys of a client placement this host does not have: given by mistake, said, not ignored."""
        unused = set()
        if clients.ssh_target(self.client) is None:
            unused |= {"client_port", "client_identity", "client_known_hosts", "client_machine_address"}
        if self.client != clients.VM:
            unused |= {"client_vcpus", "client_memory_mib"}
        ssh = 'client = "ssh:USER@MACHINE"'
        wanted = {"client_vcpus": 'client = "vm"', "client_memory_mib": 'client = "vm"'}
        return [
            (key, getattr(self, key), f"is used only with {wanted.get(key, ssh)}")
            for key in sorted(self.model_fields_set & unused)
        ]


class NotSupported(UsageError):
    """The backend of a host cannot do what was asked (publish, bare metal, warm start, ...)."""


@dataclass(frozen=True)
class Capabilities:
    """What a host can make, known from its settings alone (used by `lab plan` before anything
    exists; a backend may narrow it once it has talked to the host, in `check`)."""

    description: str  # "local QEMU", "libvirt/bhyve", "Proxmox VE": how errors name the host's kind
    nic_models: frozenset[NicModel]
    disk_buses: frozenset[DiskBus]
    clone_kinds: frozenset[CloneKind] = frozenset(CloneKind)
    boot_modes: frozenset[str] = frozenset({"kernel"})  # of an image's manifest "boot": kernel, bios, uefi
    max_vcpus: int = 128
    max_memory_mib: int = 1024 * 1024
    snapshots: bool = False  # memory snapshots (warm start): Backend.warm
    bare_metal: bool = False  # can run the suite on the host itself (the baseline cell): Backend.bare_metal
    lab_side_link: bool = False  # the lab reaches the VM's link on the host: netem can go there
    publish: bool = True  # `lab images publish`: Backend.publishing
    host_load: bool = False  # tells how busy the host was under each repetition: Backend.load_meter
    # the host is the machine the lab runs on: a run waits for it to be quiet before each
    # repetition unless told otherwise ([suite] quiet_host)
    local_host: bool = False
    # measured VMs of one run the backend can have up at once on the host ([hosts.NAME] slots)
    max_slots: int = 1
    # parts of the host a VM can be pinned to, each a lane of its own with `slots` (a Proxmox
    # cluster's nodes): a run deals its cells to them (VmSpec.place); () = the host is one place
    places: tuple[str, ...] = ()
    # isolation kinds the host makes as the cell's machine itself, instead of a VM (a SmartOS host's
    # zones: VmSpec.isolation); their cells have no NIC model, disk bus, clone kind or warm start
    machine_isolation: frozenset[Isolation] = frozenset()
    # feature -> why it is missing, for the plan's one-line refusal
    missing: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BackendEnv:
    """What every backend gets besides its settings."""

    source: str  # the lab.toml the settings came from (errors name it)
    base_dir: Path  # its folder: relative paths in settings are relative to it
    state_dir: Path  # private to this machine's lab (locks, caches): root-owned, mode 0700
    ssh_key: Path  # the lab's private key; its public half is ssh_key.with_suffix(".pub")


def default_env(source: str = "lab.toml") -> BackendEnv:
    """The environment of a backend built outside a lab (tests, the benchmark)."""
    import lab
    from lab.runlock import RUN_LOCK_DIR

    return BackendEnv(source=source, base_dir=Path.cwd(), state_dir=RUN_LOCK_DIR, ssh_key=lab.IMAGES_DIR / "lab_key")


@dataclass(frozen=True)
class Link:
    """A VM's network link as the lab can reach it on the host (for netem on the lab side)."""

    dev: str  # e.g. the VM's tap
    netns: str | None = None  # the namespace the device lives in


class Publishing(Protocol):
    """`lab images publish NAME HOST`: put a built image on the host."""

    def publish(self, image: ImageRef) -> str:
        """Returns where it went."""
        ...


class WarmSnapshots(Protocol):
    """The post-boot memory snapshots a host keeps for warm start (a spec with start = "warm" is
    cloned from the one of its machine shape; clone/start/wait_ready do it and record in
    vm.facts["start"] what really happened: "warm", or "cold: <why the restore failed>")."""

    def snapshots(self) -> list[Owned]:
        """The snapshots this host keeps (kind "warm", name = the shape key, detail = image digest)."""
        ...

    def remove(self, item: Owned) -> None:
        """Remove one snapshot (its image is gone, or it is stale)."""
        ...


class LoadMeter(Protocol):
    """The host's CPU under a repetition (lab.hostload)."""

    def window(self, vms: Sequence[Vm]) -> LoadWindow:
        """Start a window over the host's CPU: its `stop()` says how much CPU anything that is not
        the lab used meanwhile (`vms`: the run's machines that are up, whose CPU is the lab's), and
        the CPU steal where the host reports it. Over cumulative counters a backend returns
        `CounterWindow(read)`, over rates `PollingWindow(poll)`."""
        ...


class BareMetalCells(Protocol):
    """The host itself set up as a cell."""

    def make(self, run_id: str, cell_id: str, index: int, expires_at: float, client: Client) -> BareMetalHost:
        """`index` numbers the bare-metal cells of the run from 1. On failure nothing is left."""
        ...


class BareMetalHost(Protocol):
    """The host itself set up as a cell (BareMetalCells.make): its own namespace on the run's bridge
    and its own CPU accounting. destroy(vm) removes it like a VM."""

    vm: Vm  # what Backend.destroy tears down
    address: str  # the cell's address on the run's bridge
    facts: dict[str, Any]

    @property
    def guest(self) -> Machine:
        """Runs the cell's commands on the host, inside the cell's namespace and accounting."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the cell runs on (its `verify`): vcpus, mem_kib, kernel, nic_driver."""
        ...

    def effective_tuning(self) -> dict[str, Any]:
        """Nothing is tuned on a host; what is in effect is read back (the `tuning` facts)."""
        ...

    def start_web(self, image: str) -> str | None:
        """Serve `image`'s site (http/https workloads) from the cell; None, or why it cannot."""
        ...


@dataclass
class PlainClient:
    """A client on this machine, optionally inside a network namespace."""

    address: str
    netns: str | None = None

    def argv(self, argv: list[str]) -> list[str]:
        if not self.netns:
            return list(argv)
        from lab import proc

        return proc.netns_prefix(self.netns) + list(argv)

    def server_argv(self, argv: list[str]) -> list[str]:
        return self.argv(argv)  # a process of this machine: stopping it stops the server

    def proc_stat(self) -> str:
        return Path("/proc/stat").read_text()  # the whole machine's, whichever namespace


class Backend(abc.ABC):
    name: ClassVar[str]  # registry key, e.g. "local"
    settings_model: ClassVar[type[HostSettings]]
    # The optional parts (see the module's docstring), made in __init__ where the capabilities
    # declare them (tests/unit/test_seams.py keeps the two agreeing); None where the host has none.
    publishing: Publishing | None = None
    warm: WarmSnapshots | None = None
    load_meter: LoadMeter | None = None
    bare_metal: BareMetalCells | None = None

    def __init__(self, host_name: str, settings: HostSettings, env: BackendEnv | None = None):
        self.host_name = host_name
        self.settings = settings
        self.env = env or default_env()

    # -- what it can make (no host contact) -------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def capabilities(cls, settings: HostSettings) -> Capabilities:
        """What a host with these settings can make, from the settings alone."""

    @classmethod
    def plan_check(cls, host_name: str, settings: HostSettings, specs: Sequence[VmSpec]) -> None:
        """Can this host make every spec? Raises SettingError naming the lab.toml key (a matrix axis
        or a host setting) and value. The default checks the capabilities; a backend adds its own
        rules by extending it."""
        caps = cls.capabilities(settings)
        where = f"host {host_name!r} ({caps.description})"
        for spec in specs:
            check_spec(caps, spec, where)

    # -- the host ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def check(self) -> None:
        """Reach the host and verify credentials and prerequisites. Raises UsageError subclasses
        (UnreachableError, AuthError, SettingError) before anything is created."""

    def check_specs(self, specs: Sequence[VmSpec]) -> None:
        """After check(): can this host, as it now answered, make every spec? (Version gates that
        plan_check could not know.) Raises SettingError naming the matrix axis or host key. The
        default repeats plan_check."""
        self.plan_check(self.host_name, self.settings, specs)

    def check_images(self, images: Sequence[ImageRef]) -> None:  # noqa: B027 - a hook: most backends keep this default
        """Each image is usable on this host as a cell would use it (published, right recipe).
        The default accepts every image: backends that use the built image in place."""

    def describe_images(self, images: Sequence[ImageRef]) -> list[str]:
        """After check(): one line per image (and node where it matters) saying what its cells start
        from on this host, for `lab plan --check` and `lab run` to print. The default has nothing to say."""
        return []

    @abc.abstractmethod
    def facts(self) -> dict[str, Any]:
        """Facts recorded with every sample of this host (accelerator, versions)."""

    def host_facts(self) -> dict[str, Any]:
        """The host's fingerprint for `lab snapshot` (CPU, microcode, kernel, tool versions). The
        default is the backend's facts alone."""
        return {}

    def lacks(self, what: str) -> NotSupported:
        """The error of asking this host for a part it has not got ("cannot publish images")."""
        return NotSupported(f"host {self.host_name!r} ({self.name} backend) {what}")

    # -- per run ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def open_run(self, run_id: str) -> Client:
        """Set up per-run infrastructure (network namespace, run lock, ...) and return the client side."""

    @abc.abstractmethod
    def close_run(self, run_id: str) -> None:
        """Remove per-run infrastructure. Idempotent."""

    @abc.abstractmethod
    def run_is_live(self, run_id: str) -> bool | None:
        """True while a process on this machine holds the run, False when it is known dead, None
        when this machine cannot tell (a run of another machine)."""

    # -- per VM -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        """Create the machine's disk and definition (not started). On failure nothing is left."""

    @abc.abstractmethod
    def start(self, vm: Vm) -> None:
        """Power on."""

    @abc.abstractmethod
    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        """Wait (bounded, event-driven) until the guest is up; return its address."""

    @abc.abstractmethod
    def destroy(self, vm: Vm) -> None:
        """Stop and remove everything clone() and start() made. Idempotent. Raises TeardownError."""

    @abc.abstractmethod
    def renew_lease(self, vm: Vm, expires_at: float) -> None:
        """Move the lease the machine carries on the host (its expiry; run, cell and owner as
        written at clone) to `expires_at`: the run renews it while the machine stands
        (lab.runner.renewal), so a gc that cannot ask this machine's locks never takes it for a
        leftover. Raises LabError (the run warns and tries again)."""

    def console_text(self, vm: Vm) -> str:
        """What the guest printed on its serial console so far ("" where it cannot be read)."""
        return ""

    def lab_link(self, vm: Vm) -> Link | None:
        """The VM's link where the lab can reach it on the host (netem on the lab side), or None."""
        return None

    def outside_netns(self) -> str | None:
        """The network namespace of this machine from which a client machine of this host
        (client = "ssh:", lab.runner.clientssh) is reached; None: this machine's own."""
        return None

    def guest(self, vm: Vm, client: Client) -> Guest:
        """An SSH connection to the VM's guest, made the way this host's guests are reached."""
        return Guest(
            vm.address,
            key=self.env.ssh_key,
            netns=client.netns,
            control_dir=vm.control_dir,
            os=vm.spec.image.os,
            known_hosts=self.known_hosts(vm),
        )

    def known_hosts(self, vm: Vm) -> str:
        """The known_hosts lines the guest's host keys are checked against: the image's, which every
        clone of it carries (lab.images.hostkeys)."""
        return images.known_hosts(vm.spec.image, [vm.address])

    # -- garbage collection ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def list_owned(self) -> list[Owned]:
        """Everything on the host that carries the lab's own marker and a run id (VMs, disks, taps,
        namespaces, locks). Nothing without the marker is ever listed."""

    @abc.abstractmethod
    def remove_owned(self, item: Owned) -> None:
        """Remove one thing list_owned() found (for `lab gc`)."""


def check_spec(caps: Capabilities, spec: VmSpec, where: str) -> None:
    """Pure: a spec against a host's capabilities. SettingError names the matrix axis and value."""
    made_by_host = spec.isolation in MADE_BY_HOST
    if made_by_host and spec.isolation not in caps.machine_isolation:
        raise SettingError(
            "isolation",
            spec.isolation.value,
            f"not made by {where}: "
            + caps.missing.get(spec.isolation.value, f"only a SmartOS host makes {spec.isolation.value}s"),
            hint="exclude it for this host in [matrix] exclude",
        )
    # a zone has no NIC model, disk bus or clone kind (lab.axes.NOT_IN): its spec's defaults are moot
    machine = (
        ()
        if made_by_host
        else (
            ("nic", spec.nic, caps.nic_models),
            ("disk_bus", spec.disk_bus, caps.disk_buses),
            ("clone", spec.clone, caps.clone_kinds),
        )
    )
    for key, value, offered in machine:
        if value not in offered:
            raise SettingError(
                key,
                value.value,
                f"not available on {where}, which offers {', '.join(sorted(v.value for v in offered))}",
                hint="exclude it for this host in [matrix] exclude",
            )
    if spec.start == "warm" and not caps.snapshots:
        raise SettingError(
            "start",
            "warm",
            f"not available on {where}: " + caps.missing.get("snapshots", "it keeps no memory snapshots"),
            hint='exclude it for this host in [matrix] exclude, or use start = "cold"',
        )
    if not 1 <= spec.vcpus <= caps.max_vcpus:
        raise SettingError("vcpus", spec.vcpus, f"outside 1..{caps.max_vcpus} on {where}")
    if spec.memory_mib > caps.max_memory_mib:
        raise SettingError("memory_mib", spec.memory_mib, f"more than {caps.max_memory_mib} MiB on {where}")
