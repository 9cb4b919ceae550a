"""A plugin (tests/conftest.py loads it): fail every grouped test, with the reason, when xdist
does not keep an `xdist_group` on one worker.

Under `--dist loadgroup` (make test), xdist keeps the tests of one `xdist_group` on one worker by
a suffix it adds to their node ids after collection. pytest 9.2 ignores that suffix
(pytest-xdist#1386): the groups are then scattered (vagrant-libvirt's global network and box store
used from two workers, the four-lane tests' ten guests at once). Every grouped test then fails with
the reason instead of flaking."""

from __future__ import annotations

import pytest

GROUPS_SCATTERED = pytest.StashKey[str]()


def group_of(item) -> str:
    """The item's xdist group as xdist names it ("a_b" for two; "" for none)."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under loadgroup only
        return
    for item in items:
        group = group_of(item)
        if group and not item.nodeid.endswith("@" + group):
            config.stash[GROUPS_SCATTERED] = (
                f"pytest {pytest.__version__} with this pytest-xdist ignores xdist_group: tests sharing "
                "a daemon would run on two workers; install pytest<9.2 (pyproject.toml, pytest-xdist#1386)"
            )
            return


def pytest_runtest_setup(item):
    reason = item.config.stash.get(GROUPS_SCATTERED, None)
    if reason and item.get_closest_marker("xdist_group"):
        pytest.fail(reason, pytrace=False)
