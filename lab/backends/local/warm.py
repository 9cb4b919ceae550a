"""Warm start: restore a post-boot memory snapshot of the machine's shape instead of booting it.

A snapshot is made once per `ShapeKey` (image, NIC, disk bus, vCPUs, memory, firmware, accelerator,
backend, QEMU version), on first need: the golden image boots cold with its RAM in a file (shared
mapping: the file is the RAM), up to LAB-READY; the guest agent waits for the boot to settle and
syncs the disks; the agent's port stays connected (a port closed at save time makes the restored
agent back off for seconds); QEMU stops the guest and saves the device state alone
(`x-ignore-shared`: the RAM stays in its file). The overlay disk of that boot is then frozen.
Snapshots live in `<workdir>/warm/<name>/` (disk.qcow2, ram, state, meta.json), root only, or under the
host's `warm_dir`, which several workdirs may share.

A clone of it: a linked overlay on the frozen disk, the RAM file mapped private (copy on write:
the file never changes, clones share its unwritten pages), `-incoming defer` and the state restored
(~0.1 s). The restored guest is the snapshot's: before anything reaches it, through the agent and
not the network (its tap is on no bridge until then): the clock is stepped to the host's
(guest-set-time), its MAC, address, route and neighbours become the cell's (one `ip -batch`); the
VM generation ID device, new in every QEMU (guid=auto), makes the kernel reseed its RNG.

Pure parts (the key, the fix-up lines) are separate from what touches QEMU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lab import osfacts, proc
from lab.backends.local import host
from lab.backends.local.monitor import GuestAgent, Qmp
from lab.errors import BackendError, LabError
from lab.images import file_sha256
from lab.model import Accel, ImageRef, VmSpec
from lab.wait import wait_until

WARM_FORMAT = 1  # the recipe of a snapshot (devices, settle steps); a change makes old ones unusable
FIRMWARE = "seabios+kernel"  # vmgenid needs firmware with the ACPI table loader: SeaBIOS, not qboot
STORE = "warm"
META = "meta.json"
DISK, RAM, STATE = "disk.qcow2", "ram", "state"
SETTLE_TIMEOUT = 180.0  # the template's boot settling (systemd) after LAB-READY
AGENT_TIMEOUT = 15.0
# The template settles before it is saved: what the boot started has finished (nginx comes after
# LAB-READY) and nothing is left dirty for every clone to write back on its own. hwclock is masked
# in memory only (the disk keeps it): guest-set-time forks `hwclock -w` after its settimeofday,
# which costs a restored clone 0.6-1.2 s under TCG while QEMU's RTC follows the host anyway.
SETTLE = (
    "systemctl is-system-running --wait; if [ -x /sbin/hwclock ]; then mount --bind /bin/true /sbin/hwclock; fi; sync"
)
CLOCK_TOLERANCE_MS = 1000.0


class WarmUnusable(LabError):
    """A snapshot cannot be used (missing, damaged, failed to restore); the cell boots cold.
    `damaged`: QEMU could not load it (not a slow guest agent): it goes."""

    def __init__(self, message: str, damaged: bool = False):
        super().__init__(message)
        self.damaged = damaged


# -- the key (pure) ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShapeKey:
    """What a snapshot depends on: a clone may be restored from it only if every field matches."""

    image: str
    image_digest: str  # the built artifact's sha256 (its recipe digest when it has none)
    image_path: str  # resolved: the frozen overlay's backing file
    nic: str
    disk_bus: str
    vcpus: int
    memory_mib: int
    firmware: str
    accel: str
    backend: str
    qemu: str
    format: int = WARM_FORMAT

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    @property
    def name(self) -> str:
        """Its directory under the store: readable, and unique by the digest of every field."""
        return f"{self.image}-{self.nic}-{self.disk_bus}-{self.vcpus}c{self.memory_mib}m-{self.digest[:12]}"


def image_digest(image: ImageRef) -> str:
    return image.sha256 or image.digest


def shape_key(spec: VmSpec, *, accel: Accel, qemu: str, backend: str = "local") -> ShapeKey:
    """Pure but for resolving the image's path: the key of the spec's machine shape."""
    return ShapeKey(
        image=spec.image.name,
        image_digest=image_digest(spec.image),
        image_path=str(Path(spec.image.path).resolve()),
        nic=spec.nic.value,
        disk_bus=spec.disk_bus.value,
        vcpus=spec.vcpus,
        memory_mib=spec.memory_mib,
        firmware=FIRMWARE,
        accel=accel.value,
        backend=backend,
        qemu=qemu,
    )


def unusable_here(meta: dict[str, Any], qemu: str) -> bool:
    """Pure: a snapshot no QEMU of this machine can restore any more (another QEMU, an old format)."""
    key = meta.get("key") or {}
    return key.get("qemu") != qemu or key.get("format") != WARM_FORMAT


def refusal(image: ImageRef) -> str | None:
    """Pure: why `image` cannot be started warm on this backend, or None."""
    if image.os not in osfacts.OSES or not osfacts.facts(image.os).warm_fixups:
        return f"warm start fixes up Linux guests (iproute2 through the guest agent); {image.name} is {image.os}"
    if image.manifest.get("guest_agent") is False:
        return f"image {image.name} has no QEMU guest agent (the manifest says guest_agent = false)"
    return None


def guest_device(image: ImageRef) -> str:
    return (image.manifest.get("net") or {}).get("device", "eth0")


def fixup_batch(*, ip: str, prefix: int, gateway: str, mac: str, dev: str = "eth0", link_down: bool = False) -> str:
    """Pure: `ip -batch` lines that give a restored guest the cell's identity: MAC, address, default
    route, and no neighbour entry of the snapshot's network (the bridge there had another MAC).
    The MAC changes with the link up (virtio-net, e1000: no carrier flap); `link_down` is for a
    driver that refuses that."""
    mac_lines = (
        [f"link set dev {dev} down", f"link set dev {dev} address {mac}", f"link set dev {dev} up"]
        if link_down
        else [f"link set dev {dev} address {mac}"]
    )
    return (
        "\n".join(
            [
                *mac_lines,
                f"addr flush dev {dev}",
                f"addr add {ip}/{prefix} dev {dev}",
                f"route replace default via {gateway} dev {dev}",
                f"neigh flush dev {dev}",
            ]
        )
        + "\n"
    )


# -- the store ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    dir: Path
    meta: dict[str, Any] = field(compare=False)

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def disk(self) -> Path:
        return self.dir / DISK

    @property
    def ram(self) -> Path:
        return self.dir / RAM

    @property
    def state(self) -> Path:
        return self.dir / STATE


class WarmStore:
    """`root` (`<workdir>/warm/` or the host's warm_dir): one directory per snapshot, a lock file per
    key while it is built."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def ensure(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # guest memory: root only
        return self.root

    def path(self, key: ShapeKey) -> Path:
        return self.root / key.name

    def lock_path(self, key: ShapeKey) -> Path:
        return self.root / f"{key.name}.lock"

    def find(self, key: ShapeKey) -> Snapshot | None:
        """The snapshot of `key`; None if there is none. WarmUnusable if it is there but damaged."""
        d = self.path(key)
        if not d.exists():
            return None
        try:
            meta = json.loads((d / META).read_text())
        except (OSError, ValueError):
            raise WarmUnusable(f"warm snapshot {d.name}: {META} is missing or unreadable") from None
        problem = damage(d, meta, key)
        if problem:
            raise WarmUnusable(f"warm snapshot {d.name}: {problem}")
        return Snapshot(d, meta)

    def snapshots(self) -> list[Snapshot]:
        out = []
        if self.root.is_dir():
            for d in sorted(self.root.iterdir()):
                if d.is_dir() and not d.name.endswith(".tmp"):
                    try:
                        meta = json.loads((d / META).read_text())
                    except (OSError, ValueError):
                        meta = {}
                    out.append(Snapshot(d, meta if isinstance(meta, dict) else {}))
        return out

    def remove(self, name: str) -> None:
        """Remove one snapshot (clones running from it keep their open files)."""
        d = self.root / name
        if d.parent != self.root or not name:
            raise BackendError(f"not a warm snapshot: {name!r}")
        try:
            shutil.rmtree(d)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise BackendError(f"warm snapshot {name}: {exc.strerror}") from None


def damage(d: Path, meta: dict[str, Any], key: ShapeKey) -> str:
    """What is wrong with a snapshot's files against its meta and key ("" if nothing)."""
    if meta.get("key") != asdict(key):
        return "its meta.json is of another machine shape"
    for f in (DISK, RAM, STATE):
        if not (d / f).is_file():
            return f"its {f} file is missing"
    if (d / RAM).stat().st_size != key.memory_mib * 1024 * 1024:
        return f"its RAM file is {(d / RAM).stat().st_size} bytes, not {key.memory_mib} MiB"
    if file_sha256(d / STATE) != meta.get("state_sha256"):
        return "its device state does not match the checksum taken when it was saved"
    return ""


# -- making a snapshot ---------------------------------------------------------------------------------


def make_snapshot(
    key: ShapeKey,
    *,
    store: WarmStore,
    builddir: Path,
    argv: list[str],
    netns: str,
    boot_timeout: float,
    handle: dict[str, Any],
) -> Snapshot:
    """Boot the template (argv: RAM shared in builddir/ram, disk builddir/disk.qcow2), settle, save,
    then move disk, RAM and state into the store. `handle` gets the QEMU process (for the caller's
    teardown). Raises LabError; the caller removes builddir."""
    t0 = time.monotonic()
    with open(builddir / "qemu.log", "wb") as log:
        p = proc.spawn(argv, netns=netns, stdout=log, stderr=subprocess.STDOUT)
    handle["proc"] = p
    # Connected before the guest's agent starts: it would otherwise back off for seconds.
    with GuestAgent(builddir / "qga.sock", "the template's guest agent", alive=lambda: p.poll() is None) as agent:
        host.wait_console_ready(p, builddir, f"warm snapshot {key.name}", boot_timeout)
        booted = time.monotonic() - t0
        agent.sync(timeout=60)
        settled = agent.run(["/bin/sh", "-c", SETTLE], timeout=SETTLE_TIMEOUT)
        t1 = time.monotonic()
        with Qmp(builddir / "qmp.sock", "the template's QMP") as qmp, open(builddir / STATE, "wb") as state:
            qmp.call("stop", 30)
            qmp.call("migrate-set-capabilities", 10, capabilities=[{"capability": "x-ignore-shared", "state": True}])
            qmp.pass_fd("state", state.fileno())
            qmp.call("migrate", 10, uri="fd:state")
            done = wait_until(
                lambda: migration_over(qmp),
                timeout=120,
                what="the template's device state to be saved",
                interval=0.01,
                max_interval=0.2,
            )
            if done.get("status") != "completed":
                raise BackendError(f"warm snapshot {key.name}: saving failed: {done.get('error-desc') or done}")
    host.stop_process(p)  # the state is written: QEMU goes (its RAM file stays)
    saved = time.monotonic() - t1
    meta = {
        "key": asdict(key),
        "name": key.name,
        "image": key.image,
        "image_digest": key.image_digest,
        "created_at": time.time(),
        "boot_seconds": round(booted, 2),
        "save_seconds": round(saved, 3),
        "build_seconds": round(time.monotonic() - t0, 2),
        "settled": settled.stdout.strip(),
        "state_sha256": file_sha256(builddir / STATE),
        "state_bytes": (builddir / STATE).stat().st_size,
    }
    store.ensure()
    tmp = store.root / f"{key.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a build killed while moving
    tmp.mkdir()
    for f in (DISK, RAM, STATE):
        os.replace(builddir / f, tmp / f)
        os.chmod(tmp / f, 0o400)  # frozen: clones open it read-only (backing file) or map it private
    (tmp / META).write_text(json.dumps(meta, indent=1))
    os.replace(tmp, store.path(key))
    return Snapshot(store.path(key), meta)


def quit_within(p: subprocess.Popen, seconds: float) -> bool:
    """Whether `p` has exited or exits within `seconds`."""
    try:
        return bool(
            wait_until(
                lambda: p.poll() is not None,
                timeout=seconds,
                what=f"pid {p.pid} to exit",
                interval=0.01,
                max_interval=0.1,
            )
        )
    except LabError:
        return False


def migration_over(qmp: Qmp) -> dict[str, Any] | None:
    info = qmp.call("query-migrate", 10)
    return info if info.get("status") in ("completed", "failed", "cancelled") else None


# -- restoring a clone ------------------------------------------------------------------------------------


@dataclass
class Restore:
    """A clone being restored: its QEMU, monitor and agent (held from start to wait_ready)."""

    proc: subprocess.Popen
    qmp: Qmp
    agent: GuestAgent
    started: float

    def close(self) -> None:
        self.qmp.close()
        self.agent.close()


def begin_restore(snapshot: Snapshot, *, vmdir: Path, argv: list[str], netns: str) -> Restore:
    """Start QEMU waiting for the state, connect the agent's port (before the guest runs: see the
    module doc), start loading. Raises WarmUnusable (QEMU stopped again)."""
    t0 = time.monotonic()
    with open(vmdir / "qemu.log", "wb") as log:
        p = proc.spawn(argv, netns=netns, stdout=log, stderr=subprocess.STDOUT)
    opened: list[Qmp | GuestAgent] = []
    try:
        qmp = Qmp(vmdir / "qmp.sock", f"{vmdir.name}'s QMP", alive=lambda: p.poll() is None)
        opened.append(qmp)
        agent = GuestAgent(vmdir / "qga.sock", f"{vmdir.name}'s guest agent", alive=lambda: p.poll() is None)
        opened.append(agent)
        qmp.call("migrate-set-capabilities", 10, capabilities=[{"capability": "x-ignore-shared", "state": True}])
        with open(snapshot.state, "rb") as state:
            qmp.pass_fd("state", state.fileno())  # QEMU holds its own copy of the descriptor
        qmp.call("migrate-incoming", 10, uri="fd:state")
    except BaseException as exc:
        for channel in opened:
            channel.close()
        host.stop_process(p)
        if isinstance(exc, (LabError, OSError)):  # OSError: the snapshot went meanwhile
            why = exc if isinstance(exc, LabError) else exc.strerror
            raise WarmUnusable(
                f"restore of {snapshot.name} did not start: {why} {host.tail(vmdir / 'qemu.log')}".strip()
            ) from None
        raise
    return Restore(p, qmp, agent, t0)


def finish_restore(
    r: Restore, *, vmdir: Path, snapshot: Snapshot, spec: VmSpec, gateway: str, prefix: int = 24, timeout: float = 60.0
) -> dict[str, Any]:
    """Wait for the state to load, resume, step the clock, give the guest the cell's identity.
    Returns the timings; raises WarmUnusable with the reason."""

    def exited() -> WarmUnusable:
        return WarmUnusable(
            f"restore of {snapshot.name} failed: QEMU exited with status {r.proc.returncode}: "
            f"{host.tail(vmdir / 'qemu.log')}",
            damaged=True,
        )

    def loaded() -> str | None:
        if r.proc.poll() is not None:
            raise exited()
        status = r.qmp.status()
        return None if status == "inmigrate" else status

    try:
        status = wait_until(
            loaded, timeout=timeout, what=f"{vmdir.name}'s state to load", interval=0.005, max_interval=0.05
        )
    except LabError as exc:
        # QEMU exits when it cannot load a stream; its monitor may close before poll() sees the exit
        if quit_within(r.proc, 2.0):
            raise exited() from None
        raise WarmUnusable(f"restore of {snapshot.name} failed: {exc}") from None
    try:
        restored = time.monotonic()
        if status != "running":
            r.qmp.call("cont", 10)
        r.agent.sync(timeout=AGENT_TIMEOUT)
        try:
            r.agent.call("guest-set-time", AGENT_TIMEOUT, time=time.time_ns())
        except BackendError:
            pass  # set, but no hwclock to run after it: the offset read below decides
        clock = time.monotonic()
        dev = guest_device(spec.image)
        batch = fixup_batch(ip=spec.ip, prefix=prefix, gateway=gateway, mac=spec.mac, dev=dev)
        res = r.agent.run(["ip", "-batch", "-"], input=batch, timeout=timeout)
        mac_change = "live"
        if res.exitcode != 0:  # a driver that wants the link down for a new MAC
            mac_change = "link down"
            res = r.agent.run(
                ["ip", "-batch", "-"],
                input=fixup_batch(ip=spec.ip, prefix=prefix, gateway=gateway, mac=spec.mac, dev=dev, link_down=True),
                timeout=timeout,
            )
        if res.exitcode != 0:
            raise WarmUnusable(f"the restored guest refused its address: {res.stderr.strip() or res.exitcode}")
        before = time.time_ns()
        guest_ns = r.agent.call("guest-get-time", AGENT_TIMEOUT)
        offset_ms = (guest_ns - (before + time.time_ns()) / 2) / 1e6
        if abs(offset_ms) > CLOCK_TOLERANCE_MS:
            raise WarmUnusable(f"the restored guest's clock is {offset_ms / 1000:.1f} s off the host's after the step")
    except WarmUnusable:
        raise
    except LabError as exc:
        raise WarmUnusable(f"restore of {snapshot.name} failed: {exc}") from None
    done = time.monotonic()
    return {
        "restore_seconds": round(restored - r.started, 3),
        "clock_seconds": round(clock - restored, 3),
        "fixup_seconds": round(done - restored, 3),
        "clock_offset_ms": round(offset_ms, 1),
        "mac_change": mac_change,
    }
