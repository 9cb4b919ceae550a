"""lab.variants: a workload's own variants (rows of the same cells) as the two sides of `lab compare`,
on a store shaped like the container start study: two cells, container-start's runtime x network
rows, runc a third slower than crun, the network the same."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.cli import lab_cli

from lab import variants
from lab.model import RawOutput, Sample
from lab.store import Store

AXES = {"host": "local", "image": "debian12", "vcpus": 2, "memory_mib": 1024, "disk_bus": "virtio"}
AXES |= {"clone": "linked", "tuning": "default"}
RUNTIMES, NETWORKS, N = {"crun": 1.0, "runc": 1.3}, ("default", "none"), 6


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = Store(tmp_path_factory.mktemp("variants") / "results")
    s.create_run("r1", "start", config_path="lab.toml", config_text="", seed=1, lab_version="0", manifest={})
    rng = np.random.default_rng(1)
    for idx, nic in enumerate(("virtio", "e1000"), start=1):
        cid = f"c0{idx}"
        s.add_cell("r1", cid, idx, f"local/debian12/{nic}/2c/1024m/virtio/linked/default", {**AXES, "nic": nic})
        s.cell_update("r1", cid, status="done")
        for rep in range(N):
            raw_id = s.add_raw("r1", cid, rep, RawOutput("container-start", "container-start", "{}"))
            rows = [
                Sample(f"start_ms_{rt}-{net}-persistent", float(rng.normal(500 * f, 10)), "ms", False)
                for rt, f in RUNTIMES.items()
                for net in NETWORKS
            ]
            rows.append(Sample("cpu_busy_pct", float(rng.normal(70, 2)), "%", None))
            s.add_samples("r1", cid, raw_id, "container-start", rep, rows)
    yield s
    s.close()


def compare(store: Store, *args: str):
    return lab_cli("compare", "r1", *args, "--results", str(store.dir), "--json")


def test_crun_against_runc_pairs_every_network_row_of_every_cell_and_says_worse(store):
    res = compare(store, "--a", "variant=crun", "--b", "variant=runc")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["primary_rows"] == 4  # each pair tested, corrected together
    assert doc["a"]["selector"] == {"variant": "crun"} and doc["b"]["selector"] == {"variant": "runc"}
    rows = doc["rows"]
    names = {r["key"][2] for r in rows}
    assert names == {f"start_ms_crun/runc-{net}-persistent" for net in NETWORKS}
    assert len(rows) == 4  # two rows in each of the two cells, each cell with itself
    assert all(r["primary"] and r["verdict"] == "worse" and r["q_value"] < 0.05 for r in rows), rows
    assert all(1.2 < r["ratio"] < 1.4 for r in rows), rows  # runc's start takes ~1.3x crun's


def test_a_longer_variant_and_a_cell_selection_narrow_it_down(store):
    res = compare(store, "--a", "variant=crun-none,nic=e1000", "--b", "variant=runc-none,nic=e1000")
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(res.stdout)["rows"]
    cell, workload, metric = row["key"]
    assert metric == "start_ms_crun-none/runc-none-persistent" and "/e1000/" in cell
    # the network as the variant: default against none, the same runtime; nothing apart here
    res = compare(store, "--a", "variant=default", "--b", "variant=none")
    rows = json.loads(res.stdout)["rows"]
    assert {r["key"][2] for r in rows} == {f"start_ms_{rt}-default/none-persistent" for rt in RUNTIMES}
    assert not {r["verdict"] for r in rows} & {"better", "worse"}, rows


@pytest.mark.parametrize(
    "a,b,says",
    [
        ("variant=crun", None, "give one on each side"),
        ("variant=crun", "variant=crun", "both select variant=crun"),
        (
            "variant=podman",
            "variant=docker",
            "(tags: crun-default-persistent, crun-none-persistent, runc-default-persistent, runc-none-persistent)",
        ),
        ("variant=crun_x", "variant=runc", "variant=crun_x: a variant is one or more parts"),
    ],
)
def test_a_variant_that_pairs_nothing_is_one_line_exit_2(store, a, b, says):
    res = compare(store, "--a", a, *(("--b", b) if b else ("--b", "nic=virtio")))
    assert res.returncode == 2 and says in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_tags_are_the_last_part_and_swap_replaces_a_run_of_parts():
    assert variants.split_metric("start_ms_crun-none-persistent") == ("start_ms", ("crun", "none", "persistent"))
    assert variants.split_metric("throughput_mbit_s_rx") == ("throughput_mbit_s", ("rx",))
    assert variants.split_metric("rc") is None
    tag = ("crun", "none", "persistent")
    assert variants.swap(tag, ("none", "persistent"), ("host", "transient")) == ("crun", "host", "transient")
    assert variants.swap(tag, ("none",), ("host",)) == ("crun", "host", "persistent")
    assert variants.swap(tag, ("persistent", "none"), ("x",)) is None  # in order only
    assert variants.pair_tag(tag, ("crun",), ("runc",)) == "crun/runc-none-persistent"
    assert variants.take({"nic": "virtio", "variant": "crun-none"}, "--a") == ({"nic": "virtio"}, ("crun", "none"))
