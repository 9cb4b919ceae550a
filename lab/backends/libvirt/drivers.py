"""What each libvirt driver lab drives can make, and from which libvirt version: the capability
tables of ../shared/research/bhyve.md (sections 2 and 3) and the version gates checked once a
host's libvirt version is known. Pure: no connection, no host."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from lab.errors import SettingError
from lab.model import DiskBus, NicModel, named_as_lab

Driver = Literal["bhyve", "qemu"]

# The names lab gives domains, zvols and files: usable in all three, never a path.
USABLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def version(major: int, minor: int, micro: int = 0) -> int:
    """libvirt's version number encoding (getLibVersion())."""
    return major * 1_000_000 + minor * 1_000 + micro


def version_text(number: int) -> str:
    return f"{number // 1_000_000}.{number // 1_000 % 1_000}.{number % 1_000}"


FEATURES = (
    "snapshots",
    "save-restore",
    "suspend",
    "hotplug",
    "guest-agent",
    "interface-addresses",
    "direct-kernel-boot",
    "memory-balloon",
    "migration",
)


@dataclass(frozen=True)
class DriverCaps:
    driver: Driver
    nics: dict[NicModel, str]  # the interface <model type> per NIC model the driver offers
    disk_buses: frozenset[DiskBus]
    disk_formats: frozenset[str]
    disk_dev: dict[DiskBus, str]  # target dev per bus, as the driver's own test data names them
    features: frozenset[str]  # optional features the driver has at all
    max_vcpus: int
    boot_modes: frozenset[str]  # of an image manifest's "boot"
    # a NIC model, disk bus or feature -> the libvirt version on the host it needs
    since: dict[str, int] = field(default_factory=dict)


DRIVERS: dict[str, DriverCaps] = {
    "bhyve": DriverCaps(
        driver="bhyve",
        nics=named_as_lab(NicModel.VIRTIO, NicModel.E1000),
        disk_buses=frozenset({DiskBus.SATA, DiskBus.VIRTIO, DiskBus.NVME}),
        disk_formats=frozenset({"raw"}),
        disk_dev={DiskBus.SATA: "hda", DiskBus.VIRTIO: "vda", DiskBus.NVME: "nvme0n1"},
        # snapshots, save/restore, suspend, hotplug, balloon, migration: never on bhyve
        features=frozenset({"guest-agent", "interface-addresses"}),
        max_vcpus=16,
        boot_modes=frozenset({"uefi", "bios"}),
        since={
            NicModel.E1000.value: version(3, 1),
            "uefi": version(3, 2),
            "topology": version(4, 5),
            "nvme": version(11, 9),
            "interface-addresses": version(12, 3),
            "guest-agent": version(12, 4),
        },
    ),
    "qemu": DriverCaps(
        driver="qemu",
        nics=named_as_lab(*NicModel),
        # bus='nvme' disks are newer than the libvirt (9.0) we test against: left out on purpose
        disk_buses=frozenset({DiskBus.VIRTIO, DiskBus.SCSI, DiskBus.SATA, DiskBus.IDE}),
        disk_formats=frozenset({"qcow2", "raw"}),
        disk_dev={
            DiskBus.VIRTIO: "vda",
            DiskBus.SCSI: "sda",
            DiskBus.SATA: "sda",
            DiskBus.IDE: "hda",
            DiskBus.NVME: "nvme0n1",
        },
        features=frozenset(FEATURES),
        max_vcpus=255,
        boot_modes=frozenset({"kernel", "bios", "uefi"}),
        since={"genid": version(4, 4)},  # <genid>: the VM generation ID a warm clone's RNG is reseeded by
    ),
}

MISSING_HINTS = {
    "snapshots": "bhyve has no domain snapshots; lab uses zfs clones instead",
    "save-restore": "bhyve cannot save/restore memory: cold boots only",
}


def uri_scheme(uri: str) -> str:
    """The driver part of a libvirt URI: bhyve+ssh://... -> bhyve."""
    return urlsplit(uri).scheme.split("+")[0].lower()


SSH_TRANSPORTS = frozenset({"ssh", "libssh", "libssh2"})
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def uri_transport(uri: str) -> str:
    """How libvirt reaches the host: "ssh", "tcp", "tls", "unix", "ext", ... ("" for a local URI
    such as qemu:///system; "tls" for a remote one without a transport, libvirt's default)."""
    parts = urlsplit(uri)
    scheme, _, transport = parts.scheme.lower().partition("+")
    if transport:
        return transport
    return "tls" if parts.hostname and scheme != "test" else ""


def remote_without_ssh(uri: str) -> bool:
    """A URI to another machine over a transport other than SSH: lab cannot derive from it how to
    run the host's commands (zfs, qemu-img, rm, arp), which would otherwise run on this machine."""
    host = urlsplit(uri).hostname
    return bool(host) and host not in LOOPBACK and uri_transport(uri) not in SSH_TRANSPORTS | {"", "unix"}


def driver_of(uri: str, flavour: str | None = None) -> Driver:
    """Which template and capability table a URI gets ("test" URIs: the flavour, default qemu).
    ValueError for a driver lab does not drive."""
    scheme = uri_scheme(uri)
    if scheme == "test":
        return "bhyve" if flavour == "bhyve" else "qemu"
    if scheme not in DRIVERS:
        raise ValueError(
            f"unsupported libvirt driver {scheme!r}; lab drives bhyve and qemu (and test for contract tests)"
        )
    return scheme  # type: ignore[return-value]


def too_old(caps: DriverCaps, key: str, lib_version: int | None) -> int | None:
    """The version `key` needs when the host's libvirt (once known) is older; else None."""
    need = caps.since.get(key)
    return need if need and lib_version is not None and lib_version < need else None


def supports(caps: DriverCaps, feature: str, lib_version: int | None) -> bool:
    return feature in caps.features and too_old(caps, feature, lib_version) is None


def require(caps: DriverCaps, feature: str, lib_version: int | None, host_name: str) -> None:
    """SettingError (key "requires") unless the driver, and once known the host's libvirt, has it."""
    if feature not in FEATURES:
        raise SettingError("requires", feature, f"unknown feature; known: {', '.join(FEATURES)}")
    if feature not in caps.features:
        hint = None
        if caps.driver == "bhyve":
            hint = MISSING_HINTS.get(
                feature, "the bhyve driver lacks it (see shared/research/bhyve.md, capability table)"
            )
        raise SettingError("requires", feature, f"not available on libvirt/{caps.driver} host {host_name!r}", hint=hint)
    need = too_old(caps, feature, lib_version)
    if need:
        raise SettingError(
            "requires",
            feature,
            f"needs libvirt >= {version_text(need)} on host {host_name!r}, which runs {version_text(lib_version or 0)}",
        )
