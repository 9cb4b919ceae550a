"""`lab import STORE` (lab.storeimport): nightly stores of two orchestrators merged into one,
without losing or duplicating a sample, importing again changes nothing, ids that collide are
renamed, an older store is read without being written, a newer one and the store itself refused."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3

import pytest
from support.cli import lab_cli
from support.seriesstore import FACTS, add_runs
from test_history import STEP, _downgrade, _state

from lab import storeimport
from lab.store import Store
from lab.storeschema import MIGRATIONS

TWO = {**FACTS, "machine_id": "m-two"}


def content(where) -> dict[str, list]:
    """Every run's stored content by run uid, without what is numbered per store (row ids, the
    run's id here, host-facts ids): what must be the same in every store a run is in."""
    store = Store(where, readonly=True)
    ids = dict(store.db.execute("SELECT id, uid FROM runs").fetchall())
    fps = {r[0]: r[1] for r in store.db.execute("SELECT id, fingerprint FROM host_facts")}
    out: dict[str, list] = {}
    for rid, uid in ids.items():
        run = store.db.execute(
            "SELECT name, started_at, finished_at, status, config_text, seed, lab_version, manifest FROM runs"
            " WHERE id = ?",
            (rid,),
        ).fetchone()
        samples = []
        for s in store.db.execute(
            "SELECT s.cell_id, s.workload, s.metric, s.value, s.unit, s.higher_is_better, s.repetition, s.labels,"
            " r.stdout FROM samples s LEFT JOIN raw_outputs r ON r.id = s.raw_id WHERE s.run_id = ? ORDER BY s.id",
            (rid,),
        ):
            labels = json.loads(s[7])
            labels["host_facts_id"] = fps.get(labels.get("host_facts_id"))  # as the fingerprint it stands for
            samples.append((*s[:7], json.dumps(labels, sort_keys=True), s[8]))
        cells = store.db.execute("SELECT cell_id, idx, label, axes, status, facts FROM cells WHERE run_id = ?", (rid,))
        execs = store.db.execute(
            "SELECT e.cell_id, e.workload, e.repetition, e.outcome, r.stdout FROM executions e"
            " LEFT JOIN raw_outputs r ON r.id = e.raw_id WHERE e.run_id = ? ORDER BY e.id",
            (rid,),
        )
        hosts = store.db.execute(
            "SELECT rh.host, hf.fingerprint, hf.facts FROM run_hosts rh JOIN host_facts hf ON hf.id = rh.host_facts_id"
            " WHERE rh.run_id = ?",
            (rid,),
        )
        stages = store.db.execute("SELECT cell_id, stage, seconds FROM stage_times WHERE run_id = ?", (rid,))
        out[uid] = [run, samples, cells.fetchall(), execs.fetchall(), hosts.fetchall(), stages.fetchall()]
    store.close()
    return out


def digest(where) -> str:
    """Everything in the store, as bytes of its rows (row ids included): equal means nothing changed."""
    con = sqlite3.connect(where / "lab.db")
    tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    h = hashlib.sha256()
    for t in tables:
        for row in con.execute(f"SELECT * FROM {t} ORDER BY rowid"):
            h.update(repr(row).encode())
    con.close()
    return h.hexdigest()


@pytest.fixture
def two_orchestrators(tmp_path):
    """Orchestrator A's nightly store (runs r0-r5 of its local host) and B's (r0-r5 too: the ids
    collide, the runs are others, measured on another machine)."""
    a, b = tmp_path / "a" / "results", tmp_path / "b" / "results"
    add_runs(a, STEP)
    add_runs(b, [800.0, 801.0, 799.0, 800.5, 799.5, 800.0], facts=[TWO] * 6)
    store = Store(b)
    store.add_lease("r5", "c01", "local", "local", "lab-r5-c01", 0.0)  # B's VM: never A's to collect
    store.close()
    return a, b


def test_two_stores_merge_without_losing_or_duplicating_a_sample(two_orchestrators):
    a, b = two_orchestrators
    before_a, before_b = content(a), content(b)
    source_state = _state(b)
    res = lab_cli("import", str(b), "--results", str(a))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == f"imported 6 run(s) (36 samples) from {b} into {a / 'lab.db'}"
    assert "  run r0 is r0-" in res.stdout  # every id was taken: renamed, said so
    merged = content(a)
    assert merged == {**before_a, **before_b}  # every run of both, each sample once, as it was
    assert _state(b) == source_state  # the source is only read
    store = Store(a, readonly=True)
    assert store.db.execute("SELECT count(*) FROM samples").fetchone()[0] == 72
    assert store.db.execute("SELECT count(DISTINCT id) FROM runs").fetchone()[0] == 12
    assert store.open_leases() == []  # B's leases stay B's
    renamed = dict(store.db.execute("SELECT id, origin_id FROM runs WHERE id != origin_id").fetchall())
    assert sorted(renamed.values()) == [f"r{i}" for i in range(6)]
    origins = {r[0] for r in store.db.execute("SELECT origin FROM runs")}
    assert len(origins) == 2  # measured into two stores
    # the merged store's history keeps the two machines' `local` hosts apart
    doc = json.loads(lab_cli("history", "--results", str(a), "--json").stdout)
    assert sorted(s["machine"] for s in doc["series"]) == ["m-one", "m-two"]
    assert {len(s["runs"]) for s in doc["series"]} == {6}


def test_importing_again_changes_nothing(two_orchestrators):
    a, b = two_orchestrators
    assert lab_cli("import", str(b), "--results", str(a)).returncode == 0
    once = digest(a)
    res = lab_cli("import", str(b / "lab.db"), "--results", str(a), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "lab.import/1" and doc["added"] == [] and doc["already_here"] == 6 and doc["samples"] == 0
    assert digest(a) == once
    # and back the other way: A's runs go to B, B's own (already there) stay
    res = lab_cli("import", str(a), "--results", str(b), "--json")
    doc = json.loads(res.stdout)
    assert len(doc["added"]) == 6 and doc["already_here"] == 6
    assert content(b) == content(a)


def test_a_run_still_running_there_is_skipped_then_brought_in(two_orchestrators):
    a, b = two_orchestrators
    con = sqlite3.connect(b / "lab.db")
    con.execute("UPDATE runs SET status = 'running', finished_at = NULL WHERE id = 'r5'")
    con.commit()
    con.close()
    res = lab_cli("import", str(b), "--results", str(a))
    assert "imported 5 run(s)" in res.stdout and "still running there (import again once they end): r5" in res.stdout
    con = sqlite3.connect(b / "lab.db")
    con.execute("UPDATE runs SET status = 'done', finished_at = 2e9 WHERE id = 'r5'")
    con.commit()
    con.close()
    doc = json.loads(lab_cli("import", str(b), "--results", str(a), "--json").stdout)
    assert len(doc["added"]) == 1 and doc["already_here"] == 5


def test_a_copy_that_ended_there_since_replaces_the_unfinished_one(two_orchestrators):
    a, b = two_orchestrators
    con = sqlite3.connect(b / "lab.db")
    con.execute("UPDATE runs SET status = 'failed', finished_at = 1e9 WHERE id = 'r5'")
    con.commit()
    assert lab_cli("import", str(b), "--results", str(a)).returncode == 0
    con.execute("UPDATE runs SET status = 'done', finished_at = 2e9 WHERE id = 'r5'")  # resumed and done there
    con.commit()
    con.close()
    doc = json.loads(lab_cli("import", str(b), "--results", str(a), "--json").stdout)
    assert len(doc["replaced"]) == 1 and doc["added"] == [] and doc["samples"] == 6
    merged = content(a)
    assert len(merged) == 12 and all(merged[uid] == runs for uid, runs in content(b).items())


def test_an_older_store_is_imported_without_being_written(tmp_path, two_orchestrators):
    a, b = two_orchestrators
    _downgrade(b / "lab.db")
    twin = tmp_path / "twin" / "results"
    shutil.copytree(b, twin)  # the same store copied elsewhere before either was migrated
    before = _state(b)
    assert lab_cli("import", str(b), "--results", str(a)).returncode == 0
    assert _state(b) == before
    assert sqlite3.connect(b / "lab.db").execute("PRAGMA user_version").fetchone()[0] == 3
    Store(twin).close()  # the copy is migrated where it is (a `lab run` there would)
    doc = json.loads(lab_cli("import", str(twin), "--results", str(a), "--json").stdout)
    assert doc["added"] == [] and doc["already_here"] == 6  # its runs' uids are derived, not drawn: the same


def test_the_store_itself_and_a_newer_one_are_refused(two_orchestrators):
    a, b = two_orchestrators
    res = lab_cli("import", str(a), "--results", str(a))
    assert (
        res.returncode == 2 and res.stderr.strip() == f"lab: error: {a} is this results store itself: nothing to import"
    )
    con = sqlite3.connect(b / "lab.db")
    con.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    con.close()
    before = digest(a)
    res = lab_cli("import", str(b), "--results", str(a))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "newer than this lab" in res.stderr
    res = lab_cli("import", str(a.parent / "nothing"), "--results", str(a))
    assert res.returncode == 2 and "not a results store (no lab.db" in res.stderr
    assert digest(a) == before


def test_into_a_new_results_directory(tmp_path, two_orchestrators):
    _, b = two_orchestrators
    fresh = tmp_path / "merged"
    res = lab_cli("import", str(b), "--results", str(fresh))
    assert res.returncode == 0 and "imported 6 run(s)" in res.stdout
    assert content(fresh) == content(b)
    assert fresh.stat().st_mode & 0o777 == 0o700  # made as `lab run` makes one ([lab] results_mode)
    assert storeimport.import_store(Store(fresh), Store(b, readonly=True)).present == 6
