"""Local QEMU backend: clones of the golden image on this machine, one network namespace per run.

Layout of a run: namespace `lab-<run>` holding bridge `br0` (<subnet>.1/24) and one tap per VM;
QEMU, ssh, iperf3 and wrk all run inside that namespace, so load never leaves it. Each VM has a
directory `<workdir>/<vm-name>/` with its overlay disk, pidfile, QMP socket, serial console log
and `lease.json` (lab.backends.local.layout): `lab gc` finds everything from those, even when the
results store is gone. The accelerator is KVM only where a real boot proved it works
(lab.backends.local.kvm), and is recorded with every sample.

A spec with start = "warm" restores a post-boot snapshot of its machine shape instead of booting
(lab.backends.local.warm): clone() finds the snapshot (or builds it, once, under a lock), start()
begins the restore, wait_ready() gives the guest the cell's clock, MAC and address; if anything
fails the cell boots cold and vm.facts["start"] says why. Snapshots are no run's: list_owned never
shows them; warm_snapshots() and remove_warm() are for `lab images ls` and `lab gc`.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from lab import IMAGES_DIR, hostinfo, images, proc, runlock, statedir
from lab.backends.base import Backend, BackendEnv, Capabilities, Client, Link, PlainClient
from lab.backends.local import baremetal, host, hostload, layout, warm
from lab.backends.local.kvm import KVM_PROBE_FILE, probe_kvm
from lab.backends.local.qemu import QEMU, boot_files, qemu_argv, qemu_version
from lab.backends.local.settings import Settings, capabilities
from lab.errors import IncompleteListing, LabError, SettingError, UsageError
from lab.hostload import CounterWindow, LoadWindow
from lab.lease import owner_or_empty
from lab.model import Accel, CloneKind, ImageRef, Owned, Vm, VmSpec
from lab.runlock import RunLock


class LocalBackend(Backend):
    name = "local"
    settings_model = Settings
    settings: Settings

    def __init__(self, host_name: str, settings: Settings, env: BackendEnv | None = None):
        super().__init__(host_name, settings, env)
        self._accel: Accel | None = None
        self._next_host: dict[str, int] = {}  # run id -> next address/tap number
        self._allocating = threading.Lock()
        self._run_locks: dict[str, RunLock] = {}  # run id -> its lock, held while the run is open
        self._warm_failed: dict[str, str] = {}  # snapshot name -> why it is not used again by this process

    @classmethod
    def capabilities(cls, settings: Settings) -> Capabilities:  # type: ignore[override]
        return capabilities(settings)

    @classmethod
    def plan_check(cls, host_name: str, settings: Settings, specs) -> None:  # type: ignore[override]
        """The capabilities, and warm start's own rules: linked clones of images it can fix up."""
        super().plan_check(host_name, settings, specs)
        for spec in specs:
            if spec.start not in ("cold", "warm"):
                raise SettingError("start", spec.start, 'is neither "cold" nor "warm"')
            if spec.start == "warm":
                why = warm.refusal(spec.image) or (
                    "warm start makes linked clones of its snapshot's disk"
                    if spec.clone is not CloneKind.LINKED
                    else None
                )
                if why:
                    raise SettingError(
                        "start",
                        "warm",
                        f"on host {host_name!r} (local QEMU): {why}",
                        hint='exclude it in [matrix] exclude, or use start = "cold"',
                    )

    @property
    def workdir(self) -> Path:
        """The setting, else "local" in the lab's private state directory."""
        return Path(self.settings.workdir) if self.settings.workdir else self.env.state_dir / "local"

    @property
    def _workdir_what(self) -> str:
        return f"host {self.host_name!r}: workdir"

    @property
    def gateway(self) -> str:
        """The bridge's address in every run's namespace: the client side of every load."""
        return f"{self.settings.subnet}.1"

    # -- checks and facts ---------------------------------------------------------------------
    def check(self) -> None:
        missing = [t for t in (QEMU, "qemu-img", "ip") if shutil.which(t) is None]
        if missing:
            raise UsageError(f"host {self.host_name!r}: {', '.join(missing)} not installed", hint="run `make setup`")
        if os.geteuid() != 0:
            raise UsageError(f"host {self.host_name!r}: the local backend needs root for network namespaces and taps")
        # Checked, not made: exit 2 means nothing was created (open_run makes it)
        statedir.check(self.workdir, self._workdir_what)
        if self.settings.accel == "auto":  # the KVM probe's verdict is kept there
            statedir.check(self.env.state_dir)

    def facts(self) -> dict[str, object]:
        return {
            "backend": self.name,
            "accel": self._accel.value if self._accel else None,
            "qemu": qemu_version(),
            "kernel": platform.release(),
        }

    def host_facts(self) -> dict[str, object]:
        return hostinfo.local_facts()

    # -- images -------------------------------------------------------------------------------
    def publish_image(self, image: ImageRef) -> str:
        """`lab images publish NAME local`: copy the built image into this host's image store,
        <workdir>/images/<name>/<sha256[:12]>/ (+ a `current` link), verified by sha256."""
        return images.publish_local(image, self.workdir / "images")

    def describe_images(self, images: Sequence[ImageRef]) -> list[str]:
        """Each image is used in place; its warm snapshots here, if any."""
        snaps = self.warm_snapshots()
        lines = []
        for image in images:
            warm_of = [s.name for s in snaps if s.detail == warm.image_digest(image)]
            lines.append(
                f"host {self.host_name!r}: {image.name} from {image.path} in place"
                + (f"; warm snapshots: {', '.join(warm_of)}" if warm_of else "")
            )
        return lines

    # -- accelerator ----------------------------------------------------------------------------
    def accel(self, image: ImageRef) -> Accel:
        """The accelerator of this host's VMs: the setting, or with "auto" the KVM probe's verdict."""
        if self._accel is None:
            if self.settings.accel == "auto":
                self._accel = probe_kvm(image, self.workdir, cache=self.env.state_dir / KVM_PROBE_FILE)
            else:
                self._accel = Accel(self.settings.accel)
        return self._accel

    # -- per run --------------------------------------------------------------------------------
    def open_run(self, run_id: str) -> Client:
        ns = layout.netns_name(run_id)
        statedir.ensure(self.workdir, self._workdir_what)
        # Held for the run's life: `lab gc` leaves alone what a live run owns.
        lock = RunLock(layout.run_lock_path(self.workdir, run_id))
        lock.acquire(what=f"the lock of run {run_id} (is another `lab run --resume` on it?)")
        self._run_locks[run_id] = lock
        try:
            host.run_all(host.bridge_netns_argvs(ns, self.gateway), what="the run's network namespace")
        except LabError:
            self.close_run(run_id)
            raise
        self._next_host[run_id] = 0
        return PlainClient(address=self.gateway, netns=ns)

    def close_run(self, run_id: str) -> None:
        try:
            host.remove_netns(layout.netns_name(run_id))
        finally:
            lock = self._run_locks.pop(run_id, None)
            if lock is not None:
                lock.release()

    def run_is_live(self, run_id: str) -> bool:
        """True while a `lab run` process holds the run's lock."""
        return bool(runlock.held(layout.run_lock_path(self.workdir, run_id)))

    # -- per VM ---------------------------------------------------------------------------------
    def _allocate(self, run_id: str) -> tuple[str, str, str]:
        """The next tap, address and MAC of a run's network."""
        with self._allocating:  # slots > 1: two lanes of this host clone at once
            n = self._next_host.get(run_id, 0)
            self._next_host[run_id] = n + 1
        return (
            f"tap{n % 1000:03d}",
            f"{self.settings.subnet}.{10 + n % 240}",
            f"52:54:00:{(n >> 8) & 0xFF:02x}:{n & 0xFF:02x}:{0x10:02x}",
        )

    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        vmdir = self.workdir / spec.name
        ns = layout.netns_name(spec.run_id)
        tap, ip, mac = self._allocate(spec.run_id)
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
            backend=self.name,
            handle={"dir": str(vmdir), "netns": ns, "tap": tap},
            address=spec.ip,
            control_dir=vmdir,
        )
        disk = vmdir / "disk.qcow2"
        try:
            snapshot = None
            if spec.start == "warm":
                t0 = time.monotonic()
                snapshot, why = self._warm_snapshot(image, spec)
                vm.facts["warm_seconds"] = round(time.monotonic() - t0, 3)  # finding it, or building it
                vm.facts["start"] = "warm" if snapshot else f"cold: {why}"
            else:
                vm.facts["start"] = "cold"
            t0 = time.monotonic()
            if snapshot is not None:
                vm.handle["warm"] = str(snapshot.dir)
                self._overlay(snapshot.disk, disk)
            elif spec.clone is CloneKind.LINKED:
                self._overlay(image.path, disk)
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

    def renew_lease(self, vm: Vm, expires_at: float) -> None:
        layout.renew_lease(Path(vm.handle["dir"]), expires_at)  # a VM's or the bare-metal cell's

    @staticmethod
    def _overlay(backing: Path, disk: Path) -> None:
        proc.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", "qcow2", str(disk)],
            what="qemu-img create (linked clone)",
        )

    def start(self, vm: Vm) -> None:
        image: ImageRef = vm.spec.image
        accel = self.accel(image)
        vmdir = Path(vm.handle["dir"])
        kernel, initrd, cmdline = boot_files(image)
        vm.facts["accel"] = accel.value
        if vm.handle.get("warm"):
            snapshot = warm.Snapshot(Path(vm.handle["warm"]), {})
            argv = qemu_argv(
                vm.spec,
                accel=accel,
                vmdir=vmdir,
                kernel=kernel,
                initrd=initrd,
                cmdline=cmdline,
                tap=vm.handle["tap"],
                gateway=self.gateway,
                ram=snapshot.ram,
                incoming=True,
            )
            try:
                restore = warm.begin_restore(snapshot, vmdir=vmdir, argv=argv, netns=vm.handle["netns"])
            except warm.WarmUnusable as exc:
                self._cold_again(vm, exc)
            else:
                vm.handle.update(restore=restore, proc=restore.proc, pid=restore.proc.pid, started=restore.started)
                layout.update_lease(vmdir, pid=restore.proc.pid)
                return
        argv = qemu_argv(
            vm.spec,
            accel=accel,
            vmdir=vmdir,
            kernel=kernel,
            initrd=initrd,
            cmdline=cmdline,
            tap=vm.handle["tap"],
            gateway=self.gateway,
        )
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
                if exc.damaged:
                    self._drop_warm(snapshot.name, str(exc))
                self._cold_again(vm, exc)
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

    def destroy(self, vm: Vm) -> None:
        restore: warm.Restore | None = vm.handle.pop("restore", None)
        if restore is not None:  # destroyed between start and wait_ready
            restore.close()
        name = vm.spec.name if vm.spec is not None else Path(vm.handle.get("dir", "?")).name
        host.remove_machine(vm.handle, name)

    # -- warm start --------------------------------------------------------------------------------
    def _warm_snapshot(self, image: ImageRef, spec: VmSpec) -> tuple[warm.Snapshot | None, str]:
        """The spec's warm snapshot, built if it is not there yet (one build per key at a time on
        this machine: a second run waits for the first's). (None, why) when the cell boots cold."""
        why = warm.refusal(image) or (
            "warm start makes linked clones of its snapshot's disk" if spec.clone is not CloneKind.LINKED else None
        )
        if why:
            return None, why
        key = warm.shape_key(spec, accel=self.accel(image), qemu=qemu_version(), backend=self.name)
        if key.name in self._warm_failed:
            return None, self._warm_failed[key.name]
        store = warm.WarmStore(self.workdir)
        try:
            store.ensure()
            with runlock.exclusive(
                store.lock_path(key),
                what=f"another run's build of warm snapshot {key.name}",
                timeout=2 * self.settings.boot_timeout + warm.SETTLE_TIMEOUT,
            ):
                try:
                    found = store.find(key)
                except warm.WarmUnusable as exc:
                    store.remove(key.name)
                    return None, f"{exc}; removed it: the next warm cell builds it again"
                if found is not None:
                    return found, ""
                snapshot = self._build_warm(key, image, spec, store)
        except LabError as exc:
            self._warm_failed[key.name] = f"building warm snapshot {key.name} failed: {exc}"
            return None, self._warm_failed[key.name]
        for old in store.snapshots():  # made by another QEMU or an older recipe: nothing here restores them
            if warm.unusable_here(old.meta, qemu_version()):
                store.remove(old.name)
        return snapshot, ""

    def _build_warm(self, key: warm.ShapeKey, image: ImageRef, spec: VmSpec, store: warm.WarmStore) -> warm.Snapshot:
        """Boot the template as a machine of the run (its directory, lease, tap: gc finds them if
        the run is killed meanwhile), save it into the store, remove the rest."""
        ns = layout.netns_name(spec.run_id)
        tap, ip, mac = self._allocate(spec.run_id)
        name = f"lab-{spec.run_id}-w{key.digest[:8]}"
        builddir = self.workdir / name
        builddir.mkdir(parents=True, exist_ok=False)
        layout.write_lease(
            builddir,
            {
                "run_id": spec.run_id,
                "vm": name,
                "netns": ns,
                "tap": tap,
                "kind": "warm-build",
                "expires_at": spec.expires_at,
                "owner": spec.owner,
                "created_at": time.time(),
            },
        )
        handle = {"dir": str(builddir), "netns": ns, "tap": tap}
        try:
            self._overlay(image.path, builddir / warm.DISK)
            host.run_all(host.tap_argvs(ns, tap, plugged=False), what=f"{name}'s tap")  # on no bridge: not a cell
            kernel, initrd, cmdline = boot_files(image)
            argv = qemu_argv(
                replace(spec, name=name, ip=ip, mac=mac),
                accel=self.accel(image),
                vmdir=builddir,
                kernel=kernel,
                initrd=initrd,
                cmdline=cmdline,
                tap=tap,
                gateway=self.gateway,
                ram=builddir / warm.RAM,
                ram_shared=True,
            )
            return warm.make_snapshot(
                key,
                store=store,
                builddir=builddir,
                argv=argv,
                netns=ns,
                boot_timeout=self.settings.boot_timeout,
                handle=handle,
            )
        finally:
            host.remove_machine(handle, name)

    def _drop_warm(self, name: str, why: str) -> None:
        """A snapshot QEMU could not load: removed (a later run rebuilds it), not rebuilt in this one."""
        self._warm_failed[name] = why
        warm.WarmStore(self.workdir).remove(name)

    def _cold_again(self, vm: Vm, why: LabError) -> None:
        """After a failed restore: the clone becomes a cold one (its own overlay of the golden image,
        its tap on the bridge); start() then boots it. The facts say why."""
        p = vm.handle.pop("proc", None)
        if p is not None:
            host.stop_process(p)
        vm.handle.pop("warm", None)
        disk = Path(vm.handle["dir"]) / "disk.qcow2"
        disk.unlink(missing_ok=True)
        self._overlay(vm.spec.image.path, disk)
        host.run_all([host.plug_tap_argv(vm.handle["netns"], vm.handle["tap"])], what=f"{vm.name}'s tap")
        vm.facts["start"] = f"cold: {why}"

    def warm_snapshots(self) -> list[Owned]:
        """Each snapshot of this workdir: name = its shape, detail = the digest (sha256) of the image
        it was made from; `lab gc` removes those whose image is gone."""
        return [
            Owned(self.name, "warm", s.name, "", 0.0, str(s.meta.get("image_digest", "")))
            for s in warm.WarmStore(self.workdir).snapshots()
        ]

    def remove_warm(self, item: Owned) -> None:
        store = warm.WarmStore(self.workdir)
        with runlock.exclusive(
            store.root / f"{item.name}.lock",
            what=f"a build of warm snapshot {item.name}",
            timeout=2 * self.settings.boot_timeout + warm.SETTLE_TIMEOUT,
        ):
            store.remove(item.name)

    def console_text(self, vm: Vm) -> str:
        try:
            return proc.read_bounded(Path(vm.handle["dir"]) / "console.log")  # a guest may print without end
        except (KeyError, OSError):
            return ""

    def lab_link(self, vm: Vm) -> Link | None:
        """The VM's tap in the run's namespace: netem there shapes the guest's traffic on the lab side."""
        return Link(dev=vm.handle["tap"], netns=vm.handle["netns"]) if vm.handle.get("tap") else None

    # -- host load ------------------------------------------------------------------------------
    def host_load(self, vms: Sequence[Vm]) -> LoadWindow:
        """A window over this machine's CPU counters: busy time and the lab's own share of it
        (lab.backends.local.hostload), so foreign load and steal show (issue 24)."""
        return CounterWindow(lambda: hostload.cpu_times(vms))

    # -- bare metal -------------------------------------------------------------------------------
    def bare_metal(
        self, run_id: str, cell_id: str, index: int, expires_at: float, client: Client
    ) -> baremetal.BareMetal:
        """This machine as a cell, on the run's bridge (lab.backends.local.baremetal)."""
        return baremetal.create(
            workdir=self.workdir,
            subnet=self.settings.subnet,
            backend=self.name,
            run_id=run_id,
            cell_id=cell_id,
            index=index,
            expires_at=expires_at,
            bridge_ns=client.netns or layout.netns_name(run_id),
        )

    # -- garbage collection -----------------------------------------------------------------------
    def list_owned(self) -> list[Owned]:
        """Only what this workdir owns: another workdir (another user's lab, a parallel test) is not
        ours to reap. A machine directory is ours if the lab's lease for it is there (or it is
        empty: a run killed before it wrote one); a QEMU if its pidfile is here; a namespace if
        the lab's lock file or one of our leases names it. Anything else is left alone."""
        out: list[Owned] = []
        handles: dict[str, dict] = {}
        why = statedir.problem(self.workdir)
        if why:  # someone else's, or open to others: nothing found there is trusted
            raise IncompleteListing(
                f"workdir {self.workdir} {why}", [], [f"workdir {self.workdir} {why}: nothing in it was trusted"]
            )
        if self.workdir.is_dir():
            for d in sorted(self.workdir.glob("lab-*")):
                handle = self._trusted(d)
                if handle is not None:
                    handles[d.name] = handle
                    lease = layout.read_lease(d)
                    out.append(
                        Owned(
                            self.name,
                            "vm",
                            d.name,
                            layout.run_of(d.name),
                            float(lease.get("expires_at") or 0),
                            str(d),
                            owner=owner_or_empty(lease.get("owner")),
                        )
                    )
        for pid, name in host.qemu_processes(self.workdir):
            if name not in handles:
                out.append(Owned(self.name, "process", name, layout.run_of(name), 0.0, str(pid)))
        namespaces_here = {h.get("netns") for h in handles.values()}
        for ns in host.list_netns():
            lock = self.workdir / f"{ns}.lock"
            if ns.startswith("lab-") and (runlock.is_lab_lock(lock) or ns in namespaces_here):
                out.append(Owned(self.name, "netns", ns, layout.run_of_netns(ns), 0.0, ""))
        return out

    def _trusted(self, vmdir: Path) -> dict | None:
        """What gc may remove of a machine directory (layout.trusted_handle); None: not the lab's."""
        if vmdir.is_symlink() or not vmdir.is_dir():
            return None
        parent = host.cgroup_parent()
        handle = layout.trusted_handle(vmdir, layout.read_lease(vmdir), parent[0] if parent else None)
        if handle is None and not any(vmdir.iterdir()):
            return {"dir": str(vmdir)}  # made, then killed before its lease: nothing else exists
        return handle

    def remove_owned(self, item: Owned) -> None:
        if item.kind == "vm":
            handle = self._trusted(Path(item.detail))
            if handle is None:
                return  # not the lab's (any more): left alone
            for pid, name in host.qemu_processes(self.workdir):
                if name == item.name:
                    host.kill_pid(pid, item.name)
            # the lease's pid was killed above if it was our QEMU, and may be reused by now
            host.remove_machine(handle, item.name)
        elif item.kind == "process":
            host.kill_pid(int(item.detail), item.name)
        elif item.kind == "netns":
            host.remove_netns(item.name)
            runlock.remove_if_dead(self.workdir / f"{item.name}.lock")


def lab_key() -> Path:
    """The lab's SSH key (images/lab_key), made private to its owner as ssh insists."""
    key = IMAGES_DIR / "lab_key"
    if not key.exists():
        raise UsageError(f"SSH key {key} is missing", hint="run `make images`")
    os.chmod(key, 0o600)
    return key


BACKEND = LocalBackend
