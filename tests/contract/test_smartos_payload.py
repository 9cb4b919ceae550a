"""Pure: the SmartOS backend's payloads and settings, and the emulator's vmadm payload validation
(one test per rule of vmadm(8)'s properties). No SSH, no VMs, no root."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from smartos_emulator.backing import network_config
from smartos_emulator.schema import Host, validate_create

from lab.backends import backend_class, capabilities, settings_model
from lab.backends.base import check_spec
from lab.backends.smartos import payload
from lab.backends.smartos.backend import nic_tags
from lab.backends.smartos.settings import Settings
from lab.backends.smartos.vms import illumos_arp_address
from lab.errors import SettingError
from lab.model import CloneKind, DiskBus, ImageRef, NicModel, VmSpec

IMAGE_UUID = "1c4b5a3e-7f7b-4f35-9d1e-2b6f6a7e8c90"
ZONE_IMAGE = "0d1b5a3e-7f7b-4f35-9d1e-2b6f6a7e8c91"
VM_UUID = "5f7a53e9-fc4d-d94b-9205-9ff110742aaf"
HOST = Host(
    nic_tags=frozenset({"admin", "external"}),
    images={
        IMAGE_UUID: {"uuid": IMAGE_UUID, "type": "zvol", "requirements": {}},
        ZONE_IMAGE: {"uuid": ZONE_IMAGE, "type": "zone-dataset"},
    },
)
IMAGE = ImageRef(
    name="debian12",
    os="debian",
    path=Path("debian12.qcow2"),
    digest="d" * 64,
    sha256="a" * 64,
    manifest={"virtual_size": 4 << 30, "boot": ["kernel", "bios", "uefi"]},
)


def settings(**over) -> Settings:
    return Settings.model_validate(
        {"backend": "smartos", "ssh": "root@gz1", "addresses": "10.0.0.10-10.0.0.19", "gateway": "10.0.0.1", **over}
    )


def spec(nic=NicModel.VIRTIO, disk=DiskBus.VIRTIO, **over) -> VmSpec:
    return VmSpec(
        **{
            "name": "lab-r1-c01",
            "run_id": "r1",
            "cell_id": "c01",
            "image": IMAGE,
            "nic": nic,
            "vcpus": 2,
            "memory_mib": 1024,
            "disk_bus": disk,
            "expires_at": 1_900_000_000.0,
            **over,
        }
    )


def good_vm(brand: str = "bhyve") -> dict:
    return payload.vm_payload(settings(brand=brand), spec(), uuid=VM_UUID, image_uuid=IMAGE_UUID, ip="10.0.0.10")


def problems_of(p: dict) -> dict:
    return validate_create(p, HOST).as_json()


# -- the backend's settings, registry and capabilities ---------------------------------------------------


def test_registered_as_a_backend():
    assert settings_model("smartos") is Settings
    assert backend_class("smartos").name == "smartos"


@pytest.mark.parametrize(
    "table,key",
    [
        ({"ssh": "-oProxyCommand=sh"}, "ssh"),
        ({"ssh": "root@gz1; rm"}, "ssh"),
        ({"brand": "xen"}, "brand"),
        ({"addresses": "10.0.0.9-10.0.0.1"}, "addresses"),
        ({"gateway": "gw"}, "gateway"),
        ({"ssh_options": ["-v"]}, "ssh_options"),
        ({"nic_tag": "a b"}, "nic_tag"),
        ({"timeouts": {"boot": 5}}, "timeouts"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_bad_settings_are_refused(table, key):
    with pytest.raises(ValueError, match=key):
        Settings.model_validate({"backend": "smartos", "ssh": "root@gz1", **table})


def test_cross_key_problems():
    assert settings(brand="kvm", bootrom="uefi").problems()[0][0] == "bootrom"
    assert settings(addresses="10.0.0.0/29", gateway="10.0.0.1").problems()[0][0] == "gateway"
    assert settings().problems() == []


def test_capabilities_per_brand():
    bhyve, kvm = capabilities(settings()), capabilities(settings(brand="kvm"))
    assert bhyve.nic_models == {NicModel.VIRTIO, NicModel.E1000}
    assert bhyve.disk_buses == {DiskBus.VIRTIO, DiskBus.SATA, DiskBus.NVME}
    assert kvm.nic_models == {NicModel.VIRTIO, NicModel.E1000, NicModel.RTL8139}
    assert kvm.disk_buses == {DiskBus.VIRTIO, DiskBus.IDE, DiskBus.SCSI}
    assert bhyve.clone_kinds == {CloneKind.LINKED} and bhyve.boot_modes == {"bios"}
    assert capabilities(settings(bootrom="uefi")).boot_modes == {"uefi"}
    assert not bhyve.lab_side_link and not bhyve.bare_metal and bhyve.publish


@pytest.mark.parametrize(
    "cell,key",
    [
        ({"nic": NicModel.RTL8139}, "nic"),
        ({"disk": DiskBus.SCSI}, "disk_bus"),
        ({"clone": CloneKind.FULL}, "clone"),
        ({"vcpus": 33}, "vcpus"),
    ],
)
def test_plan_refuses_what_bhyve_cannot_make(cell, key):
    s = spec(nic=cell.pop("nic", NicModel.VIRTIO), disk=cell.pop("disk", DiskBus.VIRTIO), **cell)
    with pytest.raises(SettingError) as err:
        check_spec(capabilities(settings()), s, "host 'sm'")
    assert err.value.key == key


# -- payloads ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "brand,nic,disk",
    [
        ("bhyve", NicModel.VIRTIO, DiskBus.VIRTIO),
        ("bhyve", NicModel.E1000, DiskBus.SATA),
        ("bhyve", NicModel.VIRTIO, DiskBus.NVME),
        ("kvm", NicModel.RTL8139, DiskBus.IDE),
        ("kvm", NicModel.E1000, DiskBus.SCSI),
        ("kvm", NicModel.VIRTIO, DiskBus.VIRTIO),
    ],
)
def test_every_cell_the_backend_makes_is_a_valid_payload(brand, nic, disk):
    p = payload.vm_payload(
        settings(brand=brand), spec(nic=nic, disk=disk), uuid=VM_UUID, image_uuid=IMAGE_UUID, ip="10.0.0.10"
    )
    assert problems_of(p) == {}
    assert p["vcpus"] == 2 and p["ram"] == 1024 and p["autoboot"] is False and p["alias"] == "lab-r1-c01"
    assert p["nics"][0]["ips"] == ["10.0.0.10/24"] and p["nics"][0]["gateways"] == ["10.0.0.1"]
    assert p["customer_metadata"] == {
        "lab:managed": "true",
        "lab:run": "r1",
        "lab:cell": "c01",
        "lab:vm": "lab-r1-c01",
        "lab:expires": "1900000000",
    }


def test_dhcp_payload_and_zone_payloads_are_valid():
    dhcp = payload.vm_payload(settings(addresses=""), spec(), uuid=VM_UUID, image_uuid=IMAGE_UUID, ip="")
    assert dhcp["nics"][0]["ips"] == ["dhcp"] and "gateways" not in dhcp["nics"][0]
    assert problems_of(dhcp) == {}
    for brand, kv in (("joyent", ""), ("lx", "5.10.0")):
        z = payload.zone_payload(
            settings(),
            spec(),
            uuid=VM_UUID,
            brand=brand,
            image_uuid=ZONE_IMAGE,
            ip="10.0.0.11",
            authorized_keys="ssh-ed25519 AAAA lab",
            kernel_version=kv,
        )
        assert problems_of(z) == {}, brand
        assert "model" not in z["nics"][0] and z["cpu_cap"] == 200 and z["max_physical_memory"] == 1024
    with pytest.raises(ValueError, match="kernel version"):
        payload.zone_payload(
            settings(), spec(), uuid=VM_UUID, brand="lx", image_uuid=ZONE_IMAGE, ip="", authorized_keys="k"
        )


def test_proto_payload_and_manifest():
    proto = payload.proto_payload(settings(), IMAGE, uuid=VM_UUID, alias="lab-publish-debian12", expires_at=5.0)
    assert proto["disks"] == [{"boot": True, "model": "virtio", "size": 4096, "zpool": "zones"}]
    assert problems_of(proto) == {}
    m = payload.image_manifest(settings(), IMAGE)
    assert m["name"] == "lab-debian12" and m["os"] == "linux" and m["requirements"] == {"brand": "bhyve"}
    assert m["tags"]["lab:digest"] == IMAGE.digest and m["tags"]["lab:sha256"] == IMAGE.sha256
    assert m["tags"][payload.NOCLOUD_TAG] == "nocloud"
    assert payload.NOCLOUD_TAG not in payload.image_manifest(settings(brand="kvm"), IMAGE)["tags"]


def test_published_and_usable_images():
    def entry(uuid, digest, sha, brand="bhyve", name="lab-debian12"):
        return {
            "manifest": {
                "uuid": uuid,
                "name": name,
                "requirements": {"brand": brand},
                "tags": {"lab:managed": "true", "lab:digest": digest, "lab:sha256": sha},
            }
        }

    same = entry("u1", IMAGE.digest, IMAGE.sha256)
    old = entry("u0", "x" * 64, "y" * 64)
    other_brand = entry("u2", IMAGE.digest, IMAGE.sha256, brand="kvm")
    foreign = {"manifest": {"uuid": "u3", "name": "lab-debian12", "tags": {}}}
    assert payload.published([old, same, other_brand, foreign], settings(), IMAGE) == ("u1", ["u0"])
    assert payload.usable_image([old, same], settings(), IMAGE) == ("u1", "")
    rebuilt = entry("u4", IMAGE.digest, "z" * 64)  # same recipe, another build: still usable
    assert payload.usable_image([rebuilt], settings(), IMAGE) == ("u4", "")
    found, why = payload.usable_image([old], settings(), IMAGE)
    assert found is None and "another recipe" in why
    assert payload.usable_image([foreign, other_brand], settings(), IMAGE)[0] is None


def test_leases_and_addresses_read_back():
    vm = {
        "uuid": VM_UUID,
        "alias": "lab-r1-c01",
        "customer_metadata": payload.lease(spec()),
        "nics": [{"mac": "90:B8:D0:01:02:03", "ips": ["10.0.0.10/24"], "primary": True}],
    }
    assert payload.is_ours(vm) and payload.lease_of(vm) == ("r1", "lab-r1-c01", 1_900_000_000.0)
    assert payload.address_of(vm) == "10.0.0.10" and payload.mac_of(vm) == "90:b8:d0:01:02:03"
    assert not payload.is_ours({"customer_metadata": {"lab:managed": "yes"}}) and not payload.is_ours({})
    assert payload.addresses_in_use([vm, {"nics": [{"ips": ["dhcp"]}, {"ip": "10.0.0.12"}]}]) == {
        "10.0.0.10",
        "10.0.0.12",
    }


def test_sysinfo_nic_tags_and_illumos_arp():
    info = {
        "Network Interfaces": {"ixgbe0": {"NIC Names": ["admin"]}, "ixgbe1": {"NIC Names": ["external"]}},
        "Virtual Network Interfaces": {"ext0": {"Overlay Nic Tags": "sdc_overlay, x"}},
    }
    assert nic_tags(info) == {"ixgbe0", "ixgbe1", "admin", "external", "ext0", "sdc_overlay", "x"}
    arp = (
        "\nNet to Media Table: IPv4\nDevice   IP Address               Mask      Flags      Phys Addr\n"
        "------ -------------------- --------------- -------- ---------------\n"
        "e1000g0 10.0.0.1             255.255.255.255 SPLA     52:54:0:0:0:1\n"
        "e1000g0 10.0.0.150           255.255.255.255          90:b8:d0:a:b:c\n"
    )
    assert illumos_arp_address(arp, "90:B8:D0:0A:0B:0C") == "10.0.0.150"
    assert illumos_arp_address(arp, "90:b8:d0:00:00:00") == ""


def test_network_config_is_what_the_golden_guest_reads():
    nics = [
        {
            "interface": "net0",
            "mac": "90:B8:D0:01:02:03",
            "ips": ["10.0.0.10/24"],
            "gateways": ["10.0.0.1"],
            "primary": True,
        }
    ]
    text = network_config(nics, [])
    assert text.splitlines()[:4] == ["version: 2", "ethernets:", "  net0:", "    match:"]
    assert '      macaddress: "90:b8:d0:01:02:03"' in text and "      - 10.0.0.10/24" in text
    assert "    gateway4: 10.0.0.1" in text


# -- the emulator's validation: one rule each --------------------------------------------------------------


def mutate(fn, brand="bhyve") -> dict:
    p = copy.deepcopy(good_vm(brand))
    fn(p)
    return problems_of(p)


@pytest.mark.parametrize(
    "name,fn,brand,expect",
    [
        ("unknown property", lambda p: p.update(colour="blue"), "bhyve", {"bad_properties": ["colour"]}),
        ("property of another brand", lambda p: p.update(cpu_type="host"), "bhyve", {"bad_properties": ["cpu_type"]}),
        ("bhyve-only property on kvm", lambda p: p.update(bootrom="bios"), "kvm", {"bad_properties": ["bootrom"]}),
        ("not at create: state", lambda p: p.update(state="running"), "bhyve", {"bad_properties": ["state"]}),
        ("integer as string", lambda p: p.update(ram="1024"), "bhyve", {"bad_values": ["ram"]}),
        ("boolean as string", lambda p: p.update(autoboot="false"), "bhyve", {"bad_values": ["autoboot"]}),
        ("integer below its minimum", lambda p: p.update(vcpus=0), "bhyve", {"bad_values": ["vcpus"]}),
        ("max_swap below 256", lambda p: p.update(max_swap=128), "bhyve", {"bad_values": ["max_swap"]}),
        ("uuid malformed", lambda p: p.update(uuid="not-a-uuid"), "bhyve", {"bad_values": ["uuid"]}),
        ("bootrom value", lambda p: p.update(bootrom="coreboot"), "bhyve", {"bad_values": ["bootrom"]}),
        ("cpu_type value", lambda p: p.update(cpu_type="max"), "kvm", {"bad_values": ["cpu_type"]}),
        ("vga value", lambda p: p.update(vga="virtio"), "kvm", {"bad_values": ["vga"]}),
        (
            "customer_metadata value not a string",
            lambda p: p["customer_metadata"].update(n=1),
            "bhyve",
            {"bad_values": ["customer_metadata"]},
        ),
        (
            "nics not an array of objects",
            lambda p: p.update(nics={"nic_tag": "external"}),
            "bhyve",
            {"bad_values": ["nics"]},
        ),
        (
            "bhyve NIC model rtl8139",
            lambda p: p["nics"][0].update(model="rtl8139"),
            "bhyve",
            {"bad_values": ["nics.0.model"]},
        ),
        ("kvm NIC model viona", lambda p: p["nics"][0].update(model="viona"), "kvm", {"bad_values": ["nics.0.model"]}),
        ("NIC model missing", lambda p: p["nics"][0].pop("model"), "bhyve", {"missing_properties": ["nics.0.model"]}),
        ("nic_tag missing", lambda p: p["nics"][0].pop("nic_tag"), "bhyve", {"missing_properties": ["nics.0.nic_tag"]}),
        (
            "nic_tag unknown to the host",
            lambda p: p["nics"][0].update(nic_tag="storage"),
            "bhyve",
            {"bad_values": ["nics.0.nic_tag"]},
        ),
        (
            "ips without prefix",
            lambda p: p["nics"][0].update(ips=["10.0.0.10"]),
            "bhyve",
            {"bad_values": ["nics.0.ips"]},
        ),
        (
            "kvm NIC with two addresses",
            lambda p: p["nics"][0].update(ips=["10.0.0.10/24", "10.0.0.11/24"]),
            "kvm",
            {"bad_values": ["nics.0.ips"]},
        ),
        (
            "gateway not IPv4",
            lambda p: p["nics"][0].update(gateways=["gw"]),
            "bhyve",
            {"bad_values": ["nics.0.gateways"]},
        ),
        ("mac malformed", lambda p: p["nics"][0].update(mac="90:b8:d0"), "bhyve", {"bad_values": ["nics.0.mac"]}),
        ("primary false", lambda p: p["nics"][0].update(primary=False), "bhyve", {"bad_values": ["nics.0.primary"]}),
        (
            "two primary NICs",
            lambda p: p["nics"].append(dict(p["nics"][0], ips=["dhcp"])),
            "bhyve",
            {"bad_values": ["nics"]},
        ),
        (
            "vlan_id above 4095",
            lambda p: p["nics"][0].update(vlan_id=4096),
            "bhyve",
            {"bad_values": ["nics.0.vlan_id"]},
        ),
        ("mtu below 576", lambda p: p["nics"][0].update(mtu=500), "bhyve", {"bad_values": ["nics.0.mtu"]}),
        (
            "OS-only NIC property on HVM",
            lambda p: p["nics"][0].update(vrrp_vrid=1),
            "bhyve",
            {"bad_properties": ["nics.0.vrrp_vrid"]},
        ),
        (
            "unknown NIC property",
            lambda p: p["nics"][0].update(speed=1000),
            "bhyve",
            {"bad_properties": ["nics.0.speed"]},
        ),
        (
            "bhyve disk model ide",
            lambda p: p["disks"][0].update(model="ide"),
            "bhyve",
            {"bad_values": ["disks.0.model"]},
        ),
        ("kvm disk model nvme", lambda p: p["disks"][0].update(model="nvme"), "kvm", {"bad_values": ["disks.0.model"]}),
        (
            "disk model missing",
            lambda p: p["disks"][0].pop("model"),
            "bhyve",
            {"missing_properties": ["disks.0.model"]},
        ),
        (
            "size with image_uuid",
            lambda p: p["disks"][0].update(size=4096),
            "bhyve",
            {"bad_properties": ["disks.0.size"]},
        ),
        (
            "neither size nor image",
            lambda p: p["disks"][0].pop("image_uuid"),
            "bhyve",
            {"missing_properties": ["disks.0.size"]},
        ),
        (
            "image_size without image_uuid",
            lambda p: p["disks"][0].update(image_size=4096, size=4096) or p["disks"][0].pop("image_uuid"),
            "bhyve",
            {"bad_properties": ["disks.0.image_size"]},
        ),
        (
            "block_size with image_uuid",
            lambda p: p["disks"][0].update(block_size=4096),
            "bhyve",
            {"bad_properties": ["disks.0.block_size"]},
        ),
        (
            "block_size not a power of 2",
            lambda p: p["disks"][0].update(block_size=3000, size=10) or p["disks"][0].pop("image_uuid"),
            "bhyve",
            {"bad_values": ["disks.0.block_size"]},
        ),
        (
            "two boot disks",
            lambda p: p["disks"].append({"boot": True, "model": "virtio", "size": 10}),
            "bhyve",
            {"bad_values": ["disks"]},
        ),
        (
            "bhyve-only disk property on kvm",
            lambda p: p["disks"][0].update(notrim=True),
            "kvm",
            {"bad_properties": ["disks.0.notrim"]},
        ),
        (
            "image not installed",
            lambda p: p["disks"][0].update(image_uuid=VM_UUID),
            "bhyve",
            {"bad_values": ["disks.0.image_uuid"]},
        ),
        (
            "zone image as a disk",
            lambda p: p["disks"][0].update(image_uuid=ZONE_IMAGE),
            "bhyve",
            {"bad_values": ["disks.0.image_uuid"]},
        ),
        ("unknown zpool", lambda p: p.update(zpool="tank"), "bhyve", {"bad_values": ["zpool"]}),
    ],
)
def test_each_vmadm_rule(name, fn, brand, expect):
    assert mutate(fn, brand) == expect, name


def test_brand_rules():
    assert problems_of({"alias": "x"}) == {"missing_properties": ["brand"]}
    assert problems_of({"brand": "xen"}) == {"bad_brand": "xen"}
    assert problems_of({"brand": "joyent"}) == {"missing_properties": ["image_uuid"]}
    assert problems_of({"brand": "lx", "image_uuid": ZONE_IMAGE}) == {"missing_properties": ["kernel_version"]}
    assert problems_of({"brand": "joyent", "image_uuid": ZONE_IMAGE, "vcpus": 2}) == {"bad_properties": ["vcpus"]}
    assert problems_of({"brand": "joyent", "image_uuid": IMAGE_UUID}) == {"bad_values": ["image_uuid"]}
    assert problems_of(["not", "an", "object"]) == {"bad_values": ["payload"]}


def test_image_of_another_brand_is_refused():
    host = Host(
        nic_tags=frozenset({"external"}),
        images={IMAGE_UUID: {"uuid": IMAGE_UUID, "type": "zvol", "requirements": {"brand": "kvm"}}},
    )
    assert validate_create(good_vm("bhyve"), host).as_json() == {"bad_values": ["disks.0.image_uuid"]}
    assert not validate_create(good_vm("kvm"), host)


def test_publish_sends_the_raw_disks_data_runs_block_aligned_merged_and_capped(tmp_path):
    """What `lab images publish` sends of a raw disk: its data from the holes, on 1 MiB blocks (dd's
    seek= counts them), holes under 16 MiB sent as zeros, runs of at most 256 MiB; none of a hole."""
    from lab.backends.smartos.publish import BLOCK, MAX_RUN, data_runs

    raw = tmp_path / "disk.raw"
    mib = 1 << 20
    with open(raw, "wb") as fh:
        fh.truncate(2048 * mib)
        writes = ((4096, 100), (5 * mib, 10), (100 * mib + 7, 300 * mib), (2047 * mib + 10, 20))
        for at, n in writes:
            fh.seek(at)
            fh.write(b"\x01" * n)
    runs = data_runs(raw)
    assert all(off % BLOCK == 0 and 0 < n <= MAX_RUN for off, n in runs), runs
    # 0..6 MiB (the two first writes, 5 MiB apart: merged), 100..401 MiB in two runs, the last MiB
    assert runs == [(0, 6 * mib), (100 * mib, MAX_RUN), (356 * mib, 45 * mib), (2047 * mib, mib)]
    for at, n in writes:  # every byte written is in a run: the rest reads zeros, as a new zvol does
        assert any(off <= at and at + n <= off + size for off, size in _joined(runs)), (at, n)


def _joined(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for off, n in runs:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += n
        else:
            out.append([off, n])
    return [(a, b) for a, b in out]
