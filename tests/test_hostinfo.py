"""Host fingerprints: parsers on captured data, `lab snapshot` storing and linking, differences."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import lab_cli

from lab import hostinfo
from lab.store import Store
from lab.workloads.cpu import usage

DATA = Path(__file__).parent / "data"


def test_libvirt_capabilities_host_cpu():
    # captured from this machine's libvirtd (qemu:///system): a 2-core AMD EPYC guest of a cloud
    caps = (DATA / "hostinfo" / "capabilities-qemu-system.xml").read_text()
    assert hostinfo.libvirt_host_facts(caps) == {
        "cpu_arch": "x86_64",
        "cpu_model": "kvm64",
        "cpu_vendor": "AMD",
        "microcode": "0x1000065",
        "topology": {"sockets": 1, "dies": 1, "cores": 2, "threads": 1},
    }
    # libvirt's test driver: an i686 host without model or microcode
    test = (DATA / "hostinfo" / "capabilities-test-driver.xml").read_text()
    assert hostinfo.libvirt_host_facts(test) == {"cpu_arch": "i686"}


def test_nic_drivers_and_bridges(tmp_path):
    net = tmp_path / "net"
    drivers = tmp_path / "bus" / "pci" / "drivers"
    for name, driver, mtu, bridge in (
        ("enp1s0", "igc", "9000", False),
        ("vmbr0", None, "9000", True),
        ("lo", None, "65536", False),
        ("tap100i0", None, "1500", False),
    ):
        d = net / name
        d.mkdir(parents=True)
        (d / "mtu").write_text(mtu + "\n")
        if driver:
            (drivers / driver).mkdir(parents=True)
            (d / "device").mkdir()
            (d / "device" / "driver").symlink_to(drivers / driver)
        if bridge:
            (d / "bridge").mkdir()
    assert hostinfo.nic_drivers(net) == {"enp1s0": "igc, MTU 9000"}
    assert hostinfo.bridge_mtus(net) == {"vmbr0": "9000"}


def test_differences_flatten_nested_and_missing():
    a = {"kernel": "6.1", "mitigations": {"retbleed": "Vulnerable", "mds": "Not affected"}, "tools": {"qemu": "7.2"}}
    b = {"kernel": "6.12", "mitigations": {"retbleed": "Mitigation: IBRS", "mds": "Not affected"}, "smt": "off"}
    assert hostinfo.differences(a, b) == [
        ("kernel", "6.1", "6.12"),
        ("mitigations.retbleed", "Vulnerable", "Mitigation: IBRS"),
        ("tools.qemu", "7.2", "–"),
        ("smt", "–", "off"),
    ]
    assert hostinfo.differences(a, None)[0] == ("kernel", "6.1", "missing")
    assert hostinfo.differences(a, a) == []


def test_local_facts_cover_the_fingerprint_fields():
    f = hostinfo.local_facts()
    for key in (
        "cpu_model",
        "microcode",
        "cores",
        "governor",
        "mitigations",
        "kernel",
        "nics",
        "bridges",
        "tools",
        "smt",
        "sockets",
        "cores_per_socket",
    ):
        assert key in f, key
    assert f["cores"] == os.cpu_count()
    assert "qemu" in f["tools"] and "iperf3" in f["tools"]  # the hypervisor and a load generator


def test_bare_metal_cpu_ticks_from_a_cgroup():
    # captured: lab.osfacts.BARE_METAL_TICKS in a cgroup v1 cpuacct group around a 1-thread
    # sysbench on this 2-core machine (tests/data/README.md)
    before, after = (DATA / "cpu" / "linux-bare-metal-cgroup-v1-ticks.txt").read_text().split("\n")[:2]
    u = usage(before, after)
    assert u["busy_pct"] == pytest.approx(49.2, abs=0.1)  # one of two CPUs
    assert u["user_pct"] > u["sys_pct"]


def test_snapshot_is_stored_and_linked(tmp_path):
    (tmp_path / "lab.toml").write_text(f'[lab]\nresults = "{tmp_path / "results"}"\n')
    first = lab_cli("snapshot", "local", "-c", str(tmp_path / "lab.toml"), "--json")
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    assert doc["stored_id"] == 1 and doc["runs"] == [] and len(doc["fingerprint"]) == 16
    assert doc["cpu_model"] and "nics" in doc and "backend_qemu" in doc
    store = Store(tmp_path / "results")
    store.create_run("r1", "t", config_path="", config_text="", seed=1, lab_version="0", manifest={})
    facts = {k: v for k, v in doc.items() if k not in ("fingerprint", "stored_id", "runs")}
    assert store.host_facts.add("r1", "local", doc["fingerprint"], facts) == 1  # the same row: linked
    again = lab_cli("snapshot", "local", "-c", str(tmp_path / "lab.toml"))
    assert again.returncode == 0, again.stderr
    assert "host facts #1" in again.stdout and "runs with this fingerprint: r1" in again.stdout
    assert "fingerprint " + doc["fingerprint"] in again.stdout and "mitigations." in again.stdout
    bad = lab_cli("snapshot", "nope", "-c", str(tmp_path / "lab.toml"))
    assert bad.returncode == 2 and "no host 'nope'" in bad.stderr
