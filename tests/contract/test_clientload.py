"""The client under network samples (lab.clientload): its window, its label, and a saturated client
flagging the samples of a host that is not this machine, not those of one that is."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import fakes.workload as fake_workload
import pytest
from test_lanes import run_with

from lab import clientload, flags
from lab.hostload import CpuTimes, HostLoad, between

DATA = Path(__file__).parents[1] / "data" / "cpu"


def test_this_machine_reads_proc_stat_and_counts_everything_busy(tmp_path):
    shutil.copy(DATA / "linux-proc-stat-before.txt", tmp_path / "stat")
    reading = clientload.this_machine(tmp_path)
    # user 8513 + system 4215 + softirq 386 ticks; the lab's own time is not taken out of a client's
    assert reading["busy_s"] == pytest.approx(13114 / os.sysconf("SC_CLK_TCK"))
    assert reading["lab_s"] == 0.0 and reading["cpus"] == 1


def test_a_saturated_client_is_flagged_only_when_judged(tmp_path):
    ticks = os.sysconf("SC_CLK_TCK")
    readings = []
    for name, at in (("linux-proc-stat-before.txt", 0.0), ("linux-proc-stat-after.txt", 2.0)):
        shutil.copy(DATA / name, tmp_path / "stat")
        readings.append(CpuTimes.of({**clientload.this_machine(tmp_path), "at": at}))
    load = between(*readings)  # 198 ticks busy over 2 s on one CPU
    assert load.foreign_pct == pytest.approx(100.0 * 198 / ticks / 2)
    judged = clientload.label("local", load, 90.0, judged=True)
    busy = judged["busy_pct"]
    assert judged["placement"] == "local" and judged["cpus"] == 1
    assert ("flag" in judged) == (busy >= 90.0)
    shared = clientload.label("local", load, 90.0, judged=False)
    assert shared["shares_host"] is True and "flag" not in shared


def test_saturation_is_a_share_of_every_cpu():
    assert clientload.saturated(170.0, 2, 90.0) == ""
    why = clientload.saturated(185.0, 2, 90.0)
    assert why.startswith("client saturated: 185 % of one core") and "2 CPUs" in why
    assert clientload.saturated(95.0, 1, 90.0)
    unknown = clientload.label("local", HostLoad(seconds=1.0, unknown="no /proc"), 90.0, judged=True)
    assert unknown == {"placement": "local", "seconds": 1.0, "unknown": "no /proc"}
    assert not flags.is_flagged({clientload.CLIENT_LOAD: unknown})
    assert flags.reasons({clientload.CLIENT_LOAD: {"flag": why}}) == [why]


class NetworkWork(fake_workload.FakeWorkload):
    name = "fake-net"
    traits = dataclasses.replace(fake_workload.FakeWorkload.traits, network=True)


@pytest.mark.parametrize("local_host", [False, True])
def test_network_samples_carry_their_clients_load(fake_lab, monkeypatch, local_host):
    """A client busy on both of its CPUs the whole time: the samples of a remote host are flagged
    and kept out of the medians; on a host that is this machine they only carry the figures."""

    def busy_client(proc_stat: str) -> dict:
        at = time.monotonic()
        return {"at": at, "busy_s": 2.0 * at, "lab_s": 0.0, "steal_s": None, "cpus": 2}

    monkeypatch.setattr(clientload, "reading", busy_client)
    store, rid = run_with(
        fake_lab,
        [NetworkWork()],
        {"a": f"local_host = {'true' if local_host else 'false'}"},
        vcpus=1,
        repetitions=2,
        suite='workloads = ["fake-net", "fake-work"]\n[suite.params.fake-net]\nvalues = [5.0]\nsleep_s = 0.05',
    )
    samples = store.samples(rid)
    net = [s for s in samples if s.workload == "fake-net"]
    other = [s for s in samples if s.workload == "fake-work"]
    assert {s.repetition for s in net} == {0, 1} and other
    assert all(clientload.CLIENT_LOAD not in s.labels for s in other)  # not a network workload
    for s in net:
        window = s.labels[clientload.CLIENT_LOAD]
        assert window["placement"] == "local" and window["cpus"] == 2
        assert window["busy_pct"] == pytest.approx(200.0, abs=1.0)
        if local_host:
            assert window["shares_host"] is True and not flags.is_flagged(s.labels)
        else:
            assert "client saturated" in window["flag"] and flags.is_flagged(s.labels)
