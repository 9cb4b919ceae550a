"""The results store: schema migrations, round trips, and survival of a kill -9 mid-write."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

from lab.model import RawOutput, Sample
from lab.store import MIGRATIONS, Store


def test_migrations_applied_once(tmp_path):
    s = Store(tmp_path)
    assert s.schema_version == len(MIGRATIONS)
    s.close()
    s = Store(tmp_path)  # reopening does not re-run migrations
    assert s.schema_version == len(MIGRATIONS)
    mode = s.db.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_round_trip_run_cells_raw_samples(tmp_path):
    s = Store(tmp_path)
    s.create_run("r1", "t", config_path="lab.toml", config_text="x", seed=7, lab_version="0", manifest={"a": 1})
    s.add_cell("r1", "c01", 1, "local/debian12/virtio", {"nic": "virtio"})
    lease = s.add_lease("r1", "c01", "local", "local", "lab-r1-c01", time.time() + 60)
    assert [lease["vm_name"] for lease in s.open_leases()] == ["lab-r1-c01"]
    raw = RawOutput("sysbench-cpu", "sysbench cpu run", "events per second: 100.5", params={"time": 1})
    rid = s.add_raw("r1", "c01", 0, raw)
    s.add_samples(
        "r1", "c01", rid, "sysbench-cpu", 0, [Sample("events_per_s", 100.5, "events/s", True, {"nic": "virtio"})]
    )
    s.release_lease(lease)
    s.cell_update("r1", "c01", status="done", stage="workloads", facts={"accel": "tcg"}, finished=True)
    s.finish_run("r1", "done")
    assert s.open_leases() == []
    run = s.run("r")  # unique prefix
    assert run.status == "done" and run.seed == 7 and run.manifest == {"a": 1}
    (cell,) = s.cells("r1")
    assert cell.status == "done" and cell.facts == {"accel": "tcg"}
    (sample,) = s.samples("r1")
    assert (sample.metric, sample.value, sample.higher_is_better, sample.labels) == (
        "events_per_s",
        100.5,
        True,
        {"nic": "virtio"},
    )
    ((_, cell_id, rep, back),) = list(s.raw_outputs("r1"))
    assert back.stdout == raw.stdout and back.params == {"time": 1} and rep == 0


def test_kill_9_mid_write_keeps_every_committed_sample(tmp_path):
    writer = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(__import__("lab").PROJECT_ROOT)!r})
        from lab.store import Store
        from lab.model import Sample
        s = Store(__import__('pathlib').Path({str(tmp_path)!r}))
        s.create_run("r1", "t", config_path="", config_text="", seed=1, lab_version="0", manifest={{}})
        s.add_cell("r1", "c01", 1, "x", {{}})
        i = 0
        while True:
            s.add_samples("r1", "c01", None, "w", i, [Sample("m", float(i), "u", True, {{}})] * 5)
            print(i, flush=True)
            i += 1
    """)
    p = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    acked = -1
    for line in p.stdout:
        acked = int(line)
        if acked >= 200:
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    p.stdout.close()
    s = Store(tmp_path)
    samples = s.samples("r1")
    reps = {x.repetition for x in samples}
    # Every acknowledged repetition is there, complete (5 samples each): nothing half-written.
    assert set(range(acked + 1)) <= reps
    counts = {}
    for x in samples:
        counts[x.repetition] = counts.get(x.repetition, 0) + 1
    assert set(counts.values()) == {5}
    assert sqlite3.connect(s.path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_two_processes_opening_a_new_store_at_once_both_get_it(tmp_path):
    """`lab show` polling while `lab run` creates the store: one migrates, the other waits for it
    and finds the schema in place (it used to fail with "table runs already exists")."""
    import subprocess
    import sys
    import time

    opener = (
        "import sys, time\nfrom lab.store import Store\n"
        "while time.time() < float(sys.argv[2]): pass\n"  # start together
        "Store(__import__('pathlib').Path(sys.argv[1])).runs()\n"
    )
    for attempt in range(5):
        where = tmp_path / f"r{attempt}"
        start = time.time() + 1.0
        procs = [
            subprocess.Popen([sys.executable, "-c", opener, str(where), str(start)], stderr=subprocess.PIPE, text=True)
            for _ in range(4)
        ]
        for p in procs:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
