"""Zone cells on a SmartOS host (matrix isolation "zone"): an lx zone made by `vmadm create` from the
installed zone image `zone_images` names for the cell's image, in place of a VM.

What differs from a VM, and why:
- The zone image is the operator's (`imgadm import` of an lx image, e.g. Debian 12), not the lab's
  golden image: a zone boots no disk of its own. Its kernel is the host's, emulating the Linux version
  the image's tags give (`kernel_version`).
- Its CPU and memory are caps (cpu_cap, 100 per vCPU; max_physical_memory), read back from `vmadm` by
  verify_zone: inside, a zone sees its host's CPUs, and its vnic has no emulated NIC model.
- Its host keys are made at its first boot, so no image can carry them: they are read from the zone's
  root as the global zone sees it (<zonepath>/root/etc/ssh), over the global zone's checked SSH.
"""

from __future__ import annotations

from typing import Any

from lab.errors import SettingError, VerificationError
from lab.model import VmSpec

HOST_KEY = "root/etc/ssh/ssh_host_ed25519_key.pub"  # under the zonepath
CPU_ACCOUNTING = "the zone's processor set as a whole: an lx zone's /proc/stat counts every zone's use of its CPUs"


def zone_image(entries: list[dict[str, Any]], uuid: str, image: str, host: str) -> dict[str, str]:
    """The installed zone image `uuid` (from `imgadm list -j`) a zone cell of lab image `image` is made
    from: its name, version and the Linux version it emulates. SettingError names zone_images if it
    is missing or not an lx image."""
    manifest = next((e.get("manifest") or {} for e in entries if (e.get("manifest") or {}).get("uuid") == uuid), None)
    key = f"zone_images.{image}"
    if manifest is None:
        raise SettingError(
            key, uuid, f"host {host!r} has no such image installed", hint=f"run `imgadm import {uuid}` on the host"
        )
    if manifest.get("type") != "lx-dataset":
        raise SettingError(
            key,
            uuid,
            f"image {manifest.get('name')}@{manifest.get('version')} is a {manifest.get('type')}, not an lx zone "
            f"image (lx-dataset): the lab's images run Linux",
        )
    kernel = str((manifest.get("tags") or {}).get("kernel_version") or "")
    if not kernel:
        raise SettingError(key, uuid, "its manifest's tags give no kernel_version for the lx brand to emulate")
    return {"uuid": uuid, "image": f"{manifest.get('name')}@{manifest.get('version')}", "kernel_version": kernel}


def caps(obj: dict[str, Any]) -> dict[str, Any]:
    """What the host made the zone with (its `vmadm get` object): what verify_zone reads back."""
    return {k: obj.get(k) for k in ("brand", "zonepath", "cpu_cap", "max_physical_memory", "kernel_version")}


def verify_zone(zone: dict[str, Any], spec: VmSpec) -> dict[str, Any]:
    """Pure: the caps the host gave the zone (caps()) against the cell's vCPUs and memory, as the
    cell's `verified` facts; VerificationError on a mismatch."""
    problems = []
    if zone.get("cpu_cap") != 100 * spec.vcpus:
        problems.append(f"the zone's cpu_cap is {zone.get('cpu_cap')}, cell asked for {spec.vcpus} vCPUs")
    if zone.get("max_physical_memory") != spec.memory_mib:
        problems.append(
            f"the zone's max_physical_memory is {zone.get('max_physical_memory')} MiB, cell asked for {spec.memory_mib}"
        )
    if problems:
        raise VerificationError("; ".join(problems))
    return {
        "nic_driver": "vnic",  # no emulated model: the nic axis means nothing for a zone
        "vcpus": spec.vcpus,
        "mem_kib": spec.memory_mib * 1024,
        "cpu_cap": zone["cpu_cap"],
        "max_physical_memory": zone["max_physical_memory"],
    }


def known_hosts(address: str, host_key: str) -> str:
    """Pure: the known_hosts line of a zone's host key (`type key [comment]`) at its address."""
    parts = host_key.split()
    if len(parts) < 2 or not parts[0].startswith("ssh-"):
        raise VerificationError(f"the zone's host key at {HOST_KEY} is not an SSH public key: {host_key[:60]!r}")
    return f"{address} {parts[0]} {parts[1]}\n"
