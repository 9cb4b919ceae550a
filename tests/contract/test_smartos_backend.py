"""lab.backends.smartos against the emulated global zone, over real SSH (sshd in a network namespace),
its guests SSH-banner stubs: publish, lifecycle, addresses, gc by customer_metadata, faults, and
one-line errors for hosts that cannot be reached. Needs root (the namespace); no VMs."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from smartos_emulator import SmartosEmulator, gz_network
from smartos_emulator.fixtures import skip_unless_emulator_can_run
from support.cli import run_lab_cli

from lab import proc
from lab.backends.smartos import SmartosBackend
from lab.backends.smartos.globalzone import ConnectionLost
from lab.errors import (
    AuthError,
    BackendError,
    ConfigError,
    LabError,
    SettingError,
    TeardownError,
    UnreachableError,
    UsageError,
)
from lab.model import ImageRef, NicModel, Owned, VmSpec

FOREIGN_ZONE_IMAGE = "0d1b5a3e-7f7b-4f35-9d1e-2b6f6a7e8c91"


def tiny_image(tmp: Path) -> ImageRef:
    """A small stand-in for the golden image (16 MiB, some data at its start)."""
    raw = tmp / "tiny.raw"
    raw.write_bytes(b"lab tiny image\n" * 1000)
    with open(raw, "r+b") as fh:
        fh.truncate(16 << 20)
    disk = tmp / "tiny.qcow2"
    proc.run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(disk)])
    return ImageRef(
        name="tiny",
        os="debian",
        path=disk,
        digest="d" * 64,
        sha256="5" * 64,
        manifest={"virtual_size": 16 << 20, "boot": ["kernel", "bios", "uefi"]},
    )


@pytest.fixture(scope="module", name="host")
def host_fixture(tmp_path_factory):
    """One emulated host for the module (an SSH login costs 0.1-0.5 s: tests share the set-up), the
    tiny image published on it. Each test leaves it as it found it (see `clean`)."""
    skip_unless_emulator_can_run()
    workdir = Path(tempfile.mkdtemp(prefix="sm", dir="/var/tmp"))
    image = tiny_image(tmp_path_factory.mktemp("tiny"))
    try:
        with gz_network() as net, SmartosEmulator(workdir, net, backing="stub") as emu:
            backend(emu).publishing.publish(image)
            emu.test_image = image
            yield emu
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(name="smartos")
def clean(host):
    """The shared host, with no fault switched on; what a test leaves behind fails it."""
    host.faults.unstick()
    host.faults.fail_creates(0)
    host.faults.drops.clear()
    yield host
    left = host.vms()
    for uuid in left:
        host.gz.vmadm.main(["delete", uuid], _Sink())
    assert not host.gz.internal_errors, host.gz.internal_errors
    assert not left, f"the test left VMs behind: {[v['alias'] for v in left.values()]}"


class _Sink:
    def out(self, _):
        pass

    err = out


@pytest.fixture
def image(host) -> ImageRef:
    return host.test_image


@pytest.fixture
def published(smartos):
    return backend(smartos)


def backend(emu, **over) -> SmartosBackend:
    return SmartosBackend("sm", emu.settings(**over), emu.env())


def spec(
    image: ImageRef,
    name: str = "lab-r1-c01",
    *,
    run_id: str = "r1",
    nic=NicModel.VIRTIO,
    expires_at: float = 1_900_000_000.0,
) -> VmSpec:
    return VmSpec(
        name=name,
        run_id=run_id,
        cell_id=name.rsplit("-", 1)[-1],
        image=image,
        nic=nic,
        vcpus=2,
        memory_mib=512,
        expires_at=expires_at,
    )


def delete_directly(emu, uuid: str) -> None:
    """As the VM's owner would (the lab never deletes a VM without its marker)."""
    assert emu.gz.vmadm.main(["delete", uuid], _Sink()) == 0


def foreign_vm(emu, alias="someone-elses-vm", ip="10.0.0.10") -> str:
    """A VM the lab did not make (no marker), created over SSH as its owner would."""
    b = backend(emu)
    image_uuid = b._image_uuid(emu.test_image) if hasattr(emu, "test_image") else None
    payload = {
        "brand": "bhyve",
        "alias": alias,
        "autoboot": False,
        "ram": 256,
        "vcpus": 1,
        "nics": [{"nic_tag": "external", "model": "virtio", "ips": [f"{ip}/24"]}],
        "disks": [{"boot": True, "model": "virtio", **({"image_uuid": image_uuid} if image_uuid else {"size": 16})}],
        "customer_metadata": {"owner": "not the lab", "lab:run": "r1"},
    }
    b.gz.run(["vmadm", "create"], input=json.dumps(payload))
    (uuid,) = [u for u, vm in emu.vms().items() if vm["alias"] == alias]
    return uuid


def test_check_reads_sysinfo_and_refuses_an_unknown_nic_tag(smartos):
    b = backend(smartos)
    b.check()
    facts, host = b.facts(), b.host_facts()
    assert facts["hypervisor"] == "smartos" and facts["brand"] == "bhyve" and facts["platform"] == "20260306T044811Z"
    assert host["cores"] == os.cpu_count() and host["mem_kib"] > 0 and host["bhyve_capable"] is True
    with pytest.raises(ConfigError, match=r"hosts\.sm\.nic_tag = 'storage': the host has no such NIC tag"):
        backend(smartos, nic_tag="storage").check()
    b.check_specs([spec(smartos.test_image)])
    smartos.gz.bhyve_max_vcpus = 16
    try:
        with pytest.raises(SettingError, match="more than the 16 vCPUs bhyve takes") as err:
            backend(smartos).check_specs(
                [
                    VmSpec(
                        name="lab-r1-c02",
                        run_id="r1",
                        cell_id="c02",
                        image=smartos.test_image,
                        nic=NicModel.VIRTIO,
                        vcpus=24,
                        memory_mib=512,
                    )
                ]
            )
        assert err.value.key == "vcpus"
    finally:
        smartos.gz.bhyve_max_vcpus = 32
    with pytest.raises(SettingError, match="MiB .* has") as err:
        b.check_specs(
            [
                VmSpec(
                    name="lab-r1-c02",
                    run_id="r1",
                    cell_id="c02",
                    image=smartos.test_image,
                    nic=NicModel.VIRTIO,
                    vcpus=1,
                    memory_mib=host["mem_kib"] // 1024 + 1024,
                )
            ]
        )
    assert err.value.key == "memory_mib"
    smartos.gz.live_image = "20250102T000000Z"  # before SmartOS made NoCloud disks for bhyve guests
    try:
        with pytest.raises(ConfigError, match=r"hosts\.sm\.addresses = .*predates SmartOS's NoCloud disk"):
            backend(smartos).check()
        backend(smartos, addresses="").check()  # DHCP is fine there
        backend(smartos, brand="kvm").check()  # and KVM hands out static addresses by DHCP
    finally:
        smartos.gz.live_image = "20260306T044811Z"


def test_publish_made_one_tagged_image_and_left_nothing_else(smartos, image):
    (manifest,) = smartos.images().values()
    assert manifest["name"] == "lab-tiny" and manifest["type"] == "zvol" and manifest["image_size"] == 16
    assert manifest["tags"]["lab:sha256"] == image.sha256 and manifest["tags"]["lab:digest"] == image.digest
    assert manifest["tags"]["org.smartos:cloudinit_datasource"] == "nocloud"
    assert manifest["requirements"] == {"brand": "bhyve"} and manifest["os"] == "linux"
    img = smartos.gz.imgadm.images[manifest["uuid"]]
    assert img.file.read_bytes()[:15] == b"lab tiny image\n"  # the disk's bytes went through dd, create, install
    assert smartos.vms() == {}, "the proto VM is deleted"
    assert list(smartos.gz.path("/var/tmp/x").parent.iterdir()) == [], "imgadm create's files are removed"
    installs = sum(c.startswith("imgadm install") for c in smartos.gz.commands)
    backend(smartos).publishing.publish(image)  # again: nothing changes
    assert list(smartos.images()) == [manifest["uuid"]]
    assert sum(c.startswith("imgadm install") for c in smartos.gz.commands) == installs
    backend(smartos).check_images([image])
    other = ImageRef(
        name="tiny", os="debian", path=image.path, digest="e" * 64, sha256="6" * 64, manifest=image.manifest
    )
    with pytest.raises(UsageError, match="another recipe") as err:
        backend(smartos).check_images([other])
    assert err.value.hint == "lab images publish tiny sm"
    with pytest.raises(UsageError, match="has no image lab-tiny for the kvm brand"):
        backend(smartos, brand="kvm").check_images([image])


def test_a_new_build_replaces_the_published_image_once_unused(published, smartos, image):
    def build(n: str) -> ImageRef:
        return ImageRef(
            name="tiny", os="debian", path=image.path, digest=n * 64, sha256=n * 64, manifest=image.manifest
        )

    vm = published.clone(image, spec(image))
    published.publishing.publish(build("6"))  # the older image has a clone: kept
    assert sorted(m["tags"]["lab:sha256"][0] for m in smartos.images().values()) == ["5", "6"]
    published.destroy(vm)
    published.publishing.publish(build("7"))  # both others are unused now: they go
    assert [m["tags"]["lab:sha256"][0] for m in smartos.images().values()] == ["7"]
    published.publishing.publish(image)  # (the module's image back)
    assert [m["tags"]["lab:sha256"] for m in smartos.images().values()] == [image.sha256]


def test_lifecycle(published, smartos, image):
    b = published
    client = b.open_run("r1")
    try:
        assert client.address == f"{smartos.net.subnet}.1" and client.netns == smartos.net.netns
        vm = b.clone(image, spec(image))
        (obj,) = smartos.vms().values()
        assert obj["state"] == "stopped" and obj["brand"] == "bhyve" and obj["vcpus"] == 2 and obj["ram"] == 512
        assert obj["nics"][0]["model"] == "virtio" and obj["nics"][0]["ips"] == [f"{smartos.net.subnet}.10/24"]
        assert obj["disks"][0]["model"] == "virtio" and obj["disks"][0]["image_uuid"] == vm.facts["image_uuid"]
        assert obj["disks"][1]["cloudinit_datasource"] == "nocloud"
        assert obj["customer_metadata"]["lab:run"] == "r1" and obj["customer_metadata"]["lab:managed"] == "true"
        assert vm.address == f"{smartos.net.subnet}.10" and vm.handle["mac"] == obj["nics"][0]["mac"]
        b.start(vm)
        assert b.wait_ready(vm) == f"{smartos.net.subnet}.10"
        assert vm.facts["address_source"] == "static" and smartos.vms()[vm.handle["uuid"]]["state"] == "running"
        assert b.run_is_live("r1") is True
        b.destroy(vm)
        b.destroy(vm)  # idempotent
        assert smartos.vms() == {} and smartos.guests() == []
        assert not list(smartos.gz.root.joinpath("dev/zvol/rdsk/zones").iterdir())
    finally:
        b.close_run("r1")
    assert b.run_is_live("r1") is None  # finished: its lock is gone


def test_dhcp_address_comes_from_the_arp_table(published, smartos, image):
    b = backend(smartos, addresses="")
    vm = b.clone(image, spec(image))
    assert vm.address == "" and smartos.vms()[vm.handle["uuid"]]["nics"][0]["ips"] == ["dhcp"]
    b.start(vm)
    assert b.wait_ready(vm) == f"{smartos.net.subnet}.150"
    assert vm.facts["address_source"] == "arp"
    b.destroy(vm)


def test_pool_skips_addresses_any_vm_on_the_host_has(published, smartos, image):
    foreign = foreign_vm(smartos, ip=f"{smartos.net.subnet}.10")
    a = published.clone(image, spec(image, "lab-r1-c01"))
    b2 = backend(smartos)  # another lab run on another machine: sees a's address on the host
    b = b2.clone(image, spec(image, "lab-r2-c01", run_id="r2"))
    assert (a.address, b.address) == (f"{smartos.net.subnet}.11", f"{smartos.net.subnet}.12")
    published.destroy(a)
    b2.destroy(b)
    delete_directly(smartos, foreign)


def test_gc_finds_lab_vms_by_customer_metadata_and_never_touches_others(published, smartos, image):
    foreign = foreign_vm(smartos)
    mine = published.clone(image, spec(image, "lab-r1-c01"))
    owned = [o for o in published.list_owned() if o.kind == "vm"]
    assert [(o.name, o.run_id, o.expires_at, o.detail) for o in owned] == [
        ("lab-r1-c01", "r1", 1_900_000_000.0, mine.handle["uuid"])
    ]
    published.remove_owned(owned[0])
    assert list(smartos.vms()) == [foreign]
    forged = Owned(backend="smartos", kind="vm", name="lab-rX-c01", run_id="rX", detail=foreign)
    with pytest.raises(BackendError, match="does not carry the lab's marker"):
        published.remove_owned(forged)
    assert list(smartos.vms()) == [foreign]
    delete_directly(smartos, foreign)


def test_lab_gc_cli_removes_an_expired_leftover_and_keeps_a_foreign_vm(published, smartos, image, tmp_path):
    foreign = foreign_vm(smartos)
    left = published.clone(image, spec(image, "lab-dead1-c01", run_id="dead1", expires_at=time.time() - 60))
    live = published.clone(image, spec(image, "lab-other-c01", run_id="other", expires_at=time.time() + 3600))
    host = smartos.table()
    lines = [
        f"{k} = {json.dumps(v)}"
        if not isinstance(v, dict)
        else f"{k} = {{ {', '.join(f'{kk} = {json.dumps(vv)}' for kk, vv in v.items())} }}"
        for k, v in host.items()
    ]
    toml = tmp_path / "lab.toml"
    toml.write_text(
        textwrap.dedent(f"""
        [lab]
        results = "{tmp_path / "results"}"
        [hosts.sm]
        """)
        + "\n".join(lines)
        + '\n[matrix]\nhost = ["sm"]\nimage = ["debian12"]\n'
    )
    res = run_lab_cli("gc", "-c", str(toml), cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "removed sm vm lab-dead1-c01" in res.stdout
    assert "keep   sm vm lab-other-c01" in res.stdout
    assert sorted(smartos.vms()) == sorted([foreign, live.handle["uuid"]])
    assert left.handle["uuid"] not in smartos.vms()
    published.destroy(live)
    delete_directly(smartos, foreign)


def test_a_failing_create_leaves_nothing(published, smartos, image):
    smartos.faults.fail_creates(1)
    with pytest.raises(BackendError, match="out of space"):
        published.clone(image, spec(image))
    assert smartos.vms() == {}
    smartos.faults.fail_creates(1, leave_failed=True)  # a provision that failed midway: state `failed`
    with pytest.raises(BackendError, match="out of space"):
        published.clone(image, spec(image))
    assert smartos.vms() == {}
    vm = published.clone(image, spec(image))  # and the address it held is free again
    assert vm.address == f"{smartos.net.subnet}.10"
    published.destroy(vm)


def test_a_create_whose_connection_dropped(published, smartos, image):
    smartos.faults.drop_ssh("vmadm create", when="after")  # it went through; its answer was lost
    vm = published.clone(image, spec(image))
    assert list(smartos.vms()) == [vm.handle["uuid"]]
    published.destroy(vm)
    smartos.faults.drop_ssh("vmadm create", when="before")  # it never ran
    with pytest.raises(BackendError, match="the SSH connection dropped during `vmadm create"):
        published.clone(image, spec(image))
    assert smartos.vms() == {}


def test_reads_survive_one_dropped_connection(published, smartos, image):
    vm = published.clone(image, spec(image))
    published.start(vm)
    smartos.faults.drop_ssh("vmadm list", when="before")
    assert published.wait_ready(vm)
    smartos.faults.drop_ssh("vmadm lookup", when="before", times=2)
    with pytest.raises(ConnectionLost):
        published.machines.get(vm.handle["uuid"])
    published.destroy(vm)


def test_a_vm_stuck_in_stopping_is_deleted_once_it_lets_go(published, smartos, image):
    vm = published.clone(image, spec(image))
    published.start(vm)
    smartos.faults.stick(vm.name)
    smartos.faults.stuck_seconds = 0.5
    threading.Timer(2.0, smartos.faults.unstick).start()
    t0 = time.monotonic()
    published.destroy(vm)
    assert smartos.vms() == {} and time.monotonic() - t0 >= 2.0


@pytest.mark.parametrize("hang_s", [0.3, 6.0])  # refused after a while; or hung past the delete timeout
def test_a_vm_stuck_for_good_fails_teardown_in_one_line_and_gc_removes_it_later(smartos, image, hang_s):
    b = backend(smartos, timeouts={"delete": 3})
    vm = b.clone(image, spec(image))
    b.start(vm)
    smartos.faults.stick("*")
    smartos.faults.stuck_seconds = hang_s
    with pytest.raises(TeardownError) as err:
        b.destroy(vm)
    assert "\n" not in str(err.value) and "state stopping" in str(err.value)
    assert smartos.vms()[vm.handle["uuid"]]["state"] == "stopping"
    smartos.faults.unstick()
    (item,) = [o for o in b.list_owned() if o.kind == "vm"]
    b.remove_owned(item)
    assert smartos.vms() == {}


def test_unreachable_and_refused_global_zones_are_one_line(smartos):
    for over, kind, text in (
        ({"ssh_port": 2222}, UnreachableError, "cannot be reached over SSH"),
        ({"ssh": "root@10.255.255.1", "timeouts": {"connect": 1}}, UnreachableError, "cannot be reached over SSH"),
        ({"ssh_key": str(smartos.workdir / "nokey")}, AuthError, "refused the SSH login"),
    ):
        if "nokey" in str(over.get("ssh_key", "")):
            proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(smartos.workdir / "nokey")])
        with pytest.raises(kind, match=text) as err:
            backend(smartos, **over).check()
        assert "\n" not in str(err.value) and "host 'sm'" in str(err.value)


def test_lab_run_against_an_unreachable_host_is_one_line_exit_2(smartos, tmp_path):
    toml = tmp_path / "lab.toml"
    toml.write_text(
        textwrap.dedent(f"""
        [lab]
        results = "{tmp_path / "results"}"
        [hosts.sm]
        backend = "smartos"
        ssh = "root@{smartos.net.admin_ip}"
        ssh_port = 2222
        [matrix]
        host = ["sm"]
        image = ["debian12"]
        [suite]
        workloads = ["sysbench-cpu"]
        """)
    )
    res = run_lab_cli("run", "-c", str(toml), cwd=tmp_path, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "cannot be reached over SSH" in res.stderr and "Traceback" not in res.stderr
    assert smartos.vms() == {}


def test_a_zone_for_the_isolation_axis(smartos, tmp_path):
    smartos.install_zone_image(FOREIGN_ZONE_IMAGE, name="base-64-lts", kind="zone-dataset", os_name="smartos")
    # the zone trusts the lab's public key; the emulator's own stands in for it where no image was
    # built (make test-fast on a fresh clone has no images/lab_key)
    env = dataclasses.replace(smartos.env(), ssh_key=smartos.sshd.client_key)
    b = SmartosBackend("sm", smartos.settings(), env)
    zone = b.create_zone(
        spec(ImageRef(name="base-64-lts", os="smartos", path=Path("-"), digest="z")),
        brand="joyent",
        image_uuid=FOREIGN_ZONE_IMAGE,
    )
    obj = smartos.vms()[zone.handle["uuid"]]
    assert obj["brand"] == "joyent" and obj["type"] == "OS" and obj["max_physical_memory"] == 512
    assert obj["customer_metadata"]["root_authorized_keys"].startswith("ssh-")
    b.start(zone)
    assert b.wait_ready(zone) == zone.address
    assert [o.name for o in b.list_owned() if o.kind == "vm"] == ["lab-r1-c01"]
    b.destroy(zone)
    assert smartos.vms() == {}
    del smartos.gz.imgadm.images[FOREIGN_ZONE_IMAGE]


def test_a_live_vms_lease_is_renewed_with_vmadm_update(published, smartos, image):
    """Issue 35: the lease in customer_metadata names the run's owner, and `vmadm update`'s
    set_customer_metadata moves its expiry while the VM stands; gc reads both back."""
    owner = "abcdefabcdef-0123456789ab"
    vm = published.clone(image, dataclasses.replace(spec(image), owner=owner))
    try:
        published.renew_lease(vm, 1_950_000_000.4)
        meta = smartos.vms()[vm.handle["uuid"]]["customer_metadata"]
        assert meta["lab:expires"] == "1950000000" and meta["lab:owner"] == owner and meta["lab:managed"] == "true"
        (owned,) = [o for o in published.list_owned() if o.kind == "vm"]
        assert (owned.expires_at, owned.owner) == (1_950_000_000.0, owner)
    finally:
        published.destroy(vm)
    with pytest.raises(LabError, match="vmadm update"):
        published.renew_lease(vm, 1_960_000_000.0)  # gone: the run warns and goes on
