"""The isolation axis on the real bare-metal cell (no VM): with isolation = ["vm", "container"]
the host gets two cells, the host itself (bm01) and a container on it (bm02). This machine has
no podman: bm02 is n/a with that reason and no sample, bm01 measures, nothing is left."""

from __future__ import annotations

import os
import shutil

import pytest
from support.cli import run_lab_cli
from support.local import leftovers, write_lab

from lab.store import Store

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the bare-metal cell needs root (namespaces, cgroups)")

MATRIX = 'isolation = ["vm", "container"]\nexclude = [{ isolation = "vm" }, { isolation = "container" }]\n'
SUITE = """
workloads = ["sysbench-cpu"]
repetitions = 1
warmup = 0
bare_metal = true
quiet_host = "off"
[suite.params.sysbench-cpu]
time = 1
threads = [1]
"""


@pytest.mark.skipif(shutil.which("podman") is not None, reason="this host has podman: bm02 would run")
def test_a_host_without_podman_has_an_na_container_cell(workdir, tmp_path):
    cfg = write_lab(tmp_path, workdir, matrix=MATRIX, suite=SUITE)
    res = run_lab_cli("run", "-c", str(cfg), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    store = Store(tmp_path / "results")
    (run,) = store.runs()
    cells = {c.cell_id: c for c in store.cells(run.id)}
    assert {k: (c.label, c.status) for k, c in cells.items()} == {
        "bm01": ("local/bare-metal", "done"),
        "bm02": ("local/bare-metal/isolation=container", "n/a"),
    }
    assert cells["bm02"].error == "isolation container: podman is not installed on this host"
    assert {s.cell_id for s in store.samples(run.id)} == {"bm01"}
    assert leftovers(workdir, run.id) == []
