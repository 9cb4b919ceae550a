"""Issue 35: what a lab.toml may make the lab run (lab.programs), and no password of a URL's
user-info in any line, log or result (lab.redact).

A libvirt URI is an address: its `ext` transport and its parameters that name a program
(`command`, `netcat`) or turn a check off (`no_verify`, `known_hosts_verify`) are refused as
lab.toml is read, with the rest of libvirt's documented parameters allowed and any other refused.
The program such a URI names is never run, by `lab plan --check` or by `lab run`."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from support.cli import lab_cli

from lab import config, programs, redact
from lab.errors import ConfigError, HostUnreachable, LabError
from lab.store import Store

CORPUS = sorted((Path(__file__).parents[1] / "data" / "bad-config").glob("*.toml"))


@pytest.mark.parametrize(
    "uri,words",
    [
        ("qemu+ext:///system?command=/bin/true", "the ext transport runs a program"),
        ("bhyve+ext://bsd1/system?command=/bin/true", "the ext transport runs a program"),
        ("qemu+ssh://root@kvm1/system?command=/opt/ssh", "'command' names a program for this machine to run"),
        ("qemu+ssh://root@kvm1/system?netcat=/tmp/nc", "'netcat' names a program for the remote host to run"),
        ("qemu+libssh2://root@kvm1/system?netcat=nc", "'netcat' names a program"),
        ("qemu+tls://kvm1/system?no_verify=1", "'no_verify' turns off the host's certificate or host-key check"),
        ("qemu+ssh://root@kvm1/system?no_verify=1", "'no_verify' turns off"),
        ("qemu+libssh://root@kvm1/system?known_hosts_verify=auto", "known_hosts_verify='auto' is not one of normal"),
        ("qemu+ssh://root@kvm1/system?name=qemu:///session", "'name' names another driver URI"),
        ("qemu:///embed?root=/tmp/x", "'root' is not one lab passes to libvirt"),
        ("qemu+ssh://root@kvm1/system?mode=other", "mode='other' is not one of auto, direct, legacy"),
        ("qemu+ssh://root@kvm1/system?no_tty", "its query is not a list of NAME=VALUE parameters"),
        ("qemu+ssh://root@kvm1/system?no_tty=", "no_tty='' is not one of 0, 1"),
        ("qemu+ssh://root:hunter2@kvm1/system", "a password in the URI"),
    ],
)
def test_a_libvirt_uri_that_would_run_a_program_or_skip_a_check_is_refused(uri, words):
    why = programs.libvirt_uri_problem(uri)
    assert why is not None and words in why, why
    for backend in ("libvirt", "vagrant"):
        if backend == "vagrant" and not uri.startswith("qemu"):
            continue
        table = {"backend": backend, "uri": uri, **({"dataset": "z/lab"} if uri.startswith("bhyve") else {})}
        with pytest.raises(ConfigError) as err:
            config.parse({"hosts": {"h1": table}}, "lab.toml")
        assert str(err.value).startswith(f"lab.toml: hosts.h1.uri = {redact.passwords(uri)!r}: ") and words in str(
            err.value
        )
        assert "hunter2" not in str(err.value)


@pytest.mark.parametrize(
    "uri",
    [
        "qemu:///system",
        "qemu+unix:///system?socket=/run/libvirt/virtqemud-sock&mode=direct",
        "qemu+ssh://root@kvm1:2222/system?keyfile=/root/.ssh/lab&no_tty=1&proxy=native",
        "qemu+libssh2://root@kvm1/system?known_hosts=/root/.ssh/known_hosts&sshauth=privkey,agent",
        "qemu+tls://kvm1/system?pkipath=/etc/pki/lab&tls_priority=NORMAL",
        "bhyve+ssh://root@bsd1/system?keyfile=/k&no_tty=1&known_hosts_verify=normal",
        "test:///default",
    ],
)
def test_libvirts_other_documented_parameters_are_allowed(uri):
    assert programs.libvirt_uri_problem(uri) is None


@pytest.fixture
def planted(tmp_path):
    """A program a URI names: it leaves a mark if anything ever runs it."""
    mark = tmp_path / "it-ran"
    script = tmp_path / "planted.sh"
    script.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    script.chmod(0o755)
    return script, mark


@pytest.mark.parametrize("command", [["plan", "--check"], ["run"], ["gc"], ["snapshot", "h1"]])
@pytest.mark.parametrize(
    "host",
    [
        'backend = "libvirt"\nuri = "qemu+ext:///system?command={script}"',
        'backend = "libvirt"\nuri = "qemu+ssh://root@127.0.0.1/system?command={script}"',
        'backend = "vagrant"\nuri = "qemu+ext:///system?command={script}"',
    ],
    ids=["libvirt-ext", "libvirt-ssh-command", "vagrant-ext"],
)
def test_the_program_a_uri_names_never_runs(tmp_path, planted, command, host):
    script, mark = planted
    (tmp_path / "lab.toml").write_text(
        f'[lab]\nresults = "results"\n[hosts.h1]\n{host.format(script=script)}\n[matrix]\nhost = ["h1"]\n'
    )
    res = lab_cli(*command, cwd=tmp_path, env={"LAB_STATE_DIR": str(tmp_path / "state")})
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("lab: error: lab.toml: hosts.h1.uri = ")
    assert not mark.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.toml", "planted.sh"]


# -- no password of a URL, anywhere ----------------------------------------------------------------


def test_the_corpus_never_echoes_a_password():
    for path in CORPUS:
        if b"hunter2" not in path.read_bytes():
            continue
        with pytest.raises(ConfigError) as err:
            config.load(path)
        assert "hunter2" not in str(err.value) and "<redacted>" in str(err.value), path.name


def test_a_pve_url_with_a_password_is_refused_without_showing_it(tmp_path):
    (tmp_path / "lab.toml").write_text(
        '[hosts.pve1]\nbackend = "proxmox"\nurl = "https://root@pam:hunter2@pve1:8006"\nnode = "pve1"\n'
        'token = "env:T"\n[matrix]\nhost = ["pve1"]\n'
    )
    for argv in (["plan"], ["run"], ["snapshot", "pve1"]):
        res = lab_cli(*argv, cwd=tmp_path)
        assert res.returncode == 2
        assert res.stderr.strip().splitlines() == [
            "lab: error: lab.toml: hosts.pve1.url = 'https://root@pam:<redacted>@pve1:8006': has user-info "
            '(user:password@): the password goes in password = "env:NAME" or "file:PATH"'
        ]


def test_every_error_warning_log_and_stored_json_hides_the_password(tmp_path, fake_lab, monkeypatch):
    assert redact.passwords("at https://u:pw@h:8006/x and qemu+ssh://root:pw2@k/system") == (
        "at https://u:<redacted>@h:8006/x and qemu+ssh://root:<redacted>@k/system"
    )
    assert redact.passwords("https://h:8006/a?x=a@b https://user@h") == "https://h:8006/a?x=a@b https://user@h"
    err = HostUnreachable("cannot reach https://lab:hunter2@pve1:8006", hint="check https://lab:hunter2@pve1")
    assert "hunter2" not in str(err) and "hunter2" not in (err.hint or "")
    s = Store(tmp_path / "results")
    s.create_run(
        "r1", "t", config_path="", config_text="", seed=1, lab_version="0", manifest={"uri": "https://a:hunter2@b"}
    )
    assert "hunter2" not in str(s.run("r1").manifest)
    s.close()
    # a warning from the library, and the last guard's line and log
    from lab.cli import group

    def noisy(path, *sets):
        logging.getLogger("lab.somewhere").warning("tried https://lab:hunter2@pve1:8006")
        raise RuntimeError("boom at https://lab:hunter2@pve1:8006")

    monkeypatch.setattr(group.config, "load", noisy)
    res = lab_cli("plan", cwd=fake_lab.dir)
    assert res.returncode == 1 and "hunter2" not in res.stderr and "<redacted>" in res.stderr
    log = Path(res.stderr.strip().rsplit("details in ", 1)[1])
    try:
        assert "hunter2" not in log.read_text() and "<redacted>" in log.read_text()
    finally:
        log.unlink()
    assert isinstance(err, LabError)
