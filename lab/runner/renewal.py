"""Lease renewal: while a run lives, every machine it has up keeps a fresh lease.

A lease is written when a machine is made (lab.lease); a run longer than `[lab] lease_minutes`
(the client VM lives the whole run, an interleaved run's cells come back round after round) would
otherwise stand with an expired lease, and `lab gc` or the sweep of a run on another machine, which
cannot ask this machine's locks, would take its machines for leftovers. So one thread per run
moves every tracked machine's lease to `lease_minutes` from now, every third of it
(lab.lease.renew_interval), on the host (Backend.renew_lease) and in the store.

Bounded: a renewal that fails (the host unreachable for a moment, the results disk full) is one
warning line per machine, and the next round tries again; the thread stops with the run, and the
run waits for it at most STOP_WAIT_S. A machine is tracked from the moment it exists (its backend
returned it) and untracked before its teardown: `untrack` waits for a renewal of that machine in
flight, so a renewal never writes into a machine being destroyed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lab import lease
from lab.backends import Backend
from lab.errors import LabError
from lab.model import Vm
from lab.store import Store

STOP_WAIT_S = 30.0


@dataclass
class Tracked:
    backend: Backend
    vm: Vm
    lease_id: int
    name: str
    failing: bool = False  # warned about once; said again when it recovers
    active: bool = True  # False once untracked: a round that picked it up before leaves it alone
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while it is renewed


class Renewal:
    def __init__(
        self,
        store: Store,
        lease_minutes: float,
        warn: Callable[[str], None],
        *,
        interval: float | None = None,
    ):
        self.store, self.lease_minutes, self.warn = store, lease_minutes, warn
        self.interval = interval if interval is not None else lease.renew_interval(lease_minutes)
        self.tracked: dict[int, Tracked] = {}
        self.renewed = 0  # leases renewed so far
        self._lock = threading.Lock()  # over `tracked`
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the run tells it -----------------------------------------------------------------------
    def track(self, backend: Backend, vm: Vm, lease_id: int) -> None:
        # the bare-metal cell's machine has no VmSpec: its directory names it
        name = vm.spec.name if vm.spec is not None else Path(str(vm.handle.get("dir") or vm.handle.get("name"))).name
        with self._lock:
            self.tracked[lease_id] = Tracked(backend, vm, lease_id, name)

    def untrack(self, lease_id: int) -> None:
        """Stop renewing a machine (before its teardown); waits for its renewal in flight, if any
        (bounded by the backend's own timeouts)."""
        with self._lock:
            item = self.tracked.pop(lease_id, None)
        if item is not None:
            with item.lock:
                item.active = False

    # -- the thread -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="lease-renewal", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_WAIT_S)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.renew_all()

    def renew_all(self) -> None:
        """One round: every machine tracked now gets `lease_minutes` from now."""
        with self._lock:
            items = list(self.tracked.values())
        for item in items:
            if self._stop.is_set():
                return
            with item.lock:
                if item.active:
                    self._renew(item)

    def _renew(self, item: Tracked) -> None:
        expires = lease.expiry(self.lease_minutes)
        try:
            item.backend.renew_lease(item.vm, expires)
            self.store.renew_lease(item.lease_id, expires)
        except LabError as exc:
            if not item.failing:
                item.failing = True
                self.warn(f"could not renew the lease of {item.name}: {exc} (trying again)")
            return
        if item.failing:
            item.failing = False
            self.warn(f"renewed the lease of {item.name} again")
        self.renewed += 1
