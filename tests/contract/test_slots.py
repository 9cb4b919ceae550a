"""A host with several slots ([hosts.NAME] slots) or places (a cluster's nodes): as many lanes, its
cells dealt to them, its set-up made once, all of them ended when it is lost; the estimate and the
plan say so."""

from __future__ import annotations

import fakes.backend as fake
import pytest
from test_lanes import by_status, host_of, timed_run, write_lab

from lab import backends, estimate, plan, runner
from lab.errors import ConfigError
from lab.runner import lanes
from lab.store import Store


def test_split_deals_a_hosts_cells_to_its_slots_in_order(fake_lab):
    cfg = write_lab(fake_lab, {"a": "slots = 2", "b": ""}, vcpus=3)
    ordered = plan.order(plan.units(cfg), "random", seed=3)
    named = {h: [n for n, _ in backends.host_lanes(h, cfg.hosts[h])] for h in ("a", "b")}
    assert named == {"a": ["a", "a/2"], "b": ["b"]}
    split = lanes.split(ordered, named)
    a = [u for u in ordered if u.host == "a"]
    assert split["a"] == a[0::2] and split["a/2"] == a[1::2]
    assert split["b"] == [u for u in ordered if u.host == "b"]
    assert {lanes.host_of(name) for name in split} == {"a", "b"}
    # never more lanes than cells
    assert list(lanes.split(a[:1], {"a": ["a", "a/2", "a/3"]})) == ["a"]


def test_a_host_with_places_has_slots_lanes_on_each_place(fake_lab):
    cfg = write_lab(fake_lab, {"a": 'places = ["n1", "n2"]\nslots = 2'}, vcpus=1)
    assert backends.host_lanes("a", cfg.hosts["a"]) == [
        ("a@n1", "n1"),
        ("a@n1/2", "n1"),
        ("a@n2", "n2"),
        ("a@n2/2", "n2"),
    ]
    assert [(lanes.host_of(n), lanes.place_of(n)) for n in ("a@n2/2", "a/2", "a")] == [
        ("a", "n2"),
        ("a", ""),
        ("a", ""),
    ]
    assert backends.lanes_at_once("a", cfg.hosts["a"], 3) == 3 and backends.lanes_at_once("a", cfg.hosts["a"], 0) == 1


def test_each_place_is_a_lane_and_its_vms_go_there(fake_lab):
    store, rid, wall = timed_run(write_lab(fake_lab, {"a": 'places = ["n1", "n2"]'}, vcpus=4, sleep_s=0.3))
    assert by_status(store, rid) == {"done": ["c01", "c02", "c03", "c04"]}
    assert store.run(rid).manifest["lanes"] == {"a@n1": ["c01", "c03"], "a@n2": ["c02", "c04"]}
    placed = {name.rsplit("-", 1)[1]: place for name, place in fake.PLACED.items()}
    assert placed == {"c01": "n1", "c03": "n1", "c02": "n2", "c04": "n2"}  # every VM on its lane's place
    assert wall < 4 * 0.3 * 0.9  # one lane would sleep 1.2 s alone
    assert [e for e in fake.JOURNAL if e[0] == "open_run"] == [("open_run", rid)]  # the host's set-up once
    # one cell: inline (no lane threads), still on the first place
    store, rid, _ = timed_run(write_lab(fake_lab, {"a": 'places = ["n1", "n2"]'}, vcpus=1))
    assert store.run(rid).manifest["lanes"] == {"a@n1": ["c01"]}
    assert fake.PLACED[f"lab-{rid}-c01"] == "n1"


def test_two_slots_run_two_cells_of_one_host_at_once(fake_lab):
    store, rid, wall = timed_run(write_lab(fake_lab, {"a": "slots = 2"}, vcpus=4, sleep_s=0.3))
    assert by_status(store, rid) == {"done": ["c01", "c02", "c03", "c04"]}
    man = store.run(rid).manifest
    assert man["lanes"] == {"a": ["c01", "c03"], "a/2": ["c02", "c04"]}
    assert man["overlaps"]  # the manifest says which of the host's cells shared it
    assert wall < 4 * 0.3 * 0.9  # one slot would sleep 1.2 s alone
    opened = [e for e in fake.JOURNAL if e[0] == "open_run"]
    assert len(opened) == 1  # the host's set-up for the run, once for both lanes
    assert fake.LIVE == {} and store.open_leases() == [] and store.run(rid).status == "done"


@pytest.mark.parametrize("lost", ["open_run", "c02"])
def test_a_lost_host_ends_every_lane_of_it(fake_lab, lost):
    cfg = write_lab(fake_lab, {"a": f'slots = 2\nlost = "{lost}"', "b": ""}, vcpus=4, sleep_s=0.2)
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store)
    cells = {c.cell_id: c for c in store.cells(rid)}
    hosts = host_of(store, rid)
    assert all(c.status == "done" for c in cells.values() if hosts[c.cell_id] == "b")
    a = {cid: c for cid, c in cells.items() if hosts[cid] == "a"}
    if lost == "open_run":
        assert all(c.status == "failed" and c.error.startswith("host a lost: ") for c in a.values())
    else:
        assert a["c02"].status == "failed" and "no answer" in a["c02"].error
        # neither lane of host a starts a cell once c02 has lost it
        cloned = [name for ev, name in fake.JOURNAL if ev == "clone"]
        for cid in ("c03", "c04"):
            assert a[cid].status == "failed" and a[cid].error.startswith("host a lost: "), a[cid]
            assert f"lab-{rid}-{cid}" not in cloned
    assert fake.LIVE == {}


def test_the_estimate_divides_a_hosts_cells_among_its_slots(fake_lab):
    params = {"fake-work": {"values": [1.0], "sleep_s": 0.0, "seconds": 1.0, "warmup_value": 1.0, "time": 30}}
    one = write_lab(fake_lab, {"a": ""}, vcpus=4)
    single = estimate.estimate(one, plan.units(one), params)
    two = write_lab(fake_lab, {"a": "slots = 2"}, vcpus=4)
    double = estimate.estimate(two, plan.units(two), params)
    overhead = estimate.RUN_OVERHEAD_DEFAULT_S
    assert double.seconds == pytest.approx((single.seconds - overhead) / 2 + overhead)
    nodes = write_lab(fake_lab, {"a": 'places = ["n1", "n2"]'}, vcpus=4)
    assert estimate.estimate(nodes, plan.units(nodes), params).seconds == pytest.approx(double.seconds)
    # on this machine the measurements take turns on it: only the rest overlaps
    here = write_lab(fake_lab, {"a": "slots = 2\nlocal_host = true"}, vcpus=4)
    local = estimate.estimate(here, plan.units(here), params)
    assert double.seconds < local.seconds


def test_plan_says_how_many_cells_a_host_runs_at_once(fake_lab):
    from support.cli import lab_cli

    write_lab(fake_lab, {"a": "slots = 3"}, vcpus=4)
    res = lab_cli("plan", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    assert res.returncode == 0, res.stderr
    text = " ".join((res.stdout + res.stderr).split())
    assert "lanes: 1 host, as many cells as lanes" in text
    assert "lane a: 4 cells, 3 at a time (slots: its measured VMs share the host" in text
    write_lab(fake_lab, {"a": 'places = ["n1", "n2"]', "b": ""}, vcpus=2)
    res = lab_cli("plan", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    text = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 0 and "lanes: 2 hosts at once, as many cells as lanes" in text, text
    assert "lane a: 2 cells, 2 at a time, one on each node (n1, n2)" in text and "lane b: 2 cells," in text


def test_more_slots_than_the_backend_runs_is_refused(fake_lab):
    from support.cli import lab_cli

    with pytest.raises(ConfigError):
        write_lab(fake_lab, {"a": "slots = 9"}, vcpus=1)
    res = lab_cli("plan", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert "hosts.a.slots" in line and "9" in line and "at most 8" in line


def test_a_proxmox_cluster_spread_over_its_nodes_has_slots_lanes_per_node(tmp_path, monkeypatch):
    from lab import config

    monkeypatch.setenv("T", "lab@pve!t=secret")
    (tmp_path / "lab.toml").write_text(
        '[hosts.pve1]\nbackend = "proxmox"\nurl = "https://pve1:8006"\ntoken = "env:T"\nnode = "pve1"\n'
        'nodes = ["pve1", "pve2"]\nplacement = "spread"\nslots = 2\n[matrix]\nhost = ["pve1"]\n'
    )
    cfg = config.load(tmp_path / "lab.toml")
    assert [name for name, _ in backends.host_lanes("pve1", cfg.hosts["pve1"])] == [
        "pve1@pve1",
        "pve1@pve1/2",
        "pve1@pve2",
        "pve1@pve2/2",
    ]
    pack = cfg.hosts["pve1"].model_copy(update={"placement": "pack"})
    assert backends.host_lanes("pve1", pack) == [("pve1", ""), ("pve1/2", "")]  # one place: the cluster's choice
