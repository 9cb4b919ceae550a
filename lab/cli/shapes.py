"""The `--json` documents: one shape per command, its name and version defined here only (the
document of ls is built here too; plan, doctor and gc build theirs in lab.cli.runcmds, show,
compare, snapshot and images ls beside their tables, and all emit them through here).

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
