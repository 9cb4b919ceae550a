"""lab.verdicts, the decision every comparison makes, and the figures issue 34 asked for, on seeded
simulations of the default lab (lab.toml: 3 workloads, 5 repetitions, an A/A twin):

- under A/A, the chance that a comparison prints any better/worse among its primary rows <= 5 %;
- a 10 % shift at CV 3 %, n = 5, is still called in >= 80 % of trials (one changed row of five);
- a true null at CV 3 % is called "same" at the default margin in >= 80 %.

The trials go through lab.compare.compare, the function `lab compare` calls, with its 9,999
bootstrap resamples (a trial's CPU time is scipy's overhead per call, not the resamples). 100
trials here; `python tests/support/verdictrates.py` runs 1,000 (the figures the README quotes: the first
100 happen to be a little kinder than the thousand, see there)."""

from __future__ import annotations

import collections
import json
import math

import numpy as np
import pytest
from support.cli import lab_cli
from support.verdictsim import DEFAULT_LAB_ROWS, PRIMARY, TRIALS_SHIFTED, N, R, sides, simulate

from lab import analysis, results, stats, verdicts
from lab.compare import Verdict, compare
from lab.model import RawOutput, Sample
from lab.store import Store
from lab.verdicts import Answer, Margin
from lab.workloads import load_all

pytestmark = pytest.mark.filterwarnings("error")

TRIALS = 100


def test_the_default_labs_primary_rows():
    assert [m for _, m, *_ in PRIMARY] == [
        "throughput_mbit_s_tx",
        "throughput_mbit_s_rx",
        "requests_per_s_c50",
        "events_per_s_1t",
        "events_per_s_nt",
    ]
    # every workload declares its headline metrics, and its count per parameter list
    for wl in load_all().values():
        assert wl.primary_metrics.patterns, wl.name
    assert load_all()["sysbench-cpu"].primary_metrics.count({"threads": [1, "vcpus"]}) == 2
    assert load_all()["container-start"].primary_metrics.count(load_all()["container-start"].defaults) == 12
    assert load_all()["sysbench-memory"].primary_metrics.count({}) == 1


@pytest.fixture(scope="module")
def trials():
    return simulate(TRIALS, stats.DEFAULT_N_RESAMPLES)


SIMULATIONS = pytest.mark.xdist_group("verdict-simulations")  # one worker computes `trials` once


@SIMULATIONS
@pytest.mark.parametrize("twin", [False, True], ids=["default-margin", "aa-band"])
def test_aa_prints_a_false_better_or_worse_in_at_most_5_percent_of_comparisons(trials, twin):
    runs = trials[f"aa/{twin}"]
    false = sum(any(v in (Verdict.BETTER, Verdict.WORSE) for v in said.values()) for said in runs)
    assert false / len(runs) <= 0.05, f"{false} of {len(runs)} A/A comparisons printed better/worse"


@SIMULATIONS
@pytest.mark.parametrize("twin", [False, True], ids=["default-margin", "aa-band"])
def test_a_ten_percent_shift_at_cv_3_percent_n_5_is_called_in_80_percent(trials, twin):
    runs = trials[f"shift/{twin}"]
    said = collections.Counter(run[TRIALS_SHIFTED] for run in runs)
    called = said[Verdict.WORSE]
    assert Verdict.BETTER not in said  # never the wrong direction
    # "same" only where the twin happened to differ from its cell by more than 10 % itself
    assert said[Verdict.SAME] <= (0.05 * len(runs) if twin else 0), said
    assert called / len(runs) >= 0.80, said


@SIMULATIONS
def test_a_true_null_at_cv_3_percent_is_same_at_the_default_margin_in_80_percent(trials):
    # the other rows of the shifted comparisons: unchanged, CV 3 %, the stated margin (no twin)
    said = collections.Counter(v for run in trials["shift/False"] for k, v in run.items() if k != TRIALS_SHIFTED)
    assert set(said) <= {Verdict.SAME, Verdict.UNKNOWN}, said
    assert said[Verdict.SAME] / sum(said.values()) >= 0.80, said


def test_secondary_rows_never_print_a_verdict():
    rng = np.random.default_rng(1)
    a, b = sides(rng, DEFAULT_LAB_ROWS, shift={i: 0.5 for i in range(len(DEFAULT_LAB_ROWS))})  # everything halves
    rows = compare(a, b, n_resamples=R)
    assert len(rows) == 21
    for r in rows:
        if r.primary:
            assert r.verdict in (Verdict.BETTER, Verdict.WORSE) and r.q_value is not None, r.key
        else:
            assert r.verdict == Verdict.EXPLORATORY and r.q_value is None and r.margin is None, r.key


# -- the decision itself ---------------------------------------------------------------------------


def ev(ratio, ci, tost=None, p=0.001, n=5) -> verdicts.Evidence:
    return verdicts.Evidence(n, n, ratio, ci, tost or ci, p, verdicts.enough(n, n))


def test_decide_needs_q_the_ci_and_the_effect_beyond_the_margin():
    m = Margin.stated(7.5)
    assert verdicts.decide(ev(0.80, (0.75, 0.85)), higher_is_better=True, margin=m) == Answer.WORSE
    assert verdicts.decide(ev(0.80, (0.75, 0.85)), higher_is_better=False, margin=m) == Answer.BETTER
    assert verdicts.decide(ev(1.25, (1.2, 1.3)), higher_is_better=True, margin=m) == Answer.BETTER
    # q too large (corrected), CI touching 1, effect inside the margin: none is a verdict
    assert verdicts.decide(ev(0.80, (0.75, 0.85)), higher_is_better=True, margin=m, q=0.06) == Answer.UNKNOWN
    assert verdicts.decide(ev(0.80, (0.6, 1.0)), higher_is_better=True, margin=m) == Answer.UNKNOWN
    assert verdicts.decide(ev(0.95, (0.94, 0.97)), higher_is_better=True, margin=m) == Answer.SAME
    # same: the TOST interval inside the margin, whatever p says
    assert verdicts.decide(ev(1.0, (0.9, 1.1), (0.95, 1.05), p=0.9), higher_is_better=True, margin=m) == Answer.SAME
    assert verdicts.decide(ev(1.0, (0.9, 1.1), (0.92, 1.08), p=0.9), higher_is_better=True, margin=m) == Answer.UNKNOWN
    # too few samples: nothing decided
    assert verdicts.decide(ev(1.0, (1.0, 1.0), n=3), higher_is_better=True, margin=m) == Answer.UNKNOWN
    assert Answer.SAME.decided and not Answer.UNKNOWN.decided and Answer.WORSE.differs and not Answer.SAME.differs


def test_margins():
    m = Margin.stated(7.5)
    assert (m.low, m.high, m.text()) == (pytest.approx(1 / 1.075), 1.075, "±7.5 %")
    assert m.holds(1.0) and not m.holds(1.08) and m.covers(0.95, 1.05) and not m.covers(0.9, 1.0)
    assert verdicts.margin_for(None) == m
    assert verdicts.margin_for((0.98, 1.02)) == m  # a band narrower than the minimum: the minimum
    wide = verdicts.margin_for((0.8, 1.25))
    assert (wide.low, wide.high, wide.source, wide.text()) == (0.8, 1.25, "A/A band", "A/A 0.8–1.25")
    one_side = verdicts.margin_for((0.98, 1.2))  # wider on one side only: the band there, the minimum here
    assert (one_side.low, one_side.high) == (pytest.approx(1 / 1.075), 1.2)
    assert wide.as_dict() == {"low": 0.8, "high": 1.25, "source": "A/A band"}
    for bad in (0.0, -1.0, 100.0):
        with pytest.raises(ValueError):
            Margin.stated(bad)


def test_adjust_is_benjamini_hochberg_and_skips_untested():
    assert verdicts.adjust([0.01, None, 0.04, 0.03]) == [
        pytest.approx(0.03),
        None,
        pytest.approx(0.04),
        pytest.approx(0.04),
    ]
    assert verdicts.adjust([None, None]) == [None, None] and verdicts.adjust([]) == []


def test_judge_two_sample_sets_for_a_caller_with_one_row():
    """What `lab explain` will call per knob: two sets, a margin, how many knobs it asks about."""
    rng = np.random.default_rng(3)
    base, slow = rng.normal(100, 2, 6), rng.normal(80, 2, 6)
    j = verdicts.judge(base, slow, higher_is_better=True, n_resamples=R)
    assert j.answer == Answer.WORSE and j.q == j.evidence.p and j.margin == Margin.stated()
    assert j.evidence.effect == pytest.approx(j.evidence.ratio - 1) and j.evidence.ratio < 0.85
    # asked about 12 knobs at once: 6 vs 6 reaches p = 0.0022, q = 0.026 still
    assert verdicts.judge(base, slow, higher_is_better=True, tested=12, n_resamples=R).answer == Answer.WORSE
    assert verdicts.judge(base, slow, higher_is_better=True, tested=30, n_resamples=R).answer == Answer.UNKNOWN
    same = verdicts.judge(base, rng.normal(100, 2, 6), higher_is_better=True, n_resamples=R)
    assert same.answer == Answer.SAME
    with pytest.raises(ValueError):
        verdicts.judge(base, slow, higher_is_better=True, tested=0)


def test_what_a_plan_can_reach():
    assert verdicts.best_q(5, 5) == pytest.approx(5 * 2 / 252)
    assert verdicts.best_q(5, 7) > 0.05 and verdicts.n_for_q(7) == 6 and verdicts.n_for_q(5) == 5
    assert verdicts.n_for_q(1) == 4  # 4 vs 4: p = 0.029
    assert verdicts.best_q(3, 1) == pytest.approx(0.1)
    # "same" within ±7.5 % at n = 5 for CVs up to about 3 %; more repetitions, noisier metrics
    cv5 = verdicts.same_reach_cv(5)
    assert 0.029 < cv5 < 0.033 and verdicts.same_reach_cv(10) == pytest.approx(cv5 * math.sqrt(2))
    assert verdicts.same_reach_cv(5, margin_pct=15) > 2 * cv5 * 0.95


# -- the A/A twin against its cell, through the store and `lab compare` ------------------------------

VM_AXES = {"host": "local", "image": "debian12", "vcpus": 2, "memory_mib": 1024, "disk_bus": "virtio"}
VM_AXES |= {"clone": "linked", "tuning": "default"}


def default_lab_run(store: Store, run: str, seed: int) -> None:
    """The default lab's three cells, every row of DEFAULT_LAB_ROWS at its CV, n = 5: c01 virtio,
    c01-aa its twin (the same distribution), c02 e1000 with the network's headline rows lower (iperf3
    throughput 0.4x, http requests/s 0.65x), sysbench-cpu the same."""
    store.create_run(
        run, "nic-shootout-local", config_path="lab.toml", config_text="", seed=seed, lab_version="0", manifest={}
    )
    rng = np.random.default_rng(seed)
    cells = {
        "c01": ("virtio", {}, {}),
        "c02": ("e1000", {}, {"throughput_mbit_s_tx": 0.4, "throughput_mbit_s_rx": 0.4, "requests_per_s_c50": 0.65}),
        "c01-aa": ("virtio", {"replica": 2}, {}),
    }
    for idx, (cid, (nic, extra, shift)) in enumerate(cells.items(), start=1):
        label = f"local/debian12/{nic}/2c/1024m/virtio/linked/default" + ("#aa" if extra else "")
        store.add_cell(run, cid, idx, label, {**VM_AXES, "nic": nic, **extra})
        store.cell_update(run, cid, status="done")
        for rep in range(N):
            for wl in ("iperf3-tcp", "http", "sysbench-cpu"):
                raw_id = store.add_raw(run, cid, rep, RawOutput(wl, wl, "{}"))
                samples = [
                    Sample(
                        metric,
                        float(rng.normal(100 * shift.get(metric, 1), 100 * shift.get(metric, 1) * cv)),
                        unit,
                        hib,
                    )
                    for w, metric, unit, hib, cv in DEFAULT_LAB_ROWS
                    if w == wl
                ]
                store.add_samples(run, cid, raw_id, wl, rep, samples)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("verdicts") / "results")
    for seed in range(4):
        default_lab_run(store, f"r{seed}", seed)
    yield store
    store.close()


def sides_of(store: Store, run: str, a: str, b: str):
    r = store.run(run)
    cells, samples, hosts = store.cells(r.id), store.samples(r.id), store.host_facts.of_run(r.id)
    noise = analysis.noise_floor(results.series(samples, cells), seed=r.seed or 0)
    pick = [analysis.side(r.id, r.seed, cells, samples, hosts, analysis.parse_selector([s])) for s in (a, b)]
    return analysis.compare_sides(pick[0], pick[1], noise=noise, everything=True, n_resamples=R)


def test_the_twin_compared_with_its_cell_prints_no_better_or_worse_on_any_row(runs):
    for run in runs.runs():
        cmp = sides_of(runs, run.id, "nic=virtio", "replica=2")
        assert len(cmp.rows) == len(DEFAULT_LAB_ROWS)
        said = {r.key[2]: r.verdict for r in cmp.rows}
        assert not {Verdict.BETTER, Verdict.WORSE} & set(said.values()), (run.id, said)
        assert all(said[m] in (Verdict.SAME, Verdict.UNKNOWN) for _, m, *_ in PRIMARY), said
    # and through the command, as a user types it
    res = lab_cli("compare", "r0", "--a", "nic=virtio", "--b", "replica=2", "--results", str(runs.dir), "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["rows"]
    assert rows and not any(r["verdict"] in ("better", "worse") for r in rows)
    assert {r["margin"]["source"] for r in rows if r["primary"]} <= {"A/A band", "stated"}


def test_virtio_against_e1000_says_worse_for_the_network_and_same_for_the_cpu(runs):
    """The real run's expectation (README), on synthetic data shaped like it."""
    for run in runs.runs():
        said = {r.key[2]: r for r in sides_of(runs, run.id, "nic=virtio", "nic=e1000").rows}
        for metric in ("throughput_mbit_s_tx", "throughput_mbit_s_rx", "requests_per_s_c50"):
            assert said[metric].verdict == Verdict.WORSE and said[metric].q_value < 0.05, (run.id, metric)
        sib = said["throughput_mbit_s_tx"].siblings.text()
        assert sib.endswith("2 rows, every estimate on the worse side (verdicts: 2 worse)")
        assert {said[m].verdict for m in ("events_per_s_1t", "events_per_s_nt")} <= {Verdict.SAME, Verdict.UNKNOWN}
        assert said["latency_p90_ms_c50"].verdict == Verdict.EXPLORATORY
