"""A busy host is seen on a real run (issue 24): a CPU hog that is not the lab's, started on this
machine while one repetition of a real VM's workload runs, flags exactly that repetition with the
foreign load it caused; the others read well under it (the lab's own QEMU, ssh and load
generator are not foreign). Run under the VM-test lock: another VM on the 2 cores would be foreign load too."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.local import write_lab

from lab import config, flags, runner
from lab.backends.local import hostload as local_load
from lab.hostload import TICK, CpuTimes, between, read_processes
from lab.lifecycle import SilentReporter
from lab.store import Store

pytestmark = [pytest.mark.vm, pytest.mark.image, pytest.mark.serial]

SUITE = """
workloads = ["sysbench-cpu"]
repetitions = 4
warmup = 1
quiet_host = "record"
remeasure_flagged = 1
[suite.params.sysbench-cpu]
time = 3
threads = [1]
"""


def start_hog(pidfile: Path) -> int:
    """A CPU hog outside the lab's process tree (`setsid -f` leaves it to init), as an unrelated
    compile would be; its pid from its own pidfile."""
    subprocess.run(["setsid", "-f", "sh", "-c", f"echo $$ > {pidfile}; exec sha256sum /dev/zero"], check=True)
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline, "the hog did not start"
        time.sleep(0.05)
    return int(pidfile.read_text())


class HogDuringRepetition(SilentReporter):
    """Starts the hog when the third measured repetition is entered and stops it at the fourth."""

    def __init__(self, pidfile: Path):
        self.pidfile, self.pid = pidfile, None
        self.details: list[str] = []

    def stage(self, cell, stage, detail=""):
        self.details.append(detail)
        if detail.startswith("sysbench-cpu 3/4") and self.pid is None:
            self.pid = start_hog(self.pidfile)
            time.sleep(0.5)  # running before the repetition's window opens
        elif detail.startswith("sysbench-cpu 4/4"):
            self.stop()

    def stop(self):
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.pid = 0


def busiest_foreign(seconds: float = 3.0) -> tuple[float, list[str]]:
    """This machine's foreign load (% of one core) over `seconds` with no VM up, read the way the
    lab reads it, and the busiest processes outside this test's tree (to name them when it is high)."""
    before_procs = read_processes()
    first = CpuTimes.of(local_load.cpu_times([]))
    time.sleep(seconds)
    last = CpuTimes.of(local_load.cpu_times([]))
    after_procs = read_processes()
    ours = local_load.lab_processes([], after_procs)
    used = sorted(
        (
            (ticks - before_procs[pid][1], pid)
            for pid, (_, ticks) in after_procs.items()
            if pid in before_procs and pid not in ours
        ),
        reverse=True,
    )
    names = []
    for ticks, pid in used[:5]:
        if ticks > 0:
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                comm = "?"
            names.append(f"{comm}[{pid}] {100.0 * ticks / TICK / seconds:.0f} %")
    return between(first, last).foreign_pct or 0.0, names


def test_a_cpu_hog_on_the_host_flags_the_repetition_it_ran_in(golden, workdir, tmp_path):
    # warm: a restore of the VM pass's snapshot of this shape, not a boot in the serial pass
    cfg = config.load(write_lab(tmp_path, workdir, matrix='start = ["warm"]\n', suite=SUITE))
    store = Store(cfg.results_dir)
    # The machine's own background (a CI runner's agents, say) is foreign load too, and real: the
    # quiet repetitions are judged against it, not against an idle machine this test cannot promise.
    baseline, busiest = busiest_foreign()
    hog = HogDuringRepetition(tmp_path / "hog.pid")
    try:
        rid = runner.run_lab(cfg, store, hog)
    finally:
        hog.stop()
    assert hog.pid == 0  # it ran, and was stopped
    loads = {}
    for s in store.samples(rid):
        loads.setdefault(s.repetition, s.labels["host_load"])
    # the hog's repetition is measured again (remeasure_flagged = 1): a fifth, after the hog
    assert sorted(loads) == [0, 1, 2, 3, 4]
    stopped = store.run(rid).manifest["repetitions"]["c01"]["sysbench-cpu"]["stopped"]
    assert stopped.startswith("fixed n = 4: ") and "measured again" in stopped, stopped
    assert any(d.startswith("sysbench-cpu 5/4 (again: ") for d in hog.details), hog.details  # the progress says so
    context = (
        f"{loads}; before the run, with no VM up: foreign {baseline:.0f} % ({', '.join(busiest) or 'nothing busy'})"
    )
    hogged = loads[2]
    # sha256sum takes a core's worth when it can; on 2 cores shared with TCG it gets at least half of one
    assert hogged["foreign_pct"] >= 40, context
    assert hogged["flag"].startswith("foreign load ") and "of one core on the host (> 10 %)" in hogged["flag"]
    assert all(flags.is_flagged(s.labels) for s in store.samples(rid) if s.repetition == 2)
    # the lab's own work (QEMU running the guest's sysbench at a core's worth, ssh) is the lab's,
    # not foreign: a repetition without the hog reads well under that core, and the hog's repetition
    # stands out from all of them. (Not "no more than the baseline": after the suite's parallel pass
    # the quiet repetitions have read 16-21 % of a core that no process accounts for, on a machine
    # whose baseline just before was 0 %; see the closing note of 2026-11-25.)
    assert all(load["lab_pct"] >= 50 for load in loads.values()), context
    others = [loads[rep] for rep in (0, 1, 3, 4)]
    assert all(load["foreign_pct"] <= max(baseline, 0.0) + 40 for load in others), context
    assert all(load["foreign_pct"] + 30 < hogged["foreign_pct"] for load in others), context
    # each is flagged exactly when its own foreign load passed the threshold (labels are rounded)
    assert all("flag" in load for load in loads.values() if load["foreign_pct"] > 10.1), context
    assert not any(
        "flag" in load for load in loads.values() if load["foreign_pct"] < 9.9 and (load.get("steal_pct") or 0) < 9.9
    ), context
