"""Lanes for real: the local backend, a libvirt qemu:///system host and two nodes of the PVE
emulator (real QEMU guests of the golden image in a namespace of their own, the cluster's load
generators in a client VM on it) run their cells at the same time through `lab run`; a run of the
same four lanes killed with -9, then `lab gc`, leaves nothing on any of them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
from pve_emulator import PveEmulator
from pve_emulator.fixtures import FULL_ACL, TOKEN_ID, TOKEN_SECRET, pve_certs_fixture, pve_env_fixture  # noqa: F401
from pve_emulator.qemu import restoring_backing
from support.chaos_scenario import cell_state, run_id_of, wait_for
from support.cli import LAB, run_lab_cli
from support.local import leftovers, local_table
from test_libvirt_e2e import kvm_table, lab_bridge, leftovers as libvirt_leftovers, virsh_names  # noqa: F401
from test_proxmox_e2e import SUBNET, _qemus_under, node_netns, publish_template, pve_host_table  # noqa: F401

from lab import IMAGES_DIR
from lab.model import NicModel
from lab.store import Store

# timeout: the cells of four lanes boot on 2 cores under TCG, beside the other worker's VMs
pytestmark = [pytest.mark.vm, pytest.mark.image, pytest.mark.timeout(1800)]
ENV = {"LAB_TEST_PVE_TOKEN": f"{TOKEN_ID}={TOKEN_SECRET}"}
# a cell's stages once its machine exists and was started (lab.runner.cells: clone makes it)
STARTED = ("boot", "ssh", "verify", "tune", "workloads")


def union_s(spans: list[list[float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def two_cells_at_once(results: Path, lanes: dict[str, list[str]], what: str):
    """The run of `results` (its only one): both cells done, on `lanes`, up at the same time, in
    less than 0.9 of their serial time (printed). Returns the run."""
    store = Store(results)
    (run,) = store.runs()
    assert run.status == "done"
    assert {c.cell_id: c.status for c in store.cells(run.id)} == {"c01": "done", "c02": "done"}
    man = run.manifest
    assert man["lanes"] == lanes
    assert man["overlaps"] == [["c01", "c02"]]  # both VMs were up at the same time
    spans = [s for boots in man["spans"].values() for s in boots]
    together, apart = union_s(spans), sum(b - a for a, b in spans)
    print(f"{what}: {apart:.1f} s of cells in {together:.1f} s ({together / apart:.2f})")
    assert together < 0.9 * apart
    return run


@contextlib.contextmanager
def cluster(golden, pve_certs, pve_env, netns: str, monkeypatch):
    """The PVE emulator with nodes pve1 and pve2 backed by real QEMU, the golden template published
    on shared (rbd) storage. Yields (emulator, its QEMUs' directory, the host table of `pve`)."""
    pve_dir = Path(tempfile.mkdtemp(prefix="pveq", dir="/var/tmp"))
    # the cells' shapes and the client VM's: restores of the tests' shared warm snapshots (warmguest.py);
    # virtio 2c1024m last: the first tests of the other worker are likely building it meanwhile
    shapes = [(NicModel.E1000, 2, 1024), (NicModel.VIRTIO, 1, 512), (NicModel.VIRTIO, 2, 1024)]
    backing = restoring_backing(golden, shapes, netns=netns, workdir=pve_dir, key=IMAGES_DIR / "lab_key", subnet=SUBNET)
    emu = PveEmulator("8.4", pve_certs, auth_delay=0.05, backing=backing)
    emu.add_token(TOKEN_ID, TOKEN_SECRET, acl=FULL_ACL)
    try:
        with emu:
            monkeypatch.setenv("LAB_TEST_PVE_TOKEN", ENV["LAB_TEST_PVE_TOKEN"])
            # the template on shared storage, so that pve2 clones it too (PVE does not proxy an
            # upload to another node, so one template per node cannot be published through pve1)
            emu.add_storage("ceph", "rbd", {"images"}, shared=True)
            publish_template(emu, pve_certs, pve_env, golden, storage="ceph")
            table = (
                pve_host_table(emu.url, pve_certs.ca_file, netns).replace('"local-lvm"', '"ceph"')
                + 'nodes = ["pve1", "pve2"]\nplacement = "spread"\nclient = "vm"\nclient_vcpus = 1\n'
                + "client_memory_mib = 512\n"
            )
            yield emu, pve_dir, table
        assert _qemus_under(pve_dir) == []
    finally:
        for pid in _qemus_under(pve_dir):  # only if an assertion failed midway
            os.kill(pid, 9)
        shutil.rmtree(pve_dir, ignore_errors=True)


def write_toml(tmp_path: Path, workdir: Path, table: str, suite: str, kvm: str = "") -> Path:
    """Three lanes: local (one e1000 cell), pve@pve1 and pve@pve2 (an e1000 and a virtio cell); a
    fourth with `kvm`, the table of a libvirt host (one e1000 cell: c03, the cluster's c05 and c06)."""
    path = tmp_path / "lab.toml"
    path.write_text(
        textwrap.dedent(f"""
        [lab]
        results = "{tmp_path / "results"}"
        """)
        + local_table(workdir)
        + table
        + kvm
        + textwrap.dedent(f"""
        [matrix]
        host = ["local", {'"kvm", ' if kvm else ""}"pve"]
        nic = ["e1000", "virtio"]
        vcpus = [2]
        memory_mib = [1024]
        exclude = [{{ host = "local", nic = "virtio" }}{', { host = "kvm", nic = "virtio" }' if kvm else ""}]
        [suite]
        """)
        + textwrap.dedent(suite)
    )
    return path


@pytest.mark.xdist_group("lanes")  # one worker: ten TCG guests at once would starve both
def test_local_libvirt_and_two_pve_nodes_run_at_once_with_a_client_vm(
    golden,
    pve_certs,
    pve_env,
    node_netns,  # noqa: F811 - the fixture, imported above
    libvirtd,
    lab_bridge,  # noqa: F811 - the fixture, imported above
    workdir,
    tmp_path,
    monkeypatch,
):
    """Four lanes: the local backend, a libvirt qemu:///system host, and the PVE emulator's nodes
    pve1 and pve2 (placement = "spread": a lane per node), whose network measurements run in a
    client VM the run clones on the cluster (client = "vm"). Each lane an idle cell and iperf3; all
    up at once (the run's time against its cells' one after the other printed)."""
    bridge, n = lab_bridge
    with cluster(golden, pve_certs, pve_env, node_netns, monkeypatch) as (emu, pve_dir, table):
        write_toml(
            tmp_path,
            workdir,
            table,
            """
            workloads = ["idle", "iperf3-tcp"]
            repetitions = 2
            warmup = 0
            quiet_host = "record"
            [suite.params.idle]
            duration = 4
            [suite.params.iperf3-tcp]
            time = 2
            directions = ["rx"]
            """,
            kvm_table(workdir, bridge, n, boot_timeout=600),
        )
        plan = run_lab_cli("plan", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path, env=ENV)
        assert plan.returncode == 0, plan.stderr
        text = " ".join(plan.stdout.split())
        assert "lanes: 3 hosts at once" in text, text
        assert "lane pve: 2 cells, 2 at a time, one on each node (pve1, pve2)" in text
        assert "network measurements (iperf3-tcp) of lanes local, kvm take turns on the local client" in text
        assert "host pve: its load generators run in a client VM the run makes there (1 vCPUs, 512 MiB" in text
        res = run_lab_cli("run", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path, timeout=1500, env=ENV)
        assert res.returncode == 0, res.stderr[-3000:]
        store = Store(tmp_path / "results")
        (run,) = store.runs()
        man = run.manifest
        assert run.status == "done" and {c.status for c in store.cells(run.id)} == {"done"}
        assert man["lanes"] == {"local": ["c01"], "kvm": ["c03"], "pve@pve1": ["c05"], "pve@pve2": ["c06"]}
        assert {c.cell_id: c.facts["node"] for c in store.cells(run.id) if c.cell_id in ("c05", "c06")} == {
            "c05": "pve1",
            "c06": "pve2",
        }
        assert ["c05", "c06"] in man["overlaps"]  # the two nodes measured at once
        assert ["c01", "c03"] in man["overlaps"]  # local and libvirt too
        # the local and libvirt lanes did not wait for the cluster's set-up (its client VM's boot)
        spans = {cid: boots[0] for cid, boots in man["spans"].items()}
        assert max(spans["c01"][0], spans["c03"][0]) < min(spans["c05"][0], spans["c06"][0])
        wall = run.finished_at - run.started_at
        cells_s = sum(b - a for a, b in spans.values())
        # The overlaps above prove the lanes ran at once; the ratio is a figure, printed and only held
        # below 1. (It was held at 0.5: the one assertion here that the other worker's VMs can break,
        # by slowing the cluster's client VM boot and so starting its lanes later. A fresh-clone
        # make test had to rerun this test; xdist did not say why.)
        print(f"four lanes: {cells_s:.1f} s of cells (and a client VM) in {wall:.1f} s of run ({wall / cells_s:.2f})")
        assert wall < cells_s
        client_vm = man["client_vms"]["pve"]
        assert client_vm["name"] == f"lab-{run.id}-client3" and client_vm["address"].startswith(SUBNET + ".")
        samples = store.samples(run.id)
        by_cell = {s.cell_id: s for s in samples if s.metric == "throughput_mbit_s_rx"}  # iperf3-tcp's
        assert set(by_cell) == {"c01", "c03", "c05", "c06"}
        figures = ", ".join(f"{c} {s.value:.0f} ({s.labels['client']})" for c, s in by_cell.items())
        print(f"iperf3 rx Mbit/s: {figures}")
        assert by_cell["c01"].labels["client"] == by_cell["c03"].labels["client"] == "local"
        for cid in ("c05", "c06"):  # through the client VM: its own vCPU, judged
            labels = by_cell[cid].labels
            assert labels["client"] == "vm"
            assert labels["client_load"]["placement"] == "vm" and labels["client_load"]["cpus"] == 1
        raws = [
            raw
            for _, cid, _, raw in store.raw_outputs(run.id)
            if raw.workload == "iperf3-tcp" and cid in ("c05", "c06")
        ]
        assert raws and all(raw.params["client_address"] == client_vm["address"] for raw in raws)
        busy = {(s.cell_id, s.metric) for s in store.samples(run.id)}
        assert {(c, "cpu_busy_pct") for c in ("c01", "c03", "c05", "c06")} <= busy
        assert ("c01", "host_vm_cpu_pct") in busy  # the local host's window of the idle repetition
        lines = res.stderr.splitlines()
        assert any("local:   c01 workloads" in line for line in lines)
        assert any("pve@pve2:   c06 workloads" in line for line in lines)
        assert store.open_leases() == []
        assert emu.vm_ids() == [] and emu.guests() == []  # the client VM too
        assert emu.backing.starts == ["warm"] * 3, emu.backing.starts  # restores, not boots (warmguest.py)
    assert leftovers(workdir, run.id) == [] and libvirt_leftovers(run.id, workdir, bridge) == []


@pytest.mark.xdist_group("lanes")  # one worker: ten TCG guests at once would starve both
def test_a_run_of_four_lanes_killed_with_9_then_gc_leaves_nothing_on_any_host(
    golden,
    pve_certs,
    pve_env,
    node_netns,  # noqa: F811 - the fixture, imported above
    libvirtd,
    lab_bridge,  # noqa: F811 - the fixture, imported above
    workdir,
    tmp_path,
    monkeypatch,
):
    """Four lanes: local, a libvirt qemu:///system host and the PVE emulator's two nodes with a
    client VM. SIGKILL of `lab run` (it alone: its QEMUs, libvirt's domain and the cluster's VMs
    live on) once every lane has a cell's machine made and started (at its boot or later: what gc
    must find is there, and nobody waits for four TCG boots to end); then `lab gc` removes all of
    it, on every host, and the run reads failed."""
    bridge, n = lab_bridge
    kvm = kvm_table(workdir, bridge, n, boot_timeout=600)
    with cluster(golden, pve_certs, pve_env, node_netns, monkeypatch) as (emu, _, table):
        # idle cells long enough (20 min) that none ends before the kill, however late the slowest
        # lane boots on a loaded machine: the kill ends them
        write_toml(
            tmp_path,
            workdir,
            table,
            'workloads = ["idle"]\nrepetitions = 60\nwarmup = 0\nquiet_host = "record"\n'
            "[suite.params.idle]\nduration = 20\n",
            kvm,
        )
        results = tmp_path / "results"
        with open(tmp_path / "run.stderr", "w") as err:
            p = subprocess.Popen(
                [*LAB, "run", "-c", str(tmp_path / "lab.toml")],
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=tmp_path,
                env={**os.environ, **ENV},
            )
        cells = ("c01", "c03", "c05", "c06")

        def detail() -> str:
            return f"cells {[(c, *cell_state(results, c)[:2]) for c in cells]}; `lab run` said: " + " | ".join(
                (tmp_path / "run.stderr").read_text().splitlines()[-15:]
            )

        def all_started() -> bool:
            states = [cell_state(results, c)[:2] for c in cells]
            # a cell that ended will not start again: say so now, not after 15 min
            if any(status not in ("", "pending", "running") for status, _ in states):
                raise AssertionError(f"a cell ended before the kill: {detail()}")
            return all(status == "running" and stage in STARTED for status, stage in states)

        try:
            wait_for("a machine of every lane made and started", all_started, p, timeout=900, detail=detail)
            rid = run_id_of(results)
            up = len(emu.vm_ids())
            p.send_signal(signal.SIGKILL)
        finally:
            p.wait(timeout=60)
        assert up == 3  # c05, c06 and the client VM on the cluster
        assert [x for x in leftovers(workdir, rid) if "c01" in x]  # c01 here, before gc
        assert f"lab-{rid}-c03" in virsh_names()  # and c03 in libvirt
        gc = run_lab_cli("gc", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path, env=ENV, timeout=600)
        assert gc.returncode == 0, gc.stdout + gc.stderr
        print(f"gc after kill -9 of four lanes: {' '.join(gc.stdout.split())}")
        assert emu.vm_ids() == [] and emu.guests() == [] and leftovers(workdir, rid) == []
        assert libvirt_leftovers(rid, workdir, bridge) == []
        store = Store(results)
        assert store.open_leases() == [] and store.run(rid).status == "failed"
