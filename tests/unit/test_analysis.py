"""lab.analysis and `lab compare`/`lab show` on a store of seeded synthetic runs: cell selections,
pairing, missing cells, the A/A noise floor from a twin cell, overhead vs bare metal, host facts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.cli import lab_cli

from lab import analysis, results
from lab.compare import Verdict
from lab.errors import UsageError
from lab.model import RawOutput, Sample
from lab.store import Store

pytestmark = pytest.mark.filterwarnings("error")

R = 2000  # bootstrap resamples in direct calls

VM_AXES = {
    "host": "local",
    "image": "debian12",
    "vcpus": 2,
    "memory_mib": 1024,
    "disk_bus": "virtio",
    "clone": "linked",
    "tuning": "default",
}


def vm(nic: str, host: str = "local", twin: bool = False) -> tuple[str, dict]:
    axes = {**VM_AXES, "host": host, "nic": nic, **({"replica": 2} if twin else {})}
    label = f"{host}/debian12/{nic}/2c/1024m/virtio/linked/default" + ("#aa" if twin else "")
    return label, axes


BARE = ("local/bare-metal", {"host": "local", "kind": "bare-metal"})


def facts(kernel: str, cpu: str = "AMD EPYC") -> dict:
    return {
        "host": "local",
        "backend": "local",
        "cpu_model": cpu,
        "kernel": kernel,
        "microcode": "0x1",
        "mitigations": {"retbleed": "Not affected"},
        "nics": {"eth0": "virtio_net, MTU 1500"},
    }


def add_run(
    store: Store,
    run: str,
    cells: dict[str, tuple[tuple[str, dict], float, float]],
    host_facts: dict,
    *,
    n: int = 10,
    seed: int = 0,
) -> None:
    """cells: id -> ((label, axes), median throughput, CV)."""
    store.create_run(run, "synthetic", config_path="lab.toml", config_text="", seed=seed, lab_version="0", manifest={})
    for h, f in host_facts.items():
        store.host_facts.add(run, h, f"fp-{run}-{h}-{f['kernel']}", f)
    rng = np.random.default_rng(seed)
    for idx, (cid, ((label, axes), mean, cv)) in enumerate(cells.items(), start=1):
        store.add_cell(run, cid, idx, label, axes)
        store.cell_update(run, cid, status="done")
        for rep in range(n):
            raw_id = store.add_raw(run, cid, rep, RawOutput("iperf3-tcp", "iperf3", "{}"))
            tx = float(rng.normal(mean, mean * cv))
            store.add_samples(
                run,
                cid,
                raw_id,
                "iperf3-tcp",
                rep,
                [
                    Sample("throughput_mbit_s_tx", tx, "Mbit/s", True, {"repetition": rep}),
                    Sample("cpu_busy_pct_tx", float(rng.normal(40, 1)), "%", False, {"repetition": rep}),
                    Sample("cpu_busy_pct", float(rng.normal(40, 1)), "%", False, {"repetition": rep}),
                    Sample("retransmits_tx", 0.0, "count", False, {"repetition": rep}),
                ],
            )


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    s = Store(tmp_path_factory.mktemp("analysis") / "results")
    # r1: virtio, e1000, the A/A twin of virtio (2.5 % slower: boot-to-boot spread), bare metal
    add_run(
        s,
        "r1",
        {
            "c01": (vm("virtio"), 1000.0, 0.01),
            "c02": (vm("e1000"), 500.0, 0.01),
            "c01-aa": (vm("virtio", twin=True), 975.0, 0.01),
            "bm01": (BARE, 1100.0, 0.01),
        },
        {"local": facts("6.1.0")},
        seed=1,
    )
    # r2: the same cells on a newer kernel; virtio +2 % (inside the A/A band), e1000 +20 %; no bare metal
    add_run(
        s,
        "r2",
        {"c01": (vm("virtio"), 1020.0, 0.01), "c02": (vm("e1000"), 600.0, 0.01), "c03": (vm("e1000e"), 700.0, 0.01)},
        {"local": facts("6.12.0")},
        seed=2,
    )
    # r3: two hosts in one run
    add_run(
        s,
        "r3",
        {"c01": (vm("virtio", "pve1"), 900.0, 0.01), "c02": (vm("virtio", "bsd1"), 800.0, 0.01)},
        {
            "pve1": {**facts("6.8.12-pve"), "host": "pve1", "backend": "proxmox"},
            "bsd1": {**facts("14.1-RELEASE", cpu="Intel N150"), "host": "bsd1", "backend": "libvirt"},
        },
        seed=3,
    )
    yield s
    s.close()


def side(store, run, *sel):
    r = store.run(run)
    return analysis.side(
        r.id,
        r.seed,
        store.cells(r.id),
        store.samples(r.id),
        store.host_facts.of_run(r.id),
        analysis.parse_selector(sel),
    )


# --- selectors ---------------------------------------------------------------------------------------


def test_parse_selector():
    assert analysis.parse_selector(["nic=virtio", "tuning=default,vcpus=2"]) == {
        "nic": "virtio",
        "tuning": "default",
        "vcpus": "2",
    }
    assert analysis.parse_selector([]) == {}
    for bad, msg in (
        (["nic"], "expected AXIS=VALUE"),
        (["colour=red"], "unknown axis 'colour'"),
        (["nic=virtio", "nic=e1000"], "given twice"),
        (["=x"], "expected AXIS=VALUE"),
    ):
        with pytest.raises(UsageError, match=msg):
            analysis.parse_selector(bad, "--a")


def test_selections_leave_twins_out_unless_asked(store):
    labels = lambda *sel: sorted(c.cell_id for c in side(store, "r1", *sel).cells)  # noqa: E731
    assert labels() == ["bm01", "c01", "c02"]
    assert labels("nic=virtio") == ["c01"]
    assert labels("nic=virtio", "replica=2") == ["c01-aa"]
    assert labels("kind=bare-metal") == ["bm01"]
    assert labels("kind=vm") == ["c01", "c02"]
    assert labels("host=local") == ["bm01", "c01", "c02"]


# --- pairing and comparisons -------------------------------------------------------------------------


def test_two_cell_selections_of_one_run(store):
    cmp = analysis.compare_sides(side(store, "r1", "nic=virtio"), side(store, "r1", "nic=e1000"), n_resamples=R)
    ((label, ca, cb),) = cmp.pairs
    assert (ca.cell_id, cb.cell_id) == ("c01", "c02")
    tx = next(r for r in cmp.rows if r.key[2] == "throughput_mbit_s_tx")
    assert tx.verdict == Verdict.WORSE and tx.ratio == pytest.approx(0.5, rel=0.03)
    assert tx.ratio_ci[0] <= tx.ratio <= tx.ratio_ci[1] < 1
    # what `lab show` shows (retransmits even at zero) and the CPU busy % beside it
    assert {r.key[2] for r in cmp.rows} == {"throughput_mbit_s_tx", "retransmits_tx", "cpu_busy_pct_tx", "cpu_busy_pct"}
    assert not cmp.host_diffs  # one run, one host


def test_pairing_by_the_axes_the_selections_do_not_name(store):
    a, b = side(store, "r2", "kind=vm"), side(store, "r1", "kind=vm")
    pairs = analysis.pair(a, b)
    by = {k: (x.cell_id if x else None, y.cell_id if y else None) for k, x, y in pairs}
    assert by == {
        "local/debian12/virtio/2/1024/virtio/linked/default": ("c01", "c01"),
        "local/debian12/e1000/2/1024/virtio/linked/default": ("c02", "c02"),
        "local/debian12/e1000e/2/1024/virtio/linked/default": ("c03", None),
    }


def test_one_against_many_and_ambiguity(store):
    a, b = side(store, "r1", "kind=bare-metal"), side(store, "r1", "kind=vm")
    assert [(x.cell_id, y.cell_id) for _, x, y in analysis.pair(a, b)] == [("bm01", "c01"), ("bm01", "c02")]
    # r3's two virtio cells (pve1, bsd1) differ only in host, which the selections name
    with pytest.raises(UsageError, match="matches c01 and c02.*narrow it down"):
        analysis.pair(side(store, "r3", "nic=virtio"), side(store, "r1", "host=local"))


def test_two_runs_missing_cells_and_host_differences(store):
    cmp = analysis.compare_sides(side(store, "r1"), side(store, "r2"), n_resamples=R)
    tx = {nic_of(r.key[0]): r for r in cmp.rows if r.key[2] == "throughput_mbit_s_tx"}
    assert tx["e1000"].verdict == Verdict.BETTER
    assert tx["e1000e"].verdict == Verdict.MISSING_A  # only in r2
    assert tx["bare-metal"].verdict == Verdict.MISSING_B  # only in r1
    assert [(h, f) for h, f, *_ in cmp.host_diffs] == [("local", "fingerprint"), ("local", "kernel")]
    assert cmp.host_diffs[1] == ("local", "kernel", "6.1.0", "6.12.0")


def test_two_hosts_of_one_run(store):
    cmp = analysis.compare_sides(side(store, "r3", "host=pve1"), side(store, "r3", "host=bsd1"), n_resamples=R)
    tx = next(r for r in cmp.rows if r.key[2] == "throughput_mbit_s_tx")
    assert tx.verdict == Verdict.WORSE
    diffs = {fact: (a, b) for host, fact, a, b in cmp.host_diffs}
    assert host_pair(cmp) == {"pve1 / bsd1"}
    assert diffs["cpu_model"] == ("AMD EPYC", "Intel N150") and diffs["backend"] == ("proxmox", "libvirt")
    assert "mitigations.retbleed" not in diffs  # the same on both


def nic_of(label: str) -> str:
    return label.split("/")[2] if label.count("/") >= 2 else label.split("/")[-1]


def host_pair(cmp):
    return {h for h, *_ in cmp.host_diffs}


# --- noise floor -------------------------------------------------------------------------------------


def test_noise_floor_from_the_twin(store):
    s1 = results.series(store.samples("r1"), store.cells("r1"))
    nf = analysis.noise_floor(s1, seed=1)
    lo, hi = nf[("iperf3-tcp", "throughput_mbit_s_tx")].band()
    assert lo < 0.98 and hi > 1.02  # the twin ran 2.5 % slower: identical setups differ that much
    assert analysis.noise_floor(results.series(store.samples("r2"), store.cells("r2"))) == {}  # no twin in r2
    # r1 -> r2: virtio +2 % is significant by the tests, but inside the margin (the A/A band here is
    # narrower than the ±7.5 % minimum, so the minimum): the same
    cmp = analysis.compare_sides(side(store, "r1"), side(store, "r2"), noise=nf, n_resamples=R)
    virtio = next(r for r in cmp.rows if r.key[2] == "throughput_mbit_s_tx" and nic_of(r.key[0]) == "virtio")
    assert virtio.significant is True and virtio.verdict == Verdict.SAME and virtio.primary
    assert virtio.noise_band == pytest.approx((lo, hi)) and virtio.margin.text() == "±7.5 %"
    # a wider stated minimum, and the band as the margin where it is wider than the minimum
    narrow = analysis.compare_sides(side(store, "r1"), side(store, "r2"), noise=nf, n_resamples=R, margin_pct=1)
    v1 = next(r for r in narrow.rows if r.key[2] == "throughput_mbit_s_tx" and nic_of(r.key[0]) == "virtio")
    assert v1.margin.source == "A/A band" and (v1.margin.low, v1.margin.high) == pytest.approx((lo, hi))
    # exploratory rows: the CPU and the retransmits are not iperf3's headline metrics
    cpu = next(r for r in cmp.rows if r.key[2] == "cpu_busy_pct_tx" and nic_of(r.key[0]) == "virtio")
    assert cpu.verdict == Verdict.EXPLORATORY and cpu.q_value is None
    e1000 = next(r for r in cmp.rows if r.key[2] == "throughput_mbit_s_tx" and nic_of(r.key[0]) == "e1000")
    assert e1000.verdict == Verdict.BETTER  # +20 % is far outside it


# --- overhead vs a baseline --------------------------------------------------------------------------


def test_overhead_vs_bare_metal(store):
    rows = analysis.overheads(
        store.cells("r1"), store.samples("r1"), analysis.parse_selector(["kind=bare-metal"]), seed=1, n_resamples=R
    )
    tx = {nic_of(o.cell): o for o in rows if o.row.key[2] == "throughput_mbit_s_tx"}
    assert set(tx) == {"virtio", "e1000"}  # the twin is not a cell of its own here
    v = tx["virtio"]
    assert v.reference == "local/bare-metal" and v.change_pct == pytest.approx(-9.1, abs=1.0)
    lo, hi = v.change_ci_pct
    assert lo <= v.change_pct <= hi < 0 and v.row.verdict == Verdict.WORSE
    assert analysis.fmt_change(-0.5234, (-0.91, -0.13)) == "−0.52 % [−0.91, −0.13]"
    assert analysis.fmt_change(None) == "–"
    # a chosen reference cell instead of bare metal
    ref = analysis.overheads(store.cells("r1"), store.samples("r1"), {"nic": "virtio"}, seed=1, n_resamples=R)
    assert {o.reference for o in ref} == {"local/debian12/virtio/2c/1024m/virtio/linked/default"}
    with pytest.raises(UsageError, match="no bare-metal cell"):
        analysis.overheads(store.cells("r2"), store.samples("r2"), analysis.parse_selector(["kind=bare-metal"]))
    with pytest.raises(UsageError, match="one cell per host"):
        analysis.overheads(store.cells("r1"), store.samples("r1"), {"host": "local"})


# --- the CLI -----------------------------------------------------------------------------------------


def cli(store, *args):
    return lab_cli(*args, "--results", str(store.dir))


def test_cli_compare_selections_json(store):
    res = cli(store, "compare", "r1", "--a", "nic=virtio", "--b", "nic=e1000", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["a"] == {"run": "r1", "selector": {"nic": "virtio"}} and doc["b"]["selector"] == {"nic": "e1000"}
    tx = next(r for r in doc["rows"] if r["key"][2] == "throughput_mbit_s_tx")
    assert tx["verdict"] == "worse" and tx["noise_band"] is not None  # r1 has a twin


def test_cli_compare_two_runs_shows_noise_and_host_facts(store):
    res = cli(store, "compare", "r1", "r2")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "A/A band" in out and "same" in out and "missing in A" in out and "missing in B" in out
    assert "exploratory" in out and "Benjamini-Hochberg" in out
    assert "host facts that differ (2)" in out and "kernel" in out and "6.12.0" in out


def test_cli_compare_baseline(store):
    res = cli(store, "compare", "r1", "--baseline")
    assert res.returncode == 0, res.stderr
    assert "overhead vs bare-metal" in res.stdout and "−9." in res.stdout and "worse" in res.stdout
    doc = json.loads(cli(store, "compare", "r1", "--baseline", "nic=e1000", "--json").stdout)["rows"]
    assert {d["baseline"] for d in doc} == {"local/debian12/e1000/2c/1024m/virtio/linked/default"}
    virtio = next(d for d in doc if d["key"][2] == "throughput_mbit_s_tx" and nic_of(d["cell"]) == "virtio")
    assert virtio["change_pct"] == pytest.approx(100.0, abs=6)


@pytest.mark.parametrize(
    "args, needle",
    [
        (("compare", "r1"), "needs two runs"),
        (("compare", "r1", "--a", "nic"), "expected AXIS=VALUE"),
        (("compare", "r1", "--a", "nic=rtl8139", "--b", "nic=e1000"), "no cell of run r1 matches"),
        (("compare", "r2", "--baseline"), "no bare-metal cell"),
        (("compare", "r1", "r2", "--baseline"), "takes no RUN_B"),
    ],
)
def test_cli_compare_bad_input_is_one_line_exit_2(store, args, needle):
    res = cli(store, *args)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1 and needle in res.stderr and "Traceback" not in res.stderr


def test_cli_show_has_ci_and_cv(store):
    res = cli(store, "show", "r1")
    assert res.returncode == 0, res.stderr
    for col in ("median", "95 % CI", "min–max", "CV", "n", "CPU busy %"):
        assert col in res.stdout
    assert "virtio A/A" in res.stdout and "bare-metal" in res.stdout
