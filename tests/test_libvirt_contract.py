"""Contract tests on libvirt's test:///default driver, through the backend's own code path:
clone (disk command + define with the lease in <metadata>), start, address discovery, list by
metadata, destroy (with the NVRAM-flag fallback the test driver forces), gc.

The test driver shares state between connections of one process and does no driver-specific
validation (research G15/G16): it proves the API sequence, not that bhyve accepts the XML
(test_libvirt_xml.py does that). Host commands: real qemu-img for the qemu flavour, a recording
fake for bhyve (zfs/ssh cannot run here; the argv is checked instead).
"""

from __future__ import annotations

import json
import secrets
import shlex
import time
from pathlib import Path

import pytest

from lab import proc
from lab.backends import BACKENDS, Backend
from lab.errors import BackendError, TeardownError, UnreachableError, UsageError
from lab.model import CloneKind, DiskBus, ImageRef, NicModel, VmSpec

libvirt = pytest.importorskip("libvirt")

from lab.backends.libvirt import LibvirtBackend, mac_for, parse_arp, parse_console_address  # noqa: E402

TEST_URI = "test:///default"


class FakeHost:
    """Records host commands (as they would go over ssh) and answers like the host would."""

    def __init__(self, arp: str = ""):
        self.calls: list[list[str]] = []
        self.arp = arp

    def __call__(self, argv, *, timeout=60.0, check=True, what=None, **kw) -> proc.Result:
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        out = self.arp if argv[-1] == "arp -an" else ""
        return proc.Result(argv, 0, out, "", 0.0)

    def remote_commands(self) -> list[str]:
        return [c[-1] for c in self.calls if c[0] == "ssh"]


@pytest.fixture
def run_id() -> str:
    return f"t{secrets.token_hex(4)}"


@pytest.fixture
def golden_qcow2(tmp_path) -> ImageRef:
    path = tmp_path / "golden.qcow2"
    proc.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), "16M"], timeout=30)
    return ImageRef(name="golden", os="debian", path=path, digest="d0")


def spec_for(image: ImageRef, run_id: str, cell: str = "c1", **kw) -> VmSpec:
    base = dict(name=f"lab-{run_id}-{cell}", run_id=run_id, cell_id=cell, image=image, nic=NicModel.VIRTIO,
                vcpus=2, memory_mib=256, disk_bus=DiskBus.VIRTIO, expires_at=time.time() + 600)
    base.update(kw)
    return VmSpec(**base)


def qemu_backend(tmp_path: Path, **extra) -> LibvirtBackend:
    return LibvirtBackend("t", {"uri": TEST_URI, "flavour": "qemu", "dir": str(tmp_path / "disks"),
                                "bridge": "labvbr0", **extra})


def bhyve_backend(fake: FakeHost, **extra) -> LibvirtBackend:
    return LibvirtBackend("bsd1", {"uri": TEST_URI, "flavour": "bhyve", "dataset": "zroot/lab",
                                   "ssh": "-p 2222 root@bsd1", **extra}, runner=fake)


@pytest.fixture(autouse=True)
def no_leftovers():
    """test:///default is shared per process: every test must leave only the driver's own 'test'."""
    yield
    conn = libvirt.open(TEST_URI)
    try:
        stray = [d.name() for d in conn.listAllDomains(0) if d.name().startswith("lab-")]
        for name in stray:
            d = conn.lookupByName(name)
            if d.isActive():
                d.destroy()
            d.undefine()
    finally:
        conn.close()
    assert not stray, f"left behind on test:///default: {stray}"


def test_registered_and_protocol():
    assert BACKENDS["libvirt"] is LibvirtBackend
    b = LibvirtBackend("h", {"uri": TEST_URI})
    assert isinstance(b, Backend)
    assert b.name == "libvirt"


def test_qemu_flavour_lifecycle(tmp_path, golden_qcow2, run_id):
    b = qemu_backend(tmp_path)
    b.check()
    assert b.lib_version >= 9_000_000
    spec = spec_for(golden_qcow2, run_id, ip="10.78.9.10")
    vm = b.clone(golden_qcow2, spec)

    overlay = Path(vm.handle["disk_path"])
    assert overlay == tmp_path / "disks" / f"{spec.name}.qcow2"
    info = json.loads(proc.run(["qemu-img", "info", "--output=json", str(overlay)], timeout=30).stdout)
    assert info["format"] == "qcow2" and info["backing-filename"] == str(golden_qcow2.path)

    dom = b.conn.lookupByName(spec.name)
    assert not dom.isActive()
    lease = b.read_lease(dom)
    assert lease["run"] == run_id and lease["cell"] == "c1" and lease["disk"] == f"file:{overlay}"
    assert int(lease["expires"]) == int(spec.expires_at)
    owned = [o for o in b.list_owned() if o.run_id == run_id]
    assert [(o.kind, o.name) for o in owned] == [("vm", spec.name)]
    assert all(o.name != "test" for o in b.list_owned())  # the driver's own domain carries no lease

    with pytest.raises(BackendError, match="already exists"):
        b.clone(golden_qcow2, spec)

    b.start(vm)
    assert dom.isActive()
    assert b.address(vm) == "10.78.9.10" and vm.facts["address_source"] == "static"

    b.destroy(vm)
    assert vm.facts["undefine"] == "plain"  # test driver: "unsupported flags (0x4)" -> plain undefine
    assert b._lookup(spec.name) is None
    assert not overlay.exists()
    assert not [o for o in b.list_owned() if o.run_id == run_id]
    b.destroy(vm)  # idempotent
    b.close()


def test_address_from_libvirt_lease_matches_the_mac(tmp_path, golden_qcow2, run_id):
    b = qemu_backend(tmp_path)
    vm = b.clone(golden_qcow2, spec_for(golden_qcow2, run_id))
    try:
        b.start(vm)
        # test driver fakes interfaceAddresses(LEASE) with 192.168.0.x for the domain's MAC
        addr = b.address(vm)
        assert addr.startswith("192.168.") and vm.facts["address_source"] == "lease"
        vm.handle["mac"] = "52:54:00:ff:ff:ff"  # a MAC the domain does not have: no lease matches
        assert b._addr_lease(vm) == ""
    finally:
        b.destroy(vm)


def test_bhyve_flavour_lifecycle_commands(run_id):
    img = ImageRef(name="fbsd14", os="freebsd", path=Path("/nonexistent"), digest="d0")
    mac = mac_for(f"lab-{run_id}-c1")
    fake = FakeHost(arp=f"? (192.168.8.23) at {mac} on bridge0 expires in 1180 seconds [bridge]\n"
                        "? (192.168.8.1) at 58:9c:fc:00:00:01 on bridge0 permanent [bridge]\n")
    b = bhyve_backend(fake)
    b.check()  # test URI: no host commands
    assert fake.calls == []
    spec = spec_for(img, run_id, nic=NicModel.E1000, disk_bus=DiskBus.SATA, expires_at=1_900_000_000)
    vm = b.clone(img, spec)
    ds = f"zroot/lab/{spec.name}"
    assert fake.calls[0][0] == "ssh" and fake.calls[0][-4:-1] == ["-p", "2222", "root@bsd1"]
    assert "BatchMode=yes" in fake.calls[0]
    assert shlex.split(fake.remote_commands()[0]) == [
        "zfs", "clone", "-o", "volmode=dev", "-o", f"lab:run={run_id}", "-o", "lab:expires=1900000000",
        "zroot/lab/fbsd14@gold", ds]
    xml = b.conn.lookupByName(spec.name).XMLDesc(0)
    assert xml.startswith("<domain type='bhyve'")
    assert f"/dev/zvol/{ds}" in xml and "<model type='e1000'/>" in xml

    b.start(vm)
    # bhyve < 12.3 (the test driver reports 9.0) has no interfaceAddresses: host ARP table by MAC
    assert b.address(vm) == "192.168.8.23" and vm.facts["address_source"] == "host-arp"
    assert "arp -an" in fake.remote_commands()

    b.destroy(vm)
    assert vm.facts["undefine"] == "plain"
    assert fake.remote_commands()[-1] == f"zfs destroy {ds}"
    assert b._lookup(spec.name) is None


def test_bhyve_full_clone_is_send_recv(run_id):
    img = ImageRef(name="fbsd14", os="freebsd", path=Path("/nonexistent"), digest="d0")
    b = bhyve_backend(FakeHost(), golden="{dataset}/golden/{image}@{digest}")
    argv = b.clone_argv(img, spec_for(img, run_id, clone=CloneKind.FULL, expires_at=5))
    assert len(argv) == 1 and argv[0][0] == "ssh"
    assert argv[0][-1] == (f"zfs send zroot/lab/golden/fbsd14@d0 | zfs recv -o volmode=dev -o lab:run={run_id} "
                           f"-o lab:expires=5 zroot/lab/lab-{run_id}-c1")


def test_ssh_target_from_uri():
    b = LibvirtBackend("b", {"uri": "bhyve+ssh://root@bsd1:2200/system?keyfile=/k/id&no_tty=1",
                             "dataset": "tank/lab"})
    assert b.host_argv(["zfs", "list"])[-6:] == ["-p", "2200", "-i", "/k/id", "root@bsd1", "zfs list"]
    assert b._safe_uri() == "bhyve+ssh://root@bsd1:2200/system"  # facts never carry the query
    assert LibvirtBackend("q", {"uri": "qemu:///system"}).host_argv(["ip", "neigh"]) == ["ip", "neigh"]


def test_remove_disk_refuses_foreign_targets():
    b = bhyve_backend(FakeHost())
    for ref in ("zfs:zroot/lab", "zfs:zroot/other/lab-x", "zfs:zroot/lab/lab-x@gold", "zfs:zroot/lab/a/b",
                "file:/etc/passwd", "nfs:x"):
        with pytest.raises(TeardownError):
            b.remove_disk_argv(ref)
    q = LibvirtBackend("q", {"uri": "qemu:///system", "dir": "/var/lib/lab"})
    with pytest.raises(TeardownError):
        q.remove_disk_argv("file:/var/lib/lab/../x.qcow2")
    assert q.remove_disk_argv("file:/var/lib/lab/lab-1.qcow2") == ["rm", "-f", "--", "/var/lib/lab/lab-1.qcow2"]


def test_define_failure_removes_the_disk(tmp_path, golden_qcow2, run_id, monkeypatch):
    b = qemu_backend(tmp_path)
    render = b.render
    monkeypatch.setattr(b, "render", lambda ctx: render(ctx).replace("<vcpu", "<bogus/><vcpu", 1))
    spec = spec_for(golden_qcow2, run_id)
    with pytest.raises(BackendError, match="libvirt refused the domain"):
        b.clone(golden_qcow2, spec)
    assert b._lookup(spec.name) is None
    assert list((tmp_path / "disks").glob("*.qcow2")) == []


def test_gc_finds_and_removes_by_metadata(tmp_path, golden_qcow2, run_id):
    """A crashed run: only the domain's <metadata> is left to find it by."""
    b = qemu_backend(tmp_path)
    vms = [b.clone(golden_qcow2, spec_for(golden_qcow2, run_id, cell)) for cell in ("c1", "c2")]
    b.start(vms[0])
    # A new backend (as `lab gc` in a new process would build) knows nothing but the host. `b` stays
    # open: test:///default drops all its state when the last connection closes.
    gc = qemu_backend(tmp_path)
    found = sorted((o for o in gc.list_owned() if o.run_id == run_id), key=lambda o: o.name)
    assert [o.name for o in found] == [v.name for v in vms]
    assert json.loads(found[0].detail)["disk"] == vms[0].handle["disk"]
    assert found[0].expires_at == int(vms[0].spec.expires_at)
    for item in found:
        gc.remove_owned(item)
    assert not [o for o in gc.list_owned() if o.run_id == run_id]
    assert not list((tmp_path / "disks").glob("*"))


def test_orphan_disk_is_listed_for_gc(tmp_path, golden_qcow2, run_id):
    b = LibvirtBackend("q", {"uri": "qemu:///system", "dir": str(tmp_path)})
    orphan = tmp_path / f"lab-{run_id}-c9.qcow2"
    orphan.write_bytes(b"")
    assert b._orphan_disks(min_age=0)[0].detail == f"file:{orphan}"
    assert b._orphan_disks() == []  # too young: may be a clone in progress


def test_undefine_falls_back_when_nvram_flag_is_refused(tmp_path, golden_qcow2, run_id):
    b = qemu_backend(tmp_path)
    vm = b.clone(golden_qcow2, spec_for(golden_qcow2, run_id))
    dom = b.conn.lookupByName(vm.name)
    with pytest.raises(libvirt.libvirtError) as exc:
        dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)
    assert exc.value.get_error_code() == libvirt.VIR_ERR_INVALID_ARG
    b.destroy(vm)
    assert vm.facts["undefine"] == "plain"


def test_unreachable_uri_is_a_usage_error():
    b = LibvirtBackend("x", {"uri": "test:///nonexistent/node.xml"})
    with pytest.raises(UnreachableError, match="cannot connect to libvirt"):
        b.check()


def test_validate_spec_runs_before_anything_is_created(run_id):
    fake = FakeHost()
    b = bhyve_backend(fake)
    img = ImageRef(name="fbsd14", os="freebsd", path=Path("/nonexistent"), digest="d0")
    with pytest.raises(UsageError, match="'rtl8139'"):
        b.clone(img, spec_for(img, run_id, nic=NicModel.RTL8139))
    assert fake.calls == [] and b._lookup(f"lab-{run_id}-c1") is None


def test_parsers():
    mac = "52:54:00:aa:bb:cc"
    assert parse_arp(f"10.78.1.10 dev labvbr0 lladdr {mac} REACHABLE\n", mac) == "10.78.1.10"
    assert parse_arp(f"10.78.1.11 dev labvbr0 lladdr {mac} FAILED\n", mac) == ""
    assert parse_arp(f"? (10.0.0.5) at {mac.upper()} on bridge0 expires in 5 seconds [bridge]", mac) == "10.0.0.5"
    assert parse_console_address("\r\nlab-net: eth0 10.78.3.10/24 gw none\r\nLAB-READY\r\n") == "10.78.3.10"
    assert parse_console_address("DHCPACK from 10.0.0.1\nbound to 10.0.0.77 -- renewal in 300 seconds.") == "10.0.0.77"
    assert parse_console_address("nothing") == ""


def test_subnet_allocates_distinct_static_addresses(tmp_path, golden_qcow2, run_id):
    b = qemu_backend(tmp_path, subnet="10.78.7.0/24", gateway="10.78.7.1")
    vms = []
    try:
        for cell in ("c1", "c2"):
            vms.append(b.clone(golden_qcow2, spec_for(golden_qcow2, run_id, cell)))
        assert [v.spec.ip for v in vms] == ["10.78.7.10", "10.78.7.11"]
        assert b.read_lease(b.conn.lookupByName(vms[1].name))["ip"] == "10.78.7.11"
        assert b.address(vms[0]) == "10.78.7.10" and vms[0].facts["address_source"] == "static"
    finally:
        for v in vms:
            b.destroy(v)
    with pytest.raises(UsageError, match="subnet"):
        qemu_backend(tmp_path, subnet="10.78.300.0/24")


def test_bhyve_preflight_refusal_removes_the_zvol(run_id, monkeypatch):
    fake = FakeHost()
    b = bhyve_backend(fake)
    img = ImageRef(name="fbsd14", os="freebsd", path=Path("/nonexistent"), digest="d0")

    def refuse(xml):
        raise BackendError("the bhyve driver on 'bsd1' rejects the domain: unsupported disk type")
    monkeypatch.setattr(b, "_preflight_bhyve", refuse)
    spec = spec_for(img, run_id)
    with pytest.raises(BackendError, match="unsupported disk type"):
        b.clone(img, spec)
    assert [shlex.split(c)[:2] for c in fake.remote_commands()] == [["zfs", "clone"], ["zfs", "destroy"]]
    assert b._lookup(spec.name) is None


def test_wait_ready_fails_fast_when_the_domain_is_not_running(tmp_path, golden_qcow2, run_id):
    b = qemu_backend(tmp_path)
    vm = b.clone(golden_qcow2, spec_for(golden_qcow2, run_id, ip="10.78.9.11"))
    try:
        started = time.monotonic()
        with pytest.raises(BackendError, match="not running"):
            b.wait_ready(vm, timeout=30)
        assert time.monotonic() - started < 5
    finally:
        b.destroy(vm)
