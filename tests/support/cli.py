"""`lab` run from a test: in this process through click (fast, the same exit statuses and
one-line errors) or as a process of its own (signals, VMs, the entry point)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

LAB = [sys.executable, "-m", "lab"]


def run_lab_cli(*args: str, cwd: Path | None = None, timeout: float = 1800, env: dict | None = None):
    """`lab ARGS` as a process of its own: for runs that boot VMs, signals, and the entry point."""
    return subprocess.run(
        [*LAB, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})}
    )


@dataclasses.dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def lab_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> CliResult:
    """`lab ARGS` in this process through click's CliRunner (no interpreter start-up): the same
    group, exit statuses and one-line errors as the program. `env`: variables to set (None: unset)."""
    from click.testing import CliRunner

    from lab.cli import cli

    with contextlib.chdir(cwd or Path.cwd()):
        res = CliRunner().invoke(cli, list(args), env=env, prog_name="lab", catch_exceptions=False)
    return CliResult(res.exit_code, res.stdout, res.stderr)
