"""podman-build's figures as the real-VM tests check them: one engine and network's whole build and
each of its steps, all measured (no n/a), the steps within the whole."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# the Containerfile's steps and the commit, as podman-build names its metrics (<step>_seconds_<tag>)
STEPS = ("from", "packages", "clone", "make", "install", "copy", "extra", "commit")


def checked_build(by_metric: Mapping[str, Any], tag: str) -> dict[str, float]:
    """Each step's seconds and the whole build's ("build") for `tag` (<engine>-<network>), checked:
    every step a figure, the make step above 0, no n/a row, the steps after `from` within the build."""
    got = {s: by_metric[f"{s}_seconds_{tag}"].value for s in STEPS}
    build = by_metric[f"build_seconds_{tag}"].value
    assert all(v >= 0 for v in got.values()) and got["make"] > 0, (tag, got)
    assert f"na_{tag}" not in by_metric, tag
    assert build >= sum(got[s] for s in STEPS[1:]), (tag, build, got)
    return {**got, "build": build}
