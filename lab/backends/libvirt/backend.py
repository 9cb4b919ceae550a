"""The libvirt backend: bhyve hosts (``bhyve+ssh://root@HOST/system``) and QEMU hosts
(``qemu:///system``, ``qemu+ssh://``) through one libvirt-python code path.

A VM is a per-VM disk clone plus a persistent domain whose ``<metadata>`` carries the lab lease.
The package, by job:

- settings: the `[hosts.NAME]` keys and defaults; `resolve` fills in the per-driver ones (a `Host`)
- drivers: what bhyve and QEMU can make, and from which libvirt version
- checks: a VM spec against the driver's rules (plan time, and again before clone)
- hostshell: commands on the host (over SSH for a remote one)
- connection: the libvirt connection and its errors
- disks, publish: golden images and clones (zfs, qcow2 overlays, full copies) and publishing (the
  Publishing part)
- domain: the domain XML and the lease in it
- vms: the machines: clone, start, wait until SSH answers, destroy
- addresses: the guest's address, link by link
- console: the serial console (log file, console stream)
- warm, saveimage, agent, warmstart: warm start (a post-boot snapshot per machine shape, restored
  per cell; warmstart is the WarmSnapshots part)
- owned: what on the host is the lab's (`lab gc`)
- hostload: the host's CPU time and the lab's share of it (the LoadMeter part)
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

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from lab import hostinfo, proc
from lab.backends.base import Backend, BackendEnv, Capabilities, PlainClient
from lab.backends.libvirt import warm
from lab.backends.libvirt.checks import check_host_version, check_spec
from lab.backends.libvirt.connection import Connection, error_code, error_message, libvirt_module
from lab.backends.libvirt.disks import Disks
from lab.backends.libvirt.drivers import version_text
from lab.backends.libvirt.hostload import LoadMeter
from lab.backends.libvirt.hostshell import HostShell, Run
from lab.backends.libvirt.owned import Inventory
from lab.backends.libvirt.publish import Publishing
from lab.backends.libvirt.settings import Settings, capabilities, resolve
from lab.backends.libvirt.vms import Machines
from lab.backends.libvirt.warmstart import WarmStart
from lab.errors import BackendError, SettingError, UsageError
from lab.model import ImageRef, Owned, Vm, VmSpec
from lab.runlock import RunLocks


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
        self._run_locks = RunLocks(self._run_lock_path)
        self.inventory = Inventory(self.name, host_name, self.host.driver, self.connection, self.disks, self._run_locks)
        self.machines = Machines(self.name, self.host, self.connection, self.shell, self.disks, self.inventory)
        self.addresses = self.machines.addresses
        self.publishing = Publishing(self.disks, self.inventory)
        self.load_meter = LoadMeter(self.host, self.connection, self.shell)
        if capabilities(settings).snapshots:  # a QEMU host: warm start
            store = warm.WarmStore(
                self.host, self.shell, self.connection, self.disks, self.env.state_dir, self._file_label
            )
            self.warm = self.machines.warm = WarmStart(self.machines, store)

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
        self.machines.validate(spec)

    def domain_xml(self, spec: VmSpec, *, vm_uuid: str | None = None) -> str:
        """The domain XML clone() defines for `spec` (no connection)."""
        return self.machines.domain_xml(spec, vm_uuid=vm_uuid)

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

    def check_images(self, images: Sequence[ImageRef]) -> None:
        for image in images:
            self.disks.check_image(image)

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

    # -- per VM (lab.backends.libvirt.vms) ---------------------------------------------------------

    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        return self.machines.clone(image, spec)

    def start(self, vm: Vm) -> None:
        self.machines.start(vm)

    def console_text(self, vm: Vm) -> str:
        return self.machines.console_text(vm)

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        return self.machines.wait_ready(vm, timeout)

    def renew_lease(self, vm: Vm, expires_at: float) -> None:
        self.machines.renew_lease(vm, expires_at)

    def destroy(self, vm: Vm) -> None:
        self.machines.destroy(vm)

    # -- garbage collection ------------------------------------------------------------------------

    def list_owned(self) -> list[Owned]:
        return self.inventory.list()

    def remove_owned(self, item: Owned) -> None:
        self.inventory.remove(item)


BACKEND = LibvirtBackend
