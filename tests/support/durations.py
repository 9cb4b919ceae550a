"""A plugin (tests/conftest.py loads it): run the longest tests first, by the durations measured in
the last run, kept in tests/durations.json.

Ordering: each worker takes the next test when it is almost out of work, so a pass that starts with
its longest work ends on short tests, which even out the workers' last minutes, instead of on a
long VM test that leaves one core idle. The sort is stable; an xdist group weighs what its tests
add up to (make test passes --no-loadscope-reorder, which would put the groups with most tests
first). A test the file does not know counts as SECONDS_VM if it boots a VM, else 0.

Recording: with --update-durations (make test passes it), the process that prints the summary (the
xdist controller, which receives its workers' reports) sums each test's setup, call and teardown,
and at the end writes the file: the tests that ran and took at least MIN_SECONDS, merged with the
old values of those that did not run; a test that ran faster than that leaves the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.xdist_groups import group_of

FILE = Path(__file__).resolve().parent.parent / "durations.json"
SECONDS_VM = 60
MIN_SECONDS = 1.0


def pytest_addoption(parser):
    parser.addoption(
        "--update-durations",
        action="store_true",
        help=f"write the measured durations of the tests that ran to {FILE.name} (make test does)",
    )


def load(path: Path = FILE) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def plain_nodeid(nodeid: str) -> str:
    """The node id without the @group suffix xdist adds under --dist loadgroup."""
    return re.sub(r"@[\w.-]+$", "", nodeid)


def merged(old: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    """`old` with the tests that ran replaced by what they took (left out under MIN_SECONDS)."""
    out = {k: v for k, v in old.items() if k not in measured}
    out.update({k: round(v, 1) for k, v in measured.items() if v >= MIN_SECONDS})
    return dict(sorted(out.items()))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    known = load()

    def seconds(item) -> float:
        return known.get(plain_nodeid(item.nodeid), SECONDS_VM if item.get_closest_marker("vm") else 0)

    group = {item: group_of(item) for item in items}
    weight: dict[str, float] = {}
    for item in items:
        weight[group[item]] = weight.get(group[item], 0) + seconds(item)
    items.sort(key=lambda item: -(weight[group[item]] if group[item] else seconds(item)))


class Recorder:
    """What each test took (setup + call + teardown), written to FILE at the end of the session."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        nodeid = plain_nodeid(report.nodeid)
        if report.when == "setup":  # a rerun starts again from its setup
            self.seconds.pop(nodeid, None)
        if report.outcome == "skipped" and report.when != "teardown":
            self.seconds[nodeid] = float("-inf")  # did not run: keeps its old value
        else:
            self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self):
        ran = {k: v for k, v in self.seconds.items() if v >= 0}
        FILE.write_text(json.dumps(merged(load(), ran), indent=0) + "\n")


def pytest_configure(config):
    # the process that prints the summary records: xdist's controller (it receives the workers'
    # reports), or pytest itself without xdist
    if config.getoption("update_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Recorder(), "durations-recorder")
