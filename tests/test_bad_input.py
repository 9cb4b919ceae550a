"""Bad CLI invocations (the lab.toml corpus is tests/data/bad-config, checked by test_config.py):
each must exit 2 with exactly one line on stderr naming the argument or value, no traceback, and
create nothing: no file anywhere under the test's directory (no results dir, no store, no run
lock), nothing in the local backend's workdir (its namespaces and taps exist only after the
run's lock file there), no QEMU process of that workdir."""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest

from lab.backends import local
from lab.store import Store

from conftest import run_lab_cli


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PVE = """
[hosts.pve1]
backend = "proxmox"
url = "https://127.0.0.1:{port}"
node = "pve1"
token = "{token}"
[matrix]
host = ["pve1"]
"""

# (id, argv, expected fragment of the one line, lab.toml variant)
CASES = [
    ("resume-unknown-run", ["run", "--resume", "nope"], "no run 'nope'", "local"),
    ("resume-ambiguous", ["run", "--resume", "r"], "is ambiguous", "local"),
    ("run-id-path", ["run", "--run-id", "../x"], "--run-id '../x'", "local"),
    ("run-id-upper", ["run", "--run-id", "ABC"], "--run-id 'ABC'", "local"),
    ("run-id-taken", ["run", "--run-id", "r1"], "already has a run of that id", "local"),
    ("run-id-and-resume", ["run", "--run-id", "abc", "--resume", "r1"], "exclude each other", "local"),
    ("run-missing-config", ["run", "-c", "missing.toml"], "missing.toml: (file)", "local"),
    ("run-config-is-dir", ["run", "-c", "."], "is a directory", "local"),
    ("run-unknown-option", ["run", "--cells", "2"], "No such option '--cells'", "local"),
    ("plan-missing-config", ["plan", "-c", "nope.toml"], "nope.toml: (file)", "local"),
    ("show-unknown-run", ["show", "nope"], "no run 'nope'", "local"),
    ("show-no-store", ["show", "--results", "elsewhere"], "no runs in elsewhere", "local"),
    ("compare-unknown-run", ["compare", "nope", "r1"], "no run 'nope'", "local"),
    ("compare-unknown-b", ["compare", "r1", "nope"], "no run 'nope'", "local"),
    ("compare-one-run", ["compare", "r1"], "needs two runs", "local"),
    ("compare-selector-no-value", ["compare", "r1", "--a", "nic"], "nic", "local"),
    ("compare-selector-no-match", ["compare", "r1", "--a", "nic=ne2k", "--b", "nic=virtio"], "nic=ne2k", "local"),
    ("compare-baseline-and-b", ["compare", "r1", "r2", "--baseline"], "--baseline", "local"),
    ("report-unknown-run", ["report", "nope"], "no run 'nope'", "local"),
    ("reparse-unknown-run", ["reparse", "nope"], "no run 'nope'", "local"),
    ("reparse-missing-arg", ["reparse"], "RUN_REF", "local"),
    ("unknown-command", ["frobnicate"], "No such command 'frobnicate'", "local"),
    ("gc-unknown-option", ["gc", "--all"], "No such option '--all'", "local"),
    ("snapshot-unknown-host", ["snapshot", "pve9"], "no host 'pve9'", "local"),
    ("images-build-unknown", ["images", "build", "windows11"], "windows11", "local"),
    ("images-render-unknown", ["images", "render", "windows11", "out"], "windows11", "local"),
    ("images-publish-unknown-host", ["images", "publish", "debian12", "pve9"], "no host 'pve9'", "local"),
    ("token-env-unset", ["run"], "LAB_TEST_UNSET_TOKEN", "pve-env"),
    ("token-file-missing", ["run"], "cannot read secret file", "pve-file"),
    ("proxmox-unreachable", ["run"], "127.0.0.1:{port}", "pve-closed"),
]


@pytest.fixture
def place(tmp_path):
    """A valid lab (local backend, its own workdir) with one stored run `r1` (and `r2`)."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    store = Store(tmp_path / "results")
    for rid in ("r1", "r2"):
        store.create_run(rid, "t", config_path="", config_text="", seed=1, lab_version="0", manifest={})
        store.add_cell(rid, "c01", 1, "local/debian12/virtio", {"nic": "virtio"})
        store.finish_run(rid, "done")
    store.close()
    return tmp_path, workdir


def _write(tmp_path: Path, workdir: Path, variant: str, port: int) -> None:
    if variant == "local":
        text = f'[lab]\nresults = "results"\n[hosts.local]\nbackend = "local"\nworkdir = "{workdir}"\n'
    else:
        token = {"pve-env": "env:LAB_TEST_UNSET_TOKEN", "pve-file": f"file:{tmp_path}/no-such-token",
                 "pve-closed": "env:LAB_TEST_PVE_TOKEN"}[variant]
        text = f'[lab]\nresults = "results"\n' + PVE.format(port=port, token=token)
    (tmp_path / "lab.toml").write_text(textwrap.dedent(text))


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_the_table_is_large_enough():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("argv,fragment,variant", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_invocation_exit_2_one_line_nothing_created(place, argv, fragment, variant):
    tmp_path, workdir = place
    port = _closed_port()
    _write(tmp_path, workdir, variant, port)
    before = _tree(tmp_path)
    res = run_lab_cli(*argv, cwd=tmp_path, timeout=120,
                      env={"LAB_TEST_PVE_TOKEN": "lab@pve!t=00000000-dead-beef-0000-000000000000"})
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("lab: error: ") and fragment.format(port=port) in lines[0], lines[0]
    assert "dead-beef" not in res.stderr  # no secret in a message
    assert _tree(tmp_path) == before, "something was created"
    assert list(workdir.iterdir()) == []
    assert local.qemu_processes(workdir) == []
