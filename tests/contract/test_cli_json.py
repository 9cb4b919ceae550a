"""`--json` of ls, plan, doctor, gc, show, compare, snapshot and images ls (lab.cli.shapes): one
JSON document on stdout with its schema first, parsed here; errors stay one line on stderr with exit
status 2 or 1."""

from __future__ import annotations

import json

import fakes.backend as fake
import pytest
from support.cli import lab_cli

from lab import doctor, images, runner
from lab.model import Vm
from lab.store import Store


def document(res, schema: str) -> dict:
    doc = json.loads(res.stdout)
    assert list(doc)[0] == "schema" and doc["schema"] == schema, doc
    return doc


def test_ls_json_lists_the_runs_and_an_empty_store_is_an_empty_list(fake_lab):
    fake_lab.write(matrix='nic = ["virtio", "e1000"]')
    res = lab_cli("ls", "--json", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    assert res.returncode == 0 and document(res, "lab.ls/1")["runs"] == []
    assert not (fake_lab.dir / "results").exists()  # listing creates no store
    cfg = fake_lab.load()
    rid = runner.run_lab(cfg, Store(cfg.results_dir), run_id="r1")
    doc = document(lab_cli("ls", "--json", "-c", str(fake_lab.path), cwd=fake_lab.dir), "lab.ls/1")
    assert doc["results"] == str(cfg.results_dir)
    [run] = doc["runs"]
    assert run["id"] == rid and run["status"] == "done" and run["name"] == "fake"
    assert (run["cells"], run["cells_done"], run["samples"]) == (2, 2, 8)
    assert run["finished_at"] >= run["started_at"] and run["duration_s"] >= 0


def test_plan_json_has_cells_what_is_made_and_the_estimate(fake_lab):
    fake_lab.write(
        matrix='nic = ["virtio", "e1000"]', suite='order = "interleaved"\nrepetitions = 2\nbare_metal = true'
    )
    res = lab_cli("plan", "--json", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    assert res.returncode == 0, res.stderr
    doc = document(res, "lab.plan/1")
    assert doc["lab"] == "fake"
    assert [(c["id"], c["kind"], c["host"]) for c in doc["cells"]] == [
        ("c01", "vm", "f"),
        ("c02", "vm", "f"),
        ("bm01", "bare-metal", "f"),
    ]
    assert doc["cells"][1]["axes"]["nic"] == "e1000" and doc["cells"][0]["duplicate_of"] is None
    assert doc["creates"] == {"vms": 4, "boots_per_cell": 2, "backends": ["fake"], "bare_metal": True}
    assert doc["suite"]["workloads"] == ["fake-work"] and doc["suite"]["order"] == "interleaved"
    est = doc["estimate"]
    assert est["basis"] == "defaults" and est["runs"] == {} and est["seconds"] > 0 and est["at_least"] is False
    assert est["text"].startswith("first-run defaults")
    assert doc["checked"] is False and doc["images"] == []
    assert not (fake_lab.dir / "results").exists()  # planning creates no store


def test_plan_check_json_reaches_the_hosts_and_an_unreachable_one_is_exit_2(fake_lab):
    fake_lab.write()
    doc = document(lab_cli("plan", "--check", "--json", "-c", str(fake_lab.path), cwd=fake_lab.dir), "lab.plan/1")
    assert doc["checked"] is True and doc["images"] == []  # the fake backend has nothing to say about images
    assert ("check_images", "debian12") in fake.JOURNAL
    toml = fake_lab.path.read_text()
    fake_lab.path.write_text(toml.replace('"f"', '"unreachable1"').replace("[hosts.f]", "[hosts.unreachable1]"))
    res = lab_cli("plan", "--check", "--json", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    assert res.returncode == 2 and res.stdout == "" and "cannot reach it" in res.stderr, res


def test_plan_json_errors_stay_one_line_exit_2(tmp_path):
    (tmp_path / "lab.toml").write_text('[matrix]\nnic = ["nope"]\n')
    res = lab_cli("plan", "--json", "-c", str(tmp_path / "lab.toml"), cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == "" and len(res.stderr.strip().splitlines()) == 1, res


CHECKS = [
    doctor.Check("qemu-system-x86_64", "ok", "QEMU emulator version 7.2"),
    doctor.Check("kvm", "warn", "/dev/kvm absent: TCG only"),
]


@pytest.mark.parametrize("failing", [False, True])
def test_doctor_json_says_whether_this_machine_can_run_a_lab(tmp_path, monkeypatch, failing):
    checks = CHECKS + ([doctor.Check("netns", "fail", "cannot create a network namespace")] if failing else [])
    monkeypatch.setattr(doctor, "run_checks", lambda config_path: checks)
    monkeypatch.setattr(doctor, "probed_accel", lambda: "tcg")
    res = lab_cli("doctor", "--json", cwd=tmp_path)
    doc = document(res, "lab.doctor/1")
    assert doc["ok"] is (not failing) and res.returncode == (1 if failing else 0) and doc["accel"] == "tcg"
    assert doc["checks"][:2] == [
        {"name": "qemu-system-x86_64", "status": "ok", "ok": True, "detail": "QEMU emulator version 7.2"},
        {"name": "kvm", "status": "warn", "ok": True, "detail": "/dev/kvm absent: TCG only"},
    ]
    if failing:
        assert doc["checks"][2]["ok"] is False and res.stderr.strip() == "doctor: failed: netns"
    else:
        assert res.stderr == ""


def test_doctor_json_on_this_machine_parses(tmp_path):
    res = lab_cli("doctor", "--json", cwd=tmp_path)
    doc = document(res, "lab.doctor/1")
    assert res.returncode == (0 if doc["ok"] else 1) and doc["accel"] in ("kvm", "tcg", None)
    assert {"qemu-system-x86_64", "kvm", "netns", "images", "config"} <= {c["name"] for c in doc["checks"]}
    assert all(c["status"] in ("ok", "warn", "fail") and c["ok"] == (c["status"] != "fail") for c in doc["checks"])


def _leftover(name: str) -> None:
    fake.LIVE[name] = Vm(spec=None, backend="fake", handle={"name": name, "cell_id": "c01"})  # type: ignore[arg-type]


def test_gc_json_dry_run_then_real(fake_lab):
    fake_lab.write()
    _leftover("lab-dead1-c01")
    _leftover("lab-live1-c01")
    fake.JOURNAL.append(("open_run", "live1"))  # a run still going: its VM stays
    res = lab_cli("gc", "--dry-run", "--json", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    assert res.returncode == 0, res.stderr
    doc = document(res, "lab.gc/1")
    assert (doc["dry_run"], doc["ok"], doc["removed"], doc["kept"], doc["errors"]) == (True, True, 1, 1, [])
    assert doc["items"] == [
        {"action": "would-remove", "host": "f", "kind": "vm", "name": "lab-dead1-c01", "run_id": "dead1", "reason": ""},
        {
            "action": "keep",
            "host": "f",
            "kind": "vm",
            "name": "lab-live1-c01",
            "run_id": "live1",
            "reason": "run live1 is live",
        },
    ]
    assert set(fake.LIVE) == {"lab-dead1-c01", "lab-live1-c01"}  # a dry run removes nothing
    doc = document(lab_cli("gc", "--json", "-c", str(fake_lab.path), cwd=fake_lab.dir), "lab.gc/1")
    assert doc["dry_run"] is False and [(i["action"], i["name"]) for i in doc["items"]] == [
        ("removed", "lab-dead1-c01"),
        ("keep", "lab-live1-c01"),
    ]
    assert set(fake.LIVE) == {"lab-live1-c01"} and doc["marked_failed"] == []


def test_gc_json_errors_are_in_the_document_and_exit_1(fake_lab):
    fake_lab.write(host='unlisted = ["zfs datasets"]')
    res = lab_cli("gc", "--json", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    doc = document(res, "lab.gc/1")
    assert res.returncode == 1 and doc["ok"] is False and doc["errors"] == ["f: not checked: zfs datasets"]
    assert len(res.stderr.strip().splitlines()) == 1 and "zfs datasets" in res.stderr


# -- the reading commands' documents: show, compare (selections and --baseline), snapshot, images ls


def test_show_and_compare_json_carry_their_schema(fake_lab):
    fake_lab.write(matrix='nic = ["virtio", "e1000"]')
    cfg = fake_lab.load()
    rid = runner.run_lab(cfg, Store(cfg.results_dir), run_id="r1")
    at = ("-c", str(fake_lab.path))
    shown = document(lab_cli("show", rid, "--json", *at, cwd=fake_lab.dir), "lab.show/1")
    assert shown["run"]["id"] == rid and len(shown["cells"]) == 2 and len(shown["samples"]) == 8
    cmp = document(
        lab_cli("compare", rid, "--a", "nic=virtio", "--b", "nic=e1000", "--json", *at, cwd=fake_lab.dir),
        "lab.compare/2",
    )
    assert cmp["a"] == {"run": rid, "selector": {"nic": "virtio"}} and cmp["rows"]
    assert set(cmp) >= {"b", "host_differences", "host_load", "alpha", "margin_pct", "primary_rows", "families"}
    ops = next(r for r in cmp["rows"] if r["key"][2] == "ops_per_s")  # fake-work's primary metric
    assert ops["primary"] is True and ops["verdict"] in ("better", "worse", "same", "unknown", "not enough samples")
    assert set(ops) >= {"p_value", "q_value", "effect", "margin", "equivalence_ci"}
    over = document(
        lab_cli("compare", rid, "--baseline", "nic=virtio", "--json", *at, cwd=fake_lab.dir), "lab.compare.baseline/2"
    )
    assert over["run"] == rid and over["selector"] == {"nic": "virtio"} and over["rows"]
    assert all("change_pct" in r and "baseline" in r for r in over["rows"])


def test_snapshot_json_carries_its_schema(tmp_path):
    (tmp_path / "lab.toml").write_text(f'[lab]\nresults = "{tmp_path / "results"}"\n')
    doc = document(lab_cli("snapshot", "local", "-c", str(tmp_path / "lab.toml"), "--json"), "lab.snapshot/1")
    assert doc["stored_id"] == 1 and len(doc["fingerprint"]) == 16 and doc["cpu_model"]


def test_images_ls_json_carries_its_schema():
    doc = document(lab_cli("images", "ls", "--json"), "lab.images/1")
    assert [i["name"] for i in doc["images"]] == sorted(images.RECIPES)
    assert all({"state", "recipe_digest", "os"} <= set(i) for i in doc["images"])
