"""`lab gc`: remove what crashed or killed runs left behind, on every configured host.

What goes: anything carrying a lab run id whose run is known to be dead (a backend's
`run_is_live` says so: no process on this machine holds the run's lock), or whose lease has
expired. Whether a run started on another machine is alive cannot be known from here
(`run_is_live` answers None, or the backend has none), so there only expired leases go, unless
--force.
VMs and processes first, then disks, taps and namespaces.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lab import runlock
from lab.config import LabConfig
from lab.errors import LabError
from lab.runlock import run_lock_path
from lab.store import Store

ORDER = {"vm": 0, "process": 0, "disk": 1, "tap": 2, "netns": 3, "lock": 4}


@dataclass
class GcReport:
    lines: list[str] = field(default_factory=list)
    removed: int = 0
    kept: int = 0
    errors: list[str] = field(default_factory=list)


def collect(cfg: LabConfig, *, dry_run: bool = False, hosts: list[str] | None = None, force: bool = False,
            backends: dict | None = None, now: float | None = None) -> GcReport:
    from lab.runner import build_backends

    report = GcReport()
    now = time.time() if now is None else now
    names = set(hosts or cfg.hosts)
    backends = backends if backends is not None else build_backends(cfg, names)
    removed_vms: list[str] = []
    unfinished: set[str] = set()  # runs with an item kept or not removed, on any host
    # Runs of this results store: one whose lock here is not held is over (finished, or killed),
    # whatever machine-local lock its backend keeps (or no longer keeps: a finished run drops it).
    db = cfg.results_dir / Store.FILENAME
    ours: set[str] = set()
    if db.exists():
        try:
            store = Store(cfg.results_dir)
            ours = {r.id for r in store.runs()}
            store.close()
        except LabError as exc:
            report.errors.append(f"results store: {exc}")
    found = []
    for host, backend in sorted(backends.items()):
        try:
            found += [(host, backend, item) for item in backend.list_owned()]
        except LabError as exc:
            report.errors.append(f"{host}: cannot list: {exc}")
    # every host's VMs before any host's disks, ..., run locks last
    for host, backend, item in sorted(found, key=lambda f: (ORDER.get(f[2].kind, 9), f[0], f[2].name)):
        live = getattr(backend, "run_is_live", None)
        expired = bool(item.expires_at) and item.expires_at < now
        # True/False when this machine knows (its run lock), None when it cannot tell
        state = (live(item.run_id) if item.run_id else False) if live is not None else None
        if state is None and item.run_id in ours:
            state = bool(runlock.held(run_lock_path(cfg.results_dir, item.run_id)))
        if state is not None:
            keep = state and not force
            why = f"run {item.run_id} is live"
        else:
            keep = not expired and not force
            why = "lease not expired; another machine's run may own it (--force removes it)"
        if item.kind == "lock" and item.run_id in unfinished:
            # the lock is what tells the next gc this run is dead: it goes with the run's last item
            keep, why = True, f"run {item.run_id} still has items here"
        if keep:
            unfinished.add(item.run_id)
            report.kept += 1
            report.lines.append(f"keep   {host} {item.kind} {item.name} ({why})")
            continue
        if dry_run:
            report.removed += 1
            report.lines.append(f"would remove {host} {item.kind} {item.name}")
            continue
        try:
            backend.remove_owned(item)
            report.removed += 1
            report.lines.append(f"removed {host} {item.kind} {item.name}")
            if item.kind == "vm":
                removed_vms.append(item.name)
        except LabError as exc:
            unfinished.add(item.run_id)
            report.errors.append(f"{host} {item.kind} {item.name}: {exc}")
    if cfg.results_dir.joinpath(Store.FILENAME).exists() and not dry_run:
        try:
            store = Store(cfg.results_dir)
            try:
                for name in removed_vms:
                    store.release_leases_named(name)
                for run_id in mark_dead_runs(store):
                    report.lines.append(f"marked run {run_id} failed (its process is gone)")
                for run in store.runs():  # the run locks beside the store of runs killed with -9
                    lock = run_lock_path(cfg.results_dir, run.id)
                    if run.id not in unfinished and runlock.remove_if_dead(lock):
                        report.removed += 1
                        report.lines.append(f"removed {lock}")
            finally:
                store.close()
        except LabError as exc:  # e.g. the results disk is still full: what was removed stays removed
            report.errors.append(f"results store: {exc}")
    return report


def mark_dead_runs(store: Store) -> list[str]:
    """Runs the store says are running whose `lab run` no longer holds the run's lock (killed
    with -9, or it died unable to write its outcome): failed, and so are their unfinished cells,
    with one line saying so. The runs are read before their locks: a run is in the store only
    once its lock is held, so a run starting meanwhile is never taken for dead."""
    dead = []
    for run in store.runs():
        if run.status != "running" or runlock.held(run_lock_path(store.dir, run.id)):
            continue
        why = (f"the lab process ended without recording an outcome (killed, or its store could not be written); "
               f"`lab run --resume {run.id}` continues it")
        for cell in store.cells(run.id):
            if cell.status == "running":
                store.cell_update(run.id, cell.cell_id, status="failed", error=f"{cell.stage}: {why}")
        store.finish_run(run.id, "failed", why)
        dead.append(run.id)
    return dead
