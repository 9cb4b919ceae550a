"""Issue 16: secrets. A variable a lab.toml references never reaches a child process (lab.proc is
the one way to start one); a reference with an empty name is a ConfigError naming file, key and
value as lab.toml is read; a relative `file:` secret is relative to lab.toml's folder, not the
current directory; a secret file its group or others may read is used with one warning line."""

from __future__ import annotations

import logging

import pytest
from support.cli import lab_cli

from lab import config, proc, secrets
from lab.errors import ConfigError


def pve_lab(token: str, **extra) -> dict:
    host = {"backend": "proxmox", "url": "https://pve1:8006", "node": "pve1", "token": token, **extra}
    return {"hosts": {"pve1": host}}


def test_a_referenced_variable_never_reaches_a_child(monkeypatch):
    monkeypatch.setenv("LAB_TEST_CHILD_SECRET", "lab@pve!t=very-secret")
    monkeypatch.setenv("LAB_TEST_CHILD_PLAIN", "fine")
    monkeypatch.setattr(secrets, "_referenced", set())
    assert "very-secret" in proc.run(["env"]).stdout  # not referenced yet: an ordinary variable
    config.parse(pve_lab("env:LAB_TEST_CHILD_SECRET"), "x.toml")
    out = proc.run(["env"]).stdout
    assert "very-secret" not in out and "LAB_TEST_CHILD_SECRET" not in out and "LAB_TEST_CHILD_PLAIN=fine" in out
    assert "LAB_TEST_CHILD_SECRET" not in proc.run(["env"], env={"EXTRA": "1"}).stdout
    p = proc.spawn(["sh", "-c", 'test -z "$LAB_TEST_CHILD_SECRET"'])
    assert p.wait(timeout=10) == 0
    # the caller may still hand a child a value on purpose
    assert "LAB_TEST_CHILD_SECRET=given" in proc.run(["env"], env={"LAB_TEST_CHILD_SECRET": "given"}).stdout


def test_resolving_a_reference_also_keeps_it_from_children(monkeypatch):
    monkeypatch.setattr(secrets, "_referenced", set())
    monkeypatch.setenv("LAB_TEST_RESOLVED", "s3cret")
    assert secrets.resolve_secret("env:LAB_TEST_RESOLVED", "x.toml", "hosts.p.token") == "s3cret"
    assert "s3cret" not in proc.run(["env"]).stdout


@pytest.mark.parametrize(
    "ref,problem",
    [
        ("env:", 'names no variable after "env:"'),
        ("file:", 'names no file after "file:"'),
        ("env:   ", "names no variable"),
        ("env:PVE TOKEN", "is not an environment variable name"),
        ("env:1PVE", "is not an environment variable name"),
    ],
)
def test_a_reference_without_a_usable_name_is_refused_as_lab_toml_is_read(ref, problem):
    with pytest.raises(ConfigError) as err:
        config.parse(pve_lab(ref), "lab.toml")
    assert str(err.value) == f"lab.toml: hosts.pve1.token = {ref!r}: {problem}" or str(err.value).startswith(
        f"lab.toml: hosts.pve1.token = {ref!r}: {problem}"
    )


def test_a_relative_secret_file_is_relative_to_lab_toml(tmp_path, monkeypatch):
    (tmp_path / "lab.toml").write_text("")
    (tmp_path / "pve.token").write_text("lab@pve!t=from-the-lab-folder\n")
    (tmp_path / "pve.token").chmod(0o600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "pve.token").write_text("lab@pve!t=from-the-current-directory\n")
    monkeypatch.chdir(elsewhere)
    source = str(tmp_path / "lab.toml")
    assert secrets.resolve_secret("file:pve.token", source, "hosts.p.token") == "lab@pve!t=from-the-lab-folder"
    (tmp_path / "pve.token").unlink()
    with pytest.raises(ConfigError, match=f"cannot read secret file {tmp_path / 'pve.token'}"):
        secrets.resolve_secret("file:pve.token", source, "hosts.p.token")


def test_a_secret_file_others_may_read_is_used_with_one_warning(tmp_path, caplog):
    token = tmp_path / "open.token"
    token.write_text("lab@pve!t=abc\n")
    token.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="lab"):
        assert secrets.resolve_secret(f"file:{token}", "x.toml", "hosts.p.token") == "lab@pve!t=abc"
        secrets.resolve_secret(f"file:{token}", "x.toml", "hosts.p.token")  # once per file
    (record,) = [r for r in caplog.records if "secret file" in r.getMessage()]
    assert record.getMessage() == (
        f"x.toml: hosts.p.token: secret file {token} is readable by group and others (mode 0644); chmod 600 it"
    )
    assert "abc" not in record.getMessage()
    private = tmp_path / "private.token"
    private.write_text("lab@pve!t=abc\n")
    private.chmod(0o600)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lab"):
        secrets.resolve_secret(f"file:{private}", "x.toml", "hosts.p.token")
    assert not caplog.records


def test_the_cli_prints_the_warning_as_one_line(tmp_path):
    """`lab snapshot` builds the backend (the secret is read) before it reaches the host: the warning
    comes first, on its own line, then the host's error."""
    token = tmp_path / "pve.token"
    token.write_text("lab@pve!t=abc\n")
    token.chmod(0o640)
    (tmp_path / "lab.toml").write_text(
        '[hosts.pve1]\nbackend = "proxmox"\nurl = "https://127.0.0.1:9"\nnode = "pve1"\ntoken = "file:pve.token"\n'
    )
    res = lab_cli("snapshot", "pve1", cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert lines[0] == (
        f"lab: warning: lab.toml: hosts.pve1.token: secret file {token} is readable "
        "by its group (mode 0640); chmod 600 it"
    )
    assert len(lines) == 2 and lines[1].startswith("lab: error: ") and "abc" not in res.stderr
