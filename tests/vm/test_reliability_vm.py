"""Reliability on real VMs: a run killed with SIGKILL resumes only its unfinished cells; two labs at
once do not collide. Their machines are warm starts (restores of the suite's shared snapshots,
tests/support/local.py): what is tested is the run's bookkeeping, not a boot."""

from __future__ import annotations

import signal
import subprocess

import pytest
from support.cli import LAB, run_lab_cli
from support.local import leftovers, write_lab

from lab.store import Store
from lab.wait import wait_until

SUITE = """
workloads = ["sysbench-cpu"]
repetitions = 3
warmup = 0
[suite.params.sysbench-cpu]
time = 1
threads = [1]
"""


@pytest.mark.vm
@pytest.mark.image
def test_resume_after_kill_9_reruns_only_unfinished_cells(golden, workdir, tmp_path):
    cfg = write_lab(tmp_path, workdir, matrix='nic = ["virtio", "e1000"]\nstart = ["warm"]\n', suite=SUITE)
    p = subprocess.Popen(
        [*LAB, "run", "-c", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    results = tmp_path / "results"

    def c02_started():
        if not (results / "lab.db").exists():
            return None
        s = Store(results)
        try:
            runs = s.runs()
            if runs and [c.status for c in s.cells(runs[0].id)] == ["done", "running"]:
                return runs[0].id
            return None
        finally:
            s.close()

    try:
        run_id = wait_until(c02_started, timeout=600, what="cell c02 to start", interval=0.5)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    store = Store(results)
    before = [(s.cell_id, s.metric, s.repetition, s.value) for s in store.samples(run_id) if s.cell_id == "c01"]
    assert before
    res = run_lab_cli("run", "-c", str(cfg), "--resume", run_id, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "swept a leftover" in res.stderr  # the killed run's VM and namespace
    cells = store.cells(run_id)
    assert [c.status for c in cells] == ["done", "done"]
    after = [(s.cell_id, s.metric, s.repetition, s.value) for s in store.samples(run_id) if s.cell_id == "c01"]
    assert after == before, "a finished cell must not be run again"
    assert {s.repetition for s in store.samples(run_id) if s.cell_id == "c02"} == {0, 1, 2}
    assert store.run(run_id).status == "done"
    assert store.open_leases() == [] or all(lease["run_id"] != run_id for lease in store.open_leases())
    assert leftovers(workdir, run_id) == []


@pytest.mark.vm
@pytest.mark.image
def test_two_labs_at_once_do_not_collide(golden, workdir, tmp_path):
    # the serial history test's shape (1 vCPU, 512 MiB): its snapshot is made here, in the parallel
    # pass, by one of the two runs while the other waits for it, and the serial pass only restores it
    matrix = 'nic = ["virtio"]\nvcpus = [1]\nmemory_mib = [512]\nstart = ["warm"]\n'
    cfg = write_lab(tmp_path, workdir, matrix=matrix, suite=SUITE)
    procs = [
        subprocess.Popen([*LAB, "run", "-c", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    errs = [p.communicate(timeout=900)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    store = Store(tmp_path / "results")
    runs = store.runs()
    assert len(runs) == 2 and {r.status for r in runs} == {"done"}
    for r in runs:
        assert len(store.samples(r.id)) > 0
        assert leftovers(workdir, r.id) == []
