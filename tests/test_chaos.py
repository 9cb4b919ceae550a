"""The fault-injection suite's short configuration (tests/chaos.py; `make chaos` runs the long one):
every fault injected, every run ends with a clear one-line error, nothing leaked after `lab gc`,
no sample lost, every store intact."""

from __future__ import annotations

import chaos
import pytest

# The short suite in three parts, so that the two workers share two of them. The rows on the
# system's libvirt (its fault, and the planted domains) run in the serial pass, alone: they start and
# stop libvirtd themselves, as the standalone suite does, and `lab gc --force` (foreign-resources)
# removes every lab domain of qemu:///system, another worker's live test's too.
PARTS = {
    "libvirt": ["libvirt-refuses-start", "foreign-resources"],
    "pve": [f for f in chaos.CONFIGS["short"].faults if f.startswith("pve-")],
}


def part_of(fault: str) -> str:
    return next((name for name, faults in PARTS.items() if fault in faults), "others")


@pytest.mark.vm
@pytest.mark.image
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("part", [pytest.param("libvirt", marks=pytest.mark.serial), "pve", "others"])
def test_chaos_short(golden, capsys, part):
    faults = [f for f in chaos.CONFIGS["short"].faults if part_of(f) == part]
    rows, totals = chaos.run_suite("short", only=faults)
    text = chaos.table(rows, totals)
    with capsys.disabled():
        print("\n" + text)
    assert [r.fault for r in rows] == faults and len(faults) >= 2
    assert totals.faults == len(rows), text
    assert totals.clear == len(rows), text
    assert totals.leaked == 0, text
    assert totals.lost == 0, text
    assert totals.corrupt == 0, text
    assert all(r.ok for r in rows), text
    if part == "others":  # the kill mid-workload had stored samples to lose, and kept them
        killed = next(r for r in rows if r.fault == "kill-orchestrator-workload")
        assert "no sample stored before the kill" not in killed.notes, text


def test_the_parts_cover_the_short_suite_once():
    faults = chaos.CONFIGS["short"].faults
    parts = [[f for f in faults if part_of(f) == p] for p in ("libvirt", "pve", "others")]
    assert sorted(sum(parts, [])) == sorted(faults) and all(parts)


def test_verdicts_on_bad_outcomes(tmp_path):
    """The counting itself can fail: a traceback, a wrong exit status, a multi-line error."""
    assert chaos.one_line_exit(1, "progress\nlab: error: results store x: database or disk is full", tmp_path) == (
        True,
        "results store x: database or disk is full",
    )
    assert not chaos.one_line_exit(
        1, "Traceback (most recent call last):\n  ...\nsqlite3.OperationalError: full", tmp_path
    )[0]
    assert not chaos.one_line_exit(2, "lab: error: x", tmp_path)[0]
    assert not chaos.one_line_exit(1, "", tmp_path)[0]
    assert not chaos.one_line_exit(1, "1 of 1 cells failed; see `lab show abc`", tmp_path)[0]  # no store: no error
    row = chaos.Row("x", injected=True, clear=True, leaked=["qemu pid 1 lab-x-c01"])
    assert not row.ok
    totals = chaos.Totals(faults=1, clear=1, leaked=0, lost=1, corrupt=0)
    assert not totals.ok
