"""Lanes (lab.runner.lanes): a run on several fake hosts runs one lane per host at once. Order
within a lane, a lost host ending its lane only, an interrupt tearing every lane down, the
manifest's lanes and overlaps, the shared store and reporter, and the scale of many hosts."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time

import fakes.backend as fake
import fakes.workload as fake_workload
import pytest

from lab import config, plan, runner
from lab.cli.progress import Eta, PlainReporter
from lab.lifecycle import Interrupted
from lab.model import Sample
from lab.runner import lanes
from lab.store import Store


def write_lab(
    fake_lab,
    hosts: dict[str, str],
    *,
    vcpus: int = 2,
    memory: int = 1,
    sleep_s: float = 0.0,
    suite: str = "",
    repetitions: int = 1,
) -> object:
    """A lab of fake hosts (name -> extra lines of its table) × `vcpus` × `memory` cells each."""
    text = '[lab]\nname = "lanes"\nresults = "results"\n'
    text += "".join(f'[hosts.{h}]\nbackend = "fake"\n{extra}\n' for h, extra in hosts.items())
    text += (
        f"[matrix]\nhost = {json.dumps(list(hosts))}\nvcpus = {json.dumps(list(range(1, vcpus + 1)))}\n"
        f"memory_mib = {json.dumps([1024 + i for i in range(memory)])}\n"
    )
    given = {line.split("=")[0].strip() for line in suite.splitlines()}
    workloads = "" if "workloads" in given else 'workloads = ["fake-work"]\n'
    text += (
        f'[suite]\n{workloads}repetitions = {repetitions}\nwarmup = 0\nquiet_host = "off"\n'
        + suite
        + f"\n[suite.params.fake-work]\nsleep_s = {sleep_s}\n"
    )
    fake_lab.path.write_text(text)
    return config.load(fake_lab.path)


def run_with(fake_lab, probes: list, hosts: dict[str, str], **lab) -> tuple[Store, str]:
    """Register `probes` (workloads), run a lab of `hosts` (write_lab's `lab` keywords), unregister."""
    from lab import workloads

    for probe in probes:
        workloads.register(probe)
    try:
        cfg = write_lab(fake_lab, hosts, **lab)
        store = Store(cfg.results_dir)
        return store, runner.run_lab(cfg, store)
    finally:
        for probe in probes:
            workloads.unregister(probe.name)


def timed_run(cfg) -> tuple[Store, str, float]:
    """Run `cfg`: its store, the run id and the wall time."""
    store = Store(cfg.results_dir)
    started = time.monotonic()
    rid = runner.run_lab(cfg, store)
    return store, rid, time.monotonic() - started


def by_status(store, rid):
    out: dict[str, list[str]] = {}
    for c in store.cells(rid):
        out.setdefault(c.status, []).append(c.cell_id)
    return out


def host_of(store, rid):
    return {c.cell_id: c.axes["host"] for c in store.cells(rid)}


# -- pure parts ----------------------------------------------------------------------------------


def test_split_keeps_the_run_order_within_each_lane(fake_lab):
    cfg = write_lab(fake_lab, {"a": "", "b": ""}, vcpus=3)
    ordered = plan.order(plan.units(cfg), "random", seed=5)
    split = lanes.split(ordered)
    assert list(split) == list(dict.fromkeys(u.host for u in ordered))
    for lane, units in split.items():
        assert units == [u for u in ordered if u.host == lane]


def test_overlaps_are_the_pairs_up_at_the_same_time():
    spans = [("c1", "a", 0.0, 10.0), ("c2", "b", 5.0, 12.0), ("c3", "a", 10.0, 20.0), ("c4", "b", 12.5, 13.0)]
    pairs, complete = lanes.overlaps(spans)
    assert pairs == [["c1", "c2"], ["c2", "c3"], ["c3", "c4"]] and complete  # c1 ends as c3 starts
    kept, complete = lanes.overlaps(spans, limit=2)
    assert len(kept) == 2 and not complete
    # an interleaved run boots a cell several times: a pair is listed once
    again = spans + [("c1", "a", 30.0, 40.0), ("c2", "b", 35.0, 36.0)]
    assert lanes.overlaps(again) == (pairs, True)


def test_eta_is_the_longest_lanes():
    now = [0.0]
    eta = Eta(clock=lambda: now[0])
    eta.begin(total=6, estimate_s=100, lanes={"a": 2, "b": 4})
    now[0] = 10
    eta.cell_ended("a")
    eta.cell_ended("b")
    # both lanes at 10 s a cell: a has 1 left, b 3: the run ends with b
    assert eta.seconds() == pytest.approx(30)
    now[0] = 20
    eta.cell_ended("a")
    assert eta.seconds() == pytest.approx(20)  # b: 3 left at 10 s, 10 s into its second


def test_plain_progress_names_the_lane_of_each_line(fake_lab, capsys):
    cfg = write_lab(fake_lab, {"a": "", "b": ""})
    units = plan.units(cfg)
    rep = PlainReporter()
    rep.run_started("r1", units, 60)
    rep.stage(units[0], "boot")
    rep.stage(units[-1], "boot")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("run r1: 4 cells, estimated 1m00s, 2 lanes at once")
    assert lines[1].endswith("a:   c01 boot") and lines[2].endswith("b:   c04 boot")
    # a host with several lanes (slots, nodes): each line names its lane, and so does the ETA
    rep = PlainReporter()
    rep.run_started("r2", units, 60, {"c01": "a@n1", "c02": "a@n2", "c03": "b", "c04": "b"})
    rep.stage(units[1], "boot")
    rep.cell_finished(units[1], "done", None)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("run r2: 4 cells, estimated 1m00s, 3 lanes at once")
    assert lines[1].endswith("a@n2:   c02 boot") and lines[2].endswith("a@n2:   c02 done")
    assert rep.eta.lane_done == {"a@n1": 0, "a@n2": 1, "b": 0}


def test_the_store_takes_writes_from_many_threads(tmp_path):
    store = Store(tmp_path)
    store.create_run("r1", "t", config_path="x", config_text="", seed=1, lab_version="0", manifest={})
    for i in range(8):
        store.add_cell("r1", f"c{i}", i, f"cell {i}", {})

    def write(i: int) -> None:
        for rep in range(50):
            store.cell_update("r1", f"c{i}", stage=f"workloads {rep}")
            store.add_samples(
                "r1", f"c{i}", None, "w", rep, [Sample("m", float(rep), "u", True, {}), Sample("n", 1.0, "u", True, {})]
            )

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples = store.samples("r1")
    assert len(samples) == 8 * 50 * 2
    assert {(s.cell_id, s.repetition) for s in samples} == {(f"c{i}", r) for i in range(8) for r in range(50)}


# -- runs ----------------------------------------------------------------------------------------


def test_one_host_runs_inline_and_records_one_lane(fake_lab):
    cfg = write_lab(fake_lab, {"a": ""}, vcpus=2)
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store)
    man = store.run(rid).manifest
    assert man["lanes"] == {"a": ["c01", "c02"]} and man["overlaps"] == []
    assert sorted(man["spans"]) == ["c01", "c02"]
    assert not [t for t in threading.enumerate() if t.name.startswith("lane-")]


def test_two_hosts_run_at_once_and_the_manifest_says_what_overlapped(fake_lab):
    store, rid, wall = timed_run(write_lab(fake_lab, {"a": "", "b": ""}, vcpus=2, sleep_s=0.3))
    assert by_status(store, rid) == {"done": ["c01", "c02", "c03", "c04"]}
    man = store.run(rid).manifest
    assert man["lanes"] == {"a": ["c01", "c02"], "b": ["c03", "c04"]}
    hosts = host_of(store, rid)
    assert man["overlaps"] and all(hosts[x] != hosts[y] for x, y in man["overlaps"])  # never two on one host
    assert wall < 4 * 0.3 * 0.9  # serial would take 1.2 s of sleeping alone
    assert fake.LIVE == {} and store.open_leases() == [] and store.run(rid).status == "done"


def test_interleaved_rounds_run_per_lane_in_the_runs_seeded_order(fake_lab):
    cfg = write_lab(fake_lab, {"a": "", "b": ""}, vcpus=3, suite='order = "interleaved"\nseed = 11', repetitions=2)
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store)
    man = store.run(rid).manifest
    units = plan.order(plan.units(cfg), "interleaved", 11)
    for round_no, cells in enumerate(man["rounds"], start=1):
        for lane_units in lanes.split(units).values():
            want = [u.id for u in plan.round_order(lane_units, 11, round_no)]
            assert [c for c in cells if c in {u.id for u in lane_units}] == want
    assert len(man["rounds"]) == 2 and by_status(store, rid) == {"done": [f"c0{i}" for i in range(1, 7)]}


@pytest.mark.parametrize("lost", ["open_run", "c05"])
def test_a_lost_host_ends_its_lane_and_the_others_go_on(fake_lab, lost):
    cfg = write_lab(fake_lab, {"a": "", "b": f'lost = "{lost}"', "c": ""}, vcpus=3)
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store)
    cells = {c.cell_id: c for c in store.cells(rid)}
    hosts = host_of(store, rid)
    assert all(c.status == "done" for c in cells.values() if hosts[c.cell_id] != "b")
    b = [cells[cid] for cid in ("c04", "c05", "c06")]
    if lost == "open_run":
        assert all(c.status == "failed" and c.error.startswith("host b lost: ") for c in b)
    else:
        assert b[0].status == "done" and b[1].status == "failed" and "no answer" in b[1].error
        assert b[2].status == "failed" and b[2].error.startswith("host b lost: c05 failed at clone")
        assert f"lab-{rid}-c06" not in [name for ev, name in fake.JOURNAL if ev == "clone"]  # not tried
    assert store.run(rid).status == "done" and fake.LIVE == {}


def test_an_interrupt_in_the_main_thread_tears_every_lane_down(fake_lab):
    """SIGINT/SIGTERM raise Interrupted in the main thread only (lab.cli.group): the lanes stop at
    their next step, tear down, and the run is interrupted with nothing left on any host."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread")
    cfg = write_lab(fake_lab, {h: "" for h in "abcd"}, vcpus=5, sleep_s=0.2)
    store = Store(cfg.results_dir)

    def handler(signum, frame):
        raise Interrupted("SIGUSR1")

    old = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(Interrupted):
            runner.run_lab(cfg, store, run_id="r1")
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)
    assert fake.LIVE == {} and store.open_leases() == []
    assert not [t for t in threading.enumerate() if t.name.startswith("lane-")]
    status = by_status(store, "r1")
    # stopped at their next step, not run to the end: cells not started stay pending (resume)
    assert "running" not in status and status.get("pending") and len(status.get("done", [])) < 4 * 5
    assert all(c.error.endswith("interrupted") for c in store.cells("r1") if c.status == "failed")
    assert store.run("r1").status == "interrupted"


def test_many_hosts_take_the_time_of_one_lane_and_a_lost_one_stops_nothing(fake_lab):
    """20 hosts × 50 cells of 0.1 s (serially 100 s): wall ≈ Σ cell time / lanes within 10 % plus a
    constant for the orchestration itself (about 2 ms of CPU a cell on this machine). One host is
    lost at its 10th cell: its lane ends, the other 19 are done. The 50 × 1,000 figure is
    `python -m lab.runner.scalebench` (make bench)."""
    hosts = {f"h{i:02d}": "" for i in range(20)}
    cfg = write_lab(fake_lab, hosts, vcpus=5, memory=10, sleep_s=0.1)
    ordered = plan.units(cfg)
    lost_cell = [u.id for u in ordered if u.host == "h07"][9]
    hosts["h07"] = f'lost = "{lost_cell}"'
    cfg = write_lab(fake_lab, hosts, vcpus=5, memory=10, sleep_s=0.1)
    store = Store(cfg.results_dir)
    started = time.monotonic()
    rid = runner.run_lab(cfg, store)
    wall = time.monotonic() - started
    per_lane = 50 * 0.1
    assert per_lane <= wall <= 1.1 * per_lane + 8.0, wall
    cells = store.cells(rid)
    lost = [c for c in cells if c.axes["host"] == "h07"]
    assert all(c.status == "done" for c in cells if c.axes["host"] != "h07")
    assert sum(c.status == "done" for c in lost) == 9 and sum(c.status == "failed" for c in lost) == 41
    assert fake.LIVE == {} and store.open_leases() == []


class ConcurrencyProbe(fake_workload.FakeWorkload):
    """fake-work that counts how many of its runs are under way at once."""

    def __init__(self, name: str, network: bool):
        super().__init__()
        self.name = name
        self.traits = dataclasses.replace(self.traits, network=network)
        self.lock = threading.Lock()
        self.now = self.most = 0

    def run(self, ctx, repetition):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.05)
            return super().run(ctx, repetition)
        finally:
            with self.lock:
                self.now -= 1


@pytest.mark.parametrize("network, client", [(True, "local"), (False, "local"), (True, "vm")])
def test_network_measurements_of_different_lanes_take_turns_on_the_client(fake_lab, network, client):
    probe = ConcurrencyProbe("fake-probe", network)
    store, rid = run_with(
        fake_lab,
        [probe],
        {h: f'client = "{client}"' for h in "abc"},
        vcpus=3,
        suite='workloads = ["fake-probe"]\n[suite.params.fake-probe]\nvalues = [1.0]',
    )
    assert by_status(store, rid) == {"done": [f"c0{i}" for i in range(1, 10)]}
    samples = store.samples(rid)
    if network and client == "local":
        assert probe.most == 1  # never two through the one local client
        assert samples and all(s.labels["client"] == "local" for s in samples)
    else:
        assert probe.most > 1  # the lanes do run at once: each host its own client VM, or no client
        assert all(s.labels.get("client") == ("vm" if network else None) for s in samples)
    assert sorted(store.run(rid).manifest.get("client_vms", {})) == (["a", "b", "c"] if client == "vm" else [])
    assert fake.LIVE == {} and store.open_leases() == []


def test_the_estimate_is_the_longest_lane(fake_lab):
    from lab import estimate

    cfg = write_lab(fake_lab, {"a": "", "b": ""}, vcpus=3)
    units = plan.units(cfg)
    params = {w: runner.workload_params(cfg, w) for w in cfg.suite.workloads}
    est = estimate.estimate(cfg, units[:4], params)  # a: 3 cells, b: 1
    alone = {h: estimate.estimate(cfg, [u for u in units[:4] if u.host == h], params).seconds for h in "ab"}
    assert est.lanes == pytest.approx(alone) and alone["a"] > alone["b"]
    assert est.seconds == pytest.approx(alone["a"])
    assert est.as_dict()["lanes"] == {h: round(s, 1) for h, s in alone.items()}


def test_plan_shows_one_line_per_lane_and_the_turns_on_the_client(fake_lab):
    from support.cli import lab_cli

    from lab import workloads

    workloads.register(ConcurrencyProbe("fake-probe", True))
    try:
        write_lab(
            fake_lab, {"a": "local_host = true", "b": ""}, vcpus=3, suite='workloads = ["fake-work", "fake-probe"]'
        )
        res = lab_cli("plan", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    finally:
        workloads.unregister("fake-probe")
    assert res.returncode == 0, res.stderr
    text = res.stdout + res.stderr
    assert "lanes: 2 hosts at once, each one cell at a time; the estimate is the longest lane's" in text
    assert [line.strip().split(",")[0] for line in text.splitlines() if line.strip().startswith("lane ")] == [
        "lane a: 3 cells",
        "lane b: 3 cells",
    ]
    assert "network measurements (fake-probe) of lanes a, b take turns on the local client" in text
    assert "one at a time on each host" in text
    assert "host a is this machine: its measurements take turns with the other lanes' network" in text
    assert "host b is this machine" not in text


def test_the_live_progress_takes_calls_from_every_lane(fake_lab):
    from lab.cli.progress import RichReporter

    cfg = write_lab(fake_lab, {h: "" for h in "abc"}, vcpus=4, sleep_s=0.02)
    rep = RichReporter()
    try:
        rid = runner.run_lab(cfg, Store(cfg.results_dir), rep)
    finally:
        rep.close()
    assert sorted(rep.lane_tasks) == ["a", "b", "c"]
    tasks = {t.id: t for t in rep.progress.tasks}
    assert tasks[rep.task].completed == 12 and all(tasks[t].completed == 4 for t in rep.lane_tasks.values())
    assert rep.eta.lane_done == {"a": 4, "b": 4, "c": 4} and rid


def test_a_slow_host_does_not_hold_up_the_others(fake_lab):
    cfg = write_lab(fake_lab, {"fast": "", "slow": "boot_s = 0.5"}, vcpus=4)
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store)
    cells = store.cells(rid)
    spans = store.run(rid).manifest["spans"]
    fast_end = max(spans[c.cell_id][0][1] for c in cells if c.axes["host"] == "fast")
    slow_first_end = min(spans[c.cell_id][0][1] for c in cells if c.axes["host"] == "slow")
    assert all(c.status == "done" for c in cells)
    assert fast_end < slow_first_end  # the fast lane's 4 cells were all done before the slow one's first


def test_an_interrupt_inside_one_lane_stops_every_lane(fake_lab):
    cfg = write_lab(fake_lab, {"a": 'interrupt = { c02 = "workloads" }', "b": ""}, vcpus=4, sleep_s=0.3)
    store = Store(cfg.results_dir)
    with pytest.raises(Interrupted):
        runner.run_lab(cfg, store, run_id="r1")
    cells = {c.cell_id: c for c in store.cells("r1")}
    assert (cells["c02"].status, cells["c02"].error) == ("failed", "workloads: interrupted")
    assert cells["c08"].status == "pending"  # lane b stopped before its last cell
    assert fake.LIVE == {} and store.open_leases() == [] and store.run("r1").status == "interrupted"


class IntervalProbe(fake_workload.FakeWorkload):
    """fake-work that logs when each of its runs was under way, and on which guest."""

    log: list[tuple[int, str, float, float]] = []

    def __init__(self, name: str, network: bool):
        super().__init__()
        self.name = name
        self.traits = dataclasses.replace(self.traits, network=network)

    def run(self, ctx, repetition):
        started = time.monotonic()
        time.sleep(0.03)
        raw = super().run(ctx, repetition)
        IntervalProbe.log.append((id(ctx.guest), self.name, started, time.monotonic()))
        return raw


def test_a_cell_on_this_machine_never_measures_beside_another_lanes_load_generator(fake_lab):
    IntervalProbe.log = []
    store, rid = run_with(
        fake_lab,
        [IntervalProbe("probe-cpu", False), IntervalProbe("probe-net", True)],
        {"here": "local_host = true", "far": ""},
        vcpus=3,
        repetitions=2,
        suite='workloads = ["probe-cpu", "probe-net"]',
    )
    hosts = host_of(store, rid)
    host_of_guest = {id(g): hosts[name.rsplit("-", 1)[1]] for name, g in fake.GUESTS.items()}
    runs = [(host_of_guest[g], name, a, b) for g, name, a, b in IntervalProbe.log]
    here = [r for r in runs if r[0] == "here"]
    far_net = [r for r in runs if r[0] == "far" and r[1] == "probe-net"]
    assert len(here) == 12 and len(far_net) == 6
    assert not [(x, y) for x in here for y in far_net if x[2] < y[3] and y[2] < x[3]]


def test_the_estimate_counts_the_turns_network_measurements_take(fake_lab):
    from lab import estimate, workloads

    workloads.register(ConcurrencyProbe("fake-probe", True))
    try:
        cfg = write_lab(fake_lab, {h: "" for h in "abcd"}, vcpus=1, repetitions=20, suite='workloads = ["fake-probe"]')
        units = plan.units(cfg)
        params = {w: runner.workload_params(cfg, w) for w in cfg.suite.workloads}
        est = estimate.estimate(cfg, units, params)
        one = estimate.estimate(cfg, units[:1], params)
    finally:
        workloads.unregister("fake-probe")
    # each lane: one boot and 20 network repetitions; four lanes take turns on the one client
    assert est.client_s == pytest.approx(4 * one.client_s) and est.client_s > max(est.lanes.values())
    assert est.seconds == pytest.approx(est.client_s)
    assert one.seconds == pytest.approx(one.lanes["a"])  # one host: its lane, as before


def test_show_says_the_lanes_and_how_many_cells_overlapped(fake_lab):
    from support.cli import lab_cli

    cfg = write_lab(fake_lab, {"a": "", "b": ""}, vcpus=2, sleep_s=0.2)
    runner.run_lab(cfg, Store(cfg.results_dir))
    res = lab_cli("show", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    assert res.returncode == 0, res.stderr
    line = next(x for x in (res.stdout + res.stderr).splitlines() if x.startswith("lanes: "))
    assert line.startswith("lanes: 2 at once: a: c01 c02 | b: c03 c04; ")
    assert line.endswith("pairs of cells up at the same time") and "; 0 pairs" not in line
