"""Bad CLI invocations as the tests run them (tests/unit/test_bad_input.py, and its cases that need
root or the image in tests/contract/test_bad_input_host.py and tests/vm/test_bad_input_vm.py): each
must exit 2 with exactly one line on stderr naming the argument or value, no traceback, and create
nothing: no file anywhere under the test's directory (no results dir, no store, no run lock),
nothing in the local backend's workdir, no QEMU process of that workdir."""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path

import pytest

from lab.backends import local
from lab.store import Store
from support.cli import lab_cli


def closed_port() -> int:
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


def make_place(tmp_path: Path) -> tuple[Path, Path]:
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


def write_variant(tmp_path: Path, workdir: Path, variant: str, port: int) -> dict:
    """Write the variant's lab.toml; the environment its command runs with (None: unset)."""
    env: dict = {}
    if variant.startswith("local-state-"):
        real = tmp_path / "state-real"
        real.mkdir(mode=0o700)
        if variant == "local-state-symlink":
            (tmp_path / "state").symlink_to(real)
            env["LAB_STATE_DIR"] = str(tmp_path / "state")
        else:
            os.chown(real, 65534, 65534)
            env["LAB_STATE_DIR"] = str(real)
        variant = "local"
    if variant.startswith("local-planted-"):  # what `-o` names: never replaced (lab.outfiles)
        if variant.endswith("link"):
            (tmp_path / "planted.html").symlink_to(tmp_path / "lab.db-victim")
        else:
            os.mkfifo(tmp_path / "planted.html")
        variant = "local"
    if variant == "smartos-closed":  # its ssh sockets' directory used to be made in the state directory
        env["LAB_STATE_DIR"] = str(tmp_path / "state")
        text = (
            f'[lab]\nresults = "results"\n[hosts.gz]\nbackend = "smartos"\nssh = "root@127.0.0.1"\n'
            f'ssh_port = {port}\nclient_address = "10.0.0.5"\n[matrix]\nhost = ["gz"]\n'
        )
        (tmp_path / "lab.toml").write_text(text)
        return env
    if variant == "local-open-workdir":
        workdir.chmod(0o775)
        variant = "local"
    if variant == "local":
        text = f'[lab]\nresults = "results"\n[hosts.local]\nbackend = "local"\nworkdir = "{workdir}"\n'
    elif variant == "fake":
        text = (
            f'[lab]\nresults = "results"\n[hosts.local]\nbackend = "local"\nworkdir = "{workdir}"\n'
            '[hosts.f]\nbackend = "fake"\n[matrix]\nhost = ["f"]\n[suite]\nworkloads = ["fake-work"]\n'
        )
    elif variant == "pve-file-relative":  # a token beside the current directory is not lab.toml's
        (tmp_path / "pve.token").write_text("lab@pve!t=00000000-dead-beef-0000-000000000000\n")
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / "lab.toml").write_text(
            '[lab]\nresults = "results"\n' + PVE.format(port=port, token="file:pve.token")
        )
        return env
    else:
        if variant == "pve-file-fifo":
            os.mkfifo(tmp_path / "pve.fifo")
        token = {
            "pve-file-device": "file:/dev/zero",
            "pve-file-directory": f"file:{tmp_path}",
            "pve-file-fifo": f"file:{tmp_path / 'pve.fifo'}",
            "pve-file-unknown-user": "file:~nosuchuser-lab/t",
            "pve-env": "env:LAB_TEST_UNSET_TOKEN",
            "pve-file": f"file:{tmp_path}/no-such-token",
            "pve-closed": "env:LAB_TEST_PVE_TOKEN",
            "pve-env-empty": "env:",
            "pve-file-empty": "file:",
        }[variant]
        text = '[lab]\nresults = "results"\n' + PVE.format(port=port, token=token)
    (tmp_path / "lab.toml").write_text(textwrap.dedent(text))
    return env


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def values(case):
    return case.values if hasattr(case, "values") else case


def param(case):
    name, *rest = values(case)
    return pytest.param(*rest, id=name, marks=getattr(case, "marks", ()))


def check(place: tuple[Path, Path], argv: list[str], fragment: str, variant: str, request) -> None:
    """Run `lab ARGV` in the variant's lab and check the one line, the exit status and that nothing
    was created."""
    tmp_path, workdir = place
    if variant == "fake":
        request.getfixturevalue("fake_lab")
    port = closed_port()
    env = write_variant(tmp_path, workdir, variant, port)
    before = tree(tmp_path)
    res = lab_cli(
        *argv,
        cwd=tmp_path,
        env={
            "LAB_TEST_PVE_TOKEN": "lab@pve!t=00000000-dead-beef-0000-000000000000",
            "LAB_TEST_UNSET_TOKEN": None,
            **env,
        },
    )
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("lab: error: ") and fragment.format(port=port) in lines[0], lines[0]
    assert "dead-beef" not in res.stderr  # no secret in a message
    assert tree(tmp_path) == before, "something was created"
    assert list(workdir.iterdir()) == []
    assert local.qemu_processes(workdir) == []
