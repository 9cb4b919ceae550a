"""`lab explain`'s pure parts: the designs (resolution IV, corners, revert, the active knobs'
factorial), the knobs found between two stored cells, and the statistics on seeded synthetic data:
an A/A explanation calls a knob "matters" in at most 5 % of cases, planted effects are found."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lab import verdicts
from lab.explain import design, effects
from lab.explain.knobs import Knob, axis_knobs, param_knobs, untestable
from lab.store import CellRow

# -- designs ------------------------------------------------------------------------------------------


def columns(points, term):
    return np.array([effects.column(p, term) for p in points], dtype=float)


@pytest.mark.parametrize("k", range(4, 11))
def test_screening_is_resolution_iv_and_holds_both_corners(k):
    d = design.screening(k)
    pts = list(d.points)
    assert len(pts) == len(set(pts)) and len(pts) < 2**k
    assert len(pts) == (8 if k == 4 else 16 if k <= 8 else 32)
    lo, hi = design.corners(k)
    assert lo in pts and hi in pts
    mains = [columns(pts, (j,)) for j in range(k)]
    for x in mains:
        assert x.sum() == 0  # balanced
    for x, y in itertools.combinations(mains, 2):
        assert x @ y == 0  # main effects orthogonal
    for j in range(k):  # resolution IV: no main effect aliased with a two-knob interaction
        for pair in itertools.combinations(range(k), 2):
            assert mains[j] @ columns(pts, pair) == 0, (j, pair)


def test_small_designs_are_full_factorials_and_revert_is_k_plus_two():
    for k in (1, 2, 3):
        d = design.first(k)
        assert d.kind == "factorial" and len(d.points) == 2**k
    r = design.first(4, "revert")
    assert r.points[0] == (1, 1, 1, 1) and r.points[-1] == (0, 0, 0, 0) and len(r.points) == 6
    assert r.points[1] == (0, 1, 1, 1)
    with pytest.raises(ValueError, match="use --method revert"):
        design.first(design.MAX_KNOBS + 1)


def test_the_active_factorial_holds_the_others_at_a():
    d = design.active(5, [1, 3])
    assert sorted(d.points) == [(0, 0, 0, 0, 0), (0, 0, 0, 1, 0), (0, 1, 0, 0, 0), (0, 1, 0, 1, 0)]
    assert design.interactions_estimable(["screening", "active"], 5, [1, 3]) == [(1, 3)]
    assert design.interactions_estimable(["screening"], 5, []) == []
    assert len(design.interactions_estimable(["factorial"], 3, [])) == 3


def test_next_design_walks_the_phases():
    k = 5
    first = design.next_design(k, "factorial", [], stuck=[], mattering=[], max_rounds=2)
    assert first.kind == "screening"
    phases = [(first.kind, list(first.points))]
    again = design.next_design(k, "factorial", phases, stuck=[2], mattering=[0], max_rounds=2)
    assert again.kind == "more" and set(again.points) == set(first.points)
    phases.append((again.kind, list(again.points)))
    phases.append(("more", list(again.points)))
    act = design.next_design(k, "factorial", phases, stuck=[2], mattering=[0, 4], max_rounds=2)
    assert act.kind == "active" and len(act.points) == 4  # rounds spent: on to the active knobs
    phases.append((act.kind, list(act.points)))
    assert design.next_design(k, "factorial", phases, stuck=[], mattering=[0, 4], max_rounds=2) is None
    rev = design.next_design(3, "revert", [("revert", [])], stuck=[1], mattering=[], max_rounds=1)
    assert rev.points == ((1, 1, 1), (1, 0, 1))


def test_cells_needed_against_the_full_factorial():
    assert design.cells_needed(2, 2) == {"first": 2, "active": 0, "total": 2, "full_factorial": 2}
    got = design.cells_needed(8, 2)
    assert got["first"] == 14 and got["total"] < got["full_factorial"] == 254


# -- knobs ----------------------------------------------------------------------------------------------


def cell(cid, axes, **facts):
    return CellRow("r1", cid, 1, cid, axes, "done", None, None, facts)


def test_axis_knobs_in_matrix_order_with_riders():
    a = cell("c01", {"host": "h", "image": "debian12", "nic": "virtio", "vcpus": 2, "wan": "rtt50"})
    b = cell(
        "c02",
        {"host": "h", "image": "debian12", "nic": "e1000", "vcpus": 2, "isolation": "container", "runtime": "docker"},
    )
    knobs = axis_knobs(a, b)
    assert [k.name for k in knobs] == ["nic", "wan", "isolation"]
    assert knobs[1] == Knob("wan", "rtt50", "none")
    assert knobs[2].also == (("runtime", "podman", "docker"),)  # a VM cell has no runtime: it rides along
    assert "runtime podman → docker" in knobs[2].text()
    assert Knob.from_dict(knobs[2].as_dict()) == knobs[2]


def test_parameter_knobs_and_what_cannot_be_tested():
    knobs = param_knobs(
        {"http": {"connections": [50], "duration": 5}},
        {"http": {"connections": [100], "duration": 5}},
        ["http", "iperf3-tcp"],
    )
    assert knobs == [Knob("http.connections", [50], [100], workload="http")]
    assert knobs[0].param == "connections" and knobs[0].kind == "param"
    a = cell("c01", {"host": "h", "image": "debian12"}, image_digest="aaaa1111bbbb2222", accel="kvm")
    b = cell("c01", {"host": "h", "image": "debian12"}, image_digest="cccc3333dddd4444", accel="tcg")
    found = untestable(
        a,
        b,
        {"h": {"kernel": "6.1.0-1", "cpu_model": "X"}},
        {"h": {"kernel": "6.1.0-2", "cpu_model": "X"}},
        same_run=False,
    )
    what = {u.what: (u.a, u.b) for u in found}
    assert what["host h: kernel"] == ("6.1.0-1", "6.1.0-2")
    assert "host h: cpu_model" not in what
    assert what["accelerator"] == ("kvm", "tcg")
    assert what["image debian12: recipe digest"] == ("aaaa1111bbbb", "cccc3333dddd")
    other = cell("c02", {"host": "g"})
    two_hosts = untestable(a, other, {"h": {"kernel": "1"}}, {"g": {"kernel": "2"}}, same_run=True)
    assert two_hosts[0].what == "host h / g: kernel" and "flipping the host" in two_hosts[0].why


# -- statistics on seeded data -----------------------------------------------------------------------


def synthetic(points, rng, *, n=3, cv=0.03, main=None, pair=None):
    out = []
    for lv in points:
        mu = 1000.0
        for j, r in (main or {}).items():
            mu *= r if lv[j] else 1.0
        if pair is not None:
            (first, second), r = pair
            mu *= r if lv[second] and not lv[first] else 1.0
        out.append(effects.Point(lv, tuple(mu * np.exp(rng.normal(0.0, cv, n)))))
    return out


def one_explanation(k, rng, *, cv, seed, n_resamples=999, **planted):
    d = design.first(k)
    pts = synthetic(d.points, rng, cv=cv, **planted)
    pairs = design.interactions_estimable([d.kind], k, [])
    est = effects.estimate(k, pts, pairs=pairs, seed=seed, n_resamples=n_resamples)
    ((knobs, inter, _),) = effects.judge([est], higher_is_better=[True], margins=[verdicts.Margin.stated()])
    return knobs, inter


@pytest.mark.parametrize("cv", [0.03, 0.10])
def test_a_a_calls_a_knob_matters_in_at_most_5_percent(cv):
    """Nothing planted: every knob is null. Over seeded trials of k = 2..6 (full factorials and
    resolution-IV fractions, n = 3 a cell), the share of knobs called "matters" stays <= 5 %, at a
    CV well inside the margin (3 %) and at one that makes the margin no help (10 %)."""
    rng = np.random.default_rng(20260)
    called = tested = trials_with_any = trials = 0
    inter_called = inter_tested = 0
    for k in (2, 3, 4, 5, 6):
        for t in range(20):
            knobs, inter = one_explanation(k, rng, cv=cv, seed=t)
            hits = sum(1 for x in knobs if x.answer.differs)
            called += hits
            tested += len(knobs)
            trials += 1
            trials_with_any += bool(hits)
            inter_called += sum(1 for x in inter if x.answer.differs)
            inter_tested += len(inter)
    rate = called / tested
    print(
        f"\nA/A, CV {cv:.0%}: {called} of {tested} knobs called 'matters' ({rate:.1%}); "
        f"{trials_with_any} of {trials} explanations called any; interactions {inter_called}/{inter_tested}"
    )
    assert rate <= 0.05
    assert inter_called / max(inter_tested, 1) <= 0.05


def test_a_planted_effect_is_found_and_the_null_knobs_said_same():
    rng = np.random.default_rng(7)
    found = same = 0
    for t in range(10):
        knobs, inter = one_explanation(3, rng, cv=0.03, seed=t, main={0: 0.7})
        found += knobs[0].answer.differs
        same += all(x.answer is verdicts.Answer.SAME for x in knobs[1:])
        assert knobs[0].share is None or knobs[0].share > 0.8
    assert found == 10 and same >= 8


def test_effects_are_ratios_with_cis_and_shares_add_up():
    rng = np.random.default_rng(3)
    d = design.factorial(2)
    pts = synthetic(d.points, rng, n=5, cv=0.02, main={0: 0.5, 1: 0.8})
    est = effects.estimate(2, pts, seed=1)
    ((knobs, inter, gap),) = effects.judge([est], higher_is_better=[True], margins=[verdicts.Margin.stated()])
    assert 0.45 < knobs[0].ratio < 0.55 and knobs[0].ci[0] < knobs[0].ratio < knobs[0].ci[1]
    assert 0.75 < knobs[1].ratio < 0.85
    assert abs(knobs[0].share + knobs[1].share - 1.0) < 0.05
    assert math.isclose(knobs[0].share, math.log(0.5) / math.log(0.4), rel_tol=0.1)
    assert gap is verdicts.Answer.WORSE


def test_an_unestimable_knob_is_unknown_with_the_reason():
    # a full factorial of 2 with the two cells that vary knob 1 alone missing
    pts = [effects.Point((0, 0), (1.0, 1.01, 0.99)), effects.Point((1, 1), (2.0, 2.01, 1.99))]
    est = effects.estimate(2, pts)
    assert est.main[0] is None and "not estimable" in est.why[0]
    ((knobs, _, _),) = effects.judge([est], higher_is_better=[True], margins=[verdicts.Margin.stated()])
    assert knobs[0].verdict == "unknown" and knobs[0].why


def test_the_step_that_carries_the_gap():
    total = [effects.Point((0,), (10.0, 11.0)), effects.Point((1,), (70.0, 71.0))]
    parts = {
        "clone_seconds_x": [effects.Point((0,), (2.0,)), effects.Point((1,), (61.0,))],
        "make_seconds_x": [effects.Point((0,), (5.0,)), effects.Point((1,), (6.0,))],
    }
    step = effects.step_of(1, parts, total)
    assert step.metric == "clone_seconds_x" and math.isclose(step.share, 59.0 / 60.0)


def test_an_interaction_whose_sides_two_runs_measured_is_said_to_be_the_runs_too():
    """The 2^2 factorial from a parent's two corners: the follow-up run measures the other two cells,
    so the nic x cc contrast is also the difference between the two runs (a host that got busier
    reads as an interaction, as the real-VM test saw); the main effects stay balanced across runs."""
    from lab.explain.explanation import PointInfo, run_aliased

    def pts(where):
        return [PointInfo(lv, [(run, "c")], 3) for lv, run in where.items()]

    corners = {(0, 0): "parent", (1, 1): "parent", (0, 1): "child", (1, 0): "child"}
    assert run_aliased(pts(corners), [(0, 1)]) == {(0, 1): (["parent"], ["child"])}
    for j in range(2):  # each main effect has a point of each run on both sides
        assert {effects.column(lv, (j,)) for lv, run in corners.items() if run == "parent"} == {-1, 1}
    one_run = dict.fromkeys(corners, "all")
    assert run_aliased(pts(one_run), [(0, 1)]) == {}
    remeasured = pts(corners) + [PointInfo((0, 1), [("parent", "c9")], 3)]  # one side also in the parent
    assert run_aliased(remeasured, [(0, 1)]) == {}
    three = {lv: "parent" if lv in ((0, 0, 0), (1, 1, 1)) else "child" for lv in itertools.product((0, 1), repeat=3)}
    assert run_aliased(pts(three), [(0, 1), (0, 2), (1, 2)]) == {}  # partly, never wholly, the runs
