"""`lab run` (the CLI) against the PVE emulator backed by real QEMU guests of the golden image.

The emulated node is a network namespace this test makes (bridge vmbr0 + one tap per VM); the lab's
client side (iperf3 server, SSH) runs in the same namespace through `client_netns`. The template is
made by the backend's own publish path (upload + import-from). Then `lab run` clones it, gives the
guest a static address through ipconfig0, finds it through the guest agent, runs the workloads,
stops and deletes it, and nothing is left: no VM, no volume, no QEMU, no tap, no disk file. The
node's guest is a restore of the local tests' warm snapshot of its shape, given ipconfig0's address
after the restore (tests/pve_emulator/warmguest.py); tests/vm/test_firmware_boot.py boots one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from pve_emulator import PveEmulator
from pve_emulator.fixtures import FULL_ACL, TOKEN_ID, TOKEN_SECRET, pve_certs_fixture, pve_env_fixture  # noqa: F401
from pve_emulator.qemu import restoring_backing
from support.cli import run_lab_cli

from lab import IMAGES_DIR, proc
from lab.backends.local import QEMU
from lab.backends.proxmox import ProxmoxBackend
from lab.backends.proxmox.settings import Settings
from lab.model import NicModel
from lab.store import Store

SUBNET = "10.98.4"
# the cells' machine shape (nic, vcpus, MiB): the local tests' own, so the node's guest is a restore of
# their shared warm snapshot (pve_emulator.qemu.restoring_backing)
SHAPE = {nic: (nic, 2, 1024) for nic in (NicModel.E1000, NicModel.VIRTIO)}


@pytest.fixture
def node_netns():
    name = f"pvetest-{os.getpid()}"
    proc.run(["ip", "netns", "add", name])
    try:
        proc.run(["ip", "-n", name, "link", "set", "lo", "up"])
        proc.run(["ip", "-n", name, "link", "add", "vmbr0", "type", "bridge"])
        proc.run(["ip", "-n", name, "addr", "add", f"{SUBNET}.1/24", "dev", "vmbr0"])
        proc.run(["ip", "-n", name, "link", "set", "vmbr0", "up"])
        yield name
    finally:
        proc.run(["ip", "netns", "del", name], check=False)


def pve_host_table(url: str, ca_file, netns: str) -> str:
    """[hosts.pve] on the emulator's node pve1, its guests reached from the node's namespace."""
    return (
        f'[hosts.pve]\nbackend = "proxmox"\nurl = "{url}"\nnode = "pve1"\ntoken = "env:LAB_TEST_PVE_TOKEN"\n'
        f'ca_file = "{ca_file}"\nstorage = "local-lvm"\nbridge = "vmbr0"\naddresses = "{SUBNET}.10-{SUBNET}.19"\n'
        f'gateway = "{SUBNET}.1"\nclient_address = "{SUBNET}.1"\nclient_netns = "{netns}"\n'
        "timeouts = { agent = 400, ready = 420 }\n"
    )


def publish_template(emu, pve_certs, pve_env, golden, storage: str = "local-lvm") -> str:
    """The golden template published on node pve1 of `emu` by the backend's own path (upload +
    import-from); its name. The token comes from $LAB_TEST_PVE_TOKEN (set by the caller)."""
    settings = Settings(
        backend="proxmox",
        url=emu.url,
        node="pve1",
        token="env:LAB_TEST_PVE_TOKEN",
        ca_file=str(pve_certs.ca_file),
        storage=storage,
    )
    return ProxmoxBackend("pve", settings, pve_env).publishing.publish(golden)


def _qemus_under(workdir: Path) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if argv and argv[0].endswith(QEMU) and any(str(workdir) in a for a in argv):
                out.append(int(entry.name))
    return out


@pytest.mark.vm
@pytest.mark.image
def test_lab_run_against_the_emulator_end_to_end(golden, pve_certs, pve_env, node_netns, tmp_path, monkeypatch):
    workdir = Path(tempfile.mkdtemp(prefix="pveq", dir="/var/tmp"))
    backing = restoring_backing(
        golden, [SHAPE[NicModel.E1000]], netns=node_netns, workdir=workdir, key=IMAGES_DIR / "lab_key", subnet=SUBNET
    )
    emu = PveEmulator("8.4", pve_certs, auth_delay=0.05, backing=backing)
    emu.add_token(TOKEN_ID, TOKEN_SECRET, acl=FULL_ACL)
    try:
        with emu:
            monkeypatch.setenv("LAB_TEST_PVE_TOKEN", f"{TOKEN_ID}={TOKEN_SECRET}")
            t0 = time.monotonic()
            assert publish_template(emu, pve_certs, pve_env, golden) == "lab-debian12"
            publish_s = time.monotonic() - t0
            (tmp_path / "lab.toml").write_text(
                textwrap.dedent(f"""
                [lab]
                results = "{tmp_path / "results"}"
                {pve_host_table(emu.url, pve_certs.ca_file, node_netns)}
                [matrix]
                host = ["pve"]
                nic = ["e1000"]
                vcpus = [2]
                memory_mib = [1024]
                [suite]
                workloads = ["sysbench-cpu", "iperf3-tcp"]
                repetitions = 1
                warmup = 0
                [suite.params.sysbench-cpu]
                time = 1
                [suite.params.iperf3-tcp]
                time = 2
                """)
            )
            t0 = time.monotonic()
            res = run_lab_cli(
                "run",
                "-c",
                str(tmp_path / "lab.toml"),
                cwd=tmp_path,
                timeout=900,
                env={"LAB_TEST_PVE_TOKEN": f"{TOKEN_ID}={TOKEN_SECRET}"},
            )
            run_s = time.monotonic() - t0
            print(
                f"publish {publish_s:.1f} s (upload + import + template of {golden.path.stat().st_size >> 20} MiB), "
                f"lab run {run_s:.1f} s"
            )
            assert res.returncode == 0, res.stderr[-3000:]
            assert TOKEN_SECRET not in res.stdout + res.stderr
            shown = run_lab_cli("show", "--json", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path)
            doc = json.loads(shown.stdout)
            (cell,) = doc["cells"]
            assert cell["status"] == "done", cell
            facts = cell["facts"] if isinstance(cell["facts"], dict) else json.loads(cell["facts"])
            assert facts["address_source"] == "agent" and facts["node"] == "pve1"
            assert facts["disk_bus"] == "virtio"  # the template's scsi0, booted from virtio0
            assert facts["verified"]["nic_driver"] == "e1000" and facts["verified"]["vcpus"] == 2
            metrics = {(s["workload"], s["metric"]) for s in doc["samples"]}
            assert any(w == "sysbench-cpu" and m.startswith("events_per_s") for w, m in metrics), metrics
            assert any(w == "iperf3-tcp" and "throughput" in m for w, m in metrics)
            # the load generator ran on this machine, not on the PVE host: its load is judged
            window = next(s["labels"]["client_load"] for s in doc["samples"] if s["workload"] == "iperf3-tcp")
            print(f"client under iperf3: {window}")
            assert window["placement"] == "local" and window["busy_pct"] >= 0 and "shares_host" not in window
            assert all("client_load" not in s["labels"] for s in doc["samples"] if s["workload"] == "sysbench-cpu")
            # the guest was configured from ipconfig0 and answered the agent from the real guest
            clones = [p for m, path, p in emu.requests if m == "PUT" and path.endswith("/config")]
            assert clones and clones[0]["ipconfig0"] == f"ip={SUBNET}.10/24,gw={SUBNET}.1"
            assert clones[0]["delete"] == "scsi0" and clones[0]["boot"] == "order=virtio0"
            assert TOKEN_SECRET not in json.dumps(doc)
            # nothing left: VMs, volumes, QEMU, taps, files
            assert emu.vm_ids() == [] and emu.guests() == []
            assert [v for v in emu.volume_ids()] == []
            assert backing.starts == ["warm"]  # the node's guest was a restore (warmguest.py), not a boot
        assert _qemus_under(workdir) == []
        links = proc.run(["ip", "-n", node_netns, "-o", "link", "show"]).stdout
        assert "pvetap" not in links, links
        assert list(workdir.iterdir()) == []
    finally:
        for pid in _qemus_under(workdir):  # only if an assertion failed midway
            os.kill(pid, 9)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.vm
@pytest.mark.image
def test_lab_run_on_the_emulator_with_a_client_machine_over_ssh(
    golden, pve_certs, pve_env, node_netns, tmp_path, monkeypatch
):
    """client = "ssh:root@MACHINE": a machine beside the node (a real sshd at .2 on the node's bridge)
    runs iperf3's server and wrk for the PVE cell; its load is read over SSH and judged."""
    from smartos_emulator.sshd import Sshd, ensure_sshd

    why = ensure_sshd()
    assert not why, why
    machine = f"{SUBNET}.2"
    proc.run(["ip", "-n", node_netns, "addr", "add", f"{machine}/24", "dev", "vmbr0"])
    workdir = Path(tempfile.mkdtemp(prefix="pveq", dir="/var/tmp"))
    sshd = Sshd(workdir / "machine", netns=node_netns, address=machine)
    backing = restoring_backing(
        golden, [SHAPE[NicModel.VIRTIO]], netns=node_netns, workdir=workdir, key=IMAGES_DIR / "lab_key", subnet=SUBNET
    )
    emu = PveEmulator("8.4", pve_certs, auth_delay=0.05, backing=backing)
    emu.add_token(TOKEN_ID, TOKEN_SECRET, acl=FULL_ACL)
    env = {"LAB_TEST_PVE_TOKEN": f"{TOKEN_ID}={TOKEN_SECRET}"}
    try:
        sshd.start()
        with emu:
            monkeypatch.setenv("LAB_TEST_PVE_TOKEN", env["LAB_TEST_PVE_TOKEN"])
            assert publish_template(emu, pve_certs, pve_env, golden) == "lab-debian12"
            (tmp_path / "lab.toml").write_text(
                textwrap.dedent(f"""
                [lab]
                results = "{tmp_path / "results"}"
                {pve_host_table(emu.url, pve_certs.ca_file, node_netns)}
                client = "ssh:root@{machine}"
                client_identity = "{sshd.client_key}"
                client_known_hosts = "{sshd.known_hosts}"
                [matrix]
                host = ["pve"]
                nic = ["virtio"]
                vcpus = [2]
                memory_mib = [1024]
                [suite]
                workloads = ["iperf3-tcp", "http"]
                repetitions = 1
                warmup = 0
                [suite.params.iperf3-tcp]
                time = 2
                directions = ["rx", "tx"]
                [suite.params.http]
                duration = 1
                connections = [10]
                """)
            )
            res = run_lab_cli("run", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path, timeout=900, env=env)
            assert res.returncode == 0, res.stderr[-3000:]
            store = Store(tmp_path / "results")
            (run,) = store.runs()
            assert {c.status for c in store.cells(run.id)} == {"done"}
            assert run.manifest["client_machines"] == {"pve": {"target": f"root@{machine}", "address": machine}}
            samples = store.samples(run.id)
            figures = {s.metric: round(s.value) for s in samples if s.labels.get("client")}
            print(f"through the client machine over SSH: {figures}")
            network = [s for s in samples if s.workload in ("iperf3-tcp", "http")]
            assert {s.workload for s in network} == {"iperf3-tcp", "http"}
            for s in network:  # its load read from its /proc/stat over SSH: this kernel's CPUs
                load = s.labels["client_load"]
                assert s.labels["client"] == f"ssh:root@{machine}" and load["placement"] == s.labels["client"]
                assert load["cpus"] == os.cpu_count() and "shares_host" not in load
            assert any(s.metric.startswith("throughput_mbit_s_rx") and s.value > 0 for s in network)
            assert any(s.workload == "http" and s.metric.startswith("requests_per_s") and s.value > 0 for s in network)
            raws = [raw for _, _, _, raw in store.raw_outputs(run.id) if raw.workload == "iperf3-tcp"]
            assert raws and all(raw.params["client_address"] == machine for raw in raws)
            assert store.open_leases() == [] and emu.vm_ids() == [] and emu.guests() == []
            assert backing.starts == ["warm"]
        assert _qemus_under(workdir) == []
    finally:
        sshd.stop()
        for pid in _qemus_under(workdir):  # only if an assertion failed midway
            os.kill(pid, 9)
        shutil.rmtree(workdir, ignore_errors=True)
