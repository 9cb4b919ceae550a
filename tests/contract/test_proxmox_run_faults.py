"""The chaos suite's PVE faults (pve_emulator/run_faults.py), each against the backend in a small
"run" (clone, start, wait, destroy, as the runner calls them), then one gc pass: the harness's
parts are known to inject what they say and to end with nothing left and nothing foreign touched."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pve_emulator import run_faults
from pve_emulator.fixtures import backend_settings, pve_certs_fixture, pve_env_fixture, pve_fixture  # noqa: F401

from lab.backends.proxmox import ProxmoxBackend
from lab.errors import AuthError, IncompleteListing, LabError, TeardownError
from lab.model import ImageRef, NicModel, VmSpec

IMAGE = ImageRef(name="debian12", os="debian", path=Path("debian12"), digest="d1", sha256="ab" * 32)


def backend(pve, pve_env, inj: run_faults.Injection, **over) -> ProxmoxBackend:
    settings = inj.merged_settings()
    settings["timeouts"] = {**settings["timeouts"], "ready": 3, "agent": 0.5, **over.pop("timeouts", {})}
    token = inj.env.get("LAB_CHAOS_PVE_TOKEN")
    if token:
        settings["token"] = token
    return ProxmoxBackend("pve", backend_settings(pve, **{**settings, **over}), pve_env)


def cell(b: ProxmoxBackend, *, hold: float = 0.0) -> str:
    """What the runner does with one cell; the error line, or "" when it ran."""
    b.check()
    b.check_images([IMAGE])
    vm = None
    try:
        vm = b.clone(
            IMAGE,
            VmSpec(
                name="lab-chaos-c01",
                run_id="chaos",
                cell_id="c01",
                image=IMAGE,
                nic=NicModel.VIRTIO,
                vcpus=1,
                memory_mib=512,
                ip="10.0.0.5",
                expires_at=time.time() + 3600,
            ),
        )
        b.start(vm)
        b.wait_ready(vm)
        time.sleep(hold)  # the workloads
        return ""
    except LabError as exc:
        return str(exc)
    finally:
        if vm is not None:
            try:
                b.destroy(vm)
            except TeardownError as exc:
                return str(exc)


def gc_pass(b: ProxmoxBackend) -> None:
    for item in sorted(b.list_owned(), key=lambda o: o.kind != "vm"):
        b.remove_owned(item)


@pytest.fixture
def chaos_pve(pve):
    """The emulator as the chaos harness sets it up: the lab's published template, no other."""
    with pve._lock:
        pve.vms.pop(9000)
        for key in [k for k, v in pve.volumes.items() if v.vmid == 9000]:
            pve.volumes.pop(key)
    run_faults.publish_template(pve, IMAGE)
    return pve


@pytest.mark.parametrize("fault", ["pve-backup-during-teardown", "pve-slow-stop"])
def test_the_run_cleans_up_by_itself(chaos_pve, pve_env, fault):
    pve = chaos_pve
    inj = (
        run_faults.backup_during_teardown(pve, 2.0)
        if fault == "pve-backup-during-teardown"
        else run_faults.slow_stop(pve, 1.5)
    )
    line = cell(backend(pve, pve_env, inj, timeouts={"stop": 0.3} if fault == "pve-slow-stop" else {}), hold=0.3)
    assert line == ""
    assert run_faults.leftovers(pve, inj) == []  # before any gc
    if fault == "pve-backup-during-teardown":
        assert any(t.type == "vzdump" for t in pve.tasks.values())


def test_a_backup_past_the_deadline_is_named_then_gc_finishes(chaos_pve, pve_env):
    pve = chaos_pve
    inj = run_faults.backup_past_the_teardown_deadline(pve, 3.0)
    line = cell(backend(pve, pve_env, inj, timeouts={"destroy": 1}))
    assert inj.check_run(pve, 1, line) == [], line
    inj.clear()
    gc_pass(backend(pve, pve_env, inj))
    assert run_faults.leftovers(pve, inj) == []


def test_a_node_offline_mid_run(chaos_pve, pve_env):
    pve = chaos_pve
    inj = run_faults.node_offline_mid_run(pve)
    line = cell(backend(pve, pve_env, inj, timeouts={"config": 1, "start": 1, "destroy": 1, "retry": 0.5}))
    assert "No route to host" in line or "node" in line, line
    inj.watcher.join(5)
    with pytest.raises(IncompleteListing):  # `lab gc` meanwhile: exit 1, the node named
        backend(pve, pve_env, inj).list_owned()
    inj.clear()
    gc_pass(backend(pve, pve_env, inj))
    assert run_faults.leftovers(pve, inj) == []


@pytest.mark.parametrize("when", ["before", "after"])
def test_dropped_connections(chaos_pve, pve_env, when):
    pve = chaos_pve
    inj = run_faults.dropped_connections(pve, every=6, when=when)
    assert cell(backend(pve, pve_env, inj, timeouts={"http": 0.5})) == ""
    assert pve.dropped >= 2
    inj.clear()
    assert run_faults.leftovers(pve, inj) == []


def test_hanging_connections(chaos_pve, pve_env):
    pve = chaos_pve
    inj = run_faults.hanging_connections(pve, every=8, seconds=0.8)
    assert cell(backend(pve, pve_env, inj, timeouts={"http": 0.3})) == ""
    assert pve.hung >= 2
    inj.clear()
    assert run_faults.leftovers(pve, inj) == []


def test_cfs_lock_contention(chaos_pve, pve_env):
    pve = chaos_pve
    inj = run_faults.cfs_lock_contention(pve, IMAGE, refusals=2)
    try:
        line = cell(backend(pve, pve_env, inj))
        assert line == "", line
        assert inj.check_run(pve, 1, "") == []  # the lock refused the lab's clone twice ...
        clones = sorted(
            (t for t in pve.tasks.values() if t.type == "qmclone" and t.user != "root@pam"), key=lambda t: t.start
        )
        assert [t.exitstatus for t in clones[-1:]] == ["OK"]  # ... and the clone after them was made
        assert all("cfs-lock" in (t.exitstatus or "") for t in clones[:-1]) and len(clones) >= 3
    finally:
        inj.clear()
    assert not inj.watcher.is_alive()
    assert run_faults.leftovers(pve, inj) == []


def test_foreign_resources(chaos_pve, pve_env):
    pve = chaos_pve
    inj = run_faults.foreign_resources(pve, IMAGE)
    b = backend(pve, pve_env, inj)
    assert cell(b) == ""
    for item in b.list_owned():  # gc --force: everything listed
        b.remove_owned(item)
    assert run_faults.leftovers(pve, inj) == [] and inj.touched() == []


@pytest.mark.parametrize("privilege", ["SDN.Use", "VM.Clone"])
def test_a_token_without_a_privilege(chaos_pve, pve_env, privilege):
    pve = chaos_pve
    inj = run_faults.token_without(pve, privilege)
    with pytest.raises(AuthError) as err:
        b = backend(pve, pve_env, inj)
        b.check()
        b.check_images([IMAGE])
    assert inj.check_run(pve, err.value.exit_code, str(err.value)) == []
    assert run_faults.leftovers(pve, inj) == []
