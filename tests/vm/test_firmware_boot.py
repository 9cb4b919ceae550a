"""The golden image boots by firmware from its own disk, as a Proxmox VE template does (SeaBIOS,
i440fx, virtio-scsi, the cloud-init drive on ide2) and as a UEFI host does (OVMF; bhyve's
BHYVE_UEFI.fd is the same EDK2 firmware): GRUB, then the kernel with the image's command line and
no `lab.ip`. The address then comes from the NoCloud drive (network-config in the shape PVE writes)
or DHCP, and the QEMU guest agent answers on org.qemu.guest_agent.0 as PVE asks it.

Two real boots under QEMU: UEFI + cidata, SeaBIOS + DHCP (slirp's DHCP server, SSH forwarded on
127.0.0.1 only)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from pve_emulator.qemu import OVMF_CODE, OVMF_VARS, guest_agent

from lab import proc
from lab.backends.local import QEMU, READY_MARKER, lab_key, stop_process
from lab.guest import Guest
from lab.wait import wait_until

pytestmark = [pytest.mark.vm, pytest.mark.image]

MAC = "bc:24:11:5e:0a:21"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cidata(workdir: Path, extra_pubkey: str) -> Path:
    """A NoCloud drive as PVE makes it (genisoimage -R -V cidata) for net0 with
    ipconfig0=ip=10.0.2.50/24,gw=10.0.2.2 and sshkeys=<extra key>, ciuser=root."""
    d = workdir / "cidata"
    d.mkdir()
    (d / "network-config").write_text(
        "version: 1\nconfig:\n    - type: physical\n      name: eth0\n"
        f"      mac_address: {MAC.upper()}\n      subnets:\n        - type: static\n"
        "          address: 10.0.2.50/24\n          gateway: 10.0.2.2\n"
        "    - type: nameserver\n      address:\n      - 10.0.2.3\n"
    )
    (d / "user-data").write_text(
        "#cloud-config\nhostname: lab-fw\nmanage_etc_hosts: true\nuser: root\ndisable_root: False\n"
        f"ssh_authorized_keys:\n  - {extra_pubkey}\nchpasswd:\n  expire: False\npackage_upgrade: true\n"
    )
    (d / "meta-data").write_text("instance-id: 0123456789abcdef\n")
    iso = workdir / "cidata.iso"
    proc.run(["genisoimage", "-quiet", "-R", "-V", "cidata", "-o", iso, d], timeout=60, what="genisoimage")
    return iso


def _boot(golden, workdir: Path, *, uefi: bool, cidata: Path | None, guest_ip: str):
    disk = workdir / "disk.qcow2"
    proc.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(golden.path.resolve()), "-F", "qcow2", disk],
        what="qemu-img create",
    )
    port = _free_port()
    # UEFI: q35, as PVE recommends with OVMF (its ide2 is then a port of the ICH9 AHCI controller)
    argv = [
        QEMU,
        "-machine",
        f"{'q35' if uefi else 'pc'},accel=tcg",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-smp",
        "2",
        "-m",
        "1024",
        # PVE's scsihw=virtio-scsi-single + scsi0, boot order on the disk
        "-device",
        "virtio-scsi-pci,id=scsi0",
        "-drive",
        f"file={disk},if=none,id=d0,format=qcow2",
        "-device",
        "scsi-hd,drive=d0,bus=scsi0.0,bootindex=1",
        "-netdev",
        f"user,id=n0,hostfwd=tcp:127.0.0.1:{port}-{guest_ip}:22",
        "-device",
        f"virtio-net-pci,netdev=n0,mac={MAC},romfile=",
        "-chardev",
        f"socket,id=qga0,path={workdir / 'qga.sock'},server=on,wait=off",
        "-device",
        "virtio-serial-pci",
        "-device",
        "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
        "-serial",
        f"file:{workdir / 'console.log'}",
    ]
    if uefi:
        vars_copy = workdir / "OVMF_VARS.fd"
        shutil.copyfile(OVMF_VARS, vars_copy)
        argv += [
            "-drive",
            f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
            "-drive",
            f"if=pflash,format=raw,unit=1,file={vars_copy}",
        ]
    if cidata is not None:  # PVE's ide2: the secondary master (pc) or AHCI port 2 (q35), a CD-ROM
        argv += ["-drive", f"file={cidata},if=ide,index=2,media=cdrom,format=raw,readonly=on"]
    assert "-kernel" not in argv
    t0 = time.monotonic()
    with open(workdir / "qemu.log", "wb") as log:  # QEMU has its own copy
        p = proc.spawn(argv, stdout=log, stderr=subprocess.STDOUT)
    return p, port, t0


def _ready(p, workdir: Path, t0: float) -> float:
    console = workdir / "console.log"

    def up():
        if p.poll() is not None:
            raise AssertionError(f"QEMU exited: {(workdir / 'qemu.log').read_text()[-500:]}")
        return console.exists() and READY_MARKER in console.read_bytes()

    def tail() -> str:  # what the guest got to, so a CI failure can be read without its workdir
        text = console.read_bytes().decode(errors="replace") if console.exists() else "(no console.log)"
        return "console tail: " + " | ".join(line.strip() for line in text.splitlines()[-25:] if line.strip())

    wait_until(up, timeout=600, what="LAB-READY after a firmware boot", interval=0.5, max_interval=2, detail=tail)
    return time.monotonic() - t0


def _qga(sock_path: Path, command: str, timeout: float = 120) -> dict:
    """A guest agent command, retried until the agent (started by udev after boot) answers."""
    return wait_until(
        lambda: guest_agent(sock_path, command, timeout=10),
        timeout=timeout,
        what=f"the guest agent to answer {command}",
        interval=1,
        max_interval=3,
    )


def _check(golden, workdir: Path, *, uefi: bool, cidata: bool) -> dict:
    extra = workdir / "extra_key"
    proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "cidata-key", "-f", extra], timeout=30)
    guest_ip = "10.0.2.50" if cidata else "10.0.2.15"  # cidata's static address, else slirp's DHCP lease
    iso = _cidata(workdir, extra.with_suffix(".pub").read_text().strip()) if cidata else None
    p, port, t0 = _boot(golden, workdir, uefi=uefi, cidata=iso, guest_ip=guest_ip)
    try:
        ready_s = _ready(p, workdir, t0)
        with Guest("127.0.0.1", port=port, key=lab_key()) as g:
            out = g.run(
                "cat /proc/cmdline; echo ---; test -d /sys/firmware/efi && echo efi || echo bios; "
                "ip -4 -o addr show dev eth0; journalctl -b -u lab-net -o cat | grep lab-net:",
                timeout=120,
            ).stdout
        login_s = time.monotonic() - t0
        cmdline, rest = out.split("---", 1)
        # GRUB booted it (BOOT_IMAGE), with the image's command line and no lab.ip
        assert "BOOT_IMAGE=/boot/vmlinuz-" in cmdline and f"root=LABEL={golden.manifest['root_label']}" in cmdline
        assert "lab.ip=" not in cmdline
        assert rest.split()[0] == ("efi" if uefi else "bios")
        assert f"inet {guest_ip}/24" in rest
        assert ("(cidata " in rest) if cidata else ("(dhcp)" in rest), rest
        if cidata:  # the user-data key works too; the lab key was not replaced
            with Guest("127.0.0.1", port=port, key=extra) as g2:
                assert g2.run("grep -c . /root/.ssh/authorized_keys", timeout=60).stdout.strip() == "2"
        assert _qga(workdir / "qga.sock", "guest-ping") == {"return": {}}
        ifaces = _qga(workdir / "qga.sock", "guest-network-get-interfaces")["return"]
        eth0 = next(i for i in ifaces if i.get("hardware-address") == MAC)
        assert guest_ip in [a["ip-address"] for a in eth0["ip-addresses"] if a["ip-address-type"] == "ipv4"]
        console = (workdir / "console.log").read_bytes()
        assert b"GNU GRUB" in console and b"Booting `Debian 12 lab (" in console  # GRUB's menu on the serial port
        return {"ready_s": round(ready_s, 1), "login_s": round(login_s, 1)}
    finally:
        stop_process(p)


@pytest.mark.skipif(not OVMF_CODE.exists(), reason="OVMF is not installed (apt install ovmf; `make setup`)")
def test_uefi_boot_takes_the_address_and_key_from_the_pve_cidata_drive(golden, workdir):
    assert "uefi" in golden.manifest["boot"]
    t = _check(golden, workdir, uefi=True, cidata=True)
    print(f"\nOVMF (UEFI) + cidata: LAB-READY after {t['ready_s']} s, first SSH command done after {t['login_s']} s")


def test_seabios_boot_falls_back_to_dhcp_and_the_agent_answers(golden, workdir):
    assert "bios" in golden.manifest["boot"]
    t = _check(golden, workdir, uefi=False, cidata=False)
    print(f"\nSeaBIOS + DHCP: LAB-READY after {t['ready_s']} s, first SSH command done after {t['login_s']} s")
