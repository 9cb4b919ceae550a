"""The chaos suite's short configuration (tests/support/chaos.py) in make test: real VMs, the PVE
emulator and libvirt failing on purpose; nothing may leak or be lost."""

from __future__ import annotations

import pytest
from support import chaos


@pytest.mark.vm
@pytest.mark.image
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("part", [pytest.param("libvirt", marks=pytest.mark.serial), "pve", "others"])
def test_chaos_short(golden, capsys, part):
    faults = [f for f in chaos.CONFIGS["short"].faults if chaos.part_of(f) == part]
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
