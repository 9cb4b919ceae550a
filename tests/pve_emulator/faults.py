"""The fault switches a test flips on a running emulator: what real clusters do to a client daily
(a backup holding a VM's lock and flock in its own task, tasks failing half-way or outlasting a
client's timeout, another client taking a VMID, slow calls, nodes going offline (595), dropped and
hanging connections, storage and cluster-filesystem locks timing out under concurrent clones,
tickets expiring, HA-managed VMs). Their effect lives in the module of the endpoint (or
transport.py for connections); tests/pve_emulator/chaos.py turns them into faults of a `lab run`."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from . import tasks


@dataclass
class ConnectionFault:
    """Every `every`-th request matching `methods` and `path` (a regex on the API path) is
    dropped (the connection closed without an answer, `when` "before" or "after" the request is
    carried out) or hung (held `seconds`, then carried out: the client has given up by then)."""

    kind: str  # "drop" or "hang"
    every: int = 1
    when: str = "before"
    seconds: float = 0.0
    methods: tuple[str, ...] = ()
    path: str = ""
    count: int | None = None  # how many requests it hits at most (None: until cleared)
    seen: int = 0
    hits: int = 0

    def applies(self, method: str, path: str) -> bool:
        if (self.methods and method not in self.methods) or (self.path and not re.search(self.path, path)):
            return False
        if self.count is not None and self.hits >= self.count:
            return False
        self.seen += 1
        if self.seen % self.every:
            return False
        self.hits += 1
        return True


class FaultSwitches:
    """Mixed into PveEmulator: the knobs and switches of injected faults, on the emulator's state."""

    def _init_faults(self) -> None:
        self.flock_timeout = 10.0  # how long a call waits for a VM's flock before `got timeout` (PVE: 10 s)
        self.storage_slots = 2  # allocations on one storage at once before others wait for its lock
        self.storage_lock_timeout = 10.0  # ... and how long they wait before `can't lock file` / cfs-lock
        self.nextid_lag = 0.0  # nextid overlooks VMs younger than this: makes the nextid race certain
        self.latency: dict[str, float] = {}  # "METHOD /path/template" -> seconds before it is handled
        self.offline_nodes: set[str] = set()  # listed offline; any call for them answers 595
        self.unreachable_nodes: set[str] = set()  # listed online, but pveproxy cannot reach them: 595
        self.connection_faults: list[ConnectionFault] = []
        self.dropped = self.hung = 0  # connections dropped or hung so far
        self._failures: dict[str, list[str]] = {}  # task type -> exit statuses of its next tasks
        self._steal = 0  # nextid answers after which another client takes that id

    def fail_next(self, task_type: str, message: str, count: int = 1) -> None:
        """The next `count` tasks of this type fail half-way with `message` as exitstatus."""
        with self._lock:
            self._failures.setdefault(task_type, []).extend([message] * count)

    def hold_lock(self, vmid: int, lock: str, seconds: float) -> None:
        """Put a config lock (`clone`, `backup`, ...) on a VM for a while."""
        with self._lock:
            self.vms[vmid].hold_lock = (lock, time.monotonic() + seconds)

    def hold_flock(self, vmid: int, seconds: float) -> None:
        """Another process (vzdump, a qm command) holds the VM's flock for a while."""
        with self._lock:
            self.vms[vmid].flock_until = time.monotonic() + seconds

    def backup(self, vmid: int, seconds: float, user: str = "root@pam") -> str:
        """A backup job (vzdump, as `user`) of the VM for `seconds`: a task of its own on the VM's
        node, holding the VM's `backup` lock and its flock meanwhile. Returns the task's UPID."""
        with self._lock:
            vm = self.vms[vmid]
            upid = tasks.new_task(self, vm.node, "vzdump", vmid, None, seconds, user=user, flock=vm)
            vm.hold_lock = ("backup", self.tasks[upid].end)
            return upid

    def drop_connections(
        self,
        every: int = 1,
        *,
        when: str = "before",
        methods: tuple[str, ...] = (),
        path: str = "",
        count: int | None = None,
    ) -> ConnectionFault:
        """Close every `every`-th matching connection without an answer (see ConnectionFault)."""
        return self._add_connection_fault(ConnectionFault("drop", every, when, 0.0, tuple(methods), path, count))

    def hang_connections(
        self, every: int = 1, *, seconds: float, methods: tuple[str, ...] = (), path: str = "", count: int | None = None
    ) -> ConnectionFault:
        """Hold every `every`-th matching request `seconds` before carrying it out."""
        return self._add_connection_fault(
            ConnectionFault("hang", every, "before", seconds, tuple(methods), path, count)
        )

    def _add_connection_fault(self, fault: ConnectionFault) -> ConnectionFault:
        if fault.when not in ("before", "after") or fault.every < 1:
            raise ValueError(f"bad connection fault {fault}")
        with self._lock:
            self.connection_faults.append(fault)
        return fault

    def clear_connection_faults(self) -> None:
        with self._lock:
            self.connection_faults.clear()

    def connection_fault(self, method: str, path: str) -> ConnectionFault | None:
        """The fault (if any) of this request; transport.py applies it."""
        with self._lock:
            for fault in self.connection_faults:
                if fault.applies(method, path):
                    if fault.kind == "drop":
                        self.dropped += 1
                    else:
                        self.hung += 1
                    return fault
        return None

    def steal_next_vmid(self, count: int = 1) -> None:
        """After the next `count` nextid answers, another client takes that id at once."""
        with self._lock:
            self._steal += count

    def set_ha(self, vmid: int, managed: bool = True) -> None:
        """The VM is an HA resource: destroy without purge is refused."""
        with self._lock:
            self.vms[vmid].ha_managed = managed

    def expire_tickets(self) -> None:
        """Every ticket handed out so far is now older than ticket_lifetime."""
        with self._lock:
            for t, (csrf, who, _born) in list(self._tickets.items()):
                self._tickets[t] = (csrf, who, time.monotonic() - self.ticket_lifetime - 1)
