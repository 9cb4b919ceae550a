"""Crash safety of the results store, without VMs: a process writing samples the way the runner
does (raw output, then the repetition's samples in one transaction, then the execution marked ok,
then "ok N" printed: reported as completed) is killed with SIGKILL at random moments, many times,
on one store. After every kill the store must open, pass `PRAGMA integrity_check`, hold every
repetition the writer reported, and hold no repetition half-written. A full disk and a reparse
killed half-way are checked too."""

from __future__ import annotations

import os
import random
import re
import select
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from lab import runner, workloads
from lab.errors import LabError
from lab.model import RawOutput, Sample
from lab.store import Store, StoreError

METRICS = 6
WRITER = f"""
import sys
from lab.store import Store
from lab.model import RawOutput, Sample
store = Store(sys.argv[1])
run = sys.argv[2]
if not store.runs():
    store.create_run(run, "crash", config_path="", config_text="", seed=1, lab_version="0", manifest={{}})
    store.add_cell(run, "c01", 1, "c01", {{}})
rep = store.db.execute("SELECT COALESCE(MAX(repetition) + 1, 0) FROM raw_outputs").fetchone()[0]
while True:
    eid = store.timings.start_execution(run, "c01", 1, "sysbench-cpu", rep)
    raw_id = store.add_raw(run, "c01", rep, RawOutput("sysbench-cpu", "sysbench", "x" * 4000))
    store.add_samples(run, "c01", raw_id, "sysbench-cpu", rep,
                      [Sample(f"m{{i}}", rep + i / 10, "1/s", True, {{"repetition": rep}}) for i in range({METRICS})])
    store.timings.finish_execution(eid, "ok", raw_id=raw_id)
    sys.stdout.write(f"ok {{rep}}\\n")
    sys.stdout.flush()
    rep += 1
"""


def check_store(path, reported: set[int]) -> dict[int, int]:
    """Integrity, every reported repetition complete, none partial. Returns samples per repetition."""
    db = sqlite3.connect(path / Store.FILENAME)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        # a writer killed before its first Store() finished leaves an empty file (the next one migrates it)
        migrated = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'samples'").fetchone()
        per_rep = dict(
            db.execute("SELECT repetition, COUNT(*) FROM samples GROUP BY repetition").fetchall() if migrated else []
        )
    finally:
        db.close()
    missing = sorted(r for r in reported if per_rep.get(r) != METRICS)
    assert not missing, f"reported as completed but not (fully) stored: {missing}"
    partial = {r: n for r, n in per_rep.items() if n != METRICS}
    assert not partial, f"half-written repetitions: {partial}"
    return per_rep


def test_kill_9_at_random_moments_loses_no_completed_sample(tmp_path):
    rng = random.Random(int(os.environ.get("LAB_CRASH_SEED", "7")))
    reported: set[int] = set()
    kills = 30
    for _ in range(kills):
        p = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), "crashrun"], stdout=subprocess.PIPE, text=True
        )
        # A fifth of the kills land at random in startup (before any write, or in the migration);
        # the rest at a random moment after the first repetition was reported, so a busy machine
        # (startup is ~0.12 s idle, seconds beside VMs) still has the writer write.
        first = ""
        if rng.random() >= 0.2:
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], 60)
            first = p.stdout.readline() if ready else ""
        time.sleep(rng.uniform(0.0, 0.35))
        p.send_signal(signal.SIGKILL)
        rest, _ = p.communicate(timeout=30)
        out = first + rest
        assert p.returncode == -signal.SIGKILL
        # only whole lines count: a kill can cut the last one short
        reported |= {int(m) for m in re.findall(r"^ok (\d+)\n", out, re.M)}
        check_store(tmp_path, reported)
    per_rep = check_store(tmp_path, reported)
    assert len(reported) > kills, "the writer hardly wrote: the test proves nothing"
    store = Store(tmp_path)  # and the lab itself reads it
    assert len(store.samples("crashrun")) == METRICS * len(per_rep)
    assert store.run("crashrun").status == "running"  # killed, never finished


def test_full_disk_is_a_store_error_and_keeps_what_was_committed(tmp_path):
    store = Store(tmp_path)
    store.create_run("r", "t", config_path="", config_text="", seed=1, lab_version="0", manifest={})
    store.add_samples("r", "c01", None, "w", 0, [Sample("m", 1.0, "u", True)])
    store.db.execute(f"PRAGMA max_page_count = {int(store.db.execute('PRAGMA page_count').fetchone()[0])}")
    with pytest.raises(StoreError, match=r"lab\.db: database or disk is full"):
        store.add_raw("r", "c01", 1, RawOutput("w", "cmd", "y" * 200_000))
    with pytest.raises(StoreError, match="full"):
        store.add_samples("r", "c01", None, "w", 1, [Sample("m", float(i), "u", True) for i in range(5000)])
    assert isinstance(StoreError("x"), LabError)
    assert [s.value for s in store.samples("r")] == [1.0]
    assert store.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_reparse_replaces_samples_in_one_transaction(tmp_path, monkeypatch):
    store = Store(tmp_path)
    store.create_run("r", "t", config_path="", config_text="", seed=1, lab_version="0", manifest={})
    store.add_cell("r", "c01", 1, "c01", {})

    class Parser:  # the parser is not what is tested here: the swap of old for new samples is
        @staticmethod
        def parse(raw):
            return [Sample("new", float(len(raw.stdout)), "u", True), Sample("new2", 2.0, "u", True)]

    monkeypatch.setattr(workloads, "names", lambda: ["w"])
    monkeypatch.setattr(workloads, "get", lambda name: Parser)
    for rep in range(3):
        raw_id = store.add_raw("r", "c01", rep, RawOutput("w", "cmd", "out" * (rep + 1)))
        store.add_samples("r", "c01", raw_id, "w", rep, [Sample("old", 1.0, "u", True)])
    before = len(store.samples("r"))

    from lab import store as store_mod

    real, calls = store_mod._sample_rows, []

    def fails_on_second(*args):  # the disk fills half-way through the new samples
        calls.append(1)
        if len(calls) == 2:
            raise StoreError("results store: database or disk is full")
        return real(*args)

    monkeypatch.setattr(store_mod, "_sample_rows", fails_on_second)
    with pytest.raises(StoreError):
        runner.reparse(store, "r")
    assert [s.metric for s in store.samples("r")] == ["old"] * before, "a failed reparse must leave the old samples"
    monkeypatch.setattr(store_mod, "_sample_rows", real)
    assert runner.reparse(store, "r") == 6
    assert sorted({s.metric for s in store.samples("r")}) == ["new", "new2"]
