"""Bad CLI invocations that reach the local backend's checks and the golden image before they can
fail (a resume of an unknown or ambiguous run), as root; their twins on the fake backend are in
tests/unit/test_bad_input.py: exit 2, one line, nothing created."""

from __future__ import annotations

import pytest
from support import badinput

# (id, argv, expected fragment of the one line, lab.toml variant)
CASES = [
    pytest.param(
        "resume-unknown-run",
        ["run", "--resume", "nope"],
        "no run 'nope'",
        "local",
        marks=[pytest.mark.root, pytest.mark.image],
    ),
    pytest.param(
        "resume-ambiguous",
        ["run", "--resume", "r"],
        "is ambiguous",
        "local",
        marks=[pytest.mark.root, pytest.mark.image],
    ),
]


@pytest.fixture
def place(tmp_path):
    return badinput.make_place(tmp_path)


@pytest.mark.parametrize("argv,fragment,variant", [badinput.param(c) for c in CASES])
def test_bad_invocation_exit_2_one_line_nothing_created(place, argv, fragment, variant, request):
    badinput.check(place, argv, fragment, variant, request)
