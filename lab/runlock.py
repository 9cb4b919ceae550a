"""Is a run alive on this machine? The `lab run` process holds an flock on a per-run file for the
run's whole life; `lab gc`, another process, asks whether anyone still holds it. The kernel drops
an flock when its holder dies, `kill -9` included, so a killed run reads as dead at once, with no
pid files to trust and no timeouts to guess.

A lock file is the lab's when it holds the pid its holder wrote (digits, or nothing yet): `lab gc`
lists and removes only those, so a file planted under a lab-like name is never taken for a dead run's. Lock
files are opened with O_NOFOLLOW: a symbolic link planted at a lock's name is never followed."""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from lab import statedir
from lab.errors import LabError
from lab.model import Owned
from lab.wait import wait_until

# Run locks of remote backends (libvirt, Proxmox) live on the orchestrating machine, in its private
# state directory (lab.statedir): only this machine can tell whether its own runs are alive. The
# directory as it was when the lab was imported; BackendEnv.state_dir is what backends use.
RUN_LOCK_DIR = statedir.default_dir()
# what RunLock writes: its holder's pid (empty: made, and its holder killed before it wrote it)
LAB_LOCK = re.compile(r"\d*\s*")


def run_lock_path(results_dir: Path, run_id: str) -> Path:
    """Held by `lab run` while it runs `run_id`, beside the results store it writes."""
    return Path(results_dir) / f"run-{run_id}.lock"


class RunLock:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._fh: IO[str] | None = None

    def acquire(self, what: str, timeout: float = 10.0) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        got: list[IO[str]] = []

        def locked() -> bool:
            try:
                fh = _open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, "a")
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise LabError(
                        f"lock file {self.path} is a symbolic link: refusing it (it may point anywhere)",
                        hint="remove it; only another user of this machine could have put it there",
                    ) from None
                raise
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
    """A mutex between the processes of this machine for the block: an flock on `path`, in a
    directory private to this user (lab.statedir)."""
    statedir.ensure(Path(path).parent)
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
    """(None, None): no such file (or a symbolic link). (True, None): a live process holds it.
    (False, fh): nobody did, and this process holds it through `fh` for the block."""
    try:
        fh = _open(path, os.O_RDONLY, "r")
    except FileNotFoundError:
        yield None, None
        return
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        yield None, None  # a symbolic link: not a lock the lab made
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield True, None
            return
        yield False, fh


def _open(path: Path, flags: int, mode: str) -> IO[str]:
    """A lock file as a text file, never through a symbolic link (OSError ELOOP on one)."""
    return os.fdopen(statedir.open_file(path, flags, 0o600), mode)


def is_lab_lock(path: Path) -> bool:
    """The file holds what a RunLock writes (a pid): the lab made it."""
    try:
        return LAB_LOCK.fullmatch(statedir.read_text(path)) is not None
    except OSError:
        return False


def held(path: Path) -> bool | None:
    """True: a live process holds the lock. False: the file is there but nobody holds it (the run
    died without cleaning up). None: no such file (the run finished, or another machine ran it)."""
    with _probe(path) as (state, _fh):
        return state


def remove_if_dead(path: Path) -> bool:
    """Remove the lock file of a run that died without cleaning up (nobody holds it); True if
    removed. It is unlinked while this process holds it, so a `lab run --resume` racing the
    removal locks a fresh file (RunLock.acquire checks), never the removed one. A file the lab did
    not write (is_lab_lock) is left alone."""
    with _probe(path) as (state, fh):
        if state is not False or fh is None or not _same_file(fh, Path(path)):
            return False
        fh.seek(0)
        if LAB_LOCK.fullmatch(fh.read()) is None:
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
        path = self.path_of(run_id)
        statedir.ensure(path.parent)  # private to this user: gc trusts what it finds there
        lock = RunLock(path)
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
        return [
            Owned(backend=backend, kind="lock", name=p.name, run_id=p.name[len(prefix) : -len(".lock")], detail=str(p))
            for p in sorted(example.parent.glob(f"{glob.escape(prefix)}*.lock"))
            if is_lab_lock(p)
        ]

    def live(self, run_id: str) -> bool | None:
        """True/False for runs orchestrated from this machine (their lock here is held or not);
        None for runs of other machines, which only their lease expiry retires."""
        return held(self.path_of(run_id))
