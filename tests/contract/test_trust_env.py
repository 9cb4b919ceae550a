"""Issue 35: odd environments and what a check may leave behind. With HOME unset and a uid that has
no passwd entry, every command used to die with a traceback at import (the state directory was
computed then); now the commands that need no state work and the others say why in one line.
`lab plan --check` of a host that cannot be reached creates nothing (the SmartOS backend made the
state directory, mode 0755, for its ssh sockets); a run refused by a host's own checks as it
opens records nothing in the store."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from support.cli import LAB, lab_cli

import lab
from lab import config, statedir
from lab.errors import ConfigError, UsageError
from lab.store import Store

UNSHARE = shutil.which("unshare")


def as_nobody_without_home(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`lab ARGV` as uid 12345, which has no passwd entry, with HOME, XDG_STATE_HOME and
    LAB_STATE_DIR unset (a user namespace maps it to this user, so the interpreter stays readable)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_STATE_HOME", statedir.STATE_ENV)}
    env["PYTHONPATH"] = str(lab.PROJECT_ROOT)
    return subprocess.run(
        [UNSHARE, "--user", "--map-user=12345", "--map-group=12345", *LAB, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def homeless(tmp_path):
    if UNSHARE is None:
        pytest.skip("needs unshare")
    probe = subprocess.run([UNSHARE, "--user", "--map-user=12345", "id", "-u"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != "12345":
        pytest.skip(f"user namespaces are not available here: {probe.stderr.strip()}")
    s = Store(tmp_path / "results")
    s.create_run("r1", "t", config_path="", config_text="", seed=1, lab_version="0", manifest={})
    s.finish_run("r1", "done")
    s.close()
    (tmp_path / "lab.toml").write_text('[lab]\nresults = "results"\n')
    return tmp_path


def test_without_home_or_passwd_entry_the_reading_commands_work(homeless):
    for argv in (["--help"], ["--version"], ["plan"], ["ls"], ["show", "r1"], ["report", "r1", "-o", "r.html"]):
        res = as_nobody_without_home(argv, homeless)
        assert "Traceback" not in res.stderr, (argv, res.stderr)
        assert res.returncode == 0, (argv, res.stderr)


def test_without_home_or_passwd_entry_a_run_says_why_in_one_line(homeless):
    (homeless / "lab.toml").write_text(
        '[lab]\nresults = "results"\n[hosts.pve]\nbackend = "proxmox"\nurl = "https://127.0.0.1:9"\nnode = "pve"\n'
        'token = "env:LAB_TEST_UNSET_TOKEN"\n[matrix]\nhost = ["pve"]\n'
    )
    before = sorted(p.name for p in homeless.rglob("*"))
    res = as_nobody_without_home(["run"], homeless)
    assert "Traceback" not in res.stderr
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert "HOME is not set and uid 12345 has no passwd entry" in line and "LAB_STATE_DIR" in line, line
    assert sorted(p.name for p in homeless.rglob("*")) == before


def test_a_tilde_with_no_home_to_expand_to_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(statedir.pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    table = {"backend": "local", "client": "ssh:lab@client1", "client_known_hosts": "~/.ssh/known_hosts"}
    with pytest.raises(ConfigError) as err:
        config.parse({"hosts": {"local": table}}, "lab.toml")
    assert str(err.value).startswith(
        "lab.toml: hosts.local.client_known_hosts = '~/.ssh/known_hosts': cannot expand ~: "
    )
    monkeypatch.delenv(statedir.STATE_ENV, raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setattr(statedir.os, "geteuid", lambda: 12345)
    assert statedir.default_dir() == statedir.NO_HOME and statedir.home() is None
    with pytest.raises(UsageError, match="HOME is not set and uid 12345 has no passwd entry"):
        statedir.check(statedir.NO_HOME / "local")
    with pytest.raises(UsageError, match="HOME is not set"):
        statedir.ensure(statedir.NO_HOME / "local")


# -- what a check leaves behind -----------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "host",
    [
        'backend = "smartos"\nssh = "root@127.0.0.1"\nssh_port = {port}\nclient_address = "10.0.0.5"',
        'backend = "libvirt"\nuri = "qemu+ssh://root@127.0.0.1:{port}/system?no_tty=1"',
        'backend = "proxmox"\nurl = "https://127.0.0.1:{port}"\nnode = "pve1"\ntoken = "env:LAB_TEST_PVE_TOKEN"',
    ],
    ids=["smartos", "libvirt", "proxmox"],
)
def test_plan_check_of_an_unreachable_host_creates_nothing(tmp_path, host):
    (tmp_path / "lab.toml").write_text(f'[hosts.h]\n{host.format(port=_closed_port())}\n[matrix]\nhost = ["h"]\n')
    state = tmp_path / "state-parent" / "state"
    env = {statedir.STATE_ENV: str(state), "LAB_TEST_PVE_TOKEN": "lab@pve!t=00000000-0000-0000-0000-000000000000"}
    res = lab_cli("plan", "--check", cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.toml"]  # no state directory, no results


def test_a_workdir_whose_folder_anyone_may_write_is_refused_by_the_check(tmp_path):
    """ensure() made it and then refused it (the run already recorded); check() now says so first."""
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(UsageError, match="which anyone may write to"):
        statedir.check(tmp_path / "open" / "work")
    assert not (tmp_path / "open" / "work").exists()


def test_a_run_refused_as_a_host_opens_records_nothing(fake_lab, monkeypatch):
    import fakes.backend

    path = fake_lab.write()
    first = lab_cli("run", "-c", str(path), "--run-id", "before", cwd=fake_lab.dir)
    assert first.returncode == 0, first.stderr
    db = fake_lab.dir / "results" / "lab.db"

    def refuse(self, run_id):
        raise UsageError(f"host {self.host_name!r}: workdir /x is not usable (fake)")

    monkeypatch.setattr(fakes.backend.FakeBackend, "open_run", refuse)
    res = lab_cli("run", "-c", str(path), "--run-id", "refused", cwd=fake_lab.dir)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == "lab: error: host 'f': workdir /x is not usable (fake)"
    s = Store(fake_lab.dir / "results")
    try:
        assert [r.id for r in s.runs()] == ["before"]
        assert s.cells("refused") == [] and s.host_facts.of_run("refused") == {}
    finally:
        s.close()
    assert db.exists()
