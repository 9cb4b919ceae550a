"""The isolation axis on a real guest. First the web-serving study's lab (examples/study-web.toml) run
small here: its local cells, with runtime = ["podman", "docker"] and scp added, beside its bare-metal
cell. The podman cell's workloads ran inside a Podman container in the guest (the wrapper's facts:
podman's own id and state, its marker file seen by a command sent through it, every sample labelled
with that container), nginx served the http load from inside it; the docker cell did the same in a
Docker container (the golden image has both engines; docker's daemon starts on the cell's first use
of its socket); the study's `lab compare --baseline` puts each against bare metal; and nothing is
left: the containers removed before their VMs, the VMs, their namespace and files gone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes.guest import WAN_16M_IN_A_NETNS
from support.buildsteps import checked_build
from support.cli import run_lab_cli
from support.local import leftovers, local_table, write_lab

from lab.store import Store

pytestmark = [pytest.mark.vm, pytest.mark.image]

STUDY = Path(__file__).parents[2] / "examples" / "study-web.toml"
# One repetition: three cells (the VM, podman's container, docker's) and what each is asserted on
# needs no second one; the docker cell's daemon start (~15 s under TCG alone) is paid in its tune stage.
# warm: the three cells' machines are restores of one snapshot (one boot, not three); the
# containers are made in the restored guest as in a cold one (the snapshot is of a guest just
# booted, before any container)
STUDY_SMALL = [
    'matrix.host=["local"]',  # pve1 and bsd1 are the study's other hypervisors, not here
    "matrix.exclude=[]",
    'matrix.runtime=["podman", "docker"]',
    'matrix.start=["warm"]',
    'suite.workloads=["sysbench-cpu", "http", "scp"]',
    "suite.repetitions=1",
    "suite.warmup=0",
    "suite.params.scp.size_mib=8",
    "suite.params.sysbench-cpu.time=2",
    "suite.params.sysbench-cpu.threads=[1]",
    "suite.params.http.duration=2",
    "suite.params.http.connections=[10]",
]


# Not serial: nothing here compares throughput, so other VMs beside it skew nothing it asserts.
@pytest.mark.timeout(1800)
def test_study_web_small_vm_and_container_in_vm(golden, workdir, tmp_path):
    cfg = tmp_path / "study-web.toml"
    cfg.write_text(STUDY.read_text() + "\n" + local_table(workdir))
    sets = [a for s in STUDY_SMALL for a in ("--set", s)]
    res = run_lab_cli("run", "-c", str(cfg), *sets, cwd=tmp_path, timeout=1700)
    assert res.returncode == 0, res.stderr[-3000:]
    store = Store(tmp_path / "results")
    (run,) = store.runs()
    cells = {c.cell_id: c for c in store.cells(run.id)}
    # c02 would be the VM cell of runtime docker: a VM cell has no runtime, so it is not a cell
    # the study's container on bare metal: podman's needs podman on this host, docker's cannot be the cell's
    assert {k: c.status for k, c in cells.items()} == {
        **{"bm01": "done", "bm02": "n/a", "bm03": "n/a"},
        **{"c01": "done", "c03": "done", "c04": "done"},
    }, {k: c.error for k, c in cells.items()}
    assert "podman is not installed on this host" in cells["bm02"].error
    assert "outside the bare-metal cell's network namespace" in cells["bm03"].error
    assert "isolation" not in cells["c01"].facts
    vms = {k: c for k, c in cells.items() if not k.startswith("bm")}
    assert {c.facts["start"] for c in vms.values()} == {"warm"}, {k: c.facts.get("start") for k, c in vms.items()}
    box = cells["c03"].facts["isolation"]
    assert box["kind"] == "container" and box["runtime"] == "podman" and box["image"] == "localhost/lab-base:latest"
    assert box["state"] == "running" and box["pid"] > 0 and len(box["id"]) == 64 and box["network"] == "host"
    assert box["inside"] == "/run/.containerenv present" and box["nginx"] == "in the container"
    assert box["binds"] == ["/usr", "/etc/alternatives", "/etc/nginx", "/srv/www"]
    assert box["podman"].startswith("podman version") and "nested" not in box  # unprivileged
    # the workloads' commands entered it (sysbench: its load; http: its prepare) and it was removed
    assert box["execs"] >= 2 and box["removed"] is True
    samples = store.samples(run.id)
    mine = [s for s in samples if s.cell_id == "c03"]
    assert {s.workload for s in mine} == {"sysbench-cpu", "http", "scp"}
    assert {s.labels.get("container") for s in mine} == {box["id"][:12]}
    assert not [s for s in samples if s.cell_id == "c01" and "container" in s.labels]
    # the same in docker's container: its own marker, its nginx, its sshd, every sample labelled with it
    dbox = cells["c04"].facts["isolation"]
    assert dbox["runtime"] == "docker" and dbox["docker"].startswith("docker ") and "podman" not in dbox
    assert dbox["inside"] == "/.dockerenv present" and dbox["nginx"] == "in the container"
    assert dbox["state"] == "running" and dbox["network"] == "host" and dbox["removed"] is True
    assert dbox["sshd"]["port"] == 2222 and dbox["sshd"]["pid"] > 0
    assert {s.labels.get("container") for s in samples if s.cell_id == "c04"} == {dbox["id"][:12]}
    for cid in ("c01", "c03", "c04"):
        got = {(s.workload, s.metric) for s in samples if s.cell_id == cid}
        assert {
            ("sysbench-cpu", "events_per_s_1t"),
            ("sysbench-cpu", "cpu_busy_pct"),
            ("http", "requests_per_s_c10"),
            ("http", "cpu_busy_pct"),
            ("scp", "throughput_mb_s_tx"),
            ("scp", "throughput_mb_s_rx"),
        } <= got, (cid, sorted(got))
    # scp's load in the container cell: an sshd of the container's own (the machine's keys), not the guest's
    assert box["sshd"]["port"] == 2222 and box["sshd"]["pid"] > 0
    for a, b in (("isolation=vm", "isolation=container"), ("runtime=podman", "runtime=docker")):
        cmp = run_lab_cli("compare", run.id, "--a", a, "--b", b, "-c", str(cfg), cwd=tmp_path)
        assert cmp.returncode == 0, cmp.stderr
        assert "events_per_s_1t" in cmp.stdout and "requests_per_s_c10" in cmp.stdout
    # the study's first question: each layer against bare metal (the same loads on this machine)
    base = run_lab_cli("compare", run.id, "--baseline", "--json", "-c", str(cfg), cwd=tmp_path)
    assert base.returncode == 0, base.stderr
    rows = json.loads(base.stdout)["rows"]
    against = {(r["cell"], r["key"][2]) for r in rows}  # the cell's label, the metric
    assert {(cells[c].label, "requests_per_s_c10") for c in ("c01", "c03", "c04")} <= against, sorted(against)
    assert {r["baseline"] for r in rows} == {"local/bare-metal"}
    for r in rows:  # the figures, for the record (-s)
        if r["key"][2] in ("requests_per_s_c10", "events_per_s_1t"):
            print(r["cell"], r["key"][2], r["change_pct"], r["verdict"])
    assert leftovers(workdir, run.id) == []


def one_bridge_container_cell(tmp_path, workdir, matrix: str, suite: str, timeout: float = 1400):
    """`lab run` of a lab whose one cell is a container on podman's bridge: (store, run, its
    container's facts), once the cell is done and its container removed."""
    cfg = write_lab(tmp_path, workdir, matrix=matrix, suite=suite, extra='[isolation]\nnetwork = "bridge"\n')
    res = run_lab_cli("run", "-c", str(cfg), timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    store = Store(tmp_path / "results")
    (run,) = store.runs()
    (cell,) = store.cells(run.id)
    assert cell.status == "done", cell.error
    box = cell.facts["isolation"]
    assert box["network"] == "bridge" and box["removed"] is True
    return store, run, box


# No podman-build: nested, it was 71 of the cell's 175 s alone (403 s beside the other worker) for
# the same nested store, network and base image that container-start and git-clone's container
# place use here; test_apps_lab builds on the guest's podman, step by step.
BRIDGE_SUITE = """
workloads = ["http", "container-start", "git-clone", "scp"]
repetitions = 1
warmup = 0
[suite.params.http]
duration = 2
connections = [10]
[suite.params.scp]
size_mib = 8
directions = ["rx"]
# one network each (the nested podman's own bridge): the other rows (runc, none, host) are the same
# flags nested or not, and test_apps_lab measures them on the guest's podman
[suite.params.container-start]
runtime = ["crun"]
network = ["default"]
runs = 1
warmup = 0
[suite.params.git-clone]
files = 60
file_kib = 16
commits = 2
network = ["default"]
"""


@pytest.fixture(scope="module")
def bridge_cell(golden, tmp_path_factory, module_workdir):
    """One `lab run` the two bridge-container tests below only read (one restore, one container
    set-up instead of two): its one cell a container on podman's bridge in a VM tuned with wan-16m,
    measuring http and the workloads that start containers. (workdir, store, run, box)."""
    matrix = 'isolation = ["container"]\ntuning = ["wan-16m"]\nstart = ["warm"]\n'
    tmp = tmp_path_factory.mktemp("bridge")
    store, run, box = one_bridge_container_cell(tmp, module_workdir, matrix, BRIDGE_SUITE)
    return module_workdir, store, run, box


@pytest.mark.xdist_group("bridge")  # both on one worker: they share the run of bridge_cell
@pytest.mark.timeout(1800)  # bridge_cell's run comes first
def test_a_bridge_container_in_a_tuned_vm_gets_the_tcp_sysctls_its_namespace_may_have(bridge_cell):
    """wan-16m on the guest, the container on podman's bridge: its own namespace gets the profile's
    tcp_* keys at `podman run --sysctl` (read back inside), net.core.*mem_max stay the guest's."""
    workdir, store, run, box = bridge_cell
    assert (box["sysctls"], box["sysctls_kernel_wide"]) == WAN_16M_IN_A_NETNS
    got = {s.metric: s.value for s in store.samples(run.id) if s.workload == "http"}
    assert got["requests_per_s_c10"] > 0  # served by the container's nginx through the published port
    assert leftovers(workdir, run.id) == []


@pytest.mark.xdist_group("bridge")
@pytest.mark.timeout(1800)
def test_workloads_that_start_containers_run_inside_a_bridge_container_cell(bridge_cell):
    """Nested podman: the cell's container on podman's bridge network, privileged, with a store of its
    own; container-start and git-clone's container place start their containers
    inside it (on its own bridge network too), from the guest's base image seen read-only; scp
    copies to the container's own sshd through its published port."""
    workdir, store, run, box = bridge_cell
    assert box["nested"] == {
        "driver": "overlay",
        "cgroup_manager": "cgroupfs",
        "network": "labnest0 10.90.0.0/24",
        "privileged": True,
        "images": "the machine's /var/lib/containers/storage, read-only",
    }
    got = {(s.workload, s.metric): s for s in store.samples(run.id)}
    assert {s.labels.get("container") for s in got.values()} == {box["id"][:12]}  # all measured inside it
    assert got[("container-start", "start_ms_crun-default-persistent")].value > 0
    assert got[("git-clone", "clone_mb_s_default")].value > 0
    assert got[("scp", "throughput_mb_s_rx")].value > 0 and box["sshd"]["port"] == 2222  # through the published port
    assert leftovers(workdir, run.id) == []


# A docker cell whose workloads start containers: podman nested in docker's container, as in
# podman's (the same options to both CLIs). One build step by step and one start of each kind, on
# a restored guest: what is checked is that they measure inside docker's isolation, not their size.
DOCKER_NESTED_SUITE = """
workloads = ["podman-build", "container-start"]
repetitions = 1
warmup = 0
[suite.params.podman-build]
files = 30
file_kib = 16
commits = 2
engines = ["podman"]
network = ["host"]
[suite.params.container-start]
engines = ["podman"]
runtime = ["crun"]
network = ["default", "host"]
runs = 1
warmup = 0
"""


@pytest.mark.timeout(1800)
def test_a_docker_cell_builds_and_starts_containers_with_podman_nested_inside(golden, workdir, tmp_path):
    matrix = 'isolation = ["container"]\nruntime = ["docker"]\nstart = ["warm"]\n'
    cfg = write_lab(tmp_path, workdir, matrix=matrix, suite=DOCKER_NESTED_SUITE)
    res = run_lab_cli("run", "-c", str(cfg), timeout=1700)
    assert res.returncode == 0, res.stderr[-3000:]
    store = Store(tmp_path / "results")
    (run,) = store.runs()
    (cell,) = store.cells(run.id)
    assert cell.status == "done", cell.error
    box = cell.facts["isolation"]
    assert box["runtime"] == "docker" and box["inside"] == "/.dockerenv present", box
    assert box["nested"]["driver"] == "overlay" and box["nested"]["cgroup_manager"] == "cgroupfs", box
    got = {(s.workload, s.metric): s for s in store.samples(run.id)}
    assert {s.labels.get("container") for s in got.values()} == {box["id"][:12]}  # all measured inside it
    assert {s.labels.get("container_runtime") for s in got.values()} == {"docker"}
    step = checked_build({m: s for (w, m), s in got.items() if w == "podman-build"}, "podman-host")
    start = {n: got[("container-start", f"start_ms_crun-{n}-persistent")].value for n in ("default", "host")}
    assert all(v > 0 for v in start.values()), start
    print(f"docker cell, podman nested: build per step (s) {step}; start (ms) {start}")  # for the record (-s)
    assert leftovers(workdir, run.id) == []
