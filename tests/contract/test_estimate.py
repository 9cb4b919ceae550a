"""The plan's estimate (lab.estimate) on the fake backend: first-run defaults, then what a run
measured (stage times, prepares, warm-ups and repetitions from the store), on the same host,
image, accelerator and workload parameters only."""

from __future__ import annotations

import json
import statistics
import time

import fakes.backend
import pytest
from fakes.workload import FakeWorkload
from support.cli import lab_cli

from lab import estimate, lifecycle, plan, runner
from lab.store import Store

VM_STAGES = ["clone", "boot", "ssh", "verify", "tune"]


@pytest.fixture
def stepping_clock(monkeypatch):
    """lifecycle.clock advancing one second per reading: every stage and prepare lasts 1 s."""
    now = [1000.0]

    def clock():
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(lifecycle, "clock", clock)


def plan_estimate(cfg, store=None) -> estimate.Estimate:
    units = plan.units(cfg)
    params = {w: runner.workload_params(cfg, w) for w in cfg.suite.workloads}
    return estimate.estimate(cfg, units, params, store=store)


def executions(store, rid, warmups: bool):
    return [e.finished_at - e.started_at for e in store.timings.executions(rid) if (e.repetition < 0) == warmups]


def test_a_run_stores_the_time_of_each_stage(fake_lab, stepping_clock):
    fake_lab.write(matrix='nic = ["virtio", "e1000"]')
    cfg = fake_lab.load()
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store)
    times = store.timings.stage_times(rid)
    for cid in ("c01", "c02"):
        stages = [t.stage for t in times if t.cell_id == cid]
        assert stages == ["lease", *VM_STAGES, "prepare", "workloads", "teardown"], stages
        assert {t.seconds for t in times if t.cell_id == cid and t.stage in [*VM_STAGES, "prepare", "teardown"]} == {
            1.0
        }
    assert {t.workload for t in times if t.stage == "prepare"} == {"fake-work"}


def test_a_failed_stage_is_not_timed_but_the_teardown_is(fake_lab, stepping_clock):
    fake_lab.write(matrix='nic = ["virtio", "e1000"]', host='fail = { c01 = "boot" }')
    cfg = fake_lab.load()
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store)
    assert [t.stage for t in store.timings.stage_times(rid) if t.cell_id == "c01"] == ["lease", "clone", "teardown"]
    # the boot that failed says nothing about how long a boot takes: the estimate has c02's only
    assert estimate.measured(store, "f", "debian12", {}).stages["boot"] == 1.0


def test_the_next_plan_estimates_from_what_the_run_measured(fake_lab, stepping_clock):
    fake_lab.write(matrix='nic = ["virtio", "e1000"]', suite="repetitions = 3\nwarmup = 1")
    cfg = fake_lab.load()
    first = plan_estimate(cfg)
    assert first.basis == "defaults" and first.describe().startswith("first-run defaults")
    rep = estimate.default_repetition("fake-work", runner.workload_params(cfg, "fake-work"))
    per_cell = runner.BOOT_ESTIMATE_S + estimate.PREPARE_DEFAULT_S + rep + 3 * rep
    assert first.seconds == pytest.approx(2 * per_cell + estimate.RUN_OVERHEAD_DEFAULT_S)

    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store)
    after = plan_estimate(cfg, store)
    assert after.basis == "measured" and after.measured == {"f": [rid]} and after.defaulted == []
    assert after.describe() == "from 1 earlier run on host f"
    warm, reps = statistics.median(executions(store, rid, True)), statistics.median(executions(store, rid, False))
    spent, spent_runs = estimate.run_overhead(store, "f")
    assert spent_runs == [rid] and spent is not None
    # each stage and prepare took 1 s (the stepping clock), the workload and the run what the store says
    assert after.seconds == pytest.approx(2 * (len(VM_STAGES) + 1 + 1 + warm + 3 * reps) + spent)
    assert after.seconds < first.seconds / 2

    # the CLI says so, in text and JSON
    res = lab_cli("plan", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    assert res.returncode == 0 and "(from 1 earlier run on host f)" in res.stdout, res.stdout
    doc = json.loads(lab_cli("plan", "--json", "-c", str(fake_lab.path), cwd=fake_lab.dir).stdout)
    assert doc["estimate"]["basis"] == "measured" and doc["estimate"]["runs"] == {"f": [rid]}
    assert doc["estimate"]["seconds"] == pytest.approx(after.seconds, abs=0.1)


def test_other_workload_parameters_fall_back_to_defaults_for_that_workload(fake_lab, stepping_clock):
    fake_lab.write()
    cfg = fake_lab.load()
    store = Store(cfg.results_dir)
    runner.run_lab(cfg, store)
    fake_lab.write(suite="[suite.params.fake-work]\nseconds = 5.0")  # a repetition now lasts longer
    changed = plan_estimate(fake_lab.load(), store)
    assert changed.basis == "mixed"
    assert changed.defaulted == ["f/debian12 fake-work", "f/debian12 fake-work prepare"]
    assert "defaults for f/debian12 fake-work" in changed.describe()


def test_only_the_newest_accelerator_and_the_same_image_count(fake_lab):
    fake_lab.write()
    cfg = fake_lab.load()
    store = Store(cfg.results_dir)
    params = {"fake-work": runner.workload_params(cfg, "fake-work")}
    for rid, accel, boot, image in (
        ("old", "tcg", 50.0, "debian12"),
        ("new", "kvm", 5.0, "debian12"),
        ("other", "kvm", 99.0, "alpine"),
    ):
        store.create_run(
            rid, "fake", config_path="", config_text="", seed=1, lab_version="t", manifest={"workloads": params}
        )
        store.add_cell(rid, "c01", 1, "x", {"host": "f", "image": image})
        store.cell_update(rid, "c01", facts={"accel": accel})
        store.timings.add_stage_time(rid, "c01", 1, "boot", boot)
    got = estimate.measured(store, "f", "debian12", params)
    assert got.runs == ["new"] and got.stages == {"boot": 5.0}  # TCG's 50 s and alpine's 99 s left out
    assert estimate.measured(store, "g", "debian12", params).runs == []  # another host: nothing


def test_the_run_overhead_is_what_a_run_spent_outside_its_cells(fake_lab):
    fake_lab.write()
    store = Store(fake_lab.load().results_dir)
    for rid, status, took in (("r1", "done", 100.0), ("r2", "done", 80.0), ("r3", "failed", 500.0)):
        store.create_run(rid, "fake", config_path="", config_text="", seed=1, lab_version="t", manifest={})
        store.add_cell(rid, "c01", 1, "x", {"host": "f", "image": "debian12"})
        store.cell_update(rid, "c01", status="done" if status == "done" else "failed")
        for stage, seconds in (("boot", 30.0), ("workloads", 30.0), ("prepare", 10.0)):  # prepare: inside workloads
            store.timings.add_stage_time(rid, "c01", 1, stage, seconds)
        store.finish_run(rid, status)
        store.db.execute("UPDATE runs SET started_at = 1000, finished_at = ? WHERE id = ?", (1000 + took, rid))
    spent, runs = estimate.run_overhead(store, "f")
    assert sorted(runs) == ["r1", "r2"] and spent == pytest.approx(30.0)  # median of 40 and 20; r3 failed
    assert estimate.run_overhead(store, "g") == (None, [])


def test_a_store_that_cannot_be_read_leaves_the_plan_on_defaults(fake_lab):
    fake_lab.write()
    (fake_lab.dir / "results").mkdir()
    (fake_lab.dir / "results" / Store.FILENAME).write_bytes(b"not a database, " * 100)
    res = lab_cli("plan", "--json", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    assert res.returncode == 0 and json.loads(res.stdout)["estimate"]["basis"] == "defaults"
    assert res.stderr.count("\n") == 1 and "lab: warning:" in res.stderr and "first-run defaults" in res.stderr


def test_a_host_waited_for_adds_its_quiet_wait_to_each_repetition(fake_lab, stepping_clock):
    fake_lab.write(host="local_host = true", suite='repetitions = 3\nquiet_seconds = 0.2\nquiet_host = "wait"')
    cfg = fake_lab.load()
    rep = estimate.default_repetition("fake-work", runner.workload_params(cfg, "fake-work"))
    first = plan_estimate(cfg)
    assert first.seconds == pytest.approx(
        runner.BOOT_ESTIMATE_S + estimate.PREPARE_DEFAULT_S + rep + 3 * (0.2 + rep) + estimate.RUN_OVERHEAD_DEFAULT_S
    )
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store)
    quiet = [t.seconds for t in store.timings.stage_times(rid) if t.stage == "quiet"]
    assert quiet == [1.0, 1.0, 1.0]  # measured repetitions only, each 1 s on the stepping clock
    after = plan_estimate(cfg, store)
    assert after.basis == "measured" and estimate.measured(store, "f", "debian12", {}).stages["quiet"] == 1.0


def test_after_a_run_the_estimate_of_the_same_lab_is_that_runs_length(fake_lab, monkeypatch):
    """Nothing a run spends is left out or counted twice: with every step taking real time (a
    boot, a prepare, each repetition), the estimate from one run is that run's wall time."""

    def slow(method, seconds):
        def wrapper(self, *a, **k):
            time.sleep(seconds)
            return method(self, *a, **k)

        return wrapper

    monkeypatch.setattr(fakes.backend.FakeBackend, "start", slow(fakes.backend.FakeBackend.start, 0.15))
    monkeypatch.setattr(FakeWorkload, "prepare", slow(FakeWorkload.prepare, 0.1))
    monkeypatch.setattr(FakeWorkload, "run", slow(FakeWorkload.run, 0.05))
    fake_lab.write(matrix='nic = ["virtio", "e1000"]', suite="repetitions = 3\nwarmup = 1")
    cfg = fake_lab.load()
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store)
    run = store.run(rid)
    took = run.finished_at - run.started_at
    assert plan_estimate(cfg, store).seconds == pytest.approx(took, rel=0.15), took
