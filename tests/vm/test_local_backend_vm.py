"""The local backend on real VMs: boot, verify, run and destroy; SIGKILL and SIGTERM mid-boot leave
nothing; host load counts a foreign hog."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.cli import LAB, run_lab_cli
from support.local import leftovers, local_run, make_spec, write_lab

from lab import proc
from lab.backends import local
from lab.backends.local import hostload
from lab.errors import VerificationError
from lab.hostload import TICK, parse_pid_stat
from lab.model import CloneKind, NicModel, VmSpec
from lab.osfacts import facts
from lab.runner import verify
from lab.store import Store
from lab.wait import wait_until
from lab.workloads import WorkloadContext
from lab.workloads.ping import PING


def _wait_for_qemu(workdir: Path, timeout: float = 120) -> str:
    def found():
        procs = local.qemu_processes(workdir)
        return procs[0][1] if procs else None

    return wait_until(found, timeout=timeout, what="lab run to start QEMU")


HOG = "sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $!"  # its parent exits: the hog leaves our tree


def _rates(vm, pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Cores used over `seconds`: busy, the lab's, foreign (busy - lab), and each named pid's."""

    def own(pid: int) -> float:
        return parse_pid_stat(Path(f"/proc/{pid}/stat").read_text())[1] / TICK

    a, pa = hostload.cpu_times([vm]), {k: own(p) for k, p in pids.items()}
    time.sleep(seconds)
    b, pb = hostload.cpu_times([vm]), {k: own(p) for k, p in pids.items()}
    dt = b["at"] - a["at"]
    out = {
        "busy": (b["busy_s"] - a["busy_s"]) / dt,
        "lab": (b["lab_s"] - a["lab_s"]) / dt,
        **{k: (pb[k] - pa[k]) / dt for k in pids},
    }
    out["foreign"] = out["busy"] - out["lab"]
    return out


@pytest.mark.vm
@pytest.mark.image
@pytest.mark.xdist_group("boot")
@pytest.mark.parametrize("nic,clone", [(NicModel.VIRTIO, CloneKind.LINKED), (NicModel.E1000, CloneKind.FULL)])
def test_boot_verify_run_destroy(golden, workdir, nic, clone):
    with local_run(workdir) as made:
        backend, run_id, client = made["backend"], made["run_id"], made["client"]
        spec = make_spec(golden, run_id, nic, clone=clone, owner="0123456789ab-ba9876543210")
        vm = made["vm"] = backend.clone(golden, spec)
        # the lease says whose it is, and a live run moves its expiry (lab.lease, lab.runner.renewal)
        backend.renew_lease(vm, spec.expires_at + 60)
        (owned,) = [o for o in backend.list_owned() if o.kind == "vm" and o.name == vm.name]
        assert (owned.owner, owned.expires_at) == (spec.owner, spec.expires_at + 60)
        disk = Path(vm.handle["dir"]) / "disk.qcow2"
        info = json.loads(proc.run(["qemu-img", "info", "--output=json", str(disk)]).stdout)
        assert ("backing-filename" in info) == (clone is CloneKind.LINKED)
        backend.start(vm)
        backend.wait_ready(vm)
        assert vm.facts["accel"] in ("kvm", "tcg")
        with backend.guest(vm, client) as guest:
            guest.connect(timeout=60)
            observed = verify(guest, facts("debian"), vm.spec)
            assert observed["nic_driver"] == {"virtio": "virtio_net", "e1000": "e1000"}[nic.value]
            assert observed["vcpus"] == 2
            assert guest.run("echo hello from $(hostname)").stdout.startswith("hello from")
            # The lab refuses to measure a guest that is not what the cell asked for.
            wrong = VmSpec(
                **{**vm.spec.__dict__, "vcpus": 4, "nic": NicModel.E1000 if nic is NicModel.VIRTIO else NicModel.VIRTIO}
            )
            with pytest.raises(VerificationError, match="vCPUs"):
                verify(guest, facts("debian"), wrong)
            if nic is NicModel.VIRTIO:  # the ping workload, for real: the guest pings the run's bridge (~1 s)
                ctx = WorkloadContext(guest, client, "debian", 2, {"count": 5, "interval": 0.2, "size": 56})
                PING.prepare(ctx)
                rows = {s.metric: s for s in PING.parse(PING.run(ctx, 0))}
                assert rows["loss_pct"].value == 0 and 0 < rows["rtt_min_ms"].value <= rows["rtt_avg_ms"].value
                assert "flagged" not in rows["rtt_avg_ms"].labels and "cpu_busy_pct" in rows
        pid = vm.handle["pid"]
        t0 = time.monotonic()
        backend.destroy(vm)
        assert time.monotonic() - t0 < 5
        assert local.exited(pid)
        made["vm"] = None
    assert leftovers(workdir, run_id) == []


@pytest.mark.vm
@pytest.mark.image
@pytest.mark.xdist_group("boot")
def test_sigkill_mid_boot_then_gc_leaves_nothing(golden, workdir, tmp_path):
    cfg = write_lab(tmp_path, workdir, matrix='nic = ["virtio"]\n', suite='workloads = ["sysbench-cpu"]\n')
    p = subprocess.Popen(
        [*LAB, "run", "-c", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        vm_name = _wait_for_qemu(workdir)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stderr.close()
    run_id = vm_name.split("-")[1]
    # The orchestrator is gone; its VM, tap and namespace are still there.
    assert any("qemu" in x for x in leftovers(workdir, run_id))
    store = Store(tmp_path / "results")
    assert [lease["vm_name"] for lease in store.open_leases()] == [vm_name]
    assert [p.name for p in (tmp_path / "results").glob("*.lock")] == [f"run-{run_id}.lock"]
    res = run_lab_cli("gc", "-c", str(cfg), timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"removed local vm {vm_name}" in res.stdout
    assert leftovers(workdir, run_id) == []
    assert list((tmp_path / "results").glob("*.lock")) == []  # the killed run's lock beside the store too
    assert store.open_leases() == []
    # gc is idempotent
    res = run_lab_cli("gc", "-c", str(cfg), timeout=120)
    assert res.returncode == 0 and "removed 0" in res.stdout


@pytest.mark.vm
@pytest.mark.image
@pytest.mark.xdist_group("boot")
def test_sigterm_mid_boot_tears_down_by_itself(golden, workdir, tmp_path):
    cfg = write_lab(tmp_path, workdir, matrix='nic = ["e1000"]\n', suite='workloads = ["sysbench-cpu"]\n')
    p = subprocess.Popen(
        [*LAB, "run", "-c", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    vm_name = _wait_for_qemu(workdir)
    p.send_signal(signal.SIGTERM)
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr
    run_id = vm_name.split("-")[1]
    assert leftovers(workdir, run_id) == []
    store = Store(tmp_path / "results")
    assert store.open_leases() == []
    run = store.run(run_id)
    assert run.status == "interrupted"
    (cell,) = store.cells(run_id)
    assert cell.status == "failed" and cell.stage in ("boot", "clone", "ssh")


@pytest.mark.vm
@pytest.mark.image
@pytest.mark.xdist_group("boot")
def test_host_load_counts_a_foreign_hog_and_not_the_labs_own_qemu(golden, workdir):
    """A booting guest (TCG: its QEMU busy) is the lab's; a CPU hog outside the lab's process tree
    is foreign. On a machine with a core to spare the foreign load rises by about one core."""
    with local_run(workdir) as made:
        backend, run_id = made["backend"], made["run_id"]
        vm = made["vm"] = backend.clone(golden, make_spec(golden, run_id, NicModel.VIRTIO))
        backend.start(vm)
        qemu_pid = vm.handle["pid"]
        procs = hostload.read_processes()
        assert qemu_pid in hostload.lab_processes([vm], procs) and os.getpid() in hostload.lab_processes([vm], procs)
        quiet = _rates(vm, {"qemu": qemu_pid}, 3.0)
        hog = int(subprocess.run(["sh", "-c", HOG], capture_output=True, text=True, timeout=10).stdout)
        try:
            assert hog not in hostload.lab_processes([vm], hostload.read_processes())
            loaded = _rates(vm, {"qemu": qemu_pid, "hog": hog}, 3.0)
        finally:
            os.kill(hog, signal.SIGKILL)
        for r in (quiet, loaded):
            assert r["lab"] >= r["qemu"] - 0.05, r  # QEMU is inside the lab's share
        assert loaded["foreign"] >= loaded["hog"] - 0.1, loaded  # the hog is inside the foreign share
        assert loaded["lab"] <= loaded["qemu"] + 0.3, loaded  # and not in the lab's
        if quiet["busy"] < os.cpu_count() - 1.2:  # a core to spare: the hog gets about one
            assert 0.7 < loaded["foreign"] - quiet["foreign"] < 1.3, (quiet, loaded)
