"""`lab gc`: remove what crashed or killed runs left behind, on every configured host.

What goes: anything carrying a lab run id whose run is known to be dead, or whose lease has
expired (a live run renews its leases: lab.runner.renewal). Who can know (`liveness`, by the
lease's owner, lab.lease): this machine's run locks (a backend's `run_is_live`) for what this
machine made, this store's run lock for what its runs made. Whether a run of another machine or
another store is alive cannot be known from here, whatever its run id, so there only expired
leases go, unless --force.
VMs and processes first, then disks, taps and namespaces.

Warm snapshots (lab.axes `start = "warm"`) belong to no run: they go when the image build they
were taken of is no longer one this machine has (rebuilt or removed), never while a VM stands on one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lab import images, lease, runlock, statedir
from lab.config import LabConfig
from lab.errors import IncompleteListing, LabError
from lab.model import Owned
from lab.runlock import run_lock_path
from lab.store import Store

ORDER = {"vm": 0, "process": 0, "disk": 1, "tap": 2, "netns": 3, "lock": 4}


@dataclass(frozen=True)
class GcItem:
    """One thing gc looked at, for `lab gc --json`."""

    action: str  # keep | would-remove (a dry run) | removed
    host: str | None  # None: the results directory (a run lock beside the store)
    kind: str  # vm, process, disk, tap, netns, lock, ...
    name: str
    run_id: str
    reason: str = ""  # why it is kept


@dataclass
class GcReport:
    lines: list[str] = field(default_factory=list)
    removed: int = 0
    kept: int = 0
    errors: list[str] = field(default_factory=list)
    items: list[GcItem] = field(default_factory=list)
    marked_failed: list[str] = field(default_factory=list)  # runs found dead and marked failed

    def add(self, item: GcItem) -> None:
        """`item`, and its line as `lab gc` prints it."""
        self.items.append(item)
        where = f"{item.host} {item.kind} {item.name}" if item.host is not None else item.name
        self.lines.append(
            {
                "keep": f"keep   {where} ({item.reason})",
                "would-remove": f"would remove {where}",
                "removed": f"removed {where}",
            }[item.action]
        )


def collect(
    cfg: LabConfig,
    *,
    dry_run: bool = False,
    hosts: list[str] | None = None,
    force: bool = False,
    backends: dict | None = None,
    now: float | None = None,
    here: str | None = None,
) -> GcReport:
    """`here`: the machine tag this gc goes by (lab.lease; default this state directory's)."""
    report = GcReport()
    now = time.time() if now is None else now
    names = set(hosts or cfg.hosts)
    backends = backends if backends is not None else cfg.open_backends(names)
    removed_vms: list[str] = []
    unfinished: set[str] = set()  # runs with an item kept or not removed, on any host
    # Runs of this results store: one whose lock here is not held is over (finished, or killed),
    # whatever machine-local lock its backend keeps (or no longer keeps: a finished run drops it).
    db = cfg.results_dir / Store.FILENAME
    ours: dict[str, set[str]] = {}  # run id -> the owners its attempts wrote in their leases (lab.lease)
    if db.exists():
        try:
            store = Store(cfg.results_dir)
            ours = {r.id: run_owners(r.manifest) for r in store.runs()}
            store.close()
        except LabError as exc:
            report.errors.append(f"results store: {exc}")
    if here is None:  # "" where no run of this machine made an owner yet
        here = lease.machine_tag(statedir.default_dir())
    found = []
    partly: set[str] = set()  # hosts that could not be looked at whole: no run lock goes while one is
    for host, backend in sorted(backends.items()):
        try:
            found += [(host, backend, item) for item in backend.list_owned()]
        except IncompleteListing as exc:  # what it did list is collected; what it could not is an error
            found += [(host, backend, item) for item in exc.found]
            partly.add(host)
            report.errors += [f"{host}: not checked: {part}" for part in exc.unchecked]
        except LabError as exc:
            partly.add(host)
            report.errors.append(f"{host}: cannot list: {exc}")
    # every host's VMs before any host's disks, ..., run locks last
    for host, backend, item in sorted(found, key=lambda f: (ORDER.get(f[2].kind, 9), f[0], f[2].name)):
        expired = bool(item.expires_at) and item.expires_at < now
        state = liveness(backend, item, ours, cfg.results_dir, here)
        if state is not None:
            keep = state and not force
            why = f"run {item.run_id} is live"
        else:
            keep = not expired and not force
            why = (
                "lease not expired; another machine's or store's run may own it (--force removes it)"
                if item.run_id
                else "its run cannot be told from its name (--force removes it)"
            )
        if item.kind == "lock" and item.run_id in unfinished:
            # the lock is what tells the next gc this run is dead: it goes with the run's last item
            keep, why = True, f"run {item.run_id} still has items here"
        elif item.kind == "lock" and host in partly:
            keep, why = True, "not every part of the host could be looked at for the run's VMs"
        if keep:
            unfinished.add(item.run_id)
            report.kept += 1
            report.add(GcItem("keep", host, item.kind, item.name, item.run_id, why))
            continue
        if dry_run:
            report.removed += 1
            report.add(GcItem("would-remove", host, item.kind, item.name, item.run_id))
            continue
        try:
            backend.remove_owned(item)
            report.removed += 1
            report.add(GcItem("removed", host, item.kind, item.name, item.run_id))
            if item.kind == "vm":
                removed_vms.append(item.name)
        except LabError as exc:
            unfinished.add(item.run_id)
            report.errors.append(f"{host} {item.kind} {item.name}: {exc}")
    _stale_warm(backends, report, dry_run)
    if cfg.results_dir.joinpath(Store.FILENAME).exists() and not dry_run:
        try:
            store = Store(cfg.results_dir)
            try:
                for name in removed_vms:
                    store.release_leases_named(name)
                for run_id in mark_dead_runs(store):
                    report.lines.append(f"marked run {run_id} failed (its process is gone)")
                    report.marked_failed.append(run_id)
                for run in store.runs():  # the run locks beside the store of runs killed with -9
                    lock = run_lock_path(cfg.results_dir, run.id)
                    if run.id not in unfinished and not partly and runlock.remove_if_dead(lock):
                        report.removed += 1
                        report.add(GcItem("removed", None, "lock", str(lock), run.id))
            finally:
                store.close()
        except LabError as exc:  # e.g. the results disk is still full: what was removed stays removed
            report.errors.append(f"results store: {exc}")
    return report


def run_owners(manifest: dict) -> set[str]:
    """The owners a stored run's attempts wrote in their leases (the run's manifest)."""
    owners = manifest.get("owners") if isinstance(manifest, dict) else None
    return {o for o in owners if isinstance(o, str)} if isinstance(owners, list) else set()


def liveness(backend, item: Owned, ours: dict[str, set[str]], results_dir, here: str) -> bool | None:
    """Is the run that made `item` alive? True/False when this machine or this store can tell,
    None when only the lease's expiry can (lab.lease):

    - a machine this machine made (its owner carries this state directory's tag): this machine's
      run locks know, and a lock that is gone is a run that is over;
    - one a run of this store made (its owner is one of the run's): the store's run lock knows;
    - one another machine or store made, whatever its run id: nobody here knows;
    - a lease without an owner (written before owners existed, or a lock file): as before, this
      machine's lock of that run id, else this store's run of that id."""
    if not item.run_id:  # its run cannot be told from its name (lab.names): only --force or expiry
        return None
    owner = item.owner
    if owner and here and lease.machine_of(owner) == here:
        return bool(backend.run_is_live(item.run_id))
    if owner:
        if owner in ours.get(item.run_id, set()):
            return bool(runlock.held(run_lock_path(results_dir, item.run_id)))
        return None
    state = backend.run_is_live(item.run_id)
    if state is None and item.run_id in ours:
        state = bool(runlock.held(run_lock_path(results_dir, item.run_id)))
    return state


def _stale_warm(backends: dict, report: GcReport, dry_run: bool) -> None:
    """Remove the warm snapshots whose image build (digest or sha256 in Owned.detail) is gone."""
    current = {v for ref in images.list_images() for v in (ref.digest, ref.sha256) if v}
    for host, backend in sorted(backends.items()):
        if backend.warm is None:
            continue  # it keeps none
        try:
            snaps = backend.warm.snapshots()
        except IncompleteListing as exc:
            snaps = exc.found
            report.errors += [f"{host}: not checked: {part}" for part in exc.unchecked]
        except LabError as exc:
            report.errors.append(f"{host}: cannot list warm snapshots: {exc}")
            continue
        for snap in snaps:
            if snap.detail in current:
                continue  # a snapshot of an image this machine has: the next warm cell uses it
            if dry_run:
                report.removed += 1
                report.lines.append(f"would remove {host} warm {snap.name} (its image build is gone)")
                continue
            try:
                backend.warm.remove(snap)
                report.removed += 1
                report.lines.append(f"removed {host} warm {snap.name} (its image build is gone)")
            except LabError as exc:
                report.errors.append(f"{host} warm {snap.name}: {exc}")


def mark_dead_runs(store: Store) -> list[str]:
    """Runs the store says are running whose `lab run` no longer holds the run's lock (killed
    with -9, or it died unable to write its outcome): failed, and so are their unfinished cells,
    with one line saying so. The runs are read before their locks: a run is in the store only
    once its lock is held, so a run starting meanwhile is never taken for dead."""
    dead = []
    for run in store.runs():
        if run.status != "running" or runlock.held(run_lock_path(store.dir, run.id)):
            continue
        why = (
            f"the lab process ended without recording an outcome (killed, or its store could not be written); "
            f"`lab run --resume {run.id}` continues it"
        )
        for cell in store.cells(run.id):
            if cell.status == "running":
                store.cell_update(run.id, cell.cell_id, status="failed", error=f"{cell.stage}: {why}")
        store.finish_run(run.id, "failed", why)
        dead.append(run.id)
    return dead
