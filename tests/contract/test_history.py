"""`lab history` over stores made with the Store API (tests/support/seriesstore.py): the series of one
configuration on one host, its change points and the host facts that changed across them,
--fail-on-regression, `lab run --quiet` on the fake backend, `lab prune`, and that no reading
command writes to the store."""

from __future__ import annotations

import json
import os
import sqlite3

import pytest
from support.cli import lab_cli
from support.seriesstore import FACTS, LABEL, add_runs

from lab import history
from lab.store import Store
from lab.storeschema import MIGRATIONS

FLAT = [1000.0, 1004.0, 998.0, 1002.0, 999.0, 1003.0]
STEP = [1000.0, 1004.0, 998.0, 700.0, 703.0, 698.0]  # -30 % from the 4th run
CAPPED = {**FACTS, "cpu_quota": "0.5 CPUs"}


def hist(tmp_path, *args):
    res = lab_cli("history", "--results", str(tmp_path / "results"), *args)
    return res


def test_a_planted_step_is_found_at_its_run_with_size_ci_and_the_fact_that_changed(tmp_path):
    add_runs(tmp_path / "results", STEP, facts=[FACTS] * 3 + [CAPPED] * 3)
    res = hist(tmp_path, "local", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "lab.history/1" and len(doc["series"]) == 1  # cpu_busy_pct is not shown by default
    s = doc["series"][0]
    assert (s["host"], s["cell"], s["workload"], s["metric"]) == ("local", LABEL, "sysbench-cpu", "events_per_s_1t")
    assert s["verdict"] == "changed" and s["primary"] and s["regression"]
    assert [r["run"] for r in s["runs"]] == [f"r{i}" for i in range(6)]
    assert all(r["n"] == 3 and r["ci"][0] <= r["median"] <= r["ci"][1] for r in s["runs"])
    (cp,) = s["change_points"]
    assert (cp["run"], cp["before_run"], cp["index"], cp["verdict"]) == ("r3", "r2", 3, "worse")
    assert cp["size_pct"] == pytest.approx(-30.0, abs=0.5)
    assert cp["ci_pct"][0] < cp["size_pct"] < cp["ci_pct"][1] < 0
    assert cp["facts_changed"] == [{"fact": "cpu_quota", "before": "none", "after": "0.5 CPUs"}]
    assert doc["regressions"] == [history.regression_line(*_regression(tmp_path))]
    assert set(doc["host_facts"]) == {r["fingerprint"] for r in s["runs"]}  # each fingerprint's facts once
    assert [doc["host_facts"][r["fingerprint"]]["cpu_quota"] for r in s["runs"]] == ["none"] * 3 + ["0.5 CPUs"] * 3
    assert "foreign load" not in doc["host_facts"][s["runs"][0]["fingerprint"]]  # the run's, below
    assert (s["runs"][0]["accel"], s["runs"][0]["lab_version"]) == ("tcg", "0.1.0")
    assert s["runs"][0]["foreign_load"] == "0 of 3 repetitions over 10 % of one core"


def _regression(tmp_path):
    (h,) = history.histories(Store(tmp_path / "results", readonly=True))
    return h, h.regression


def test_the_table_names_the_change_and_the_facts(tmp_path):
    add_runs(tmp_path / "results", STEP, facts=[FACTS] * 3 + [CAPPED] * 3)
    res = hist(tmp_path)
    assert res.returncode == 0, res.stderr
    assert "sysbench-cpu events_per_s_1t (events/s) ↑ · 6 runs  ███▁▁▁" in res.stdout
    assert "change: worse -30.0 % [" in res.stdout and "at run r3 (the 4th of 6 measured) after 3 runs" in res.stdout
    assert "changed: cpu_quota none -> 0.5 CPUs" in res.stdout


def test_fail_on_regression_exits_1_with_one_line_and_0_on_a_flat_series(tmp_path):
    add_runs(tmp_path / "results", STEP, facts=[FACTS] * 3 + [CAPPED] * 3)
    res = hist(tmp_path, "--fail-on-regression")
    assert res.returncode == 1
    assert res.stdout.strip().splitlines() == [
        f"regression: host local, cell {LABEL}, sysbench-cpu events_per_s_1t: -30.0 % "
        + res.stdout.split(": -30.0 % ")[1].split("since")[0]
        + "since run r3; changed: cpu_quota none -> 0.5 CPUs"
    ]
    flat = tmp_path / "flat"
    add_runs(flat / "results", FLAT)
    res = lab_cli("history", "--results", str(flat / "results"), "--fail-on-regression")
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")


def test_a_change_for_the_better_is_no_regression(tmp_path):
    add_runs(tmp_path / "results", [700.0, 703.0, 698.0, 1000.0, 1004.0, 998.0])
    res = hist(tmp_path, "--fail-on-regression")
    assert (res.returncode, res.stdout) == (0, "")
    doc = json.loads(hist(tmp_path, "--json").stdout)
    (cp,) = doc["series"][0]["change_points"]
    assert cp["verdict"] == "better" and cp["facts_changed"] == [] and not doc["series"][0]["regression"]


def test_a_series_too_short_to_judge_says_so(tmp_path):
    add_runs(tmp_path / "results", STEP[:4])
    res = hist(tmp_path)
    assert res.returncode == 0 and "too short: 4 runs: a change needs 3 on each side (6)" in res.stdout
    doc = json.loads(hist(tmp_path, "--json").stdout)
    assert doc["series"][0]["verdict"] == "too short" and doc["series"][0]["change_points"] == []
    assert hist(tmp_path, "--fail-on-regression").returncode == 0


def test_another_configuration_is_another_series_never_mixed(tmp_path):
    where = tmp_path / "results"
    add_runs(where, FLAT, prefix="a")
    add_runs(where, [500.0] * 6, prefix="b", digest="d2")  # another image build
    add_runs(where, [400.0] * 6, prefix="c", params={"time": 2, "threads": [1]})  # other parameters
    add_runs(where, [300.0] * 6, prefix="d", axes={"nic": "e1000"})  # another cell
    add_runs(where, [200.0] * 6, prefix="e", facts=[{**FACTS, "machine_id": "m-two"}] * 6)  # another machine
    doc = json.loads(hist(tmp_path, "--json").stdout)
    assert len(doc["series"]) == 5
    for s in doc["series"]:
        assert len({r["run"][0] for r in s["runs"]}) == 1 and s["verdict"] == "no change", s["runs"]
    nic = json.loads(hist(tmp_path, "--cell", "nic=e1000", "--json").stdout)
    assert [r["run"][0] for r in nic["series"][0]["runs"]] == ["d"] * 6


def test_runs_from_before_machine_ids_join_the_hosts_one_machine(tmp_path):
    old = {k: v for k, v in FACTS.items() if k != "machine_id"}
    add_runs(tmp_path / "results", FLAT, facts=[old] * 3 + [FACTS] * 3)
    (s,) = json.loads(hist(tmp_path, "--json").stdout)["series"]
    assert len(s["runs"]) == 6 and s["machine"] == "m-one"


def test_flagged_samples_stay_out_and_foreign_load_is_named(tmp_path):
    # the runs from the 4th on had foreign load under 10 % before, then over: the last three medians are gone
    add_runs(tmp_path / "results", FLAT + [1001.0, 1000.0, 1002.0], foreign=[0.0] * 6 + [45.0] * 3)
    (s,) = json.loads(hist(tmp_path, "--json").stdout)["series"]
    assert [r["median"] is None for r in s["runs"]] == [False] * 6 + [True] * 3
    assert [r["flagged"] for r in s["runs"]][-1] == 3 and s["verdict"] == "no change"
    add_runs(tmp_path / "step", STEP, foreign=[0.0] * 3 + [8.0] * 3)
    (s,) = json.loads(lab_cli("history", "--results", str(tmp_path / "step"), "--json").stdout)["series"]
    assert s["runs"][-1]["host_load"]["max_pct"] == 8.0
    assert s["change_points"][0]["facts_changed"] == []  # under the threshold: not a changed fact
    add_runs(tmp_path / "hot", STEP + [699.0, 701.0], foreign=[0.0] * 3 + [0.0, 0.0, 0.0, 30.0, 30.0])
    doc = json.loads(lab_cli("history", "--results", str(tmp_path / "hot"), "--json").stdout)
    assert doc["series"][0]["runs"][-1]["median"] is None  # its samples flagged: out of the search


def test_last_limits_the_search(tmp_path):
    add_runs(tmp_path / "results", STEP + [699.0, 700.0, 702.0, 701.0])
    assert json.loads(hist(tmp_path, "--json").stdout)["series"][0]["change_points"][0]["run"] == "r3"
    doc = json.loads(hist(tmp_path, "--last", "6", "--json").stdout)
    assert doc["settings"]["last"] == 6 and doc["series"][0]["verdict"] == "no change"
    assert hist(tmp_path, "--last", "6", "--fail-on-regression").returncode == 0  # a known regression, acknowledged


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["nohost"], "no series of host nohost"),
        (["--cell", "nic"], "--cell 'nic': expected AXIS=VALUE"),
        (["--workload", "nope"], "no series of workload nope"),
        (["--last", "1"], "--last"),
        (["--min-runs", "1"], "--min-runs"),
    ],
)
def test_bad_history_arguments_are_one_line_exit_2(tmp_path, argv, fragment):
    add_runs(tmp_path / "results", FLAT)
    res = hist(tmp_path, *argv)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert fragment in res.stderr and "Traceback" not in res.stderr


def test_no_store_is_one_line(tmp_path):
    res = hist(tmp_path)
    assert res.returncode == 2 and res.stderr.strip() == (
        f"lab: error: no runs in {tmp_path / 'results'} (no lab.db); `lab run` makes one"
    )


# -- reading commands write nothing; stores of other schemas ---------------------------------------


def _state(where):
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(where.iterdir()) if p.name == "lab.db"}


READERS = [
    ["history"],
    ["history", "--json"],
    ["history", "--fail-on-regression"],
    ["ls"],
    ["show", "r5"],
    ["compare", "r0", "r5"],
    ["report", "r5", "--history", "-o", "{tmp}/r.html"],
]


@pytest.mark.parametrize("argv", READERS, ids=[" ".join(a[:2]) for a in READERS])
def test_reading_commands_write_nothing_to_the_store(tmp_path, argv):
    where = tmp_path / "results"
    add_runs(where, STEP, facts=[FACTS] * 3 + [CAPPED] * 3)
    Store(where).close()  # checkpointed: the WAL is empty
    before = _state(where)
    res = lab_cli(*(a.format(tmp=tmp_path) for a in argv), "--results", str(where))
    assert res.returncode in (0, 1), res.stderr
    assert _state(where) == before


def test_an_older_store_is_read_through_an_upgraded_copy_and_left_as_it_is(tmp_path):
    where = tmp_path / "results"
    add_runs(where, STEP, facts=[FACTS] * 3 + [CAPPED] * 3)
    _downgrade(where / "lab.db")
    before = _state(where)
    res = hist(tmp_path, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["series"][0]["change_points"][0]["run"] == "r3"
    assert _state(where) == before
    assert sqlite3.connect(where / "lab.db").execute("PRAGMA user_version").fetchone()[0] == 3


def _downgrade(db):
    """The store as lab wrote it before migration 4 (runs without uids, no store identity)."""
    con = sqlite3.connect(db)
    con.executescript(
        "DROP INDEX runs_uid; ALTER TABLE runs DROP COLUMN uid; ALTER TABLE runs DROP COLUMN origin;"
        " ALTER TABLE runs DROP COLUMN origin_id; DROP TABLE store_identity; PRAGMA user_version = 3;"
    )
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()


def test_a_store_from_a_newer_lab_is_refused_in_one_line(tmp_path):
    where = tmp_path / "results"
    add_runs(where, FLAT)
    con = sqlite3.connect(where / "lab.db")
    con.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    con.close()
    for argv in (["history"], ["show"], ["compare", "r0", "r1"]):
        res = lab_cli(*argv, "--results", str(where))
        assert res.returncode == 2, (argv, res.stderr)
        assert res.stderr.strip().splitlines() == [
            f"lab: error: results store {where / 'lab.db'} has schema {len(MIGRATIONS) + 1}, newer than this "
            f"lab's {len(MIGRATIONS)} (hint: upgrade lab)"
        ]
    res = lab_cli("prune", "--keep", "1", "--results", str(where))  # a writer: refused the same way
    assert res.returncode == 2 and "newer lab" in res.stderr and len(res.stderr.strip().splitlines()) == 1


# -- prune -------------------------------------------------------------------------------------------


def test_prune_keeps_the_newest_runs_and_everything_of_theirs(tmp_path):
    where = tmp_path / "results"
    add_runs(where, FLAT)
    res = lab_cli("prune", "--keep", "2", "--dry-run", "--results", str(where))
    assert res.returncode == 0 and "would remove 4 run(s) (24 samples), kept the newest 2" in res.stdout
    assert len(Store(where).runs()) == 6
    res = lab_cli("prune", "--keep", "2", "--results", str(where))
    assert res.returncode == 0 and "removed 4 run(s) (24 samples)" in res.stdout and "r0, r1, r2, r3" in res.stdout
    store = Store(where)
    assert [r.id for r in store.runs()] == ["r4", "r5"]
    for table in ("cells", "samples", "raw_outputs", "executions", "stage_times", "run_hosts"):
        left = {r[0] for r in store.db.execute(f"SELECT DISTINCT run_id FROM {table}")}
        assert left == {"r4", "r5"}, table
    assert lab_cli("prune", "--keep", "0", "--results", str(where)).returncode == 2


def test_prune_keeps_a_run_that_still_holds_a_lease(tmp_path):
    where = tmp_path / "results"
    add_runs(where, FLAT[:3])
    store = Store(where)
    store.add_lease("r0", "c01", "local", "local", "lab-r0-c01", 0.0)
    res = lab_cli("prune", "--keep", "1", "--results", str(where))
    assert res.returncode == 0 and "removed 1 run(s)" in res.stdout and "holding a lease" in res.stdout
    assert [r.id for r in Store(where).runs()] == ["r0", "r2"]


# -- lab run --quiet (the fake backend) ---------------------------------------------------------------


def test_lab_run_quiet_is_silent_until_a_run_makes_its_series_worse(fake_lab, monkeypatch):
    """Six nightly runs from cron: nothing printed while the host is as it was; from the 4th run on
    the host's kernel is another and the work 30 % slower, and the 6th run (the third after the
    change: the first a change can be told at) says so in one line naming the fact."""
    import fakes.backend as fake_backend

    path = fake_lab.write(suite="repetitions = 3\n[suite.params.fake-work]\nvalues = [1000.0, 1004.0, 998.0]\n")
    run = fake_lab.workload.run
    for night in range(6):
        if night == 3:
            monkeypatch.setattr(
                fake_backend.FakeBackend, "host_facts", lambda self: {"cpu_model": "Fake CPU", "kernel": "6.12-fake"}
            )

            def slower(ctx, repetition):
                raw = run(ctx, repetition)
                value = float(raw.stdout.strip().removeprefix("value="))
                return type(raw)(**{**raw.__dict__, "stdout": f"value={value * 0.7}\n"})

            monkeypatch.setattr(fake_lab.workload, "run", slower)
        res = lab_cli("run", "-c", str(path), "--quiet", cwd=fake_lab.dir)
        assert res.returncode == 0, res.stderr
        assert res.stdout == ""
        if night < 5:
            assert res.stderr == "", (night, res.stderr)
    assert res.stderr.strip().splitlines() == [
        line for line in res.stderr.strip().splitlines() if line.startswith("regression: host f, cell f/")
    ]
    assert len(res.stderr.strip().splitlines()) == 1
    assert "fake-work ops_per_s: -30.0 %" in res.stderr and "changed: kernel 6.1.0-fake -> 6.12-fake" in res.stderr
    assert os.path.exists(fake_lab.dir / "results" / "lab.db")
