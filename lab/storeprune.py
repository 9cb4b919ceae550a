"""`lab prune --keep N`: the store keeps every run until told otherwise; this removes all but the
newest N, each with everything stored for it (cells, samples, raw outputs, executions, stage times,
its link to its host facts). Host facts stay: they are small, and `lab snapshot` rows belong to no
run. A run that is still running (its lock is held) or still holds a lease on a machine (`lab gc`
releases those first) is kept and said so. Deleted pages are reused by later runs; SQLite's
`VACUUM` shrinks the file if that is wanted."""

from __future__ import annotations

from dataclasses import dataclass, field

from lab import runlock
from lab.store import Store

# Every table with a run_id column, children first. Leases are deleted only when released (see below).
RUN_TABLES = ("samples", "raw_outputs", "executions", "stage_times", "run_hosts", "cells", "leases")


@dataclass(frozen=True)
class Pruned:
    removed: list[str] = field(default_factory=list)  # run ids, oldest first
    kept_live: list[str] = field(default_factory=list)  # older than the newest N, but running or leasing
    samples: int = 0  # samples removed with them


def delete_run(store: Store, run_id: str) -> int:
    """Delete one run and everything stored for it, in the caller's transaction; its sample count."""
    n = store.db.execute("SELECT count(*) FROM samples WHERE run_id = ?", (run_id,)).fetchone()[0]
    for table in RUN_TABLES:
        store.db.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))
    store.db.execute("DELETE FROM runs WHERE id = ?", (run_id,))
    return int(n)


def prune(store: Store, keep: int, *, dry_run: bool = False) -> Pruned:
    """Remove every run but the newest `keep` (by start time), in one transaction."""
    runs = store.runs()  # oldest first
    older = runs[: max(len(runs) - keep, 0)]
    leasing = {lease["run_id"] for lease in store.open_leases()}
    out = Pruned()
    for run in older:
        live = run.status == "running" and runlock.held(runlock.run_lock_path(store.dir, run.id))
        (out.kept_live if live or run.id in leasing else out.removed).append(run.id)
    if dry_run or not out.removed:
        counted = sum(
            store.db.execute("SELECT count(*) FROM samples WHERE run_id = ?", (rid,)).fetchone()[0]
            for rid in out.removed
        )
        return Pruned(out.removed, out.kept_live, counted)
    with store.db:
        store.db.execute("BEGIN IMMEDIATE")
        samples = sum(delete_run(store, rid) for rid in out.removed)
    return Pruned(out.removed, out.kept_live, samples)
