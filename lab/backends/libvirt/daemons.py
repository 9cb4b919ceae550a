"""libvirtd and virtlogd on this machine, started only when they are not already serving, and stopped
again by whoever started them: for `make bench`'s Vagrant part, the qemu:///system tests and the
chaos suite (tests/support/libvirt_daemons.py adds one pair for a whole pytest session).

Where no init system starts them (containers, CI machines) the daemons run in the foreground as
the caller's children (proc.spawn). A socket file is no proof of a daemon: one killed with -9
leaves its socket behind, and libvirt then fails every domain start with "Failed to connect socket
to '/run/libvirt/virtlogd-sock': Connection refused". So "serving" means a connect() succeeds.
"""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

from lab import proc
from lab.backends.libvirt import kvmdevice
from lab.errors import LabError
from lab.wait import wait_until

URI = "qemu:///system"
RUN_DIR = Path("/run/libvirt")
VIRTLOGD_SOCK = RUN_DIR / "virtlogd-sock"
LIBVIRTD_SOCK = RUN_DIR / "libvirt-sock"


def serving(path: Path) -> bool:
    """Does a daemon accept connections on this UNIX socket?"""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def libvirtd_answers() -> bool:
    return serving(LIBVIRTD_SOCK) and proc.run(["virsh", "-c", URI, "version"], timeout=30, check=False).ok


def _start(argv: list[str], ready, what: str) -> subprocess.Popen:
    daemon = proc.spawn(argv)

    def up() -> bool:
        if daemon.poll() is not None:
            raise LabError(f"{argv[0]} exited with status {daemon.returncode}")
        return ready()

    try:
        wait_until(up, timeout=60, what=what, interval=0.2)
    except BaseException:
        stop([daemon])
        raise
    return daemon


def ensure_running() -> list[subprocess.Popen]:
    """virtlogd, then libvirtd, each started if it does not serve; the ones started, libvirtd
    first (the order to stop them in). A stale socket file is replaced by the daemon's bind."""
    # /dev/kvm as udev's rule would have it (these machines have no udev): else every define and
    # start of the tests' domains waits ~30 s for libvirt to probe QEMU again, a running libvirtd's
    # too (lab.backends.libvirt.kvmdevice; `lab doctor` says so on a user's machine)
    if kvmdevice.qemu_user_problem():
        kvmdevice.grant_group()
    started: list[subprocess.Popen] = []
    try:
        if not serving(VIRTLOGD_SOCK):
            started.append(_start(["virtlogd"], lambda: serving(VIRTLOGD_SOCK), "virtlogd to listen"))
        if not libvirtd_answers():
            started.insert(0, _start(["libvirtd"], libvirtd_answers, f"libvirtd to answer on {URI}"))
    except BaseException:
        stop(started)
        raise
    return started


def stop(started: list[subprocess.Popen]) -> None:
    """SIGTERM each (libvirtd before virtlogd), SIGKILL what does not exit within 30 s."""
    for daemon in started:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=10)
