"""Two slots on the local backend for real: two QEMU guests of the golden image up at once in the
run's namespace (each its own tap, address and MAC), both measured, nothing left."""

from __future__ import annotations

import pytest
from support.cli import run_lab_cli
from support.local import leftovers, write_lab
from test_lanes_vm import two_cells_at_once

from lab.store import Store

pytestmark = [pytest.mark.vm, pytest.mark.image]


def test_two_slots_boot_two_local_guests_at_once(golden, workdir, tmp_path):
    cfg = write_lab(
        tmp_path,
        workdir,
        extra="slots = 2\n",
        # warm: restores of the tests' shared snapshots (two machines up at once is what is tested)
        matrix='nic = ["virtio", "e1000"]\nstart = ["warm"]\n',
        suite='workloads = ["idle"]\nrepetitions = 2\nwarmup = 0\nquiet_host = "record"\n'
        "[suite.params.idle]\nduration = 3\n",
    )
    plan = run_lab_cli("plan", "-c", str(cfg), cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "lane local: 2 cells, 2 at a time" in " ".join(plan.stdout.split())
    res = run_lab_cli("run", "-c", str(cfg), cwd=tmp_path, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    run = two_cells_at_once(tmp_path / "results", {"local": ["c01"], "local/2": ["c02"]}, "slots")
    store = Store(tmp_path / "results")
    facts = {c.cell_id: c.facts for c in store.cells(run.id)}
    assert facts["c01"]["verified"]["nic_driver"] == "virtio_net"
    assert facts["c02"]["verified"]["nic_driver"] == "e1000"
    assert facts["c01"]["start"] == facts["c02"]["start"] == "warm"
    busy = {(s.cell_id, s.metric) for s in store.samples(run.id)}
    assert {("c01", "cpu_busy_pct"), ("c02", "cpu_busy_pct")} <= busy
    assert leftovers(workdir, run.id) == []
