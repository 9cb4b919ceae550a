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
from dataclasses import replace
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from lab import proc
from lab.backends import Backend, backend_class, default_env
from lab.config import parse
from lab.errors import BackendError, CommandError, ConfigError, TeardownError, UnreachableError, UsageError
from lab.model import CloneKind, DiskBus, ImageRef, NicModel, VmSpec

libvirt = pytest.importorskip("libvirt")

from lab.backends.libvirt import publish  # noqa: E402
from lab.backends.libvirt.backend import LibvirtBackend  # noqa: E402
from lab.backends.libvirt.domain import mac_for, read_lease  # noqa: E402
from lab.backends.libvirt.settings import Settings  # noqa: E402

TEST_URI = "test:///default"


class FakeHost:
    """Records host commands (as they would go over ssh) and answers like the host would."""

    def __init__(self, arp: str = "", answers: dict[str, tuple[int, str]] | None = None):
        self.calls: list[list[str]] = []
        self.stdin: dict[str, str] = {}  # remote command -> the local file fed to it
        self.arp = arp
        self.answers = answers or {}  # remote command prefix -> (exit status, stdout)

    def __call__(self, argv, *, timeout=60.0, check=True, what=None, stdin=None, **kw) -> proc.Result:
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        if stdin is not None:
            self.stdin[argv[-1]] = str(stdin)
        rc, out = 0, self.arp if argv[-1] == "arp -an" else ""
        for prefix, answer in self.answers.items():
            if argv[-1].startswith(prefix):
                rc, out = answer
        if check and rc:
            raise CommandError(argv, rc, out, "failed", what)
        return proc.Result(argv, rc, out, "" if rc == 0 else "failed", 0.0)

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
    base = dict(
        name=f"lab-{run_id}-{cell}",
        run_id=run_id,
        cell_id=cell,
        image=image,
        nic=NicModel.VIRTIO,
        vcpus=2,
        memory_mib=256,
        disk_bus=DiskBus.VIRTIO,
        expires_at=time.time() + 600,
    )
    base.update(kw)
    return VmSpec(**base)


def host(name: str, run_command: FakeHost | None = None, env=None, **table) -> LibvirtBackend:
    """The backend of a `[hosts.NAME]` table, typed as lab.config hands it over."""
    kw = {"run_command": run_command} if run_command is not None else {}
    return LibvirtBackend(name, Settings(backend="libvirt", **table), env, **kw)


def qemu_backend(tmp_path: Path, **extra) -> LibvirtBackend:
    return host("t", uri=TEST_URI, flavour="qemu", dir=str(tmp_path / "disks"), bridge="labvbr0", **extra)


def bhyve_backend(fake: FakeHost, **extra) -> LibvirtBackend:
    return host("bsd1", fake, uri=TEST_URI, flavour="bhyve", dataset="zroot/lab", ssh="-p 2222 root@bsd1", **extra)


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
    assert backend_class("libvirt") is LibvirtBackend
    b = host("h", uri=TEST_URI)
    assert isinstance(b, Backend)
    assert b.name == "libvirt"


def test_qemu_flavour_lifecycle(tmp_path, golden_qcow2, run_id):
    b = qemu_backend(tmp_path)
    b.check()
    assert b.connection.lib_version >= 9_000_000
    spec = spec_for(golden_qcow2, run_id, ip="10.78.9.10")
    vm = b.clone(golden_qcow2, spec)

    overlay = Path(vm.handle["disk_path"])
    assert overlay == tmp_path / "disks" / f"{spec.name}.qcow2"
    info = json.loads(proc.run(["qemu-img", "info", "--output=json", str(overlay)], timeout=30).stdout)
    assert info["format"] == "qcow2" and info["backing-filename"] == str(golden_qcow2.path)

    dom = b.connection.get().lookupByName(spec.name)
    assert not dom.isActive()
    lease = read_lease(dom)
    assert lease["run"] == run_id and lease["cell"] == "c1" and lease["disk"] == f"file:{overlay}"
    assert int(lease["expires"]) == int(spec.expires_at)
    owned = [o for o in b.list_owned() if o.run_id == run_id]
    assert [(o.kind, o.name) for o in owned] == [("vm", spec.name)]
    assert all(o.name != "test" for o in b.list_owned())  # the driver's own domain carries no lease

    with pytest.raises(BackendError, match="already exists"):
        b.clone(golden_qcow2, spec)

    b.start(vm)
    assert dom.isActive()
    assert b.addresses.find(vm) == "10.78.9.10" and vm.facts["address_source"] == "static"

    b.destroy(vm)
    assert vm.facts["undefine"] == "plain"  # test driver: "unsupported flags (0x4)" -> plain undefine
    assert b.connection.lookup(spec.name) is None
    assert not overlay.exists()
    assert not [o for o in b.list_owned() if o.run_id == run_id]
    b.destroy(vm)  # idempotent
    b.connection.close()


def test_address_from_libvirt_lease_matches_the_mac(tmp_path, golden_qcow2, run_id):
    b = qemu_backend(tmp_path)
    vm = b.clone(golden_qcow2, spec_for(golden_qcow2, run_id))
    try:
        b.start(vm)
        # test driver fakes interfaceAddresses(LEASE) with 192.168.0.x for the domain's MAC
        addr = b.addresses.find(vm)
        assert addr.startswith("192.168.") and vm.facts["address_source"] == "lease"
        vm.handle["mac"] = "52:54:00:ff:ff:ff"  # a MAC the domain does not have: no lease matches
        assert b.addresses.lease(vm) == ""
    finally:
        b.destroy(vm)


def test_bhyve_flavour_lifecycle_commands(run_id):
    img = ImageRef(name="fbsd14", os="freebsd", path=Path("/nonexistent"), digest="d0")
    mac = mac_for(f"lab-{run_id}-c1")
    fake = FakeHost(
        arp=f"? (192.168.8.23) at {mac} on bridge0 expires in 1180 seconds [bridge]\n"
        "? (192.168.8.1) at 58:9c:fc:00:00:01 on bridge0 permanent [bridge]\n"
    )
    b = bhyve_backend(fake)
    b.check()  # test URI: no host commands
    assert fake.calls == []
    spec = spec_for(img, run_id, nic=NicModel.E1000, disk_bus=DiskBus.SATA, expires_at=1_900_000_000)
    vm = b.clone(img, spec)
    ds = f"zroot/lab/{spec.name}"
    assert fake.calls[0][0] == "ssh" and fake.calls[0][-4:-1] == ["-p", "2222", "root@bsd1"]
    assert "BatchMode=yes" in fake.calls[0]
    assert shlex.split(fake.remote_commands()[0]) == [
        "zfs",
        "clone",
        "-o",
        "volmode=dev",
        "-o",
        f"lab:run={run_id}",
        "-o",
        "lab:expires=1900000000",
        "zroot/lab/fbsd14@gold",
        ds,
    ]
    xml = b.connection.get().lookupByName(spec.name).XMLDesc(0)
    assert xml.startswith("<domain type='bhyve'")
    assert f"/dev/zvol/{ds}" in xml and "<model type='e1000'/>" in xml

    b.start(vm)
    # bhyve < 12.3 (the test driver reports 9.0) has no interfaceAddresses: host ARP table by MAC
    assert b.addresses.find(vm) == "192.168.8.23" and vm.facts["address_source"] == "host-arp"
    assert "arp -an" in fake.remote_commands()

    b.destroy(vm)
    assert vm.facts["undefine"] == "plain"
    assert fake.remote_commands()[-1] == f"zfs destroy {ds}"
    assert b.connection.lookup(spec.name) is None


def test_bhyve_full_clone_is_send_recv(run_id):
    img = ImageRef(name="fbsd14", os="freebsd", path=Path("/nonexistent"), digest="d0")
    b = bhyve_backend(FakeHost(), golden="{dataset}/golden/{image}@{digest}")
    argv = b.disks.clone_argv(img, spec_for(img, run_id, clone=CloneKind.FULL, expires_at=5))
    assert len(argv) == 1 and argv[0][0] == "ssh"
    assert argv[0][-1] == (
        f"zfs send zroot/lab/golden/fbsd14@d0 | zfs recv -o volmode=dev -o lab:run={run_id} "
        f"-o lab:expires=5 zroot/lab/lab-{run_id}-c1"
    )


def test_ssh_target_from_uri():
    b = host("b", uri="bhyve+ssh://root@bsd1:2200/system?keyfile=/k/id&no_tty=1", dataset="tank/lab")
    assert b.shell.argv(["zfs", "list"])[-6:] == ["-p", "2200", "-i", "/k/id", "root@bsd1", "zfs list"]
    assert b.connection.safe_uri == "bhyve+ssh://root@bsd1:2200/system"  # facts never carry the query
    assert b.facts()["libvirt_uri"] == "bhyve+ssh://root@bsd1:2200/system"
    assert host("q", uri="qemu:///system").shell.argv(["ip", "neigh"]) == ["ip", "neigh"]


def test_remove_disk_refuses_foreign_targets():
    b = bhyve_backend(FakeHost())
    for ref in (
        "zfs:zroot/lab",
        "zfs:zroot/other/lab-x",
        "zfs:zroot/lab/lab-x@gold",
        "zfs:zroot/lab/a/b",
        "file:/etc/passwd",
        "nfs:x",
    ):
        with pytest.raises(TeardownError):
            b.disks.remove_argv(ref)
    q = host("q", uri="qemu:///system", dir="/var/lib/lab")
    with pytest.raises(TeardownError):
        q.disks.remove_argv("file:/var/lib/lab/../x.qcow2")
    assert q.disks.remove_argv("file:/var/lib/lab/lab-1.qcow2") == ["rm", "-f", "--", "/var/lib/lab/lab-1.qcow2"]


def test_define_failure_removes_the_disk(tmp_path, golden_qcow2, run_id):
    b = qemu_backend(tmp_path, cpu_mode="bogus")  # libvirt's schema check refuses <cpu mode='bogus'>
    spec = spec_for(golden_qcow2, run_id)
    with pytest.raises(BackendError, match="libvirt refused the domain"):
        b.clone(golden_qcow2, spec)
    assert b.connection.lookup(spec.name) is None
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
    """A clone whose domain is gone (a crash between clone and define) is found by its lease file."""
    b = qemu_backend(tmp_path)
    spec = spec_for(golden_qcow2, run_id, "c9")
    vm = b.clone(golden_qcow2, spec)
    lease = json.loads((tmp_path / "disks" / f"{spec.name}.lease").read_text())
    assert lease["lab"] == "https://lab.invalid/lease" and lease["run"] == run_id and lease["disk"] == vm.handle["disk"]
    b.connection.get().lookupByName(spec.name).undefine()  # the domain is gone, its disk is not
    (orphan,) = [o for o in b.list_owned() if o.run_id == run_id]
    assert (orphan.kind, orphan.name, orphan.detail) == ("disk", spec.name, vm.handle["disk"])
    assert orphan.expires_at == int(spec.expires_at)
    b.remove_owned(orphan)
    assert list((tmp_path / "disks").iterdir()) == []


def test_undefine_falls_back_when_nvram_flag_is_refused(tmp_path, golden_qcow2, run_id):
    b = qemu_backend(tmp_path)
    vm = b.clone(golden_qcow2, spec_for(golden_qcow2, run_id))
    dom = b.connection.get().lookupByName(vm.name)
    with pytest.raises(libvirt.libvirtError) as exc:
        dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)
    assert exc.value.get_error_code() == libvirt.VIR_ERR_INVALID_ARG
    b.destroy(vm)
    assert vm.facts["undefine"] == "plain"


def test_unreachable_uri_is_a_usage_error():
    b = host("x", uri="test:///nonexistent/node.xml")
    with pytest.raises(UnreachableError, match="cannot connect to libvirt"):
        b.check()


def test_validate_spec_runs_before_anything_is_created(run_id):
    fake = FakeHost()
    b = bhyve_backend(fake)
    img = ImageRef(name="fbsd14", os="freebsd", path=Path("/nonexistent"), digest="d0")
    with pytest.raises(UsageError, match="'rtl8139'"):
        b.clone(img, spec_for(img, run_id, nic=NicModel.RTL8139))
    assert fake.calls == [] and b.connection.lookup(f"lab-{run_id}-c1") is None


def test_subnet_allocates_distinct_static_addresses(tmp_path, golden_qcow2, run_id):
    b = qemu_backend(tmp_path, subnet="10.78.7.0/24", gateway="10.78.7.1")
    vms = []
    try:
        for cell in ("c1", "c2"):
            vms.append(b.clone(golden_qcow2, spec_for(golden_qcow2, run_id, cell)))
        assert [v.spec.ip for v in vms] == ["10.78.7.10", "10.78.7.11"]
        assert read_lease(b.connection.get().lookupByName(vms[1].name))["ip"] == "10.78.7.11"
        assert b.addresses.find(vms[0]) == "10.78.7.10" and vms[0].facts["address_source"] == "static"
    finally:
        for v in vms:
            b.destroy(v)
    with pytest.raises(ConfigError, match=r"hosts.t.subnet = '10.78.300.0/24': .*not a network"):
        parse({"hosts": {"t": {"backend": "libvirt", "uri": TEST_URI, "subnet": "10.78.300.0/24"}}})


def test_bhyve_preflight_refusal_removes_the_zvol(run_id, monkeypatch):
    fake = FakeHost()
    b = bhyve_backend(fake)
    img = ImageRef(name="fbsd14", os="freebsd", path=Path("/nonexistent"), digest="d0")

    def refuse(xml):
        raise BackendError("the bhyve driver on 'bsd1' rejects the domain: unsupported disk type")

    monkeypatch.setattr(b.machines, "_preflight_bhyve", refuse)
    spec = spec_for(img, run_id)
    with pytest.raises(BackendError, match="unsupported disk type"):
        b.clone(img, spec)
    assert [shlex.split(c)[:2] for c in fake.remote_commands()] == [["zfs", "clone"], ["zfs", "destroy"]]
    assert b.connection.lookup(spec.name) is None


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


# --------------------------------------------------------------------------------------------
# golden images on the host: publishing and check_image

FBSD = ImageRef(name="fbsd14", os="freebsd", path=Path("/nonexistent/fbsd14.raw"), digest="abc123")


def bsd(fake: FakeHost, **extra) -> LibvirtBackend:
    """A bhyve host reached over ssh; publishing needs no libvirt connection, only host commands."""
    return host("bsd1", fake, uri="bhyve+ssh://root@bsd1/system", dataset="zroot/lab", **extra)


def test_bhyve_publish_plan_is_zvol_dd_snapshot():
    b = bsd(FakeHost())
    steps = publish.zvol_plan(b.disks, FBSD, "/var/tmp/x/fbsd14.raw", 3 * (1 << 30) + 1)
    assert [s[0][:3] for s in steps] == [["ssh"] + s[0][1:3] for s in steps]  # all over ssh
    assert [shlex.split(s[0][-1]) for s in steps] == [
        [
            "zfs",
            "create",
            "-s",
            "-V",
            "3073M",
            "-o",
            "volmode=dev",
            "-o",
            "lab:image=fbsd14",
            "-o",
            "lab:digest=abc123",
            "zroot/lab/fbsd14",
        ],
        ["dd", "of=/dev/zvol/zroot/lab/fbsd14", "bs=1048576", "conv=sparse"],
        ["zfs", "snapshot", "-o", "lab:digest=abc123", "zroot/lab/fbsd14@gold"],
    ]
    assert [s[1] for s in steps] == [None, "/var/tmp/x/fbsd14.raw", None]  # dd reads the raw image
    # a golden per recipe when the format names the digest
    b2 = bsd(FakeHost(), golden="{dataset}/golden/{image}-{digest}@gold")
    assert (
        shlex.split(publish.zvol_plan(b2.disks, FBSD, "r", 1 << 20)[0][0][-1])[-1] == "zroot/lab/golden/fbsd14-abc123"
    )


def test_bhyve_publish_runs_the_plan_and_is_idempotent(tmp_path):
    raw = tmp_path / "fbsd14.raw"
    proc.run(["qemu-img", "create", "-q", "-f", "raw", str(raw), "8M"], timeout=30)
    img = ImageRef(name="fbsd14", os="freebsd", path=raw, digest="abc123")
    fake = FakeHost(answers={"zfs list -H -t snapshot": (1, "")})  # not there yet
    b = bsd(fake)
    assert b.publishing.publish(img) == "zfs:zroot/lab/fbsd14@gold"
    cmds = [shlex.split(c)[:2] for c in fake.remote_commands()]
    assert cmds == [["zfs", "list"], ["zfs", "create"], ["dd", "of=/dev/zvol/zroot/lab/fbsd14"], ["zfs", "snapshot"]]
    assert fake.stdin == {"dd of=/dev/zvol/zroot/lab/fbsd14 bs=1048576 conv=sparse": str(raw)}  # raw: no convert

    # there already with this recipe: nothing is written
    fake = FakeHost(answers={"zfs list -H -t snapshot": (0, "zroot/lab/fbsd14@gold\tabc123\n")})
    assert bsd(fake).publishing.publish(img) == "zfs:zroot/lab/fbsd14@gold"
    assert [shlex.split(c)[:2] for c in fake.remote_commands()] == [["zfs", "list"]]
    # another recipe under the same name: refused (clones may depend on the old snapshot)
    fake = FakeHost(answers={"zfs list -H -t snapshot": (0, "zroot/lab/fbsd14@gold\told999\n")})
    with pytest.raises(UsageError, match="recipe old999.*not abc123"):
        bsd(fake).publishing.publish(img)


def test_bhyve_publish_failure_destroys_the_half_made_zvol(tmp_path):
    raw = tmp_path / "fbsd14.raw"
    proc.run(["qemu-img", "create", "-q", "-f", "qcow2", str(raw), "8M"], timeout=30)  # converted first
    img = ImageRef(name="fbsd14", os="freebsd", path=raw, digest="abc123")
    fake = FakeHost(answers={"zfs list -H -t snapshot": (1, ""), "dd of=": (1, "")})
    with pytest.raises(CommandError):
        bsd(fake).publishing.publish(img)
    assert shlex.split(fake.remote_commands()[-1]) == ["zfs", "destroy", "-r", "zroot/lab/fbsd14"]
    fed = next(iter(fake.stdin.values()))
    assert fed.endswith("/fbsd14.raw") and fed != str(raw)  # the qcow2 went through qemu-img convert
    assert not Path(fed).exists()  # and the temporary raw file is gone


def test_bhyve_check_image_before_anything_is_created():
    missing = FakeHost(answers={"zfs list -H -t snapshot": (1, "")})
    b = bsd(missing)
    with pytest.raises(UsageError, match=r"zroot/lab/fbsd14@gold .* not on host 'bsd1'") as exc:
        b.check_images([FBSD])
    assert "lab images publish fbsd14 bsd1" in exc.value.hint
    stale = FakeHost(answers={"zfs list -H -t snapshot": (0, "zroot/lab/fbsd14@gold\tzzz\n")})
    with pytest.raises(UsageError, match="recipe zzz"):
        bsd(stale).check_images([FBSD])
    for state in ("abc123", "-"):  # this recipe, or a snapshot made by hand (no lab:digest)
        ok = FakeHost(answers={"zfs list -H -t snapshot": (0, f"zroot/lab/fbsd14@gold\t{state}\n")})
        bsd(ok).check_images([FBSD])


@pytest.fixture
def built_image(tmp_path) -> ImageRef:
    """An images/ directory as `lab images build` leaves it (tiny stand-in files)."""
    img_dir = tmp_path / "images"
    (img_dir / "debian12").mkdir(parents=True)
    for f in ("debian12.qcow2", "debian12/vmlinuz", "debian12/initrd.img"):
        (img_dir / f).write_bytes(b"x")
    manifest = {
        "name": "debian12",
        "recipe_digest": "d1",
        "boot": ["kernel", "bios", "uefi"],
        "paths": {"disk": "debian12.qcow2", "kernel": "debian12/vmlinuz", "initrd": "debian12/initrd.img"},
    }
    return ImageRef(name="debian12", os="debian", path=img_dir / "debian12.qcow2", digest="d1", manifest=manifest)


def test_qemu_golden_root_follows_the_published_manifest(tmp_path, built_image):
    img, manifest = built_image, built_image.manifest
    disks = tmp_path / "disks"
    b = host("q", uri="qemu:///system", dir=str(disks))
    assert b.disks.golden_root(img) is None and b.disks.golden_source(img) == str(img.path)  # local host: in place

    b = host("q", uri="qemu:///system", dir=str(disks))
    assert b.publishing.publish(img) == f"file:{disks}/debian12.qcow2"
    assert json.loads((disks / "debian12.json").read_text())["recipe_digest"] == "d1"
    assert (disks / "debian12" / "vmlinuz").read_bytes() == b"x"
    assert b.disks.golden_source(img) == f"{disks}/debian12.qcow2"
    os_el = ET.fromstring(b.domain_xml(spec_for(img, "r1"))).find("os")
    assert os_el.findtext("kernel") == f"{disks}/debian12/vmlinuz"
    assert os_el.findtext("initrd") == f"{disks}/debian12/initrd.img"

    newer = ImageRef(
        name="debian12", os="debian", path=img.path, digest="d2", manifest={**manifest, "recipe_digest": "d2"}
    )
    with pytest.raises(UsageError, match="recipe d1, this lab's is d2") as exc:
        host("q", uri="qemu:///system", dir=str(disks)).check_images([newer])
    assert exc.value.hint == "lab images publish debian12 q"
    # a remote host has no "in place": the image must be published there
    r = host(
        "r",
        FakeHost(answers={"cat /srv/lab/debian12.json": (1, "")}),
        uri="qemu+ssh://root@kvm1/system",
        dir="/srv/lab",
    )
    with pytest.raises(UsageError, match="not on host 'r'"):
        r.check_images([img])


def test_qemu_publish_to_a_remote_host_streams_over_ssh(built_image):
    img, img_dir = built_image, built_image.path.parent
    fake = FakeHost(answers={"cat /srv/lab/debian12.json": (1, "")})
    b = host("r", fake, uri="qemu+ssh://root@kvm1/system", images_dir="/srv/lab")
    assert b.publishing.publish(img) == "file:/srv/lab/debian12.qcow2"
    cmds = fake.remote_commands()
    assert cmds[1] == "mkdir -p /srv/lab /srv/lab/debian12"
    assert fake.stdin == {
        "dd of=/srv/lab/debian12.qcow2.part bs=1048576 conv=sparse": str(img.path),
        "dd of=/srv/lab/debian12/vmlinuz.part bs=1048576 conv=sparse": str(img_dir / "debian12/vmlinuz"),
        "dd of=/srv/lab/debian12/initrd.img.part bs=1048576 conv=sparse": str(img_dir / "debian12/initrd.img"),
    }
    assert "mv -f /srv/lab/debian12.qcow2.part /srv/lab/debian12.qcow2" in cmds
    assert cmds[-1] == "cat > /srv/lab/debian12.json"  # the manifest last: its presence = complete


# --------------------------------------------------------------------------------------------
# run liveness for `lab gc`: a run lock on the orchestrating machine


def test_run_lock_tells_live_dead_and_unknown_runs(tmp_path, run_id):
    from lab import gc as gc_mod

    b = qemu_backend(tmp_path, env=replace(default_env(), state_dir=tmp_path))  # the locks live in state_dir
    assert b.run_is_live(run_id) is None  # never ran here: only its lease expiry can retire it
    b.open_run(run_id)
    lock = tmp_path / f"libvirt-t@{run_id}.lock"
    assert lock.exists() and b.run_is_live(run_id) is True
    assert [(o.kind, o.run_id) for o in b.list_owned() if o.kind == "lock"] == [("lock", run_id)]
    b.close_run(run_id)
    assert not lock.exists() and b.run_is_live(run_id) is None

    # a run killed with -9 leaves its lock file, unlocked: dead, so gc removes what it left
    lock.write_text("12345")
    assert b.run_is_live(run_id) is False
    cfg = parse(
        {
            "hosts": {"t": {"backend": "libvirt", "uri": TEST_URI, "flavour": "qemu", "dir": str(tmp_path / "disks")}},
            "matrix": {"host": ["t"]},
        }
    )
    golden = tmp_path / "g.qcow2"
    proc.run(["qemu-img", "create", "-q", "-f", "qcow2", str(golden), "16M"], timeout=30)
    img = ImageRef(name="golden", os="debian", path=golden, digest="d0")
    vm = b.clone(img, spec_for(img, run_id, expires_at=time.time() + 3600))  # lease not expired
    report = gc_mod.collect(cfg, hosts=["t"], backends={"t": b})
    assert f"removed t vm {vm.name}" in report.lines and f"removed t lock {lock.name}" in report.lines
    assert b.connection.lookup(vm.name) is None and not lock.exists()

    # a run of another machine (no lock here) whose lease has not expired is kept
    vm = b.clone(img, spec_for(img, run_id + "x", expires_at=time.time() + 3600))
    report = gc_mod.collect(cfg, hosts=["t"], backends={"t": b})
    assert any(line.startswith(f"keep   t vm {vm.name}") for line in report.lines)
    report = gc_mod.collect(cfg, hosts=["t"], backends={"t": b}, force=True)
    assert f"removed t vm {vm.name}" in report.lines


def test_a_domain_carries_its_owner_and_its_lease_is_renewed_live_and_persistent(tmp_path, golden_qcow2, run_id):
    """Issue 35: the lease in <metadata> names the run's owner, and the run moves its expiry while
    the domain stands, in its persistent definition as well as the running one."""
    b = qemu_backend(tmp_path)
    b.check()
    spec = spec_for(golden_qcow2, run_id, ip="10.78.9.11", owner="abcdefabcdef-0123456789ab")
    vm = b.clone(golden_qcow2, spec)
    try:
        b.renew_lease(vm, spec.expires_at + 1000)  # defined, not started: its definition
        dom = b.connection.get().lookupByName(spec.name)
        assert int(read_lease(dom)["expires"]) == int(spec.expires_at) + 1000
        b.start(vm)
        b.renew_lease(vm, spec.expires_at + 2000)
        lease = read_lease(dom)
        assert int(lease["expires"]) == int(spec.expires_at) + 2000 and lease["run"] == run_id
        inactive = ET.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        stored = inactive.find("metadata/{https://lab.invalid/lease}lease")
        assert int(stored.get("expires")) == int(spec.expires_at) + 2000
        (owned,) = [o for o in b.list_owned() if o.run_id == run_id and o.kind == "vm"]
        assert owned.owner == "abcdefabcdef-0123456789ab" and owned.expires_at == int(spec.expires_at) + 2000
    finally:
        b.destroy(vm)
    with pytest.raises(BackendError, match="is gone"):
        b.renew_lease(vm, spec.expires_at)
