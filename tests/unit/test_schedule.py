"""The repetition policy (lab.schedule) and the run's units and rounds (lab.plan), on seeded data."""

from __future__ import annotations

import collections
import functools

import numpy as np
import pytest

from lab import clientload, config, errors, flags, hostload, plan, schedule, verdicts
from lab.model import Sample
from lab.workloads import PrimaryMetrics


def suite(**kw) -> config.SuiteSection:
    return config.parse({"suite": kw}).suite


def feed(tally: schedule.Tally, s: config.SuiteSection, values, *, metric="throughput", seconds=1.0, seed=0):
    """Add repetitions one at a time as the runner does; returns after the policy stops it."""
    for v in values:
        if tally.stopped:
            break
        tally.add(
            [
                Sample(metric, float(v), "Mbit/s", True),
                Sample("cpu_busy_pct", 50.0, "%", False),
                Sample("latency_ms", float(v) * 3, "ms", False),
            ],
            seconds,
        )
        tally.update(s, seed=seed)
    return tally


def test_fixed_n_stops_at_n():
    s = suite(repetitions=5)
    t = feed(schedule.Tally(), s, range(100, 200))
    assert t.n == 5 and t.reason == "fixed n = 5"
    assert t.values == {"throughput": [100.0, 101.0, 102.0, 103.0, 104.0]}  # only throughput-like metrics steer


def test_adaptive_stops_when_the_ci_is_narrow_enough():
    s = suite(repetitions=3, target_ci_pct=2.0, max_repetitions=50)
    rng = np.random.default_rng(1)
    t = feed(schedule.Tally(), s, rng.normal(1000, 1000 * 0.01, 200))  # CV 1 %
    assert t.reason.startswith("95 % CI of the median within ±2 %"), t.reason
    assert 3 <= t.n < 50


def test_adaptive_noisier_data_needs_more_repetitions():
    s = suite(repetitions=3, target_ci_pct=2.0, max_repetitions=200)
    ns = {}
    for cv in (0.005, 0.05):
        runs = []
        for seed in range(20):
            rng = np.random.default_rng(seed)
            runs.append(feed(schedule.Tally(), s, rng.normal(1000, 1000 * cv, 400)).n)
        ns[cv] = float(np.median(runs))
    assert ns[0.005] < ns[0.05], ns


def test_adaptive_budgets():
    noisy = np.random.default_rng(2).normal(1000, 300, 500)  # CV 30 %: never within ±1 %
    by_count = feed(schedule.Tally(), suite(repetitions=3, target_ci_pct=1.0, max_repetitions=7), noisy)
    assert by_count.n == 7 and by_count.reason.startswith("budget: 7 repetitions"), by_count.reason
    assert "throughput" in by_count.reason
    by_time = feed(
        schedule.Tally(),
        suite(repetitions=3, target_ci_pct=1.0, max_repetitions=100, max_seconds=10),
        noisy,
        seconds=2.5,
    )
    assert by_time.n == 4 and by_time.reason.startswith("budget: 10 s"), by_time.reason


def test_adaptive_never_stops_before_the_minimum():
    s = suite(repetitions=6, target_ci_pct=50.0, max_repetitions=10)
    t = feed(schedule.Tally(), s, [100.0] * 20)  # constant: the CI is [100, 100] from n = 1
    assert t.n == 6
    # nor on the CI before n = 5, whatever `repetitions` says: three lucky values are not precision
    t3 = feed(schedule.Tally(), suite(repetitions=3, target_ci_pct=50.0), [100.0] * 20)
    assert t3.n == schedule.ADAPTIVE_MIN_N == 5
    # a budget below that still holds
    t4 = feed(schedule.Tally(), suite(repetitions=3, target_ci_pct=50.0, max_repetitions=4), [100.0] * 20)
    assert t4.n == 4 and t4.reason.startswith("budget: 4 repetitions")


def test_adaptive_without_a_throughput_metric_stops_at_the_minimum():
    s = suite(repetitions=3, target_ci_pct=1.0)
    t = schedule.Tally()
    for _ in range(10):
        t.add([Sample("latency_ms", 5.0, "ms", False)], 1.0)
        t.update(s)
        if t.stopped:
            break
    assert t.n == 5 and "no throughput-like metric" in t.reason  # the adaptive minimum


def test_flagged_repetitions_do_not_steer():
    t = schedule.Tally()
    t.add([Sample("rps", 1.0, "req/s", True, {"flagged": 1})], 1.0)
    assert t.values == {} and t.n == 1


def test_outcome_describe_planned_skipped():
    s = suite(order="interleaved", repetitions=4, repetitions_per_boot=2, target_ci_pct=3, max_repetitions=9)
    assert schedule.describe(s, 7) == {
        "order": "interleaved",
        "seed": 7,
        "repetitions": 4,
        "warmup": 1,
        "repetitions_per_boot": 2,
        "target_ci_pct": 3.0,
        "max_repetitions": 9,
        "max_seconds": None,
        "decide": {"margin_pct": 7.5, "alpha": 0.05},
        "foreign_load_pct": 10.0,
        "client_saturated_pct": 90.0,
        "quiet": {"seconds": 2.0, "timeout_s": 30.0},
    }
    assert schedule.planned(s) == "4-9" and schedule.planned(suite(repetitions=5)) == "5"
    t = schedule.Tally()
    t.stop("skipped: nginx is not installed")
    tallies = {("bm01", "http"): t, ("bm01", "iperf3-tcp"): feed(schedule.Tally(), suite(repetitions=2), [1, 2])}
    assert schedule.skipped(tallies, "bm01") == {"http": "nginx is not installed"}
    assert schedule.skipped(tallies, "c01") == {}
    assert schedule.outcome(tallies)["bm01"]["iperf3-tcp"] == {
        "n": 2,
        "load_flagged": 0,
        "seconds": 2.0,
        "stopped": "fixed n = 2",
    }
    assert schedule.describe(suite(repetitions=3, remeasure_flagged=2), 1)["remeasure_flagged"] == 2


def busy_host(flag: bool) -> dict:
    """labels[HOST_LOAD] as lab.hostload.label makes it, of a window with (or without) foreign load."""
    window = hostload.HostLoad(seconds=5.0, foreign_pct=40.0 if flag else 2.0, lab_pct=100.0, steal_pct=0.0)
    return {hostload.HOST_LOAD: hostload.label(window, 10.0)}


def feed_flags(s: config.SuiteSection, flagged: list[bool]) -> schedule.Tally:
    """Repetitions whose host was busy (True) or quiet, until the policy stops."""
    t = schedule.Tally()
    for busy in flagged:
        if t.stopped:
            break
        t.add([Sample("throughput", 100.0, "Mbit/s", True, busy_host(busy))], 1.0)
        t.update(s)
    return t


def test_fixed_n_measures_a_repetition_flagged_for_load_again_within_its_budget():
    s = suite(repetitions=3, remeasure_flagged=2)
    # one busy repetition: measured again once, 3 that count
    t = feed_flags(s, [False, True, False, False, False])
    assert (t.n, t.load_flagged) == (4, 1) and t.reason == "fixed n = 3: 1 flagged for load, measured again"
    assert t.values == {"throughput": [100.0, 100.0, 100.0]}  # the flagged one does not steer
    # a host busy throughout: the budget of 2 is spent, and the reason says how many count
    t = feed_flags(s, [True] * 10)
    assert (t.n, t.load_flagged) == (5, 5)
    assert t.reason == "fixed n = 3: 5 flagged for load, 2 measured again (remeasure_flagged = 2), 0 unflagged"
    assert schedule.progress(s, feed_flags(s, [False, True])) == "3/3"
    assert schedule.progress(s, feed_flags(s, [False, True, False])) == "4/3 (again: 1 flagged for load)"
    # the default: flagged repetitions are shown and left out, never measured again
    t = feed_flags(suite(repetitions=3), [True, False, False, False])
    assert (t.n, t.reason) == (3, "fixed n = 3: 1 flagged for load, 2 unflagged")
    # a parser's flag is about the measurement, not the machine: not measured again
    t = schedule.Tally()
    for _ in range(5):
        if not t.stopped:
            t.add([Sample("rps", 1.0, "req/s", True, {"flagged": 1})], 1.0)
            t.update(s)
    assert (t.n, t.load_flagged, t.reason) == (3, 0, "fixed n = 3")


def test_a_client_saturated_is_flagged_for_load_too():
    window = hostload.HostLoad(seconds=5.0, foreign_pct=97.0, lab_pct=0.0, cpus=1)
    client = {clientload.CLIENT_LOAD: clientload.label("vm", window, 90.0, judged=True)}
    assert flags.load_flagged(client) and flags.load_flagged(busy_host(True))
    assert not flags.load_flagged(busy_host(False)) and not flags.load_flagged({"flagged": 1})


def test_remeasure_flagged_is_refused_with_adaptive_repetition():
    with pytest.raises(errors.ConfigError, match=r"^lab.toml: suite.remeasure_flagged = 2: applies to a fixed n only"):
        config.parse({"suite": {"target_ci_pct": 5, "remeasure_flagged": 2}})
    assert config.parse({"suite": {"remeasure_flagged": 2}}).suite.remeasure_flagged == 2


# --- units and rounds --------------------------------------------------------------------------------


def test_units_twin_and_bare_metal():
    cfg = config.parse({"matrix": {"nic": ["virtio", "e1000"]}, "suite": {"noise_floor": True, "bare_metal": True}})
    units = plan.units(cfg)
    assert [u.id for u in units] == ["c01", "c02", "c01-aa", "bm01"]
    twin, bm = units[2], units[3]
    assert twin.label == units[0].label + "#aa" and twin.axes() == {**units[0].axes(), "replica": 2}
    assert (bm.label, bm.axes(), bm.kind) == ("local/bare-metal", {"host": "local", "kind": "bare-metal"}, "bare-metal")
    idx = [plan.store_index(u, 2) for u in units]
    assert idx == sorted(idx) and len(set(idx)) == 4
    assert [u.id for u in plan.units(config.parse({}))] == ["c01"]


def test_a_bare_metal_only_lab_is_allowed():
    cfg = config.parse({"matrix": {"exclude": [{"nic": "virtio"}]}, "suite": {"bare_metal": True}})
    assert [u.id for u in plan.units(cfg)] == ["bm01"]


def test_rounds_split_the_repetitions():
    assert plan.rounds(4, 2) == [2, 2]
    assert plan.rounds(5, 2) == [2, 2, 1]
    assert plan.rounds(3, 5) == [3]
    assert plan.rounds(3, 1) == [1, 1, 1]


def test_round_order_is_seeded_per_round_and_balanced():
    cfg = config.parse({"matrix": {"nic": ["virtio", "e1000", "e1000e", "rtl8139"]}})
    units = plan.cells(cfg)
    r1 = [u.id for u in plan.round_order(units, 11, 1)]
    assert r1 == [u.id for u in plan.round_order(list(reversed(units)), 11, 1)]  # input order does not matter
    assert sorted(r1) == [u.id for u in units]
    orders = [tuple(u.id for u in plan.round_order(units, 11, r)) for r in range(1, 41)]
    assert len(set(orders)) > 10  # a fresh shuffle each round
    # over many rounds every cell takes every position about equally often (no cell always last)
    last = collections.Counter(o[-1] for o in orders)
    assert set(last) == {u.id for u in units} and max(last.values()) <= 20
    # a cell dropping out does not reshuffle the others' relative order
    without = [u.id for u in plan.round_order(units[1:], 11, 1)]
    assert without == [x for x in r1 if x != "c01"]


@pytest.mark.parametrize("order, boots", [("sequential", 1), ("interleaved", 3)])
def test_estimate_counts_boots_and_warmups(order, boots, monkeypatch):
    monkeypatch.delenv("LAB_QUIET_HOST", raising=False)  # the product's default: the local host waits
    from lab import estimate, runner

    extra = {"repetitions_per_boot": 1} if order == "interleaved" else {}
    cfg = config.parse(
        {
            "suite": {
                "workloads": ["sysbench-cpu"],
                "repetitions": 3,
                "warmup": 1,
                "order": order,
                "bare_metal": True,
                "params": {"sysbench-cpu": {"time": 1}},
                **extra,
            }
        }
    )
    units = plan.units(cfg)
    rep = estimate.default_repetition("sysbench-cpu", runner.workload_params(cfg, "sysbench-cpu"))
    # each boot: the fixed stages, the prepare and the warm-up; the 3 repetitions over all boots,
    # each after the least wait for a quiet host (the local host is this machine: quiet_host "wait");
    # and once per host, the run's own set-up
    measured = 3 * (rep + cfg.suite.quiet_seconds)
    assert runner.estimate_seconds(cfg, units[:1]) == pytest.approx(
        boots * (runner.BOOT_ESTIMATE_S + estimate.PREPARE_DEFAULT_S + rep) + measured + estimate.RUN_OVERHEAD_DEFAULT_S
    )
    assert runner.estimate_seconds(cfg, units[1:]) == pytest.approx(  # the bare-metal cell: no VM to boot
        boots * (sum(estimate.BARE_METAL_DEFAULTS_S.values()) + estimate.PREPARE_DEFAULT_S + rep)
        + measured
        + estimate.RUN_OVERHEAD_DEFAULT_S
    )


# -- unknown gets more data: adaptive repetition until the comparisons the run will be asked are decided


HEADLINE = PrimaryMetrics(("throughput",))


def primary_feed(tallies, cell, s, values, asked, *, workload="w", seed=0):
    """As the runner does: one repetition at a time into the cell's tally, the policy asked after each."""
    t = tallies.setdefault((cell, workload), schedule.Tally())
    for v in values:
        if t.stopped:
            break
        t.add([Sample("throughput", float(v), "Mbit/s", True), Sample("cpu_busy_pct", 50.0, "%", False)], 1.0, HEADLINE)
        t.update(s, seed=seed, unknown=functools.partial(asked.unknown, tallies, cell, workload, seed=seed))
    return t


def test_the_tally_keeps_the_primary_metrics_unflagged():
    t = schedule.Tally()
    t.add([Sample("throughput", 1.0, "Mbit/s", True), Sample("latency", 2.0, "ms", False)], 1.0, HEADLINE)
    t.add([Sample("throughput", 9.0, "Mbit/s", True, {"flagged": 1})], 1.0, HEADLINE)
    t.add([Sample("throughput", 3.0, "Mbit/s", True)], 1.0)  # no declaration: nothing kept
    assert t.primary == {"throughput": [1.0]} and t.higher == {"throughput": True}


def test_a_primary_row_unknown_at_n_keeps_its_cell_measuring_until_decided():
    s = suite(repetitions=5, target_ci_pct=50.0, max_repetitions=40)  # the CI rule alone stops at 5
    asked = schedule.Asked(pairs=(("c01", "c02"),), rows=1)
    rng = np.random.default_rng(3)
    tallies: dict = {}
    # c01 first (sequential): nobody to compare with yet, so the CI rule alone stops it
    first = primary_feed(tallies, "c01", s, rng.normal(100, 3, 40), asked)
    assert first.n == 5 and first.reason == "95 % CI of the median within ±50 % at n = 5", first.reason
    # c02: the same setup; at n = 5 "same" within ±7.5 % is not shown yet for this seed, so it goes on
    assert asked.unknown(tallies, "c02", "w") is None  # not measured yet
    second = primary_feed(tallies, "c02", s, [100.0 * v for v in (1.06, 0.96, 1.05, 0.94, 1.04)], asked)
    assert second.n == 5 and not second.stopped and asked.unknown(tallies, "c02", "w") == ["throughput vs c01"]
    primary_feed(tallies, "c02", s, rng.normal(100, 3, 40), asked)
    assert 5 < second.n < 40 and second.reason.endswith("every primary row decided against its partners")
    assert asked.unknown(tallies, "c02", "w") == [] and asked.unknown(tallies, "c01", "w") == []


def test_an_undecidable_row_stops_at_the_budget_and_says_which():
    s = suite(repetitions=5, target_ci_pct=50.0, max_repetitions=8)
    asked = schedule.Asked(pairs=(("c01", "c02"),), rows=5)
    tallies: dict = {}
    rng = np.random.default_rng(4)
    primary_feed(tallies, "c01", s, rng.normal(100, 10, 5), asked)
    # 8 % lower at CV 10 %: neither a verdict nor "same" within 8 repetitions
    t = primary_feed(tallies, "c02", s, rng.normal(92, 9.2, 20), asked)
    assert t.n == 8 and t.reason == "budget: 8 repetitions (unknown: throughput vs c01)", t.reason


def test_the_twins_band_is_the_margin_in_the_run():
    asked = schedule.Asked(pairs=(("c01", "c02"),), twins=(("c01", "c01-aa"),), rows=1)
    s = suite(repetitions=5, target_ci_pct=50.0, max_repetitions=5)
    tallies: dict = {}
    primary_feed(tallies, "c01", s, [100, 101, 99, 100, 102], asked)
    primary_feed(tallies, "c01-aa", s, [112, 111, 113, 110, 112], asked)  # the twin came out 11 % higher
    primary_feed(tallies, "c02", s, [110, 111, 109, 110, 112], asked)  # 10 % higher: inside what twins differ by
    lo, hi = asked.bands(tallies, "w")["throughput"]
    assert lo < 1 / 1.1 and hi > 1.1
    assert asked.unknown(tallies, "c02", "w") == []  # decided: the same, against the band
    j = verdicts.judge([100, 101, 99, 100, 102], [110, 111, 109, 110, 112], higher_is_better=True)
    assert j.answer == verdicts.Answer.BETTER  # and better against the stated ±7.5 %


def test_optional_stopping_on_unknown_keeps_a_pairs_false_verdicts_rare():
    """A/A pairs, CV 3 %: the partner measured first (n = 5), the later cell adaptive up to 15
    repetitions while its row is unknown, as in a sequential run. Each look is a chance for a false
    better/worse; the margin and the correction keep the rate at the end well under 5 %."""
    s = suite(repetitions=5, target_ci_pct=50.0, max_repetitions=15)
    asked = schedule.Asked(pairs=(("c01", "c02"),), rows=5, n_resamples=999)
    said, ns = collections.Counter(), []
    for trial in range(60):
        rng = np.random.default_rng(500 + trial)
        tallies: dict = {}
        primary_feed(tallies, "c01", s, rng.normal(100, 3, 5), asked, seed=trial)
        t = primary_feed(tallies, "c02", s, rng.normal(100, 3, 15), asked, seed=trial)
        ns.append(t.n)
        a, b = tallies[("c01", "w")].primary["throughput"], t.primary["throughput"]
        said[verdicts.judge(a, b, higher_is_better=True, tested=5, seed=trial).answer] += 1
    assert said[verdicts.Answer.BETTER] + said[verdicts.Answer.WORSE] <= 0.05 * 60, said
    assert max(ns) > 5 and said[verdicts.Answer.SAME] >= 0.8 * 60, (said, ns)
