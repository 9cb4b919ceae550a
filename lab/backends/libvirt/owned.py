"""What on a libvirt host is the lab's, for `lab gc`: its domains (by the lease in their
<metadata>: the lab's namespace and a run id), clones whose domain is gone (the lab's naming and a
lease file or zfs property), and this machine's run locks. Nothing else is listed or removed,
`--force` included, and a host that could be listed only in part says which part
(IncompleteListing), never an empty list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lab import runlock
from lab.backends.libvirt.connection import Connection, error_message, libvirt_module
from lab.backends.libvirt.disks import Disks
from lab.backends.libvirt.domain import read_lease
from lab.errors import BackendError, IncompleteListing, LabError, TeardownError, UsageError
from lab.lease import owner_or_empty
from lab.model import Owned
from lab.runlock import RunLocks


class Inventory:
    def __init__(
        self, backend: str, host_name: str, driver: str, connection: Connection, disks: Disks, run_locks: RunLocks
    ):
        self.backend = backend
        self.host_name = host_name
        self.driver = driver
        self.connection = connection
        self.disks = disks
        self.run_locks = run_locks

    def leases(self) -> tuple[list[tuple[Any, dict[str, str]]], list[str]]:
        """(domain, lease) of every lab domain, and what could not be looked at."""
        libvirt = libvirt_module()
        try:
            doms = self.connection.domains(self.host_name)
        except LabError as exc:  # refused, unreachable, auth
            return [], [f"domains at {self.connection.safe_uri}: {exc}"]
        found, unchecked = [], []
        for dom in doms:
            try:
                lease = read_lease(dom)
            except libvirt.libvirtError as exc:
                unchecked.append(f"domain {_name(dom)}: its metadata could not be read ({error_message(exc)})")
                continue
            if lease is not None:
                found.append((dom, lease))
        return found, unchecked

    def in_use(self, snapshot: str) -> list[str]:
        """The lab domains whose disk stands on the warm snapshot `snapshot` (BackendError when the
        domains cannot all be read: then every snapshot may be in use)."""
        leases, unchecked = self.leases()
        if unchecked:
            raise BackendError(f"cannot tell which domains use warm snapshot {snapshot}: {'; '.join(unchecked)}")
        return [_name(dom) for dom, lease in leases if lease.get("warm") == snapshot]

    def list(self) -> list[Owned]:
        leases, unchecked = self.leases()
        out = [
            Owned(
                backend=self.backend,
                kind="vm",
                name=_name(dom),
                run_id=lease["run"],
                expires_at=float(lease.get("expires") or 0),
                owner=owner_or_empty(lease.get("owner")),
                detail=json.dumps(
                    {k: lease.get(k, "") for k in ("disk", "console", "host", "cell")} | {"uuid": _uuid(dom)},
                    sort_keys=True,
                ),
            )
            for dom, lease in leases
        ]
        if unchecked:
            # a domain not read may stand on any clone: none is an orphan until all are read
            unchecked.append("clones whose domain is gone: not looked for while a domain could not be read")
        else:
            try:
                referenced = {lease.get("disk") for _, lease in leases}
                out += [o for o in self.disks.orphans(self.backend) if o.detail not in referenced]
            except LabError as exc:
                unchecked.append(f"clones in {self._disk_place()}: {exc}")
        out += self.run_locks.owned(self.backend)
        if unchecked:
            raise IncompleteListing(
                f"host {self.host_name!r} could be listed only in part",
                out,
                unchecked,
                hint="fix what is named, then `lab gc` again",
            )
        return out

    def _disk_place(self) -> str:
        if self.driver == "bhyve":
            return f"zfs dataset {self.disks.host.dataset}"
        try:
            return self.disks.clone_dir()
        except LabError:
            return f"storage pool {self.disks.host.pool}"

    def remove(self, item: Owned) -> None:
        if item.kind == "disk":
            if not self.disks.still_owned(item):
                raise BackendError(f"{item.detail} no longer carries run {item.run_id}'s lease: left alone")
            problems: list[str] = []
            self.disks.remove_clone(item.name, item.detail, problems)
            if problems:
                raise TeardownError(f"gc of {item.name} on {self.host_name!r} failed: " + "; ".join(problems))
            return
        if item.kind == "lock":
            runlock.remove_if_dead(Path(item.detail))  # never the lock of a live run
            return
        if item.kind != "vm":
            raise UsageError(f"libvirt backend does not own {item.kind!r} items")
        self.remove_vm(item)

    def remove_vm(self, item: Owned) -> None:
        libvirt = libvirt_module()
        try:
            listed = json.loads(item.detail or "{}")
        except ValueError:
            listed = {}
        dom = self.connection.lookup(item.name)
        lease: dict[str, str] | None = listed
        if dom is not None:  # the domain of that name now: still the lab's, of that run?
            lease = read_lease(dom)
            if (
                lease is None
                or lease.get("run") != item.run_id
                or (listed.get("uuid") and _uuid(dom) != listed["uuid"])
            ):
                raise BackendError(f"domain {item.name!r} is not run {item.run_id}'s any more: left alone")
        problems: list[str] = []
        try:
            self.connection.remove_domain(item.name, self.driver, uuid=listed.get("uuid", ""))
        except (libvirt.libvirtError, LabError) as exc:
            problems.append(f"domain: {error_message(exc)}")
        if not problems:  # never a disk from under a domain that is still there
            self.disks.remove_clone(item.name, (lease or {}).get("disk", ""), problems)
        if problems:
            raise TeardownError(f"gc of {item.name} on {self.host_name!r} failed: " + "; ".join(problems))


def _name(dom: Any) -> str:
    try:
        return dom.name()
    except Exception:  # a domain gone while listed: named by what is left
        return "?"


def _uuid(dom: Any) -> str:
    try:
        return dom.UUIDString()
    except Exception:  # gone meanwhile: no UUID to pin
        return ""
