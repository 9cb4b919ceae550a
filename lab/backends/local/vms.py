"""The local backend's machines: QEMU VMs in the run's network namespace, and what they share (the
accelerator, the addresses of each run's network).

A VM has a directory `<workdir>/<vm-name>/` with its overlay disk, pidfile, QMP socket, serial
console log and `lease.json` (lab.backends.local.layout), written before anything else, so that
`lab gc` finds whatever exists. A spec with start = "warm" is cloned from the snapshot of its
shape (lab.backends.local.warmstart): clone() finds it (or builds it), start() begins the
restore, wait_ready() gives the guest the cell's clock, MAC and address; if anything fails the
cell boots cold and vm.facts["start"] says why.
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from lab import proc
from lab.backends.local import host, layout, warm
from lab.backends.local.kvm import KVM_PROBE_FILE, probe_kvm
from lab.backends.local.qemu import boot_files, qemu_argv
from lab.backends.local.settings import Settings
from lab.errors import LabError
from lab.model import Accel, CloneKind, ImageRef, Vm, VmSpec

if TYPE_CHECKING:
    from lab.backends.local.warmstart import WarmStart


class Machines:
    def __init__(self, backend: str, settings: Settings, workdir: Path, state_dir: Path):
        self.backend, self.settings, self.workdir, self.state_dir = backend, settings, workdir, state_dir
        self.gateway = f"{settings.subnet}.1"  # the bridge's address in every run's namespace: the client side
        self.warm: WarmStart | None = None  # the backend's warm start part, which clone and start use
        self._accel: Accel | None = None
        self._next_host: dict[str, int] = {}  # run id -> next address/tap number
        self._allocating = threading.Lock()

    def accel(self, image: ImageRef) -> Accel:
        """The accelerator of this host's VMs: the setting, or with "auto" the KVM probe's verdict."""
        if self._accel is None:
            if self.settings.accel == "auto":
                self._accel = probe_kvm(image, self.workdir, cache=self.state_dir / KVM_PROBE_FILE)
            else:
                self._accel = Accel(self.settings.accel)
        return self._accel

    @property
    def known_accel(self) -> str | None:
        """The accelerator once known (a machine started, or the probe ran): a fact of the host."""
        return self._accel.value if self._accel else None

    def open_run(self, run_id: str) -> None:
        self._next_host[run_id] = 0

    def allocate(self, run_id: str) -> tuple[str, str, str]:
        """The next tap, address and MAC of a run's network."""
        with self._allocating:  # slots > 1: two lanes of this host clone at once
            n = self._next_host.get(run_id, 0)
            self._next_host[run_id] = n + 1
        return (
            f"tap{n % 1000:03d}",
            f"{self.settings.subnet}.{10 + n % 240}",
            f"52:54:00:{(n >> 8) & 0xFF:02x}:{n & 0xFF:02x}:{0x10:02x}",
        )

    @staticmethod
    def overlay(backing: Path, disk: Path) -> None:
        proc.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", "qcow2", str(disk)],
            what="qemu-img create (linked clone)",
        )

    def argv(self, spec: VmSpec, vmdir: Path, tap: str, **extra) -> list[str]:
        """The QEMU command line of a machine of this host (`extra`: qemu_argv's warm options)."""
        kernel, initrd, cmdline = boot_files(spec.image)
        return qemu_argv(
            spec,
            accel=self.accel(spec.image),
            vmdir=vmdir,
            kernel=kernel,
            initrd=initrd,
            cmdline=cmdline,
            tap=tap,
            gateway=self.gateway,
            tcg_threads=self.settings.tcg_threads,
            **extra,
        )

    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        vmdir = self.workdir / spec.name
        ns = layout.netns_name(spec.run_id)
        tap, ip, mac = self.allocate(spec.run_id)
        spec = replace(spec, ip=spec.ip or ip, mac=spec.mac or mac)
        vmdir.mkdir(parents=True, exist_ok=False)
        # The lease file is written before the disk: whatever exists, gc can find.
        layout.write_lease(
            vmdir,
            {
                "run_id": spec.run_id,
                "vm": spec.name,
                "netns": ns,
                "tap": tap,
                "expires_at": spec.expires_at,
                "owner": spec.owner,
                "created_at": time.time(),
                "clone": spec.clone.value,
            },
        )
        vm = Vm(
            spec=spec,
            backend=self.backend,
            handle={"dir": str(vmdir), "netns": ns, "tap": tap},
            address=spec.ip,
            control_dir=vmdir,
        )
        disk = vmdir / "disk.qcow2"
        try:
            snapshot = None
            if spec.start == "warm" and self.warm is not None:
                t0 = time.monotonic()
                snapshot, why = self.warm.snapshot_for(image, spec)
                vm.facts["warm_seconds"] = round(time.monotonic() - t0, 3)  # finding it, or building it
                vm.facts["start"] = "warm" if snapshot else f"cold: {why}"
            else:
                vm.facts["start"] = "cold"
            t0 = time.monotonic()
            if snapshot is not None:
                vm.handle["warm"] = str(snapshot.dir)
                self.overlay(snapshot.disk, disk)
            elif spec.clone is CloneKind.LINKED:
                self.overlay(image.path, disk)
            else:
                proc.run(
                    ["cp", "--reflink=auto", "--sparse=always", str(image.path), str(disk)],
                    timeout=600,
                    what="full clone copy",
                )
            vm.facts["clone_seconds"] = round(time.monotonic() - t0, 4)
            # A restored guest carries the snapshot's identity until wait_ready gives it the cell's:
            # its tap stays off the bridge until then.
            host.run_all(host.tap_argvs(ns, tap, plugged=snapshot is None), what=f"{spec.name}'s tap")
        except BaseException:
            self.destroy(vm)  # a half-made clone is removed here, not left for gc
            raise
        vm.facts["clone"] = spec.clone.value
        return vm

    def start(self, vm: Vm) -> None:
        vmdir = Path(vm.handle["dir"])
        vm.facts["accel"] = self.accel(vm.spec.image).value
        if vm.handle.get("warm"):
            snapshot = warm.Snapshot(Path(vm.handle["warm"]), {})
            argv = self.argv(vm.spec, vmdir, vm.handle["tap"], ram=snapshot.ram, incoming=True)
            try:
                restore = warm.begin_restore(snapshot, vmdir=vmdir, argv=argv, netns=vm.handle["netns"])
            except warm.WarmUnusable as exc:
                self.cold_again(vm, exc)
            else:
                vm.handle.update(restore=restore, proc=restore.proc, pid=restore.proc.pid, started=restore.started)
                layout.update_lease(vmdir, pid=restore.proc.pid)
                return
        argv = self.argv(vm.spec, vmdir, vm.handle["tap"])
        with open(vmdir / "qemu.log", "wb") as log:
            p = proc.spawn(argv, netns=vm.handle["netns"], stdout=log, stderr=subprocess.STDOUT)
        vm.handle.update(proc=p, pid=p.pid, started=time.monotonic())
        layout.update_lease(vmdir, pid=p.pid)

    def wait_booted(self, vm: Vm, timeout: float | None = None) -> float:
        """Wait for the guest's LAB-READY line on the serial console; seconds since start."""
        host.wait_console_ready(
            vm.handle["proc"], Path(vm.handle["dir"]), vm.name, timeout or self.settings.boot_timeout
        )
        return time.monotonic() - vm.handle["started"]

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        restore: warm.Restore | None = vm.handle.pop("restore", None)
        if restore is not None:
            snapshot = warm.Snapshot(Path(vm.handle["warm"]), {})
            try:
                timings = warm.finish_restore(
                    restore,
                    vmdir=Path(vm.handle["dir"]),
                    snapshot=snapshot,
                    spec=vm.spec,
                    gateway=self.gateway,
                    timeout=timeout or 60.0,
                )
                host.run_all([host.plug_tap_argv(vm.handle["netns"], vm.handle["tap"])], what=f"{vm.name}'s tap")
            except warm.WarmUnusable as exc:
                if exc.damaged and self.warm is not None:
                    self.warm.drop(snapshot.name, str(exc))
                self.cold_again(vm, exc)
                self.start(vm)
            else:
                vm.facts.update(
                    timings, warm_snapshot=snapshot.name, boot_seconds=round(time.monotonic() - vm.handle["started"], 2)
                )
                return vm.address
            finally:
                restore.close()
        vm.facts["boot_seconds"] = round(self.wait_booted(vm, timeout), 2)
        return vm.address

    def cold_again(self, vm: Vm, why: LabError) -> None:
        """After a failed restore: the clone becomes a cold one (its own overlay of the golden image,
        its tap on the bridge); start() then boots it. The facts say why."""
        p = vm.handle.pop("proc", None)
        if p is not None:
            host.stop_process(p)
        vm.handle.pop("warm", None)
        disk = Path(vm.handle["dir"]) / "disk.qcow2"
        disk.unlink(missing_ok=True)
        self.overlay(vm.spec.image.path, disk)
        host.run_all([host.plug_tap_argv(vm.handle["netns"], vm.handle["tap"])], what=f"{vm.name}'s tap")
        vm.facts["start"] = f"cold: {why}"

    def destroy(self, vm: Vm) -> None:
        restore: warm.Restore | None = vm.handle.pop("restore", None)
        if restore is not None:  # destroyed between start and wait_ready
            restore.close()
        name = vm.spec.name if vm.spec is not None else Path(vm.handle.get("dir", "?")).name
        host.remove_machine(vm.handle, name)

    @staticmethod
    def console_text(vm: Vm) -> str:
        try:
            return proc.read_bounded(Path(vm.handle["dir"]) / "console.log")  # a guest may print without end
        except (KeyError, OSError):
            return ""
