"""Reliability on real VMs: resume after a kill -9, two labs at once, gc policy on expiry."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from lab import config, gc, runlock
from lab.errors import TeardownError, UsageError
from lab.model import Owned
from lab.runlock import RunLock, RunLocks, run_lock_path
from lab.runner import resumable
from lab.store import Store


def test_resume_refuses_changed_images(tmp_path):
    store = Store(tmp_path)
    manifest = {
        "images": {"debian12": {"digest": "aaa", "tools": {"sysbench": "1.0.20"}}},
        "workloads": {"sysbench-cpu": {"time": 1}},
    }
    store.create_run("r1", "t", config_path="", config_text="", seed=3, lab_version="0", manifest=manifest)
    cfg = config.LabConfig.model_validate({"matrix": {"nic": ["virtio"]}})
    from lab import plan

    cells = plan.cells(cfg)
    store.add_cell("r1", "c01", 1, cells[0].label, cells[0].axes())
    assert resumable(store, "r1", cells, manifest)[:2] == ("r1", 3)
    changed = json.loads(json.dumps(manifest))
    changed["images"]["debian12"]["digest"] = "bbb"
    with pytest.raises(UsageError, match="image debian12 changed"):
        resumable(store, "r1", cells, changed)
    two = plan.cells(config.LabConfig.model_validate({"matrix": {"nic": ["virtio", "e1000"]}}))
    with pytest.raises(UsageError, match="matrix changed"):
        resumable(store, "r1", two, manifest)


class _Warm:
    def __init__(self, backend, snapshots):
        self.backend, self.items = backend, snapshots

    def snapshots(self):
        return list(self.items)

    def remove(self, item):
        self.backend.removed.append(item.name)


class _Remote:
    """A backend that cannot tell whether a run elsewhere is alive (like Proxmox or libvirt)."""

    name = "remote"

    def __init__(self, items, warm=()):
        self.items, self.removed = items, []
        self.warm = _Warm(self, list(warm))  # its WarmSnapshots part

    def list_owned(self):
        return self.items

    def remove_owned(self, item):
        self.removed.append(item.name)

    def run_is_live(self, run_id):
        return None  # a run of another machine: this one cannot tell


def test_gc_on_remote_hosts_removes_only_expired_leases_unless_forced(tmp_path):
    cfg = config.LabConfig.model_validate({"lab": {"results": str(tmp_path)}})
    now = time.time()
    items = [Owned("remote", "vm", "lab-a-c01", "a", now - 10), Owned("remote", "vm", "lab-b-c01", "b", now + 3600)]
    b = _Remote(items)
    report = gc.collect(cfg, backends={"pve": b}, now=now)
    assert b.removed == ["lab-a-c01"] and report.kept == 1
    b = _Remote(items)
    gc.collect(cfg, backends={"pve": b}, now=now, force=True)
    assert b.removed == ["lab-a-c01", "lab-b-c01"]


def test_gc_removes_warm_snapshots_of_image_builds_that_are_gone(tmp_path, monkeypatch):
    """A warm snapshot is no run's: it stays while its image build is this machine's, and goes
    (dry run: would go) once that build is rebuilt or removed."""
    from lab import images
    from lab.model import ImageRef

    cfg = config.LabConfig.model_validate({"lab": {"results": str(tmp_path)}})
    built = ImageRef("debian12", "debian", tmp_path / "d.qcow2", digest="d" * 64, sha256="s" * 64)
    monkeypatch.setattr(images, "list_images", lambda images_dir=None: [built])
    warm = [
        Owned("remote", "warm", "lab-warm-current", "", detail="s" * 64),
        Owned("remote", "warm", "lab-warm-old", "", detail="o" * 64),
    ]
    b = _Remote([], warm)
    report = gc.collect(cfg, backends={"pve": b}, dry_run=True)
    assert b.removed == [] and "would remove pve warm lab-warm-old (its image build is gone)" in report.lines
    report = gc.collect(cfg, backends={"pve": b})
    assert b.removed == ["lab-warm-old"] and report.removed == 1 and not report.errors


def _store_with_run(results, run_id: str) -> Store:
    store = Store(results)
    store.create_run(run_id, "t", config_path="", config_text="", seed=1, lab_version="0", manifest={})
    store.add_cell(run_id, "c01", 1, "c01", {})
    store.cell_update(run_id, "c01", status="running", stage="workloads")
    return store


def test_gc_removes_remote_vms_of_a_dead_run_of_this_store_before_expiry(tmp_path):
    """Found by the chaos suite (pve-lock-on-teardown): a VM whose teardown failed outlives its
    run; the run dropped its backend lock when it ended, so gc could not tell and kept the VM
    until its lease expired (2 h). The run lock beside the store says the run is over."""
    cfg = config.LabConfig.model_validate({"lab": {"results": str(tmp_path)}})
    store = _store_with_run(tmp_path, "dead")
    _store_with_run(tmp_path, "alive").close()
    lock = RunLock(run_lock_path(tmp_path, "alive"))
    lock.acquire("test")
    try:
        later = time.time() + 3600
        b = _Remote(
            [
                Owned("remote", "vm", "lab-dead-c01", "dead", later),
                Owned("remote", "vm", "lab-alive-c01", "alive", later),
                Owned("remote", "vm", "lab-other-c01", "other", later),
            ]
        )  # another machine's run
        report = gc.collect(cfg, backends={"pve": b})
        assert b.removed == ["lab-dead-c01"] and report.kept == 2
        # the killed run reads failed, with one line saying how to go on; the live one is untouched
        assert store.run("dead").status == "failed" and "--resume dead" in store.run("dead").error
        assert store.cells("dead")[0].status == "failed"
        assert store.cells("dead")[0].error.startswith("workloads: the lab process ended")
        assert store.run("alive").status == "running" and store.cells("alive")[0].status == "running"
    finally:
        lock.release()


def test_a_waiter_never_holds_a_lock_file_its_holder_removed(tmp_path):
    """The run's lock is unlinked by its holder (release) or by gc (remove_if_dead) while held;
    a `lab run --resume` waiting on the old file must end up holding the file at the path."""
    import os
    import threading

    path = tmp_path / "run-x.lock"
    first, second = RunLock(path), RunLock(path)
    first.acquire("first")
    waiter = threading.Thread(target=second.acquire, args=("second",), kwargs={"timeout": 10})
    waiter.start()
    time.sleep(0.3)  # the waiter has opened the old file and retries its flock
    first.release()
    waiter.join(15)
    try:
        assert not waiter.is_alive()
        assert runlock.held(path) is True
        assert os.fstat(second._fh.fileno()).st_ino == path.stat().st_ino
    finally:
        second.release()
    assert runlock.held(path) is None


def test_remove_if_dead_spares_a_held_lock(tmp_path):
    path = tmp_path / "run-x.lock"
    assert runlock.remove_if_dead(path) is False  # no file
    lock = RunLock(path)
    lock.acquire("test")
    try:
        assert runlock.remove_if_dead(path) is False and path.exists()
    finally:
        lock.release()
    path.write_text("12345")  # what `lab run` killed with -9 leaves
    assert runlock.remove_if_dead(path) is True and not path.exists()


def test_gc_removes_run_locks_of_dead_runs_once_nothing_else_of_theirs_remains(tmp_path):
    """A run killed with -9 leaves lock files beside the store and, for remote backends, in
    RUN_LOCK_DIR. gc removes them, but not while the run still has an item it could not remove:
    the file is what tells the next gc that the run is dead."""
    cfg = config.LabConfig.model_validate({"lab": {"results": str(tmp_path / "results")}})
    for run_id in ("gone", "stuck"):
        _store_with_run(cfg.results_dir, run_id).close()
        run_lock_path(cfg.results_dir, run_id).write_text("1")
    locks = RunLocks(lambda run_id: tmp_path / "locks" / f"remote-h@{run_id}.lock")
    (tmp_path / "locks").mkdir()
    for run_id in ("gone", "stuck"):
        locks.path_of(run_id).write_text("1")
    live = RunLock(locks.path_of("alive"))
    live.acquire("test")

    class Stuck(_Remote):
        def run_is_live(self, run_id):
            return locks.live(run_id)

        def list_owned(self):
            return self.items + locks.owned(self.name)

        def remove_owned(self, item):
            if item.kind == "lock":
                runlock.remove_if_dead(Path(item.detail))
            elif item.run_id == "stuck":
                raise TeardownError("VM is locked (backup)")
            super().remove_owned(item)

    try:
        later = time.time() + 3600
        b = Stuck(
            [
                Owned("remote", "vm", "lab-gone-c01", "gone", later),
                Owned("remote", "vm", "lab-stuck-c01", "stuck", later),
            ]
        )
        b.name = "remote"
        report = gc.collect(cfg, backends={"h": b})
        assert b.removed == ["lab-gone-c01", "remote-h@gone.lock"], report.lines
        assert not locks.path_of("gone").exists() and not run_lock_path(cfg.results_dir, "gone").exists()
        assert f"removed {run_lock_path(cfg.results_dir, 'gone')}" in report.lines
        # the stuck run's VM could not go: its locks stay, so the next gc still knows it is dead
        assert locks.path_of("stuck").exists() and run_lock_path(cfg.results_dir, "stuck").exists()
        assert "keep   h lock remote-h@stuck.lock (run stuck still has items here)" in report.lines
        assert any("lab-stuck-c01" in e for e in report.errors)
        # the live run's lock is never touched
        assert "keep   h lock remote-h@alive.lock (run alive is live)" in report.lines
        assert runlock.held(locks.path_of("alive")) is True
    finally:
        live.release()
