"""What runs behind a started bhyve- or KVM-brand VM of the emulator.

QemuBacking: a real QEMU guest of the VM's disk (a clone of the published golden image), in the
test's network namespace with a tap on the bridge of the VM's nic_tag, booted as the brand boots
it: by firmware (bhyve `bootrom` bios = SeaBIOS, uefi = OVMF; the KVM brand SeaBIOS), the cell's
vCPUs, RAM, disk model (virtio-blk, AHCI, NVMe; the KVM brand's ide and scsi = QEMU's PIIX IDE and
LSI 53C895A, as SmartOS's QEMU attaches `if=scsi`) and NIC model. Static addresses reach the guest
the way they do on SmartOS: a bhyve VM of an image tagged for NoCloud gets SmartOS's cidata disk
(FAT, network-config version 2 built from its nics, as smartos-live's cloudinit/nocloud.js
writes it); a KVM VM gets its address by DHCP (SmartOS's QEMU answers DHCP with the NIC's ip;
here a dnsmasq in the namespace holds one host entry per KVM NIC). DHCP nics get a dynamic lease
from the same dnsmasq (the network's DHCP server). `stop` of the guest is lab.backends.local's
stop_process; ACPI power-off goes through QMP (the golden guest ignores it: logind is masked).

StubBacking: no guest at all, for the fast lane: the VM's address answers with an SSH banner
(a listener in the namespace), so the backend's readiness check has something to see.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.local import TCG_THREADS

from lab import images, proc
from lab.backends.local import QEMU, machine_args, stop_process
from lab.model import Accel, ImageRef

OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
NIC_DEVICE = {"virtio": "virtio-net-pci", "e1000": "e1000", "rtl8139": "rtl8139"}
DISK_DEVICE = {
    "virtio": ["-device", "virtio-blk-pci,drive=d0,bootindex=0"],
    "ahci": ["-device", "ahci,id=ahci0", "-device", "ide-hd,drive=d0,bus=ahci0.0,bootindex=0"],
    "nvme": ["-device", "nvme,drive=d0,serial=lab0,bootindex=0"],
    "ide": ["-device", "ide-hd,drive=d0,bus=ide.0,bootindex=0"],
    "scsi": ["-device", "lsi53c895a,id=scsi0", "-device", "scsi-hd,drive=d0,bus=scsi0.0,bootindex=0"],
}


@dataclass
class Guest:
    uuid: str
    process: subprocess.Popen
    tap: str
    vmdir: Path
    mac: str

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def console(self) -> Path:
        return self.vmdir / "console.log"


def network_config(nics: list[dict[str, Any]], resolvers: list[str]) -> str:
    """network-config version 2 of a VM's nics, as SmartOS writes it on the NoCloud disk."""
    lines = ["version: 2", "ethernets:"]
    for nic in nics:
        ips = nic.get("ips") or []
        lines += [
            f"  {nic.get('interface', 'eth0')}:",
            "    match:",
            f'      macaddress: "{nic["mac"].lower()}"',
            f"    set-name: {nic.get('interface', 'eth0')}",
        ]
        if "dhcp" in ips:
            lines.append("    dhcp4: true")
        static = [ip for ip in ips if ip not in ("dhcp", "addrconf")]
        if static:
            lines += ["    addresses:"] + [f"      - {ip}" for ip in static]
        if nic.get("primary") and nic.get("gateways"):
            lines += [f"    gateway4: {g}" for g in nic["gateways"] if ":" not in g]
        if nic.get("primary") and resolvers:
            lines += ["    nameservers:", "      addresses:"] + [f"        - {r}" for r in resolvers]
    return "\n".join(lines) + "\n"


def make_cidata(path: Path, vm: dict[str, Any]) -> None:
    """SmartOS's NoCloud disk: 16 MiB FAT labelled CIDATA with meta-data, user-data, network-config."""
    files = {
        "meta-data": f"# cloud-init meta-data\ninstance-id: {vm['uuid']}\n"
        f"local-hostname: {vm.get('hostname') or vm.get('alias') or vm['uuid']}\n",
        "user-data": (vm.get("customer_metadata") or {}).get("cloud-init:user-data", "#cloud-config\n{}\n"),
        "network-config": network_config(vm.get("nics") or [], vm.get("resolvers") or []),
    }
    path.unlink(missing_ok=True)
    proc.run(["mkfs.fat", "-C", "-F", "16", "-n", "CIDATA", str(path), str(16 * 1024)], what="mkfs.fat (cidata)")
    staging = path.with_suffix(".d")
    staging.mkdir(exist_ok=True)
    for name, text in files.items():
        (staging / name).write_text(text)
    proc.run(
        ["mcopy", "-i", str(path), *[str(staging / n) for n in files], "::"],
        env={"MTOOLS_SKIP_CHECK": "1"},
        what="mcopy (cidata)",
    )
    shutil.rmtree(staging)


class Dnsmasq:
    """The DHCP server on a bridge of the namespace: dynamic leases, plus one fixed host per KVM NIC."""

    def __init__(self, workdir: Path, *, netns: str, bridge: str, subnet: str):
        self.dir = Path(workdir) / "dnsmasq"
        self.netns, self.bridge, self.subnet = netns, bridge, subnet
        self.hosts: dict[str, tuple[str, str]] = {}  # mac -> (ip, gateway)
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write()
        with open(self.dir / "log", "ab") as log:
            self.process = proc.spawn(
                [
                    "dnsmasq",
                    "--keep-in-foreground",
                    "--conf-file=/dev/null",
                    "--port=0",
                    "--bind-interfaces",
                    f"--interface={self.bridge}",
                    "--except-interface=lo",
                    "--user=root",
                    "--group=root",
                    f"--pid-file={self.dir / 'pid'}",
                    f"--dhcp-range={self.subnet}.150,{self.subnet}.199,255.255.255.0,1h",
                    f"--dhcp-hostsfile={self.dir / 'hosts'}",
                    f"--dhcp-optsfile={self.dir / 'opts'}",
                    f"--dhcp-leasefile={self.dir / 'leases'}",
                    "--log-facility=-",
                ],
                netns=self.netns,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def _write(self) -> None:
        (self.dir / "hosts").write_text(
            "".join(f"{mac},set:h{i},{ip}\n" for i, (mac, (ip, _)) in enumerate(self.hosts.items()))
        )
        (self.dir / "opts").write_text(
            "".join(f"tag:h{i},option:router,{gw}\n" for i, (_, (_, gw)) in enumerate(self.hosts.items()) if gw)
        )

    def fix(self, mac: str, ip: str, gateway: str) -> None:
        self.hosts[mac] = (ip, gateway)
        self._reload()

    def forget(self, mac: str) -> None:
        if self.hosts.pop(mac, None) is not None:
            self._reload()

    def _reload(self) -> None:
        self._write()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None


class QemuBacking:
    def __init__(
        self,
        image: ImageRef,
        *,
        workdir: Path,
        netns: str,
        bridges: dict[str, str],
        subnet: str,
        accel: Accel = Accel.TCG,
        tcg_threads: str = TCG_THREADS,
    ):
        self.image, self.workdir, self.netns, self.bridges, self.accel = image, Path(workdir), netns, bridges, accel
        # the test suite's choice for its guests: support.local.TCG_THREADS
        self.tcg_threads = tcg_threads
        self.dhcp = Dnsmasq(self.workdir, netns=netns, bridge=next(iter(bridges.values())), subnet=subnet)
        self._n = 0

    def __enter__(self) -> QemuBacking:
        self.dhcp.start()
        return self

    def __exit__(self, *exc) -> None:
        self.dhcp.stop()

    def start(self, vm, boot_disk: Path) -> Guest:
        obj = vm.get()
        nic = obj["nics"][0]
        disk = next(d for d in obj["disks"] if d.get("boot"))
        uefi = obj["brand"] == "bhyve" and obj.get("bootrom") == "uefi"
        images.require_boot(self.image, "uefi" if uefi else "bios", f"{obj['brand']} VM {vm.uuid}")
        vmdir = self.workdir / "guests" / vm.uuid
        vmdir.mkdir(parents=True, exist_ok=True)
        self._n += 1
        tap = f"vnic{self._n}"
        with open(boot_disk, "rb") as fh:  # a clone of an image is a qcow2 overlay; a zvol filled by dd raw
            fmt = "qcow2" if fh.read(4) == b"QFI\xfb" else "raw"
        argv = [
            QEMU,
            "-name",
            f"{obj['alias'] or vm.uuid},process={obj['alias'] or vm.uuid}",
            *machine_args(self.accel, self.tcg_threads),
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-smp",
            str(obj["vcpus"]),
            "-m",
            str(obj["ram"]),
            "-drive",
            f"file={boot_disk},if=none,id=d0,format={fmt},cache=writeback",
            *DISK_DEVICE[disk["model"]],
            "-netdev",
            f"tap,id=n0,ifname={tap},script=no,downscript=no",
            "-device",
            f"{NIC_DEVICE[nic['model']]},netdev=n0,mac={nic['mac']}",
            "-serial",
            f"file:{vmdir / 'console.log'}",
            "-qmp",
            f"unix:{vmdir / 'qmp.sock'},server=on,wait=off",
            "-pidfile",
            str(vmdir / "qemu.pid"),
        ]
        if vm.nocloud:
            make_cidata(vmdir / "cidata.img", obj)
            argv += [
                "-drive",
                f"file={vmdir / 'cidata.img'},if=none,id=d1,format=raw,readonly=on",
                "-device",
                "virtio-blk-pci,drive=d1",
            ]
        if uefi:
            shutil.copyfile(OVMF_VARS, vmdir / "efivars.fd")
            argv += [
                "-drive",
                f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
                "-drive",
                f"if=pflash,format=raw,unit=1,file={vmdir / 'efivars.fd'}",
            ]
        if self.accel is Accel.KVM:
            argv += ["-cpu", "host"]
        static = next((ip for ip in nic.get("ips", []) if ip not in ("dhcp", "addrconf")), "")
        if obj["brand"] == "kvm" and static:
            self.dhcp.fix(nic["mac"], static.split("/")[0], (nic.get("gateways") or [""])[0])
        proc.run(["ip", "-n", self.netns, "tuntap", "add", tap, "mode", "tap"], what="tap add")
        try:
            proc.run(
                ["ip", "-n", self.netns, "link", "set", tap, "master", self.bridges[nic["nic_tag"]], "up"],
                what="tap up",
            )
            with open(vmdir / "qemu.log", "wb") as log:
                p = proc.spawn(argv, netns=self.netns, stdout=log, stderr=subprocess.STDOUT)
        except BaseException:
            proc.run(["ip", "-n", self.netns, "link", "del", tap], check=False)
            self.dhcp.forget(nic["mac"])
            raise
        return Guest(vm.uuid, p, tap, vmdir, nic["mac"])

    def powerdown(self, guest: Guest) -> None:
        qmp(guest.vmdir / "qmp.sock", "system_powerdown")

    def running(self, guest: Guest) -> bool:
        return guest.process.poll() is None

    def stop(self, guest: Guest) -> None:
        stop_process(guest.process)
        proc.run(["ip", "-n", self.netns, "link", "del", guest.tap], check=False)
        self.dhcp.forget(guest.mac)
        shutil.rmtree(guest.vmdir, ignore_errors=True)


def qmp(sock_path: Path, command: str, timeout: float = 5.0) -> dict | None:
    """One QMP command after the capabilities handshake; None if QEMU does not answer."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout)
            s.connect(str(sock_path))
            f = s.makefile("rwb")
            f.readline()  # greeting
            for cmd in ("qmp_capabilities", command):
                f.write(json.dumps({"execute": cmd}).encode() + b"\n")
                f.flush()
                while True:
                    reply = json.loads(f.readline())
                    if "return" in reply or "error" in reply:
                        break
            return reply
    except (OSError, ValueError):
        return None


class StubBacking:
    """No guest: the VM's address answers with an SSH banner (enough for the backend's readiness)."""

    backs_zones = True  # a zone's sshd is a stub too (there is no zone runtime here)
    SERVER = (
        "import socket,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        "s.bind((sys.argv[1],22));s.listen(16)\nwhile True:\n"
        " c,_=s.accept();c.sendall(b'SSH-2.0-stub\\r\\n');c.close()\n"
    )

    def __init__(self, *, netns: str, bridges: dict[str, str], subnet: str):
        self.netns, self.bridges, self.subnet = netns, bridges, subnet
        self.leases: dict[str, str] = {}  # mac -> address of DHCP stubs (what `arp -an` shows)
        self._next = 150

    def __enter__(self) -> StubBacking:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def start(self, vm, boot_disk: Path | None) -> Guest:
        obj = vm.get()
        nic = obj["nics"][0]
        static = next((ip for ip in nic.get("ips", []) if ip not in ("dhcp", "addrconf")), "")
        ip = static.split("/")[0] if static else f"{self.subnet}.{self._next}"
        if not static:
            self._next += 1
            self.leases[nic["mac"]] = ip
        bridge = self.bridges[nic["nic_tag"]]
        proc.run(["ip", "-n", self.netns, "addr", "add", f"{ip}/32", "dev", bridge])
        p = proc.spawn([sys.executable, "-c", self.SERVER, ip], netns=self.netns)
        return Guest(vm.uuid, p, f"{bridge}|{ip}", Path(os.devnull), nic["mac"])

    def powerdown(self, guest: Guest) -> None:
        pass  # like the golden guest: ACPI power-off is ignored

    def running(self, guest: Guest) -> bool:
        return guest.process.poll() is None

    def stop(self, guest: Guest) -> None:
        stop_process(guest.process)
        bridge, ip = guest.tap.split("|")
        proc.run(["ip", "-n", self.netns, "addr", "del", f"{ip}/32", "dev", bridge], check=False)
        self.leases.pop(guest.mac, None)
