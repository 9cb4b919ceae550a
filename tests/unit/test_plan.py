from lab import config, plan


def cfg(**matrix):
    return config.LabConfig.model_validate({"matrix": matrix})


def test_product_and_stable_ids():
    c = cfg(nic=["virtio", "e1000"], vcpus=[1, 2], tuning=["default"])
    cells = plan.cells(c)
    assert [x.id for x in cells] == ["c01", "c02", "c03", "c04"]
    assert [(x.nic.value, x.vcpus) for x in cells] == [("virtio", 1), ("virtio", 2), ("e1000", 1), ("e1000", 2)]
    assert cells[0].label == "local/debian12/virtio/1c/1024m/virtio/linked/default"


def test_exclude_keeps_indexes_stable():
    c = cfg(nic=["virtio", "e1000"], vcpus=[1, 2], exclude=[{"nic": "e1000", "vcpus": 1}])
    cells = plan.cells(c)
    assert [x.id for x in cells] == ["c01", "c02", "c04"]


def test_random_order_is_replayable_by_seed():
    c = cfg(nic=["virtio", "e1000"], vcpus=[1, 2, 4])
    cells = plan.cells(c)
    a = plan.order(cells, "random", 42)
    assert a == plan.order(cells, "random", 42)
    assert sorted(a, key=lambda x: x.index) == cells
    assert any(plan.order(cells, "random", s) != cells for s in range(5))
    assert plan.order(cells, "sequential", 1) == cells


def test_the_axes_table_drives_the_matrix_the_cell_and_the_columns():
    from lab import axes
    from lab.labconfig import MatrixSection

    assert list(MatrixSection.model_fields) == [*axes.AXES, "exclude"]
    assert [f for f in plan.Cell.__dataclass_fields__] == ["index", *axes.AXES, "replica"]
    c = config.parse(
        {
            "wan": {"rtt50": {"delay_ms": 50}},
            "matrix": {"cc": ["default", "bbr"], "offloads": ["lro=off"], "wan": ["rtt50"]},
        }
    )
    cells = plan.cells(c)
    # labels are byte-identical to the ones stored before the table existed
    assert cells[0].label == "local/debian12/virtio/2c/1024m/virtio/linked/default/offloads=lro=off/wan=rtt50"
    assert cells[1].label == "local/debian12/virtio/2c/1024m/virtio/linked/default/cc=bbr/offloads=lro=off/wan=rtt50"
    assert [a.column for a in axes.shown_columns(c.matrix)] == [
        "host",
        "image",
        "nic",
        "vcpus",
        "memory",
        "disk",
        "clone",
        "tuning",
        "cc",
        "offloads",
        "wan",
    ]
    assert [a.column for a in axes.shown_columns(cfg().matrix)][-1] == "tuning"  # unset optional axes: no column
    assert cells[0].machine() == ("local", "debian12", "virtio", 2, 1024, "virtio", "linked", "cold", "vm", "podman", 1)
    spec = plan.vm_spec(cells[0], _image(), run_id="r")
    assert (spec.name, spec.nic, spec.vcpus, spec.memory_mib) == ("lab-r-c01", cells[0].nic, 2, 1024)


def _image():
    from pathlib import Path

    from lab.model import ImageRef

    return ImageRef("debian12", "debian", Path("/x"), "d")


def test_exclude_may_name_an_optional_axis_at_its_default():
    c = cfg(cc=["default", "bbr"], nic=["virtio", "e1000"], exclude=[{"cc": "default", "nic": "e1000"}])
    assert [x.id for x in plan.cells(c)] == ["c01", "c02", "c04"]


def test_the_comparisons_a_run_will_be_asked():
    cfg = config.parse({"matrix": {"nic": ["virtio", "e1000"], "vcpus": [1, 2]}, "suite": {"noise_floor": True}})
    units = plan.units(cfg)
    # c01 virtio/1, c02 virtio/2, c03 e1000/1, c04 e1000/2: pairs differ in one axis; no twin, no diagonal
    assert plan.comparison_pairs(units) == [("c01", "c02"), ("c01", "c03"), ("c02", "c04"), ("c03", "c04")]


def test_verdict_reach_counts_the_primary_rows_a_comparison_corrects_for():
    cfg = config.parse(
        {"matrix": {"nic": ["virtio", "e1000"]}, "suite": {"workloads": ["container-start"], "repetitions": 5}}
    )
    units = plan.units(cfg)
    rows = plan.primary_rows(cfg)
    assert rows == 12  # 2 runtimes x 3 networks x 2 stores: one start time each
    ok, text = plan.verdict_reach(units, 5, rows=rows, setting="suite.repetitions = 5")
    assert not ok
    assert text.startswith(
        "suite.repetitions = 5: nic virtio vs e1000: one changed primary row among the 12 a comparison tests "
        "reaches q = 0.095 at best after correction, never < 0.05"
    )
    assert "repetitions = 6 lets one alone reach 0.026" in text and '"same" within ±7.5 %' in text
    ok, text = plan.verdict_reach(units, 6, rows=rows, setting="suite.repetitions = 6")
    assert ok and "reaches q = 0.026" in text
    ok, text = plan.verdict_reach(units, 3, rows=rows, setting="suite.repetitions = 3")
    assert not ok and "can reach p = 0.1 at best" in text
    one_cell = config.parse({"suite": {"workloads": ["container-start"]}})
    assert plan.verdict_reach(plan.units(one_cell), 5, rows=12, setting="x") == (True, "")
