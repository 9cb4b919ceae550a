"""`lab explain` end to end on the fake backend (tests/fakes): a parent run that measured only the two
corner cells, effects planted on the knobs (tests/fakes/effects.py: one strong main effect, one
interaction, every other knob null), the follow-up cells run by the runner as a child run, and
the explanation must name exactly the planted effects, for 2 to 6 knobs (a resolution-IV fraction
then the active knobs' factorial from 4 on). Also: --plan, --json, revert, resuming an interrupted
follow-up run, a parameter knob across two runs, and bad input (exit 2, nothing created)."""

from __future__ import annotations

import json
import textwrap

import fakes.backend as fake
import pytest
from fakes.effects import EffectsWorkload
from support.cli import lab_cli

from lab import config, runner, workloads
from lab.explain import record as rec
from lab.lifecycle import Interrupted
from lab.store import Store

# knob -> (A's value, B's value) as lab.toml writes them; tests/fakes/effects.AT_B reads them back
KNOBS = {
    "wan": ('"none"', '"cap"'),
    "nic": ('"virtio"', '"e1000"'),
    "vcpus": ("2", "4"),
    "memory_mib": ("1024", "2048"),
    "offloads": ('"default"', '"lro=off"'),
    "tuning": ('"default"', '"wan-16m"'),
}
ORDER = list(KNOBS)


@pytest.fixture
def effects_lab(fake_lab):
    wl = EffectsWorkload()
    workloads.register(wl)
    yield fake_lab
    workloads.unregister(wl.name)


def corners_lab(lab, knobs, *, params="", host="", suite="repetitions = 3", name="fx"):
    """A lab whose matrix holds every knob's two values, excluding all but the two corners."""
    first = knobs[0]
    a0, b0 = KNOBS[first]
    excludes = []
    for k in knobs[1:]:
        a, b = KNOBS[k]
        excludes += [f"{{ {first} = {a0}, {k} = {b} }}", f"{{ {first} = {b0}, {k} = {a} }}"]
    matrix = "".join(f"{k} = [{KNOBS[k][0]}, {KNOBS[k][1]}]\n" for k in knobs) + f"exclude = [{', '.join(excludes)}]\n"
    return lab.write(
        matrix=matrix,
        suite=f'workloads = ["fake-effects"]\nwarmup = 0\n{suite}\n[suite.params.fake-effects]\n{params}',
        host=host,
        extra="[wan.cap]\nrate_mbit = 20\n",
        name=name,
    )


PLANTED = 'main = { wan = 0.2 }\npair = ["wan", "nic"]\npair_ratio = 0.5\n'


def parent_run(lab, knobs, **kw):
    path = corners_lab(lab, knobs, **kw)
    cfg = config.load(path)
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store, config_text=path.read_text())
    assert [c.status for c in store.cells(rid)] == ["done", "done"]
    return store, rid


def sel(knobs, side):
    return ",".join(f"{k}={KNOBS[k][side].strip(chr(34))}" for k in knobs[:1])


def explain(lab, *args):
    return lab_cli("explain", *args, "--results", str(lab.dir / "results"), cwd=lab.dir)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_planted_effects_are_recovered(effects_lab, k):
    knobs = ORDER[:k]
    store, rid = parent_run(effects_lab, knobs, params=PLANTED)
    res = explain(effects_lab, rid, "--a", sel(knobs, 0), "--b", sel(knobs, 1), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "lab.explain/1"
    (m,) = doc["metrics"]
    verdict = {x["name"]: x["verdict"] for x in m["knobs"]}
    # the strong knob and the one whose effect depends on it matter; every other does not (or is unknown)
    assert verdict["wan"] == "matters" and verdict["nic"] == "matters", verdict
    assert all(v != "matters" for n, v in verdict.items() if n not in ("wan", "nic")), verdict
    assert m["top"] == "wan"
    share = {x["name"]: x["share_of_gap"] for x in m["knobs"]}
    assert share["wan"] == max(share.values()) and share["wan"] > 0.6
    effect = {x["name"]: x["effect_ratio"] for x in m["knobs"]}
    assert 0.17 < effect["wan"] < 0.35 and 0.6 < effect["nic"] < 0.8, effect
    named = [x for x in m["interactions"] if x["verdict"] == "matters"]
    assert [x["knobs"] for x in named] == [["wan", "nic"]], m["interactions"]
    assert 0.4 < named[0]["effect_at_a"] < 0.6 and 0.9 < named[0]["effect_at_b"] < 1.1
    kinds = [p["kind"] for p in doc["design"]["phases"]]
    if k <= 3:
        assert kinds[0] == "factorial" and doc["design"]["cells"] == 2**k
    else:  # the fraction, then the full factorial of the two knobs found to matter
        assert kinds[0] == "screening" and "active" in kinds
        active = next(p for p in doc["design"]["phases"] if p["kind"] == "active")
        assert {doc["knobs"][i]["name"] for i in active["active"]} == {"wan", "nic"}
        assert doc["design"]["cells"] < 2**k
    # the follow-up runs are children of the parent, and the parent's two cells were reused
    children = rec.follow_ups(store, store.run(rid))
    assert [r.id for r in children] == doc["runs"] and children
    corners = [c for c in doc["cells"] if set(c["levels"]) in ({0}, {1})]
    assert all(any(s["run"] == rid for s in c["sources"]) for c in corners)
    assert fake.LIVE == {}
    moved = {x["metric"]: x for x in m["moved_with_top"]}
    assert 0.45 < moved["cpu_busy_pct"]["ratio"] < 0.55  # planted to halve with wan


def test_table_show_and_asking_again_measures_nothing(effects_lab):
    knobs = ORDER[:2]
    store, rid = parent_run(effects_lab, knobs, params=PLANTED)
    res = explain(effects_lab, rid, "--a", "wan=none", "--b", "wan=cap")
    assert res.returncode == 0, res.stderr
    assert "knobs (2): nic virtio → e1000; wan none → cap" in res.stdout
    assert "interaction: nic (virtio → e1000): ×0.4" in res.stdout and "with wan cap" in res.stdout
    assert "moved with wan: cpu_busy_pct ×0.5" in res.stdout
    assert "cannot be tested here: nothing" in res.stdout
    (child,) = rec.follow_ups(store, store.run(rid))
    shown = lab_cli("show", child.id, "--results", str(effects_lab.dir / "results"))
    assert f"follow-up run of {rid} (lab explain:" in shown.stdout
    parent = lab_cli("show", rid, "--results", str(effects_lab.dir / "results"))
    assert f"follow-up runs (lab explain): {child.id}" in parent.stdout
    clones = len([e for e in fake.JOURNAL if e[0] == "clone"])
    again = explain(effects_lab, rid, "--a", "wan=none", "--b", "wan=cap")
    assert again.returncode == 0 and len([e for e in fake.JOURNAL if e[0] == "clone"]) == clones
    assert len(rec.follow_ups(store, store.run(rid))) == 1


def test_plan_prints_the_cells_and_runs_nothing(effects_lab):
    knobs = ORDER[:5]
    store, rid = parent_run(effects_lab, knobs, params=PLANTED)
    runs = len(store.runs())
    res = explain(effects_lab, rid, "--a", "wan=none", "--b", "wan=cap", "--plan", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "lab.explain.plan/1"
    assert doc["design"]["kind"] == "screening" and len(doc["cells"]) == 16
    assert doc["new_cells"] == 14 and doc["reused_cells"] == 2 and doc["full_factorial"] == 32
    assert doc["estimate_s"] is not None and doc["later"]
    text = explain(effects_lab, rid, "--a", "wan=none", "--b", "wan=cap", "--plan")
    assert "resolution IV fractional factorial of 5 knobs: 16 of 32 cells" in text.stdout
    assert "14 follow-up cells to measure, 2 already measured" in text.stdout
    assert len(store.runs()) == runs and not [e for e in fake.JOURNAL if e[0] == "clone" and rid not in e[1]]


def test_revert_puts_one_knob_back_at_a_time(effects_lab):
    knobs = ORDER[:3]
    store, rid = parent_run(effects_lab, knobs, params=PLANTED, suite="repetitions = 5")
    res = explain(effects_lab, rid, "--a", "wan=none", "--b", "wan=cap", "--method", "revert", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["design"]["phases"][0]["kind"] == "revert"
    assert doc["design"]["cells"] == 5  # B, three reverts, A
    verdict = {x["name"]: x["verdict"] for x in doc["metrics"][0]["knobs"]}
    # at B (wan capped) e1000 costs nothing: reverting nic does not matter there
    assert verdict["wan"] == "matters" and verdict["nic"] != "matters" and verdict["vcpus"] != "matters"
    assert doc["metrics"][0]["interactions"] == []


def test_an_interrupted_follow_up_run_is_continued(effects_lab, monkeypatch):
    knobs = ORDER[:2]
    store, rid = parent_run(effects_lab, knobs, params=PLANTED)
    real_start = fake.FakeBackend.start
    state = {"n": 0}

    def start_then_interrupt(self, vm):
        state["n"] += 1
        if state["n"] == 2:  # the second follow-up cell's boot: as SIGINT would
            raise Interrupted("SIGINT")
        return real_start(self, vm)

    monkeypatch.setattr(fake.FakeBackend, "start", start_then_interrupt)
    cut = explain(effects_lab, rid, "--a", "wan=none", "--b", "wan=cap")
    assert cut.returncode == 130
    (child,) = rec.follow_ups(store, store.run(rid))
    assert child.status == "interrupted" and fake.LIVE == {}
    done = {c.cell_id for c in store.cells(child.id) if c.status == "done"}
    assert len(done) == 1
    res = explain(effects_lab, rid, "--a", "wan=none", "--b", "wan=cap", "--json")
    assert res.returncode == 0, res.stderr
    assert [r.id for r in rec.follow_ups(store, store.run(rid))] == [child.id]  # the same run, resumed
    assert store.run(child.id).status == "done"
    assert {c.cell_id for c in store.cells(child.id) if c.status == "done"} >= done
    doc = json.loads(res.stdout)
    assert {x["name"]: x["verdict"] for x in doc["metrics"][0]["knobs"]}["wan"] == "matters"


def test_a_parameter_knob_across_two_runs_of_one_lab(effects_lab):
    """Two runs of one lab.toml, the second with a workload parameter changed (and a NIC): the
    parameter is a knob, measured in a follow-up run of its own value."""
    path = effects_lab.write(
        matrix='nic = ["virtio"]',
        suite='workloads = ["fake-effects"]\nwarmup = 0\nrepetitions = 4\n[suite.params.fake-effects]\nbase = 1000.0\n',
    )
    store = Store(config.load(path).results_dir)
    ra = runner.run_lab(config.load(path), store, config_text=path.read_text())
    text = path.read_text().replace("base = 1000.0", "base = 500.0").replace('nic = ["virtio"]', 'nic = ["e1000"]')
    path.write_text(text)
    rb = runner.run_lab(config.load(path), store, config_text=text)
    res = explain(effects_lab, ra, rb, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    knobs = {k["name"]: k for k in doc["knobs"]}
    assert set(knobs) == {"nic", "fake-effects.base"} and knobs["fake-effects.base"]["kind"] == "param"
    verdict = {x["name"]: x["verdict"] for x in doc["metrics"][0]["knobs"]}
    assert verdict == {"nic": "does not matter", "fake-effects.base": "matters"}, verdict
    assert len(doc["runs"]) == 2  # one follow-up run per parameter value


BAD = [
    (["--a", "wan=none", "--b", "wan=nope"], "--b wan=nope: no cell of run"),
    (["--a", "host=f", "--b", "wan=cap"], "--a host=f matches 2 cells of run"),
    (["--a", "wan=none", "--b", "nic=virtio"], "--a and --b select the same cell, c01"),
    (["--a", "wan=none"], "lab explain RUN needs --a and --b"),
    (["--a", "wan=none", "--b", "wan=cap", "--budget", "1"], "--budget 1 cells: the design needs 2 follow-up cells"),
    (["--a", "wan=none", "--b", "wan=cap", "--budget", "soon"], "--budget 'soon': expected a number of cells"),
    (["--a", "wan=none", "--b", "wan=cap", "--workload", "http"], "--workload http: not measured in both cells"),
    (["--a", "wan=none", "--b", "wan=cap", "--metric", "nope"], "--metric nope: not measured in both cells"),
    (["--a", "wan=none", "--b", "wan=cap", "--margin", "0"], "--margin 0: must be a percentage"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[b[1][:30] for b in BAD])
def test_bad_input_is_one_line_exit_2_nothing_created(effects_lab, args, message):
    store, rid = parent_run(effects_lab, ORDER[:2], params=PLANTED)
    runs, clones = len(store.runs()), len(fake.JOURNAL)
    res = explain(effects_lab, rid, *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert len(store.runs()) == runs and len(fake.JOURNAL) == clones


def test_a_knob_the_host_cannot_flip_is_refused(effects_lab):
    """Warm start on a host that keeps no memory snapshots (as Proxmox): one line naming the knob."""
    lab = effects_lab
    path = lab.write(
        matrix='start = ["cold", "warm"]\nnic = ["virtio", "e1000"]\n'
        'exclude = [{ start = "cold", nic = "e1000" }, { start = "warm", nic = "virtio" }]',
        suite='workloads = ["fake-effects"]\nwarmup = 0\nrepetitions = 3',
        host='warm = { "debian12-2c-1024m" = "x" }',
    )
    cfg = config.load(path)
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store, config_text=path.read_text())
    # the host no longer keeps snapshots (its lab.toml as stored in the run says so now)
    text = store.config_text(rid).replace('warm = { "debian12-2c-1024m" = "x" }', "")
    store.db.execute("UPDATE runs SET config_text = ? WHERE id = ?", (text, rid))
    runs = len(store.runs())
    res = explain(lab, rid, "--a", "start=cold", "--b", "start=warm")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "lab explain: knob start cold → warm cannot be tested here:" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and len(store.runs()) == runs


def test_a_and_b_of_one_configuration_in_effect(effects_lab):
    """cc = cubic on a guest whose default is cubic: not a knob; with nothing else, nothing to explain."""
    lab = effects_lab
    path = lab.write(
        matrix='cc = ["default", "cubic"]',
        suite='workloads = ["fake-effects"]\nwarmup = 0\nrepetitions = 3',
    )
    cfg = config.load(path)
    store = Store(cfg.results_dir)
    rid = runner.run_lab(cfg, store, config_text=textwrap.dedent(path.read_text()))
    res = explain(lab, rid, "--a", "cc=default", "--b", "cc=cubic")
    assert res.returncode == 2
    assert "is a duplicate of c01" in res.stderr  # the runner already recorded it as one


def test_the_report_has_an_explain_section_that_chromium_renders(effects_lab, tmp_path):
    from support.chromium import chromium_render
    from test_report import _Dom

    from lab import report

    knobs = ORDER[:3]
    store, rid = parent_run(effects_lab, knobs, params=PLANTED)
    assert explain(effects_lab, rid, "--a", "wan=none", "--b", "wan=cap").returncode == 0
    (child,) = rec.follow_ups(store, store.run(rid))
    for run_id in (rid, child.id):  # the parent's report and the follow-up run's both show it
        html = report.render(store, run_id)
        assert 'id="explain"' in html and "Explain: which knob makes the difference" in html
        assert "each knob" in html
        assert '<tr class="worse"><td class="mono">wan</td>' in html
        assert "Interaction:</strong> nic (virtio → e1000)" in html
    page = report.write(store, rid, None, tmp_path / "report.html")
    dom_text, console = chromium_render(page, tmp_path / "shot.png", tmp_path / "profile")
    assert not console, console
    dom = _Dom()
    dom.feed(dom_text)
    assert "explain" in dom.ids and f"explain-{rec.of_run(store, store.run(rid))[0].question_id}" in dom.ids
    assert dom.svg_in_figure == dom.count.get("figure")  # every chart, the explain one too, is an <svg>
    assert dom.count.get("script", 0) == 0
