"""Real QEMU guests behind the emulator's VMs, so a lab run against the emulator measures real guests.

The "node" is a network namespace the test made, holding the bridge (`vmbr0`) that net0 names; every
started VM is a QEMU of the golden image in that namespace, with a tap on the bridge. QEMU is built
and stopped with lab.backends.local's own helpers (qemu_argv, boot_files, stop_process), so the
guests are exactly what the local backend boots.

What the emulator translates, and why:
- disks: a linked clone is a qcow2 overlay on the template's disk, a full clone a copy;
- `ipconfig0` (cloud-init on real PVE): the golden image has no cloud-init; it configures eth0 from
  `lab.ip=`/`lab.gw=` on the kernel command line, so the static address goes there. `ip=dhcp` gets an
  address of the bridge's subnet the same way (the emulator plays the DHCP server);
- the bootloader: the golden image is a bare filesystem booted by direct kernel boot; QEMU gets the
  image's kernel and initrd (what a bootable template disk would carry itself);
- the guest agent: the image has no qemu-guest-agent. network-get-interfaces answers "not running"
  until the guest printed LAB-READY on its serial console, then returns what the real guest reports
  (`ip -j addr`, asked once over SSH with the lab key, the stand-in for the agent's virtio channel);
- `sshkeys` (cloud-init) is validated by the API but not applied: the image already trusts the lab key.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from lab import proc
from lab.backends.local import READY_MARKER, boot_files, qemu_argv, stop_process
from lab.errors import LabError
from lab.guest import Guest
from lab.model import Accel, DiskBus, ImageRef, NicModel, VmSpec

NET0 = re.compile(r"^(?P<model>[a-z0-9]+)=(?P<mac>[0-9A-Fa-f:]{17})")


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

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def console(self) -> Path:
        return self.vmdir / "console.log"


class QemuBacking:
    def __init__(self, image: ImageRef, *, netns: str, workdir: Path, key: Path, subnet: str,
                 bridge: str = "vmbr0", prefix: int = 24, accel: Accel = Accel.TCG):
        self.image, self.netns, self.workdir, self.key = image, netns, Path(workdir), Path(key)
        self.subnet, self.bridge, self.prefix, self.accel = subnet, bridge, prefix, accel
        self.gateway = f"{subnet}.1"
        self.workdir.mkdir(parents=True, exist_ok=True)

    def dhcp_address(self, vmid: int) -> str:
        return f"{self.subnet}.{200 + vmid % 50}"

    def make_disk(self, dst: Path, src: Path, *, linked: bool) -> None:
        if linked:
            proc.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(Path(src).resolve()), "-F", "qcow2",
                      str(dst)], what="qemu-img create (linked clone)")
        else:
            proc.run(["cp", "--reflink=auto", "--sparse=always", str(src), str(dst)], timeout=600,
                     what="full clone copy")

    def start(self, vmid: int, config: dict, disk: Path, *, ip: str, prefix: int, gateway: str) -> QemuGuest:
        m = NET0.match(str(config.get("net0", "")))
        if m is None:
            raise LabError(f"VM {vmid}: net0 {config.get('net0')!r} has no model=MAC")
        vcpus = int(config.get("cores", 1)) * int(config.get("sockets", 1))
        memory = int(str(config.get("memory", 512)).split("=")[-1])
        name = str(config.get("name") or f"vm-{vmid}")
        spec = VmSpec(name=name, run_id="", cell_id="", image=self.image, nic=NicModel(m.group("model")),
                      vcpus=vcpus, memory_mib=memory, disk_bus=DiskBus.SCSI, ip=ip, mac=m.group("mac").lower())
        vmdir = self.workdir / f"vm-{vmid}"
        vmdir.mkdir(parents=True, exist_ok=False)
        (vmdir / "disk.qcow2").symlink_to(Path(disk).resolve())  # qemu_argv's disk path
        tap = f"pvetap{vmid}"
        proc.run(["ip", "-n", self.netns, "tuntap", "add", tap, "mode", "tap"], what="tap add")
        try:
            proc.run(["ip", "-n", self.netns, "link", "set", tap, "master", self.bridge, "up"], what="tap up")
            kernel, initrd, cmdline = boot_files(self.image)
            argv = qemu_argv(spec, accel=self.accel, vmdir=vmdir, kernel=kernel, initrd=initrd, cmdline=cmdline,
                             tap=tap, gateway=gateway, prefix=prefix)
            with open(vmdir / "qemu.log", "wb") as log:
                p = proc.spawn(argv, netns=self.netns, stdout=log, stderr=subprocess.STDOUT)
        except BaseException:
            proc.run(["ip", "-n", self.netns, "link", "del", tap], check=False)
            raise
        return QemuGuest(vmid, name, p, tap, vmdir, spec.mac, ip)

    def stop(self, guest: QemuGuest) -> None:
        stop_process(guest.process)
        proc.run(["ip", "-n", self.netns, "link", "del", guest.tap], check=False)
        for f in guest.vmdir.iterdir():
            f.unlink()
        guest.vmdir.rmdir()

    def interfaces(self, guest: QemuGuest) -> list[dict] | None:
        """The guest agent's network-get-interfaces answer from the real guest; None while it boots."""
        with guest.lock:
            if guest.interfaces is not None:
                return guest.interfaces
            try:
                if guest.process.poll() is not None or READY_MARKER not in guest.console.read_bytes():
                    return None
            except FileNotFoundError:
                return None
            with Guest(guest.ip, key=self.key, netns=self.netns) as ssh:
                try:
                    out = ssh.run("ip -j addr show", timeout=20).stdout
                except LabError:
                    return None  # sshd not answering yet: the "agent" is not up yet
            guest.interfaces = agent_interfaces(json.loads(out))
            return guest.interfaces


def agent_interfaces(ip_json: list[dict]) -> list[dict]:
    """`ip -j addr show` -> qemu-guest-agent's guest-network-get-interfaces result."""
    out = []
    for link in ip_json:
        addrs = [{"ip-address": a["local"], "ip-address-type": "ipv4" if a.get("family") == "inet" else "ipv6",
                  "prefix": int(a.get("prefixlen", 0))}
                 for a in link.get("addr_info", []) if a.get("family") in ("inet", "inet6")]
        out.append({"name": link.get("ifname", ""), "hardware-address": link.get("address", ""),
                    "ip-addresses": addrs,
                    "statistics": {"rx-bytes": 0, "rx-packets": 0, "rx-errs": 0, "rx-dropped": 0,
                                   "tx-bytes": 0, "tx-packets": 0, "tx-errs": 0, "tx-dropped": 0}})
    return out
