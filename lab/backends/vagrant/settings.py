"""`[hosts.NAME] backend = "vagrant"`: cells run through Vagrant, one generated Vagrantfile per
cell (lab.backends.vagrant.backend documents the lifecycle)."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import Field, ValidationError, field_validator

from lab.backends import fields
from lab.backends.base import Capabilities, HostSettings
from lab.backends.libvirt import settings as libvirt_settings
from lab.model import CloneKind, DiskBus, NicModel, named_as_lab

# What vagrant-libvirt can ask libvirt's QEMU driver for: `nic_model_type` takes any QEMU model,
# `disk_bus` these four (bus='nvme' is newer than Debian 12's libvirt 9.0).
LIBVIRT_NICS = named_as_lab(*NicModel)
LIBVIRT_DISK_BUSES = frozenset({DiskBus.VIRTIO, DiskBus.SCSI, DiskBus.SATA, DiskBus.IDE})
# Written unescaped into the domain XML and Ruby strings by vagrant-libvirt and our template
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9_./+-]*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class Settings(HostSettings):
    backend: Literal["vagrant"]
    # Vagrant's provider. Only vagrant-libvirt is implemented: the one provider Debian packages
    # and the one this machine can run (no VirtualBox, no nested KVM).
    provider: Literal["libvirt"] = Field(
        default="libvirt", description="Vagrant's provider: only vagrant-libvirt is implemented"
    )
    uri: str = Field(
        default="qemu:///system", description="the libvirt daemon vagrant-libvirt and lab's checks talk to"
    )
    driver: Literal["qemu", "kvm"] = Field(default="qemu", description="domain type: qemu = TCG, or kvm")
    # <workdir>/<run>/<vm>/Vagrantfile; `lab gc` looks here and runs `vagrant destroy` in what it finds,
    # so it is held to the state directory's rules (lab.statedir: this user's alone). Default:
    # "vagrant" in the lab's private state directory (BackendEnv.state_dir)
    workdir: str | None = Field(
        default=None,
        description=(
            '<workdir>/<run>/<vm>/Vagrantfile; `lab gc` looks here (default: "vagrant" in the state directory); must be'
            " this user's alone"
        ),
    )
    vagrant_home: str | None = Field(
        default=None, description="VAGRANT_HOME (boxes, machine index); unset: Vagrant's default"
    )
    storage_pool: str = Field(
        default="default", description="libvirt pool for the box's base volume and each cell's overlay"
    )
    # Each run gets its own isolated libvirt network (no forwarding: load stays on it), a free /24
    # of this range; the guest takes a DHCP lease, the host side is the run's client address.
    subnets: str = Field(
        default="10.79.0.0/16", description="each run gets its own isolated libvirt network, a free /24 of this range"
    )
    boot_timeout: float = Field(default=600.0, gt=0, le=3600, description="`vagrant up` until SSH answers, seconds")
    destroy_timeout: float = Field(default=300.0, gt=0, le=3600, description="`vagrant destroy`, seconds")

    @field_validator("workdir", "vagrant_home")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = fields.state_dir(v)  # `~` expanded, absolute (lab.paths)
        if not _SAFE_PATH.match(v):
            raise ValueError("must be an absolute path of letters, digits and _ . / + -")
        return v

    @field_validator("storage_pool")
    @classmethod
    def _pool(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("is not a libvirt storage pool name")
        return v

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if not v.startswith(("qemu:///", "qemu+")):
            raise ValueError("must be a libvirt QEMU URI such as qemu:///system (vagrant-libvirt drives QEMU)")
        # the libvirt backend's own checks of a libvirt URI: one key, one validator
        try:
            libvirt_settings.Settings.model_validate({"backend": "libvirt", "uri": v})
        except ValidationError as exc:
            raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return v

    @field_validator("subnets")
    @classmethod
    def _subnets(cls, v: str) -> str:
        try:
            net = ipaddress.IPv4Network(v)
        except ValueError as exc:
            raise ValueError(f"is not an IPv4 network: {exc}") from None
        if net.prefixlen > 24:
            raise ValueError("must hold at least one /24 (prefix 24 or shorter)")
        if net.prefixlen < 8:  # its /24s are listed to find a free one: at most 65,536 of them
            raise ValueError("holds more than 65,536 /24s: a prefix of 8 or longer")
        return v


def capabilities(settings: Settings) -> Capabilities:
    return Capabilities(
        description=f"Vagrant/{settings.provider}",
        nic_models=frozenset(LIBVIRT_NICS),
        disk_buses=LIBVIRT_DISK_BUSES,
        # vagrant-libvirt always makes a qcow2 overlay on the box's volume
        clone_kinds=frozenset({CloneKind.LINKED}),
        # the box boots by SeaBIOS and the image's GRUB; DHCP on the run's network
        boot_modes=frozenset({"bios"}),
        max_vcpus=255,
        publish=True,
        missing={"snapshots": "Vagrant boots every cell cold: warm start is not available"},
    )
