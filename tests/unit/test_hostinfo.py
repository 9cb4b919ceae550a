"""Host fingerprints: parsers on captured data, `lab snapshot` storing and linking, differences."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.cli import lab_cli

from lab import hostinfo
from lab.store import Store
from lab.workloads.cpu import usage

DATA = Path(__file__).parents[1] / "data"


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


# -- the CPU quota of the lab's cgroup (issue 36: a host fact a change point can name) ---------------


def test_cgroup_paths_and_mounts_on_captured_files():
    paths = hostinfo.cgroup_paths((DATA / "hostinfo" / "linux-cgroup-v1-capped.txt").read_text())
    assert paths["cpu"] == "/lab-capture" and paths[""] == "/" and paths["name=systemd"] == "/"
    mounts = hostinfo.cgroup_mounts((DATA / "hostinfo" / "linux-mountinfo-cgroup-v1.txt").read_text())
    assert mounts["cpu"] == ("/sys/fs/cgroup/cpu", "/") and mounts[""] == ("/sys/fs/cgroup/unified", "/")
    assert "proc" not in mounts and "tmpfs" not in mounts


def test_quota_as_cpus():
    assert hostinfo.quota_cpus("50000", "100000") == 0.5
    assert hostinfo.quota_cpus("-1", "100000") is None  # v1: no quota
    assert hostinfo.quota_cpus("max", "100000") is None  # v2: no quota
    assert hostinfo.quota_cpus("", "") is None


def _fake_proc(tmp_path, cgroup_line: str, mount_line: str) -> Path:
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup_line + "\n")
    (proc / "mountinfo").write_text(mount_line + "\n")
    return proc


def test_the_tightest_quota_between_the_cgroup_and_the_root_counts(tmp_path):
    top = tmp_path / "cg" / "cpu"
    for d, quota in ((top, -1), (top / "slice", 150000), (top / "slice" / "lab", -1)):
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = _fake_proc(tmp_path, "1:cpu:/slice/lab", f"32 31 0:29 / {top} rw,relatime - cgroup cgroup rw,cpu")
    assert hostinfo.cpu_quota(proc) == "1.5 CPUs"  # the slice's, inherited by the lab's cgroup
    (top / "slice" / "lab" / "cpu.cfs_quota_us").write_text("50000\n")
    assert hostinfo.cpu_quota(proc) == "0.5 CPUs"  # the tighter one
    (top / "slice" / "lab" / "cpu.cfs_quota_us").write_text("-1\n")
    (top / "slice" / "cpu.cfs_quota_us").write_text("-1\n")
    assert hostinfo.cpu_quota(proc) == "none"


def test_cgroup_v2_cpu_max(tmp_path):
    top = tmp_path / "cg2"
    (top / "user.slice").mkdir(parents=True)
    (top / "user.slice" / "cpu.max").write_text("25000 100000\n")
    proc = _fake_proc(tmp_path, "0::/user.slice", f"41 31 0:38 / {top} rw,relatime - cgroup2 cgroup2 rw")
    assert hostinfo.cpu_quota(proc) == "0.25 CPUs"
    (top / "user.slice" / "cpu.max").write_text("max 100000\n")
    assert hostinfo.cpu_quota(proc) == "none"
    assert hostinfo.cpu_quota(tmp_path / "nowhere") == "none"  # no /proc: nothing known, nothing limited


def test_local_facts_say_which_machine_and_what_the_lab_may_use():
    f = hostinfo.local_facts()
    assert f["cpu_quota"].endswith(" CPUs") or f["cpu_quota"] == "none"
    assert 1 <= f["cpus_allowed"] <= f["cores"]
    machine = hostinfo.machine_id()
    assert f.get("machine_id", "") == machine and (machine == "" or len(machine) == 16)
    if machine:
        assert machine not in Path("/etc/machine-id").read_text()  # a hash, never the id itself
