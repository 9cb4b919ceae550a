"""Two lanes for real: the local backend and the PVE emulator (real QEMU guests of the golden image
in a namespace of their own) run one idle cell each at the same time through `lab run`."""

from __future__ import annotations

import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import leftovers, run_lab_cli
from pve_emulator import PveEmulator
from pve_emulator.fixtures import FULL_ACL, TOKEN_ID, TOKEN_SECRET, pve_certs_fixture, pve_env_fixture  # noqa: F401
from pve_emulator.qemu import QemuBacking
from test_proxmox_e2e import SUBNET, _qemus_under, node_netns, pve_host_table  # noqa: F401

from lab import IMAGES_DIR
from lab.backends.proxmox import ProxmoxBackend
from lab.backends.proxmox.settings import Settings
from lab.store import Store

pytestmark = [pytest.mark.vm, pytest.mark.image]


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


def test_local_and_pve_lanes_run_at_once(
    golden,
    pve_certs,
    pve_env,
    node_netns,  # noqa: F811 - the fixture, imported above
    workdir,
    tmp_path,
    monkeypatch,
):
    pve_dir = Path(tempfile.mkdtemp(prefix="pveq", dir="/var/tmp"))
    backing = QemuBacking(golden, netns=node_netns, workdir=pve_dir, key=IMAGES_DIR / "lab_key", subnet=SUBNET)
    emu = PveEmulator("8.4", pve_certs, auth_delay=0.05, backing=backing)
    emu.add_token(TOKEN_ID, TOKEN_SECRET, acl=FULL_ACL)
    env = {"LAB_TEST_PVE_TOKEN": f"{TOKEN_ID}={TOKEN_SECRET}"}
    try:
        with emu:
            monkeypatch.setenv("LAB_TEST_PVE_TOKEN", env["LAB_TEST_PVE_TOKEN"])
            settings = Settings(
                backend="proxmox",
                url=emu.url,
                node="pve1",
                token="env:LAB_TEST_PVE_TOKEN",
                ca_file=str(pve_certs.ca_file),
                storage="local-lvm",
            )
            ProxmoxBackend("pve", settings, pve_env).publish_image(golden)
            (tmp_path / "lab.toml").write_text(
                textwrap.dedent(f"""
                [lab]
                results = "{tmp_path / "results"}"
                [hosts.local]
                backend = "local"
                workdir = "{workdir}"
                boot_timeout = 300
                {pve_host_table(emu.url, pve_certs.ca_file, node_netns)}
                [matrix]
                host = ["local", "pve"]
                nic = ["e1000"]
                vcpus = [1]
                memory_mib = [1024]
                [suite]
                workloads = ["idle"]
                repetitions = 2
                warmup = 0
                quiet_host = "record"
                [suite.params.idle]
                duration = 3
                """)
            )
            plan = run_lab_cli("plan", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path, env=env)
            assert plan.returncode == 0, plan.stderr
            assert "lanes: 2 hosts at once" in plan.stdout and "lane pve: 1 cells" in plan.stdout
            res = run_lab_cli("run", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path, timeout=1200, env=env)
            assert res.returncode == 0, res.stderr[-3000:]
            run = two_cells_at_once(tmp_path / "results", {"local": ["c01"], "pve": ["c02"]}, "lanes")
            store = Store(tmp_path / "results")
            busy = {(s.cell_id, s.metric) for s in store.samples(run.id)}
            assert {("c01", "cpu_busy_pct"), ("c02", "cpu_busy_pct")} <= busy
            assert ("c01", "host_vm_cpu_pct") in busy  # the local host's window of the idle repetition
            lines = res.stderr.splitlines()
            assert any("local:   c01 workloads" in line for line in lines)
            assert any("pve:   c02 workloads" in line for line in lines)
            assert emu.vm_ids() == [] and emu.guests() == []
        assert leftovers(workdir, run.id) == []
        assert _qemus_under(pve_dir) == []
    finally:
        shutil.rmtree(pve_dir, ignore_errors=True)
