"""Bad CLI invocations that reach the local backend's checks of its workdir and state directory
before they fail, as root (tests/unit/test_bad_input.py has the rest): exit 2, one line, nothing
created."""

from __future__ import annotations

import pytest
from support import badinput

# (id, argv, expected fragment of the one line, lab.toml variant)
CASES = [
    pytest.param(
        "run-workdir-group-writable",
        ["run"],
        "is writable by its group",
        "local-open-workdir",
        marks=[pytest.mark.root],
    ),
    pytest.param(
        "run-state-dir-symlink", ["run"], "is a symbolic link", "local-state-symlink", marks=[pytest.mark.root]
    ),
    pytest.param(
        "run-state-dir-someone-elses", ["run"], "is owned by nobody", "local-state-nobody", marks=[pytest.mark.root]
    ),
]


@pytest.fixture
def place(tmp_path):
    return badinput.make_place(tmp_path)


@pytest.mark.parametrize("argv,fragment,variant", [badinput.param(c) for c in CASES])
def test_bad_invocation_exit_2_one_line_nothing_created(place, argv, fragment, variant, request):
    badinput.check(place, argv, fragment, variant, request)
