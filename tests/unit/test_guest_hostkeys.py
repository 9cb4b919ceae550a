"""The Guest checks a guest's SSH host key when the backend hands it the image's known_hosts lines
(lab.images.known_hosts), and only then; the lines live in the VM's control directory."""

from __future__ import annotations

from lab.guest import Guest


def option(argv: list[str], name: str) -> str | None:
    values = [
        argv[i + 1].split("=", 1)[1]
        for i, a in enumerate(argv[:-1])
        if a == "-o" and argv[i + 1].startswith(name + "=")
    ]
    return values[-1] if values else None


def test_known_hosts_makes_ssh_strict(tmp_path):
    line = "10.0.0.5 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBz1\n"
    g = Guest("10.0.0.5", key=tmp_path / "k", control_dir=tmp_path, known_hosts=line)
    opts = g._ssh_options()
    assert option(opts, "StrictHostKeyChecking") == "yes"
    assert option(opts, "UserKnownHostsFile") == str(g.known_hosts)
    assert g.known_hosts.parent == tmp_path and g.known_hosts.read_text() == line


def test_without_known_hosts_nothing_is_checked(tmp_path):
    g = Guest("10.0.0.5", key=tmp_path / "k", control_dir=tmp_path)
    opts = g._ssh_options()
    assert g.known_hosts is None
    assert option(opts, "StrictHostKeyChecking") == "no"
    assert option(opts, "UserKnownHostsFile") == "/dev/null"
