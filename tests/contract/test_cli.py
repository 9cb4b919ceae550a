"""CLI behaviour without VMs: exit statuses, one-line errors, no traceback, nothing created."""

from __future__ import annotations

import socket

from pve_emulator.fixtures import pve_certs_fixture, pve_fixture  # noqa: F401  (fixtures)
from support.cli import lab_cli, run_lab_cli


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line_exit_2(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_unreachable_proxmox_host_is_exit_2_and_creates_nothing(tmp_path):
    port = _closed_port()
    (tmp_path / "lab.toml").write_text(f"""
[hosts.pve1]
backend = "proxmox"
url = "https://127.0.0.1:{port}"
node = "pve1"
token = "env:LAB_TEST_PVE_TOKEN"
[matrix]
host = ["pve1"]
""")
    res = lab_cli(
        "run",
        "-c",
        str(tmp_path / "lab.toml"),
        cwd=tmp_path,
        env={"LAB_TEST_PVE_TOKEN": "lab@pve!t=00000000-dead-beef-0000-000000000000"},
    )
    _one_line_exit_2(res, f"127.0.0.1:{port}")
    assert "dead-beef" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.toml"]


def test_missing_token_env_is_exit_2_naming_the_variable(tmp_path):
    (tmp_path / "lab.toml").write_text("""
[hosts.pve1]
backend = "proxmox"
url = "https://127.0.0.1:1"
node = "pve1"
token = "env:LAB_TEST_UNSET_TOKEN"
[matrix]
host = ["pve1"]
""")
    res = lab_cli("run", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path)
    _one_line_exit_2(res, "hosts.pve1.token", "LAB_TEST_UNSET_TOKEN")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.toml"]


def test_unknown_run_and_unknown_command(tmp_path):
    (tmp_path / "lab.toml").write_text('[lab]\nresults = "r"\n')
    res = lab_cli("show", "nope", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path)
    _one_line_exit_2(res, "no runs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.toml"]
    # Listing no runs is an empty answer, not an error, and creates no store either.
    res = lab_cli("ls", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path)
    assert res.returncode == 0 and "no runs in" in res.stdout, (res.returncode, res.stdout, res.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.toml"]
    res = run_lab_cli("frobnicate", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_plan_shows_cells_and_estimate(tmp_path):
    (tmp_path / "lab.toml").write_text('[matrix]\nnic = ["virtio", "e1000"]\nvcpus = [1, 2]\n')
    res = lab_cli("plan", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "4 cells" in res.stdout and "c04" in res.stdout and "estimated time" in res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.toml"]


def _pve_toml(tmp_path, emu, token_env: str) -> None:
    (tmp_path / "lab.toml").write_text(f"""
[hosts.pve1]
backend = "proxmox"
url = "{emu.url}"
node = "pve1"
token = "env:{token_env}"
ca_file = "{emu.certs.ca_file}"
template = 9000
[matrix]
host = ["pve1"]
""")


def test_bad_token_and_missing_privilege_on_the_cli_are_exit_2_without_secrets(tmp_path, pve):
    from pve_emulator.fixtures import VM_PRIVS

    _pve_toml(tmp_path, pve, "LAB_TEST_PVE_TOKEN")
    wrong = "lab@pve!lab=0bad5ec7-0000-4000-8000-5ec7e7000000"
    res = lab_cli("run", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path, env={"LAB_TEST_PVE_TOKEN": wrong})
    _one_line_exit_2(res, "authentication failed (401) for token lab@pve!lab")
    assert "0bad5ec7" not in res.stderr + res.stdout
    pve.add_token("lab@pve!audit", "5ec7-audit-only", acl={"/vms": VM_PRIVS - {"VM.Audit"}})
    res = lab_cli(
        "run",
        "-c",
        str(tmp_path / "lab.toml"),
        cwd=tmp_path,
        env={"LAB_TEST_PVE_TOKEN": "lab@pve!audit=5ec7-audit-only"},
    )
    _one_line_exit_2(res, "lab@pve!audit lacks a privilege: Permission check failed (/vms/9000, VM.Audit)")
    assert "5ec7-audit-only" not in res.stderr + res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.toml"]  # no results store, nothing made
    assert pve.vm_ids() == []


def test_unknown_node_on_the_cli_is_exit_2_naming_the_key(tmp_path, pve):
    _pve_toml(tmp_path, pve, "LAB_TEST_PVE_TOKEN")
    text = (tmp_path / "lab.toml").read_text().replace('node = "pve1"', 'node = "pve1"\nnodes = ["pve1", "pve3"]')
    (tmp_path / "lab.toml").write_text(text)
    from pve_emulator.fixtures import TOKEN_ID, TOKEN_SECRET

    res = lab_cli(
        "run", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path, env={"LAB_TEST_PVE_TOKEN": f"{TOKEN_ID}={TOKEN_SECRET}"}
    )
    _one_line_exit_2(res, "hosts.pve1.nodes[1] = 'pve3': no such node in the cluster", "its nodes: pve1, pve2")
    assert TOKEN_SECRET not in res.stderr + res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.toml"]


def test_eta_counts_down_within_a_cell_after_the_first_one_ends():
    """Seen in `make run`: after cell 1 of 2 ended at 6m42s, the plain ETA read 7m01s at 7m01s and
    11m18s at 11m18s (elapsed / done x left, growing with the cell under way)."""
    from lab.cli import Eta

    now = [0.0]
    eta = Eta(clock=lambda: now[0])
    eta.begin(total=2, estimate_s=600)
    now[0] = 100
    assert eta.seconds() == 500  # the plan's estimate until a cell ends
    now[0] = 402
    eta.cell_ended()  # cell 1 took 402 s
    assert eta.seconds() == 402
    now[0] = 421
    assert eta.seconds() == 383  # counts down while cell 2 runs
    now[0] = 678
    assert eta.seconds() == 126 and eta.elapsed() == 678
    now[0] = 900
    assert eta.seconds() == 0  # late: never negative
    eta.cell_ended()
    assert eta.seconds() == 0
