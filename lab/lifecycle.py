"""One cell's life, written once for every kind of cell (a VM, the host as a bare-metal cell).

    life = CellLife(...)            # the lease is recorded in the store before anything is made
    with life:
        life.enter("clone")         # each stage is recorded as it is entered
        life.vm = backend.clone(...)  # from here on, teardown destroys it
        ...
        life.finish(CellStatus.DONE)
    status = life.status            # what was recorded, teardown included

Leaving the block by a LabError records the cell as failed at the stage it reached, with the
error and the end of the guest's console, and the run goes on; an interrupt (Interrupted) is
recorded the same way and goes on up. Either way, and on success, teardown runs: the cell's own
clean-ups (netem, SSH), then `backend.destroy(vm)`, shielded from SIGINT/SIGTERM so that a second
Ctrl-C cannot leave a VM behind. The lease is released only once the destroy succeeded: a VM that
could not be destroyed keeps its lease for `lab gc`, and fails the cell and, loudly, the run.

Each stage that completes is timed into the store (Store.timings.stage_times): what the next `lab plan`
estimates from (lab.estimate).

In a lane of a run on several hosts (lab.runner.lanes) the cell runs in a thread of its own, where
no signal arrives and shielded() does nothing: the run's `cancel` event stands for the signal (the
next stage entered raises Interrupted), and a HostUnreachable is written into `lost_hosts` so that
the lane ends after this cell.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from lab import lease
from lab.backends import Backend
from lab.errors import HostUnreachable, Interrupted, LabError
from lab.model import CellStatus, Vm
from lab.store import Store

STAGES = ("lease", "clone", "boot", "ssh", "verify", "tune", "workloads", "teardown")
CONSOLE_TAIL_LINES = 15
clock = time.monotonic  # stage times: a module attribute so that tests can step it


@contextlib.contextmanager
def shielded():
    """Teardown must finish: hold SIGINT/SIGTERM until it has (they are delivered after)."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Reporter(Protocol):
    """Progress of a run, as the CLI shows it (lab.cli.progress)."""

    # lanes: cell id -> its lane (lab.runner.lanes), when the run has several
    def run_started(self, run_id: str, cells: list, estimate_s: float, lanes: dict[str, str] | None = None) -> None: ...
    def cell_started(self, cell: Any, position: int, total: int) -> None: ...
    def stage(self, cell: Any, stage: str, detail: str = "") -> None: ...
    def cell_finished(self, cell: Any, status: str, error: str | None) -> None: ...
    def warn(self, message: str) -> None: ...


class LeaseKeeper(Protocol):
    """Renews the leases of a run's machines while they stand (lab.runner.renewal)."""

    def track(self, backend: Backend, vm: Vm, lease_id: int) -> None: ...
    def untrack(self, lease_id: int) -> None: ...


class SilentReporter:
    def run_started(self, *a, **k): ...
    def cell_started(self, *a, **k): ...
    def stage(self, *a, **k): ...
    def cell_finished(self, *a, **k): ...
    def warn(self, *a, **k): ...


class CellLife:
    """The lifecycle of one boot of one cell (see the module's docstring)."""

    def __init__(
        self,
        *,
        store: Store,
        run_id: str,
        reporter: Reporter,
        cell: Any,
        backend: Backend,
        expires_at: float,
        position: int,
        total: int,
        first_boot: bool,
        teardown_failures: list[str],
        facts: dict[str, Any] | None = None,
        round_no: int = 1,
        cancel: threading.Event | None = None,
        lost_hosts: dict[str, str] | None = None,
        leases: LeaseKeeper | None = None,
    ):
        self.store, self.run_id, self.reporter, self.cell, self.backend = store, run_id, reporter, cell, backend
        self.leases = leases  # the run's lease renewal: told of the machine once it exists
        self.teardown_failures = teardown_failures  # the run's: any entry fails the run
        self.name = f"lab-{run_id}-{cell.id}"
        self.facts: dict[str, Any] = dict(facts or {})
        self._vm: Vm | None = None
        self.stage = "lease"
        self.status: str = CellStatus.FAILED
        self.error: str | None = None
        self._cleanups: list[tuple[str, Callable[[], None]]] = []
        self.round_no = round_no
        # a lane's cell (lab.runner.lanes): the run was interrupted in the main thread; this thread
        # stops at its next stage (Interrupted is raised only in the main thread)
        self.cancel = cancel
        self.lost_hosts = lost_hosts  # the run's: host -> why it was lost (its lane ends)
        self._stage_start = clock()
        reporter.cell_started(cell, position, total)
        store.cell_update(
            run_id, cell.id, status=CellStatus.RUNNING, stage="lease", vm_name=self.name, started=first_boot
        )
        self.lease_id = store.add_lease(run_id, cell.id, cell.host, backend.name, self.name, expires_at)

    # -- inside the block ------------------------------------------------------------------------
    @property
    def vm(self) -> Vm | None:
        """Set as soon as the backend made something: its lease is renewed, and teardown destroys it."""
        return self._vm

    @vm.setter
    def vm(self, vm: Vm | None) -> None:
        self._vm = vm
        if vm is not None and self.leases is not None:
            self.leases.track(self.backend, vm, self.lease_id)

    def enter(self, stage: str, detail: str = "") -> None:
        """The cell reached `stage` (one of STAGES): recorded, shown. The stage it leaves completed:
        its time is stored."""
        if self.cancel is not None and self.cancel.is_set():
            raise Interrupted("cancelled: the run was interrupted")
        if stage != self.stage:
            self._stage_done()
        self.stage = stage
        self.store.cell_update(self.run_id, self.cell.id, stage=stage)
        self.reporter.stage(self.cell, stage, detail)

    def progress(self, detail: str) -> None:
        """A step within the current stage (a workload's repetition): shown, not recorded."""
        self.reporter.stage(self.cell, self.stage, detail)

    def timed(self, stage: str, seconds: float, workload: str | None = None) -> None:
        """A step's time, for the estimate (a workload's prepare): stored."""
        self.store.timings.add_stage_time(self.run_id, self.cell.id, self.round_no, stage, seconds, workload)

    def _stage_done(self) -> None:
        now = clock()
        self.timed(self.stage, now - self._stage_start)
        self._stage_start = now

    def on_teardown(self, what: str, cleanup: Callable[[], None]) -> None:
        """Run `cleanup` at teardown, before the machine is destroyed (last registered first). A
        LabError from it is a warning: the destroy that follows removes what it could not."""
        self._cleanups.append((what, cleanup))

    def finish(self, status: str, error: str | None = None) -> None:
        """How the cell ended, if it did not fail: done, pending (more rounds), n/a, duplicate."""
        self.status, self.error = status, error

    # -- the end ---------------------------------------------------------------------------------
    def __enter__(self) -> CellLife:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        swallow = False
        # The last stage completed (a failed one says nothing about its length); stored after the
        # destroy, so that nothing (a full results disk) stands between the block and teardown.
        last = (self.stage, clock() - self._stage_start) if exc is None else None
        if exc is not None:
            self.status = CellStatus.FAILED
            if isinstance(exc, Interrupted):
                self.error = f"{self.stage}: interrupted"
            else:
                self.error = f"{self.stage}: {exc}"
                if isinstance(exc, LabError):  # the cell failed; the run goes on
                    self.reporter.warn(f"{self.cell.id} failed at {self.stage}: {exc}")
                    swallow = True
                if isinstance(exc, HostUnreachable) and self.lost_hosts is not None:
                    self.lost_hosts.setdefault(str(self.cell.host), f"{self.cell.id} failed at {self.stage}: {exc}")
        with shielded():
            self._teardown(last)
        return swallow

    def _teardown(self, last: tuple[str, float] | None = None) -> None:
        if self.status == CellStatus.FAILED and self.vm is not None:
            self.facts["console_tail"] = "\n".join(
                self.backend.console_text(self.vm).splitlines()[-CONSOLE_TAIL_LINES:]
            )
        self.reporter.stage(self.cell, "teardown")
        self._stage_start = clock()
        for what, cleanup in reversed(self._cleanups):
            try:
                cleanup()
            except LabError as exc:
                self.reporter.warn(f"{self.cell.id}: could not {what}: {exc}")
        if self.leases is not None:
            self.leases.untrack(self.lease_id)  # never renewed while (or after) it is destroyed
        if self.vm is not None:
            try:
                self.backend.destroy(self.vm)
            except LabError as exc:
                self.teardown_failures.append(str(exc))
                self.status, self.error = CellStatus.FAILED, f"teardown: {exc}"
            else:
                self.store.release_lease(self.lease_id)
                teardown = clock() - self._stage_start
                if last:
                    self.timed(*last)
                self.timed("teardown", teardown)
        else:
            self.store.release_lease(self.lease_id)
            if last:
                self.timed(*last)
        self.store.cell_update(
            self.run_id, self.cell.id, status=self.status, error=self.error, facts=self.facts, finished=True
        )
        self.reporter.cell_finished(self.cell, self.status, self.error)


def lease_expiry(lease_minutes: float) -> float:
    """When a cell made now may be removed by `lab gc` on any machine (unless renewed: lab.lease)."""
    return lease.expiry(lease_minutes)
