"""`[hosts.NAME] backend = "proxmox"`: a Proxmox VE node or cluster through its API.

The one place the keys of a Proxmox host and their defaults live; the backend reads
`self.settings.<key>` and nothing else. Light on purpose (pydantic only): lab.config and `lab plan`
import it without loading proxmoxer.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from lab import paths
from lab.backends import fields
from lab.backends.base import Capabilities, HostSettings
from lab.backends.proxmox.tls import normalise
from lab.model import CloneKind, DiskBus, NicModel, named_as_lab

PVE_NODE = r"^[a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?$"  # PVE's pve-node format


class Timeouts(BaseModel):
    """`timeouts = { clone = 600, ... }`: seconds per phase."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    http: float = Field(30.0, gt=0, le=86400, description="one API call")
    # how long an idempotent call (GET; stop or delete of the lab's own VM) is retried on a lost
    # connection, a 5xx or a lock timeout when its operation has no deadline of its own
    retry: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="how long an idempotent call is retried on a lost connection, a 5xx or a lock timeout",
    )
    clone: float = Field(600.0, gt=0, le=86400, description="the clone task (and its lock retries)")
    config: float = Field(60.0, gt=0, le=86400, description="configuring a clone; the address lock")
    start: float = Field(120.0, gt=0, le=86400, description="starting the VM")
    stop: float = Field(
        120.0, gt=0, le=86400, description="PVE's stop `timeout` (then it kills QEMU); its task may outlast it"
    )
    # the teardown deadline: stop + delete keep trying (locks, lost connections, a slow stop task)
    # this long, then the VM is left to `lab gc` with one line naming it and its lock holder
    destroy: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="the teardown deadline: stop + delete keep trying this long, then the VM is left to `lab gc`",
    )
    ready: float = Field(
        600.0, gt=0, le=86400, description="the guest being ready, when wait_ready is given no timeout"
    )
    agent: float = Field(60.0, gt=0, le=86400, description="the guest agent, before the static address or ARP")
    publish: float = Field(1800.0, gt=0, le=86400, description="upload + import + template of `lab images publish`")


class Settings(HostSettings):
    backend: Literal["proxmox"]
    url: str = Field(description="the API, e.g. https://pve1.example:8006")
    node: str = Field(description="the node that holds the template; `lab images publish` puts it there")
    # where clones may run (default: [node]); a node without its own template of the same name gets
    # clones through `target=` (shared storage)
    nodes: list[str] | None = Field(
        default=None,
        description=(
            "cluster: where clones may run (default: [node]); a node without its own template gets clones through "
            "target= (shared storage)"
        ),
    )
    # pack: one lane, its VMs on the first listed node that is online with the memory free (a
    # comparison shares a node). spread: each of `nodes` is a lane of its own (lab.runner.lanes): a
    # run deals its cells to the nodes and runs them at once, each VM on its lane's node; a VM made
    # outside a run goes to the node with the fewest of the lab's VMs so far, then the most free memory
    placement: Literal["pack", "spread"] = Field(
        default="pack",
        description="pack: one lane, the first listed node with room; spread: a lane per node, cells dealt to them",
    )
    storage: str = Field(
        default="local-lvm", description="full clones and published templates (linked clones stay with the template)"
    )
    import_storage: str = Field(default="local", description="receives the upload of `lab images publish`")
    bridge: str = Field(default="vmbr0", description="the bridge of net0")
    template: str | int = Field(
        default="lab-{image}", description='a VMID, or a name; "{image}" becomes the image\'s name'
    )
    token: str | None = Field(
        default=None, description='the API token: "env:NAME" or "file:PATH" holding user@realm!tokenid=SECRET'
    )
    user: str | None = Field(
        default=None, description="ticket login (user@realm) with password; an expired ticket is renewed once"
    )
    password: str | None = Field(default=None, description='the ticket login\'s password: "env:NAME" or "file:PATH"')
    verify_tls: bool = Field(
        default=True,
        description="verify the node's TLS certificate (against requests' CA bundle, ca_file or fingerprint)",
    )
    # the cluster CA (/etc/pve/pve-root-ca.pem) to verify against; relative to lab.toml's folder.
    # Read when lab.toml is: a missing or unreadable file is an error naming it, before anything runs
    ca_file: str | None = Field(
        default=None,
        description="the cluster CA (/etc/pve/pve-root-ca.pem) to verify against; relative to lab.toml's folder",
    )
    # or: the node certificate itself, pinned by its SHA-256 fingerprint as PVE's GUI shows it
    # (Node > System > Certificates): "sha256:AB:CD:…". Checked on every connection, instead of a CA
    fingerprint: str | None = Field(
        default=None,
        description=(
            "or: the node certificate itself, pinned by its SHA-256 fingerprint as PVE's GUI shows it "
            '("sha256:AB:CD:…")'
        ),
    )
    # clone and destroy calls in flight at once per node and per storage (from this process, all
    # hosts on the same cluster together): PVE serialises them behind locks that time out after 10 s
    concurrency: int = Field(
        default=1,
        ge=1,
        le=32,
        description=(
            "clone and destroy calls in flight at once per node and per storage (PVE serialises them behind locks)"
        ),
    )
    cpu_type: str = Field(default="host", description='the VMs\' CPU type, e.g. "host" or "x86-64-v2-AES"')
    ci_user: str = Field(default="lab", description="the cloud-init user")
    ssh_keys: str | list[str] | None = Field(
        default=None, description="public keys for cloud-init (default: the lab's key)"
    )
    client_address: str = Field(default="", description="this machine as the guests see it (iperf3/wrk servers)")
    client_netns: str = Field(
        default="", description="load generators and SSH run in this network namespace of this machine"
    )
    # static guest addresses (cloud-init ipconfig0): "FIRST-LAST" or a CIDR; "" = DHCP. One in the
    # ipconfig0 of any lab VM on the cluster is never handed out again
    addresses: str = Field(
        default="", description='static guest addresses (cloud-init ipconfig0): "FIRST-LAST" or a CIDR; "" = DHCP'
    )
    gateway: str = Field(default="", description='of static addresses ("" = none)')
    prefix_len: int = Field(default=24, ge=8, le=30, description="prefix length of static addresses")
    guest_agent: bool = Field(
        default=True, description="false for images without qemu-guest-agent: static address or ARP"
    )
    node_ssh: str = Field(
        default="", description='ssh destination of the node for the ARP fallback, e.g. "root@pve1" ("" = here)'
    )
    timeouts: Timeouts = Field(default=Timeouts(), description="seconds per phase (keys below)")
    lock_retries: int = Field(default=6, ge=0, le=100, description="retries of a clone or start refused by a lock")
    # first backoff between retries, doubled per retry up to 30 s, with jitter (teardown and
    # idempotent calls retry until their deadline, not a count)
    retry_backoff: float = Field(
        default=2.0,
        gt=0,
        le=300,
        description="first backoff between retries, seconds, doubled per retry up to 30 s, with jitter",
    )
    poll_interval: float = Field(default=0.25, gt=0, le=60, description="first task/agent poll interval, seconds")
    poll_max: float = Field(default=2.0, gt=0, le=600, description="longest task/agent poll interval, seconds")

    def problems(self) -> list[tuple[str, object, str]]:
        out: list[tuple[str, object, str]] = []
        if not self.token and not (self.user and self.password):
            out.append(("token", None, 'Proxmox needs token = "env:NAME" (an API token), or user and password'))
        if self.fingerprint and self.ca_file:
            out.append(
                ("fingerprint", self.fingerprint, "pins the certificate itself: leave out ca_file (one or the other)")
            )
        if self.fingerprint and not self.verify_tls:
            out.append(("verify_tls", False, "contradicts the pinned fingerprint: leave verify_tls out"))
        if self.token and (self.user or self.password):
            key = "user" if self.user else "password"
            out.append((key, getattr(self, key), "is a ticket login: leave it out with a token (one or the other)"))
        out += pool_problems(self.addresses, gateway=self.gateway, client_address=self.client_address)
        return out

    def warnings(self) -> list[tuple[str, object, str]]:
        if self.verify_tls:
            return []
        return [
            (
                "verify_tls",
                False,
                "the node's TLS certificate is not checked: anyone on the path to it can pose as the node and "
                "read the credentials; set ca_file or fingerprint instead",
            )
        ]

    @property
    def clone_nodes(self) -> list[str]:
        """Where clones may run: `nodes`, else the template's `node`."""
        return list(self.nodes or [self.node])

    @field_validator("node")
    @classmethod
    def _node(cls, v: str) -> str:
        if not re.fullmatch(PVE_NODE, v):
            raise ValueError("is not a PVE node name (letters, digits and inner dashes)")
        return v

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v: list[str] | None) -> list[str] | None:
        for n in v or []:
            if not re.fullmatch(PVE_NODE, n):
                raise ValueError(f"{n!r} is not a PVE node name (letters, digits and inner dashes)")
        if v is not None and not v:
            raise ValueError("must list at least one node (or leave it out: the `node` alone)")
        if v is not None and len(set(v)) != len(v):
            raise ValueError("lists a node twice")
        return v

    @field_validator("template")
    @classmethod
    def _template(cls, v: str | int) -> str | int:
        if isinstance(v, int) and not 100 <= v <= 999_999_999:
            raise ValueError("is not a VMID (100 to 999999999)")
        if isinstance(v, str) and not v:
            raise ValueError('must be a VMID or a name such as "lab-{image}"')
        return v

    @field_validator("addresses")
    @classmethod
    def _addresses(cls, v: str) -> str:
        return check_addresses(v)

    @field_validator("url")
    @classmethod
    def _https(cls, v: str) -> str:
        # TLS always: the token travels in every request
        if "@" in v.partition("://")[2].partition("/")[0]:  # the message's value is redacted (lab.redact)
            raise ValueError(
                'has user-info (user:password@): the password goes in password = "env:NAME" or "file:PATH"'
            )
        if not re.fullmatch(r"https://(\[[0-9A-Fa-f:.]+\]|[^/\s:\[\]]+)(:\d+)?(/\S*)?", v):
            raise ValueError("must be an https:// URL such as https://pve1.example:8006")
        return v.rstrip("/")

    @field_validator("ca_file")
    @classmethod
    def _ca_file(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        path = paths.local(v, fields.base_dir(info))  # relative to lab.toml's folder (lab.config passes it)
        try:
            head = paths.read_regular(path)  # a FIFO in its place never hangs lab.toml's reading
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None
        if b"-----BEGIN CERTIFICATE-----" not in head:
            raise ValueError(f"{path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
        return str(path)

    @field_validator("bridge")
    @classmethod
    def _net0_bridge(cls, v: str) -> str:
        if not v:  # PVE would make a NAT user network: not the cells' network
            raise ValueError('must name the bridge the clones\' net0 joins, such as "vmbr0"')
        return v

    @field_validator("storage", "import_storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        return fields.pve_storage(v)

    @field_validator("cpu_type")
    @classmethod
    def _cpu_type(cls, v: str) -> str:
        return fields.cpu_type(v)

    @field_validator("node_ssh")
    @classmethod
    def _node_ssh(cls, v: str) -> str:
        return fields.ssh_destination(v)

    @field_validator("fingerprint")
    @classmethod
    def _fingerprint(cls, v: str | None) -> str | None:
        if v is None:
            return v
        fp = normalise(v)
        if fp is None:
            raise ValueError('must be a SHA-256 fingerprint as PVE shows it: "sha256:AB:CD:…" (32 hex pairs)')
        return fp

    @field_validator("token", "password")
    @classmethod
    def _secret_ref(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("env:", "file:")):
            raise ValueError('must be a reference "env:NAME" or "file:/path", never the secret itself')
        return v


# The most addresses a pool may hold: what it names is listed and checked before anything is made,
# so "10.0.0.0/8" (16 M addresses) would cost seconds and hundreds of MB before the first check.
MAX_POOL = 65536


def check_addresses(v: str) -> str:
    """An `addresses` setting: empty, or a pool that holds an address (a settings validator)."""
    if v:
        try:
            size = pool_size(v)
        except ValueError:
            raise ValueError('must be a range "10.0.0.100-10.0.0.150" or a CIDR "10.0.0.96/27"') from None
        if not size:
            raise ValueError("holds no address")
        if size > MAX_POOL:
            raise ValueError(f"holds {size} addresses; at most {MAX_POOL} (a /16) are taken")
    return v


def pool_size(spec: str) -> int:
    """Pure: how many addresses a pool names, counted without listing them. ValueError if malformed."""
    if "-" in spec:
        first, last = (ipaddress.IPv4Address(x.strip()) for x in spec.split("-", 1))
        if last < first:
            raise ValueError("range ends before it starts")
        return int(last) - int(first) + 1
    net = ipaddress.IPv4Network(spec.strip(), strict=False)
    return net.num_addresses - 2 if net.prefixlen < 31 else net.num_addresses


def address_pool(spec: str) -> list[str]:
    """Pure: "10.0.0.100-10.0.0.150" or "10.0.0.96/27" -> the addresses, in order. ValueError if
    malformed or larger than MAX_POOL (counted before anything is listed)."""
    if not spec:
        return []
    if pool_size(spec) > MAX_POOL:
        raise ValueError(f"{spec} holds more than {MAX_POOL} addresses")
    if "-" in spec:
        first, last = (ipaddress.IPv4Address(x.strip()) for x in spec.split("-", 1))
        return [str(ipaddress.IPv4Address(i)) for i in range(int(first), int(last) + 1)]
    return [str(ip) for ip in ipaddress.IPv4Network(spec.strip(), strict=False).hosts()]


def in_pool(spec: str, address: str) -> bool:
    """Pure: is `address` one of the pool's (counted, not listed)?"""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        return False
    if "-" in spec:
        first, last = (ipaddress.IPv4Address(x.strip()) for x in spec.split("-", 1))
        return first <= ip <= last
    net = ipaddress.IPv4Network(spec.strip(), strict=False)
    return ip in net and (net.prefixlen >= 31 or ip not in (net.network_address, net.broadcast_address))


def pool_problems(addresses: str, **others: str) -> list[tuple[str, object, str]]:
    """Addresses of the lab's own (gateway, client_address) that a static pool would hand to a guest."""
    if not addresses:
        return []
    return [
        (key, value, "is inside `addresses`: it would be handed to a guest")
        for key, value in others.items()
        if value and in_pool(addresses, value)
    ]


# The NIC models a clone's net0 can have: PVE's `model` names them as the lab does.
NET_MODELS = named_as_lab(*NicModel)
# The config key each disk bus gets on a clone: ide2 holds the cloud-init drive, so IDE is ide0.
DISK_KEYS = {DiskBus.VIRTIO: "virtio0", DiskBus.SCSI: "scsi0", DiskBus.SATA: "sata0", DiskBus.IDE: "ide0"}


MAX_SLOTS = 16


def capabilities(settings: Settings) -> Capabilities:
    return Capabilities(
        description="Proxmox VE",
        nic_models=frozenset(NET_MODELS),
        disk_buses=frozenset(DISK_KEYS),  # the clone's disk is re-attached on the cell's bus
        clone_kinds=frozenset(CloneKind),
        boot_modes=frozenset({"bios", "uefi"}),
        max_vcpus=512,
        places=tuple(settings.clone_nodes) if settings.placement == "spread" and settings.nodes else (),
        # measured VMs at once on a node (`slots`): the cluster makes them (VMIDs, addresses and
        # clone/destroy calls are already shared safely by the lanes of a run)
        max_slots=MAX_SLOTS,
        host_load=True,  # the node's CPU from the API (host.LoadMeter)
        missing={"snapshots": "a PVE vmstate snapshot cannot be cloned: warm start is not available"},
    )
