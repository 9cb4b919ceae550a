"""lab.hostload: the arithmetic of a window over counters and over polled rates, what is stamped on a
sample, waiting for a quiet host (on a fake clock), which samples count (lab.flags), and the
Proxmox backend's window against the PVE emulator."""

from __future__ import annotations

import threading
import time

import pytest
from pve_emulator.fixtures import (  # noqa: F401  (fixtures)
    TEST_IMAGE,
    fast_backend,
    pve_certs_fixture,
    pve_env_fixture,
    pve_fixture,
)

from lab import flags, hostload
from lab.errors import LabError
from lab.hostload import CounterWindow, CpuRates, CpuTimes, HostLoad, PollingWindow
from lab.model import NicModel, VmSpec


def times(at, busy, lab, steal=None, cpus=2):
    return CpuTimes(at=at, busy_s=busy, lab_s=lab, steal_s=steal, cpus=cpus)


def test_between_counts_what_is_not_the_lab_in_percent_of_one_core():
    load = hostload.between(times(100.0, 50.0, 20.0, 1.0), times(110.0, 62.0, 27.0, 2.5))
    assert load.seconds == 10.0 and load.cpus == 2
    assert load.foreign_pct == pytest.approx(50.0)  # (12 - 7) s over 10 s: half a core
    assert load.lab_pct == pytest.approx(70.0) and load.steal_pct == pytest.approx(15.0)
    assert load.too_busy(10) == "foreign load 50 % of one core and CPU steal 15 % of one core on the host (> 10 %)"
    assert load.too_busy(60) == ""


def test_between_never_goes_below_zero_and_says_when_it_cannot_tell():
    # the lab's processes are read a little apart from /proc/stat: more lab time than busy time
    load = hostload.between(times(0.0, 10.0, 5.0), times(2.0, 11.0, 7.0))
    assert load.foreign_pct == 0.0 and load.steal_pct is None and load.known
    assert not hostload.between(times(5.0, 1, 1), times(5.0, 2, 1)).known


def test_a_counter_window_adapts_the_backends_dicts_and_survives_a_failed_reading():
    readings = iter(
        [
            {"at": 1.0, "busy_s": 10, "lab_s": 4, "steal_s": None, "cpus": 4},
            {"at": 3.0, "busy_s": 13, "lab_s": 6, "steal_s": None, "cpus": 4},
        ]
    )
    load = CounterWindow(lambda: next(readings)).stop()
    assert load.foreign_pct == pytest.approx(50.0) and load.cpus == 4

    def broken():
        raise LabError("cannot read /proc/stat on 'bsd1'")

    lost = CounterWindow(broken).stop()
    assert not lost.known and "cannot read /proc/stat on 'bsd1'" in lost.unknown


def test_a_polling_window_averages_the_polls_made_during_it():
    answers = [CpuRates(0, 3.9, 0.0, None, 4)]  # at start: describes the time before, not counted

    def poll():
        return answers.pop(0) if answers else CpuRates(1, 2.0, 0.5, 0.25, 4)

    window = PollingWindow(poll, interval=0.01)
    time.sleep(0.1)
    load = window.stop()
    assert len(window.polls) >= 3  # the thread's polls and the one at stop
    assert load.foreign_pct == pytest.approx(150.0) and load.lab_pct == pytest.approx(50.0)
    assert load.steal_pct == pytest.approx(25.0) and load.cpus == 4
    assert not [t for t in threading.enumerate() if t.name == "lab-host-load"]


def test_a_polling_window_that_never_got_an_answer_cannot_tell():
    def down():
        raise LabError("pve1: HTTP 595 no route to host")

    load = PollingWindow(down, interval=0.01).stop()
    assert not load.known and "595" in load.unknown


def test_the_label_of_a_sample_carries_the_figures_and_the_flag():
    quiet = hostload.label(HostLoad(20.0, 3.04, None, 95.0, 2), 10.0)
    assert quiet == {"seconds": 20.0, "foreign_pct": 3.0, "lab_pct": 95.0}
    assert not flags.is_flagged({hostload.HOST_LOAD: quiet})
    busy = hostload.label(HostLoad(20.0, 48.0, 0.0, 95.0, 2), 10.0, waited_s=4.2)
    assert busy["flag"] == "foreign load 48 % of one core on the host (> 10 %)" and busy["waited_s"] == 4.2
    assert flags.reasons({hostload.HOST_LOAD: busy, "flagged": 1, "flagged_why": "wrk: 3 errors"}) == [
        "wrk: 3 errors",
        "foreign load 48 % of one core on the host (> 10 %)",
    ]
    assert flags.foreign_pct({hostload.HOST_LOAD: busy}) == 48.0 and flags.steal_pct({hostload.HOST_LOAD: busy}) == 0.0
    unknown = hostload.label(HostLoad(5.0, unknown="no counters"), 10.0, not_quiet="host not quiet")
    assert unknown["unknown"] == "no counters" and unknown["flag"] == "host not quiet"


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def probes(clock: FakeClock, loads: list[float | None]):
    """open_window for wait_quiet: each window lasts what the waiter sleeps and reads the next load."""
    it = iter(loads)

    class Window:
        def __init__(self):
            self.start = clock()

        def stop(self):
            pct = next(it)
            if pct is None:
                return HostLoad(unknown="cannot tell")
            return HostLoad(seconds=clock() - self.start, foreign_pct=pct, lab_pct=0.0, cpus=2)

    return Window


def test_a_quiet_host_costs_the_quiet_time_only():
    clock = FakeClock()
    q = hostload.wait_quiet(
        probes(clock, [1.0, 2.0, 0.0]), threshold_pct=10, quiet_s=3, timeout_s=30, clock=clock, sleep=clock.sleep
    )
    assert q.quiet and q.waited_s == 0.0 and clock.now == 3.0


def test_a_busy_host_is_waited_for_and_the_wait_is_shown():
    clock, seen = FakeClock(), []
    q = hostload.wait_quiet(
        probes(clock, [80.0, 60.0, 5.0, 90.0, 0.0, 0.0]),
        threshold_pct=10,
        quiet_s=2,
        timeout_s=30,
        on_wait=seen.append,
        clock=clock,
        sleep=clock.sleep,
    )
    assert q.quiet and q.waited_s == 4.0  # busy, busy, quiet, busy, then two quiet seconds
    assert len(seen) == 3 and seen[0].startswith("foreign load 80 % of one core on the host (> 10 %); waited 1 s")


def test_a_host_that_stays_busy_is_given_up_on_with_the_reason():
    clock = FakeClock()
    q = hostload.wait_quiet(
        probes(clock, [50.0] * 100), threshold_pct=10, quiet_s=2, timeout_s=5, clock=clock, sleep=clock.sleep
    )
    assert not q.quiet and q.waited_s == 5.0 and "foreign load 50 %" in q.why


def test_a_host_that_cannot_tell_is_not_waited_for():
    clock = FakeClock()
    q = hostload.wait_quiet(
        probes(clock, [None]), threshold_pct=10, quiet_s=2, timeout_s=5, clock=clock, sleep=clock.sleep
    )
    assert q.quiet and q.why == "cannot tell" and clock.now == 1.0


# -- Proxmox: the node's CPU from the API minus the lab's VMs ------------------------------------


def test_proxmox_rates_are_cores_of_the_node_minus_the_labs_vms():
    from lab.backends.proxmox import host

    class Resource:
        def __init__(self, answer):
            self.answer = answer

        def get(self, **_):
            return self.answer

    class Session:
        settings = type("S", (), {"timeouts": type("T", (), {"retry": 1.0})()})()

        def get(self, what, resource, *, until=None):
            return resource.get()

        def node(self, name):
            return type("N", (), {"status": Resource({"cpu": 0.5, "cpuinfo": {"cpus": 8}})})()

        def qemu(self, node, vmid):
            answer = {101: {"cpu": 0.75, "cpus": 2}, 102: {"cpu": 0.1, "cpus": 1}}[vmid]
            return type("Q", (), {"status": type("S", (), {"current": Resource(answer)})()})()

    rates = host.cpu_rates(Session(), "pve1", [101, 102])  # type: ignore[arg-type]
    assert rates.cpus == 8 and rates.busy_cores == 4.0 and rates.lab_cores == pytest.approx(1.6)
    assert rates.steal_cores is None  # inside the node's figure on PVE


def test_proxmox_host_load_polls_the_emulator(pve, pve_env):
    b = fast_backend(pve, pve_env)
    b.open_run("r1")
    vm = b.clone(
        TEST_IMAGE,
        VmSpec(
            name="lab-r1-c01",
            run_id="r1",
            cell_id="c01",
            image=TEST_IMAGE,
            nic=NicModel.VIRTIO,
            vcpus=2,
            memory_mib=1024,
            ip="10.0.0.5",
            mac="BC:24:11:12:34:56",
            expires_at=1_900_000_000.0,
        ),
    )
    try:
        b.start(vm)
        load = b.load_meter.window([vm]).stop()
        # the emulator's node answers cpu 0.02 of its 4 threads; its VMs report no cpu of their own
        assert load.known and load.foreign_pct == pytest.approx(8.0) and load.lab_pct == 0.0 and load.cpus == 4
        assert load.steal_pct is None
        paths = [path for _, path, _ in pve.requests]
        assert f"/nodes/pve1/qemu/{vm.handle['vmid']}/status/current" in paths[-3:]
    finally:
        b.destroy(vm)
        b.close_run("r1")
