"""The fault-injection suite's short configuration (tests/support/chaos.py; `make chaos` runs the long one):
every fault injected, every run ends with a clear one-line error, nothing leaked after `lab gc`,
no sample lost, every store intact."""

from __future__ import annotations

from support import chaos


def test_the_parts_cover_the_short_suite_once():
    faults = chaos.CONFIGS["short"].faults
    parts = [[f for f in faults if chaos.part_of(f) == p] for p in ("libvirt", "pve", "others")]
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
