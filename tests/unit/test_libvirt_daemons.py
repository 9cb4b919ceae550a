"""The daemons the qemu:///system tests and the chaos suite share (tests/support/libvirt_daemons.py): a
socket file left by a virtlogd killed with -9 is not taken for a serving daemon (CI once failed
every libvirt domain start on such a file: "Connection refused")."""

from __future__ import annotations

import socket

from support import libvirt_daemons


def test_serving_tells_a_listener_from_a_stale_socket_file(tmp_path):
    path = tmp_path / "sock"
    assert not libvirt_daemons.serving(path)  # no file
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1)
    try:
        assert libvirt_daemons.serving(path)
    finally:
        s.close()
    assert path.exists()  # what a daemon killed with -9 leaves behind
    assert not libvirt_daemons.serving(path)
