"""The application workloads for real: one `lab run` on the Debian golden image with all five and
tiny parameters (one VM shared by every assertion), including git-clone on the guest, in a container
on podman's default network and with --network=host (both rows), podman-build step by step and
container-start with podman and with docker (the image has both), and `lab reparse` of what it stored.
The studies' own labs, run small, are `make test-studies` (test_studies_vm.py)."""

from __future__ import annotations

import pytest
from support.cli import run_lab_cli
from support.local import leftovers, write_lab

from lab.store import Store

pytestmark = [pytest.mark.vm, pytest.mark.image]

SUITE = """
workloads = ["git-clone", "podman-build", "container-start", "scp", "bulk-http"]
repetitions = 1
warmup = 0
[suite.params.git-clone]
files = 120
file_kib = 16
commits = 2
network = ["guest", "default", "host"]
[suite.params.podman-build]
files = 120
file_kib = 16
commits = 2
network = ["host"]
[suite.params.container-start]
engines = ["podman", "docker"]
runtime = ["crun", "runc"]
network = ["default", "none"]
runs = 1
warmup = 0
[suite.params.scp]
size_mib = 8
[suite.params.bulk-http]
count = 1
"""


def test_application_workloads_on_the_debian_image(golden, workdir, tmp_path):
    cfg = write_lab(tmp_path, workdir, matrix='nic = ["virtio"]\n', suite=SUITE)
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

    build = by["podman-build"]
    steps = ("from", "packages", "clone", "make", "install", "copy", "extra", "commit")
    for engine in ("podman", "docker"):  # the same Containerfile, both engines of the image, no n/a
        tag = f"{engine}-host"
        assert all(build[f"{s}_seconds_{tag}"].value >= 0 for s in steps), engine
        assert build[f"build_seconds_{tag}"].value >= sum(build[f"{s}_seconds_{tag}"].value for s in steps[1:])
        assert build[f"make_seconds_{tag}"].value > 0 and f"na_{tag}" not in build, engine
    for e in ("podman", "docker"):  # the figures, for the record (-s)
        print(
            f"{e} build per step (s):", {s: round(build[f"{s}_seconds_{e}-host"].value, 1) for s in (*steps, "build")}
        )

    start = by["container-start"]
    for rt in ("crun", "runc"):
        for net in ("default", "none"):
            assert start[f"start_ms_{rt}-{net}-persistent"].value > 0
            assert start[f"start_ms_{rt}-{net}-persistent"].labels["runtime_version"].startswith(f"{rt} version")
            assert "--transient-store" in start[f"na_{rt}-{net}-transient"].labels["na"]  # podman 4.3.1
            # docker starts the same image from its own store, with the same runtime (crun registered)
            d = start[f"start_ms_{rt}-{net}-docker"]
            assert d.value > 0 and d.labels["engine"] == "docker" and d.labels["runtime"] == rt, d.labels
            assert f"na_{rt}-{net}-docker" not in start

    assert by["scp"]["throughput_mb_s_tx"].value > 0 and by["scp"]["throughput_mb_s_rx"].value > 0
    assert by["bulk-http"]["download_mb_s_guest-http"].value > 0
    for wl in ("git-clone", "podman-build", "container-start", "scp", "bulk-http"):
        assert "cpu_busy_pct" in by[wl], wl

    before = len(store.samples(run.id))
    rep = run_lab_cli("reparse", run.id, "-c", str(cfg))
    assert rep.returncode == 0 and f"{before} samples rebuilt" in rep.stdout
    show = run_lab_cli("show", run.id, "-c", str(cfg))
    assert "clone_seconds_default" in show.stdout and "clone_seconds_host" in show.stdout
    assert store.open_leases() == [] and leftovers(workdir, run.id) == []
