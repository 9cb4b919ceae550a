"""The libvirt backend's machines: a per-VM disk clone plus a persistent domain whose <metadata>
carries the lab lease; started (or, for a warm cell, restored: lab.backends.libvirt.warmstart),
waited for until it answers SSH, and destroyed with everything it made."""

from __future__ import annotations

import time
import uuid as uuidlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lab.backends.libvirt import domain
from lab.backends.libvirt.addresses import AddressChain, free_address
from lab.backends.libvirt.checks import check_spec
from lab.backends.libvirt.connection import Connection, error_code, error_message, libvirt_module
from lab.backends.libvirt.console import FAILED_MARK, ConsoleTap, console_text, log_readable, tail
from lab.backends.libvirt.disks import Disks
from lab.backends.libvirt.hostshell import HostShell
from lab.backends.libvirt.owned import Inventory
from lab.backends.libvirt.settings import Host
from lab.backends.neighbours import ssh_banner
from lab.errors import BackendError, LabError, TeardownError
from lab.model import CloneKind, ImageRef, Vm, VmSpec
from lab.wait import wait_until

if TYPE_CHECKING:
    from lab.backends.libvirt.warmstart import WarmStart


def golden_root(host: Host, disks: Disks, image: ImageRef) -> str | None:
    """Where a QEMU host keeps the image's boot files (direct kernel boot); None on bhyve."""
    return disks.golden_root(image) if host.driver == "qemu" else None


class Machines:
    def __init__(
        self,
        backend: str,
        host: Host,
        connection: Connection,
        shell: HostShell,
        disks: Disks,
        inventory: Inventory,
    ):
        self.backend, self.host, self.host_name = backend, host, host.name
        self.connection, self.shell, self.disks, self.inventory = connection, shell, disks, inventory
        self.addresses = AddressChain(host, connection, shell, self.console_text)
        self.warm: WarmStart | None = None  # the backend's warm start part (a QEMU host's)

    def validate(self, spec: VmSpec) -> None:
        """The plan's rules for one spec, with the version gates once check() knows the host's libvirt."""
        check_spec(self.host, spec, self.connection.lib_version)

    def placement(self, spec: VmSpec, vm_uuid: str) -> domain.Placement:
        disk_ref, disk_path = self.disks.disk_for(spec)
        return domain.Placement(
            uuid=vm_uuid,
            disk_ref=disk_ref,
            disk_path=disk_path,
            console=self.disks.console_path(spec, vm_uuid),
            mac=(spec.mac or domain.mac_for(spec.name)).lower(),
        )

    def cell_host(self, spec: VmSpec) -> Host:
        """The host's settings as a cell's domain uses them: a warm cell has the guest agent channel."""
        return self.host.model_copy(update={"guest_agent": True}) if spec.start == "warm" else self.host

    def domain_xml(self, spec: VmSpec, *, vm_uuid: str | None = None) -> str:
        """The domain XML clone() defines for `spec` (no connection)."""
        placement = self.placement(spec, vm_uuid or str(uuidlib.uuid4()))
        return domain.render(self.cell_host(spec), spec, placement, golden_root(self.host, self.disks, spec.image))

    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        libvirt = libvirt_module()
        self.validate(spec)
        if self.connection.lookup(spec.name) is not None:
            raise BackendError(
                f"a domain named {spec.name!r} already exists on {self.host_name!r}",
                hint="`lab gc` removes what an earlier run left behind",
            )
        if spec.image != image:
            spec = replace(spec, image=image)
        if not spec.ip and self.host.subnet is not None:
            leases, _ = self.inventory.leases()
            spec = replace(spec, ip=free_address(self.host, (lease.get("ip", "") for _, lease in leases)))
        placement = self.placement(spec, str(uuidlib.uuid4()))
        vm = Vm(
            spec=spec,
            backend=self.backend,
            handle={
                "uuid": placement.uuid,
                "disk": placement.disk_ref,
                "disk_path": placement.disk_path,
                "console": placement.console,
                "mac": placement.mac,
                "host": self.host_name,
                "driver": self.host.driver,
            },
            facts={"libvirt_driver": self.host.driver, "clone": CloneKind(spec.clone).value},
        )
        if self.host.driver == "qemu":
            vm.facts["accel"] = "kvm" if self.host.domain_type == "kvm" else "tcg"
        snap = self.warm.snapshot_for(spec, vm) if spec.start == "warm" and self.warm is not None else None
        host = self.cell_host(spec)
        lease = domain.lease(host, spec, placement, snap.name if snap else "")
        xml = domain.render(
            host, spec, placement, golden_root(self.host, self.disks, image), warm=snap.name if snap else ""
        )
        started = time.monotonic()
        try:
            if self.host.driver == "qemu":
                self.disks.write_lease(spec.name, lease)  # first: a clone is never without its lease
            argvs = (
                self.warm.store.clone_argv(snap, spec, placement.disk_path)
                if snap and self.warm is not None
                else self.disks.clone_argv(image, spec)
            )
            for argv in argvs:
                self.shell.run_argv(argv, timeout=1800, what="disk clone")
            vm.facts["clone_seconds"] = round(time.monotonic() - started, 3)
            if self.host.driver == "bhyve":
                self._preflight_bhyve(xml)  # after the clone: the driver may look at the zvol
            self._define(xml)
        except BaseException as exc:  # libvirt's refusal, preflight, Ctrl-C: nothing may outlive the attempt
            problems: list[str] = []
            self.disks.remove_clone(spec.name, placement.disk_ref, problems)
            why = error_message(exc) if isinstance(exc, libvirt.libvirtError) else str(exc)
            if problems:
                raise TeardownError(
                    f"creating {spec.name!r} failed ({why}) and what it made could not be "
                    f"removed: {'; '.join(problems)}"
                ) from None
            if isinstance(exc, libvirt.libvirtError):
                raise BackendError(f"libvirt refused the domain {spec.name!r}: {why}") from None
            raise
        self.disks.refresh_pool()
        if snap:
            vm.handle.update(warm=snap, lease=lease)
        return vm

    def _define(self, xml: str) -> None:
        """Define with libvirt's schema check where the driver has it."""
        libvirt = libvirt_module()
        conn = self.connection.get()
        try:
            conn.defineXMLFlags(xml, libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
        except libvirt.libvirtError as exc:
            if error_code(exc) not in (libvirt.VIR_ERR_NO_SUPPORT, libvirt.VIR_ERR_INVALID_ARG):
                raise
            conn.defineXML(xml)

    def _preflight_bhyve(self, xml: str) -> None:
        """On a real bhyve host the driver builds the command line without starting anything:
        XML it would refuse at start() fails here instead."""
        libvirt = libvirt_module()
        if self.host.test_uri:
            return
        try:
            self.connection.get().domainXMLToNative("bhyve-argv", xml, 0)
        except libvirt.libvirtError as exc:
            if error_code(exc) == libvirt.VIR_ERR_NO_SUPPORT:
                return
            raise BackendError(
                f"the bhyve driver on {self.host_name!r} rejects the domain: {error_message(exc)}"
            ) from None

    # -- running --------------------------------------------------------------------------------------

    def start(self, vm: Vm) -> None:
        dom = self.connection.lookup(vm.name)
        if dom is None:
            raise BackendError(f"domain {vm.name!r} is not defined on {self.host_name!r}")
        vm.facts["started_at"] = time.time()
        snap = vm.handle.get("warm")
        if snap is None or self.warm is None:
            self._create(dom, vm)
        else:
            try:
                self.warm.restore(vm, snap)
                vm.facts["start"] = "warm"
            except (LabError, ValueError) as exc:  # ValueError: a save image lab cannot rewrite
                self._boot_cold_instead(vm, str(exc))
        self._open_console(vm)

    def _boot_cold_instead(self, vm: Vm, why: str) -> None:
        """A warm cell whose restore failed: its disk made afresh from the golden image, its domain
        (defined for a cold boot all along) booted."""
        libvirt = libvirt_module()
        vm.facts["start"] = f"cold: {why}"
        vm.handle.pop("warm", None)
        dom = self.connection.lookup(vm.name)
        if dom is None or dom.UUIDString() != vm.handle["uuid"]:
            raise BackendError(f"domain {vm.name!r} is gone (after: {why})")
        try:
            if dom.isActive():
                dom.destroy()
        except libvirt.libvirtError as exc:
            raise BackendError(f"stopping the half-restored {vm.name!r} failed: {error_message(exc)}") from None
        self.disks.remove(vm.handle["disk"])
        for argv in self.disks.clone_argv(vm.spec.image, vm.spec):
            self.shell.run_argv(argv, timeout=1800, what="disk clone")
        self._create(dom, vm)

    def _create(self, dom: Any, vm: Vm) -> None:
        libvirt = libvirt_module()
        try:
            dom.create()
        except libvirt.libvirtError as exc:
            raise BackendError(f"starting {vm.name!r} failed: {error_message(exc)}") from None

    def _open_console(self, vm: Vm) -> None:
        libvirt = libvirt_module()
        if not self.host.test_uri:  # the test driver has no consoles
            try:
                vm.handle["console_tap"] = ConsoleTap(self.host.uri, vm.name)
            except libvirt.libvirtError as exc:  # the console is the last resort, not a must
                vm.facts["console_stream"] = f"unavailable: {error_message(exc)}"

    def _console_log(self, vm: Vm) -> str:
        return vm.handle.get("console", "") if self.host.driver == "qemu" else ""  # bhyve: an nmdm device

    def console_text(self, vm: Vm) -> str:
        return console_text(self._console_log(vm), vm.handle.get("console_tap"), self.shell)

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        libvirt = libvirt_module()
        timeout = self.host.boot_timeout if timeout is None else timeout
        port = self.host.ssh_port
        # the image's own readiness line (manifest `ready_marker`); without one, probe SSH directly
        marker = str((vm.spec.image.manifest or {}).get("ready_marker") or "")
        state = {"last": "nothing yet"}

        def ready() -> str | None:
            dom = self.connection.lookup(vm.name)
            try:
                active = dom is not None and dom.isActive()
            except libvirt.libvirtError:
                active = False
            if not active:
                raise BackendError(
                    f"{vm.name} is not running any more (while waiting for SSH)", hint=tail(self.console_text(vm))
                )
            text = self.console_text(vm)
            if FAILED_MARK in text:
                raise BackendError(f"{vm.name} reported {FAILED_MARK} on its console", hint=tail(text))
            if marker and marker not in text and log_readable(self._console_log(vm), self.shell):
                state["last"] = f"no {marker} on the serial console yet"
                return None
            addr = self.addresses.find(vm)
            if not addr:
                state["last"] = "no address found (static, leases, ARP, console)"
                return None
            if ssh_banner(addr, port):
                return addr
            state["last"] = f"{addr}:{port} does not answer SSH yet"
            return None

        started = time.monotonic()
        addr = wait_until(
            ready, timeout=timeout, what=f"{vm.name} to answer SSH", interval=0.2, detail=lambda: state["last"]
        )
        vm.facts["ready_seconds"] = round(time.monotonic() - started, 3)
        vm.address = addr
        return addr

    def renew_lease(self, vm: Vm, expires_at: float) -> None:
        """The lease in the domain's <metadata>, live and persistent (lab.runner.renewal)."""
        dom = self.connection.lookup(vm.name)
        if dom is None:
            raise BackendError(f"domain {vm.name} is gone: its lease cannot be renewed")
        domain.renew_lease(dom, expires_at)

    def destroy(self, vm: Vm) -> None:
        libvirt = libvirt_module()
        problems: list[str] = []
        try:
            mode = self.connection.remove_domain(vm.name, self.host.driver, uuid=vm.handle.get("uuid", ""))
            if mode:
                vm.facts["undefine"] = mode
        except (libvirt.libvirtError, LabError) as exc:
            problems.append(f"domain: {error_message(exc)}")
        if not problems and self.connection.lookup(vm.name) is not None:
            problems.append("domain still defined after undefine")
        tap = vm.handle.pop("console_tap", None)
        if tap is not None:  # the domain is gone: its console stream has ended
            tap.close()
        if not problems:  # never a disk from under a domain that is still there
            self.disks.remove_clone(vm.name, vm.handle.get("disk", ""), problems)
        if problems:
            raise TeardownError(
                f"teardown of {vm.name} on {self.host_name!r} failed: " + "; ".join(problems),
                hint="`lab gc` retries; see `virsh -c URI list --all`",
            )
