"""SmartOS backend: bhyve- or KVM-brand VMs made by `vmadm` in the global zone, over SSH.

Per cell: `vmadm create` with a JSON payload on stdin (our own uuid, so a create whose connection
dropped can be found again), its disk a `zfs clone` of the published image (`lab images publish`),
the cell's vCPUs, RAM, disk model and NIC model, a static address from `addresses` (or DHCP), the
lease in `customer_metadata`; `vmadm start`; `vmadm delete` at teardown (it halts a running VM
first). `lab gc` finds VMs by the lease's marker and never touches one without it.

Addresses: a static one is in the payload's nics (bhyve guests read it from the NoCloud cidata disk
SmartOS makes for images tagged so, since platform 20260306: `check` refuses static addresses on
bhyve hosts older than that; the KVM brand's QEMU hands it out by DHCP); with DHCP the
guest's MAC is looked up in the global zone's ARP table (`arp -an`), then in this machine's
neighbour table (in `client_netns`). Ready means: running, an address, and sshd answering there.

Zones for the isolation axis (lab.backends.smartos.zones): a cell whose spec asks for a zone gets an lx
zone of the zone image `zone_images` names, made by the Zones part; it then lives and dies through the
same start / wait_ready / destroy as a VM.

The Backend seam, put together from the package's parts: globalzone (SSH to the global zone), vms
(the machines: create, start, wait, delete), zones (zone cells), payload (what vmadm is asked),
publish (`lab images publish`: the Publishing part).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab import runlock, statedir
from lab.backends.base import Backend, BackendEnv, Capabilities, PlainClient
from lab.backends.smartos import payload, publish
from lab.backends.smartos.globalzone import GlobalZone
from lab.backends.smartos.settings import DISK_MODELS, NIC_MODELS, Settings, capabilities
from lab.backends.smartos.vms import Machines
from lab.backends.smartos.zones import Zones
from lab.errors import BackendError, ConfigError, SettingError, UsageError
from lab.lease import owner_or_empty
from lab.model import Client, ImageRef, Isolation, Owned, Vm, VmSpec
from lab.runlock import RunLocks

NOCLOUD_SINCE = "20260306T044811Z"  # the first platform that hands bhyve guests a NoCloud (cidata) disk


class SmartosBackend(Backend):
    name = "smartos"
    settings_model = Settings
    settings: Settings

    def __init__(self, host_name: str, settings: Settings, env: BackendEnv | None = None):
        super().__init__(host_name, settings, env)
        self.gz = GlobalZone(host_name, settings)
        self._sysinfo: dict[str, Any] | None = None
        self._images: dict[str, str] = {}  # image name -> imgadm uuid of its published image
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", host_name)
        self._run_locks = RunLocks(lambda run_id: self.env.state_dir / f"smartos-{host}@{run_id}.lock")
        address_lock = self.env.state_dir / f"smartos-{host}.addresses.lock"
        self.machines = Machines(self.name, host_name, settings, self.gz, address_lock)
        self.zones = Zones(self.machines, self.gz, settings, self.env.ssh_key, self.check_specs)
        self.publishing = publish.Publishing(
            self.gz, settings, self.check, self._work_dir, lambda image: self._images.pop(image.name, None)
        )

    @classmethod
    def capabilities(cls, settings: Settings) -> Capabilities:  # type: ignore[override]
        return capabilities(settings)

    @classmethod
    def plan_check(cls, host_name: str, settings: Settings, specs: Sequence[VmSpec]) -> None:  # type: ignore[override]
        super().plan_check(host_name, settings, specs)
        for spec in specs:
            if spec.isolation == Isolation.ZONE and spec.image.name not in settings.zone_images:
                raise SettingError(
                    f"zone_images.{spec.image.name}",
                    None,
                    f"a zone cell of image {spec.image.name!r} needs the installed lx zone image it is made from",
                    hint=f'zone_images = {{ {spec.image.name} = "<uuid from imgadm list>" }}',
                )

    # -- the host -----------------------------------------------------------------------------------
    def sysinfo(self) -> dict[str, Any]:
        if self._sysinfo is None:
            info = self.gz.json(["sysinfo"], what="sysinfo")
            if not isinstance(info, dict) or "Live Image" not in info:
                raise UsageError(
                    f"host {self.host_name!r}: {self.settings.ssh} does not answer `sysinfo` as a "
                    "SmartOS global zone does",
                    hint="point `ssh` at the global zone, not a zone",
                )
            self._sysinfo = info
        return self._sysinfo

    def check(self) -> None:
        info = self.sysinfo()
        brand = self.settings.brand
        capable = info.get("Bhyve Capable") if brand == "bhyve" else info.get("VM Capable")
        if not capable:
            raise UsageError(
                f"host {self.host_name!r}: the global zone says it cannot run {brand} VMs "
                f"(platform {info.get('Live Image')}, CPU virtualization "
                f"{info.get('CPU Virtualization', '?')})"
            )
        platform = str(info.get("Live Image") or "")
        if brand == "bhyve" and self.settings.addresses and platform < NOCLOUD_SINCE:
            raise ConfigError(
                self.env.source,
                f"hosts.{self.host_name}.addresses",
                self.settings.addresses,
                f"platform {platform} predates SmartOS's NoCloud disk ({NOCLOUD_SINCE}): a bhyve "
                "guest cannot learn a static address there",
                hint='set addresses = "" (DHCP on the nic_tag\'s network), or upgrade the platform',
            )
        tags = nic_tags(info)
        if self.settings.nic_tag not in tags:
            raise ConfigError(
                self.env.source,
                f"hosts.{self.host_name}.nic_tag",
                self.settings.nic_tag,
                f"the host has no such NIC tag; it has {', '.join(sorted(tags)) or 'none'}",
            )

    def check_specs(self, specs: Sequence[VmSpec]) -> None:
        """The capabilities' limits, then what this host said: bhyve's vCPU limit and its memory."""
        super().check_specs(specs)
        info = self.sysinfo()
        where = f"host {self.host_name!r} ({info.get('Live Image')})"
        max_vcpus = info.get("Bhyve Max Vcpus") if self.settings.brand == "bhyve" else None
        memory = int(info.get("MiB of Memory") or 0)
        self.zones.learn(specs)
        for spec in specs:
            zone = spec.isolation == Isolation.ZONE  # its vCPUs are a CPU cap, not bhyve's
            if not zone and isinstance(max_vcpus, int) and spec.vcpus > max_vcpus:
                raise SettingError("vcpus", spec.vcpus, f"more than the {max_vcpus} vCPUs bhyve takes on {where}")
            if memory and spec.memory_mib > memory:
                raise SettingError("memory_mib", spec.memory_mib, f"more than the {memory} MiB {where} has")

    def check_images(self, images: Sequence[ImageRef]) -> None:
        entries = publish.installed(self.gz)
        for image in images:
            found, why = payload.usable_image(entries, self.settings, image)
            if found is None:
                raise UsageError(
                    f"host {self.host_name!r} {why}", hint=f"lab images publish {image.name} {self.host_name}"
                )
            self._images[image.name] = found

    def facts(self) -> dict[str, Any]:
        info = self.sysinfo()
        out = {
            "hypervisor": "smartos",
            "brand": self.settings.brand,
            "platform": info.get("Live Image"),
            "nic_tag": self.settings.nic_tag,
        }
        if self.settings.brand == "bhyve":
            out["bootrom"] = self.settings.bootrom
        return out

    def host_facts(self) -> dict[str, Any]:
        info = self.sysinfo()
        memory = info.get("MiB of Memory")
        return {
            "cpu_model": info.get("HW Version") or info.get("CPU Type"),
            "cores": info.get("CPU Online Count") or info.get("CPU Total Cores"),
            "sockets": info.get("CPU Socket Count") or info.get("CPU Physical Cores"),
            "mem_kib": int(str(memory)) * 1024 if str(memory or "").isdigit() else None,
            "kernel": info.get("Live Image"),
            "os": f"SmartOS {info.get('Live Image')}",
            "virt_flags": [v for v in [info.get("CPU Virtualization")] if v not in (None, "none")],
            "smt": (info.get("Psrinfo") or {}).get("smt_enabled"),
            "bhyve_capable": info.get("Bhyve Capable"),
            "bhyve_max_vcpus": info.get("Bhyve Max Vcpus"),
            "hvm_api": info.get("HVM API"),
            "zpool": info.get("Zpool"),
            "product": " ".join(str(info.get(k) or "") for k in ("Manufacturer", "Product")).strip(),
        }

    # -- images ---------------------------------------------------------------------------------------
    def _image_uuid(self, image: ImageRef) -> str:
        if image.name not in self._images:
            self.check_images([image])
        return self._images[image.name]

    def _work_dir(self) -> Path:
        return statedir.ensure(self.env.state_dir)  # private: run locks and the address lock live here

    # -- per run ----------------------------------------------------------------------------------------
    def open_run(self, run_id: str) -> Client:
        # Held for the run's life: `lab gc` here removes a killed run's VMs at once.
        self._work_dir()
        self._run_locks.acquire(run_id, what=f"the lock of run {run_id} on host {self.host_name!r}")
        return PlainClient(self.settings.client_address, self.settings.client_netns or None)

    def outside_netns(self) -> str | None:
        return self.settings.client_netns or None  # where this machine's SSH to the host's side goes

    def close_run(self, run_id: str) -> None:
        try:
            self.gz.close()
        finally:
            self._run_locks.release(run_id)

    def run_is_live(self, run_id: str) -> bool | None:
        return self._run_locks.live(run_id)

    # -- per VM (lab.backends.smartos.vms; zones: lab.backends.smartos.zones) ---------------------------
    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        if spec.isolation == Isolation.ZONE:
            return self.zones.make(image, spec)
        brand = self.settings.brand
        if spec.nic not in NIC_MODELS[brand] or spec.disk_bus not in DISK_MODELS[brand]:
            raise UsageError(
                f"host {self.host_name!r}: the {brand} brand has no {spec.nic} NIC or {spec.disk_bus} disk"
            )
        image_uuid = self._image_uuid(image)
        t0 = time.monotonic()
        vm = self.machines.create(
            spec, lambda uuid, ip: payload.vm_payload(self.settings, spec, uuid=uuid, image_uuid=image_uuid, ip=ip)
        )
        vm.facts.update(
            {
                "brand": brand,
                "image_uuid": image_uuid,
                "clone": "linked",
                "clone_seconds": round(time.monotonic() - t0, 2),
            }
        )
        return vm

    def create_zone(self, spec: VmSpec, *, brand: str, image_uuid: str, kernel_version: str = "") -> Vm:
        """A joyent or lx zone for a cell (Zones.create)."""
        return self.zones.create(spec, brand=brand, image_uuid=image_uuid, kernel_version=kernel_version)

    def known_hosts(self, vm: Vm) -> str:
        """A zone's host key is made at its first boot: read from its root through the global zone."""
        if vm.spec.isolation != Isolation.ZONE:
            return super().known_hosts(vm)
        return self.zones.known_hosts(vm)

    def start(self, vm: Vm) -> None:
        self.machines.start(vm)

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        return self.machines.wait_ready(vm, timeout)

    def renew_lease(self, vm: Vm, expires_at: float) -> None:
        self.machines.renew_lease(vm, expires_at)

    def destroy(self, vm: Vm) -> None:
        self.machines.destroy(vm)

    # -- garbage collection ---------------------------------------------------------------------------------
    def list_owned(self) -> list[Owned]:
        out = []
        for vm in self.machines.lab_vms():
            run_id, name, expires = payload.lease_of(vm)
            out.append(
                Owned(
                    backend=self.name,
                    kind="vm",
                    name=name,
                    run_id=run_id,
                    expires_at=expires,
                    detail=str(vm["uuid"]),
                    owner=owner_or_empty(payload.owner_of(vm)),
                )
            )
        return out + self._run_locks.owned(self.name)

    def remove_owned(self, item: Owned) -> None:
        if item.kind == "lock":
            runlock.remove_if_dead(Path(item.detail))  # never the lock of a live run
            return
        got = self.machines.get(item.detail)
        if got is None:
            return
        if not payload.is_ours(got):  # the uuid was reused, or the item was forged: not ours to delete
            raise BackendError(f"host {self.host_name!r}: VM {item.detail} does not carry the lab's marker; left alone")
        self.machines.delete(item.detail, item.name)


def nic_tags(info: dict[str, Any]) -> set[str]:
    """Every NIC tag sysinfo lists (physical and virtual NICs, overlays), plus the link names: vmadm
    takes an etherstub or device name as a nic_tag too."""
    tags: set[str] = set()
    for group in ("Network Interfaces", "Virtual Network Interfaces"):
        for link, nic in (info.get(group) or {}).items():
            tags.add(str(link))
            tags.update(str(t) for t in nic.get("NIC Names") or [])
            tags.update(t.strip() for t in str(nic.get("Overlay Nic Tags") or "").split(",") if t.strip())
    return tags


BACKEND = SmartosBackend
