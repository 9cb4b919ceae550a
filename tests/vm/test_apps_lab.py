"""The application workloads for real: one `lab run` on the Debian golden image with git-clone (on
the guest, in a container on podman's default network and with --network=host: all three rows), scp
and bulk-http, tiny parameters (one VM shared by every assertion), and `lab reparse` of what it
stored. The machine is a warm start (a restore of the suite's shared snapshot, tests/support/local.py).
podman-build (both engines, step by step) and container-start (both engines and runtimes) are the
build and start studies' small runs (test_studies_vm.py), and in a docker cell test_isolation_vm.py's."""

from __future__ import annotations

import pytest
from support.cli import run_lab_cli
from support.local import leftovers, write_lab

from lab.store import Store

pytestmark = [pytest.mark.vm, pytest.mark.image]

SUITE = """
workloads = ["git-clone", "scp", "bulk-http"]
repetitions = 1
warmup = 0
[suite.params.git-clone]
files = 120
file_kib = 16
commits = 2
network = ["guest", "default", "host"]
[suite.params.scp]
size_mib = 8
[suite.params.bulk-http]
count = 1
"""


def test_application_workloads_on_the_debian_image(golden, workdir, tmp_path):
    cfg = write_lab(tmp_path, workdir, matrix='nic = ["virtio"]\nstart = ["warm"]\n', suite=SUITE)
    res = run_lab_cli("run", "-c", str(cfg), timeout=1500)
    assert res.returncode == 0, res.stderr[-3000:]
    store = Store(tmp_path / "results")
    (run,) = store.runs()
    (cell,) = store.cells(run.id)
    assert cell.status == "done", cell.error
    by = {}
    for s in store.samples(run.id):
        by.setdefault(s.workload, {})[s.metric] = s

    clone = by["git-clone"]
    for place in ("guest", "default", "host"):  # the container network vs --network=host: both rows
        assert clone[f"clone_seconds_{place}"].value > 0
        assert clone[f"clone_mb_s_{place}"].value > 0
        assert 0 < clone[f"cpu_busy_pct_{place}"].value <= 100
    assert clone["clone_seconds_default"].labels["engine"] == "podman"
    assert clone["clone_seconds_host"].labels["network"] == "host"
    assert (
        clone["clone_seconds_guest"].labels["repetition"] == 0 and "image_digest" in clone["clone_seconds_guest"].labels
    )

    assert by["scp"]["throughput_mb_s_tx"].value > 0 and by["scp"]["throughput_mb_s_rx"].value > 0
    assert by["bulk-http"]["download_mb_s_guest-http"].value > 0
    for wl in ("git-clone", "scp", "bulk-http"):
        assert "cpu_busy_pct" in by[wl], wl

    before = len(store.samples(run.id))
    rep = run_lab_cli("reparse", run.id, "-c", str(cfg))
    assert rep.returncode == 0 and f"{before} samples rebuilt" in rep.stdout
    show = run_lab_cli("show", run.id, "-c", str(cfg))
    assert "clone_seconds_default" in show.stdout and "clone_seconds_host" in show.stdout
    assert store.open_leases() == [] and leftovers(workdir, run.id) == []
