"""The idle workload (lab.workloads.idle): guest CPU busy % over a window with nothing running,
from real /proc/stat text, and the host's figures of the same window folded in by the runner."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import fakes.workload as fake_workload
import pytest

from lab import proc, runner
from lab.errors import UsageError
from lab.model import RawOutput
from lab.store import Store
from lab.workloads import WorkloadContext, idle, load_all

DATA = Path(__file__).parents[1] / "data" / "cpu"


def raw_of(before: str, after: str, **extra: str) -> RawOutput:
    return RawOutput(
        "idle",
        "sleep 1",
        "",
        params={"duration": 1, "vcpus": 2},
        extra={"cpu_before": before, "cpu_after": after, **extra},
    )


def test_guest_busy_from_captured_proc_stat():
    before = (DATA / "linux-sleep1-before.txt").read_text()
    after = (DATA / "linux-sleep1-after.txt").read_text()
    got = {s.metric: s for s in idle.IDLE.parse(raw_of(before, after))}
    # cpu  30953 0 7918 165949 1219 0 566 44 -> cpu  31051 0 7928 166038 1221 0 567 44: busy 109 of 200 ticks
    assert got["cpu_busy_pct"].value == pytest.approx(100 * 109 / 200)
    assert got["cpu_busy_pct"].higher_is_better is False and got["cpu_busy_pct"].labels == {"duration": 1}
    assert got["cpu_steal_pct"].value == 0
    assert "host_vm_cpu_pct" not in got  # the host was not watched


def test_host_figures_come_from_the_folded_host_load():
    before = (DATA / "linux-proc-stat-before.txt").read_text()
    after = (DATA / "linux-proc-stat-after.txt").read_text()
    label = {"seconds": 10.0, "foreign_pct": 3.5, "lab_pct": 1.2}
    got = {s.metric: s.value for s in idle.IDLE.parse(raw_of(before, after, host_load=json.dumps(label)))}
    assert got["host_vm_cpu_pct"] == 1.2 and got["host_foreign_cpu_pct"] == 3.5
    unknown = idle.host_samples({"host_load": json.dumps({"seconds": 10.0, "unknown": "no window"})})
    assert unknown == []


@pytest.mark.parametrize("duration", [0, -1, "10", True, 3601])
def test_duration_must_be_a_sane_number_of_seconds(duration):
    ctx = WorkloadContext(guest=None, client=None, os="debian", vcpus=1, params={"duration": duration})
    with pytest.raises(UsageError, match="duration"):
        idle.IDLE.params(ctx)


class LocalShell:
    """A guest that is this machine: the idle run's one command runs here, on its /proc/stat."""

    address = "127.0.0.1"

    def run(self, command, *, timeout=120.0, check=True, input=None):
        return proc.run(["sh", "-c", command], timeout=timeout, check=check)


def test_an_idle_run_on_this_machines_proc_stat():
    assert "idle" in load_all()
    ctx = WorkloadContext(guest=LocalShell(), client=None, os="debian", vcpus=1, params={"duration": 0.3})
    raw = idle.IDLE.run(ctx, 0)
    assert raw.command == "sleep 0.3" and raw.seconds >= 0.3
    busy = {s.metric: s.value for s in idle.IDLE.parse(raw)}["cpu_busy_pct"]
    assert 0.0 <= busy <= 100.0


class HostLoadProbe(fake_workload.FakeWorkload):
    """fake-work whose samples include the host's figures, as idle's do."""

    name = "fake-idle"
    traits = dataclasses.replace(fake_workload.FakeWorkload.traits, records_host_load=True)

    def parse(self, raw):
        return super().parse(raw) + idle.host_samples(raw.extra)


def test_the_runner_folds_the_hosts_window_into_the_raw_output(fake_lab):
    from lab import workloads

    workloads.register(HostLoadProbe())
    try:
        fake_lab.write(suite='workloads = ["fake-idle"]\nquiet_host = "record"', host='foreign_load = { "*" = 4.0 }')
        cfg = fake_lab.load()
        store = Store(cfg.results_dir)
        rid = runner.run_lab(cfg, store)
        samples = {(s.repetition, s.metric): s.value for s in store.samples(rid)}
        raws = [raw for _, _, rep, raw in store.raw_outputs(rid) if rep >= 0]
        assert samples[(0, "host_vm_cpu_pct")] == 60.0 and samples[(1, "host_foreign_cpu_pct")] == 4.0
        assert all(json.loads(r.extra["host_load"])["lab_pct"] == 60.0 for r in raws)
        assert runner.reparse(store, rid) == len(store.samples(rid))  # rebuilt from the raw outputs alone
        assert {(s.repetition, s.metric): s.value for s in store.samples(rid)} == samples
    finally:
        workloads.unregister("fake-idle")
