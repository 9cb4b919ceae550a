"""Bad CLI invocations (the lab.toml corpus is tests/data/bad-config, checked by test_config.py):
each must exit 2 with exactly one line on stderr naming the argument or value, no traceback, and
create nothing: no file anywhere under the test's directory (no results dir, no store, no run
lock), nothing in the local backend's workdir (its namespaces and taps exist only after the
run's lock file there), no QEMU process of that workdir.

They run in this process through click's CliRunner (lab_cli). The cases that reach the local
backend's checks and the golden image before they can fail (a resume of an unknown run) need root
and the image: those are marked, and each has a twin on the fake backend in the fast lane."""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path

import pytest
from conftest import lab_cli

from lab.backends import local
from lab.store import Store


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
    pytest.param(
        "resume-unknown-run",
        ["run", "--resume", "nope"],
        "no run 'nope'",
        "local",
        marks=[pytest.mark.root, pytest.mark.image],
    ),
    pytest.param(
        "resume-ambiguous",
        ["run", "--resume", "r"],
        "is ambiguous",
        "local",
        marks=[pytest.mark.root, pytest.mark.image],
    ),
    ("resume-unknown-run-fake", ["run", "--resume", "nope"], "no run 'nope'", "fake"),
    ("resume-ambiguous-fake", ["run", "--resume", "r"], "is ambiguous", "fake"),
    ("run-id-path", ["run", "--run-id", "../x"], "--run-id '../x'", "local"),
    ("run-id-upper", ["run", "--run-id", "ABC"], "--run-id 'ABC'", "local"),
    ("run-id-taken", ["run", "--run-id", "r1"], "already has a run of that id", "local"),
    # issue 35: a "-" made another run's sweep take this run's machines for its own
    ("run-id-dash", ["run", "--run-id", "nightly-1"], "--run-id 'nightly-1': is not a usable run id", "local"),
    ("report-over-a-symlink", ["report", "r1", "-o", "planted.html"], "is a symbolic link", "local-planted-link"),
    ("report-over-a-fifo", ["report", "r1", "-o", "planted.html"], "is a FIFO", "local-planted-fifo"),
    ("plan-check-unreachable-smartos-makes-no-state", ["plan", "--check"], "port {port}", "smartos-closed"),
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
    ("compare-margin-zero", ["compare", "r1", "r2", "--margin", "0"], "--margin 0: must be a percentage", "local"),
    ("compare-margin-100", ["compare", "r1", "--baseline", "--margin", "100"], "--margin 100", "local"),
    ("compare-margin-text", ["compare", "r1", "r2", "--margin", "tight"], "'tight' is not a valid float", "local"),
    ("report-unknown-run", ["report", "nope"], "no run 'nope'", "local"),
    ("history-unknown-host", ["history", "pve9"], "no series of host pve9", "local"),
    ("history-bad-cell", ["history", "--cell", "nic"], "--cell 'nic': expected AXIS=VALUE", "local"),
    ("history-last-1", ["history", "--last", "1"], "--last", "local"),
    ("history-no-store", ["history", "--results", "elsewhere"], "no runs in elsewhere", "local"),
    ("import-not-a-store", ["import", "nowhere"], "nowhere: not a results store", "local"),
    ("import-itself", ["import", "results"], "is this results store itself", "local"),
    ("prune-without-keep", ["prune"], "--keep", "local"),
    ("prune-keep-0", ["prune", "--keep", "0"], "--keep", "local"),
    ("prune-no-store", ["prune", "--keep", "1", "--results", "elsewhere"], "no runs in elsewhere", "local"),
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
    # nothing stored from a host that did not answer; the line names file, key and value
    ("snapshot-unreachable", ["snapshot", "pve1"], "hosts.pve1.url = 'https://127.0.0.1:{port}'", "pve-closed"),
    # issue 16: what is wrong with the arguments is said before any host is asked
    ("resume-unknown-before-host-checks", ["run", "--resume", "nope"], "no run 'nope'", "pve-closed"),
    ("resume-ambiguous-before-host-checks", ["run", "--resume", "r"], "is ambiguous", "pve-closed"),
    ("resume-unknown-before-secrets", ["run", "--resume", "nope"], "no run 'nope'", "pve-env"),
    ("run-id-taken-before-host-checks", ["run", "--run-id", "r1"], "already has a run of that id", "pve-closed"),
    ("show-results-is-a-file", ["show", "--results", "lab.toml"], "lab.toml", "local"),
    ("snapshot-token-file-missing", ["snapshot", "pve1"], "cannot read secret file", "pve-file"),
    ("snapshot-token-env-unset", ["snapshot", "pve1"], "LAB_TEST_UNSET_TOKEN", "pve-env"),
    ("plan-check-token-env-unset", ["plan", "--check"], "LAB_TEST_UNSET_TOKEN", "pve-env"),
    ("run-token-env-empty", ["run"], 'names no variable after "env:"', "pve-env-empty"),
    ("plan-token-file-empty", ["plan"], 'names no file after "file:"', "pve-file-empty"),
    ("run-secret-file-relative-to-lab-toml", ["run", "-c", "sub/lab.toml"], "sub/pve.token", "pve-file-relative"),
    # issue 35: a special file where the secret's regular file is meant: never read (a FIFO would
    # hang the run, /dev/zero never end it)
    ("run-secret-file-device", ["run"], "/dev/zero: is a character device", "pve-file-device"),
    ("run-secret-file-directory", ["run"], "is a directory", "pve-file-directory"),
    ("run-secret-file-fifo", ["run"], "is a FIFO (named pipe)", "pve-file-fifo"),
    ("snapshot-secret-file-fifo", ["snapshot", "pve1"], "is a FIFO (named pipe)", "pve-file-fifo"),
    ("run-secret-file-unknown-user", ["run"], "~nosuchuser-lab/t", "pve-file-unknown-user"),
    pytest.param(
        "run-workdir-group-writable",
        ["run"],
        "is writable by its group",
        "local-open-workdir",
        marks=[pytest.mark.root],
    ),
    pytest.param(
        "run-state-dir-symlink", ["run"], "is a symbolic link", "local-state-symlink", marks=[pytest.mark.root]
    ),
    pytest.param(
        "run-state-dir-someone-elses", ["run"], "is owned by nobody", "local-state-nobody", marks=[pytest.mark.root]
    ),
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


def _write(tmp_path: Path, workdir: Path, variant: str, port: int) -> dict:
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


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _values(case):
    return case.values if hasattr(case, "values") else case


def _param(case):
    name, *rest = _values(case)
    return pytest.param(*rest, id=name, marks=getattr(case, "marks", ()))


def test_the_table_is_large_enough():
    names = [_values(c)[0] for c in CASES]
    assert len(CASES) >= 45 and len(set(names)) == len(CASES)


@pytest.mark.parametrize("argv,fragment,variant", [_param(c) for c in CASES])
def test_bad_invocation_exit_2_one_line_nothing_created(place, argv, fragment, variant, request):
    tmp_path, workdir = place
    if variant == "fake":
        request.getfixturevalue("fake_lab")
    port = _closed_port()
    env = _write(tmp_path, workdir, variant, port)
    before = _tree(tmp_path)
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
    assert _tree(tmp_path) == before, "something was created"
    assert list(workdir.iterdir()) == []
    assert local.qemu_processes(workdir) == []
