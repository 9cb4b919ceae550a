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

Zones, the backend's part for them, makes a zone cell's machine (and any joyent or lx zone) through
the backend's machines (lab.backends.smartos.vms); it then lives and dies through the same start /
wait_ready / destroy as a VM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lab.backends.smartos import payload, publish
from lab.backends.smartos.globalzone import GlobalZone
from lab.backends.smartos.settings import Settings
from lab.backends.smartos.vms import Machines
from lab.errors import SettingError, UsageError, VerificationError
from lab.model import ImageRef, Isolation, Vm, VmSpec

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


class Zones:
    def __init__(
        self,
        machines: Machines,
        gz: GlobalZone,
        settings: Settings,
        ssh_key: Path,
        check_specs: Callable[[Sequence[VmSpec]], None],
    ):
        self.machines, self.gz, self.settings, self.host_name = machines, gz, settings, machines.host_name
        self.ssh_key = ssh_key
        self.check_specs = check_specs  # the backend's: learns the zone images of zone specs
        self.images: dict[str, dict[str, str]] = {}  # image name -> its zone image (zone_image)

    def learn(self, specs: Sequence[VmSpec]) -> None:
        """The zone image of each zone spec's image (SettingError naming zone_images if it is missing)."""
        zones = [s for s in specs if s.isolation == Isolation.ZONE]
        entries = publish.installed(self.gz) if zones else []
        for spec in zones:
            name = spec.image.name
            self.images[name] = zone_image(entries, self.settings.zone_images[name], name, self.host_name)

    def create(self, spec: VmSpec, *, brand: str, image_uuid: str, kernel_version: str = "") -> Vm:
        """A joyent or lx zone for a cell (the isolation axis): `image_uuid` is an installed zone image
        (`imgadm list`), root's key the lab's. It lives and dies through start / wait_ready / destroy."""
        key = self.ssh_key.with_suffix(".pub")
        if not key.exists():
            raise UsageError(f"the lab's public key {key} is missing", hint="run `make images`")
        vm = self.machines.create(
            spec,
            lambda uuid, ip: payload.zone_payload(
                self.settings,
                spec,
                uuid=uuid,
                brand=brand,
                image_uuid=image_uuid,
                ip=ip,
                authorized_keys=key.read_text().strip(),
                kernel_version=kernel_version,
            ),
        )
        vm.facts.update({"brand": brand, "image_uuid": image_uuid, "isolation": "zone"})
        return vm

    def make(self, image: ImageRef, spec: VmSpec) -> Vm:
        """A zone cell's machine: an lx zone of the zone image for `image`, its caps read back and
        checked; nothing is left if they differ."""
        if image.name not in self.images:
            self.check_specs([spec])
        made = self.images[image.name]
        t0 = time.monotonic()
        vm = self.create(spec, brand="lx", image_uuid=made["uuid"], kernel_version=made["kernel_version"])
        try:
            got = self.machines.get(vm.handle["uuid"]) or {}
            zone = caps(got)
            vm.handle["zonepath"] = zone["zonepath"]
            vm.facts.update(
                {
                    "zone_image": made["image"],
                    "kernel_version": made["kernel_version"],
                    "clone_seconds": round(time.monotonic() - t0, 2),
                    "caps": verify_zone(zone, spec),
                    "cpu_accounting": CPU_ACCOUNTING,
                }
            )
        except BaseException:
            self.machines.destroy_quietly(vm)
            raise
        return vm

    def known_hosts(self, vm: Vm) -> str:
        """A zone's host key is made at its first boot: read from its root through the global zone."""
        path = f"{vm.handle['zonepath']}/{HOST_KEY}"
        return known_hosts(vm.address, self.gz.read(["cat", path], what=f"cat {path}").stdout)
