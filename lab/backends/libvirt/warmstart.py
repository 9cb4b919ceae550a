"""The libvirt backend's warm start part (lab.backends.base.WarmSnapshots), on QEMU hosts: the
snapshot of a cell's machine shape (built once, lab.backends.libvirt.warm), restored as the cell
(its own copy of the save image naming it, then its clock, MAC and address through the guest
agent), and the snapshots the host keeps, for `lab images ls --warm` and `lab gc`."""

from __future__ import annotations

import time
import uuid as uuidlib
from dataclasses import replace

from lab.backends.base import NotSupported
from lab.backends.libvirt import domain, saveimage, warm
from lab.backends.libvirt.agent import Agent, give_identity
from lab.backends.libvirt.connection import error_message, libvirt_module
from lab.backends.libvirt.vms import Machines, golden_root
from lab.errors import BackendError, IncompleteListing, LabError
from lab.model import CloneKind, Owned, Vm, VmSpec


class WarmStart:
    def __init__(self, machines: Machines, store: warm.WarmStore):
        """`machines`: the backend's, whose host, connection, shell, disks and inventory it uses."""
        self.backend, self.host, self.host_name = machines.backend, machines.host, machines.host_name
        self.connection, self.shell, self.disks = machines.connection, machines.shell, machines.disks
        self.inventory, self.store = machines.inventory, store

    def snapshot_for(self, spec: VmSpec, vm: Vm) -> warm.Snapshot | None:
        """The snapshot of the cell's shape (built now if there is none); None, and the reason in
        vm.facts["start"], when there is none to be had: the cell boots cold."""
        try:
            key = warm.shape(self.host, spec, self.disks.golden_source(spec.image))
            snap = self.store.ensure(
                spec, key, lambda name, disk, log: self._snapshot_xml(spec, name, disk, log), self.inventory.in_use
            )
        except LabError as exc:
            vm.facts["start"] = f"cold: no warm snapshot ({exc})"
            return None
        vm.facts["warm"] = {
            "snapshot": snap.name,
            "state_bytes": snap.state_bytes,
            **({"built_seconds": snap.built_seconds} if snap.built_seconds else {}),
        }
        return snap

    def _snapshot_xml(self, spec: VmSpec, name: str, disk: str, log: str) -> str:
        """The domain a warm snapshot is booted in: the cell's shape, the guest agent, a VM
        generation ID, SeaBIOS (qboot hangs with the generation ID device); its lease names the
        run that builds it, so `lab gc` removes a build that died with its run."""
        mac = domain.mac_for(name)
        placement = domain.Placement(
            uuid=str(uuidlib.uuid4()), disk_ref=f"file:{disk}", disk_path=disk, console=log, mac=mac
        )
        tspec = replace(spec, name=name, cell_id="warm-snapshot", mac=mac, clone=CloneKind.LINKED)
        host = self.host.model_copy(update={"guest_agent": True, "bios": ""})
        root = golden_root(self.host, self.disks, spec.image)
        return domain.render(host, tspec, placement, root, genid=str(uuidlib.uuid4()))

    def restore(self, vm: Vm, snap: warm.Snapshot) -> None:
        """The snapshot restored as this cell (its own copy of the save image, naming it), then its
        clock, MAC and address through the guest agent, and LAB-READY on its console."""
        libvirt = libvirt_module()
        ident = saveimage.Identity(
            name=vm.name,
            uuid=vm.handle["uuid"],
            genid=str(uuidlib.uuid4()),
            lease=vm.handle["lease"],
            disk_path=vm.handle["disk_path"],
            disk_format=self.host.disk_format,
            console=vm.handle["console"],
            mac=vm.handle["mac"],
        )
        state = f"{self.disks.clone_dir()}/{vm.name}.state"
        t0 = time.monotonic()
        self.store.write_state(snap, state, saveimage.clone_xml(snap.header.xml, ident, domain.LEASE_NS))
        t1 = time.monotonic()
        try:
            self.connection.get().restoreFlags(state, None, libvirt.VIR_DOMAIN_SAVE_RUNNING)
        except libvirt.libvirtError as exc:
            raise BackendError(f"restore failed: {error_message(exc)}") from None
        finally:
            self.shell.run_argv(
                self.disks.remove_argv(f"file:{state}"), timeout=60, check=False, what="rm the copy of the warm state"
            )
        t2 = time.monotonic()
        dom = self.connection.lookup(vm.name)
        if dom is None:
            raise BackendError("the restored domain is gone")
        address = vm.spec.ip if "/" in vm.spec.ip else f"{vm.spec.ip}/{self.host.prefix}"
        give_identity(Agent(dom), address, vm.handle["mac"], self.host.gateway)
        vm.facts["warm"].update(
            state_copy_seconds=round(t1 - t0, 3),
            restore_seconds=round(t2 - t1, 3),
            identity_seconds=round(time.monotonic() - t2, 3),
        )

    def snapshots(self) -> list[Owned]:
        if self.host.driver != "qemu" or self.host.test_uri:
            return []
        try:
            return self.store.owned(self.backend)
        except LabError as exc:
            raise IncompleteListing(
                f"host {self.host_name!r}: warm snapshots could not be listed",
                [],
                [f"warm snapshots in {self.host.pool or self.host.dir}: {exc}"],
            ) from None

    def remove(self, item: Owned) -> None:
        if item.kind != "warm" or self.host.driver != "qemu":
            raise NotSupported(f"host {self.host_name!r} keeps no warm snapshot {item.name!r}")
        self.store.remove(item.name, self.inventory.in_use(item.name))
