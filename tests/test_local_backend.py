"""The local QEMU backend with real VMs: clone, boot, verify inside the guest, destroy, nothing left.

Also: `lab run` killed with SIGKILL mid-boot leaves things that `lab gc` removes, and SIGTERM
mid-run tears everything down by itself.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import proc
from lab.backends import local
from lab.errors import VerificationError
from lab.guest import Guest
from lab.model import CloneKind, NicModel, VmSpec
from lab.osfacts import facts
from lab.runner import verify
from lab.store import Store
from lab.wait import wait_until

from conftest import LAB, leftovers, local_run, run_lab_cli, write_lab

pytestmark = [pytest.mark.vm, pytest.mark.image]


def make_spec(golden, run_id, nic, vcpus=2, memory=1024, clone=CloneKind.LINKED, cell="c01"):
    return VmSpec(name=f"lab-{run_id}-{cell}", run_id=run_id, cell_id=cell, image=golden, nic=nic, vcpus=vcpus,
                  memory_mib=memory, clone=clone, expires_at=time.time() + 600)


def test_qemu_argv_carries_cell_choices(golden, tmp_path):
    spec = make_spec(golden, "abcd0001", NicModel.E1000, vcpus=3, memory=768)
    spec = VmSpec(**{**spec.__dict__, "ip": "10.77.0.10", "mac": "52:54:00:00:00:10"})
    argv = local.qemu_argv(spec, accel=local.Accel.TCG, vmdir=tmp_path, kernel=Path("k"), initrd=Path("i"),
                           cmdline="console=ttyS0", tap="tap000", gateway="10.77.0.1")
    joined = " ".join(argv)
    assert "-smp 3" in joined and "-m 768" in joined and "accel=tcg" in joined
    assert "e1000,netdev=n0,mac=52:54:00:00:00:10" in joined
    assert "lab.ip=10.77.0.10/24 lab.gw=10.77.0.1" in joined
    assert argv[argv.index("-name") + 1].startswith("lab-abcd0001-c01")


@pytest.mark.xdist_group("boot")
@pytest.mark.parametrize("nic,clone", [(NicModel.VIRTIO, CloneKind.LINKED), (NicModel.E1000, CloneKind.FULL)])
def test_boot_verify_run_destroy(golden, workdir, nic, clone):
    with local_run(workdir) as made:
        backend, run_id, client = made["backend"], made["run_id"], made["client"]
        spec = make_spec(golden, run_id, nic, clone=clone)
        vm = made["vm"] = backend.clone(golden, spec)
        disk = Path(vm.handle["dir"]) / "disk.qcow2"
        info = json.loads(proc.run(["qemu-img", "info", "--output=json", str(disk)]).stdout)
        assert ("backing-filename" in info) == (clone is CloneKind.LINKED)
        backend.start(vm)
        address = backend.wait_ready(vm)
        assert vm.facts["accel"] in ("kvm", "tcg")
        with Guest(address, key=local.lab_key(), netns=client.netns) as guest:
            guest.connect(timeout=60)
            observed = verify(guest, facts("debian"), vm.spec)
            assert observed["nic_driver"] == {"virtio": "virtio_net", "e1000": "e1000"}[nic.value]
            assert observed["vcpus"] == 2
            assert guest.run("echo hello from $(hostname)").stdout.startswith("hello from")
            # The lab refuses to measure a guest that is not what the cell asked for.
            wrong = VmSpec(**{**vm.spec.__dict__, "vcpus": 4,
                              "nic": NicModel.E1000 if nic is NicModel.VIRTIO else NicModel.VIRTIO})
            with pytest.raises(VerificationError, match="vCPUs"):
                verify(guest, facts("debian"), wrong)
        pid = vm.handle["pid"]
        t0 = time.monotonic()
        backend.destroy(vm)
        assert time.monotonic() - t0 < 5
        assert not Path(f"/proc/{pid}").exists() or local._zombie(pid)
        made["vm"] = None
    assert leftovers(workdir, run_id) == []


def _wait_for_qemu(workdir: Path, timeout: float = 120) -> str:
    def found():
        procs = local.qemu_processes(workdir)
        return procs[0][1] if procs else None

    return wait_until(found, timeout=timeout, what="lab run to start QEMU")


@pytest.mark.xdist_group("boot")
def test_sigkill_mid_boot_then_gc_leaves_nothing(golden, workdir, tmp_path):
    cfg = write_lab(tmp_path, workdir, matrix='nic = ["virtio"]\n', suite='workloads = ["sysbench-cpu"]\n')
    p = subprocess.Popen([*LAB, "run", "-c", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        vm_name = _wait_for_qemu(workdir)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    run_id = vm_name.split("-")[1]
    # The orchestrator is gone; its VM, tap and namespace are still there.
    assert any("qemu" in x for x in leftovers(workdir, run_id))
    store = Store(tmp_path / "results")
    assert [l["vm_name"] for l in store.open_leases()] == [vm_name]
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


@pytest.mark.xdist_group("boot")
def test_sigterm_mid_boot_tears_down_by_itself(golden, workdir, tmp_path):
    cfg = write_lab(tmp_path, workdir, matrix='nic = ["e1000"]\n', suite='workloads = ["sysbench-cpu"]\n')
    p = subprocess.Popen([*LAB, "run", "-c", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
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
