"""End to end on the real libvirt QEMU driver (qemu:///system, TCG), in three tests that boot two
VMs in all (the third is killed mid-boot):

1. the backend object: its `publishing` part into a libvirt storage pool, a clone of the published copy,
   boot, every link of the address chain checked against the running guest (static, libvirt's ARP
   source, the host's neighbour table, the console log, the console stream bhyve relies on), SSH,
   destroy, nothing left;
2. `lab run` through the CLI with a lab.toml whose host is `backend = "libvirt"`,
   `uri = "qemu:///system"`: clone, boot, verify, sysbench-cpu and iperf3-tcp, destroy, samples
   stored, nothing left (no domain, overlay, console log, tap, run lock);
3. `lab run` killed with SIGKILL while its VM boots: `lab gc` keeps the domain while the run
   lives, finds the orphan by its <metadata> lease once the run is dead, and removes everything.

Networking: a dedicated bridge `labvbr<random>` holding 10.78.<n>.1/24 in the host netns
(libvirt's QEMU domains live there), with no uplink, no NAT and no gateway given to the guest;
iperf3's server binds to that address, so load stays on the bridge the test made. It is deleted
afterwards. libvirtd (and virtlogd) are started if they are not running, and stopped again at
the end if this module started them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
from support import subnets
from support.cli import LAB, run_lab_cli
from support.libvirt_daemons import URI as URI, VIRSH_TIMEOUT

import lab
from lab import proc
from lab.wait import wait_until

libvirt = pytest.importorskip("libvirt")

from lab.backends.libvirt.backend import LibvirtBackend  # noqa: E402
from lab.backends.libvirt.settings import Settings  # noqa: E402
from lab.backends.neighbours import arp_entries, parse_console_address  # noqa: E402
from lab.guest import Guest  # noqa: E402
from lab.model import DiskBus, NicModel, Vm, VmSpec  # noqa: E402
from lab.runlock import RUN_LOCK_DIR  # noqa: E402

IMAGES = Path(lab.PROJECT_ROOT) / "images"
# QEMU as root without relabelling: libvirt would otherwise chown the shared golden image;
# qboot: a faster direct kernel boot under TCG
QEMU_SETTINGS = {"dac_label": "+0:+0", "bios": "/usr/share/qemu/qboot.rom"}

# one xdist worker runs them all: the libvirtd fixture may start and stop the daemon
pytestmark = [
    pytest.mark.vm,
    pytest.mark.image,
    pytest.mark.timeout(900),
]


def virsh_names() -> list[str]:
    return proc.run(["virsh", "-c", URI, "list", "--all", "--name"], timeout=VIRSH_TIMEOUT).stdout.split()


def bridge_ports(bridge: str) -> list[str]:
    """Interfaces enslaved to `bridge` (libvirt's vnetN taps while a domain runs)."""
    out = proc.run(["ip", "-o", "link", "show", "master", bridge], timeout=10, check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


@pytest.fixture
def lab_bridge():
    """An isolated bridge 10.78.<n>.1/24: no uplink, no NAT, deleted afterwards."""
    n = subnets.free("10.78")
    if n is None:
        pytest.skip("no free 10.78.x.0/24 subnet")
    name = f"labvbr{secrets.token_hex(3)}"
    proc.run(["ip", "link", "add", "name", name, "type", "bridge"], timeout=10)
    try:
        proc.run(["ip", "addr", "add", f"10.78.{n}.1/24", "dev", name], timeout=10)
        proc.run(["ip", "link", "set", name, "up"], timeout=10)
        yield name, n
    finally:
        proc.run(["ip", "link", "del", name], timeout=10, check=False)


@pytest.fixture
def lab_pool(libvirtd, workdir):
    """A transient libvirt `dir` storage pool in the test's own directory (destroying a transient
    dir pool leaves its files; `workdir` removes them)."""
    name = f"labpool{secrets.token_hex(3)}"
    target = workdir / "pool"
    target.mkdir()
    conn = libvirt.open(URI)
    pool = conn.storagePoolCreateXML(
        f"<pool type='dir'><name>{name}</name><target><path>{target}</path></target></pool>", 0
    )
    try:
        yield name, target, pool
    finally:
        try:
            pool.destroy()
        finally:
            conn.close()


def test_publish_clone_boot_address_chain_destroy(golden, libvirtd, lab_bridge, lab_pool):
    """`golden` (conftest) skips with the reason when images/debian12.json is not built yet."""
    bridge, n = lab_bridge
    pool_name, pool_dir, pool = lab_pool
    settings = Settings(backend="libvirt", uri=URI, pool=pool_name, bridge=bridge, **QEMU_SETTINGS)
    backend = LibvirtBackend("e2e", settings)
    backend.check()
    assert backend.facts()["accel"] == "tcg"
    assert backend.disks.golden_root(golden) is None  # nothing published yet: the image is used in place

    # publish into the pool: the images/ layout, the manifest last, the pool refreshed
    t0 = time.monotonic()
    where = backend.publishing.publish(golden)
    publish_s = time.monotonic() - t0
    assert where == f"file:{pool_dir}/debian12.qcow2"
    for rel in ("debian12.qcow2", "debian12/vmlinuz", "debian12/initrd.img", "debian12.json"):
        assert (pool_dir / rel).is_file(), rel
    assert not list(pool_dir.rglob("*.part"))
    assert (pool_dir / "debian12.qcow2").stat().st_size == Path(golden.path).stat().st_size
    vol = pool.storageVolLookupByName("debian12.qcow2")  # libvirt sees it as a volume of the pool
    assert "<format type='qcow2'/>" in vol.XMLDesc(0)
    mtime = (pool_dir / "debian12.qcow2").stat().st_mtime_ns
    assert backend.publishing.publish(golden) == where  # same recipe: nothing copied again
    assert (pool_dir / "debian12.qcow2").stat().st_mtime_ns == mtime

    backend = LibvirtBackend("e2e", settings)  # a new process would resolve the golden afresh
    backend.check()
    backend.check_images([golden])
    assert backend.disks.golden_root(golden) == str(pool_dir)

    run_id = f"e2e{secrets.token_hex(3)}"
    spec = VmSpec(
        name=f"lab-{run_id}-c1",
        run_id=run_id,
        cell_id="c1",
        image=golden,
        nic=NicModel.E1000,
        vcpus=2,
        memory_mib=768,
        disk_bus=DiskBus.SATA,
        ip=f"10.78.{n}.10",
        expires_at=time.time() + 3600,
    )
    timings: dict[str, float] = {"publish": publish_s}
    vm = None
    t0 = time.monotonic()
    try:
        vm = backend.clone(golden, spec)
        timings["clone_define"] = time.monotonic() - t0
        overlay = Path(vm.handle["disk_path"])
        assert overlay.parent == pool_dir
        info = json.loads(proc.run(["qemu-img", "info", "--output=json", str(overlay)], timeout=30).stdout)
        assert info["format"] == "qcow2"
        assert info["backing-filename"] == f"{pool_dir}/debian12.qcow2"  # the published copy

        dom = backend.connection.get().lookupByName(spec.name)
        xml = dom.XMLDesc(0)
        assert xml.startswith("<domain type='qemu'")
        assert f"<kernel>{pool_dir}/debian12/vmlinuz</kernel>" in xml
        owned = [o for o in backend.list_owned() if o.run_id == run_id]
        assert [o.name for o in owned] == [spec.name]

        t = time.monotonic()
        backend.start(vm)
        timings["start"] = time.monotonic() - t
        tap = vm.handle["console_tap"]
        t = time.monotonic()
        addr = backend.wait_ready(vm, timeout=480)
        timings["ready"] = time.monotonic() - t
        assert addr == spec.ip and vm.facts["address_source"] == "static"
        log_text = backend.console_text(vm)  # virtlogd's log of the pty
        assert "LAB-READY" in log_text

        t = time.monotonic()
        with Guest(addr, key=IMAGES / "lab_key", user="root") as guest:
            guest.connect(timeout=90)
            out = guest.run("uname -a").stdout
            driver = guest.run("basename $(readlink /sys/class/net/eth0/device/driver)").stdout.strip()
            guest.run(f"ping -c 1 -W 5 10.78.{n}.1")  # the host's neighbour entry is now fresh
            # lab-net's report ("lab-net: eth0 ADDR/24 gw none") goes to the journal at boot; run it
            # again (it is idempotent) with its output on the serial port, as a guest whose
            # network unit logs to the console would print it
            guest.run("/usr/local/sbin/lab-net > /dev/ttyS0")
        timings["ssh_uname"] = time.monotonic() - t
        assert out.startswith("Linux ")
        assert driver == "e1000"
        print(f"\nguest: {out.strip()}")

        # every other link of the address chain, against this real guest
        mac = vm.handle["mac"]
        assert parse_console_address(log_text) == ""  # at boot the image announces LAB-READY only
        log_text = wait_until(
            lambda: "lab-net:" in backend.console_text(vm) and backend.console_text(vm),
            timeout=30,
            what="lab-net's line in the console log",
        )
        assert parse_console_address(log_text) == spec.ip
        assert backend.addresses.console(vm) == spec.ip
        # the console stream (the reader bhyve's nmdm depends on) saw the boot and the same line
        stream = wait_until(
            lambda: "lab-net:" in tap.text() and tap.text(), timeout=30, what="lab-net's line on the console stream"
        )
        assert "LAB-READY" in stream and parse_console_address(stream) == spec.ip
        neigh = proc.run(backend.addresses.arp_argv(), timeout=30).stdout  # `ip -4 neigh show` on the host
        assert (spec.ip, mac, bridge) in arp_entries(neigh)
        assert backend.addresses.host_arp(vm) == spec.ip
        assert backend.addresses.lease(vm) == ""  # a bridge, not a libvirt network: no DHCP lease
        # libvirt's own ARP source (interfaceAddresses SRC_ARP): libvirt 9.0 fails here with
        # "wrong nlmsg len" reading the neighbour table; the chain must then go on to the host's
        try:
            found = dom.interfaceAddresses(libvirt.VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_ARP, 0)
            libvirt_arp = [a["addr"] for i in found.values() if i["hwaddr"] == mac for a in i["addrs"] or []]
            assert libvirt_arp == [spec.ip]
        except libvirt.libvirtError as exc:
            libvirt_arp = None
            print(f"libvirt ARP source: {exc}")
        # the chain as a guest without a static address meets it: leases, ARP, host table, console
        unknown = Vm(spec=replace(spec, ip=""), backend=backend.name, handle=vm.handle)
        assert backend.addresses.find(unknown) == spec.ip
        assert unknown.facts["address_source"] == ("arp" if libvirt_arp else "host-arp")
    finally:
        t = time.monotonic()
        if vm is not None:
            backend.destroy(vm)
        else:  # clone failed half way: remove whatever carries our run id
            for item in backend.list_owned():
                if item.run_id == run_id:
                    backend.remove_owned(item)
        timings["destroy"] = time.monotonic() - t
        timings["total"] = time.monotonic() - t0
        print("timings: " + json.dumps({k: round(v, 2) for k, v in timings.items()}))

    # nothing left: domain, overlay, console log, tap, console reader
    assert backend.connection.lookup(spec.name) is None
    assert spec.name not in virsh_names()
    assert not any(o.run_id == run_id for o in backend.list_owned())
    assert not list(pool_dir.glob("lab-*")), list(pool_dir.glob("lab-*"))
    assert bridge_ports(bridge) == []
    assert not tap.alive
    assert vm.facts.get("undefine") == "nvram"  # QEMU accepts VIR_DOMAIN_UNDEFINE_NVRAM
    backend.connection.close()


# --------------------------------------------------------------------------------------------
# through the CLI


def kvm_table(workdir: Path, bridge: str, n: int, *, boot_timeout: int) -> str:
    """[hosts.kvm]: libvirt's qemu:///system, its disks in `workdir`, its guests on the test's
    bridge 10.78.<n>.0/24 (lab_bridge), the load generators' side at .1."""
    return textwrap.dedent(f"""
        [hosts.kvm]
        backend = "libvirt"
        uri = "{URI}"
        dir = "{workdir / "disks"}"
        bridge = "{bridge}"
        subnet = "10.78.{n}.0/24"
        client_address = "10.78.{n}.1"
        dac_label = "{QEMU_SETTINGS["dac_label"]}"
        bios = "{QEMU_SETTINGS["bios"]}"
        boot_timeout = {boot_timeout}
        """)


def write_libvirt_lab(tmp_path: Path, workdir: Path, bridge: str, n: int, *, workloads: str) -> Path:
    text = (
        textwrap.dedent(f"""
        [lab]
        name = "libvirt-e2e"
        results = "{tmp_path / "results"}"

        [hosts.local]  # `lab gc` also sweeps the local backend: only this test's directory
        backend = "local"
        workdir = "{workdir / "local"}"

        """)
        + kvm_table(workdir, bridge, n, boot_timeout=480)
        + textwrap.dedent(f"""
        [matrix]
        host = ["kvm"]
        image = ["debian12"]
        nic = ["virtio"]
        vcpus = [2]
        memory_mib = [768]
        disk_bus = ["virtio"]

        [suite]
        workloads = {workloads}
        repetitions = 1
        warmup = 0

        [suite.params.sysbench-cpu]
        time = 1

        [suite.params.iperf3-tcp]
        time = 2
        """)
    )
    path = tmp_path / "lab.toml"
    path.write_text(text)
    return path


def leftovers(run_id: str, workdir: Path, bridge: str) -> list[str]:
    out = [f"domain {d}" for d in virsh_names() if d.startswith(f"lab-{run_id}-")]
    disks = workdir / "disks"
    out += [f"file {p.name}" for p in disks.iterdir()] if disks.is_dir() else []
    out += [f"tap {t}" for t in bridge_ports(bridge)]
    out += [f"lock {p.name}" for p in RUN_LOCK_DIR.glob(f"libvirt-kvm@{run_id}.lock")]
    return out


def test_lab_run_cli_on_qemu_system(golden, libvirtd, lab_bridge, workdir, tmp_path):
    bridge, n = lab_bridge
    cfg = write_libvirt_lab(tmp_path, workdir, bridge, n, workloads='["sysbench-cpu", "iperf3-tcp"]')
    plan = run_lab_cli("plan", "-c", str(cfg), timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert "kvm" in plan.stdout and "1 cells" in plan.stdout

    run_id = f"cli{secrets.token_hex(3)}"
    t0 = time.monotonic()
    res = run_lab_cli("run", "-c", str(cfg), "--run-id", run_id, timeout=900)
    seconds = time.monotonic() - t0
    print(f"\nlab run on qemu:///system: {seconds:.1f} s\n{res.stderr[-3000:]}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    shown = run_lab_cli("show", run_id, "-c", str(cfg), "--json", timeout=60)
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["run"]["status"] == "done"
    (cell,) = doc["cells"]
    assert cell["status"] == "done", cell
    facts = cell["facts"]
    assert facts["libvirt_driver"] == "qemu" and facts["accel"] == "tcg"
    assert facts["address_source"] == "static"
    assert facts["verified"]["nic_driver"] == "virtio_net" and facts["verified"]["vcpus"] == 2
    metrics = {(s["workload"], s["metric"]) for s in doc["samples"]}
    assert ("sysbench-cpu", "events_per_s_1t") in metrics and ("sysbench-cpu", "events_per_s_nt") in metrics
    assert ("iperf3-tcp", "throughput_mbit_s_tx") in metrics and ("iperf3-tcp", "throughput_mbit_s_rx") in metrics
    tx = next(s for s in doc["samples"] if s["metric"] == "throughput_mbit_s_tx")
    assert tx["value"] > 0 and tx["labels"]["host"] == "kvm" and tx["labels"]["accel"] == "tcg"
    print(
        "samples: "
        + json.dumps(
            {f"{s['workload']}/{s['metric']}": round(s["value"], 1) for s in doc["samples"] if "cpu" not in s["metric"]}
        )
    )
    assert leftovers(run_id, workdir, bridge) == []


def test_gc_finds_a_killed_runs_domain_by_its_metadata(golden, libvirtd, lab_bridge, workdir, tmp_path):
    bridge, n = lab_bridge
    cfg = write_libvirt_lab(tmp_path, workdir, bridge, n, workloads='["sysbench-cpu"]')
    run_id = f"kill{secrets.token_hex(3)}"
    name = f"lab-{run_id}-c01"
    log = open(tmp_path / "run.log", "wb")
    p = proc.spawn([*LAB, "run", "-c", str(cfg), "--run-id", run_id], stdout=log, stderr=log)
    log.close()
    try:

        def domain_running() -> bool:
            if p.poll() is not None:
                raise AssertionError(f"lab run exited early: {(tmp_path / 'run.log').read_text()[-2000:]}")
            res = proc.run(["virsh", "-c", URI, "domstate", name], timeout=VIRSH_TIMEOUT, check=False)
            return res.ok and "running" in res.stdout

        wait_until(domain_running, timeout=180, what=f"{name} to run")
        # while the run lives, gc leaves its domain alone (the run lock is held)
        gc = run_lab_cli("gc", "-c", str(cfg), timeout=120)
        assert gc.returncode == 0, gc.stderr
        assert re.search(rf"keep\s+kvm vm {name} \(run {run_id} is live\)", gc.stdout), gc.stdout
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)

    # the orchestrator is gone, libvirtd keeps the domain: a leftover only <metadata> describes
    assert name in virsh_names()
    assert (workdir / "disks" / f"{name}.qcow2").exists()
    assert bridge_ports(bridge)
    gc = run_lab_cli("gc", "-c", str(cfg), "--dry-run", timeout=120)
    assert f"would remove kvm vm {name}" in gc.stdout, gc.stdout
    gc = run_lab_cli("gc", "-c", str(cfg), timeout=300)
    print(f"\n{gc.stdout}")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert f"removed kvm vm {name}" in gc.stdout
    assert leftovers(run_id, workdir, bridge) == []
