"""`[hosts.NAME] backend = "smartos"`: a SmartOS host, driven in its global zone over SSH
(`vmadm`, `imgadm`, `sysinfo`). One brand per host: to compare bhyve and KVM on one machine, define
two hosts with the same `ssh` and a different `brand`, and put both in `matrix.host`."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from lab.backends import fields
from lab.backends.base import Capabilities, HostSettings
from lab.backends.proxmox.settings import (  # one pool syntax for every backend
    address_pool,  # noqa: F401 - the backend's, from here
    check_addresses,
    pool_problems,
)
from lab.model import CloneKind, DiskBus, Isolation, NicModel, named_as_lab

TIMEOUT_KEYS = Literal["connect", "command", "create", "start", "stop", "delete", "ready", "publish"]
DEFAULT_TIMEOUTS = {
    "connect": 10.0,
    "command": 120.0,
    "create": 300.0,
    "start": 120.0,
    "stop": 60.0,
    "delete": 300.0,
    "ready": 600.0,
    "publish": 3600.0,
}

# vmadm(8): nics.*.model and disks.*.model per brand, as the lab's axes name them. bhyve emulates
# virtio (viona) and e1000 NICs, virtio/ahci/nvme disks; the KVM brand's QEMU virtio/e1000/rtl8139
# NICs and virtio/ide/scsi disks (scsi is QEMU's LSI controller).
NIC_MODELS: dict[str, dict[NicModel, str]] = {
    "bhyve": named_as_lab(NicModel.VIRTIO, NicModel.E1000),
    "kvm": named_as_lab(NicModel.VIRTIO, NicModel.E1000, NicModel.RTL8139),
}
DISK_MODELS: dict[str, dict[DiskBus, str]] = {
    "bhyve": {DiskBus.VIRTIO: "virtio", DiskBus.SATA: "ahci", DiskBus.NVME: "nvme"},
    "kvm": {DiskBus.VIRTIO: "virtio", DiskBus.IDE: "ide", DiskBus.SCSI: "scsi"},
}
MAX_VCPUS = {"bhyve": 32, "kvm": 64}  # sysinfo "Bhyve Max Vcpus" is 32 on current platforms
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class Settings(HostSettings):
    backend: Literal["smartos"]
    ssh: str = Field(description='the global zone, e.g. "root@gz1.example" (vmadm and imgadm need root)')
    ssh_port: int = Field(default=22, ge=1, le=65535, description="the global zone's SSH port")
    ssh_key: str | None = Field(
        default=None, description="identity file; default: ssh's own (agent, ~/.ssh/id_*); relative to lab.toml"
    )
    ssh_options: list[str] = Field(
        default=[], description='extra `ssh -o` options, e.g. ["UserKnownHostsFile=/etc/lab/gz_hosts"]'
    )
    brand: Literal["bhyve", "kvm"] = Field(default="bhyve", description="the VM brand: bhyve or kvm")
    bootrom: Literal["bios", "uefi"] = Field(
        default="bios", description="bhyve's firmware; the KVM brand boots by BIOS only"
    )
    image: str = Field(
        default="lab-{image}", description="the imgadm image name `lab images publish` makes and clones come from"
    )
    zpool: str = Field(default="zones", description="the zpool the VMs' disks live in")
    nic_tag: str = Field(
        default="external", description="sysinfo's \"NIC Names\" (or an etherstub) the guest's NIC joins"
    )
    vlan_id: int = Field(default=0, ge=0, le=4095, description="the guest NIC's VLAN (0: none)")
    addresses: str = Field(
        default="", description='static guest addresses "FIRST-LAST" or a CIDR; "" = DHCP on the nic_tag\'s network'
    )
    gateway: str = Field(default="", description='of static addresses ("" = none)')
    prefix_len: int = Field(default=24, ge=8, le=30, description="prefix length of static addresses")
    resolvers: list[str] = Field(default=[], description="the guests' DNS resolvers")
    client_address: str = Field(default="", description="this machine as the guests see it (iperf3/wrk servers)")
    client_netns: str = Field(
        default="", description="load generators and SSH to guests run in this network namespace of this machine"
    )
    cpu_type: Literal["host", "qemu64"] = Field(default="host", description="KVM brand only: the guest CPU type")
    # matrix isolation "zone": lab image -> the installed lx zone image (imgadm uuid) its zones are made from
    zone_images: dict[str, str] = Field(
        default={},
        description=(
            'matrix isolation "zone": lab image -> the installed lx zone image (imgadm uuid) its zones are made from'
        ),
    )
    timeouts: dict[TIMEOUT_KEYS, Annotated[float, Field(gt=0, le=86400)]] = Field(
        default={}, description="seconds per phase: connect, command, create, start, stop, delete, ready, publish"
    )
    poll_interval: float = Field(default=1.0, gt=0, le=60, description="poll interval of vmadm/imgadm state, seconds")

    def timeout(self, key: str) -> float:
        return float(self.timeouts.get(key, DEFAULT_TIMEOUTS[key]))  # type: ignore[call-overload]

    def problems(self) -> list[tuple[str, object, str]]:
        if self.brand == "kvm" and self.bootrom != "bios":
            return [("bootrom", self.bootrom, "the KVM brand boots by BIOS only (bootrom is a bhyve setting)")]
        if self.brand != "kvm" and "cpu_type" in self.model_fields_set:
            return [("cpu_type", self.cpu_type, 'is a setting of the KVM brand (brand = "kvm"); bhyve has none')]
        return pool_problems(self.addresses, gateway=self.gateway, client_address=self.client_address)

    @field_validator("ssh")
    @classmethod
    def _ssh(cls, v: str) -> str:
        if not v:
            raise ValueError('must be an SSH destination such as "root@gz1.example"')
        return fields.ssh_destination(v)

    @field_validator("ssh_key")
    @classmethod
    def _ssh_key(cls, v: str | None, info: ValidationInfo) -> str | None:
        return None if v is None else fields.regular_file(v, info, "the private key to log in to the global zone with")

    @field_validator("ssh_options")
    @classmethod
    def _ssh_options(cls, v: list[str]) -> list[str]:
        for opt in v:
            if not re.fullmatch(r"[A-Za-z]+=\S.*", opt):
                raise ValueError(f"{opt!r} is not an ssh option of the form Name=value")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._{}-]+", v):
            raise ValueError("must be an image name (letters, digits, . _ -; {image} for the image's name)")
        return v

    @field_validator("addresses")
    @classmethod
    def _addresses(cls, v: str) -> str:
        return check_addresses(v)

    @field_validator("resolvers")
    @classmethod
    def _resolvers(cls, v: list[str]) -> list[str]:
        for r in v:
            try:
                ipaddress.ip_address(r)
            except ValueError:
                raise ValueError(f"{r!r} is not an IP address") from None
        return v

    @field_validator("zone_images")
    @classmethod
    def _zone_images(cls, v: dict[str, str]) -> dict[str, str]:
        for name, uuid in v.items():
            if not UUID.fullmatch(uuid):
                raise ValueError(f"{name} = {uuid!r} is not an image uuid (as `imgadm list` prints it)")
        return v

    @field_validator("zpool", "nic_tag")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", v):
            raise ValueError("must be a name (letters, digits, . _ -)")
        return v


def capabilities(settings: Settings) -> Capabilities:
    brand = settings.brand
    return Capabilities(
        description=f"SmartOS {'bhyve' if brand == 'bhyve' else 'KVM'}",
        nic_models=frozenset(NIC_MODELS[brand]),
        disk_buses=frozenset(DISK_MODELS[brand]),
        clone_kinds=frozenset({CloneKind.LINKED}),  # vmadm makes an image's disk with `zfs clone`
        boot_modes=frozenset({settings.bootrom}),
        max_vcpus=MAX_VCPUS[brand],
        machine_isolation=frozenset({Isolation.ZONE}) if settings.zone_images else frozenset(),
        missing={
            "zone": 'its settings name no zone image: set zone_images = { IMAGE = "<uuid of an installed lx image>" }',
            "clone=full": "vmadm clones an image's disk with zfs clone: there is no full copy",
            "snapshots": "vmadm has no memory snapshots: warm start is not available",
        },
    )
