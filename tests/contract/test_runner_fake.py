"""The runner's lifecycle on the fake backend (tests/fakes): no root, no QEMU, no SSH. Teardown
always runs, the failing stage is recorded, n/a and duplicate cells, interleaved rounds, adaptive
repetitions, resume, and nothing measured is lost when a cell fails midway."""

from __future__ import annotations

import fakes.backend as fake
import pytest

from lab import runner
from lab.errors import TeardownError
from lab.lifecycle import Interrupted
from lab.model import CellStatus
from lab.store import Store


def run(lab, **kw):
    cfg = lab.load()
    store = Store(cfg.results_dir)
    return cfg, store, runner.run_lab(cfg, store, **kw)


def events(kind):
    return [name for ev, name in fake.JOURNAL if ev == kind]


def cell(store, rid, cid):
    return next(c for c in store.cells(rid) if c.cell_id == cid)


def test_a_clean_run_measures_every_cell_and_leaves_nothing(fake_lab):
    fake_lab.write(matrix='nic = ["virtio", "e1000"]')
    cfg, store, rid = run(fake_lab)
    assert [(c.cell_id, c.status) for c in store.cells(rid)] == [("c01", "done"), ("c02", "done")]
    assert store.run(rid).status == "done"
    assert sorted(events("destroy")) == sorted(events("clone")) == [f"lab-{rid}-c01", f"lab-{rid}-c02"]
    assert fake.LIVE == {} and store.open_leases() == []
    assert all(g.closed for g in fake.GUESTS.values())
    samples = [s for s in store.samples(rid) if s.metric == "ops_per_s"]
    assert len(samples) == 4 and {s.labels["nic"] for s in samples} == {"virtio", "e1000"}
    assert events("open_run") == events("close_run") == [rid]


STAGES = ["clone", "boot", "ssh", "verify", "tune", "workloads"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_failing_stage_is_recorded_and_teardown_runs(fake_lab, stage):
    fake_lab.write(matrix='nic = ["virtio", "e1000"]', host=f'fail = {{ c01 = "{stage}" }}')
    cfg, store, rid = run(fake_lab)
    failed, other = cell(store, rid, "c01"), cell(store, rid, "c02")
    assert failed.status == "failed" and failed.stage == stage, (failed.stage, failed.error)
    assert failed.error.startswith(f"{stage}: ") and "injected failure" in failed.error
    assert other.status == "done"  # the other cells go on
    assert fake.LIVE == {} and store.open_leases() == []  # destroyed, then the lease released
    made = stage != "clone"
    assert (f"lab-{rid}-c01" in events("destroy")) == made
    assert ("FAKE-CONSOLE-END" in failed.facts.get("console_tail", "")) == made
    if made:
        assert len(failed.facts["console_tail"].splitlines()) == 15
    assert store.run(rid).status == "done"  # a failed cell does not fail the run


def test_a_failed_teardown_keeps_the_lease_and_fails_the_run_loudly(fake_lab):
    fake_lab.write(host='fail = { c01 = "teardown" }')
    cfg = fake_lab.load()
    store = Store(cfg.results_dir)
    with pytest.raises(TeardownError, match="teardown failed"):
        runner.run_lab(cfg, store, run_id="r1")
    c = cell(store, "r1", "c01")
    assert c.status == "failed" and c.error.startswith("teardown: ")
    assert [lease["vm_name"] for lease in store.open_leases()] == ["lab-r1-c01"]  # for `lab gc`
    run_row = store.run("r1")
    assert run_row.status == "failed" and "teardown failed" in run_row.error
    assert events("close_run") == ["r1"]


@pytest.mark.parametrize("stage", ["clone", "boot", "ssh", "verify", "tune", "workloads"])
def test_an_interrupt_tears_down_and_records_the_stage(fake_lab, stage):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]', host=f'interrupt = {{ c01 = "{stage}" }}', suite='order = "sequential"'
    )
    cfg = fake_lab.load()
    store = Store(cfg.results_dir)
    with pytest.raises(Interrupted):
        runner.run_lab(cfg, store, run_id="r1")
    c = cell(store, "r1", "c01")
    assert (c.status, c.stage, c.error) == ("failed", stage, f"{stage}: interrupted")
    assert cell(store, "r1", "c02").status == "pending"  # never started
    assert fake.LIVE == {} and store.open_leases() == []
    assert store.run("r1").status == "interrupted" and events("close_run") == ["r1"]


def test_nothing_measured_is_lost_when_a_cell_fails_midway(fake_lab):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]',
        host='fail = { c01 = "workloads@2" }',
        suite="repetitions = 4\n[suite.params.fake-work]\nvalues = [10.0, 20.0, 30.0, 40.0]",
    )
    cfg, store, rid = run(fake_lab)
    c = cell(store, rid, "c01")
    assert c.status == "failed" and c.stage == "workloads"
    kept = sorted(s.value for s in store.samples(rid) if s.cell_id == "c01" and s.metric == "ops_per_s")
    assert kept == [10.0, 20.0]  # repetitions 0 and 1 were committed before 2 failed
    outcomes = [(e.repetition, e.outcome) for e in store.timings.executions(rid) if e.cell_id == "c01"]
    assert outcomes == [(-1, "ok"), (0, "ok"), (1, "ok"), (2, "failed")]
    assert cell(store, rid, "c02").status == "done"


def test_n_a_when_a_knob_cannot_apply(fake_lab):
    fake_lab.write(matrix='offloads = ["default", "lro=off"]', host='lro = "fixed-on"')
    cfg, store, rid = run(fake_lab)
    na = cell(store, rid, "c02")
    assert na.status == CellStatus.NA and "[fixed]" in na.error
    assert cell(store, rid, "c01").status == "done"
    assert f"lab-{rid}-c02" in events("destroy") and fake.LIVE == {}
    assert not [s for s in store.samples(rid) if s.cell_id == "c02"]


def test_duplicates_known_at_plan_time_are_not_booted(fake_lab):
    # cubic is what the guest runs by default: cc = "cubic" is the same configuration as "default"
    fake_lab.write(matrix='cc = ["default", "cubic"]')
    cfg, store, rid = run(fake_lab)
    dup = cell(store, rid, "c02")
    assert dup.status == CellStatus.DUPLICATE and dup.facts == {"duplicate_of": "c01", "duplicate_found": "plan"}
    assert events("clone") == [f"lab-{rid}-c01"]


def test_the_cc_knob_after_a_profile_that_sets_another_is_what_the_cell_records(fake_lab):
    # wan-16m sets bbr; cc = "cubic" is applied after it: the facts say cubic, in both places
    fake_lab.write(matrix='tuning = ["wan-16m"]\ncc = ["cubic"]')
    cfg, store, rid = run(fake_lab)
    t = cell(store, rid, "c01").facts["tuning"]
    assert t["cc"] == {"asked": "cubic", "effective": "cubic"}
    assert t["effective"]["net.ipv4.tcp_congestion_control"] == "cubic"
    assert t["effective"]["net.core.rmem_max"] == "16777216"  # the profile's other values stand


def test_duplicates_found_by_read_back_stop_before_the_workloads(fake_lab):
    # the NIC comes with LRO off: lro=off changes nothing, which only the read-back shows
    fake_lab.write(matrix='offloads = ["default", "lro=off"]', host='lro = "off"')
    cfg, store, rid = run(fake_lab)
    dup = cell(store, rid, "c02")
    assert dup.status == CellStatus.DUPLICATE and dup.facts["duplicate_found"] == "read-back"
    assert "duplicate of c01" in dup.error
    assert f"lab-{rid}-c02" in events("destroy")
    assert not [s for s in store.samples(rid) if s.cell_id == "c02"]


def test_interleaved_rounds_follow_the_seed(fake_lab):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000", "e1000e"]', suite='repetitions = 3\norder = "interleaved"\nseed = 7'
    )
    cfg, store, rid = run(fake_lab)
    rounds = store.run(rid).manifest["rounds"]
    assert len(rounds) == 3 and all(sorted(r) == ["c01", "c02", "c03"] for r in rounds)
    again = Store(cfg.results_dir.parent / "again")
    fake.reset()
    rid2 = runner.run_lab(cfg, again)
    assert again.run(rid2).manifest["rounds"] == rounds  # the same seed replays the same order
    # one boot per cell and round; measured repetitions in the rounds' order
    assert len(events("clone")) == 9
    measured = [(e.round, e.cell_id) for e in store.timings.executions(rid) if e.repetition >= 0]
    assert measured == [(i, c) for i, r in enumerate(rounds, start=1) for c in r]
    assert all(c.status == "done" for c in store.cells(rid))
    assert {(s.cell_id, s.labels["round"]) for s in store.samples(rid) if s.metric == "ops_per_s"} == {
        (c, i) for i, r in enumerate(rounds, start=1) for c in r
    }


def test_a_failed_cell_leaves_the_rounds_and_the_others_go_on(fake_lab):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]',
        host='fail = { c02 = "boot" }',
        suite='repetitions = 3\norder = "interleaved"\nseed = 1',
    )
    cfg, store, rid = run(fake_lab)
    assert cell(store, rid, "c02").status == "failed"
    assert [r for r in store.run(rid).manifest["rounds"]][1:] == [["c01"], ["c01"]]
    assert cell(store, rid, "c01").status == "done" and fake.LIVE == {}


def test_adaptive_repetitions_stop_on_the_ci_or_the_budget(fake_lab):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]',
        host="",
        suite="repetitions = 3\ntarget_ci_pct = 2.0\nmax_repetitions = 8\n"
        "[suite.params.fake-work]\nvalues = [100.0, 100.5, 99.5, 100.2, 99.8]",
    )
    cfg, store, rid = run(fake_lab)
    stopped = store.run(rid).manifest["repetitions"]
    assert stopped["c01"]["fake-work"]["n"] == 5 and "within ±2 %" in stopped["c01"]["fake-work"]["stopped"]
    noisy = fake_lab.write(
        suite="repetitions = 3\ntarget_ci_pct = 2.0\nmax_repetitions = 8\n"
        "[suite.params.fake-work]\nvalues = [50.0, 150.0, 80.0, 130.0]"
    )
    fake.reset()
    cfg2 = fake_lab.load()
    store2 = Store(cfg2.results_dir)
    rid2 = runner.run_lab(cfg2, store2)
    out = store2.run(rid2).manifest["repetitions"]["c01"]["fake-work"]
    assert out["n"] == 8 and out["stopped"].startswith("budget: 8 repetitions"), (noisy, out)


def test_the_hosts_ssh_timeout_is_what_a_guests_login_may_take(fake_lab):
    fake_lab.write(host='ssh_timeout = 7.5\nclient = "vm"\n')
    cfg, store, rid = run(fake_lab)
    assert cell(store, rid, "c01").status == "done"
    # the cell's VM and the host's client VM
    assert sorted(g.connect_timeout for g in fake.GUESTS.values()) == [7.5, 7.5], fake.GUESTS


def test_resume_reruns_what_did_not_finish_and_keeps_the_rest(fake_lab):
    fake_lab.write(matrix='nic = ["virtio", "e1000"]', host='fail = { c02 = "boot" }')
    cfg, store, rid = run(fake_lab)
    assert cell(store, rid, "c02").status == "failed"
    kept = [s.value for s in store.samples(rid) if s.cell_id == "c01"]
    fake_lab.write(matrix='nic = ["virtio", "e1000"]')  # the host is fixed; the matrix is the same
    fake.reset()
    cfg = fake_lab.load()
    assert runner.run_lab(cfg, store, resume=rid) == rid
    assert events("clone") == [f"lab-{rid}-c02"]  # only the unfinished cell runs again
    assert [(c.cell_id, c.status) for c in store.cells(rid)] == [("c01", "done"), ("c02", "done")]
    assert [s.value for s in store.samples(rid) if s.cell_id == "c01"] == kept
    assert store.run(rid).status == "done"


def test_the_bare_metal_cell_uses_the_backend_and_the_same_lifecycle(fake_lab):
    fake_lab.write(suite="bare_metal = true")
    cfg, store, rid = run(fake_lab)
    bm = cell(store, rid, "bm01")
    assert bm.status == "done" and bm.facts["verified"]["nic_driver"] == "veth"
    assert events("bare_metal") == events("destroy")[-1:] == [f"lab-{rid}-bm01"]
    assert fake.LIVE == {} and store.open_leases() == []
    assert [s for s in store.samples(rid) if s.cell_id == "bm01" and s.metric == "ops_per_s"]


def test_a_failing_bare_metal_cell_is_torn_down_too(fake_lab):
    fake_lab.write(suite="bare_metal = true", host='fail = { bm01 = "workloads" }')
    cfg, store, rid = run(fake_lab)
    bm = cell(store, rid, "bm01")
    assert bm.status == "failed" and bm.stage == "workloads"
    assert f"lab-{rid}-bm01" in events("destroy") and fake.LIVE == {}


def test_gc_removes_what_a_partial_listing_found_and_says_what_it_could_not_check(fake_lab):
    from lab import gc
    from lab.model import Vm

    fake_lab.write(host='unlisted = ["node2: offline"]')
    cfg = fake_lab.load()
    fake.LIVE["lab-dead1-c01"] = Vm(spec=None, backend="fake", handle={"name": "lab-dead1-c01", "cell_id": "c01"})
    report = gc.collect(cfg, hosts=["f"])
    assert report.removed == 1 and fake.LIVE == {}
    assert report.errors == ["f: not checked: node2: offline"]


def test_adaptive_repetitions_go_on_while_a_primary_row_is_unknown(fake_lab):
    """Two cells differing in one axis (a comparison the run will be asked): the CI target (±50 %)
    is met at n = 5 by both, but at n = 5 their fake-work ops/s (its primary metric, CV 9 %) is
    neither different nor the same within ±7.5 %. c01, measured first, has nobody to compare with
    yet and stops; c02 goes on until its row is decided or the budget is spent: here the budget,
    since c01's five values bound how narrow the CI of the ratio can get (sequential order)."""
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]',
        host="",
        suite="repetitions = 5\ntarget_ci_pct = 50.0\nmax_repetitions = 12\nseed = 1\n"
        "[suite.params.fake-work]\nvalues = [100.0, 115.0, 88.0, 108.0, 92.0, 104.0, 96.0]",
    )
    cfg, store, rid = run(fake_lab)
    stopped = store.run(rid).manifest["repetitions"]
    assert stopped["c01"]["fake-work"] == {
        "n": 5,
        "load_flagged": 0,
        "seconds": 5.0,
        "stopped": "95 % CI of the median within ±50 % at n = 5",
    }
    later = stopped["c02"]["fake-work"]
    assert (later["n"], later["stopped"]) == (12, "budget: 12 repetitions (unknown: ops_per_s vs c01)"), later
    assert store.run(rid).manifest["schedule"]["decide"] == {"margin_pct": 7.5, "alpha": 0.05}
