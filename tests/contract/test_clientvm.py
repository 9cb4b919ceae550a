"""client = "vm" (lab.runner.clientvm) through the fake backend: the run makes a client VM on the
host, its network workloads run their client side there and carry its load, it is the client of
that host alone (test_lanes: the lanes' measurements overlap), and it is destroyed with the run,
whatever happens; config refuses the workloads that need this machine's files on the client side."""

from __future__ import annotations

import fakes.backend as fake
import pytest
from test_clientload import NetworkWork
from test_lanes import run_with, write_lab

from lab import clientload, runner
from lab.errors import ConfigError
from lab.lifecycle import Interrupted
from lab.runner.clientvm import VmClient
from lab.store import Store

SUITE = 'workloads = ["fake-net", "fake-work"]\n[suite.params.fake-net]\nvalues = [5.0]'


class ClientSeen(NetworkWork):
    """fake-net that keeps the client each repetition ran through."""

    def __init__(self):
        super().__init__()
        self.clients: list = []

    def run(self, ctx, repetition):
        self.clients.append(ctx.client)
        return super().run(ctx, repetition)


def test_a_hosts_network_workloads_run_in_its_client_vm_destroyed_with_the_run(fake_lab):
    probe = ClientSeen()
    store, rid = run_with(
        fake_lab, [probe], {"a": 'client = "vm"\nclient_vcpus = 3'}, vcpus=2, repetitions=2, suite=SUITE
    )
    run = store.run(rid)
    assert run.status == "done"
    name = f"lab-{rid}-client1"
    assert run.manifest["client_vms"] == {"a": {"name": name, "address": fake.GUESTS[name].address}}
    cloned = [n for ev, n in fake.JOURNAL if ev == "clone"]
    assert cloned[0] == name and cloned.count(name) == 1  # made once, before the cells
    destroyed = [n for ev, n in fake.JOURNAL if ev == "destroy"]
    assert destroyed[-1] == name  # after every cell
    assert fake.LIVE == {} and store.open_leases() == []
    # the workloads' client was the VM's: commands go through its SSH
    assert probe.clients and all(isinstance(c, VmClient) and c.name == name for c in probe.clients)
    assert probe.clients[0].argv(["iperf3", "-s"]) == ["sh", "-c", "iperf3 -s"]
    net = [s for s in store.samples(rid) if s.workload == "fake-net"]
    assert net and all(s.labels["client"] == "vm" for s in net)
    for s in net:  # the client VM's own /proc/stat: its 3 vCPUs, judged (not the cell's host)
        window = s.labels[clientload.CLIENT_LOAD]
        assert window["placement"] == "vm" and window["cpus"] == 3 and window["busy_pct"] == 0.0
        assert "shares_host" not in window
    assert "cat /proc/stat" in fake.GUESTS[name].commands
    from support.cli import lab_cli

    from lab import workloads

    workloads.register(probe)  # the lab.toml names it
    try:
        shown = lab_cli("show", rid, "-c", str(fake_lab.path))
    finally:
        workloads.unregister(probe.name)
    assert shown.returncode == 0, shown.stderr
    assert f"client VM of host a: {name} at {fake.GUESTS[name].address} ran its load generators" in shown.stdout


@pytest.mark.parametrize("stage", ["clone", "boot", "ssh"])
def test_a_client_vm_that_cannot_be_made_ends_its_hosts_lane_and_leaves_nothing(fake_lab, stage):
    store, rid = run_with(
        fake_lab,
        [NetworkWork()],
        {"a": f'client = "vm"\nfail = {{ client1 = "{stage}" }}', "b": ""},
        vcpus=2,
        suite=SUITE,
    )
    cells = {c.cell_id: c for c in store.cells(rid)}
    hosts = {c.cell_id: c.axes["host"] for c in store.cells(rid)}
    assert all(c.status == "failed" and "host a lost" in c.error for cid, c in cells.items() if hosts[cid] == "a")
    assert all(c.status == "done" for cid, c in cells.items() if hosts[cid] == "b")
    assert fake.LIVE == {} and store.open_leases() == []


def test_an_interrupted_run_destroys_its_client_vm(fake_lab):
    cfg = write_lab(fake_lab, {"a": 'client = "vm"\ninterrupt = { c02 = "workloads" }'}, vcpus=2)
    store = Store(cfg.results_dir)
    with pytest.raises(Interrupted):
        runner.run_lab(cfg, store)
    assert fake.LIVE == {} and store.open_leases() == []
    assert any(n.endswith("-client1") for ev, n in fake.JOURNAL if ev == "destroy")


@pytest.mark.parametrize("workload", ["scp", "git-clone", "podman-build"])
def test_workloads_that_need_this_machines_files_refuse_a_client_vm(fake_lab, workload):
    with pytest.raises(ConfigError) as exc:
        write_lab(fake_lab, {"a": 'client = "vm"'}, suite=f'workloads = ["{workload}"]')
    text = str(exc.value)
    assert "hosts.a.client" in text and "'vm'" in text and f"workload {workload}" in text
    assert 'only with client = "local"' in text
    with pytest.raises(ConfigError, match="hosts.a.client") as exc:
        write_lab(fake_lab, {"a": 'client = "ssh:me@there"'}, suite=f'workloads = ["{workload}"]')
    assert "'ssh:me@there'" in str(exc.value) and f"workload {workload}" in str(exc.value)
