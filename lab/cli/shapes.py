"""The `--json` documents: one shape per command, its name and version defined here only (the
documents of ls, plan, doctor and gc are built here too; show, compare, snapshot and images ls
build theirs beside their tables and emit them through here).

Each document is one JSON object on stdout whose first key, "schema", names its shape and version
("lab.plan/1"). A version changes only when a key is removed or changes meaning; new keys may be
added within a version, so readers ignore keys they do not know. Errors stay what they are
without --json: one line on stderr, exit status 2 (bad input) or 1 (failed).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from lab import plan
from lab.doctor import Check
from lab.estimate import Estimate
from lab.gc import GcReport
from lab.labconfig import LabConfig
from lab.store import Store

VERSIONS = {
    "ls": 1,
    "plan": 1,
    "doctor": 1,
    "gc": 1,
    "show": 1,
    "compare": 2,  # 2: verdicts are better | worse | same | unknown (primary rows), q, margin, primary
    "compare.baseline": 2,  # `lab compare RUN --baseline`: the overhead rows, a shape of its own
    "snapshot": 1,
    "images": 1,  # `lab images ls`
    "images.warm": 1,  # `lab images ls --warm`
    "history": 1,
    "import": 1,
    "explain": 1,  # `lab explain`: knobs with effect, CI, share of the gap and verdict; interactions; cells
    "explain.plan": 1,  # `lab explain --plan`: the follow-up cells and the estimate
}


def schema(command: str) -> str:
    return f"lab.{command}/{VERSIONS[command]}"


def emit(command: str, document: dict[str, Any]) -> None:
    """`document` on stdout as the command's JSON shape, its schema first."""
    click.echo(json.dumps({"schema": schema(command), **document}, indent=2, default=str))


def ls_document(where: Path, store: Store | None) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    if store is None:  # no results store yet: no runs
        return {"results": str(where.resolve()), "runs": runs}
    for r in store.runs():
        cells = store.cells(r.id)
        runs.append(
            {
                "id": r.id,
                "name": r.name,
                "status": r.status,
                "error": r.error,
                "started_at": r.started_at,
                "finished_at": r.finished_at,
                "duration_s": round((r.finished_at or time.time()) - r.started_at, 1),
                "cells": len(cells),
                "cells_done": sum(1 for c in cells if c.status == "done"),
                "samples": len(store.samples(r.id)),
                "seed": r.seed,
            }
        )
    return {"results": str(where.resolve()), "runs": runs}


def plan_document(
    cfg: LabConfig,
    units: list[plan.Unit],
    dups: dict[str, str],
    *,
    vms: int,
    boots: int,
    backends: list[str],
    est: Estimate,
    verdicts: tuple[bool, str, str, dict[str, Any]],
    host_watch: dict[str, str],
    images: list[str] | None,
) -> dict[str, Any]:
    suite = cfg.suite
    cells = [
        {"id": u.id, "label": u.label, "kind": u.kind, "host": u.host, "axes": u.axes(), "duplicate_of": dups.get(u.id)}
        for u in units
    ]
    return {
        "lab": cfg.lab.name,
        "cells": cells,
        "creates": {"vms": vms, "boots_per_cell": boots, "backends": backends, "bare_metal": suite.bare_metal},
        "suite": {
            "workloads": list(suite.workloads),
            "repetitions": suite.repetitions,
            "max_repetitions": suite.max_repetitions if suite.target_ci_pct is not None else suite.repetitions,
            "target_ci_pct": suite.target_ci_pct,
            "warmup": suite.warmup,
            "order": suite.order,
            "seed": suite.seed,
        },
        "estimate": {**est.as_dict(), "at_least": suite.target_ci_pct is not None},
        "verdicts": {"reachable": verdicts[0], "text": verdicts[1], "setting": verdicts[2], **verdicts[3]},
        "host_watch": host_watch,
        "checked": images is not None,
        "images": images or [],
    }


def doctor_document(checks: list[Check], accel: str | None) -> dict[str, Any]:
    return {
        "ok": not any(c.status == "fail" for c in checks),
        "accel": accel,
        "checks": [{"name": c.name, "status": c.status, "ok": c.status != "fail", "detail": c.detail} for c in checks],
    }


def gc_document(report: GcReport, dry_run: bool) -> dict[str, Any]:
    return {
        "dry_run": dry_run,
        "ok": not report.errors,
        "removed": report.removed,
        "kept": report.kept,
        "items": [i.__dict__ for i in report.items],
        "marked_failed": report.marked_failed,
        "errors": report.errors,
    }
