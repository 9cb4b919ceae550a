"""libvirtd and virtlogd for the qemu:///system tests and the chaos suite, started only when they
are not already serving, and stopped again by whoever started them.

No systemd in these containers, so the daemons run in the foreground as our children
(proc.spawn). A socket file is no proof of a daemon: one killed with -9 leaves its socket behind,
and libvirt then fails every domain start with "Failed to connect socket to
'/run/libvirt/virtlogd-sock': Connection refused". So "serving" means a connect() succeeds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
from pathlib import Path

from lab import proc
from lab.backends.libvirt import kvmdevice
from lab.errors import TimeoutError_
from lab.wait import wait_until

URI = "qemu:///system"
# A test's own virsh call (define, dumpxml, list): libvirtd answers in well under a second when idle,
# but took over 30 s beside two workers' VMs (the chaos suite's planting failed on it in a fresh-clone run).
VIRSH_TIMEOUT = 180
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
            raise RuntimeError(f"{argv[0]} exited with status {daemon.returncode}")
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


# -- one pair of daemons for a whole pytest session, its xdist workers included -------------------
# The qemu:///system tests run on both workers. The first to need the daemons starts them; none
# stops them, since the other worker may be using them; the session's main process (the xdist
# controller, or pytest itself without -n) stops them when the session ends. The pids of what was
# started are kept in a file named by that process's pid.


def session_file(session_pid: int) -> Path:
    return Path(f"/run/lab-tests-libvirtd-{session_pid}.json")


def ensure_running_for_session(session_pid: int) -> None:
    """ensure_running() under a lock the workers share; what it started is added to the file."""
    with open("/run/lab-tests-libvirtd.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = ensure_running()
        if started:
            path = session_file(session_pid)
            pids = json.loads(path.read_text()) if path.exists() else []
            path.write_text(json.dumps(pids + [p.pid for p in started]))


def stop_session(session_pid: int) -> None:
    """Stop what the session's workers started (libvirtd before virtlogd): SIGTERM, then SIGKILL
    after 30 s. They are not this process's children, so their end is seen in /proc."""
    path = session_file(session_pid)
    if not path.exists():
        return
    for pid in json.loads(path.read_text()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            try:
                wait_until(lambda: not _alive(pid), timeout=30, what=f"pid {pid} to exit", interval=0.2)
            except TimeoutError_:
                os.kill(pid, signal.SIGKILL)
    path.unlink()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except (FileNotFoundError, IndexError):
        return False
