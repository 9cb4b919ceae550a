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
