"""The libvirt backend: bhyve hosts (``bhyve+ssh://root@HOST/system``) and QEMU hosts
(``qemu:///system``, ``qemu+ssh://``) through one libvirt-python code path.

A VM is a per-VM disk clone plus a persistent domain whose ``<metadata>`` carries the lab lease.
The package, by job:

- settings: the `[hosts.NAME]` keys and defaults; `resolve` fills in the per-driver ones (a `Host`)
- drivers: what bhyve and QEMU can make, and from which libvirt version
- checks: a VM spec against the driver's rules (plan time, and again before clone)
- hostshell: commands on the host (over SSH for a remote one)
- connection: the libvirt connection and its errors
- disks, publish: golden images and clones (zfs, qcow2 overlays, full copies) and publishing
- domain: the domain XML and the lease in it
- addresses: the guest's address, link by link
- console: the serial console (log file, console stream)
- warm, saveimage, agent: warm start (a post-boot snapshot per machine shape, restored per cell)
- owned: what on the host is the lab's (`lab gc`)
- hostload: the host's CPU time and the lab's share of it
- backend (here): the Backend seam, composed of the above.

Before anything is created: `lab plan` (plan_check) refuses a setting, NIC model, disk bus,
format or feature the driver cannot use, with a SettingError naming the lab.toml key and value;
check() adds the host's libvirt version and prerequisites (dataset, firmware, qemu-img);
check_specs() every cell against that version; check_images() that each golden image is on the
host and is this recipe.

`lab gc`: open_run holds a lock file on this machine for the run's life, so run_is_live tells a
live run from one killed with -9 (whose domains libvirtd keeps running); runs of other machines
are retired by their lease expiry.
"""

from __future__ import annotations

import os
import re
import time
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from lab import hostinfo, proc
from lab.backends.base import Backend, BackendEnv, Capabilities, NotSupported, PlainClient
from lab.backends.libvirt import domain, publish, saveimage, warm
from lab.backends.libvirt.addresses import AddressChain, free_address
from lab.backends.libvirt.agent import Agent, give_identity
from lab.backends.libvirt.checks import check_host_version, check_spec
from lab.backends.libvirt.connection import Connection, error_code, error_message, libvirt_module
from lab.backends.libvirt.console import FAILED_MARK, ConsoleTap, console_text, log_readable, tail
from lab.backends.libvirt.disks import Disks
from lab.backends.libvirt.drivers import version_text
from lab.backends.libvirt.hostload import parse_cp_time, parse_proc_stat
from lab.backends.libvirt.hostshell import HostShell, Run
from lab.backends.libvirt.owned import Inventory
from lab.backends.libvirt.settings import Host, Settings, capabilities, resolve
from lab.backends.neighbours import ssh_banner
from lab.errors import BackendError, IncompleteListing, LabError, SettingError, TeardownError, UsageError
from lab.hostload import CounterWindow, LoadWindow, tree_seconds
from lab.model import CloneKind, ImageRef, Owned, Vm, VmSpec
from lab.runlock import RunLocks
from lab.wait import wait_until


class LibvirtBackend(Backend):
    name = "libvirt"
    settings_model = Settings

    def __init__(
        self, host_name: str, settings: Settings, env: BackendEnv | None = None, *, run_command: Run = proc.run
    ):
        """`run_command` runs host commands (tests record them instead)."""
        super().__init__(host_name, settings, env)
        self.host = resolve(host_name, settings)
        self.connection = Connection(self.host.uri)
        self.shell = HostShell(self.host.ssh_args, run_command)
        self.disks = Disks(self.host, self.shell, self.connection)
        self.addresses = AddressChain(self.host, self.connection, self.shell, self.console_text)
        self._run_locks = RunLocks(self._run_lock_path)
        self.inventory = Inventory(self.name, host_name, self.host.driver, self.connection, self.disks, self._run_locks)
        self.warm = warm.WarmStore(
            self.host, self.shell, self.connection, self.disks, self.env.state_dir, self._file_label
        )

    # -- what it can make (no host contact) --------------------------------------------------------

    @classmethod
    def capabilities(cls, settings: Settings) -> Capabilities:  # type: ignore[override]
        return capabilities(settings)

    @classmethod
    def plan_check(cls, host_name: str, settings: Settings, specs: Sequence[VmSpec]) -> None:  # type: ignore[override]
        """The host's settings against its driver, then every spec against the driver's rules."""
        host = resolve(host_name, settings)
        for spec in specs:
            check_spec(host, spec)

    def validate_spec(self, spec: VmSpec) -> None:
        """plan_check's rules for one spec, with the version gates once check() knows the host's libvirt."""
        check_spec(self.host, spec, self.connection.lib_version)

    # -- the host ---------------------------------------------------------------------------------------

    def check(self) -> None:
        hv_type = self.connection.probe()
        want = "test" if self.host.test_uri else self.host.driver
        if hv_type != want:
            raise UsageError(f"uri = {self.host.uri!r} reaches a {hv_type!r} driver, expected {want!r}")
        check_host_version(self.host, self.connection.lib_version)
        if self.host.test_uri:
            return
        if self.host.driver == "qemu":
            self.shell.run(["qemu-img", "--version"], what="qemu-img", timeout=30)
            return
        res = self.shell.run(
            ["zfs", "list", "-H", "-o", "name", self.host.dataset], what="zfs list", check=False, timeout=30
        )
        if not res.ok:
            raise SettingError(
                "dataset",
                self.host.dataset,
                f"not found on the host ({(res.stderr or res.stdout).strip()[:200]})",
                where=self.host.where,
            )
        if (
            self.host.firmware == "uefi"
            and not self.shell.run(["test", "-r", self.host.loader], what="test -r", check=False, timeout=30).ok
        ):
            raise SettingError(
                "loader",
                self.host.loader,
                "not readable on the host",
                where=self.host.where,
                hint='pkg install bhyve-firmware, or firmware = "bhyveload"',
            )

    def check_specs(self, specs: Sequence[VmSpec]) -> None:
        """After check(): every spec against the host's libvirt version (NIC models, disk buses,
        firmware and features that need a newer one), and for warm cells the VM generation ID
        device the host's QEMU must offer. Nothing exists yet."""
        for spec in specs:
            check_spec(self.host, spec, self.connection.lib_version)
        if any(spec.start == "warm" for spec in specs) and not self.host.test_uri:
            self._check_genid()

    def _check_genid(self) -> None:
        libvirt = libvirt_module()
        try:
            caps = self.connection.get().getDomainCapabilities(
                None, "x86_64", self.host.machine, self.host.domain_type, 0
            )
        except libvirt.libvirtError as exc:
            if error_code(exc) == libvirt.VIR_ERR_NO_SUPPORT:
                return  # no domain capabilities to ask: the restore will tell
            raise BackendError(f"domain capabilities of {self.host_name!r}: {error_message(exc)}") from None
        genid = ET.fromstring(caps).find("features/genid")
        if genid is not None and genid.get("supported") == "no":
            raise SettingError(
                "start",
                "warm",
                f"host {self.host_name!r}: its QEMU has no VM generation ID "
                "device, by which a restored guest's RNG is reseeded",
            )

    def facts(self) -> dict[str, Any]:
        f: dict[str, Any] = {
            "backend": "libvirt",
            "libvirt_driver": self.host.driver,
            "libvirt_uri": self.connection.safe_uri,
        }
        if self.host.driver == "qemu":
            f["accel"] = "kvm" if self.host.domain_type == "kvm" else "tcg"
        try:
            conn = self.connection.get()
            f["libvirt_version"] = version_text(conn.getLibVersion())
            f["hypervisor_version"] = version_text(conn.getVersion())
        except Exception:  # facts are informative; an unreachable host fails check(), not this
            pass
        return f

    def host_facts(self) -> dict[str, Any]:
        """The host's CPU model, vendor, microcode and topology from libvirt's capabilities."""
        return hostinfo.libvirt_host_facts(self.connection.get().getCapabilities())

    def cpu_times(self, vms: Sequence[Vm]) -> dict[str, Any]:
        """The host's cumulative CPU time and the lab's domains' share, read now over the
        backend's own link: {"at": this machine's monotonic seconds, "busy_s", "lab_s",
        "steal_s" (None where not reported), "cpus"}. Two readings make a rate."""
        libvirt = libvirt_module()
        at = time.monotonic()
        if self.host.driver == "bhyve":
            cpu = parse_cp_time(
                self.shell.run(
                    ["sysctl", "-n", "kern.cp_time", "kern.smp.cpus", "kern.clockrate"], what="sysctl", timeout=30
                ).stdout
            )
        else:
            text = self.shell.read("/proc/stat")
            if text is None:
                raise BackendError(f"cannot read /proc/stat on {self.host_name!r}")
            # USER_HZ: this machine's, else Linux's fixed 100 (the userspace ABI on every arch lab meets)
            cpu = parse_proc_stat(text, os.sysconf("SC_CLK_TCK") if not self.shell.remote else 100)
        lab_ns = 0
        for vm in vms:
            dom = self.connection.lookup(vm.name)
            try:
                lab_ns += dom.info()[4] if dom is not None and dom.isActive() else 0
            except libvirt.libvirtError:
                pass  # gone meanwhile: it used no more CPU
        lab_s = lab_ns / 1e9
        if not self.shell.remote:
            # the host is this machine: the lab's load generators and ssh run on it too, and are the lab's
            lab_s += tree_seconds()
        return {"at": at, "busy_s": cpu.busy_s, "lab_s": lab_s, "steal_s": cpu.steal_s, "cpus": cpu.cpus}

    def host_load(self, vms: Sequence[Vm]) -> LoadWindow:
        """Two readings of cpu_times over the backend's own link, at the window's start and stop."""
        vms = list(vms)
        return CounterWindow(lambda: self.cpu_times(vms))

    def check_images(self, images: Sequence[ImageRef]) -> None:
        for image in images:
            self.disks.check_image(image)

    def publish_image(self, image: ImageRef) -> str:
        """Put `image` on the host so clones can be made of it; returns where it went
        ("zfs:POOL/DS/NAME@gold" or "file:/DIR/NAME.qcow2"). Idempotent for the same recipe."""
        if self.host.test_uri:
            raise UsageError(f"host {self.host_name!r} is a test:/// URI: nothing to publish to")
        domain.require_boot(self.host, image)
        if self.host.driver == "bhyve":
            return publish.publish_zvol(self.disks, image)
        return publish.publish_files(self.disks, image, self._lab_domains)

    def _lab_domains(self) -> list[str]:
        """The lab's domains on the host; BackendError when some could not be read (any of them
        could stand on what is about to change)."""
        leases, unchecked = self.inventory.leases()
        if unchecked:
            raise BackendError(f"cannot tell which lab domains are on {self.host_name!r}: {'; '.join(unchecked)}")
        return [dom.name() for dom, _ in leases]

    # -- per run --------------------------------------------------------------------------------------

    @property
    def _file_label(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", self.host_name)  # no "@": it separates the run id

    def _run_lock_path(self, run_id: str) -> Path:
        return self.env.state_dir / f"libvirt-{self._file_label}@{run_id}.lock"

    def open_run(self, run_id: str) -> PlainClient:
        # Held for the run's life on this machine: `lab gc` here tells a live run from one killed
        # with -9 (whose domains keep running under libvirtd).
        self._run_locks.acquire(run_id, what=f"the lock of run {run_id} on host {self.host_name!r}")
        return PlainClient(address=self.host.client_address)

    def close_run(self, run_id: str) -> None:
        self._run_locks.release(run_id)

    def run_is_live(self, run_id: str) -> bool | None:
        return self._run_locks.live(run_id)

    # -- per VM ---------------------------------------------------------------------------------------

    def _placement(self, spec: VmSpec, vm_uuid: str) -> domain.Placement:
        disk_ref, disk_path = self.disks.disk_for(spec)
        return domain.Placement(
            uuid=vm_uuid,
            disk_ref=disk_ref,
            disk_path=disk_path,
            console=self.disks.console_path(spec, vm_uuid),
            mac=(spec.mac or domain.mac_for(spec.name)).lower(),
        )

    def _golden_root(self, image: ImageRef) -> str | None:
        return self.disks.golden_root(image) if self.host.driver == "qemu" else None

    def _cell_host(self, spec: VmSpec) -> Host:
        """The host's settings as a cell's domain uses them: a warm cell has the guest agent channel."""
        return self.host.model_copy(update={"guest_agent": True}) if spec.start == "warm" else self.host

    def domain_xml(self, spec: VmSpec, *, vm_uuid: str | None = None) -> str:
        """The domain XML clone() defines for `spec` (no connection)."""
        placement = self._placement(spec, vm_uuid or str(uuidlib.uuid4()))
        return domain.render(self._cell_host(spec), spec, placement, self._golden_root(spec.image))

    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        libvirt = libvirt_module()
        self.validate_spec(spec)
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
        placement = self._placement(spec, str(uuidlib.uuid4()))
        vm = Vm(
            spec=spec,
            backend=self.name,
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
        snap = self._warm_snapshot(spec, vm) if spec.start == "warm" else None
        host = self._cell_host(spec)
        lease = domain.lease(host, spec, placement, snap.name if snap else "")
        xml = domain.render(host, spec, placement, self._golden_root(image), warm=snap.name if snap else "")
        started = time.monotonic()
        try:
            if self.host.driver == "qemu":
                self.disks.write_lease(spec.name, lease)  # first: a clone is never without its lease
            argvs = (
                self.warm.clone_argv(snap, spec, placement.disk_path) if snap else self.disks.clone_argv(image, spec)
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

    # -- warm start -------------------------------------------------------------------------------------

    def _warm_snapshot(self, spec: VmSpec, vm: Vm) -> warm.Snapshot | None:
        """The snapshot of the cell's shape (built now if there is none); None, and the reason in
        vm.facts["start"], when there is none to be had: the cell boots cold."""
        try:
            key = warm.shape(self.host, spec, self.disks.golden_source(spec.image))
            snap = self.warm.ensure(
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
        return domain.render(host, tspec, placement, self._golden_root(spec.image), genid=str(uuidlib.uuid4()))

    def _restore(self, vm: Vm, snap: warm.Snapshot) -> None:
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
        self.warm.write_state(snap, state, saveimage.clone_xml(snap.header.xml, ident, domain.LEASE_NS))
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

    # -- running --------------------------------------------------------------------------------------

    def start(self, vm: Vm) -> None:
        dom = self.connection.lookup(vm.name)
        if dom is None:
            raise BackendError(f"domain {vm.name!r} is not defined on {self.host_name!r}")
        vm.facts["started_at"] = time.time()
        snap = vm.handle.get("warm")
        if snap is None:
            self._create(dom, vm)
        else:
            try:
                self._restore(vm, snap)
                vm.facts["start"] = "warm"
            except (LabError, ValueError) as exc:  # ValueError: a save image lab cannot rewrite
                self._boot_cold_instead(vm, str(exc))
        self._open_console(vm)

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

    # -- warm snapshots and garbage collection ------------------------------------------------------------

    def warm_snapshots(self) -> list[Owned]:
        if self.host.driver != "qemu" or self.host.test_uri:
            return []
        try:
            return self.warm.owned(self.name)
        except LabError as exc:
            raise IncompleteListing(
                f"host {self.host_name!r}: warm snapshots could not be listed",
                [],
                [f"warm snapshots in {self.host.pool or self.host.dir}: {exc}"],
            ) from None

    def remove_warm(self, item: Owned) -> None:
        if item.kind != "warm" or self.host.driver != "qemu":
            raise NotSupported(f"host {self.host_name!r} keeps no warm snapshot {item.name!r}")
        self.warm.remove(item.name, self.inventory.in_use(item.name))

    def list_owned(self) -> list[Owned]:
        return self.inventory.list()

    def remove_owned(self, item: Owned) -> None:
        self.inventory.remove(item)


BACKEND = LibvirtBackend
