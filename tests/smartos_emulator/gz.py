"""The emulated SmartOS global zone: its commands, its files, its faults, and the socket the SSH
logins reach it through.

Every SSH login to the emulated host runs gzsh.py (sshd's ForceCommand), which hands the command
line and its stdin to this process over a unix socket and relays back stdout, stderr and the exit
status. Here the line is parsed as a shell would parse one simple command (no pipes, redirections
or lists: those are refused, as a strict emulator must) and run against one state: `vmadm`,
`imgadm`, `sysinfo`, `arp -an`, `dd of=... bs=... seek=...` (into a zvol or a file under /var/tmp),
`rm -f` (under /var/tmp), `true`. Anything else is "not found" (exit 127).

Paths of the global zone (/zones, /dev/zvol/rdsk, /var/tmp, /var/imgadm) live under `root`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import socketserver
import struct
import threading
import time
import uuid as uuidlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab import proc

from .gzsh import FRAME, recv_exact
from .imgadm import Imgadm
from .vmadm import Vmadm, VmRecord

GZ_DIRS = ("/var/tmp/", "/zones/", "/dev/zvol/rdsk/", "/var/imgadm/")
SHELL_OPERATORS = re.compile(r"^[;&|<>()]+$")
CHUNK = 1 << 20


def send(sock: socket.socket, kind: bytes, data: bytes = b"") -> None:
    sock.sendall(FRAME.pack(kind, len(data)) + data)


def recv(sock: socket.socket) -> tuple[bytes, bytes]:
    kind, size = FRAME.unpack(recv_exact(sock, FRAME.size))
    return kind, recv_exact(sock, size) if size else b""


class Io:
    """One command's stdin (frames from gzsh.py, read only if the command wants it), stdout, stderr."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._eof = False

    def stdin_chunks(self) -> Iterator[bytes]:
        while not self._eof:
            kind, data = recv(self.sock)
            if kind == b"E":
                self._eof = True
            elif kind == b"I":
                yield data

    def stdin_all(self) -> bytes:
        return b"".join(self.stdin_chunks())

    def out(self, text: str | bytes) -> None:
        send(self.sock, b"O", text.encode() if isinstance(text, str) else text)

    def err(self, text: str | bytes) -> None:
        send(self.sock, b"R", text.encode() if isinstance(text, str) else text)


@dataclass
class Faults:
    """What can go wrong, switched on by tests."""

    create_failures: int = 0  # the next N `vmadm create`s fail after validation
    create_message: str = "zfs clone of the image failed: out of space"
    create_leaves_failed: bool = False  # ... leaving the VM behind in state `failed`
    stuck: set[str] = field(default_factory=set)  # VMs (uuid, alias or "*") that never leave `stopping`
    stuck_seconds: float = 1.0  # how long a stop or delete of a stuck VM hangs before it fails
    drops: list[list] = field(default_factory=list)  # [command prefix, "before"|"after", times left]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail_creates(self, n: int = 1, *, leave_failed: bool = False, message: str | None = None) -> None:
        with self.lock:
            self.create_failures, self.create_leaves_failed = n, leave_failed
            self.create_message = message or self.create_message

    def take_create_failure(self) -> str | None:
        with self.lock:
            if self.create_failures <= 0:
                return None
            self.create_failures -= 1
            return self.create_message

    def stick(self, target: str = "*") -> None:
        with self.lock:
            self.stuck.add(target)

    def unstick(self) -> None:
        with self.lock:
            self.stuck.clear()

    def is_stuck(self, vm: VmRecord) -> bool:
        with self.lock:
            return bool(self.stuck & {"*", vm.uuid, str(vm.obj.get("alias"))})

    def drop_ssh(self, prefix: str, *, when: str = "before", times: int = 1) -> None:
        """Drop the SSH connection of the next `times` commands starting with `prefix`, before the
        command runs or after it ran (its output lost, its effect done)."""
        assert when in ("before", "after")
        with self.lock:
            self.drops.append([prefix, when, times])

    def take_drop(self, line: str) -> str | None:
        with self.lock:
            for d in self.drops:
                if line.startswith(d[0]) and d[2] > 0:
                    d[2] -= 1
                    return d[1]
        return None


class GlobalZoneEmulator:
    def __init__(
        self,
        workdir: Path,
        *,
        netns: str | None,
        nic_tags: dict[str, str],
        backing: Any = None,
        zones: Any = None,
        hostname: str = "gz-emu",
        live_image: str = "20260306T044811Z",
    ):
        self.workdir = Path(workdir)
        self.root = self.workdir / "root"
        for d in ("var/tmp", "zones", "dev/zvol/rdsk/zones", "var/imgadm/images"):  # what a fresh host has
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.socket_path = self.workdir / "gz.sock"
        self.netns, self.bridges, self.backing = netns, dict(nic_tags), backing
        self.zones = zones  # what runs booted lx zones (zones.ZoneBacking); None: the backing's stub, if any
        self.hostname, self.live_image = hostname, live_image
        self.bhyve_max_vcpus = 32  # sysinfo's "Bhyve Max Vcpus" (a test may lower it)
        self.server_uuid = str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, hostname))
        self.vmadm, self.imgadm = Vmadm(self), Imgadm(self)
        self.faults = Faults()
        self.commands: list[str] = []  # every command line run, in order
        self.dd_bytes = 0  # what `dd` wrote, all commands together
        self.internal_errors: list[str] = []
        self._zoneid = 0
        self._zoneid_lock = threading.Lock()
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        gz = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                gz.serve(self.request)

        self.socket_path.unlink(missing_ok=True)
        self._server = socketserver.ThreadingUnixStreamServer(str(self.socket_path), Handler)
        self._server.daemon_threads = True
        os.chmod(self.socket_path, 0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="gz-emulator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and halt every guest still running (the host powers off); files stay for the test."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for vm in list(self.vmadm.vms.values()):
            with vm.lock:
                if vm.guest is not None:
                    vm.backing.stop(vm.guest)
                    vm.guest = None

    def next_zoneid(self) -> int:
        with self._zoneid_lock:
            self._zoneid += 1
            return self._zoneid

    # -- one SSH command -----------------------------------------------------------------------------------
    def serve(self, sock: socket.socket) -> None:
        try:
            kind, data = recv(sock)
        except EOFError:
            return
        if kind != b"H":
            return
        line = json.loads(data)["command"]
        self.commands.append(line)
        io = Io(sock)
        when = self.faults.take_drop(line)
        try:
            if when == "before":
                send(sock, b"K")
                return
            try:
                code = self.run(line, io)
            except Exception as exc:  # a bug of the emulator: say so, loudly, in the test too
                self.internal_errors.append(f"{line}: {exc!r}")
                io.err(f"emulator: internal error: {exc!r}\n")
                code = 1
            send(sock, b"K" if when == "after" else b"X", b"" if when == "after" else struct.pack("!i", code))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            pass  # the SSH session went away meanwhile

    def run(self, line: str, io: Io) -> int:
        raw = shlex.shlex(line, posix=False, punctuation_chars=True)  # quotes kept: a quoted ";" is a word
        raw.whitespace_split = True
        try:
            operators = [tok for tok in raw if SHELL_OPERATORS.match(tok)]
            argv = shlex.split(line)
        except ValueError as exc:
            io.err(f"sh: syntax error: {exc}\n")
            return 2
        if operators:
            io.err(f"emulator: shell syntax is not emulated (one simple command per login): {line}\n")
            return 2
        if not argv:
            return 0
        name = argv[0].rsplit("/", 1)[-1]
        if name in ("vmadm", "imgadm"):
            return getattr(self, name).main(argv[1:], io)
        handler = getattr(self, f"cmd_{name}", None)
        if handler is None:
            io.err(f"sh: {argv[0]}: not found\n")
            return 127
        return handler(argv[1:], io)

    # -- files ----------------------------------------------------------------------------------------------
    def path(self, gz_path: str) -> Path:
        norm = os.path.normpath(gz_path)
        if not norm.startswith("/") or not any((norm + "/").startswith(d) for d in GZ_DIRS):
            raise FileNotFoundError(f"{gz_path}: not a path the emulated global zone has (only {', '.join(GZ_DIRS)})")
        return self.root / norm.lstrip("/")

    def read_file(self, gz_path: str) -> str:
        try:
            return self.path(gz_path).read_text()
        except OSError as exc:
            raise FileNotFoundError(f"{gz_path}: {exc.strerror or exc}") from None

    def write_file(self, gz_path: str, text: str) -> None:
        p = self.path(gz_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def make_zvol(self, gz_path: str, size_mib: int) -> None:
        p = self.path(gz_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as fh:
            fh.truncate(size_mib << 20)

    def make_clone(self, gz_path: str, image_file: Path) -> None:
        """`zfs clone` of an image's @final: a qcow2 overlay on the image's raw bytes."""
        p = self.path(gz_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        proc.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image_file), "-F", "raw", str(p)],
            what="qemu-img create (zfs clone)",
        )

    def remove_zvol(self, gz_path: str) -> None:
        p = self.path(gz_path)
        p.unlink(missing_ok=True)
        if p.parent.name != "zones" and p.parent.is_dir() and not any(p.parent.iterdir()):
            p.parent.rmdir()  # a bhyve VM's zones/<uuid>/ of its disks

    @staticmethod
    def zfs_send(zvol: Path, stream: Path) -> None:
        """An uncompressed `zfs send` of a zvol, as the emulator writes one: a qcow2 of its bytes
        (like a send stream, it carries the blocks that hold data, not the holes; a cloned zvol, a
        qcow2 overlay here, is read through its origin as zfs send reads a clone)."""
        with open(zvol, "rb") as fh:
            fmt = "qcow2" if fh.read(4) == b"QFI\xfb" else "raw"
        proc.run(
            ["qemu-img", "convert", "-q", "-f", fmt, "-O", "qcow2", str(zvol), str(stream)],
            timeout=1800,
            what="qemu-img convert (zfs send)",
        )

    @staticmethod
    def zfs_receive(stream: Path, zvol: Path) -> None:
        """`zfs receive` of a stream zfs_send wrote: the zvol's raw bytes (sparse)."""
        proc.run(
            ["qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", str(stream), str(zvol)],
            timeout=1800,
            what="qemu-img convert (zfs receive)",
        )

    def nic_tags(self) -> list[str]:
        return list(self.bridges)

    # -- the other commands -----------------------------------------------------------------------------------
    def cmd_true(self, args: list[str], io: Io) -> int:
        return 0

    def sysinfo(self) -> dict[str, Any]:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
        mem_kib = int(
            next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        )
        cpus = os.cpu_count() or 1
        virt = "vmx" if "vmx" in flags else "svm" if "svm" in flags else "none"
        nics = {
            "e1000g0": {"MAC Address": "52:54:00:00:00:01", "ip4addr": "", "Link Status": "up", "NIC Names": ["admin"]}
        }
        for i, tag in enumerate(t for t in self.bridges if t != "admin"):
            nics[f"vioif{i}"] = {
                "MAC Address": f"52:54:00:00:01:{i:02x}",
                "ip4addr": "",
                "Link Status": "up",
                "NIC Names": [tag],
            }
        return {
            "Live Image": self.live_image,
            "System Type": "SunOS",
            "Boot Time": int(time.time()) - 3600,
            "SDC Version": "7.0",
            "Manufacturer": "lab",
            "Product": "SmartOS global zone emulator",
            "Serial Number": self.server_uuid,
            "SKU Number": "",
            "HW Version": model,
            "HW Family": "",
            "Setup": "false",
            "VM Capable": True,
            "Bhyve Capable": True,
            "Bhyve Max Vcpus": self.bhyve_max_vcpus,
            "HVM API": True,
            "CPU Type": model,
            "CPU Virtualization": virt,
            "CPU Physical Cores": 1,
            "CPU Socket Count": 1,
            "CPU Core Count": cpus,
            "CPU Online Count": cpus,
            "CPU Count": cpus,
            "CPU Total Cores": cpus,
            "Admin NIC Tag": "admin",
            "UUID": self.server_uuid,
            "Hostname": self.hostname,
            "MiB of Memory": mem_kib // 1024,
            "Zpool": "zones",
            "Zpool Disks": "c0t0d0",
            "Zpool Creation": 1700000000,
            "Zpool Size in GiB": 100,
            "Zpool Encrypted": False,
            "Disks": 1,
            "Boot Parameters": {"console": "ttyb"},
            "Psrinfo": {"smt_enabled": False},
            "Network Interfaces": nics,
            "Virtual Network Interfaces": {},
            "Link Aggregations": {},
        }

    def cmd_sysinfo(self, args: list[str], io: Io) -> int:
        if any(a not in ("-f", "-u") for a in args):
            io.err("sysinfo: the emulator prints JSON only (-p is not emulated)\n")
            return 2
        io.out(json.dumps(self.sysinfo(), indent=2) + "\n")
        return 0

    def cmd_arp(self, args: list[str], io: Io) -> int:
        if args != ["-an"]:
            io.err("arp: the emulator knows `arp -an` only\n")
            return 2
        rows = []
        if self.netns:
            res = proc.run(["ip", "-n", self.netns, "-4", "neigh", "show"], check=False)
            for line in res.stdout.splitlines():
                m = re.match(r"^(\S+) dev (\S+) lladdr (\S+)", line)
                if m and "FAILED" not in line and "INCOMPLETE" not in line:
                    rows.append((m.group(2), m.group(1), m.group(3)))
        leases = {**(getattr(self.backing, "leases", None) or {}), **(getattr(self.zones, "leases", None) or {})}
        for mac, ip in leases.items():
            rows.append(("vnic0", ip, mac))
        io.out(
            "\nNet to Media Table: IPv4\nDevice   IP Address               Mask      Flags      Phys Addr\n"
            "------ -------------------- --------------- -------- ---------------\n"
            + "".join(f"{dev:<6} {ip:<20} 255.255.255.255          {_illumos_mac(mac)}\n" for dev, ip, mac in rows)
        )
        return 0

    def cmd_cat(self, args: list[str], io: Io) -> int:
        """Files the global zone has; a zone's own files are under its zonepath's root/."""
        code = 0
        for a in args:
            try:
                io.out(self.read_file(a))
            except FileNotFoundError:
                io.err(f"cat: cannot open {a}: No such file or directory\n")
                code = 2
        return code

    def cmd_rm(self, args: list[str], io: Io) -> int:
        force = "-f" in args
        code = 0
        for a in (a for a in args if a != "-f"):
            try:
                p = self.path(a)
                if not a.startswith("/var/tmp/"):
                    raise FileNotFoundError(a)
                p.unlink()
            except FileNotFoundError:
                if not force:
                    io.err(f"rm: {a}: No such file or directory\n")
                    code = 1
        return code

    def cmd_dd(self, args: list[str], io: Io) -> int:
        """illumos dd(1) with of=, if=, bs= and seek= (in bs blocks; only decimal numbers here):
        without seek= a file is truncated, with it cut at seek x bs (a device is left as it is),
        then written from there; a block read short (a pipe) is written short, as dd does."""
        ops = dict(a.split("=", 1) for a in args if "=" in a)
        if set(ops) - {"of", "bs", "if", "seek"} or len(ops) != len(args) or "of" not in ops:
            io.err("dd: the emulator takes of=PATH [bs=N] [seek=N] [if=PATH] only\n")
            return 2
        for key in ("bs", "seek"):
            if not ops.get(key, "1").isdigit():
                io.err(f'dd: bad numeric argument: "{ops[key]}"\n')
                return 2
        bs, seek = int(ops.get("bs", "512")), int(ops.get("seek", "0"))
        if bs == 0:
            io.err("dd: buffer sizes cannot be zero\n")
            return 2
        try:
            target = self.path(ops["of"])
            source = open(self.path(ops["if"]), "rb") if "if" in ops else None
        except FileNotFoundError as exc:
            io.err(f"dd: {exc}\n")
            return 1
        zvol = ops["of"].startswith("/dev/zvol/")
        if zvol and not target.is_file():
            io.err(f"dd: {ops['of']}: open: No such file or directory\n")
            return 1
        if zvol:
            with open(target, "rb") as fh:
                if fh.read(4) == b"QFI\xfb":
                    io.err("emulator: dd onto a cloned zvol is not emulated\n")
                    return 2
        limit = target.stat().st_size if zvol else None
        chunks = iter(lambda: source.read(CHUNK), b"") if source else io.stdin_chunks()
        start = seek * bs
        written = 0
        with open(target, "r+b" if zvol or (seek and target.is_file()) else "wb") as fh:
            if not zvol:
                fh.truncate(start)
            fh.seek(start)
            for chunk in chunks:
                if limit is not None and start + written + len(chunk) > limit:
                    io.err(
                        "dd: unexpected short write, wrote 0 bytes, expected ...\n"
                        "dd: write error: No space left on device\n"
                    )
                    return 1
                if chunk.count(0) == len(chunk):
                    fh.seek(len(chunk), os.SEEK_CUR)  # zvols are sparse: holes stay holes
                else:
                    fh.write(chunk)
                written += len(chunk)
            if not zvol:
                fh.truncate(start + written)
        if source:
            source.close()
        self.dd_bytes += written
        io.err(
            f"{written // bs}+{1 if written % bs else 0} records in\n{written // bs}+{1 if written % bs else 0} "
            f"records out\n"
        )
        return 0


def _illumos_mac(mac: str) -> str:
    """illumos prints MAC octets without leading zeros."""
    return ":".join(format(int(p, 16), "x") for p in mac.split(":"))
