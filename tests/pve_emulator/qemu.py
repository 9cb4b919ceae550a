"""Real QEMU guests behind the emulator's VMs, so a lab run against the emulator measures real guests.

The "node" is a network namespace the test made, holding the bridge (`vmbr0`) that net0 names; every
started VM is a QEMU of the golden image in that namespace, with a tap on the bridge, started the way
PVE starts a template clone (`qm showcmd`, reduced):

- the bootloader: no direct kernel boot. SeaBIOS (or OVMF with `bios=ovmf`) boots the disk on the
  bus of its config key (`scsi0`: virtio-scsi, `virtio0`, `sata0`, `ide0`), GRUB the kernel, as on a
  real node;
- `ipconfig0`/`sshkeys`/`ciuser` (cloud-init): a NoCloud ISO labelled `cidata` on `ide2`, made as PVE's
  `PVE::QemuServer::Cloudinit` makes it (`genisoimage -R -V cidata`; network-config version 1,
  user-data, meta-data). `ip=dhcp` is the one translation: the emulator plays the DHCP server and
  writes the address it would have leased as a static one;
- the guest agent: with `agent` enabled, a virtio-serial port `org.qemu.guest_agent.0` on a unix
  socket; `network-get-interfaces` is asked of the real qemu-guest-agent in the guest (`guest_agent`).
QEMU is stopped with lab.backends.local's own `stop_process`.

With `warm_dir`, a VM of a shape the local backend has a warm snapshot of is restored instead of
booted (warmguest.py says how, and what the lab sees of it: nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

from support.local import TCG_THREADS, WARM_ENV

from lab import images, proc
from lab.backends.local import NIC_DEVICE, QEMU, disk_args, machine_args, stop_process
from lab.backends.local.warm import WarmUnusable
from lab.errors import LabError
from lab.model import Accel, DiskBus, ImageRef, NicModel

from .warmguest import WarmGuests

OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")

NET0 = re.compile(r"^(?P<model>[a-z0-9]+)=(?P<mac>[0-9A-Fa-f:]{17})")


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class QemuGuest:
    vmid: int
    name: str
    process: subprocess.Popen
    tap: str
    vmdir: Path
    mac: str
    ip: str
    interfaces: list[dict] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # a restored guest: set once it has its identity (until then its agent is "not running"); its
    # finishing thread; how it started ("cold", "warm", or "cold: why" after a failed restore)
    ready: threading.Event = field(default_factory=_set_event)
    finisher: threading.Thread | None = None
    start: str = "cold"
    stopped: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def console(self) -> Path:
        return self.vmdir / "console.log"


class QemuBacking:
    def __init__(
        self,
        image: ImageRef,
        *,
        netns: str,
        workdir: Path,
        key: Path,
        subnet: str,
        bridge: str = "vmbr0",
        prefix: int = 24,
        accel: Accel = Accel.TCG,
        tcg_threads: str = TCG_THREADS,
        warm_dir: str | Path | None = None,
    ):
        self.image, self.netns, self.workdir, self.key = image, netns, Path(workdir), Path(key)
        self.subnet, self.bridge, self.prefix, self.accel = subnet, bridge, prefix, accel
        # the test suite's choice for its guests: support.local.TCG_THREADS
        self.tcg_threads = tcg_threads
        self.gateway = f"{subnet}.1"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.warm = (
            WarmGuests(image, warm_dir=Path(warm_dir), accel=accel, tcg_threads=tcg_threads) if warm_dir else None
        )
        self.starts: list[str] = []  # how each stopped guest had started (QemuGuest.start), in order

    def dhcp_address(self, vmid: int) -> str:
        return f"{self.subnet}.{200 + vmid % 50}"

    def make_disk(self, dst: Path, src: Path, *, linked: bool) -> None:
        if linked:
            proc.run(
                ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(Path(src).resolve()), "-F", "qcow2", str(dst)],
                what="qemu-img create (linked clone)",
            )
        else:
            proc.run(
                ["cp", "--reflink=auto", "--sparse=always", str(src), str(dst)], timeout=600, what="full clone copy"
            )

    def start(self, vmid: int, config: dict, disk: Path, *, bus: str, ip: str, prefix: int, gateway: str) -> QemuGuest:
        """QEMU for a started VM: `disk` on `bus` (the prefix of its config key: scsi, virtio, sata, ide)."""
        m = NET0.match(str(config.get("net0", "")))
        if m is None:
            raise LabError(f"VM {vmid}: net0 {config.get('net0')!r} has no model=MAC")
        uefi = str(config.get("bios", "seabios")) == "ovmf"
        images.require_boot(self.image, "uefi" if uefi else "bios", f"PVE VM {vmid}")
        vcpus = int(config.get("cores", 1)) * int(config.get("sockets", 1))
        memory = int(str(config.get("memory", 512)).split("=")[-1])
        name = str(config.get("name") or f"vm-{vmid}")
        mac = m.group("mac").lower()
        vmdir = self.workdir / f"vm-{vmid}"
        vmdir.mkdir(parents=True, exist_ok=False)
        files = nocloud_files(vmid, config, ip=ip, prefix=prefix, gateway=gateway)
        (vmdir / "cidata").mkdir()
        for fname, text in files.items():
            (vmdir / "cidata" / fname).write_text(text)
        proc.run(
            ["genisoimage", "-quiet", "-R", "-V", "cidata", "-o", vmdir / "cidata.iso", vmdir / "cidata"],
            timeout=60,
            what="genisoimage (cloud-init drive)",
        )
        shutil.rmtree(vmdir / "cidata")
        argv = [
            QEMU,
            "-name",
            f"{name},process={name}",
            *machine_args(self.accel, self.tcg_threads),
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-smp",
            str(vcpus),
            "-m",
            str(memory),
            *disk_args(DiskBus(bus), Path(disk).resolve()),
            "-drive",
            f"file={vmdir / 'cidata.iso'},if=ide,index=2,media=cdrom,format=raw,readonly=on",
            "-netdev",
            f"tap,id=n0,ifname=pvetap{vmid},script=no,downscript=no",
            "-device",
            f"{NIC_DEVICE[NicModel(m.group('model'))]},netdev=n0,mac={mac},romfile=",
            "-serial",
            f"file:{vmdir / 'console.log'}",
            "-pidfile",
            str(vmdir / "qemu.pid"),
        ]
        if uefi:
            shutil.copyfile(OVMF_VARS, vmdir / "efivars.fd")
            argv += [
                "-drive",
                f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
                "-drive",
                f"if=pflash,format=raw,unit=1,file={vmdir / 'efivars.fd'}",
            ]
        if _enabled(config.get("agent", "0")):
            argv += [
                "-chardev",
                f"socket,id=qga0,path={vmdir / 'qga.sock'},server=on,wait=off",
                "-device",
                "virtio-serial-pci",
                "-device",
                "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
            ]
        if self.accel is Accel.KVM:
            argv += ["-cpu", "host"]
        tap = f"pvetap{vmid}"
        proc.run(["ip", "-n", self.netns, "tuntap", "add", tap, "mode", "tap"], what="tap add")
        try:
            if self.warm is not None and not uefi and bus == "virtio" and _enabled(config.get("agent", "0")):
                spec = self.warm.spec(
                    name=name, nic=NicModel(m.group("model")), vcpus=vcpus, memory=memory, ip=ip, mac=mac
                )
                guest = self._restore(vmid, spec, vmdir, tap, argv, prefix=prefix, gateway=gateway)
                if guest is not None:
                    return guest
            return QemuGuest(vmid, name, self._boot(argv, vmdir, tap), tap, vmdir, mac, ip)
        except BaseException:
            proc.run(["ip", "-n", self.netns, "link", "del", tap], check=False)
            raise

    def _boot(self, argv: list[str], vmdir: Path, tap: str) -> subprocess.Popen:
        """The firmware boot: the tap on the node's bridge, QEMU started."""
        proc.run(["ip", "-n", self.netns, "link", "set", tap, "master", self.bridge, "up"], what="tap up")
        with open(vmdir / "qemu.log", "wb") as log:
            return proc.spawn(argv, netns=self.netns, stdout=log, stderr=subprocess.STDOUT)

    def _restore(self, vmid, spec, vmdir: Path, tap: str, argv: list[str], *, prefix: int, gateway: str):
        """A restored guest of `spec` (its identity given by a thread of its own, which boots `argv`
        by firmware instead if that fails), or None: no snapshot of its shape, or QEMU refused it."""
        assert self.warm is not None
        snapshot = self.warm.find(spec)
        if snapshot is None:
            return None
        # up but off the bridge while it carries the snapshot's identity (as the local backend does)
        proc.run(["ip", "-n", self.netns, "link", "set", tap, "up"], what="tap up")
        try:
            restore = self.warm.begin(snapshot, spec, vmdir=vmdir, tap=tap, netns=self.netns, gateway=gateway)
        except WarmUnusable:
            (vmdir / "disk.qcow2").unlink(missing_ok=True)
            return None
        guest = QemuGuest(vmid, spec.name, restore.proc, tap, vmdir, spec.mac, spec.ip, ready=threading.Event())
        guest.start = "warm"

        def finish() -> None:
            try:
                self.warm.finish(restore, snapshot, spec, vmdir=vmdir, gateway=gateway, prefix=prefix)
            except WarmUnusable as exc:
                with guest.lock:
                    if not guest.stopped:  # else the stop is what failed it
                        guest.start = f"cold: {exc}"
                        stop_process(guest.process)
                        guest.process = self._boot(argv, vmdir, tap)
            else:
                with guest.lock:
                    if not guest.stopped:
                        proc.run(["ip", "-n", self.netns, "link", "set", tap, "master", self.bridge], check=False)
            finally:
                guest.ready.set()

        guest.finisher = threading.Thread(target=finish, name=f"restore VM {vmid}", daemon=True)
        guest.finisher.start()
        return guest

    def stop(self, guest: QemuGuest) -> None:
        with guest.lock:
            guest.stopped = True
        stop_process(guest.process)  # a restore being finished then fails at once
        if guest.finisher is not None:
            guest.finisher.join(timeout=60)
        self.starts.append(guest.start)
        proc.run(["ip", "-n", self.netns, "link", "del", guest.tap], check=False)
        for f in guest.vmdir.iterdir():
            f.unlink()
        guest.vmdir.rmdir()

    def interfaces(self, guest: QemuGuest) -> list[dict] | None:
        """The real guest agent's guest-network-get-interfaces; None while it is not up."""
        if not guest.ready.is_set():
            return None  # a restored guest still carrying the snapshot's identity
        with guest.lock:
            if guest.process.poll() is not None or not (guest.vmdir / "qga.sock").exists():
                return None
            answer = guest_agent(guest.vmdir / "qga.sock", "guest-network-get-interfaces", timeout=5)
            return None if answer is None else answer.get("return")


def restoring_backing(image: ImageRef, shapes: list[tuple[NicModel, int, int]], **kw) -> QemuBacking:
    """A QemuBacking whose guests of `shapes` ((nic, vcpus, memory), disk on virtio0, SeaBIOS, the
    agent on) are restores of the tests' shared warm snapshots ($LAB_TESTS_WARM_DIR), made first
    where missing: for tests of the PVE backend, to whom how the node's guests come up is not the
    question (each such boot was ~30 s of a core under TCG, a restore is ~2)."""
    backing = QemuBacking(image, warm_dir=os.environ[WARM_ENV], **kw)
    assert backing.warm is not None
    backing.warm.prepare(shapes)
    return backing


def _enabled(value: object) -> bool:
    first = str(value).split(",")[0]
    first = first.split("=", 1)[1] if first.startswith("enabled=") else first
    return first.lower() in ("1", "on", "yes", "true")


def nocloud_files(vmid: int, config: dict, *, ip: str, prefix: int, gateway: str) -> dict[str, str]:
    """network-config, user-data and meta-data as PVE's Cloudinit.pm (nocloud) writes them for net0 /
    ipconfig0 / ciuser / sshkeys; `ip`/`prefix`/`gateway` are ipconfig0's static address (or the
    emulator's DHCP stand-in for ip=dhcp)."""
    m = NET0.match(str(config.get("net0", "")))
    mac = m.group("mac") if m else ""
    net = (
        "version: 1\nconfig:\n"
        f"    - type: physical\n      name: eth0\n      mac_address: {mac}\n      subnets:\n"
        f"        - type: static\n          address: {ip}/{prefix}\n"
        + (f"          gateway: {gateway}\n" if gateway else "")
    )
    user = f"#cloud-config\nhostname: {config.get('name') or f'VM{vmid}'}\nmanage_etc_hosts: true\n"
    ciuser = config.get("ciuser")
    if ciuser:
        user += f"user: {ciuser}\n" + ("disable_root: False\n" if ciuser == "root" else "")
    keys = [k.strip() for k in unquote(str(config.get("sshkeys", ""))).split("\n") if k.strip()]
    if keys:
        user += "ssh_authorized_keys:\n" + "".join(f"  - {k}\n" for k in keys)
    user += "chpasswd:\n  expire: False\n"
    if ciuser != "root":
        user += "users:\n  - default\n"
    user += "package_upgrade: true\n"
    meta = f"instance-id: {hashlib.sha1((user + net).encode()).hexdigest()}\n"
    return {"network-config": net, "user-data": user, "meta-data": meta}


def guest_agent(sock_path: Path, command: str, *, timeout: float = 10.0) -> dict | None:
    """One QEMU guest agent command on its virtio-serial unix socket, after a guest-sync handshake
    (answers left over from an earlier, timed-out exchange are skipped). None if the agent does
    not answer within `timeout`."""
    sync = time.monotonic_ns() % 2**31
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout)
            s.connect(str(sock_path))
            f = s.makefile("rwb")
            f.write(json.dumps({"execute": "guest-sync", "arguments": {"id": sync}}).encode() + b"\n")
            f.flush()
            while True:
                line = f.readline()
                if not line:
                    return None  # the agent hung up
                if json.loads(line).get("return") == sync:
                    break
            f.write(json.dumps({"execute": command}).encode() + b"\n")
            f.flush()
            return json.loads(f.readline())
    except (OSError, ValueError):
        return None
