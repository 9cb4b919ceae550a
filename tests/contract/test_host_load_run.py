"""A busy host is seen (issue 24) and a flagged sample is never averaged in (issue 16), on the fake
backend (tests/fakes): foreign CPU load injected during chosen repetitions flags exactly those,
keeps them out of medians and verdicts, and `lab show`, `lab compare` and the report say so;
waiting for a quiet host, giving up on one, and `lab plan` saying whether a verdict is possible."""

from __future__ import annotations

import json

import fakes.backend as fake
import pytest
from support.cli import lab_cli

from lab import analysis, flags, report, results, runner, schedule
from lab.compare import Verdict
from lab.model import Sample
from lab.store import Store

VALUES = "[suite.params.fake-work]\nvalues = [10.0, 20.0, 30.0, 40.0, 1000.0]"


class Recorder:
    """A Reporter that keeps every stage detail and warning."""

    def __init__(self):
        self.details: list[str] = []
        self.warnings: list[str] = []

    def run_started(self, *a): ...
    def cell_started(self, *a): ...
    def cell_finished(self, *a): ...

    def stage(self, cell, stage, detail=""):
        self.details.append(f"{cell.id} {detail}")

    def warn(self, message):
        self.warnings.append(message)


def run(lab, reporter=None):
    cfg = lab.load()
    store = Store(cfg.results_dir)
    return cfg, store, runner.run_lab(cfg, store, reporter)


def host_of(store, rid, cell, rep):
    labels = {
        json.dumps(s.labels.get("host_load"), sort_keys=True)
        for s in store.samples(rid)
        if s.cell_id == cell and s.repetition == rep
    }
    assert len(labels) == 1, labels  # every sample of a repetition carries its window
    return json.loads(labels.pop())


def test_exactly_the_repetitions_under_foreign_load_are_flagged_and_left_out(fake_lab):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]',
        host='foreign_load = { "c01@3" = 80.0, "c01@4" = 35.0, "c02@0" = 9.0 }',
        suite=f'repetitions = 5\nquiet_host = "record"\n{VALUES}',
    )
    rec = Recorder()
    cfg, store, rid = run(fake_lab, rec)
    flagged = {(s.cell_id, s.repetition) for s in store.samples(rid) if flags.is_flagged(s.labels)}
    assert flagged == {("c01", 3), ("c01", 4)}  # 9 % on c02 is under the 10 % threshold
    assert host_of(store, rid, "c01", 3)["flag"] == "foreign load 80 % of one core on the host (> 10 %)"
    assert host_of(store, rid, "c02", 0) == {
        "seconds": host_of(store, rid, "c02", 0)["seconds"],
        "foreign_pct": 9.0,
        "lab_pct": 60.0,
    }
    assert sum("flagged: foreign load" in w for w in rec.warnings) == 2

    by = {s.key: s for s in results.series(store.samples(rid), store.cells(rid))}
    label = {c.cell_id: c.label for c in store.cells(rid)}
    c01 = by[(label["c01"], "fake-work", "ops_per_s")]
    assert c01.values == (10.0, 20.0, 30.0) and c01.flagged_values == (40.0, 1000.0)
    row = next(r for r in results.show_rows(list(by.values())) if r.cell == c01.cell and r.metric == "ops_per_s")
    assert (row.n, row.median, row.high, row.flagged) == (3, 20.0, 30.0, 2)  # 1000 never in the median

    cells, samples = store.cells(rid), store.samples(rid)
    a = analysis.side(rid, 0, cells, samples, {}, {"nic": "virtio"})
    b = analysis.side(rid, 0, cells, samples, {}, {"nic": "e1000"})
    cmp = analysis.compare_sides(a, b, n_resamples=99)
    ops = next(r for r in cmp.rows if r.key[2] == "ops_per_s")
    assert (ops.n_a, ops.flagged_a, ops.n_b, ops.flagged_b) == (3, 2, 5, 0)
    assert ops.median_a == 20.0 and ops.median_b == 30.0
    assert "side A has repetitions flagged for host load (2)" in cmp.load_diff
    assert a.load.flagged == 2 and a.load.max_pct == 80.0 and b.load.max_pct == 9.0


def test_a_repetition_flagged_for_load_is_measured_again_within_remeasure_flagged(fake_lab):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]',
        host='foreign_load = { "c01@1" = 80.0, "c01@5" = 50.0, "c02@0" = 60.0, "c02@3" = 70.0, "c02@4" = 70.0 }',
        suite=f'repetitions = 3\nremeasure_flagged = 2\nquiet_host = "record"\n{VALUES}',
    )
    rec = Recorder()
    cfg, store, rid = run(fake_lab, rec)
    reps = {c: sorted({s.repetition for s in store.samples(rid) if s.cell_id == c}) for c in ("c01", "c02")}
    # c01: rep 1 busy, measured again; 3 counted after 4 (rep 5 is never reached)
    # c02: reps 0, 3 and 4 busy: the budget of 2 spent at rep 4, 2 counted
    assert reps == {"c01": [0, 1, 2, 3], "c02": [0, 1, 2, 3, 4]}
    outcome = store.run(rid).manifest["repetitions"]
    assert outcome["c01"]["fake-work"]["stopped"] == "fixed n = 3: 1 flagged for load, measured again"
    assert outcome["c02"]["fake-work"]["stopped"] == (
        "fixed n = 3: 3 flagged for load, 2 measured again (remeasure_flagged = 2), 2 unflagged"
    )
    assert (outcome["c02"]["fake-work"]["n"], outcome["c02"]["fake-work"]["load_flagged"]) == (5, 3)
    assert store.run(rid).manifest["schedule"]["remeasure_flagged"] == 2
    by = {s.key: s for s in results.series(store.samples(rid), store.cells(rid))}
    label = {c.cell_id: c.label for c in store.cells(rid)}
    assert by[(label["c01"], "fake-work", "ops_per_s")].values == (10.0, 30.0, 40.0)
    assert by[(label["c02"], "fake-work", "ops_per_s")].values == (20.0, 30.0)


def test_interleaved_rounds_go_on_for_the_cells_that_must_measure_again(fake_lab):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]',
        host='foreign_load = { "c02@1" = 80.0 }',
        suite='repetitions = 2\norder = "interleaved"\nseed = 3\nremeasure_flagged = 1\nquiet_host = "record"\n'
        + VALUES,
    )
    cfg, store, rid = run(fake_lab)
    man = store.run(rid).manifest
    assert [sorted(r) for r in man["rounds"]] == [["c01", "c02"], ["c01", "c02"], ["c02"]]  # a third for c02 only
    assert {c: o["fake-work"]["n"] for c, o in man["repetitions"].items()} == {"c01": 2, "c02": 3}
    assert {c.status for c in store.cells(rid)} == {"done"}


def test_plan_says_flagged_repetitions_are_measured_again(fake_lab):
    out = plan_text(fake_lab, 'repetitions = 5\nremeasure_flagged = 2\nquiet_host = "wait"')
    assert "a repetition flagged for its host's or client's load is measured again, at most 2 times" in out
    assert "measured again" not in plan_text(fake_lab, 'repetitions = 5\nquiet_host = "wait"')


def test_show_compare_and_the_report_say_which_samples_were_flagged(fake_lab):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]',
        host='foreign_load = { "c02@1" = 50.0 }',
        suite=f'repetitions = 5\nquiet_host = "record"\n{VALUES}',
    )
    cfg, store, rid = run(fake_lab)
    shown = lab_cli("show", rid, "-c", str(fake_lab.path))
    assert shown.returncode == 0, shown.stderr
    assert "⚑1" in shown.stdout and "flagged, not counted in any median or verdict (1 repetitions):" in shown.stdout
    assert "c02 e1000 fake-work repetition 2: foreign load 50 % of one core on the host (> 10 %)" in shown.stdout
    assert "host load: flagged above 10 % of one core; f: record" in shown.stdout
    compared = lab_cli("compare", rid, "--a", "nic=virtio", "--b", "nic=e1000", "-c", str(fake_lab.path))
    assert compared.returncode == 0, compared.stderr
    assert "⚑1" in compared.stdout and "host load under A: foreign load median 0 %" in compared.stdout
    assert "host load differs: side B has repetitions flagged for host load (1), the other none" in compared.stdout
    doc = json.loads(
        lab_cli("compare", rid, "--a", "nic=virtio", "--b", "nic=e1000", "--json", "-c", str(fake_lab.path)).stdout
    )
    assert doc["host_load"]["b"]["flagged"] == 1 and doc["host_load"]["difference"]
    html = report.render(store, rid)
    assert 'id="host-load"' in html and "foreign load 50 % of one core on the host (&gt; 10 %)" in html
    assert 'class="flagged-reps"' in html


def test_a_side_whose_every_sample_is_flagged_says_so(fake_lab):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]',
        host='foreign_load = { "c02" = 50.0 }',
        suite='repetitions = 3\nquiet_host = "record"',
    )
    cfg, store, rid = run(fake_lab)
    cells, samples = store.cells(rid), store.samples(rid)
    cmp = analysis.compare_sides(
        analysis.side(rid, 0, cells, samples, {}, {"nic": "virtio"}),
        analysis.side(rid, 0, cells, samples, {}, {"nic": "e1000"}),
        n_resamples=99,
    )
    assert {r.verdict for r in cmp.rows if r.key[2] == "ops_per_s"} == {Verdict.ONLY_FLAGGED}
    assert "all flagged" in report.render(store, rid)  # the chart has no bar for it
    shown = lab_cli("show", rid, "-c", str(fake_lab.path)).stdout
    assert "⚑3" in shown


def test_waiting_for_a_quiet_host_is_shown_and_leaves_the_sample_clean(fake_lab):
    fake_lab.write(
        host="busy_probes = { c01 = 3 }", suite='quiet_host = "wait"\nquiet_seconds = 0.03\nquiet_timeout_s = 30'
    )
    rec = Recorder()
    cfg, store, rid = run(fake_lab, rec)
    waits = [d for d in rec.details if "waiting for a quiet host" in d]  # shown once, then every 5 s
    assert len(waits) == 1 and waits[0].startswith("c01 fake-work 1/2: waiting for a quiet host: foreign load 50 %")
    assert not any(flags.is_flagged(s.labels) for s in store.samples(rid))
    assert host_of(store, rid, "c01", 0)["waited_s"] > 0 and "waited_s" not in host_of(store, rid, "c01", 1)


def test_a_host_that_never_quiets_down_flags_the_repetition_and_the_run_goes_on(fake_lab):
    fake_lab.write(
        host="busy_probes = { c01 = 100000 }",
        suite='quiet_host = "wait"\nquiet_seconds = 0.02\nquiet_timeout_s = 0.1\nrepetitions = 5',
    )
    rec = Recorder()
    cfg, store, rid = run(fake_lab, rec)
    assert store.cells(rid)[0].status == "done"
    assert {s.repetition for s in store.samples(rid) if flags.is_flagged(s.labels)} == {0, 1, 2}
    assert host_of(store, rid, "c01", 0)["flag"].startswith(
        "host not quiet for 0.02 s within 0.1 s before it (foreign load 50 % of one core"
    )
    # three times in a row: the run stops waiting for this host, and goes on recording its load
    assert sum("measuring it anyway, flagged" in w for w in rec.warnings) == 3
    assert "not waiting for it any more in this run" in rec.warnings[-1]
    assert "waited_s" not in host_of(store, rid, "c01", 3) and "foreign_pct" in host_of(store, rid, "c01", 3)


@pytest.mark.parametrize(
    "local, setting, expect",
    [(True, None, "wait"), (False, None, "record"), (True, '"record"', "record"), (True, '"off"', "off")],
)
def test_quiet_host_defaults_to_waiting_on_this_machine_only(fake_lab, local, setting, expect, monkeypatch):
    monkeypatch.delenv("LAB_QUIET_HOST", raising=False)  # the product's default, not the test suite's
    fake_lab.write(
        host=f"local_host = {str(local).lower()}",
        suite="quiet_seconds = 0.01\nrepetitions = 1" + (f"\nquiet_host = {setting}" if setting else ""),
    )
    cfg, store, rid = run(fake_lab)
    assert store.run(rid).manifest["quiet_host"] == {"f": expect}
    probes = [e for e in fake.JOURNAL if e[0] == "host_load"]
    windows = {"wait": 2, "record": 1, "off": 0}[expect]  # a quiet probe and the repetition's window
    assert len(probes) == windows
    assert ("host_load" in store.samples(rid)[0].labels) == (expect != "off")


def test_a_host_that_cannot_tell_its_load_is_recorded_as_such_not_flagged(fake_lab):
    fake_lab.write(host="load_unknown = true\nlocal_host = true", suite='quiet_seconds = 0.01\nquiet_host = "wait"')
    cfg, store, rid = run(fake_lab)
    load = host_of(store, rid, "c01", 0)
    assert load["unknown"] == "host 'f' (fake backend) does not report its CPU load" and "flag" not in load
    assert "cannot tell (2 repetitions)" in lab_cli("show", rid, "-c", str(fake_lab.path)).stdout


def test_reparse_keeps_the_hosts_flag_and_recomputes_the_parsers(fake_lab):
    fake_lab.write(host='foreign_load = { "c01@1" = 50.0 }', suite='quiet_host = "record"')
    cfg, store, rid = run(fake_lab)
    before = sorted(
        (s.repetition, flags.reasons(s.labels)[0] if flags.is_flagged(s.labels) else "") for s in store.samples(rid)
    )
    with store.db:  # as if an older parser had flagged repetition 0
        store.db.execute("BEGIN")
        store.db.execute("UPDATE samples SET labels = json_set(labels, '$.flagged', 1) WHERE repetition = 0")
    assert any(flags.is_flagged(s.labels) for s in store.samples(rid) if s.repetition == 0)
    runner.reparse(store, rid)
    after = sorted(
        (s.repetition, flags.reasons(s.labels)[0] if flags.is_flagged(s.labels) else "") for s in store.samples(rid)
    )
    assert after == before and any(why for rep, why in after if rep == 1)


def test_a_repetition_flagged_for_host_load_does_not_steer_adaptive_repetition():
    t = schedule.Tally()
    t.add([Sample("ops", 1.0, "ops/s", True, {"host_load": {"foreign_pct": 50.0, "flag": "busy"}})], 1.0)
    t.add([Sample("ops", 2.0, "ops/s", True, {"host_load": {"foreign_pct": 1.0}})], 1.0)
    assert t.n == 2 and t.values == {"ops": [2.0]}


# -- lab plan: can the matrix's comparisons reach a verdict at all? -----------------------------


def plan_text(fake_lab, suite):
    fake_lab.write(matrix='nic = ["virtio", "e1000"]', suite=suite)
    res = lab_cli("plan", "-c", str(fake_lab.path))
    assert res.returncode == 0, res.stderr
    return " ".join(res.stdout.split())


def test_plan_warns_when_three_repetitions_can_never_give_a_verdict(fake_lab):
    out = plan_text(fake_lab, "repetitions = 3")
    assert (
        "warning: suite.repetitions = 3: nic virtio vs e1000 can reach p = 0.1 at best, never < 0.05; "
        "repetitions = 4 gives 0.029, 5 gives 0.0079"
    ) in out


def test_plan_does_not_warn_with_five(fake_lab):
    out = plan_text(fake_lab, "repetitions = 5")
    assert "warning" not in out
    assert "verdicts: nic virtio vs e1000 can reach p = 0.0079 with 5 repetitions a side" in out


def test_plan_says_what_adaptive_repetitions_give_at_their_minimum(fake_lab):
    out = plan_text(fake_lab, "repetitions = 3\ntarget_ci_pct = 5")
    assert "warning" not in out and "can reach p = 0.0079 with 5 repetitions a side" in out
    assert "adaptive repetitions can stop at n = 5" in out
    budget = plan_text(fake_lab, "repetitions = 3\ntarget_ci_pct = 5\nmax_seconds = 60")
    assert "warning: adaptive repetitions can stop at n = 3 (suite.repetitions = 3, suite.max_seconds = 60)" in budget


def test_plan_names_every_axis_that_can_be_compared(fake_lab):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]\ntuning = ["default", "wan-16m"]\n'
        'exclude = [{ nic = "e1000", tuning = "wan-16m" }]',
        suite="repetitions = 5",
    )
    res = lab_cli("plan", "-c", str(fake_lab.path))
    assert res.returncode == 0, res.stderr
    out = " ".join(res.stdout.split())
    assert "nic virtio vs e1000 and tuning default vs wan-16m can reach" in out


def test_plan_says_how_the_host_is_watched(fake_lab):
    out = plan_text(fake_lab, 'repetitions = 5\nquiet_host = "wait"')
    assert (
        "host f: its load waits until it has been quiet for 2 s (at most 30 s) before each repetition, "
        "records and flags (a repetition is flagged above 10 % of one core of foreign load or steal)"
    ) in out


def test_quiet_timeout_shorter_than_the_quiet_time_is_refused(fake_lab):
    fake_lab.write(suite='quiet_host = "wait"\nquiet_seconds = 5\nquiet_timeout_s = 2')
    res = lab_cli("plan", "-c", str(fake_lab.path))
    assert res.returncode == 2 and "suite.quiet_timeout_s" in res.stderr


def test_lab_quiet_host_is_the_default_of_a_machine_running_several_labs(fake_lab, monkeypatch):
    from lab.errors import UsageError

    monkeypatch.setenv("LAB_QUIET_HOST", "record")
    fake_lab.write(host="local_host = true")
    assert fake_lab.load().suite.quiet_mode(True) == "record"
    fake_lab.write(host="local_host = true", suite='quiet_host = "wait"')
    assert fake_lab.load().suite.quiet_mode(True) == "wait"  # lab.toml's word wins
    monkeypatch.setenv("LAB_QUIET_HOST", "sometimes")
    fake_lab.write(host="local_host = true")
    with pytest.raises(UsageError, match="LAB_QUIET_HOST = 'sometimes'"):
        fake_lab.load().suite.quiet_mode(True)


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_bad_lab_quiet_host_is_one_line_exit_2_nothing_created(fake_lab, command):
    from support.cli import lab_cli

    path = fake_lab.write()
    before = sorted(p.name for p in fake_lab.dir.iterdir())
    res = lab_cli(command, "-c", str(path), env={"LAB_QUIET_HOST": "sometimes"})
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == ["lab: error: LAB_QUIET_HOST = 'sometimes': expected wait, record or off"]
    assert sorted(p.name for p in fake_lab.dir.iterdir()) == before
