"""Progress of a run as it goes (lab.lifecycle.Reporter): a live bar on a terminal, plain lines in
a pipe or a CI log. Labels and errors are text (lab.cli.printing).

A run of several hosts runs one lane per host at once (lab.runner.lanes): the reporters are called
from every lane's thread, so each holds a lock around what it changes and prints; plain lines then
start with the lane ("pve1", "pve1/2", "pve1@node2"), and the ETA is the longest lane's."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from lab.cli.printing import STATUS_STYLES, duration, err, line, styled


class Eta:
    """Time left in a run: the plan's estimate until the first cell ends; then the pace of the
    cells ended so far, less the time already spent on the cell under way (so it counts down
    within a cell instead of restarting at each line). With several lanes, each lane at its own
    pace (a lane with no cell ended yet at the others' mean pace): the run ends with its longest."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.start = self.last = clock()
        self.total = self.done = 0
        self.estimate = 0.0
        self.lane_total: dict[str, int] = {}
        self.lane_done: dict[str, int] = {}
        self.lane_last: dict[str, float] = {}

    def begin(self, total: int, estimate_s: float, lanes: dict[str, int] | None = None) -> None:
        self.total, self.estimate = total, estimate_s
        self.lane_total = dict(lanes or {})
        self.lane_done = {lane: 0 for lane in self.lane_total}
        self.lane_last = {lane: self.start for lane in self.lane_total}

    def cell_ended(self, lane: str = "") -> None:
        self.done += 1
        self.last = self.clock()
        if lane in self.lane_done:
            self.lane_done[lane] += 1
            self.lane_last[lane] = self.last

    def elapsed(self) -> float:
        return self.clock() - self.start

    def seconds(self) -> float:
        now = self.clock()
        if not self.done:
            return max(self.estimate - (now - self.start), 0.0)
        if len(self.lane_total) <= 1:
            pace = (self.last - self.start) / self.done
            return max(pace * (self.total - self.done) - (now - self.last), 0.0)
        paces = {lane: (self.lane_last[lane] - self.start) / n for lane, n in self.lane_done.items() if n}
        mean = sum(paces.values()) / len(paces)
        return max(
            max(paces.get(lane, mean) * (total - self.lane_done[lane]) - (now - self.lane_last[lane]), 0.0)
            for lane, total in self.lane_total.items()
        )


def lane(lane_of: dict[str, str], cell) -> str:
    """A cell's lane (lab.runner.lanes: `lane_of` a cell id's; else its host's)."""
    return lane_of.get(cell.id, str(cell.host))


def lanes_of(cells: list, lane_of: dict[str, str]) -> dict[str, int]:
    """The run's lanes and how many cells each has."""
    return dict(Counter(lane(lane_of, c) for c in cells))


class _EtaColumn(ProgressColumn):
    def __init__(self, eta: Eta):
        super().__init__()
        self.eta = eta

    def render(self, task):
        return Text(f"ETA {duration(self.eta.seconds())}", style="progress.remaining")


class RichReporter:
    """Live progress on a terminal: a bar over cells (M/N, elapsed, ETA) and the current stage."""

    def __init__(self) -> None:
        self.eta = Eta()
        self.lock = threading.Lock()
        self.lane_tasks: dict[str, Any] = {}  # several lanes: one line each under the run's
        self.lane_of: dict[str, str] = {}  # cell id -> its lane
        self.progress = Progress(
            TextColumn("{task.description}", style="bold", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("cells", markup=False),
            TimeElapsedColumn(),
            _EtaColumn(self.eta),
            TextColumn("{task.fields[stage]}", markup=False),
            console=err,
            transient=False,
        )
        self.task = None

    def run_started(self, run_id, cells, estimate_s, lanes=None):
        self.lane_of = dict(lanes or {})
        lanes = lanes_of(cells, self.lane_of)
        with self.lock:
            self.eta.begin(len(cells), estimate_s, lanes)
            err.print(
                line(
                    "run ",
                    styled(run_id, "bold"),
                    f": {len(cells)} cells, estimated {duration(estimate_s)}"
                    + (f", {len(lanes)} lanes at once" if len(lanes) > 1 else ""),
                )
            )
            self.progress.start()
            self.task = self.progress.add_task(run_id, total=len(cells), stage="")
            if len(lanes) > 1:
                self.lane_tasks = {
                    name: self.progress.add_task(f"  {name}", total=n, stage="") for name, n in lanes.items()
                }

    def _show(self, cell, text):
        task = self.lane_tasks.get(lane(self.lane_of, cell), self.task)
        self.progress.update(task, stage=text)

    def cell_started(self, cell, position, total):
        with self.lock:
            self._show(cell, f"{cell.id} {cell.label}")

    def stage(self, cell, stage, detail=""):
        with self.lock:
            self._show(cell, f"{cell.id} {stage} {detail}".rstrip())

    def cell_finished(self, cell, status, error):
        with self.lock:
            name = lane(self.lane_of, cell)
            self.eta.cell_ended(name)
            self.progress.advance(self.task)
            if name in self.lane_tasks:
                self.progress.advance(self.lane_tasks[name])
            where = f"{name}: " if self.lane_tasks else ""
            self.progress.console.print(
                line(
                    f"  {where}{cell.id} {cell.label}: ",
                    styled(status, STATUS_STYLES.get(status, "red")),
                    f" ({error})" if error else "",
                )
            )

    def warn(self, message):
        with self.lock:
            self.progress.console.print(line("  ", styled("warning:", "yellow"), f" {message}"))

    def close(self):
        self.progress.stop()


class PlainReporter:
    """Progress as plain lines (CI logs, pipes): cell, stage, elapsed, ETA."""

    def __init__(self):
        self.eta = Eta()
        self.lock = threading.Lock()
        self.several = False  # several lanes: each line of a cell starts with its lane
        self.lane_of: dict[str, str] = {}

    def _line(self, text, cell=None):
        where = f"{lane(self.lane_of, cell)}: " if self.several and cell is not None else ""
        with self.lock:
            err.print(f"[{duration(self.eta.elapsed())} elapsed, ETA {duration(self.eta.seconds())}] {where}{text}")

    def run_started(self, run_id, cells, estimate_s, lanes=None):
        self.lane_of = dict(lanes or {})
        lanes = lanes_of(cells, self.lane_of)
        with self.lock:
            self.eta.begin(len(cells), estimate_s, lanes)
            self.several = len(lanes) > 1
        self._line(
            f"run {run_id}: {len(cells)} cells, estimated {duration(estimate_s)}"
            + (f", {len(lanes)} lanes at once" if self.several else "")
        )

    def cell_started(self, cell, position, total):
        self._line(f"cell {position}/{total} {cell.id} {cell.label}", cell)

    def stage(self, cell, stage, detail=""):
        self._line(f"  {cell.id} {stage} {detail}".rstrip(), cell)

    def cell_finished(self, cell, status, error):
        with self.lock:
            self.eta.cell_ended(lane(self.lane_of, cell))
        self._line(f"  {cell.id} {status}" + (f": {error}" if error else ""), cell)

    def warn(self, message):
        self._line(f"  warning: {message}")

    def close(self):
        pass


class QuietReporter:
    """`lab run --quiet` (cron): nothing while all goes well; a warning and a failed cell are one
    line each on stderr."""

    def __init__(self):
        self.lock = threading.Lock()
        self.run_id = ""

    def run_started(self, run_id, cells, estimate_s, lanes=None):
        self.run_id = run_id

    def cell_started(self, cell, position, total):
        pass

    def stage(self, cell, stage, detail=""):
        pass

    def cell_finished(self, cell, status, error):
        if status == "failed":
            with self.lock:
                err.print(f"lab: run {self.run_id}: {cell.id} {cell.label} failed" + (f": {error}" if error else ""))

    def warn(self, message):
        with self.lock:
            err.print(f"lab: warning: run {self.run_id}: {message}")

    def close(self):
        pass
