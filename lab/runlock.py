"""Is a run alive on this machine? The `lab run` process holds an flock on a per-run file for the
run's whole life; `lab gc`, another process, asks whether anyone still holds it. The kernel drops
an flock when its holder dies, `kill -9` included, so a killed run reads as dead at once, with no
pid files to trust and no timeouts to guess."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO, Callable

from lab.errors import LabError
from lab.wait import wait_until

# Run locks of remote backends (libvirt, Proxmox) live on the orchestrating machine, like the
# local backend's workdir: only this machine can tell whether its own runs are alive.
RUN_LOCK_DIR = Path("/var/tmp/lab")


class RunLock:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._fh: IO[str] | None = None

    def acquire(self, what: str, timeout: float = 10.0) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "w")

        def locked() -> bool:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:  # a `lab gc` may be testing the lock for a moment
                return False

        try:
            wait_until(locked, timeout=timeout, what=what)
        except LabError:
            fh.close()
            raise
        fh.write(str(os.getpid()))
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        """Drop the lock and its file (idempotent)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.path.unlink(missing_ok=True)


def held(path: Path) -> bool | None:
    """True: a live process holds the lock. False: the file is there but nobody holds it (the run
    died without cleaning up). None: no such file (the run finished, or another machine ran it)."""
    try:
        fh = open(path)
    except FileNotFoundError:
        return None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


class RunLocks:
    """The run locks a backend whose VMs live elsewhere (libvirt, Proxmox) keeps on this machine,
    one per run, held for the run's life: `lab gc` here tells a live run from one killed with -9.
    `path_of(run_id)` names the lock file."""

    def __init__(self, path_of: Callable[[str], Path]):
        self.path_of = path_of
        self._held: dict[str, RunLock] = {}

    def acquire(self, run_id: str, what: str) -> None:
        lock = RunLock(self.path_of(run_id))
        lock.acquire(what=what)
        self._held[run_id] = lock

    def release(self, run_id: str) -> None:
        lock = self._held.pop(run_id, None)
        if lock is not None:
            lock.release()

    def live(self, run_id: str) -> bool | None:
        """True/False for runs orchestrated from this machine (their lock here is held or not);
        None for runs of other machines, which only their lease expiry retires."""
        return held(self.path_of(run_id))
