"""libvirtd and virtlogd for the qemu:///system tests and the chaos suite: lab.backends.libvirt.daemons
starts them only when they are not already serving, and whoever started them stops them; here, one
pair for a whole pytest session, its xdist workers included.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
from pathlib import Path

from lab.backends.libvirt.daemons import (  # noqa: F401 - the tests import them from here
    LIBVIRTD_SOCK,
    URI,
    VIRTLOGD_SOCK,
    ensure_running,
    libvirtd_answers,
    serving,
    stop,
)
from lab.errors import TimeoutError_
from lab.wait import wait_until

# A test's own virsh call (define, dumpxml, list): libvirtd answers in well under a second when idle,
# but took over 30 s beside two workers' VMs (the chaos suite's planting failed on it in a fresh-clone run).
VIRSH_TIMEOUT = 180


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
