"""`lab run` of zone cells (matrix isolation "zone") on the emulated SmartOS host, end to end over
real SSH: `vmadm create` of an lx zone from the installed zone image `zone_images` names, its caps
read back, its host key read from its root through the global zone, the suite run inside it (this
machine's sysbench, iperf3 against the lab's server, wrk against the zone's nginx), and `vmadm
delete` leaving nothing: no zone, namespace, cgroup or process.

The emulator's zones (smartos_emulator.zones) run this machine's userland in a namespace on the
host's bridge, capped by cgroups, as an lx zone runs its image's userland on the host's kernel.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from smartos_emulator.fixtures import (  # noqa: F401  (fixtures)
    ZONE_IMAGE,
    lab_toml,
    skip_unless_emulator_can_run,
    smartos_fixture,
    smartos_net_fixture,
    smartos_workdir_fixture,
)
from support.cli import lab_cli
from test_smartos_backend import spec

from lab import axes, plan
from lab.backends.smartos import SmartosBackend, zones
from lab.config import load
from lab.errors import SettingError, VerificationError
from lab.model import ImageRef, Isolation, VmSpec

# -- before anything is made: the plan, the checks, the pure parts ------------------------------------

SMARTOS_HOST = {
    "backend": "smartos",
    "ssh": "root@192.0.2.7",
    "addresses": "10.9.0.10-10.9.0.20",
    "gateway": "10.9.0.1",
}


def _plan_toml(tmp_path: Path, *, host: dict | None = None, matrix: str = "", suite: str = "") -> Path:
    return lab_toml(
        tmp_path / "lab.toml",
        {**SMARTOS_HOST, "zone_images": {"debian12": ZONE_IMAGE}} if host is None else host,
        matrix=matrix or 'isolation = ["vm", "zone"]\nnic = ["virtio", "e1000"]',
        suite=suite or 'workloads = ["sysbench-cpu"]',
    )


def test_a_zone_cell_has_no_nic_disk_clone_or_start_axis(tmp_path):

    cfg = load(_plan_toml(tmp_path))
    cells = plan.cells(cfg)
    # two VM cells (virtio, e1000) and one zone: the nic axis means nothing for a zone's vnic
    assert [(c.isolation.value, c.nic.value) for c in cells] == [("vm", "virtio"), ("zone", "virtio"), ("vm", "e1000")]
    zone = cells[1]
    assert {"nic", "disk_bus", "clone", "start"} <= axes.moot(zone.values())
    assert not axes.applies("nic", zone) and axes.applies("nic", cells[0])
    assert (
        plan.vm_spec(
            zone, ImageRef(name="debian12", os="debian12", path=Path("-"), digest=""), run_id="r"
        ).isolation.value
        == "zone"
    )


@pytest.mark.parametrize(
    "host, matrix, suite, key, words",
    [
        (SMARTOS_HOST, 'isolation = ["zone"]', "", "matrix.isolation[0]", "name no zone image"),
        (
            {**SMARTOS_HOST, "zone_images": {"alpine": ZONE_IMAGE}},
            'isolation = ["zone"]',
            "",
            "hosts.sm.zone_images.debian12",
            "installed lx zone image",
        ),
        ({**SMARTOS_HOST, "zone_images": {"debian12": "debian-12"}}, 'isolation = ["zone"]', "", "hosts.sm", "uuid"),
        (None, 'isolation = ["zone"]\ntuning = ["wan-16m"]', "", "matrix.tuning[0]", "shares its host's kernel"),
        (None, 'isolation = ["zone"]\ncc = ["bbr"]', "", "matrix.cc[0]", "cannot be tuned"),
        (None, 'isolation = ["zone"]', 'workloads = ["podman-build"]', "suite.workloads[0]", "lx zone runs none"),
        (None, 'isolation = ["zone"]\nimage = ["freebsd14"]', "", "matrix.isolation[0]", "lx zones"),
    ],
)
def test_zone_cells_refused_at_plan_time_in_one_line(tmp_path, host, matrix, suite, key, words):

    path = _plan_toml(tmp_path, host=host, matrix=matrix, suite=suite)
    res = lab_cli("plan", "-c", str(path))
    assert res.returncode == 2, (res.stdout, res.stderr)
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and key in err and words in err, err
    assert str(path.name) in err and not (tmp_path / "results").exists()


def _spec(vcpus: int = 1, memory: int = 512) -> VmSpec:
    image = ImageRef(name="debian12", os="debian12", path=Path("-"), digest="d")
    return dataclasses.replace(spec(image), vcpus=vcpus, memory_mib=memory, isolation=Isolation.ZONE)


def test_zone_image_caps_and_host_key_checks():

    lx = {
        "uuid": ZONE_IMAGE,
        "name": "debian-12",
        "version": "20240101",
        "type": "lx-dataset",
        "tags": {"kernel_version": "5.10.0"},
    }
    assert zones.zone_image([{"manifest": lx}], ZONE_IMAGE, "debian12", "sm") == {
        "uuid": ZONE_IMAGE,
        "image": "debian-12@20240101",
        "kernel_version": "5.10.0",
    }
    for entries, words in (
        ([], "no such image installed"),
        ([{"manifest": {**lx, "type": "zone-dataset"}}], "not an lx zone image"),
        ([{"manifest": {**lx, "tags": {}}}], "kernel_version"),
    ):
        with pytest.raises(SettingError, match=words) as err:
            zones.zone_image(entries, ZONE_IMAGE, "debian12", "sm")
        assert err.value.key == "zone_images.debian12"
    made = {
        "brand": "lx",
        "zonepath": "/zones/x",
        "cpu_cap": 200,
        "max_physical_memory": 1024,
        "kernel_version": "5.10.0",
    }
    assert zones.caps({**made, "alias": "a"}) == made
    got = zones.verify_zone(made, _spec(2, 1024))
    assert got["nic_driver"] == "vnic" and got["cpu_cap"] == 200 and got["vcpus"] == 2
    with pytest.raises(VerificationError, match="cpu_cap is 200, cell asked for 1 vCPUs"):
        zones.verify_zone(made, _spec(1, 1024))
    with pytest.raises(VerificationError, match="max_physical_memory is 1024 MiB, cell asked for 512"):
        zones.verify_zone(made, _spec(2, 512))
    assert zones.known_hosts("10.0.0.5", "ssh-ed25519 AAAAC3 root@zone\n") == "10.0.0.5 ssh-ed25519 AAAAC3\n"
    with pytest.raises(VerificationError, match="not an SSH public key"):
        zones.known_hosts("10.0.0.5", "cat: no such file")


def test_a_zone_cell_through_clone_on_the_emulator(smartos):
    """The backend's clone of a zone spec: the zone image looked up and checked, an lx zone with its
    kernel version and caps, read back; a zone image that is not installed names its key."""
    env = dataclasses.replace(smartos.env(), ssh_key=smartos.sshd.client_key)
    b = SmartosBackend("sm", smartos.settings(zone_images={"debian12": ZONE_IMAGE}), env)
    with pytest.raises(SettingError, match="no such image installed") as err:
        b.check_specs([_spec()])
    assert err.value.key == "zone_images.debian12"
    smartos.install_zone_image(ZONE_IMAGE, name="debian-12", kernel_version="5.10.0")
    try:
        b.check_specs([_spec()])
        zone = b.clone(_spec().image, _spec())
        obj = smartos.vms()[zone.handle["uuid"]]
        assert obj["brand"] == "lx" and obj["kernel_version"] == "5.10.0" and obj["image_uuid"] == ZONE_IMAGE
        assert obj["cpu_cap"] == 100 and obj["max_physical_memory"] == 512 and "disks" not in obj
        assert zone.facts["caps"]["cpu_cap"] == 100 and zone.facts["zone_image"] == "debian-12@20260101"
        assert zone.handle["zonepath"] == obj["zonepath"]
        b.destroy(zone)
        assert smartos.vms() == {}
    finally:
        del smartos.gz.imgadm.images[ZONE_IMAGE]
