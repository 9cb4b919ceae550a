"""Warm start of the local backend with real VMs (lab.backends.local.warm).

Each test has a workdir and a run of its own. A snapshot of the module's machine shape (debian12,
virtio, 2 vCPUs, 1 GiB) is made once per module (`snapshots`) and each test that needs one starts
from its own copy of it (a snapshot is tied to no directory: its disk's backing file is the golden
image, its meta names the image, not the store). The first test, about building: a maker killed with
-9 mid-build and after a restore leaves nothing that `lab gc` does not remove, except the snapshot,
which is no run's (the one it built after the killed build: the module's, from then on). Then two
warm cells restored from one snapshot are two machines (their own address and MAC, side by side on
the bridge, clocks on the host's, different RNG output) and pass the runner's verification; another
machine shape builds another snapshot, once, then finds it; a state QEMU cannot load, and a missing
one, each make the cell boot cold and say why (in their own copy).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.cli import run_lab_cli
from support.local import TCG_THREADS, leftovers, local_backend, write_lab

from lab import images, proc
from lab.backends import local
from lab.backends.local import warm
from lab.model import NicModel, VmSpec
from lab.osfacts import facts
from lab.runner import verify
from lab.wait import wait_until

pytestmark = [pytest.mark.vm, pytest.mark.image, pytest.mark.xdist_group("boot")]


class Snapshots:
    """The module's warm snapshots, in a workdir of their own: each made once, by the test about
    building (put) or else here on first need, and copied into a test's workdir for it to use (or
    damage)."""

    def __init__(self, workdir: Path, golden):
        self.workdir, self.golden = workdir, golden
        self.store = warm.WarmStore(workdir / warm.STORE)

    def find(self, nic: NicModel, memory: int) -> Path | None:
        for snap in self.store.snapshots():
            key = snap.meta.get("key") or {}
            if (key.get("nic"), key.get("vcpus"), key.get("memory_mib"), key.get("image_digest")) == (
                nic.value,
                2,
                memory,
                warm.image_digest(self.golden),
            ):
                return snap.dir
        return None

    def put(self, snapshot: Path) -> None:
        """Keep a copy of a snapshot a test built (a test that builds does so in its own workdir)."""
        if not (self.store.root / snapshot.name).exists():
            copy(snapshot, self.store.ensure())

    def copy_into(self, workdir: Path, nic: NicModel = NicModel.VIRTIO, memory: int = 1024) -> Path:
        """A private copy of the snapshot of that shape in `workdir`'s store, made first if need be."""
        src = self.find(nic, memory) or self.build(nic, memory)
        return copy(src, warm.WarmStore(workdir / warm.STORE).ensure())

    def build(self, nic: NicModel, memory: int) -> Path:
        backend = local_backend(self.workdir)
        backend.check()
        run_id = os.urandom(4).hex()
        backend.open_run(run_id)
        try:
            vm = backend.clone(self.golden, warm_spec(self.golden, run_id, "c00", nic=nic, memory=memory))
            backend.destroy(vm)  # cloning built it; no need to boot the cell
        finally:
            backend.close_run(run_id)
        assert vm.facts["start"] == "warm", vm.facts
        assert leftovers(self.workdir, run_id) == []
        return self.find(nic, memory)


def copy(snapshot: Path, store: Path) -> Path:
    """`snapshot` copied into `store` (modes kept: its files stay read-only; RAM holes stay holes)."""
    proc.run(["cp", "-a", "--sparse=always", "--reflink=auto", str(snapshot), str(store)], timeout=120)
    return store / snapshot.name


@pytest.fixture(scope="module")
def snapshots(golden, module_workdir):
    return Snapshots(module_workdir, golden)


@pytest.fixture
def warm_run(golden, workdir):
    """(backend, run id, client) of a run in the test's workdir; the run leaves nothing."""
    backend = local_backend(workdir)
    backend.check()
    run_id = os.urandom(4).hex()
    client = backend.open_run(run_id)
    try:
        yield backend, run_id, client
    finally:
        backend.close_run(run_id)
    assert leftovers(workdir, run_id) == []


def warm_spec(golden, run_id: str, cell: str, nic=NicModel.VIRTIO, memory=1024) -> VmSpec:
    return VmSpec(
        name=f"lab-{run_id}-{cell}",
        run_id=run_id,
        cell_id=cell,
        image=golden,
        nic=nic,
        vcpus=2,
        memory_mib=memory,
        start="warm",
        expires_at=time.time() + 600,
    )


def up(backend, golden, spec):
    vm = backend.clone(golden, spec)
    try:
        backend.start(vm)
        backend.wait_ready(vm)
    except BaseException:
        backend.destroy(vm)
        raise
    return vm


def identity(guest) -> dict:
    before = time.time()
    out = guest.run(
        "date +%s.%N; cat /sys/class/net/eth0/address; ip -4 -o addr show dev eth0; "
        "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo"
    ).stdout.split("\n")
    after = time.time()
    return {
        "clock_off_s": float(out[0]) - (before + after) / 2,
        "rtt_s": after - before,
        "mac": out[1].strip(),
        "addr": out[2].split()[3],
        "rng": out[3].strip(),
    }


MAKER = """
import sys, time
from lab import images
from lab.backends import local
from lab.model import NicModel, VmSpec
backend = local.LocalBackend("local", local.Settings(backend="local", workdir=sys.argv[1], tcg_threads=sys.argv[3]))
run_id = sys.argv[2]
client = backend.open_run(run_id)
image = images.load("debian12")
spec = VmSpec(name=f"lab-{run_id}-c01", run_id=run_id, cell_id="c01", image=image, nic=NicModel.VIRTIO, vcpus=2,
              memory_mib=1024, start="warm", expires_at=time.time() + 600)
vm = backend.clone(image, spec)
backend.start(vm)
backend.wait_ready(vm)
print(vm.facts["start"], flush=True)
time.sleep(600)
"""


def test_killed_mid_build_and_after_restore_then_gc_keeps_only_the_snapshot(golden, workdir, tmp_path, snapshots):
    cfg = write_lab(tmp_path, workdir, matrix='nic = ["virtio"]\n', suite='workloads = ["sysbench-cpu"]\n')

    made: list[str] = []

    def maker() -> tuple[subprocess.Popen, str]:
        run_id = os.urandom(4).hex()
        made.append(run_id)
        return subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(MAKER), str(workdir), run_id, TCG_THREADS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        ), run_id

    def kill(p: subprocess.Popen) -> None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        p.stdout.close()
        p.stderr.close()

    def gc(run_id: str) -> None:
        res = run_lab_cli("gc", "-c", str(cfg), timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        assert leftovers(workdir, run_id) == []
        assert not [n for n in local.list_netns() if n.startswith(f"lab-{run_id}")]

    try:
        # 1. killed while the template boots: its QEMU, directory and tap are the run's, gc takes them
        p, run_id = maker()
        try:
            # a fresh interpreter importing lab beside the other worker's VMs: minutes, not seconds
            wait_until(
                lambda: any(name.startswith(f"lab-{run_id}-w") for _, name in local.qemu_processes(workdir)),
                timeout=300,
                what="the template's QEMU",
            )
        finally:
            kill(p)
        assert any(f"lab-{run_id}-w" in x for x in leftovers(workdir, run_id))
        gc(run_id)
        backend = local_backend(workdir)
        assert backend.warm.snapshots() == []  # nothing half-made in the store
        # 2. killed with a warm cell running, after building the snapshot again: gc takes the cell,
        # the snapshot stays (no run owns it)
        p, run_id = maker()
        try:
            line = p.stdout.readline().strip()
            assert line == "warm", line + (p.stderr.read() if p.poll() is not None else "")
        finally:
            kill(p)
        assert leftovers(workdir, run_id)
        gc(run_id)
        (snap,) = backend.warm.snapshots()
        assert snap.name.startswith("debian12-virtio-virtio-2c1024m-") and snap.detail == golden.sha256
        assert (workdir / "warm" / snap.name / warm.STATE).is_file()
        snapshots.put(workdir / "warm" / snap.name)  # the module's: the next tests start from copies of it
    finally:
        # A failed attempt must not leave its killed runs' namespaces and QEMUs on the machine (CI
        # runs on a shared one: an earlier failure here leaked `lab-<run>` namespaces).
        run_lab_cli("gc", "-c", str(cfg), timeout=300)
        for run_id in made:
            for ns in local.list_netns():
                if ns.startswith(f"lab-{run_id}"):
                    local.remove_netns(ns)


def test_two_warm_cells_of_one_snapshot_are_two_machines(warm_run, golden, workdir, snapshots):
    backend, run_id, client = warm_run
    snapshots.copy_into(workdir)
    vms, seen = [], []
    try:
        for cell in ("c01", "c02"):
            vms.append(up(backend, golden, warm_spec(golden, run_id, cell)))
        first, second = vms
        assert first.facts["start"] == second.facts["start"] == "warm", (first.facts, second.facts)
        assert first.facts["warm_snapshot"] == second.facts["warm_snapshot"]
        # found, each (built once, then found: test_another_machine_shape_builds_its_own_snapshot)
        assert 5 > first.facts["warm_seconds"] and 5 > second.facts["warm_seconds"], (first.facts, second.facts)
        for vm in vms:
            disk = json.loads(
                proc.run(["qemu-img", "info", "-U", "--output=json", str(Path(vm.handle["dir"]) / "disk.qcow2")]).stdout
            )
            assert disk["backing-filename"].endswith(f"/warm/{vm.facts['warm_snapshot']}/disk.qcow2")
            assert vm.facts["restore_seconds"] < 5 and abs(vm.facts["clock_offset_ms"]) < 1000
            with backend.guest(vm, client) as guest:
                guest.connect(timeout=60)
                seen.append(identity(guest))
                observed = verify(guest, facts("debian"), vm.spec)  # as the runner does before measuring
                assert observed["nic_driver"] == "virtio_net" and observed["vcpus"] == 2
                if vm is second:  # side by side on the bridge, each answers as itself
                    guest.run(f"ping -c 1 -W 5 {first.address} >/dev/null")
                    neigh = guest.run(f"ip neigh show {first.address}").stdout
                    assert first.spec.mac in neigh, neigh
        for vm, got in zip(vms, seen):
            assert got["addr"] == f"{vm.address}/24" and got["mac"] == vm.spec.mac
            assert abs(got["clock_off_s"]) < 1 + got["rtt_s"], got  # stepped to the host's clock
        assert seen[0]["addr"] != seen[1]["addr"] and seen[0]["mac"] != seen[1]["mac"]
        assert seen[0]["rng"] != seen[1]["rng"]  # vmgenid: each restore reseeds the kernel's RNG
    finally:
        for vm in vms:
            backend.destroy(vm)
    # the run is still open (its namespace and lock stay until the module ends); nothing of the cells
    assert [
        x for x in leftovers(backend.workdir, run_id) if x not in (f"netns {client.netns}", f"file {client.netns}.lock")
    ] == []
    assert proc.run(["ip", "-n", client.netns, "-o", "link", "show", "type", "tun"]).stdout.strip() == ""
    assert [s.name for s in backend.warm.snapshots()] == [first.facts["warm_snapshot"]]  # it stays


def test_another_machine_shape_builds_its_own_snapshot(warm_run, golden, workdir, snapshots):
    backend, run_id, client = warm_run
    snapshots.copy_into(workdir)  # the 1 GiB virtio one
    before = {s.name for s in backend.warm.snapshots()}
    assert len(before) == 1, before
    # e1000 (its MAC changed live on restore, lab.backends.local.warm.fixup_batch) and 768 MiB
    vm = up(backend, golden, warm_spec(golden, run_id, "c03", nic=NicModel.E1000, memory=768))
    try:
        assert vm.facts["start"] == "warm" and vm.facts["warm_snapshot"] not in before
        assert "-e1000-" in vm.facts["warm_snapshot"] and "c768m-" in vm.facts["warm_snapshot"]
        with backend.guest(vm, client) as guest:
            guest.connect(timeout=60)
            # e1000 and 768 MiB, not the other snapshot's virtio and 1 GiB
            observed = verify(guest, facts("debian"), vm.spec)
            assert observed["nic_driver"] == "e1000", observed
    finally:
        backend.destroy(vm)
    again = backend.clone(golden, warm_spec(golden, run_id, "c04", nic=NicModel.E1000, memory=768))
    from_dir = again.handle.get("warm", "")
    backend.destroy(again)
    assert again.facts["start"] == "warm" and Path(from_dir).name == vm.facts["warm_snapshot"], again.facts
    assert vm.facts["warm_seconds"] > 5 > again.facts["warm_seconds"], (vm.facts, again.facts)  # built once, then found
    assert {s.name for s in backend.warm.snapshots()} == before | {vm.facts["warm_snapshot"]}


def snapshot_named(backend, memory: int) -> Path:
    (snap,) = [s for s in backend.warm.snapshots() if f"c{memory}m-" in s.name]
    return backend.workdir / "warm" / snap.name


def test_a_state_qemu_cannot_load_boots_cold_and_says_why(warm_run, golden, workdir, snapshots):
    backend, run_id, client = warm_run
    snapshots.copy_into(workdir)  # its own copy, which it damages
    d = snapshot_named(backend, 1024)
    state = d / warm.STATE
    os.chmod(state, 0o600)
    state.write_bytes(b"QEVM" + os.urandom(4096))  # not a migration stream QEMU can load...
    meta = json.loads((d / warm.META).read_text())
    meta["state_sha256"] = images.file_sha256(state)  # ...though its checksum matches
    (d / warm.META).write_text(json.dumps(meta))
    vm = up(backend, golden, warm_spec(golden, run_id, "c04"))
    try:
        assert vm.facts["start"].startswith(f"cold: restore of {d.name} failed"), vm.facts["start"]
        assert vm.facts["boot_seconds"] > 1 and "warm" not in vm.handle
        with backend.guest(vm, client) as guest:
            guest.connect(timeout=90)
            verify(guest, facts("debian"), vm.spec)
            assert guest.run("cat /sys/class/net/eth0/address").stdout.strip() == vm.spec.mac
    finally:
        backend.destroy(vm)
    assert not d.exists()  # removed: a later run builds it again; this one does not try twice
    vm = backend.clone(golden, warm_spec(golden, run_id, "c05"))
    backend.destroy(vm)
    assert vm.facts["start"].startswith(f"cold: restore of {d.name} failed")


def test_a_missing_state_boots_cold_and_says_why(warm_run, golden, workdir, snapshots):
    backend, run_id, client = warm_run
    snapshots.copy_into(workdir)  # its own copy, which it damages
    d = snapshot_named(backend, 1024)
    (d / warm.STATE).unlink()
    vm = up(backend, golden, warm_spec(golden, run_id, "c06"))
    try:
        assert vm.facts["start"] == (
            f"cold: warm snapshot {d.name}: its state file is missing; removed it: the next warm cell builds it again"
        )
        with backend.guest(vm, client) as guest:
            guest.connect(timeout=90)
            verify(guest, facts("debian"), vm.spec)
    finally:
        backend.destroy(vm)
    assert not d.exists()
