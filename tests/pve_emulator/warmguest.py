"""Restored guests behind the emulator's VMs (`QemuBacking(warm_dir=...)`): a started VM of a shape the
local backend has a warm snapshot of is a restore of that snapshot instead of a firmware boot.

What the lab sees through the API is the same: the clone, its config, a qmstart task, then the guest
agent reporting ipconfig0's address, SSH with the image's key. Only the emulator's side differs: the
guest's QEMU is the local backend's command line of that shape (lab.backends.local.qemu_argv: direct
kernel boot, the guest agent's port, its RAM mapped from the snapshot), its disk an overlay of the
snapshot's disk (the PVE volume the clone made stays the emulator's state, unread), and the address,
MAC and clock the cloud-init drive would have given at boot are given after the restore
(lab.backends.local.warm.finish_restore, through the guest agent), before the agent answers anyone:
until then `network-get-interfaces` says the agent is not running, as during a boot.

The snapshots are the tests' shared ones ($LAB_TESTS_WARM_DIR, tests/support/local.py), made by the
local backend itself: a test that wants its emulated guests restored makes sure of their shapes first
(`prepare`, before the emulator starts: a build takes a boot, too long for a start task, which runs
under the emulator's lock). A VM of another shape (UEFI, no agent, a boot disk off virtio0, a shape
with no snapshot), or whose restore fails, boots by firmware as before; tests/vm/test_firmware_boot.py
tests that boot and the cloud-init drive.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from support.local import make_spec

from lab.backends import local
from lab.backends.local import warm
from lab.backends.local.qemu import boot_files, qemu_argv, qemu_version
from lab.backends.local.vms import Machines
from lab.errors import LabError
from lab.model import Accel, ImageRef, NicModel, VmSpec

RESTORE_TIMEOUT = 120.0  # the state's load and the identity's fixup, on a busy 2-core host


class WarmGuests:
    def __init__(self, image: ImageRef, *, warm_dir: Path, accel: Accel, tcg_threads: str):
        self.image, self.accel, self.tcg_threads = image, accel, tcg_threads
        self.store = warm.WarmStore(Path(warm_dir))

    def spec(self, *, name: str, nic: NicModel, vcpus: int, memory: int, ip: str = "", mac: str = "") -> VmSpec:
        """A machine of the local backend's warm shape (disk on virtio, a linked clone) named `name`."""
        return replace(make_spec(self.image, "emulated", nic, vcpus, memory, start="warm", ip=ip, mac=mac), name=name)

    def prepare(self, shapes: list[tuple[NicModel, int, int]]) -> None:
        """Make sure the store has a snapshot of each (nic, vcpus, memory): the local backend builds
        a missing one, in a run and a workdir of its own (removed after), or waits for another
        process's build of it. Raises LabError if one cannot be made."""
        workdir = Path(tempfile.mkdtemp(prefix="pvew", dir="/var/tmp"))
        # named "local": a shape's key names its backend, and these are the local backend's shapes
        backend = local.LocalBackend(
            "local",
            local.Settings(
                backend="local",
                workdir=str(workdir),
                warm_dir=str(self.store.root),
                accel=self.accel.value,
                tcg_threads=self.tcg_threads,
            ),
        )
        run_id = os.urandom(4).hex()
        try:
            backend.check()
            backend.open_run(run_id)
            try:
                for nic, vcpus, memory in shapes:
                    spec = make_spec(self.image, run_id, nic, vcpus, memory, start="warm")
                    snapshot, why = backend.warm.snapshot_for(self.image, spec)
                    if snapshot is None:
                        raise LabError(f"no warm snapshot of {nic.value} {vcpus}c{memory}m: {why}")
            finally:
                backend.close_run(run_id)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def find(self, spec: VmSpec) -> warm.Snapshot | None:
        """The store's snapshot of `spec`'s shape, if there is a sound one (never built here)."""
        key = warm.shape_key(spec, accel=self.accel, qemu=qemu_version())
        try:
            return self.store.find(key)
        except warm.WarmUnusable:
            return None

    def begin(self, snapshot: warm.Snapshot, spec: VmSpec, *, vmdir: Path, tap: str, netns: str, gateway: str):
        """QEMU of `spec` waiting for `snapshot`'s state, its disk an overlay in `vmdir`: a Restore.
        Raises WarmUnusable."""
        kernel, initrd, cmdline = boot_files(self.image)
        Machines.overlay(snapshot.disk, vmdir / "disk.qcow2")
        argv = qemu_argv(
            spec,
            accel=self.accel,
            vmdir=vmdir,
            kernel=kernel,
            initrd=initrd,
            cmdline=cmdline,
            tap=tap,
            gateway=gateway,
            ram=snapshot.ram,
            incoming=True,
            tcg_threads=self.tcg_threads,
        )
        return warm.begin_restore(snapshot, vmdir=vmdir, argv=argv, netns=netns)

    @staticmethod
    def finish(restore: warm.Restore, snapshot: warm.Snapshot, spec: VmSpec, *, vmdir: Path, gateway: str, prefix: int):
        """Load, resume, and give the guest ipconfig0's address, the VM's MAC and the host's clock.
        Raises WarmUnusable."""
        try:
            return warm.finish_restore(
                restore, vmdir=vmdir, snapshot=snapshot, spec=spec, gateway=gateway, prefix=prefix,
                timeout=RESTORE_TIMEOUT,
            )  # fmt: skip
        finally:
            restore.close()
