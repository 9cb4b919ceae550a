"""The studies' own labs (examples/study-*.toml), each run small on this machine's local backend, the
way their pages tell a user to try them first: the file itself, made small with `--set` (fewer
repetitions, shorter loads, only the cells this machine can run), then the `lab compare` the file's
comments give. What each study measures must come out with figures, both container engines included,
and n/a only where this machine says why. The web study's small run is test_isolation_vm.py's.
Their machines are warm starts (`--set 'matrix.start=["warm"]'`, restores of the suite's shared
snapshots: tests/support/local.py), which is how they fit in make test: on a fresh clone, booted
cold, these three took 291, 169 and 66 s of the two workers and pushed make test past its 40
minutes. Marked `study` too: `make test-studies` runs them alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.buildsteps import checked_build
from support.cli import run_lab_cli
from support.local import leftovers, local_table

from lab.store import Store

pytestmark = [pytest.mark.vm, pytest.mark.image, pytest.mark.study]

EXAMPLES = Path(__file__).parents[2] / "examples"


def run_small(study: str, tmp_path: Path, workdir: Path, sets: list[str]):
    """`lab run` of examples/<study>.toml as written, its local host this test's, made small by `sets`."""
    lab = tmp_path / f"{study}.toml"
    lab.write_text((EXAMPLES / f"{study}.toml").read_text() + "\n" + local_table(workdir))
    args = [a for s in [*sets, 'matrix.start=["warm"]'] for a in ("--set", s)]
    res = run_lab_cli("run", "-c", str(lab), *args, cwd=tmp_path, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    store = Store(tmp_path / "results")
    (run,) = store.runs()
    assert store.config_text(run.id).startswith(f"# {lab}, with ")  # the lab that ran, not the file
    return lab, store, run


def by_metric(store: Store, run_id: str, workload: str) -> dict:
    return {s.metric: s for s in store.samples(run_id) if s.workload == workload}


def compare_json(lab: Path, run_id: str, a: str, b: str) -> list[dict]:
    res = run_lab_cli("compare", run_id, "--a", a, "--b", b, "--json", "-c", str(lab), cwd=lab.parent, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(res.stdout)["rows"]


def test_study_build_small_podman_and_docker_build_the_same_containerfile_step_by_step(golden, workdir, tmp_path):
    lab, store, run = run_small(
        "study-build",
        tmp_path,
        workdir,
        [
            'matrix.host=["local"]',  # kvm1 (FreeBSD's LRO cells) is not here
            'matrix.image=["debian12"]',
            "matrix.exclude=[]",
            'matrix.offloads=["default"]',  # LRO is [fixed] on virtio-net under Linux: an lro cell is n/a
            "suite.repetitions=1",
            "suite.params.podman-build.files=120",
            "suite.params.podman-build.commits=2",
            'suite.params.podman-build.network=["host"]',
            "suite.params.git-clone.files=120",
            "suite.params.git-clone.commits=2",
            'suite.params.git-clone.network=["guest"]',
        ],
    )
    (cell,) = store.cells(run.id)
    assert cell.status == "done", cell.error
    assert cell.facts["start"] == "warm", cell.facts["start"]
    build = by_metric(store, run.id, "podman-build")
    for engine in ("podman", "docker"):  # the same Containerfile, both engines of the image, no n/a
        steps = checked_build(build, f"{engine}-host")
        print(f"{engine} build per step (s):", {s: round(v, 1) for s, v in steps.items()})
    assert by_metric(store, run.id, "git-clone")["clone_seconds_guest"].value > 0

    # the file's own question: each step of one engine against the other's, in the same cell
    rows = compare_json(lab, run.id, "variant=podman", "variant=docker")
    steps = {r["key"][2] for r in rows if r["key"][1] == "podman-build"}  # A's metric, written podman/docker
    assert {f"{s}_seconds_podman/docker-host" for s in ("clone", "make", "build")} <= steps, steps

    before = len(store.samples(run.id))  # what was stored parses again into the same samples
    rep = run_lab_cli("reparse", run.id, "-c", str(lab), cwd=tmp_path)
    assert rep.returncode == 0 and f"{before} samples rebuilt" in rep.stdout, rep.stdout + rep.stderr
    assert store.open_leases() == [] and leftovers(workdir, run.id) == []


def test_study_start_small_every_variant_measured_or_said_why_podman_and_docker(golden, workdir, tmp_path):
    lab, store, run = run_small(
        "study-start",
        tmp_path,
        workdir,
        [
            "suite.repetitions=1",
            "suite.warmup=0",
            "suite.remeasure_flagged=0",  # the other test worker's VM is foreign load here
            "suite.params.container-start.runs=2",  # hyperfine has no deviation of 1 run: flagged
            "suite.params.container-start.warmup=0",
            'suite.params.container-start.engines=["podman", "docker"]',
            # the study's first question (none's argv is unit-tested, for both engines)
            'suite.params.container-start.network=["default", "host"]',
        ],
    )
    cells = {c.label: c for c in store.cells(run.id)}
    vm = next(c for label, c in cells.items() if label != "local/bare-metal")
    assert vm.status == "done" and cells["local/bare-metal"].status == "done", [
        (c.label, c.error) for c in cells.values()
    ]
    start = {s.metric: s for s in store.samples(run.id) if s.cell_id == vm.cell_id}
    for rt in ("crun", "runc"):
        for net in ("default", "host"):
            p = start[f"start_ms_{rt}-{net}-persistent"]
            assert p.value > 0 and p.labels["runtime_version"].startswith(f"{rt} version"), p.labels
            assert "--transient-store" in start[f"na_{rt}-{net}-transient"].labels["na"]  # podman 4.3.1
            # docker starts the same image from its own store, with the same runtime (crun registered)
            d = start[f"start_ms_{rt}-{net}-docker"]
            assert d.value > 0 and d.labels["engine"] == "docker" and d.labels["runtime"] == rt, d.labels
            assert f"na_{rt}-{net}-docker" not in start
    print("start (ms):", {k: round(v.value) for k, v in sorted(start.items()) if k.startswith("start_ms_")})

    # the file's questions: each a pair of rows of the same cell, answered or said why not
    host = {r["key"][2]: r for r in compare_json(lab, run.id, "variant=default", "variant=host")}
    assert {f"start_ms_{rt}-default/host-persistent" for rt in ("crun", "runc")} <= set(host), sorted(host)
    engines = {r["key"][2]: r for r in compare_json(lab, run.id, "variant=persistent", "variant=docker")}
    assert {f"start_ms_{rt}-host-persistent/docker" for rt in ("crun", "runc")} <= set(engines), sorted(engines)
    for name, r in sorted({**host, **engines}.items()):  # the figures, for the record (-s)
        print(name, r["verdict"], r["ratio"])
    assert store.open_leases() == [] and leftovers(workdir, run.id) == []


def test_study_wan_small_buffers_over_a_100_ms_path_iperf3_beside_scp(golden, workdir, tmp_path):
    lab, store, run = run_small(
        "study-wan",
        tmp_path,
        workdir,
        [
            'matrix.nic=["virtio"]',  # the study's other corners: nic, cc and loss (its full run)
            'matrix.cc=["cubic"]',
            'matrix.wan=["rtt100"]',
            "suite.repetitions=1",
            "suite.warmup=0",
            "suite.params.iperf3-tcp.time=3",
            'suite.params.iperf3-tcp.directions=["rx"]',
            "suite.params.scp.size_mib=8",
            'suite.params.scp.directions=["rx"]',
        ],
    )
    cells = {c.axes["tuning"]: c for c in store.cells(run.id)}
    assert {t: c.status for t, c in cells.items()} == {"default": "done", "wan-16m": "done"}, [
        (c.label, c.error) for c in cells.values()
    ]
    for c in cells.values():  # the path and the buffers, as the guest read them back
        assert c.facts["tuning"]["wan"]["netem"]["delay_ms"] == 100.0, c.facts["tuning"]
        assert c.facts["start"] == "warm"  # restores of one snapshot
    assert cells["wan-16m"].facts["tuning"]["effective"]["net.core.rmem_max"] == "16777216"
    got = {}
    for s in store.samples(run.id):
        got[(s.cell_id, s.metric)] = s.value
    for c in cells.values():
        assert got[(c.cell_id, "throughput_mbit_s_rx")] > 0 and got[(c.cell_id, "throughput_mb_s_rx")] > 0
    print(
        {
            t: (round(got[(c.cell_id, "throughput_mbit_s_rx")]), round(got[(c.cell_id, "throughput_mb_s_rx")], 1))
            for t, c in cells.items()
        }
    )  # iperf3 Mbit/s, scp MB/s, for the record (-s)

    # the file's first question: the buffers, on this path
    rows = compare_json(lab, run.id, "tuning=default", "tuning=wan-16m")
    assert {("iperf3-tcp", "throughput_mbit_s_rx"), ("scp", "throughput_mb_s_rx")} <= {
        (r["key"][1], r["key"][2]) for r in rows
    }
    assert store.open_leases() == [] and leftovers(workdir, run.id) == []
