"""Trustworthy comparisons on a real run: VirtIO and E1000 VMs, the A/A twin of the VirtIO cell and
the bare-metal cell, interleaved in seeded rounds; one VM killed midway; then show, compare (two
cell selections, the noise floor, overhead vs bare metal) and the HTML report in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest
from support.chromium import chromium_render
from support.cli import LAB, run_lab_cli
from support.local import leftovers, write_lab

from lab import config, plan
from lab.backends import local
from lab.store import Store
from lab.wait import wait_until

pytestmark = [pytest.mark.vm, pytest.mark.image]

SUITE = """
workloads = ["sysbench-cpu", "iperf3-tcp"]
order = "interleaved"
seed = {seed}
repetitions = 4
repetitions_per_boot = 2
warmup = 0  # about rounds, a kill and the views, not warm caches: 7 boots' warm-ups saved
bare_metal = true
noise_floor = true
quiet_host = "off"  # about rounds and a VM killed midway; the host's load is test_host_load_vm's
[suite.params.sysbench-cpu]
time = 1
threads = [1]
[suite.params.iperf3-tcp]
time = 2
directions = ["tx"]
"""
# warm: each NIC model's post-boot snapshot is made once and every boot after it (2 per cell, the
# twin's too) is a restore: 2 cold boots instead of 6, the same rounds, kill and figures to check
MATRIX = 'nic = ["virtio", "e1000"]\nstart = ["warm"]\n'


def seed_with_twin_first_in_round_2(cfg_text: str) -> int:
    """A seed whose second round boots the twin before the other VMs: killing it there shows the
    cells after it going on."""
    for seed in range(1000):
        matrix = {"nic": ["virtio", "e1000"], "start": ["warm"]}
        cfg = config.parse({"matrix": matrix, "suite": {"bare_metal": True, "noise_floor": True}})
        order = [u.id for u in plan.round_order(plan.units(cfg), seed, 2) if u.kind == "vm"]
        if order[0] == "c01-aa":
            return seed
    raise AssertionError("no seed found")


def test_interleaved_run_then_show_compare_report(golden, workdir, tmp_path):
    seed = seed_with_twin_first_in_round_2(MATRIX)
    cfg = write_lab(tmp_path, workdir, matrix=MATRIX, suite=SUITE.format(seed=seed))
    results = tmp_path / "results"
    p = subprocess.Popen(
        [*LAB, "run", "-c", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )

    def twin_measuring_iperf3_in_round_2():
        if not (results / "lab.db").exists():
            return False
        s = Store(results)
        try:
            runs = s.runs()
            return bool(runs) and any(
                e.cell_id == "c01-aa"
                and e.round == 2
                and e.workload == "iperf3-tcp"
                and e.repetition >= 0
                and e.outcome == "running"
                for e in s.timings.executions(runs[0].id)
            )
        finally:
            s.close()

    try:
        wait_until(twin_measuring_iperf3_in_round_2, timeout=1500, what="the twin's iperf3 in round 2", interval=0.2)
        ((pid, _),) = [(pid, n) for pid, n in local.qemu_processes(workdir) if n.endswith("-c01-aa")]
        os.kill(pid, signal.SIGKILL)  # the twin's VM dies mid-measurement
        out, err = p.communicate(timeout=1500)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 1, err[-3000:]  # a cell failed
    assert "Traceback" not in err
    store = Store(results)
    (run,) = store.runs()
    cells = {c.cell_id: c for c in store.cells(run.id)}
    assert {k: c.status for k, c in cells.items()} == {"c01": "done", "c02": "done", "c01-aa": "failed", "bm01": "done"}
    assert cells["c01-aa"].stage == "workloads" and cells["c01-aa"].error
    # the executed order: every cell in both rounds, each round in its recorded seeded order; the
    # cells after the failed one in round 2 went on
    ex = store.timings.executions(run.id)
    firsts: dict[int, list[str]] = {}
    for e in ex:
        if e.cell_id not in firsts.setdefault(e.round, []):
            firsts[e.round].append(e.cell_id)
    assert firsts == {1: run.manifest["rounds"][0], 2: run.manifest["rounds"][1]}
    assert run.manifest["schedule"]["seed"] == seed == run.seed
    assert [u.id for u in plan.round_order(plan.units(config.load(cfg)), seed, 2)] == firsts[2]
    failed = [e for e in ex if e.outcome == "failed"]
    assert [(e.cell_id, e.round, e.workload) for e in failed] == [("c01-aa", 2, "iperf3-tcp")]
    after = firsts[2][firsts[2].index("c01-aa") + 1 :]
    assert {"c01", "c02"} <= set(after)
    # samples: 4 per finished cell; the twin keeps what it measured before it died
    n = {}
    for s in store.samples(run.id):
        n[(s.cell_id, s.metric)] = n.get((s.cell_id, s.metric), 0) + 1
    for cid in ("c01", "c02", "bm01"):
        assert n[(cid, "events_per_s_1t")] == 4 and n[(cid, "throughput_mbit_s_tx")] == 4, (cid, n)
    assert n[("c01-aa", "events_per_s_1t")] == 4 and n[("c01-aa", "throughput_mbit_s_tx")] == 2
    assert store.open_leases() == [] and leftovers(workdir, run.id) == []
    accel = cells["c01"].facts["accel"]
    assert {cells[c].facts["start"] for c in ("c01", "c02", "c01-aa")} == {"warm"}

    # lab show: median, CI, min-max, CV, n, CPU; the twin and bare metal by name
    show = run_lab_cli("show", run.id, "-c", str(cfg))
    assert show.returncode == 0, show.stderr
    for text in ("95 % CI", "CV", "virtio A/A", "bare-metal", "order interleaved", f"seed {seed}"):
        assert text in show.stdout, text

    # lab compare: two cell selections of the run, with the A/A band of the twin beside each row
    res = run_lab_cli("compare", run.id, "--a", "nic=virtio", "--b", "nic=e1000", "-c", str(cfg), "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["key"][2]: r for r in json.loads(res.stdout)["rows"]}
    tx = rows["throughput_mbit_s_tx"]
    assert (tx["n_a"], tx["n_b"]) == (4, 4) and tx["p_value"] is not None
    assert tx["verdict"] in ("better", "worse", "same", "unknown") and tx["primary"] and tx["q_value"] is not None
    assert tx["noise_band"] and tx["noise_band"][0] <= 1 <= tx["noise_band"][1]
    assert rows["events_per_s_1t"]["noise_band"]
    # overhead vs bare metal: under TCG a VM computes far slower than the host does
    res = run_lab_cli("compare", run.id, "--baseline", "-c", str(cfg), "--json")
    assert res.returncode == 0, res.stderr
    over = [o for o in json.loads(res.stdout)["rows"] if o["key"][2] == "events_per_s_1t"]
    assert sorted(o["cell"].split("/")[2] for o in over) == ["e1000", "virtio"]
    assert all(
        o["baseline"] == "local/bare-metal" and o["change_ci_pct"][0] <= o["change_pct"] <= o["change_ci_pct"][1]
        for o in over
    )
    if accel == "tcg":
        assert all(o["change_pct"] < -30 and o["verdict"] == "worse" for o in over), over
    text = run_lab_cli("compare", run.id, "--baseline", "-c", str(cfg)).stdout
    assert re.search(r"−\d+\.\d\d % \[−", text), text

    # lab report: renders in Chromium without console errors; overhead, comparison-free single run
    rep = run_lab_cli("report", run.id, "-c", str(cfg), "-o", str(tmp_path / "report.html"))
    assert rep.returncode == 0, rep.stderr
    page = tmp_path / "report.html"
    html_text = page.read_text()
    assert 'id="overhead-table"' in html_text and "bare-metal" in html_text and "virtio A/A" in html_text
    dom, console = chromium_render(page, tmp_path / "report.png", tmp_path / "profile", size=(1280, 2400))
    assert not console, console
    assert 'id="overhead-table"' in dom and dom.count("<figure") == html_text.count("<figure") > 0
    assert (tmp_path / "report.png").stat().st_size > 30_000
