"""`lab import STORE`: merge another results store into this one (issue 36), so that a team can
follow its hosts over the nightly runs of several orchestrators.

A run is known everywhere by its uid (lab.storeschema migration 4), never by its id: ids are
unique only per store, so a run whose id is taken here is imported under a new one (its id at its
origin stays in `origin_id`). Each run comes whole, in one transaction with the others: its
cells, raw outputs, samples (their raw output and host-facts references renumbered), executions,
stage times and host facts (deduplicated by fingerprint, as a run's own are). Leases are not
copied: they are the other machine's VMs, which this store's `lab gc` must never touch.

Importing again changes nothing: runs already here are skipped. A run still running there is
skipped and said so (import again once it ended); one that ended there after an earlier import
took it unfinished (resumed since) replaces that copy. A run measured into this store is never
replaced by a copy of itself. The other store is only read: one from an older lab is read through
an upgraded copy in memory, one from a newer lab is refused (lab.store).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from lab.errors import UsageError
from lab.store import Store
from lab.storeprune import delete_run

RUN_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,15}")  # as `lab run --run-id` (lab.cli.group.RUN_ID)
RUN_FIELDS = (
    "id",
    "name",
    "started_at",
    "finished_at",
    "status",
    "error",
    "config_path",
    "config_text",
    "seed",
    "lab_version",
    "manifest",
    "uid",
    "origin",
    "origin_id",
)
RUN_COLUMNS = ", ".join(RUN_FIELDS)


@dataclass
class Imported:
    added: list[tuple[str, str]] = field(default_factory=list)  # (id there, id here)
    replaced: list[str] = field(default_factory=list)  # ids here of copies brought up to date
    present: int = 0  # runs already here
    running: list[str] = field(default_factory=list)  # ids there of runs still running: skipped
    samples: int = 0  # samples added

    @property
    def renamed(self) -> list[tuple[str, str]]:
        return [(a, b) for a, b in self.added if a != b]


def source_store(path: str | Path) -> Store:
    """The store to import, read-only: a results directory, or the lab.db in it."""
    p = Path(path)
    where = p.parent if p.name == Store.FILENAME and p.is_file() else p
    if not (where / Store.FILENAME).is_file():
        raise UsageError(f"{path}: not a results store (no {Store.FILENAME} in {where})")
    return Store(where, readonly=True)


def store_uid(store: Store) -> str:
    return str(store.db.execute("SELECT uid FROM store_identity").fetchone()[0])


def import_store(dst: Store, src: Store) -> Imported:
    """Copy every ended run of `src` that `dst` does not have, in one transaction."""
    ours, theirs = store_uid(dst), store_uid(src)
    if ours == theirs or dst.path.resolve() == src.path.resolve():
        raise UsageError(f"{src.dir} is this results store itself: nothing to import")
    here = {r[0]: r[1:] for r in dst.db.execute("SELECT uid, id, status, finished_at, origin FROM runs").fetchall()}
    used = {v[0] for v in here.values()}
    out = Imported()
    with dst.db:
        dst.db.execute("BEGIN IMMEDIATE")
        for row in src.db.execute(f"SELECT {RUN_COLUMNS} FROM runs ORDER BY started_at").fetchall():
            run = dict(zip(RUN_FIELDS, row))
            if run["status"] == "running":
                out.running.append(run["id"])
                continue
            if run["uid"] in here:
                local_id, status, finished, origin = here[run["uid"]]
                newer = (run["finished_at"] or 0) > (finished or 0) and status != "done"
                if origin == ours or not newer:
                    out.present += 1
                    continue
                delete_run(dst, local_id)  # an unfinished copy, ended there since: brought up to date
                out.replaced.append(local_id)
                new_id = local_id
            else:
                new_id = _free_id(run["id"], run["uid"], used)
                used.add(new_id)
                out.added.append((run["id"], new_id))
            out.samples += _copy_run(dst, src, run, new_id, theirs)
    return out


def _free_id(run_id: str, uid: str, used: set[str]) -> str:
    """The run's id if it is free here, else the id with a short suffix from its uid."""
    if run_id not in used and RUN_ID.fullmatch(run_id):
        return run_id
    digest = hashlib.sha256(uid.encode()).hexdigest()
    for width in range(4, len(digest)):
        candidate = f"{run_id[: 15 - width]}-{digest[:width]}".lstrip("-")
        if candidate not in used and RUN_ID.fullmatch(candidate):
            return candidate
    raise UsageError(f"no free id for run {run_id!r}")  # 60 hex digits all taken: cannot happen


def _copy_run(dst: Store, src: Store, run: dict, new_id: str, source_uid: str) -> int:
    """Insert one run of `src` as `new_id` with everything stored for it; its sample count."""
    old_id = run["id"]
    dst.db.execute(
        f"INSERT INTO runs ({RUN_COLUMNS}) VALUES ({', '.join('?' * len(RUN_FIELDS))})",
        tuple(
            {**run, "id": new_id, "origin": run["origin"] or source_uid, "origin_id": run["origin_id"] or old_id}[k]
            for k in RUN_FIELDS
        ),
    )
    _copy_rows(dst, src, "cells", old_id, new_id)
    raw_ids: dict[int, int] = {}
    for r in src.db.execute("SELECT * FROM raw_outputs WHERE run_id = ? ORDER BY id", (old_id,)).fetchall():
        cur = dst.db.execute(
            f"INSERT INTO raw_outputs VALUES (NULL, ?, {', '.join('?' * (len(r) - 2))})", (new_id, *r[2:])
        )
        raw_ids[r[0]] = int(cur.lastrowid)
    facts_ids = _copy_host_facts(dst, src, old_id, new_id)
    samples = src.db.execute(
        "SELECT cell_id, raw_id, workload, metric, value, unit, higher_is_better, repetition, labels"
        " FROM samples WHERE run_id = ? ORDER BY id",
        (old_id,),
    ).fetchall()
    for cell_id, raw_id, workload, metric, value, unit, hib, rep, labels in samples:
        shown = json.loads(labels)
        if isinstance(shown.get("host_facts_id"), int):  # the run's host facts, as numbered here
            shown["host_facts_id"] = facts_ids.get(shown["host_facts_id"], shown["host_facts_id"])
        dst.db.execute(
            "INSERT INTO samples (run_id, cell_id, raw_id, workload, metric, value, unit, higher_is_better,"
            " repetition, labels) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (new_id, cell_id, raw_ids.get(raw_id), workload, metric, value, unit, hib, rep, _j(shown)),
        )
    for r in src.db.execute(
        "SELECT cell_id, round, workload, repetition, started_at, finished_at, outcome, raw_id, error"
        " FROM executions WHERE run_id = ? ORDER BY id",
        (old_id,),
    ).fetchall():
        dst.db.execute(
            "INSERT INTO executions (run_id, cell_id, round, workload, repetition, started_at, finished_at,"
            " outcome, raw_id, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (new_id, *r[:7], raw_ids.get(r[7]), r[8]),
        )
    for r in src.db.execute(
        "SELECT cell_id, round, stage, workload, seconds, finished_at FROM stage_times WHERE run_id = ? ORDER BY id",
        (old_id,),
    ).fetchall():
        dst.db.execute(
            "INSERT INTO stage_times (run_id, cell_id, round, stage, workload, seconds, finished_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (new_id, *r),
        )
    return len(samples)


def _copy_rows(dst: Store, src: Store, table: str, old_id: str, new_id: str) -> None:
    """The rows of `table` (whose first column is run_id and that has no id of its own) as `new_id`'s."""
    for r in src.db.execute(f"SELECT * FROM {table} WHERE run_id = ?", (old_id,)).fetchall():
        dst.db.execute(f"INSERT INTO {table} VALUES ({', '.join('?' * len(r))})", (new_id, *r[1:]))


def _copy_host_facts(dst: Store, src: Store, old_id: str, new_id: str) -> dict[int, int]:
    """The run's hosts and their facts (one row per host and fingerprint here); src id -> dst id."""
    mapping = {}
    for host, fid, fingerprint, facts, taken_at in src.db.execute(
        "SELECT rh.host, hf.id, hf.fingerprint, hf.facts, hf.taken_at FROM run_hosts rh"
        " JOIN host_facts hf ON hf.id = rh.host_facts_id WHERE rh.run_id = ?",
        (old_id,),
    ).fetchall():
        row = dst.db.execute(
            "SELECT id FROM host_facts WHERE host = ? AND fingerprint = ?", (host, fingerprint)
        ).fetchone()
        if row is None:
            row = (
                dst.db.execute(
                    "INSERT INTO host_facts (host, fingerprint, facts, taken_at) VALUES (?, ?, ?, ?)",
                    (host, fingerprint, facts, taken_at),
                ).lastrowid,
            )
        mapping[fid] = int(row[0])
        dst.db.execute("INSERT INTO run_hosts (run_id, host, host_facts_id) VALUES (?, ?, ?)", (new_id, host, row[0]))
    return mapping


def _j(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str)
