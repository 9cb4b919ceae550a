"""`lab explain` on real VMs (issue 33): the golden Debian image under QEMU, the local backend.

A parent run measures only the two corner cells of two knobs whose effects are known by construction,
on iperf3-tcp with the guest receiving:

- nic: virtio → e1000: under TCG the emulated e1000 costs most of the throughput (about 2.7x less
  than VirtIO on this machine): it matters, with the largest share of the gap;
- cc: cubic → reno: the guest's congestion control governs only what the guest sends, and a
  receiving guest sends only ACKs: it does not matter (or is unknown at n = 3), never "matters".

Then `lab explain --plan` (the 2^2 factorial: 4 cells, the parent's 2 reused, 2 to measure, an
estimate), the follow-up run with `--json` (a child of the parent: `lab show` says so both ways),
the same question again as text (nothing left to measure: the answer only, as the README shows it)
and the report's "Explain" section.

The lab is examples/explain.toml's [matrix] and [suite], so the README's output is that file's.
Short on purpose (make test is near its ceiling): one workload, one direction, 1 s windows, n = 3,
no warm-up repetition, warm start (a restored snapshot per NIC model instead of a boot per cell), no
extra rounds. Serial: a measurement another VM on the two cores would skew. The seconds it takes are
printed (-s shows them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.cli import run_lab_cli
from support.local import leftovers, write_lab

from lab.store import Store

pytestmark = [pytest.mark.vm, pytest.mark.image, pytest.mark.serial]

EXAMPLE = Path(__file__).parents[2] / "examples" / "explain.toml"
# the walk-through's own question (its last two sections), on this test's host and store
MATRIX, SUITE = EXAMPLE.read_text().split("\n[matrix]\n", 1)[1].split("\n[suite]\n", 1)
SELECT = ("--a", "nic=virtio", "--b", "nic=e1000")


@pytest.mark.timeout(1200)
def test_explain_names_the_nic_and_not_the_congestion_control(golden, tmp_path, workdir):
    lab = write_lab(tmp_path, workdir, matrix=MATRIX, suite=SUITE)
    began = time.monotonic()
    parent = run_lab_cli("run", "-c", str(lab), cwd=tmp_path, timeout=600)
    assert parent.returncode == 0, parent.stdout[-3000:] + parent.stderr[-3000:]
    parent_s = time.monotonic() - began
    store = Store(tmp_path / "results")
    (run,) = store.runs()
    assert [(c.axes["nic"], c.axes["cc"], c.status) for c in store.cells(run.id)] == [
        ("virtio", "cubic", "done"),
        ("e1000", "reno", "done"),
    ]

    # --plan: the 2^2 factorial, the parent's two corners reused, two cells to measure, an estimate
    plan = run_lab_cli("explain", run.id, *SELECT, "--plan", "--json", "-c", str(lab), cwd=tmp_path, timeout=120)
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-3000:]
    p = json.loads(plan.stdout)
    assert [k["name"] for k in p["knobs"]] == ["nic", "cc"] and p["untestable"] == []
    assert (p["new_cells"], p["reused_cells"], p["full_factorial"]) == (2, 2, 4)
    assert p["estimate_s"] > 0
    measured_now = sorted((c["axes"]["nic"], c["axes"]["cc"]) for c in p["cells"] if not c["reused"])
    assert measured_now == [("e1000", "cubic"), ("virtio", "reno")]
    assert {r["run"] for c in p["cells"] for r in c["reused"]} == {run.id}
    text_plan = run_lab_cli("explain", run.id, *SELECT, "--plan", "-c", str(lab), cwd=tmp_path, timeout=120)
    assert text_plan.returncode == 0 and "2 follow-up cells to measure, 2 already measured" in text_plan.stdout
    assert [r.id for r in store.runs()] == [run.id]  # --plan created nothing

    began = time.monotonic()
    res = run_lab_cli(
        "explain", run.id, *SELECT, "--rounds", "0", "--json", "-c", str(lab), cwd=tmp_path, timeout=600
    )  # fmt: skip
    explain_s = time.monotonic() - began
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(res.stdout)
    (m,) = doc["metrics"]
    assert m["metric"] == "throughput_mbit_s_rx" and m["median_b"] < m["median_a"]
    knobs = {k["name"]: k for k in m["knobs"]}
    assert set(knobs) == {"nic", "cc"}
    nic, cc = knobs["nic"], knobs["cc"]
    assert nic["verdict"] == "matters" and m["top"] == "nic", knobs
    assert nic["ci"][1] < 1 and nic["effect_ratio"] < 0.7, nic  # e1000 slower, its CI excluding 1
    assert nic["share_of_gap"] > 0.7, knobs
    assert cc["verdict"] in ("does not matter", "unknown"), cc
    assert abs(cc["share_of_gap"]) < 0.3, cc
    # two follow-up cells, measured as one run of their own, a child of the parent; the corners reused
    assert doc["design"]["cells"] == 4 and len(doc["runs"]) == 1
    child = store.run(doc["runs"][0])
    assert child.status == "done" and child.manifest["explain"]["parents"] == [run.id]
    assert sorted((c.axes["nic"], c.axes["cc"], c.status) for c in store.cells(child.id)) == [
        ("e1000", "cubic", "done"),
        ("virtio", "reno", "done"),
    ]
    sources = {s["run"] for c in doc["cells"] for s in c["sources"]}
    assert sources == {run.id, child.id}
    # the nic x cc contrast is also parent run against follow-up run: said, whatever its verdict
    (inter,) = m["interactions"]
    assert inter["knobs"] == ["nic", "cc"] and inter["aliased_with_runs"] == [[run.id], [child.id]], inter

    shown = run_lab_cli("show", child.id, "-c", str(lab), cwd=tmp_path, timeout=120)
    assert shown.returncode == 0 and f"follow-up run of {run.id}" in shown.stdout, shown.stdout[-2000:]
    shown_parent = run_lab_cli("show", run.id, "-c", str(lab), cwd=tmp_path, timeout=120)
    assert f"follow-up runs (lab explain): {child.id}" in shown_parent.stdout, shown_parent.stdout[-2000:]

    # asked again: nothing to measure, the same answer as a table (the README's example)
    again = run_lab_cli("explain", run.id, *SELECT, "--rounds", "0", "-c", str(lab), cwd=tmp_path, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert len(store.runs()) == 2 and "matters" in again.stdout
    report = tmp_path / "report.html"
    rep = run_lab_cli("report", run.id, "-o", str(report), "-c", str(lab), cwd=tmp_path, timeout=300)
    assert rep.returncode == 0, rep.stderr[-2000:]
    assert 'id="explain-' in report.read_text()

    print(
        f"\nlab explain on real VMs: parent run (2 cells) {parent_s:.0f} s, explain (2 follow-up cells + "
        f"analysis) {explain_s:.0f} s; A {m['median_a']:.0f} -> B {m['median_b']:.0f} Mbit/s; "
        f"nic x{nic['effect_ratio']:.3f} [{nic['ci'][0]:.3f}, {nic['ci'][1]:.3f}] "
        f"({nic['share_of_gap']:.0%} of the gap) {nic['verdict']}; "
        f"cc x{cc['effect_ratio']:.3f} [{cc['ci'][0]:.3f}, {cc['ci'][1]:.3f}] "
        f"({cc['share_of_gap']:.0%}) {cc['verdict']}; interaction x{inter['ratio']:.2f} {inter['verdict']}"
        f"\n{text_plan.stdout}\n{again.stdout}"
    )
    assert leftovers(workdir) == []
