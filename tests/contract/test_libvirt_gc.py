"""What `lab gc` may touch on a libvirt host (issue 16) and what it must admit it could not look at
(issue 23), on libvirt's test:///default driver and a recording host shell: foreign domains and
disks that look like the lab's are never listed nor removed, a host or a part of it that cannot be
listed raises IncompleteListing naming it, check_specs applies the host's version, and cpu_times
reads the host's load."""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

import pytest

from lab.errors import BackendError, IncompleteListing, SettingError, TeardownError
from lab.model import ImageRef, NicModel, Owned, VmSpec

libvirt = pytest.importorskip("libvirt")


from test_libvirt_contract import TEST_URI, FakeHost, bhyve_backend, golden_qcow2, host, qemu_backend, spec_for  # noqa: E402,F401


@pytest.fixture
def run_id() -> str:
    return f"t{secrets.token_hex(4)}"


FOREIGN = {
    "lab-foreign-plain": "",  # named like the lab's, no metadata at all
    "lab-foreign-empty": '<lab:lease xmlns:lab="https://lab.invalid/lease" run="" cell="c1"/>',
    "lab-foreign-ns": '<x:lease xmlns:x="https://example.org/lease" run="r1" cell="c1" disk="file:/etc/passwd"/>',
}


@pytest.fixture
def foreign_domains():
    """Domains someone else made on the host, each looking a little like the lab's."""
    conn = libvirt.open(TEST_URI)
    made = []
    try:
        for name, meta in FOREIGN.items():
            metadata = f"<metadata>{meta}</metadata>" if meta else ""
            conn.defineXML(
                f"<domain type='test'><name>{name}</name>{metadata}<memory>65536</memory>"
                "<os><type>hvm</type></os></domain>"
            )
            made.append(name)
        conn.lookupByName("lab-foreign-ns").create()
        yield conn
    finally:
        for name in made:
            d = conn.lookupByName(name)
            if d.isActive():
                d.destroy()
            d.undefine()
        conn.close()


def test_foreign_domains_are_never_listed_nor_removed(tmp_path, golden_qcow2, run_id, foreign_domains):  # noqa: F811 - the imported fixture
    b = qemu_backend(tmp_path)
    vm = b.clone(golden_qcow2, spec_for(golden_qcow2, run_id))
    try:
        listed = b.list_owned()
        assert [o.name for o in listed if o.kind == "vm"] == [vm.name]
        for name in FOREIGN:  # as `lab gc --force` would ask, had anything listed them
            with pytest.raises(BackendError, match="left alone"):
                b.remove_owned(Owned(backend="libvirt", kind="vm", name=name, run_id="r1"))
            assert foreign_domains.lookupByName(name) is not None
        assert foreign_domains.lookupByName("lab-foreign-ns").isActive()
        # a lab item whose domain was replaced by another of the same name: left alone too
        (item,) = [o for o in listed if o.kind == "vm"]
        dom = foreign_domains.lookupByName(vm.name)
        uuid = dom.UUIDString()
        stale = Owned(
            backend="libvirt",
            kind="vm",
            name=item.name,
            run_id=item.run_id,
            detail=json.dumps({**json.loads(item.detail), "uuid": "00000000-0000-0000-0000-000000000001"}),
        )
        with pytest.raises(BackendError, match="left alone"):
            b.remove_owned(stale)
        assert foreign_domains.lookupByUUIDString(uuid) is not None
        b.remove_owned(item)
        assert b.connection.lookup(vm.name) is None and not list((tmp_path / "disks").iterdir())
    finally:
        b.destroy(vm)


def test_destroy_leaves_a_domain_that_is_not_the_vms(tmp_path, golden_qcow2, run_id, foreign_domains):  # noqa: F811 - the imported fixture
    b = qemu_backend(tmp_path)
    vm = b.clone(golden_qcow2, spec_for(golden_qcow2, run_id))
    real_uuid = vm.handle["uuid"]
    vm.handle["uuid"] = "00000000-0000-0000-0000-000000000002"  # as if the name now belonged to another domain
    with pytest.raises(TeardownError, match="another domain now"):
        b.destroy(vm)
    assert b.connection.lookup(vm.name) is not None and Path(vm.handle["disk_path"]).exists()
    vm.handle["uuid"] = real_uuid
    b.destroy(vm)
    assert b.connection.lookup(vm.name) is None


def test_orphan_disks_need_the_labs_naming_and_a_lease(tmp_path, run_id):
    b = host("q", uri="qemu:///system", dir=str(tmp_path))
    d = tmp_path

    def clone(name: str, lease: dict | None, suffix: str = "qcow2") -> None:
        (d / f"{name}.{suffix}").write_bytes(b"")
        if lease is not None:
            (d / f"{name}.lease").write_text(json.dumps(lease) + "\n")

    ours = f"lab-{run_id}-c1"
    base = {"lab": "https://lab.invalid/lease", "run": run_id, "expires": "1900000000"}
    clone(ours, {**base, "name": ours, "disk": f"file:{d}/{ours}.qcow2"})
    clone("lab-nolease", None)  # named like the lab's, nothing proves it
    clone("lab-emptyrun", {**base, "name": "lab-emptyrun", "run": "", "disk": f"file:{d}/lab-emptyrun.qcow2"})
    clone(
        "lab-foreignns",
        {**base, "lab": "https://example.org", "name": "lab-foreignns", "disk": f"file:{d}/lab-foreignns.qcow2"},
    )
    clone("lab-elsewhere", {**base, "name": "lab-elsewhere", "disk": "file:/etc/passwd"})
    clone("lab-othername", {**base, "name": ours, "disk": f"file:{d}/{ours}.qcow2"})  # a copy of our lease
    clone("notlab", {**base, "name": "notlab", "disk": f"file:{d}/notlab.qcow2"})
    (found,) = b.disks.orphans("libvirt")
    assert (found.name, found.run_id, found.detail, found.expires_at) == (
        ours,
        run_id,
        f"file:{d}/{ours}.qcow2",
        1_900_000_000,
    )
    assert b.disks.still_owned(found)
    assert not b.disks.still_owned(
        Owned(backend="libvirt", kind="disk", name=ours, run_id="other", detail=found.detail)
    )
    with pytest.raises(BackendError, match="left alone"):
        b.remove_owned(
            Owned(
                backend="libvirt", kind="disk", name="lab-nolease", run_id=run_id, detail=f"file:{d}/lab-nolease.qcow2"
            )
        )
    b.remove_owned(found)
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(ours)) == []
    assert (d / "lab-nolease.qcow2").exists() and (d / "lab-emptyrun.qcow2").exists()


def test_bhyve_orphans_need_a_lab_name_and_lab_run(run_id):
    zfs = (
        f"zroot/lab/lab-{run_id}-c1\t{run_id}\t1900000000\n"
        "zroot/lab/lab-norun\t-\t-\n"
        "zroot/lab/lab-emptyrun\t\t-\n"
        f"zroot/lab/somevm\t{run_id}\t-\n"
        f"zroot/lab/deeper/lab-x\t{run_id}\t-\n"
        "zroot/lab/debian12\t-\t-\n"
    )
    fake = FakeHost(answers={"zfs list -H -p -t volume": (0, zfs), "zfs get": (0, f"{run_id}\n")})
    b = host("bsd1", fake, uri="bhyve+ssh://root@bsd1/system", dataset="zroot/lab")
    (found,) = b.disks.orphans("libvirt")
    assert (found.name, found.run_id, found.detail) == (f"lab-{run_id}-c1", run_id, f"zfs:zroot/lab/lab-{run_id}-c1")
    assert b.disks.still_owned(found)
    assert not b.disks.still_owned(
        Owned(backend="libvirt", kind="disk", name="somevm", run_id=run_id, detail="zfs:zroot/lab/somevm")
    )


# -- a host that can be listed only in part -----------------------------------------------------------


def test_unreachable_host_is_an_incomplete_listing(tmp_path):
    b = host("gone", uri="test:///nonexistent/node.xml", env=None)
    with pytest.raises(IncompleteListing) as exc:
        b.list_owned()
    assert exc.value.exit_code == 1
    assert any(u.startswith("domains at test:///nonexistent/node.xml") for u in exc.value.unchecked)
    assert any("clones whose domain is gone: not looked for" in u for u in exc.value.unchecked)


def test_a_clone_directory_that_cannot_be_read_is_named(tmp_path, golden_qcow2, run_id):  # noqa: F811 - the imported fixture
    fake = FakeHost(answers={"[ -e": (2, "")})
    b = host("t", fake, uri=TEST_URI, flavour="qemu", dir=str(tmp_path / "disks"))
    with pytest.raises(IncompleteListing) as exc:
        b.list_owned()
    (part,) = exc.value.unchecked
    assert part.startswith(f"clones in {tmp_path / 'disks'}:")
    pool = host("t", uri=TEST_URI, flavour="qemu", pool="no-such-pool")
    with pytest.raises(IncompleteListing) as exc:
        pool.list_owned()
    (part,) = exc.value.unchecked
    assert part.startswith("clones in storage pool no-such-pool:") and "no-such-pool" in part


def test_a_zfs_listing_that_fails_is_named(run_id):
    fake = FakeHost(answers={"zfs list -H -p -t volume": (1, "")})
    with pytest.raises(IncompleteListing) as exc:
        bhyve_backend(fake).list_owned()
    (part,) = exc.value.unchecked
    assert part.startswith("clones in zfs dataset zroot/lab:")


def test_a_domain_whose_lease_cannot_be_read_is_named(tmp_path, golden_qcow2, run_id, monkeypatch):  # noqa: F811 - the imported fixture
    b = qemu_backend(tmp_path)
    vm = b.clone(golden_qcow2, spec_for(golden_qcow2, run_id))
    try:

        class InternalError(libvirt.libvirtError):
            def get_error_code(self):  # not the thread's last libvirt error: this one
                return libvirt.VIR_ERR_INTERNAL_ERROR

        class Unreadable:
            def name(self):
                return "lab-someone"

            def metadata(self, *a):
                raise InternalError("internal error: metadata unreadable")

        real = b.connection.domains
        monkeypatch.setattr(b.connection, "domains", lambda h: [*real(h), Unreadable()])
        with pytest.raises(IncompleteListing) as exc:
            b.list_owned()
        assert [o.name for o in exc.value.found if o.kind == "vm"] == [vm.name]
        assert exc.value.unchecked[0].startswith("domain lab-someone: its metadata could not be read")
        assert "not looked for" in exc.value.unchecked[1]  # its disk could look orphaned: no disk is listed
    finally:
        b.destroy(vm)


# -- versions, load --------------------------------------------------------------------


def test_check_specs_applies_the_hosts_libvirt_version(run_id, monkeypatch):
    img = ImageRef(name="fbsd14", os="freebsd", path=Path("/nonexistent"), digest="d0")
    b = bhyve_backend(FakeHost(), firmware="bhyveload")
    b.check()
    spec = spec_for(img, run_id, nic=NicModel.E1000)
    b.check_specs([spec])  # the test driver reports the client's libvirt (9.0)
    monkeypatch.setattr(b.connection, "lib_version", 3_000_000)  # as a bhyve host on libvirt 3.0 answers
    with pytest.raises(SettingError) as exc:
        b.check_specs([spec_for(img, run_id, "c0"), spec])
    assert exc.value.key == "nic" and exc.value.value == "e1000" and "needs libvirt >= 3.1.0" in str(exc.value)
    with pytest.raises(SettingError) as exc:
        b.check_specs([VmSpec(**{**spec.__dict__, "nic": NicModel.VIRTIO, "start": "warm"})])
    assert exc.value.key == "start" and "BHYVE_SNAPSHOT" in str(exc.value)


def test_cpu_times_of_a_local_host_and_a_freebsd_host(tmp_path, golden_qcow2, run_id):  # noqa: F811 - the imported fixture
    b = qemu_backend(tmp_path)
    vm = b.clone(golden_qcow2, spec_for(golden_qcow2, run_id))
    try:
        b.start(vm)
        first = b.load_meter.cpu_times([vm])
        assert set(first) == {"at", "busy_s", "lab_s", "steal_s", "cpus"}
        assert first["cpus"] == os.cpu_count() and first["busy_s"] > 0 and first["lab_s"] >= 0
        t = time.monotonic() + 0.2
        while time.monotonic() < t:
            pass
        second = b.load_meter.cpu_times([vm])
        assert second["at"] > first["at"] and second["busy_s"] > first["busy_s"]
        # the host is this machine: this process's own CPU (as the lab's load generators') is the lab's
        assert second["lab_s"] - first["lab_s"] >= 0.1
        window = b.load_meter.window([vm])
        t = time.monotonic() + 0.5
        while time.monotonic() < t:
            pass
        load = window.stop()
        assert load.known and load.seconds >= 0.5 and load.lab_pct >= 60, load
    finally:
        b.destroy(vm)
    fake = FakeHost(
        answers={
            "sysctl -n kern.cp_time": (
                0,
                "2046 0 1567 38 456219\n4\n{ hz = 1000, tick = 1000, profhz = 8128, stathz = 127 }\n",
            )
        }
    )
    bsd = bhyve_backend(fake)
    got = bsd.load_meter.cpu_times([])
    assert got["cpus"] == 4 and got["steal_s"] is None and got["lab_s"] == 0
    assert got["busy_s"] == pytest.approx(3651 / 127)
    assert fake.remote_commands()[-1] == "sysctl -n kern.cp_time kern.smp.cpus kern.clockrate"


def test_remote_linux_host_load_is_read_over_ssh():
    stat = "cpu  100 0 100 800 0 0 0 50 0 0\ncpu0 100 0 100 800 0 0 0 50 0 0\n"
    fake = FakeHost(answers={"cat /proc/stat": (0, stat)})
    b = host("kvm1", fake, uri="qemu+ssh://root@kvm1/system")
    got = b.load_meter.cpu_times([])
    assert (got["busy_s"], got["steal_s"], got["cpus"]) == (2.0, 0.5, 1)
    assert got["lab_s"] == 0  # no domain of the lab's is up there; this machine's processes are not that host's
    assert fake.remote_commands() == ["cat /proc/stat"]
