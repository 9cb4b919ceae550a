"""The results store: one SQLite file (WAL) per results directory.

Every write commits at once, so a `kill -9` at any point leaves a readable store holding every
sample measured so far. Schema changes are numbered migrations, applied in order on open.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab import storeschema
from lab.errors import LabError, TimeoutError_, UsageError
from lab.model import RawOutput, Sample
from lab.storeschema import MIGRATIONS
from lab.storetables import ExecutionRow, HostFacts, StageTimeRow, Timings, as_json as _j  # noqa: F401 - row types, as lab.store names them
from lab.wait import wait_until

_INSERT_SAMPLE = (
    "INSERT INTO samples (run_id, cell_id, raw_id, workload, metric, value, unit, higher_is_better,"
    " repetition, labels) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _sample_rows(
    run_id: str, cell_id: str, raw_id: int | None, workload: str, repetition: int, samples: list[Sample]
) -> list[tuple]:
    return [
        (
            run_id,
            cell_id,
            raw_id,
            workload,
            s.metric,
            float(s.value),
            s.unit,
            None if s.higher_is_better is None else int(s.higher_is_better),
            repetition,
            _j(s.labels),
        )
        for s in samples
    ]


@dataclass(frozen=True)
class RunRow:
    id: str
    name: str
    started_at: float
    finished_at: float | None
    status: str
    error: str | None
    seed: int | None
    config_path: str | None
    manifest: dict[str, Any]


@dataclass(frozen=True)
class CellRow:
    run_id: str
    cell_id: str
    idx: int
    label: str
    axes: dict[str, Any]
    status: str
    stage: str | None
    error: str | None
    facts: dict[str, Any]


@dataclass(frozen=True)
class SampleRow:
    run_id: str
    cell_id: str
    workload: str
    metric: str
    value: float
    unit: str
    higher_is_better: bool | None
    repetition: int
    labels: dict[str, Any]


class StoreError(LabError):
    """The results store failed (disk full, read-only, corrupt): one line naming the file."""


class _Connection(sqlite3.Connection):
    """Every SQLite failure (SQLITE_FULL on a full results disk, a locked or unreadable file)
    becomes a StoreError naming the store, so the CLI reports it in one line, not a traceback.
    A failed statement or commit is rolled back by SQLite: what was committed before stays.

    One writer: the lanes of a run (lab.runner.lanes) share the store from several threads. Every
    statement, and every `with db:` transaction as a whole, holds the connection's lock, so one
    lane's autocommit write never lands inside another lane's open transaction."""

    where = "results store"
    hint: str | None = None  # what to do, when not _HINT

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lock = threading.RLock()

    def execute(self, *args, **kwargs):
        with self.lock:
            try:
                return super().execute(*args, **kwargs)
            except sqlite3.Error as exc:
                raise StoreError(f"{self.where}: {exc}", hint=self.hint or _HINT) from None

    def executemany(self, *args, **kwargs):
        with self.lock:
            try:
                return super().executemany(*args, **kwargs)
            except sqlite3.Error as exc:
                raise StoreError(f"{self.where}: {exc}", hint=self.hint or _HINT) from None

    def __enter__(self):
        self.lock.acquire()  # held until the transaction is committed or rolled back
        try:
            return super().__enter__()
        except BaseException:
            self.lock.release()
            raise

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.where}: {exc}", hint=self.hint or _HINT) from None
        finally:
            self.lock.release()


_HINT = "free space in the results directory, then `lab run --resume RUN` continues the run"


class Store:
    FILENAME = "lab.db"

    def __init__(self, results_dir: Path, *, readonly: bool | None = None):
        """The store of `results_dir`, made if missing. `readonly`: True opens an existing store
        for reading only; None (the default) does so when this process cannot write to it (a
        read-only mount, a copy of someone else's results), so that reading commands still work."""
        self.dir = Path(results_dir)
        self.path = self.dir / self.FILENAME
        if readonly is None:
            readonly = self.path.exists() and not (os.access(self.path, os.W_OK) and os.access(self.dir, os.W_OK))
        self.readonly = readonly
        # Its tables with a job of their own (lab.storetables), over this store's connection
        self.timings = Timings(self)
        self.host_facts = HostFacts(self)
        if readonly:
            self._open_readonly()
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create results directory {self.dir}: {exc.strerror}") from None
        try:
            # Two processes making one new store at once (`lab show` polling while `lab run` starts):
            # switching it to WAL is refused at once ("locked"), without SQLite's busy wait: try again.
            wait_until(
                self._open_writable,
                timeout=30,
                what=f"results store {self.path} to be unlocked",
                interval=0.02,
                max_interval=0.5,
            )
        except (sqlite3.DatabaseError, StoreError, TimeoutError_) as exc:
            raise StoreError(f"results store {self.path} is unusable: {getattr(exc, 'message', exc)}") from None

    def _open_writable(self) -> bool:
        """Connect, set the pragmas, migrate. False (closed again) when the file was locked."""
        # isolation_level=None: autocommit; every statement is durable when it returns.
        self.db = sqlite3.connect(
            self.path, isolation_level=None, timeout=30, check_same_thread=False, factory=_Connection
        )
        self.db.where = f"results store {self.path}"
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA busy_timeout=30000")
            self._migrate()
            return True
        except LabError as exc:  # a StoreError, or a newer schema
            self.db.close()
            if "database is locked" in str(exc):
                return False
            raise

    def _open_readonly(self) -> None:
        """Open for reading only. Where the store could be written, a connection that refuses to
        write (query_only): as the last one it removes the -wal and -shm files it opened, as every
        writer does. Elsewhere SQLite's read-only mode, and where even that needs files it cannot
        make (a WAL store in a directory this process cannot write to), an immutable file. A store
        of an older schema is read through a copy upgraded in memory (the file stays as it is);
        one of a newer schema is refused."""
        if not self.path.is_file():
            raise UsageError(f"no runs in {self.dir} (no {self.FILENAME})")
        uri = "file:" + urllib.parse.quote(str(self.path.resolve()))
        last: Exception | None = None
        writable = os.access(self.path, os.W_OK) and os.access(self.dir, os.W_OK)
        for query in ("mode=rw", "mode=ro", "mode=ro&immutable=1")[0 if writable else 1 :]:
            db = None
            try:
                db = sqlite3.connect(
                    f"{uri}?{query}",
                    uri=True,
                    isolation_level=None,
                    timeout=30,
                    check_same_thread=False,
                    factory=_Connection,
                )
                db.where = f"results store {self.path} (read-only)"
                db.hint = "the store is read-only here: copy the results directory somewhere writable to change it"
                db.execute("PRAGMA query_only = 1")
                version = db.execute("PRAGMA user_version").fetchone()[0]
                self.db = db
                break
            except (sqlite3.Error, StoreError) as exc:
                last = exc
                if db is not None:
                    db.close()
        else:
            raise StoreError(f"results store {self.path} cannot be read: {getattr(last, 'message', last)}")
        if version > len(MIGRATIONS):
            self.db.close()
            raise UsageError(
                f"results store {self.path} has schema {version}, newer than this lab's {len(MIGRATIONS)}",
                hint="upgrade lab",
            )
        if version < len(MIGRATIONS):  # read through an upgraded copy in memory: the file is never written
            older, self.db = self.db, sqlite3.connect(":memory:", isolation_level=None, factory=_Connection)
            self.db.where, self.db.hint = older.where, older.hint
            older.backup(self.db)
            older.close()
            storeschema.apply(self.db, version)

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version == len(MIGRATIONS):
            return  # the common case: no write lock taken
        # One migrator at a time: another process (a second `lab run`, `lab show` while a run
        # starts) may be opening the same new store; the version is read again under the lock.
        self.db.execute("BEGIN IMMEDIATE")
        try:
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version > len(MIGRATIONS):
                raise UsageError(f"{self.path} was written by a newer lab (schema {version}); upgrade lab")
            storeschema.apply(self.db, version)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    @property
    def schema_version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def close(self) -> None:
        self.db.close()

    # -- runs -------------------------------------------------------------------------------
    def create_run(
        self,
        run_id: str,
        name: str,
        *,
        config_path: str,
        config_text: str,
        seed: int,
        lab_version: str,
        manifest: dict[str, Any],
    ) -> None:
        # uid: the run's identity in every store it is imported into (lab.storeimport)
        row = (run_id, name, time.time(), config_path, config_text, seed, lab_version, _j(manifest), uuid.uuid4().hex)
        self.db.execute(
            "INSERT INTO runs (id, name, started_at, status, config_path, config_text, seed, lab_version, manifest,"
            " uid, origin, origin_id)"
            " VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, (SELECT uid FROM store_identity), ?)",
            (*row, run_id),
        )

    def finish_run(self, run_id: str, status: str, error: str | None = None) -> None:
        self.db.execute(
            "UPDATE runs SET status = ?, error = ?, finished_at = ? WHERE id = ?", (status, error, time.time(), run_id)
        )

    def reopen_run(self, run_id: str) -> None:
        self.db.execute("UPDATE runs SET status = 'running', error = NULL, finished_at = NULL WHERE id = ?", (run_id,))

    def reset_cell(self, run_id: str, cell_id: str) -> None:
        """Forget an unfinished cell's partial results before it is run again (resume)."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM samples WHERE run_id = ? AND cell_id = ?", (run_id, cell_id))
            self.db.execute("DELETE FROM raw_outputs WHERE run_id = ? AND cell_id = ?", (run_id, cell_id))
            self.db.execute(
                "UPDATE cells SET status = 'pending', stage = NULL, error = NULL, started_at = NULL,"
                " finished_at = NULL, facts = '{}' WHERE run_id = ? AND cell_id = ?",
                (run_id, cell_id),
            )

    def discard_run(self, run_id: str) -> None:
        """Forget a run refused before any of its cells started (a host's checks as it opened said
        no): exit 2 records nothing. Its rows go whole, in one transaction."""
        with self.db:
            self.db.execute("BEGIN")
            for table in ("samples", "raw_outputs", "executions", "stage_times", "leases", "run_hosts", "cells"):
                self.db.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))  # noqa: S608 - our names
            self.db.execute("DELETE FROM runs WHERE id = ?", (run_id,))

    def update_manifest(self, run_id: str, manifest: dict[str, Any]) -> None:
        self.db.execute("UPDATE runs SET manifest = ? WHERE id = ?", (_j(manifest), run_id))

    def runs(self) -> list[RunRow]:
        rows = self.db.execute(
            "SELECT id, name, started_at, finished_at, status, error, seed, config_path, manifest"
            " FROM runs ORDER BY started_at"
        ).fetchall()
        return [RunRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], json.loads(r[8] or "{}")) for r in rows]

    def run(self, ref: str) -> RunRow:
        """A run by id, unique id prefix, or "latest"."""
        runs = self.runs()
        if not runs:
            raise UsageError(f"no runs in {self.path}")
        if ref == "latest":
            return runs[-1]
        exact = [r for r in runs if r.id == ref]
        if exact:
            return exact[0]
        matches = [r for r in runs if r.id.startswith(ref)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise UsageError(f"no run {ref!r} in {self.path} (see `lab ls`)")
        raise UsageError(f"run {ref!r} is ambiguous: {', '.join(m.id for m in matches)}")

    def config_text(self, run_id: str) -> str:
        row = self.db.execute("SELECT config_text FROM runs WHERE id = ?", (run_id,)).fetchone()
        return row[0] if row else ""

    # -- cells ------------------------------------------------------------------------------
    def add_cell(self, run_id: str, cell_id: str, idx: int, label: str, axes: dict[str, Any]) -> None:
        self.db.execute(
            "INSERT INTO cells (run_id, cell_id, idx, label, axes, status, facts)"
            " VALUES (?, ?, ?, ?, ?, 'pending', '{}')",
            (run_id, cell_id, idx, label, _j(axes)),
        )

    def cell_update(
        self,
        run_id: str,
        cell_id: str,
        *,
        status: str | None = None,
        stage: str | None = None,
        error: str | None = None,
        vm_name: str | None = None,
        facts: dict[str, Any] | None = None,
        started: bool = False,
        finished: bool = False,
    ) -> None:
        sets: list[str] = []
        args: list[Any] = []
        for col, val in (("status", status), ("stage", stage), ("error", error), ("vm_name", vm_name)):
            if val is not None:
                sets.append(f"{col} = ?")
                args.append(val)
        if facts is not None:
            sets.append("facts = ?")
            args.append(_j(facts))
        if started:
            sets.append("started_at = ?")
            args.append(time.time())
        if finished:
            sets.append("finished_at = ?")
            args.append(time.time())
        if sets:
            self.db.execute(
                f"UPDATE cells SET {', '.join(sets)} WHERE run_id = ? AND cell_id = ?", (*args, run_id, cell_id)
            )

    def cells(self, run_id: str) -> list[CellRow]:
        rows = self.db.execute(
            "SELECT run_id, cell_id, idx, label, axes, status, stage, error, facts FROM cells"
            " WHERE run_id = ? ORDER BY idx",
            (run_id,),
        ).fetchall()
        return [
            CellRow(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5], r[6], r[7], json.loads(r[8] or "{}")) for r in rows
        ]

    # -- leases -----------------------------------------------------------------------------
    def cell_statuses(self, run_id: str) -> dict[str, str]:
        """cell id -> status: what a lane that ends needs, without every cell's facts."""
        return dict(self.db.execute("SELECT cell_id, status FROM cells WHERE run_id = ?", (run_id,)).fetchall())

    def add_lease(
        self,
        run_id: str,
        cell_id: str,
        host: str,
        backend: str,
        vm_name: str,
        expires_at: float,
        detail: dict[str, Any] | None = None,
    ) -> int:
        cur = self.db.execute(
            "INSERT INTO leases (run_id, cell_id, host, backend, vm_name, created_at, expires_at, detail)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (run_id, cell_id, host, backend, vm_name, time.time(), expires_at, _j(detail or {})),
        )
        return int(cur.lastrowid)

    def release_lease(self, lease_id: int) -> None:
        self.db.execute("UPDATE leases SET released_at = ? WHERE id = ?", (time.time(), lease_id))

    def renew_lease(self, lease_id: int, expires_at: float) -> None:
        """A live run's machine keeps its lease (lab.runner.renewal)."""
        self.db.execute("UPDATE leases SET expires_at = ? WHERE id = ? AND released_at IS NULL", (expires_at, lease_id))

    def release_leases_named(self, vm_name: str) -> None:
        self.db.execute(
            "UPDATE leases SET released_at = ? WHERE vm_name = ? AND released_at IS NULL", (time.time(), vm_name)
        )

    def open_leases(self) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT id, run_id, cell_id, host, backend, vm_name, created_at, expires_at FROM leases"
            " WHERE released_at IS NULL ORDER BY id"
        ).fetchall()
        keys = ("id", "run_id", "cell_id", "host", "backend", "vm_name", "created_at", "expires_at")
        return [dict(zip(keys, r)) for r in rows]

    # -- raw outputs and samples -------------------------------------------------------------
    def add_raw(self, run_id: str, cell_id: str, repetition: int, raw: RawOutput) -> int:
        cur = self.db.execute(
            "INSERT INTO raw_outputs (run_id, cell_id, workload, repetition, command, stdout, stderr, returncode,"
            " started_at, seconds, params, extra) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                run_id,
                cell_id,
                raw.workload,
                repetition,
                raw.command,
                raw.stdout,
                raw.stderr,
                raw.returncode,
                raw.started,
                raw.seconds,
                _j(raw.params),
                _j(raw.extra),
            ),
        )
        return int(cur.lastrowid)

    def raw_outputs(self, run_id: str) -> Iterable[tuple[int, str, int, RawOutput]]:
        rows = self.db.execute(
            "SELECT id, cell_id, repetition, workload, command, stdout, stderr, returncode, started_at, seconds,"
            " params, extra FROM raw_outputs WHERE run_id = ? ORDER BY id",
            (run_id,),
        ).fetchall()
        for r in rows:
            yield (
                r[0],
                r[1],
                r[2],
                RawOutput(
                    r[3], r[4], r[5], r[6], r[7], r[8], r[9], json.loads(r[10] or "{}"), json.loads(r[11] or "{}")
                ),
            )

    def add_samples(
        self, run_id: str, cell_id: str, raw_id: int | None, workload: str, repetition: int, samples: list[Sample]
    ) -> None:
        with self.db:  # one transaction: a repetition's samples land together or not at all
            self.db.execute("BEGIN")
            self.db.executemany(_INSERT_SAMPLE, _sample_rows(run_id, cell_id, raw_id, workload, repetition, samples))

    def replace_samples(self, run_id: str, rows: Sequence[tuple[str, int | None, str, int, list[Sample]]]) -> None:
        """A run's samples replaced by `rows` (cell, raw id, workload, repetition, samples) in one
        transaction: a reparse killed half-way leaves the old samples, never none."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM samples WHERE run_id = ?", (run_id,))
            for cell_id, raw_id, workload, repetition, samples in rows:
                self.db.executemany(
                    _INSERT_SAMPLE, _sample_rows(run_id, cell_id, raw_id, workload, repetition, samples)
                )

    def samples(self, run_id: str) -> list[SampleRow]:
        rows = self.db.execute(
            "SELECT run_id, cell_id, workload, metric, value, unit, higher_is_better, repetition, labels"
            " FROM samples WHERE run_id = ? ORDER BY id",
            (run_id,),
        ).fetchall()
        return [
            SampleRow(r[0], r[1], r[2], r[3], r[4], r[5], None if r[6] is None else bool(r[6]), r[7], json.loads(r[8]))
            for r in rows
        ]
