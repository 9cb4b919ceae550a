"""The command line: the only part of the lab that prints, reads argv and the environment, and exits.

- lab.cli.group: the `lab` group and what its commands share (options, the results store, signals)
- lab.cli.printing: every line printed, as text (never rich markup), and the number formats
- lab.cli.progress: a run's progress (live bar or plain lines) and its ETA
- lab.cli.runcmds: plan, run, gc, doctor, snapshot
- lab.cli.views: ls, show, report, reparse
- lab.cli.comparing: compare (two sides, or every cell against its baseline)
- lab.cli.explaincmds: explain (which knob makes a difference: follow-up cells, effects)
- lab.cli.imagecmds: images build, ls, render, publish
- lab.cli.historycmds: history, import, prune

Exit status: 0 success, 1 a run or operation failed (or an unexpected error: one line here, the
traceback in a log file), 2 bad input (nothing was created), 130 interrupted.
"""

from __future__ import annotations

from lab.cli import (  # noqa: F401 - each registers its commands on the group
    comparing,
    explaincmds,
    historycmds,
    imagecmds,
    runcmds,
    views,
)
from lab.cli.group import cli
from lab.cli.progress import Eta, PlainReporter, RichReporter  # noqa: F401 - tests and callers use lab.cli.Eta

__all__ = ["cli", "main", "Eta", "PlainReporter", "RichReporter"]


def main(argv: list[str] | None = None) -> None:
    """The `lab` program (its exit statuses and one-line errors: lab.cli.group.LabGroup.main)."""
    cli.main(args=argv, prog_name="lab")
