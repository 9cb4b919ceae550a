"""Local QEMU backend: clones of the golden image on this machine, one network namespace per run.

Layout of a run: namespace `lab-<run>` holding bridge `br0` (<subnet>.1/24) and one tap per VM;
QEMU, ssh, iperf3 and wrk all run inside that namespace, so load never leaves it. The accelerator
is KVM only where a real boot proved it works (lab.backends.local.kvm), and is recorded with every
sample.

The Backend seam, put together from the package's parts: vms (the machines: clone, start, wait,
destroy), owned (what `lab gc` may remove), and the optional parts: warmstart (warm start's
snapshots), baremetal (this machine as a cell), hostload (this machine's CPU under each
repetition) and publishing into the host's image store (LocalPublishing).
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Sequence
from pathlib import Path

from lab import IMAGES_DIR, hostinfo, images, runlock, statedir
from lab.backends.base import Backend, BackendEnv, Capabilities, Client, Link, PlainClient
from lab.backends.local import baremetal, host, hostload, layout, warm
from lab.backends.local.owned import Inventory
from lab.backends.local.qemu import QEMU, qemu_version
from lab.backends.local.settings import Settings, capabilities
from lab.backends.local.vms import Machines
from lab.backends.local.warmstart import WarmStart
from lab.errors import LabError, SettingError, UsageError
from lab.model import Accel, CloneKind, ImageRef, Owned, Vm, VmSpec
from lab.runlock import RunLock


class LocalPublishing:
    """The local host's Publishing part: `lab images publish NAME local` copies the built image into
    this host's image store, <workdir>/images/<name>/<sha256[:12]>/ (+ a `current` link), verified
    by sha256."""

    def __init__(self, workdir: Path):
        self.workdir = workdir

    def publish(self, image: ImageRef) -> str:
        return images.publish_local(image, self.workdir / "images")


class LocalBackend(Backend):
    name = "local"
    settings_model = Settings
    settings: Settings
    warm: WarmStart

    def __init__(self, host_name: str, settings: Settings, env: BackendEnv | None = None):
        super().__init__(host_name, settings, env)
        # the setting, else "local" in the lab's private state directory
        self.workdir = Path(settings.workdir) if settings.workdir else self.env.state_dir / "local"
        self.machines = Machines(self.name, settings, self.workdir, self.env.state_dir)
        self.warm = self.machines.warm = WarmStart(self.machines)
        self.inventory = Inventory(self.name, self.workdir)
        self.publishing = LocalPublishing(self.workdir)
        self.bare_metal = baremetal.BareMetalCells(self.name, self.workdir, settings.subnet)
        self.load_meter = hostload.LoadMeter()
        self._run_locks: dict[str, RunLock] = {}  # run id -> its lock, held while the run is open

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
    def _workdir_what(self) -> str:
        return f"host {self.host_name!r}: workdir"

    # -- checks and facts ---------------------------------------------------------------------
    def check(self) -> None:
        missing = [t for t in (QEMU, "qemu-img", "ip") if shutil.which(t) is None]
        if missing:
            raise UsageError(f"host {self.host_name!r}: {', '.join(missing)} not installed", hint="run `make setup`")
        if os.geteuid() != 0:
            raise UsageError(f"host {self.host_name!r}: the local backend needs root for network namespaces and taps")
        # Checked, not made: exit 2 means nothing was created (open_run makes it)
        statedir.check(self.workdir, self._workdir_what)
        if self.settings.warm_dir:
            statedir.check(Path(self.settings.warm_dir), f"host {self.host_name!r}: warm_dir")
        if self.settings.accel == "auto":  # the KVM probe's verdict is kept there
            statedir.check(self.env.state_dir)

    def facts(self) -> dict[str, object]:
        return {
            "backend": self.name,
            "accel": self.machines.known_accel,
            **({"tcg_threads": self.settings.tcg_threads} if self.machines.known_accel == "tcg" else {}),
            "qemu": qemu_version(),
            "kernel": platform.release(),
        }

    def host_facts(self) -> dict[str, object]:
        return hostinfo.local_facts()

    def describe_images(self, images: Sequence[ImageRef]) -> list[str]:
        """Each image is used in place; its warm snapshots here, if any."""
        snaps = self.warm.snapshots()
        lines = []
        for image in images:
            warm_of = [s.name for s in snaps if s.detail == warm.image_digest(image)]
            lines.append(
                f"host {self.host_name!r}: {image.name} from {image.path} in place"
                + (f"; warm snapshots: {', '.join(warm_of)}" if warm_of else "")
            )
        return lines

    def accel(self, image: ImageRef) -> Accel:
        """The accelerator of this host's VMs: the setting, or with "auto" the KVM probe's verdict."""
        return self.machines.accel(image)

    # -- per run --------------------------------------------------------------------------------
    def open_run(self, run_id: str) -> Client:
        ns = layout.netns_name(run_id)
        statedir.ensure(self.workdir, self._workdir_what)
        # Held for the run's life: `lab gc` leaves alone what a live run owns.
        lock = RunLock(layout.run_lock_path(self.workdir, run_id))
        lock.acquire(what=f"the lock of run {run_id} (is another `lab run --resume` on it?)")
        self._run_locks[run_id] = lock
        try:
            host.run_all(host.bridge_netns_argvs(ns, self.machines.gateway), what="the run's network namespace")
        except LabError:
            self.close_run(run_id)
            raise
        self.machines.open_run(run_id)
        return PlainClient(address=self.machines.gateway, netns=ns)

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

    # -- per VM (lab.backends.local.vms) ---------------------------------------------------------
    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        return self.machines.clone(image, spec)

    def start(self, vm: Vm) -> None:
        self.machines.start(vm)

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        return self.machines.wait_ready(vm, timeout)

    def destroy(self, vm: Vm) -> None:
        self.machines.destroy(vm)

    def renew_lease(self, vm: Vm, expires_at: float) -> None:
        layout.renew_lease(Path(vm.handle["dir"]), expires_at)  # a VM's or the bare-metal cell's

    def console_text(self, vm: Vm) -> str:
        return self.machines.console_text(vm)

    def lab_link(self, vm: Vm) -> Link | None:
        """The VM's tap in the run's namespace: netem there shapes the guest's traffic on the lab side."""
        return Link(dev=vm.handle["tap"], netns=vm.handle["netns"]) if vm.handle.get("tap") else None

    # -- garbage collection (lab.backends.local.owned) ----------------------------------------------
    def list_owned(self) -> list[Owned]:
        return self.inventory.list()

    def remove_owned(self, item: Owned) -> None:
        self.inventory.remove(item)


def lab_key() -> Path:
    """The lab's SSH key (images/lab_key), made private to its owner as ssh insists."""
    key = IMAGES_DIR / "lab_key"
    if not key.exists():
        raise UsageError(f"SSH key {key} is missing", hint="run `make images`")
    os.chmod(key, 0o600)
    return key


BACKEND = LocalBackend
