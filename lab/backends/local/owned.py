"""What on this machine is the local backend's, for `lab gc`: only what its workdir owns (another
workdir, another user's lab or a parallel test, is not its to reap). A machine directory is the
lab's if its lease is there (or it is empty: a run killed before it wrote one); a QEMU if its
pidfile is here; a namespace if the lab's lock file or one of its leases names it. Anything else
is left alone."""

from __future__ import annotations

from pathlib import Path

from lab import runlock, statedir
from lab.backends.local import host, layout
from lab.errors import IncompleteListing
from lab.lease import owner_or_empty
from lab.model import Owned


class Inventory:
    def __init__(self, backend: str, workdir: Path):
        self.backend, self.workdir = backend, workdir

    def list(self) -> list[Owned]:
        out: list[Owned] = []
        handles: dict[str, dict] = {}
        why = statedir.problem(self.workdir)
        if why:  # someone else's, or open to others: nothing found there is trusted
            raise IncompleteListing(
                f"workdir {self.workdir} {why}", [], [f"workdir {self.workdir} {why}: nothing in it was trusted"]
            )
        if self.workdir.is_dir():
            for d in sorted(self.workdir.glob("lab-*")):
                handle = self.trusted(d)
                if handle is not None:
                    handles[d.name] = handle
                    lease = layout.read_lease(d)
                    out.append(
                        Owned(
                            self.backend,
                            "vm",
                            d.name,
                            layout.run_of(d.name),
                            float(lease.get("expires_at") or 0),
                            str(d),
                            owner=owner_or_empty(lease.get("owner")),
                        )
                    )
        for pid, name in host.qemu_processes(self.workdir):
            if name not in handles:
                out.append(Owned(self.backend, "process", name, layout.run_of(name), 0.0, str(pid)))
        namespaces_here = {h.get("netns") for h in handles.values()}
        for ns in host.list_netns():
            lock = self.workdir / f"{ns}.lock"
            if ns.startswith("lab-") and (runlock.is_lab_lock(lock) or ns in namespaces_here):
                out.append(Owned(self.backend, "netns", ns, layout.run_of_netns(ns), 0.0, ""))
        return out

    def trusted(self, vmdir: Path) -> dict | None:
        """What gc may remove of a machine directory (layout.trusted_handle); None: not the lab's."""
        if vmdir.is_symlink() or not vmdir.is_dir():
            return None
        parent = host.cgroup_parent()
        handle = layout.trusted_handle(vmdir, layout.read_lease(vmdir), parent[0] if parent else None)
        if handle is None and not any(vmdir.iterdir()):
            return {"dir": str(vmdir)}  # made, then killed before its lease: nothing else exists
        return handle

    def remove(self, item: Owned) -> None:
        if item.kind == "vm":
            handle = self.trusted(Path(item.detail))
            if handle is None:
                return  # not the lab's (any more): left alone
            for pid, name in host.qemu_processes(self.workdir):
                if name == item.name:
                    host.kill_pid(pid, item.name)
            # the lease's pid was killed above if it was our QEMU, and may be reused by now
            host.remove_machine(handle, item.name)
        elif item.kind == "process":
            host.kill_pid(int(item.detail), item.name)
        elif item.kind == "netns":
            host.remove_netns(item.name)
            runlock.remove_if_dead(self.workdir / f"{item.name}.lock")
