"""The isolation axis on a real guest: a short `lab run` on the local backend with isolation =
["vm", "container"]. The container cell's workloads ran inside a Podman container in the guest
(the wrapper's facts: podman's own id and state, /run/.containerenv seen by a command sent through
it, every sample labelled with that container), nginx served the http load from inside it, and
nothing is left: the container removed before the VM, the VM, its namespace and files gone."""

from __future__ import annotations

import pytest
from conftest import leftovers, run_lab_cli, write_lab

from lab.store import Store

pytestmark = [pytest.mark.vm, pytest.mark.image]

SUITE = """
workloads = ["sysbench-cpu", "http"]
repetitions = 2
warmup = 0
[suite.params.sysbench-cpu]
time = 2
threads = [1]
[suite.params.http]
duration = 2
connections = [10]
"""


@pytest.mark.serial
@pytest.mark.timeout(1200)
def test_vm_and_container_in_vm(golden, workdir, tmp_path):
    cfg = write_lab(tmp_path, workdir, matrix='isolation = ["vm", "container"]\n', suite=SUITE)
    res = run_lab_cli("run", "-c", str(cfg), timeout=1100)
    assert res.returncode == 0, res.stderr[-3000:]
    store = Store(tmp_path / "results")
    (run,) = store.runs()
    cells = {c.cell_id: c for c in store.cells(run.id)}
    assert {k: c.status for k, c in cells.items()} == {"c01": "done", "c02": "done"}, {
        k: c.error for k, c in cells.items()
    }
    assert "isolation" not in cells["c01"].facts
    box = cells["c02"].facts["isolation"]
    assert box["kind"] == "container" and box["runtime"] == "podman" and box["image"] == "localhost/lab-base:latest"
    assert box["state"] == "running" and box["pid"] > 0 and len(box["id"]) == 64 and box["network"] == "host"
    assert box["inside"] == "/run/.containerenv present" and box["nginx"] == "in the container"
    assert box["binds"] == ["/usr", "/etc/nginx", "/srv/www"] and box["podman"].startswith("podman version")
    # every repetition's commands entered it (sysbench: one load each; http: its prepare) and it was removed
    assert box["execs"] >= 3 and box["removed"] is True
    samples = store.samples(run.id)
    mine = [s for s in samples if s.cell_id == "c02"]
    assert {s.workload for s in mine} == {"sysbench-cpu", "http"}
    assert {s.labels.get("container") for s in mine} == {box["id"][:12]}
    assert not [s for s in samples if s.cell_id == "c01" and "container" in s.labels]
    for cid in ("c01", "c02"):
        got = {(s.workload, s.metric) for s in samples if s.cell_id == cid}
        assert {
            ("sysbench-cpu", "events_per_s_1t"),
            ("sysbench-cpu", "cpu_busy_pct"),
            ("http", "requests_per_s_c10"),
            ("http", "cpu_busy_pct"),
        } <= got, (cid, sorted(got))
    cmp = run_lab_cli("compare", run.id, "--a", "isolation=vm", "--b", "isolation=container", "-c", str(cfg))
    assert cmp.returncode == 0, cmp.stderr
    assert "events_per_s_1t" in cmp.stdout and "requests_per_s_c10" in cmp.stdout
    assert leftovers(workdir, run.id) == []
