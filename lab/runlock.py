"""Is a run alive on this machine? The `lab run` process holds an flock on a per-run file for the
run's whole life; `lab gc`, another process, asks whether anyone still holds it. The kernel drops
an flock when its holder dies, `kill -9` included, so a killed run reads as dead at once, with no
pid files to trust and no timeouts to guess."""

from __future__ import annotations

import fcntl
import glob
import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator

from lab.model import Owned
from lab.wait import wait_until

# Run locks of remote backends (libvirt, Proxmox) live on the orchestrating machine, like the
# local backend's workdir: only this machine can tell whether its own runs are alive.
RUN_LOCK_DIR = Path("/var/tmp/lab")


def run_lock_path(results_dir: Path, run_id: str) -> Path:
    """Held by `lab run` while it runs `run_id`, beside the results store it writes."""
    return Path(results_dir) / f"run-{run_id}.lock"


class RunLock:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._fh: IO[str] | None = None

    def acquire(self, what: str, timeout: float = 10.0) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        got: list[IO[str]] = []

        def locked() -> bool:
            fh = open(self.path, "a")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live run; or a `lab gc` testing the lock for a moment
                fh.close()
                return False
            if not _same_file(fh, self.path):  # its holder or gc removed it meanwhile: lock the new one
                fh.close()
                return False
            got.append(fh)
            return True

        wait_until(locked, timeout=timeout, what=what)
        fh = got[0]
        fh.truncate(0)
        fh.write(str(os.getpid()))
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        """Drop the file, then the lock (idempotent). Unlinked while still held: whoever waits on
        the old file then finds it gone and locks a new one, never a file nobody can see."""
        if self._fh is not None:
            self.path.unlink(missing_ok=True)
            self._fh.close()
            self._fh = None


@contextmanager
def exclusive(path: Path, what: str, timeout: float) -> Iterator[None]:
    """A mutex between the processes of this machine for the block: an flock on `path`."""
    lock = RunLock(path)
    lock.acquire(what=what, timeout=timeout)
    try:
        yield
    finally:
        lock.release()


def _same_file(fh: IO[str], path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fh.fileno())
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


@contextmanager
def _probe(path: Path) -> Iterator[tuple[bool | None, IO[str] | None]]:
    """(None, None): no such file. (True, None): a live process holds it. (False, fh): nobody
    did, and this process holds it through `fh` for the block."""
    try:
        fh = open(path)
    except FileNotFoundError:
        yield None, None
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield True, None
            return
        yield False, fh


def held(path: Path) -> bool | None:
    """True: a live process holds the lock. False: the file is there but nobody holds it (the run
    died without cleaning up). None: no such file (the run finished, or another machine ran it)."""
    with _probe(path) as (state, _fh):
        return state


def remove_if_dead(path: Path) -> bool:
    """Remove the lock file of a run that died without cleaning up (nobody holds it); True if
    removed. It is unlinked while this process holds it, so a `lab run --resume` racing the
    removal locks a fresh file (RunLock.acquire checks), never the removed one."""
    with _probe(path) as (state, fh):
        if state is not False or fh is None or not _same_file(fh, Path(path)):
            return False
        Path(path).unlink()
        return True


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

    def owned(self, backend: str) -> list[Owned]:
        """The lock files of this machine's runs on this host, as `lab gc` items: a run killed
        with -9 leaves its file behind."""
        example = self.path_of("")
        prefix = example.name.removesuffix(".lock")
        return [Owned(backend=backend, kind="lock", name=p.name, run_id=p.name[len(prefix):-len(".lock")],
                      detail=str(p))
                for p in sorted(example.parent.glob(f"{glob.escape(prefix)}*.lock"))]

    def live(self, run_id: str) -> bool | None:
        """True/False for runs orchestrated from this machine (their lock here is held or not);
        None for runs of other machines, which only their lease expiry retires."""
        return held(self.path_of(run_id))
