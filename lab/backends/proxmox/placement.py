"""Where a new VM goes: its VMID, its node, and how many clone and destroy calls may be in flight at
once per node and per storage (the lanes of a many-hosts run share them)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

from lab.backends.proxmox.session import ApiError, Session
from lab.errors import BackendError, LabError, TimeoutError_
from lab.model import VmSpec

VMID_MAX = 999_999_999


class Vmids:
    """VMIDs for new VMs. /cluster/nextid is not a reservation: the ids handed to this process's
    workers are kept here so that two of them never pick the same one; another client taking an id
    is seen by the caller as `already exists` and answered with the next one."""

    def __init__(self, session: Session):
        self.session = session
        self._reserved: set[int] = set()
        self._lock = threading.Lock()

    def candidate(self) -> int:
        nextid = self.session.api().cluster.nextid
        vmid = int(self.session.get("GET /cluster/nextid", nextid))
        for _ in range(1000):
            with self._lock:
                if vmid not in self._reserved:
                    self._reserved.add(vmid)
                    return vmid
            vmid += 1
            while vmid < VMID_MAX:  # the next id that is free on the cluster (400 when taken)
                try:
                    vmid = int(self.session.get("GET /cluster/nextid", nextid, vmid=vmid))
                    break
                except ApiError as exc:
                    if exc.status != 400:
                        raise
                    vmid += 1
        raise BackendError(f"{self.session.host}: could not find a free VMID")

    def forget(self, vmid: int) -> None:
        with self._lock:
            self._reserved.discard(vmid)


class Placement:
    """The node of a new VM: online, with the memory free; `placement` chooses among those."""

    def __init__(self, session: Session):
        self.session = session
        self.settings = session.settings
        self._placed: dict[str, int] = {}  # VMs placed per node by this backend (placement "spread")
        self._lock = threading.Lock()

    def node_for(self, spec: VmSpec) -> str:
        """`spec.place` (its lane's node, lab.runner.lanes) if it names one, else `placement`'s choice."""
        nodes = [spec.place] if spec.place else self.settings.clone_nodes
        if spec.place and spec.place not in self.settings.clone_nodes:
            raise BackendError(f"{self.session.host}: {spec.name} asks for node {spec.place}, not one of `nodes`")
        if len(nodes) == 1 and not spec.place:
            node = nodes[0]
        else:
            res = self.session.get("GET /cluster/resources", self.session.api().cluster.resources, type="node")
            info = {str(r.get("node")): r for r in res if r.get("type") == "node"}
            need = spec.memory_mib * 1024 * 1024
            fits = []  # (node, its place in `nodes`, free memory)
            for order, n in enumerate(nodes):
                r = info.get(n) or {}
                free = int(r.get("maxmem") or 0) - int(r.get("mem") or 0)
                if r.get("status") == "online" and free >= need:
                    fits.append((n, order, free))
            if not fits:
                which = f"node {spec.place} (its lane's) is not" if spec.place else f"no node of {', '.join(nodes)} is"
                raise BackendError(
                    f"{self.session.host}: {which} online with {spec.memory_mib} MiB free for {spec.name}"
                )
            with self._lock:
                if self.settings.placement == "spread":
                    node = min(fits, key=lambda f: (self._placed.get(f[0], 0), -f[2], f[1]))[0]
                else:
                    node = fits[0][0]
        with self._lock:
            self._placed[node] = self._placed.get(node, 0) + 1
        return node


class Slots:
    """At most `size` clone and destroy calls at once per node and per storage. PVE serialises
    allocations behind locks (a VM's flock, a storage's lock, pmxcfs's cluster lock) whose 10 s
    timeout fails the task of whoever waits longer, so the lab queues here instead. The slots are
    shared by every backend of this process on the same cluster (URL) with the same `concurrency`:
    two hosts of lab.toml that name one cluster (one per node) share its storages. A thread that
    holds a slot passes through it again (the cleanup of a failed clone inside the clone's own slot)."""

    _sems: ClassVar[dict[tuple, threading.BoundedSemaphore]] = {}
    _sems_lock: ClassVar[threading.Lock] = threading.Lock()
    _held = threading.local()

    def __init__(self, session: Session):
        self.session = session
        self.cluster = session.url
        self.size = session.settings.concurrency
        self._shared: dict[str, set[str]] = {}  # node -> its storages that are shared (cluster-wide)
        self._lock = threading.Lock()

    def storage_key(self, node: str, storage: str) -> tuple:
        """A shared storage is one lock for the cluster; a local one (local-lvm) is one per node."""
        with self._lock:
            shared = self._shared.get(node)
        if shared is None:
            try:
                stores = self.session.get(f"GET storage of node {node}", self.session.node(node).storage)
                shared = {str(s.get("storage")) for s in stores if s.get("shared")}
            except LabError:  # cannot tell: per node (PVE's own locks still serialise a shared one)
                shared = set()
            with self._lock:
                self._shared[node] = shared
        return ("storage", storage) if storage in shared else ("storage", node, storage)

    @contextmanager
    def hold(self, *, node: str, storage: str, deadline: float, what: str) -> Iterator[None]:
        """One slot of `node` and one of `storage` (node first, always: no lock-order cycle)."""
        held: set = getattr(self._held, "keys", None) or set()
        self._held.keys = held
        taken: list[tuple[tuple, threading.BoundedSemaphore]] = []
        try:
            for key in (("node", node), self.storage_key(node, storage)):
                full = (self.cluster, self.size, *key)  # hosts with another `concurrency` queue apart
                if full in held:
                    continue
                with self._sems_lock:
                    sem = self._sems.setdefault(full, threading.BoundedSemaphore(self.size))
                if not sem.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError_(
                        f"{self.session.host}: {what}: no free slot on {' '.join(key)} before "
                        f"the deadline ({self.size} clone/destroy call(s) at once, `concurrency`)"
                    )
                held.add(full)
                taken.append((full, sem))
            yield
        finally:
            for full, sem in reversed(taken):
                held.discard(full)
                sem.release()
