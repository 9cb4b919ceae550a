"""A plugin (tests/conftest.py loads it): the marks a test gets from where it is rather than from
its module (root for the tests listed below, one rerun for a real-VM test), and why each rerun
test failed its first try."""

from __future__ import annotations

import pytest

# Tests that need root whose modules do not say so yet (their owners will mark them `root`): the
# fast lane runs without root and leaves them out. node id prefix -> why.
NEEDS_ROOT = {
    "tests/contract/test_baremetal.py::": "the bare-metal cell makes network namespaces and cgroups",
    "tests/vm/test_images_os_vm.py::test_render_writes_answers_and_stage": (
        "mmdebstrap --mode=root (the container base)"
    ),
    "tests/contract/test_proxmox_cluster.py::test_guest_without_agent_and_without_static_address_is_found_by_arp": (
        "a network namespace stands in for the node's neighbours"
    ),
}

# A real-VM test boots TCG guests on 2 shared cores beside another worker's VMs; CI lost whole
# submissions to one such test hanging once in ~20 runs where it passed alone and in 10 loaded loops
# here (test_firmware_boot, test_host_load_vm). One rerun, shown as R in the summary (make test runs
# -rsR), keeps a rare environmental stall from failing a run; a test that fails twice still fails.
VM_RERUNS = 1


def pytest_itemcollected(item):
    if any(item.nodeid.startswith(prefix) for prefix in NEEDS_ROOT) and not item.get_closest_marker("root"):
        item.add_marker(pytest.mark.root)
    if item.get_closest_marker("vm") and not item.get_closest_marker("flaky"):
        item.add_marker(pytest.mark.flaky(reruns=VM_RERUNS, reruns_delay=5))


# Why each rerun test failed its first try: pytest-rerunfailures reports only the name, and a CI
# log is all we get of a flake. Kept by the process that prints the summary (xdist's controller,
# which receives its workers' reports).
RERUN_REASONS: list[str] = []


def pytest_runtest_logreport(report):
    if report.outcome == "rerun":
        lines = (report.longreprtext or "").strip().splitlines()
        RERUN_REASONS.append(f"{report.nodeid} ({report.when}, {report.duration:.0f} s):")
        RERUN_REASONS.extend("    " + line for line in lines[-16:])


def pytest_terminal_summary(terminalreporter):
    if RERUN_REASONS:
        terminalreporter.section("why the rerun tests failed first")
        for line in RERUN_REASONS:
            terminalreporter.write_line(line)
