"""What a name may be, one rule per kind of name: a host, a run id, a cell id, a profile.

Names go into places with rules of their own: a lane's name ("pve1/2", "pve1@node"), a cell's
label ("pve1/debian12/virtio"), file and directory names (run locks, `lab-<run>-<cell>`), network
namespace and libvirt domain names, a Vagrantfile (Ruby), shell scripts, ssh's command line, and
the terminal. Rather than escaping a name for each of them, each kind has one pattern that is
safe in all of them (letters, digits and a few marks, none that means anything to a shell, Ruby, a
path, a label or an option parser), checked once where the name comes in (lab.toml, the command
line, a results store), with one line naming where it came from and the value.

A run id has no "-": the names made of it (`lab-<run>-<cell>`, namespace `lab-<run>`) are split on
"-" to find their run, and run `nightly` must never take `nightly-1`'s machines for its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    what: str  # "host name", "run id", ...
    pattern: re.Pattern[str]
    rule: str  # what the pattern allows, in words

    def problem(self, value: object) -> str | None:
        """Why `value` is not a usable name of this kind (None: it is one)."""
        if not isinstance(value, str):
            return f"is not a {self.what} (a string: {self.rule})"
        if not self.pattern.fullmatch(value):
            return f"is not a usable {self.what}: {self.rule}"
        return None

    def valid(self, value: object) -> bool:
        return self.problem(value) is None


HOST = Kind(
    "host name",
    re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}"),
    "1-40 letters, digits, '_', '.' or '-', starting with a letter or digit (no '/', '@', spaces or quotes)",
)
RUN_ID = Kind("run id", re.compile(r"[a-z0-9]{1,16}"), "1-16 lower-case letters or digits (no '-')")
# a run id in a results store: runs made before run ids lost their "-" may have one (they are read,
# shown and reproduced, never resumed: their machines' names would be ambiguous)
STORED_RUN_ID = Kind("run id", re.compile(r"[a-z0-9][a-z0-9-]{0,15}"), "1-16 lower-case letters, digits or '-'")
# c01, c01-aa (an A/A twin), bm01 (bare metal): lab.plan makes them
CELL_ID = Kind("cell id", re.compile(r"(?:c|bm)\d{2,4}(?:-aa)?"), "c01, c01-aa or bm01 as lab.plan makes them")
# [wan.NAME] profiles, tuning profiles, congestion-control algorithms
PROFILE = Kind("profile name", re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"), "letters, digits, '_', '.' or '-'")
CC = Kind("congestion-control name", re.compile(r"[a-z0-9_]{1,32}"), "lower-case letters, digits or '_'")
DIGEST = Kind("digest", re.compile(r"[0-9a-f]{12,128}"), "lower-case hexadecimal")

# What the names lab gives machines are made of: `lab-<run>-<what>` where <what> is a cell id, a
# client VM (client1), a warm template (w + 8 hex digits) or a boot benchmark's VM (b001).
MACHINE_PART = r"(?:c|bm)\d{2,4}(?:-aa)?|client\d+|w[0-9a-f]{8}|b\d{3}"
MACHINE = re.compile(rf"lab-(?P<run>{RUN_ID.pattern.pattern})-(?P<part>{MACHINE_PART})")
NETNS = re.compile(rf"lab-(?P<run>{RUN_ID.pattern.pattern})(?:-bm\d{{2,4}})?")


def run_of_machine(name: str) -> str:
    """The run id in a machine's name `lab-<run>-<cell>` ("" when the name is not of that shape:
    not the lab's, or a run of an id this rule does not allow, whose run cannot be told)."""
    m = MACHINE.fullmatch(name)
    return m.group("run") if m else ""


def run_of_netns(name: str) -> str:
    """The run id of a run's namespace `lab-<run>` or a bare-metal cell's `lab-<run>-bm01` ("" as above)."""
    m = NETNS.fullmatch(name)
    return m.group("run") if m else ""
