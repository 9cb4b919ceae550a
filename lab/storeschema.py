"""The results store's schema (lab.store): numbered migrations, applied in order when a store is
opened (`apply`). A migration is never edited once released: a new one is appended."""

from __future__ import annotations

import sqlite3

MIGRATIONS: list[str] = [
    # 1: the first schema
    """
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        started_at REAL NOT NULL,
        finished_at REAL,
        status TEXT NOT NULL,            -- running | done | failed | interrupted
        error TEXT,
        config_path TEXT,
        config_text TEXT,
        seed INTEGER,
        lab_version TEXT,
        manifest TEXT                    -- JSON: images (digests, tool versions), backends' facts
    );
    CREATE TABLE cells (
        run_id TEXT NOT NULL REFERENCES runs(id),
        cell_id TEXT NOT NULL,
        idx INTEGER NOT NULL,
        label TEXT NOT NULL,
        axes TEXT NOT NULL,              -- JSON
        status TEXT NOT NULL,            -- pending | running | done | failed | n/a | duplicate
        stage TEXT,                      -- the stage reached (the failed one, if failed)
        error TEXT,
        started_at REAL,
        finished_at REAL,
        vm_name TEXT,
        facts TEXT,                      -- JSON: accel, image digest, clone kind, tuning in effect...
        PRIMARY KEY (run_id, cell_id)
    );
    CREATE TABLE leases (
        id INTEGER PRIMARY KEY,
        run_id TEXT NOT NULL,
        cell_id TEXT NOT NULL,
        host TEXT NOT NULL,
        backend TEXT NOT NULL,
        vm_name TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        released_at REAL,
        detail TEXT
    );
    CREATE TABLE raw_outputs (
        id INTEGER PRIMARY KEY,
        run_id TEXT NOT NULL,
        cell_id TEXT NOT NULL,
        workload TEXT NOT NULL,
        repetition INTEGER NOT NULL,     -- warm-up runs are negative: -1, -2, ...
        command TEXT,
        stdout TEXT,
        stderr TEXT,
        returncode INTEGER,
        started_at REAL,
        seconds REAL,
        params TEXT,
        extra TEXT
    );
    CREATE TABLE samples (
        id INTEGER PRIMARY KEY,
        run_id TEXT NOT NULL,
        cell_id TEXT NOT NULL,
        raw_id INTEGER REFERENCES raw_outputs(id),
        workload TEXT NOT NULL,
        metric TEXT NOT NULL,
        value REAL NOT NULL,
        unit TEXT NOT NULL,
        higher_is_better INTEGER,        -- 1, 0 or NULL (informational)
        repetition INTEGER NOT NULL,
        labels TEXT NOT NULL
    );
    CREATE INDEX samples_run ON samples(run_id, cell_id, workload, metric);
    CREATE TABLE host_facts (
        id INTEGER PRIMARY KEY,
        host TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        facts TEXT NOT NULL,
        taken_at REAL NOT NULL
    );
    CREATE TABLE run_hosts (
        run_id TEXT NOT NULL,
        host TEXT NOT NULL,
        host_facts_id INTEGER REFERENCES host_facts(id),
        PRIMARY KEY (run_id, host)
    );
    """,
    # 2: the executed order: one row per workload execution (warm-ups included), written when it
    # starts and completed when it ends, so the order of cells and repetitions a run really
    # followed (and where it was cut short) is in the store, not only the planned order.
    """
    CREATE TABLE executions (
        id INTEGER PRIMARY KEY,          -- the execution order
        run_id TEXT NOT NULL,
        cell_id TEXT NOT NULL,
        round INTEGER NOT NULL,          -- 1 unless the run interleaves cells in rounds
        workload TEXT NOT NULL,
        repetition INTEGER NOT NULL,     -- warm-ups are negative, as in raw_outputs
        started_at REAL NOT NULL,
        finished_at REAL,
        outcome TEXT NOT NULL,           -- running | ok | failed
        raw_id INTEGER,
        error TEXT
    );
    CREATE INDEX executions_run ON executions(run_id, id);
    """,
    # 3: how long each stage of each boot of a cell took (a workload's prepare per workload), so
    # the next `lab plan` on the same host estimates from what runs measured (lab.estimate).
    # Only stages that completed are recorded: a boot that timed out says nothing about a boot.
    """
    CREATE TABLE stage_times (
        id INTEGER PRIMARY KEY,
        run_id TEXT NOT NULL,
        cell_id TEXT NOT NULL,
        round INTEGER NOT NULL,          -- the boot of the cell (1 unless the run interleaves rounds)
        stage TEXT NOT NULL,             -- lease, clone, boot, ssh, verify, tune, workloads, teardown, prepare
        workload TEXT,                   -- prepare: the workload prepared
        seconds REAL NOT NULL,
        finished_at REAL NOT NULL
    );
    CREATE INDEX stage_times_run ON stage_times(run_id, cell_id)
    """,
    # 4: identities, so stores from several machines can be merged (lab import, lab.storeimport):
    # the store's own uid, and per run a uid that is the same in every store it is copied to, the
    # uid of the store it was measured into (origin) and its id there (an import may rename it:
    # ids are only unique per store). A run made before this migration gets a uid derived from its
    # id and start time, so two copies of one store, each migrated on its own, still agree.
    """
    CREATE TABLE store_identity (
        uid TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    INSERT INTO store_identity (uid, created_at)
        VALUES (lower(hex(randomblob(16))), (julianday('now') - 2440587.5) * 86400.0);
    ALTER TABLE runs ADD COLUMN uid TEXT;
    ALTER TABLE runs ADD COLUMN origin TEXT;
    ALTER TABLE runs ADD COLUMN origin_id TEXT;
    UPDATE runs SET uid = 'run:' || id || '@' || printf('%.6f', started_at),
        origin = (SELECT uid FROM store_identity), origin_id = id;
    CREATE UNIQUE INDEX runs_uid ON runs(uid)
    """,
]


def apply(db: sqlite3.Connection, version: int) -> None:
    """Bring `db` from schema `version` to the newest, in the caller's transaction."""
    for number, sql in enumerate(MIGRATIONS[version:], start=version + 1):
        for stmt in filter(str.strip, sql.split(";")):
            db.execute(stmt)
        db.execute(f"PRAGMA user_version = {number}")
