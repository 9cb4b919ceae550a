"""Can this libvirt host make this VM? The base's capability check (NIC model, disk bus, clone
kind, size) extended with the driver's own rules, and, once the host's libvirt version is known,
the version each value needs. Pure: `lab plan` asks before anything exists (version unknown), and
clone() asks again with the version check() learnt, before anything is created."""

from __future__ import annotations

import ipaddress
import re

from lab.backends.base import check_spec as check_capabilities
from lab.backends.libvirt.drivers import USABLE_NAME, require, too_old, version_text
from lab.backends.libvirt.settings import Host, capabilities
from lab.errors import SettingError, UsageError
from lab.model import CloneKind, VmSpec

MAC = re.compile(r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$")


def check_spec(host: Host, spec: VmSpec, lib_version: int | None = None) -> None:
    """SettingError naming the lab.toml key (a matrix axis or a host key) and value."""
    caps = host.caps
    where = f"host {host.name!r} (libvirt/{host.driver})"
    if not USABLE_NAME.match(spec.name):
        raise UsageError(f"VM name {spec.name!r} is not usable as a libvirt/zfs/file name")
    check_capabilities(capabilities(host), spec, where)
    for key, value in (("nic", spec.nic.value), ("disk_bus", spec.disk_bus.value)):
        need = too_old(caps, value, lib_version)
        if need:
            raise SettingError(
                key,
                value,
                f"needs libvirt >= {version_text(need)} on {where}, which runs {version_text(lib_version or 0)}",
            )
    check_host_version(host, lib_version)
    if spec.clone is CloneKind.LINKED and host.driver == "qemu" and host.disk_format != "qcow2":
        raise SettingError(
            "clone",
            "linked",
            f"a linked clone needs disk_format qcow2 on {where} (it has {host.disk_format})",
            hint="use clone = full, or disk_format = qcow2",
        )
    if spec.memory_mib < 64:
        raise SettingError("memory_mib", spec.memory_mib, "too small (>= 64)")
    if spec.ip:
        try:
            ipaddress.ip_interface(spec.ip if "/" in spec.ip else f"{spec.ip}/{host.prefix}")
        except ValueError:
            raise UsageError(f"ip = {spec.ip!r} is not an IPv4/IPv6 address") from None
    if spec.mac and not MAC.match(spec.mac.lower()):
        raise UsageError(f"mac = {spec.mac!r} is not a MAC address")
    for feature in filter(None, (f.strip() for f in spec.labels.get("requires", "").split(","))):
        require(caps, feature, lib_version, host.name)
    if spec.start == "warm":
        check_warm(host, spec, lib_version)
    elif spec.start != "cold":
        raise SettingError("start", spec.start, "is cold or warm")


def check_warm(host: Host, spec: VmSpec, lib_version: int | None) -> None:
    """What a warm start (a restored post-boot snapshot) needs of the host and the cell."""
    where = f"host {host.name!r} (libvirt/{host.driver})"
    if "save-restore" not in host.caps.features:
        missing = capabilities(host).missing.get("snapshots", "no memory snapshots")
        raise SettingError(
            "start", "warm", f"not available on {where}: {missing}", hint="exclude it for this host in [matrix] exclude"
        )
    if host.test_uri:
        raise SettingError("start", "warm", f"not available on {where}: the test driver has no guest agent")
    need = too_old(host.caps, "genid", lib_version)
    if need:
        raise SettingError(
            "start",
            "warm",
            f"needs libvirt >= {version_text(need)} on {where} (the VM generation "
            f"ID that reseeds a restored guest's RNG), which runs {version_text(lib_version or 0)}",
        )
    if not spec.ip and host.subnet is None:
        raise SettingError(
            "start",
            "warm",
            f"needs a static address for each cell on {where}: a restored "
            "guest is given its address by the guest agent, not by DHCP",
            hint=f"set {host.where}subnet (and gateway / client_address)",
        )
    if (spec.image.manifest or {}).get("guest_agent") is False:
        raise SettingError(
            "start",
            "warm",
            f"image {spec.image.name!r} has no guest agent, which gives a restored guest its clock, MAC and address",
        )


def check_host_version(host: Host, lib_version: int | None) -> None:
    """The host's settings against its libvirt version (nothing while it is unknown)."""
    if host.driver == "bhyve" and host.firmware == "uefi":
        need = too_old(host.caps, "uefi", lib_version)
        if need:
            raise SettingError(
                "firmware",
                "uefi",
                f"needs libvirt >= {version_text(need)} on host {host.name!r}, "
                f"which runs {version_text(lib_version or 0)}",
                where=host.where,
            )
