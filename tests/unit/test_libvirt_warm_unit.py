"""Warm start and host load on libvirt, without a hypervisor: the save image's header rewritten for
a clone, the clone's domain XML, the shape key, the guest-agent fix-ups, the plan's refusals, the
snapshot store on a directory, and the /proc/stat and kern.cp_time parsers on captured text."""

from __future__ import annotations

import json
import os
import struct
import time
import uuid
from dataclasses import replace
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from lab.backends.libvirt import saveimage, warm
from lab.backends.libvirt.agent import network_batch
from lab.backends.libvirt.backend import LibvirtBackend
from lab.backends.libvirt.checks import check_spec
from lab.backends.libvirt.domain import LEASE_NS, Placement, lease, render
from lab.backends.libvirt.hostload import parse_cp_time, parse_proc_stat
from lab.backends.libvirt.settings import Settings, capabilities, resolve
from lab.errors import BackendError, SettingError
from lab.model import DiskBus, ImageRef, NicModel, VmSpec

IMAGE = ImageRef(
    name="debian12",
    os="debian",
    path=Path("/img/debian12.qcow2"),
    digest="d" * 64,
    sha256="s" * 64,
    manifest={
        "paths": {"kernel": "debian12/vmlinuz", "initrd": "debian12/initrd.img"},
        "cmdline": "console=ttyS0 quiet",
        "guest_agent": True,
    },
)


def qemu_host(**extra):
    return resolve(
        "kvm",
        Settings(
            backend="libvirt",
            uri="qemu:///system",
            bridge="labbr0",
            subnet="10.78.5.0/24",
            gateway="10.78.5.1",
            **extra,
        ),
    )


def spec(**kw) -> VmSpec:
    base = dict(
        name="lab-r1-c1",
        run_id="r1",
        cell_id="c1",
        image=IMAGE,
        nic=NicModel.VIRTIO,
        vcpus=2,
        memory_mib=768,
        disk_bus=DiskBus.VIRTIO,
        start="warm",
        ip="10.78.5.10",
        expires_at=1_900_000_000,
    )
    base.update(kw)
    return VmSpec(**base)


# -- the save image -----------------------------------------------------------------------------------


def save_image(
    xml: str,
    cookie: str = "<cookie><cpu/></cookie>\n",
    data_len: int = 4096,
    stream: bytes = b"QEVM\x00\x00\x00\x03stream",
) -> bytes:
    """A save image as libvirt writes it: header, XML, NUL, cookie, zeros, migration stream."""
    text = xml.encode() + b"\0"
    data = (text + cookie.encode() + b"\0").ljust(data_len, b"\0")
    return saveimage.HEADER.pack(saveimage.MAGIC, 2, data_len, 1, 0, len(text), *(0,) * 14) + data + stream


def test_save_image_header_round_trip_and_clone_copy():
    blob = save_image("<domain><name>t</name></domain>")
    head = saveimage.parse(blob)
    assert head.xml == "<domain><name>t</name></domain>" and head.cookie == "<cookie><cpu/></cookie>\n"
    assert head.size == saveimage.HEADER.size + 4096 and blob[head.size :].startswith(b"QEVM")
    assert saveimage.data_length(blob[: saveimage.HEADER.size]) == 4096
    assert saveimage.SaveHeader.from_dict(json.loads(json.dumps(head.as_dict()))) == head

    copy = saveimage.with_xml(head, "<domain><name>a-longer-name</name></domain>")
    assert len(copy) == head.size  # the stream after it is copied unchanged, at the same offset
    again = saveimage.parse(copy + blob[head.size :])
    assert again.xml == "<domain><name>a-longer-name</name></domain>" and again.cookie == head.cookie
    magic, version, data_len, was_running, compressed, cookie_offset, *_ = struct.unpack_from("<16s19I", copy)
    assert (version, data_len, was_running, compressed) == (2, 4096, 1, 0)
    assert cookie_offset == len("<domain><name>a-longer-name</name></domain>") + 1


def test_save_image_refusals():
    head = saveimage.parse(save_image("<domain/>", data_len=64))
    with pytest.raises(ValueError, match="does not fit"):
        saveimage.with_xml(head, "<domain>" + "x" * 100 + "</domain>")
    with pytest.raises(ValueError, match="bad magic"):
        saveimage.parse(b"NotASaveImage..." + bytes(200))
    with pytest.raises(ValueError, match="header bytes"):
        saveimage.data_length(b"LibvirtQemudSave")
    bad_version = bytearray(save_image("<domain/>"))
    bad_version[16:20] = struct.pack("<I", 3)
    with pytest.raises(ValueError, match="version 3"):
        saveimage.parse(bytes(bad_version))
    with pytest.raises(ValueError, match="cut short"):
        saveimage.parse(save_image("<domain/>")[:200])


def test_clone_xml_carries_the_clones_identity_and_keeps_the_devices():
    host = qemu_host()
    tspec = replace(spec(), name="lab-warm-0123456789abcdef", cell_id="warm-snapshot", mac="52:54:00:aa:bb:cc")
    placement = Placement(
        uuid=str(uuid.uuid4()),
        disk_ref="file:/d/lab-warm-0123456789abcdef.qcow2",
        disk_path="/d/lab-warm-0123456789abcdef.qcow2",
        console="/d/lab-warm-0123456789abcdef.console.log",
        mac="52:54:00:aa:bb:cc",
    )
    template = render(host.model_copy(update={"guest_agent": True}), tspec, placement, "/img", genid=str(uuid.uuid4()))
    cell = Placement(
        uuid=str(uuid.uuid4()),
        disk_ref="file:/d/lab-r1-c1.qcow2",
        disk_path="/d/lab-r1-c1.qcow2",
        console="/d/lab-r1-c1.console.log",
        mac="52:54:00:01:02:03",
    )
    genid = str(uuid.uuid4())
    ident = saveimage.Identity(
        name="lab-r1-c1",
        uuid=cell.uuid,
        genid=genid,
        lease=lease(host, spec(), cell, "lab-warm-x"),
        disk_path=cell.disk_path,
        disk_format="qcow2",
        console=cell.console,
        mac=cell.mac,
    )
    root = ET.fromstring(saveimage.clone_xml(template, ident, LEASE_NS))
    assert (
        root.findtext("name") == "lab-r1-c1" and root.findtext("uuid") == cell.uuid and root.findtext("genid") == genid
    )
    got = root.find(f"metadata/{{{LEASE_NS}}}lease").attrib
    assert got["run"] == "r1" and got["cell"] == "c1" and got["warm"] == "lab-warm-x" and got["disk"] == cell.disk_ref
    assert root.find("devices/disk/source").get("file") == cell.disk_path
    assert root.find("devices/interface/mac").get("address") == cell.mac
    assert {log.get("file") for log in root.iter("log")} == {cell.console}
    assert root.find("devices/channel/target").get("name") == "org.qemu.guest_agent.0"
    assert root.findtext("os/cmdline").endswith("lab.ip=10.78.5.10/24 lab.gw=10.78.5.1")  # the snapshot's kernel's
    with pytest.raises(ValueError, match="no lab lease"):
        saveimage.clone_xml("<domain><name>x</name><uuid>u</uuid><genid>g</genid></domain>", ident, LEASE_NS)


def test_network_fixups_are_one_ip_batch():
    batch = network_batch("10.78.5.11/24", "52:54:00:01:02:03", "10.78.5.1")
    assert batch.splitlines() == [
        "addr flush dev eth0",
        "link set eth0 down",
        "link set eth0 address 52:54:00:01:02:03",
        "addr add 10.78.5.11/24 dev eth0",
        "link set eth0 up",
        "route replace default via 10.78.5.1 dev eth0",
    ]
    assert "route" not in network_batch("10.78.5.11/24", "52:54:00:01:02:03")
    with pytest.raises(ValueError):
        network_batch("10.78.5.11; reboot", "52:54:00:01:02:03")


# -- the shape key ------------------------------------------------------------------------------------


def test_snapshot_key_changes_with_every_part_of_the_shape():
    host = qemu_host()
    base = warm.shape(host, spec(), "/img/debian12.qcow2")
    name = warm.snapshot_name(base)
    assert name.startswith("lab-warm-") and len(name) == len("lab-warm-") + 16
    assert warm.snapshot_name(warm.shape(host, spec(name="lab-r2-c7", ip="10.78.5.99"), "/img/debian12.qcow2")) == name
    variants = [
        spec(nic=NicModel.E1000),
        spec(disk_bus=DiskBus.SATA),
        spec(vcpus=1),
        spec(memory_mib=1024),
        spec(image=replace(IMAGE, digest="e" * 64)),
        spec(image=replace(IMAGE, sha256="t" * 64)),
    ]
    names = {warm.snapshot_name(warm.shape(host, v, "/img/debian12.qcow2")) for v in variants}
    names.add(warm.snapshot_name(warm.shape(qemu_host(domain_type="kvm"), spec(), "/img/debian12.qcow2")))
    names.add(warm.snapshot_name(warm.shape(qemu_host(boot="disk"), spec(), "/img/debian12.qcow2")))
    names.add(warm.snapshot_name(warm.shape(host, spec(), "/pool/debian12.qcow2")))
    assert len(names) == 9 and name not in names
    assert base["firmware"] == "seabios" and base["boot"] == "kernel" and base["net"] == "bridge:labbr0"


# -- the plan's refusals --------------------------------------------------------------------------------


def test_warm_is_refused_on_bhyve_in_one_line():
    bhyve = resolve("bsd1", Settings(backend="libvirt", uri="bhyve+ssh://root@bsd1/system", dataset="zroot/lab"))
    assert capabilities(bhyve).snapshots is False
    with pytest.raises(SettingError) as exc:
        check_spec(bhyve, spec())
    assert exc.value.key == "start" and exc.value.value == "warm"
    assert "BHYVE_SNAPSHOT" in str(exc.value) and "\n" not in str(exc.value)


def test_warm_needs_a_static_address_the_agent_and_a_new_enough_libvirt():
    no_subnet = resolve("kvm", Settings(backend="libvirt", uri="qemu:///system"))
    with pytest.raises(SettingError, match="static address") as exc:
        check_spec(no_subnet, spec(ip=""))
    assert exc.value.hint and "subnet" in exc.value.hint
    check_spec(no_subnet, spec(ip="10.0.0.5"))  # a cell with its own address is fine
    with pytest.raises(SettingError, match="no guest agent"):
        check_spec(qemu_host(), spec(image=replace(IMAGE, manifest={"guest_agent": False})))
    with pytest.raises(SettingError, match=r"needs libvirt >= 4\.4\.0"):
        check_spec(qemu_host(), spec(), lib_version=4_003_000)
    check_spec(qemu_host(), spec(), lib_version=9_000_000)
    with pytest.raises(SettingError, match="test driver"):
        check_spec(resolve("t", Settings(backend="libvirt", uri="test:///default", subnet="10.1.0.0/24")), spec())
    with pytest.raises(SettingError, match="cold or warm"):
        check_spec(qemu_host(), spec(start="tepid"))


# -- the snapshot store on a directory ------------------------------------------------------------------


def test_warm_store_lists_only_the_labs_snapshots_and_keeps_those_in_use(tmp_path):
    b = LibvirtBackend("kvm", Settings(backend="libvirt", uri="qemu:///system", dir=str(tmp_path)))
    ours = "lab-warm-00112233aabbccdd"
    for suffix in (".qcow2", ".state"):
        (tmp_path / f"{ours}{suffix}").write_bytes(b"x")
    (tmp_path / f"{ours}.json").write_text(
        json.dumps({"lab": warm.WARM_NS, "name": ours, "status": "ready", "key": {"digest": "d1"}}) + "\n"
    )
    # a look-alike without the lab's marker, and one naming another snapshot: never listed, never removed
    (tmp_path / "lab-warm-ffffffffffffffff.json").write_text(json.dumps({"name": "lab-warm-ffffffffffffffff"}) + "\n")
    (tmp_path / "lab-warm-eeeeeeeeeeeeeeee.json").write_text(
        json.dumps({"lab": warm.WARM_NS, "name": "lab-warm-0000000000000000"}) + "\n"
    )
    listed = b.warm.store.owned("libvirt")
    assert [(o.kind, o.name, o.detail, o.run_id) for o in listed] == [("warm", ours, "d1", "")]
    with pytest.raises(BackendError, match="in use by lab-r1-c1"):
        b.warm.store.remove(ours, ["lab-r1-c1"])
    assert (tmp_path / f"{ours}.state").exists()
    for name in ("lab-warm-ffffffffffffffff", "lab-warm-eeeeeeeeeeeeeeee", "../etc", "other"):
        with pytest.raises(BackendError):
            b.warm.store.remove(name, [])
    b.warm.store.remove(ours, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "lab-warm-eeeeeeeeeeeeeeee.json",
        "lab-warm-ffffffffffffffff.json",
    ]


# -- host load ---------------------------------------------------------------------------------------------

PROC_STAT = """\
cpu  1303752 500 288264 236904 5013 0 22826 3477 0 0
cpu0 646490 248 141740 127655 1697 0 10422 1749 0 0
cpu1 657262 252 146523 109248 3315 0 12403 1727 0 0
intr 28787307 0 0 0
ctxt 61923771
btime 1795604893
processes 1044817
"""


def test_proc_stat_parser():
    cpu = parse_proc_stat(PROC_STAT)
    assert cpu.cpus == 2
    assert cpu.busy_s == pytest.approx((1303752 + 500 + 288264 + 0 + 22826) / 100)
    assert cpu.steal_s == pytest.approx(34.77)
    old_kernel = parse_proc_stat("cpu  10 0 10 100\ncpu0 10 0 10 100\n", ticks_per_s=250)
    assert old_kernel.busy_s == pytest.approx(0.08) and old_kernel.steal_s is None and old_kernel.cpus == 1
    with pytest.raises(ValueError):
        parse_proc_stat("intr 1 2 3\n")


def test_proc_stat_of_this_machine_grows():
    text = Path("/proc/stat").read_text()
    first = parse_proc_stat(text, os.sysconf("SC_CLK_TCK"))
    assert first.cpus == os.cpu_count()
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:
        pass  # busy for a moment: the counters move
    assert parse_proc_stat(Path("/proc/stat").read_text(), os.sysconf("SC_CLK_TCK")).busy_s > first.busy_s


def test_freebsd_cp_time_parser():
    # `sysctl -n kern.cp_time kern.smp.cpus kern.clockrate` on a FreeBSD 14 host
    text = "2046 0 1567 38 456219\n4\n{ hz = 1000, tick = 1000, profhz = 8128, stathz = 127 }\n"
    cpu = parse_cp_time(text)
    assert cpu.cpus == 4 and cpu.steal_s is None
    assert cpu.busy_s == pytest.approx((2046 + 0 + 1567 + 38) / 127)
    for broken in ("1 2 3\n4\n{ stathz = 127 }\n", "1 2 3 4 5\n4\n{ hz = 100 }\n", "1 2 3 4 5\n"):
        with pytest.raises(ValueError):
            parse_cp_time(broken)
