"""The system's libvirt daemons as the tests start them (tests/support/libvirt_daemons.py): a stale
virtlogd socket replaced by a serving daemon."""

from __future__ import annotations

import os
import shutil
import socket

import pytest
from support import libvirt_daemons


# Starts and stops the system's libvirtd: never in the fast lane, and in make test's serial pass,
# where no other test holds the session's daemons (conftest's libvirtd serves both workers before).
@pytest.mark.vm
@pytest.mark.serial
def test_a_stale_virtlogd_socket_is_replaced_by_a_serving_daemon():
    if os.geteuid() != 0 or not shutil.which("virtlogd") or not shutil.which("libvirtd"):
        pytest.skip("needs root and libvirt's daemons (make setup)")
    if libvirt_daemons.serving(libvirt_daemons.VIRTLOGD_SOCK) or libvirt_daemons.serving(libvirt_daemons.LIBVIRTD_SOCK):
        pytest.skip("libvirt's daemons already serve here: no stale socket to make")
    sock = libvirt_daemons.VIRTLOGD_SOCK
    sock.parent.mkdir(parents=True, exist_ok=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.unlink(missing_ok=True)
    stale.bind(str(sock))
    stale.close()
    assert sock.exists() and not libvirt_daemons.serving(sock)

    started = libvirt_daemons.ensure_running()
    try:
        assert [p.args[-1] for p in started] == ["libvirtd", "virtlogd"]
        assert libvirt_daemons.serving(sock)
        assert libvirt_daemons.libvirtd_answers()
        assert libvirt_daemons.ensure_running() == []  # serving now: nothing more is started
    finally:
        libvirt_daemons.stop(started)
    assert all(p.returncode is not None for p in started)
    assert not libvirt_daemons.serving(sock)
