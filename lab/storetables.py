"""Two tables of the results store (lab.store), each a part of Store with its own job, over the
store's one connection: what a run timed (`store.timings`: its executed order and each stage's
seconds, for lab.estimate) and the facts of the hosts it ran on (`store.host_facts`: one row per
distinct fingerprint of a host, lab.hostinfo)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lab import redact

if TYPE_CHECKING:
    from lab.store import Store


@dataclass(frozen=True)
class ExecutionRow:
    seq: int
    cell_id: str
    round: int
    workload: str
    repetition: int
    started_at: float
    finished_at: float | None
    outcome: str  # running (never finished: the run was killed) | ok | failed
    raw_id: int | None
    error: str | None


@dataclass(frozen=True)
class StageTimeRow:
    cell_id: str
    round: int
    stage: str
    workload: str | None
    seconds: float


def as_json(value: Any) -> str:
    return redact.passwords(json.dumps(value, sort_keys=True, default=str))  # no URL's password is kept


class Timings:
    """The executed order (each warm-up and repetition as it started and ended) and each stage's
    seconds (lab.estimate)."""

    def __init__(self, store: Store):
        self.store = store

    def start_execution(self, run_id: str, cell_id: str, round_no: int, workload: str, repetition: int) -> int:
        cur = self.store.db.execute(
            "INSERT INTO executions (run_id, cell_id, round, workload, repetition, started_at, outcome)"
            " VALUES (?, ?, ?, ?, ?, ?, 'running')",
            (run_id, cell_id, round_no, workload, repetition, time.time()),
        )
        return int(cur.lastrowid)

    def finish_execution(
        self, execution_id: int, outcome: str, raw_id: int | None = None, error: str | None = None
    ) -> None:
        self.store.db.execute(
            "UPDATE executions SET outcome = ?, raw_id = ?, error = ?, finished_at = ? WHERE id = ?",
            (outcome, raw_id, error, time.time(), execution_id),
        )

    def executions(self, run_id: str) -> list[ExecutionRow]:
        rows = self.store.db.execute(
            "SELECT id, cell_id, round, workload, repetition, started_at, finished_at, outcome, raw_id, error"
            " FROM executions WHERE run_id = ? ORDER BY id",
            (run_id,),
        ).fetchall()
        return [ExecutionRow(*r) for r in rows]

    def add_stage_time(
        self, run_id: str, cell_id: str, round_no: int, stage: str, seconds: float, workload: str | None = None
    ) -> None:
        self.store.db.execute(
            "INSERT INTO stage_times (run_id, cell_id, round, stage, workload, seconds, finished_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (run_id, cell_id, round_no, stage, workload, seconds, time.time()),
        )

    def stage_times(self, run_id: str) -> list[StageTimeRow]:
        rows = self.store.db.execute(
            "SELECT cell_id, round, stage, workload, seconds FROM stage_times WHERE run_id = ? ORDER BY id", (run_id,)
        ).fetchall()
        return [StageTimeRow(*r) for r in rows]


class HostFacts:
    """A host's facts, stored once per distinct fingerprint, and the runs that ran on them."""

    def __init__(self, store: Store):
        self.store = store

    def save(self, host: str, fingerprint: str, facts: dict[str, Any]) -> int:
        """Store a host's facts once per distinct fingerprint; the id of the stored row."""
        row = self.store.db.execute(
            "SELECT id FROM host_facts WHERE host = ? AND fingerprint = ?", (host, fingerprint)
        ).fetchone()
        return (
            row[0]
            if row
            else int(
                self.store.db.execute(
                    "INSERT INTO host_facts (host, fingerprint, facts, taken_at) VALUES (?, ?, ?, ?)",
                    (host, fingerprint, as_json(facts), time.time()),
                ).lastrowid
            )
        )

    def runs_of(self, host_facts_id: int) -> list[str]:
        """The runs that ran on a host while it had this fingerprint."""
        rows = self.store.db.execute(
            "SELECT run_id FROM run_hosts WHERE host_facts_id = ? ORDER BY run_id", (host_facts_id,)
        ).fetchall()
        return [r[0] for r in rows]

    def add(self, run_id: str, host: str, fingerprint: str, facts: dict[str, Any]) -> int:
        fid = self.save(host, fingerprint, facts)
        self.store.db.execute(
            "INSERT OR REPLACE INTO run_hosts (run_id, host, host_facts_id) VALUES (?, ?, ?)", (run_id, host, fid)
        )
        return fid

    def of_run(self, run_id: str) -> dict[str, dict[str, Any]]:
        rows = self.store.db.execute(
            "SELECT rh.host, hf.fingerprint, hf.facts FROM run_hosts rh JOIN host_facts hf ON hf.id = rh.host_facts_id"
            " WHERE rh.run_id = ?",
            (run_id,),
        ).fetchall()
        return {r[0]: {"fingerprint": r[1], **json.loads(r[2])} for r in rows}
