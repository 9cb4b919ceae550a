"""A libvirt URI to another machine over a transport other than SSH (issue 16): lab would run the
host's commands (zfs, qemu-img, rm, arp) on this machine instead; `lab plan` refuses it in one
line naming file, key and value unless `ssh = "user@host"` says where they go."""

from __future__ import annotations

import pytest

from lab.backends.libvirt.backend import LibvirtBackend
from lab.backends.libvirt.settings import Settings
from lab.config import parse
from lab.errors import ConfigError, SettingError


@pytest.mark.parametrize(
    "uri",
    [
        "qemu+tcp://kvm1/system",
        "qemu+tls://kvm1/system",
        "qemu://kvm1/system",
        "bhyve+tcp://bsd1/system",
    ],
)
def test_remote_uri_over_another_transport_needs_ssh(uri):
    table = {"backend": "libvirt", "uri": uri, **({"dataset": "zroot/lab"} if uri.startswith("bhyve") else {})}
    with pytest.raises(ConfigError) as exc:
        parse({"hosts": {"h1": table}}, source="lab.toml")
    msg = str(exc.value)
    assert msg.startswith(f"lab.toml: hosts.h1.uri = {uri!r}: ") and "\n" not in msg and 'ssh = "user@host"' in msg
    with pytest.raises(SettingError, match="would run on this machine"):
        LibvirtBackend("h1", Settings(**table))
    b = LibvirtBackend("h1", Settings(**table, ssh="root@kvm1"))
    assert b.shell.argv(["true"])[-2:] == ["root@kvm1", "true"]


@pytest.mark.parametrize(
    "uri",
    [
        "qemu:///system",
        "qemu+unix:///system",
        "qemu+tcp://localhost/system",
        "qemu+libssh2://root@kvm1/system",
        "test:///default",
    ],
)
def test_local_and_ssh_uris_need_no_ssh_key(uri):
    assert Settings(backend="libvirt", uri=uri).problems() == []
