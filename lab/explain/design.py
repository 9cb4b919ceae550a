"""Pure: which follow-up cells answer "which of these k knobs makes the difference".

A point is a tuple of levels, one per knob: 0 is the knob's value in cell A, 1 its value in B.
(0, ..., 0) is cell A itself and (1, ..., 1) is cell B: the two corners a run already measured.

- k <= 3: the full 2^k factorial (at most 8 points, 6 of them new): every main effect and every
  two-knob interaction can be estimated.
- k > 3: a two-level fractional factorial of resolution IV (pyDOE's `fracfact_by_res`: no
  hand-written generators or alias tables): main effects are not aliased with two-knob
  interactions, so each knob's effect is clear of the others' pairs; 8 points for 4 knobs, 16 for
  5 to 8, 32 for 9 to 16. Then ("active") the full factorial of the knobs found to matter, every
  other knob at A's value, which gives their interactions (DOE screening: Yilmaz and Schmidt's
  14 options in 32 runs, then a full factorial of the 2 that mattered).
- "revert": B, then B with one knob put back to A's value at a time (run-perf's bisecter): k
  new cells, each knob's effect where B stands, no interactions. The cheap mode.

Every regular resolution-IV design pyDOE builds for 4 to 16 factors holds both corners (its
defining words are of even length), so the parent's two cells are points of the design too.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

Levels = tuple[int, ...]  # per knob: 0 = A's value, 1 = B's

FULL_UP_TO = 3  # knobs: up to here the full factorial; above, the fractional one first
MAX_KNOBS = 16  # a resolution-IV design of 32 runs carries 16 factors; more knobs than that: --method revert
METHODS = ("factorial", "revert")


@dataclass(frozen=True)
class Design:
    kind: str  # factorial | screening | revert | active | more
    k: int
    points: tuple[Levels, ...]
    note: str  # what it is, in words

    def as_dict(self) -> dict:
        return {"kind": self.kind, "k": self.k, "points": [list(p) for p in self.points], "note": self.note}


def corners(k: int) -> tuple[Levels, Levels]:
    return (0,) * k, (1,) * k


def factorial(k: int) -> Design:
    """Every combination of the k knobs' two values, A's first."""
    points = tuple(itertools.product((0, 1), repeat=k))
    return Design("factorial", k, points, f"full factorial of {k} knob{'s' if k != 1 else ''}: {len(points)} cells")


@functools.cache
def screening(k: int) -> Design:
    """The smallest regular two-level design of resolution IV (or better) for k knobs."""
    from pydoe import fracfact_by_res  # imported on first use: numpy work only an explain needs

    matrix = fracfact_by_res(k, 4)
    points = tuple(sorted({tuple(int(v > 0) for v in row) for row in matrix}))
    return Design(
        "screening",
        k,
        points,
        f"resolution IV fractional factorial of {k} knobs: {len(points)} of {2**k} cells",
    )


def revert(k: int) -> Design:
    """B, B with knob j back at A's value (each j), and A."""
    lo, hi = corners(k)
    points = (hi, *(tuple(0 if i == j else 1 for i in range(k)) for j in range(k)), lo)
    return Design("revert", k, tuple(dict.fromkeys(points)), f"B with one of {k} knobs reverted to A at a time")


def first(k: int, method: str = "factorial") -> Design:
    """The first design of an explanation: see the module docstring."""
    if k < 1:
        raise ValueError("no knob to design for")
    if method == "revert":
        return revert(k)
    if method != "factorial":
        raise ValueError(f"unknown method {method!r}; methods: {', '.join(METHODS)}")
    if k > MAX_KNOBS:
        raise ValueError(f"{k} knobs: a factorial design carries at most {MAX_KNOBS}; use --method revert")
    return factorial(k) if k <= FULL_UP_TO else screening(k)


def active(k: int, knobs: list[int]) -> Design:
    """The full factorial of the knobs found active (indices), every other knob at A's value."""
    points = []
    for combo in itertools.product((0, 1), repeat=len(knobs)):
        levels = [0] * k
        for j, v in zip(knobs, combo, strict=True):
            levels[j] = v
        points.append(tuple(levels))
    return Design("active", k, tuple(points), f"full factorial of the {len(knobs)} active knob(s): {len(points)} cells")


def more(k: int, method: str, phases: list[tuple[str, list[Levels]]], stuck: list[int]) -> Design:
    """Another round of the points that decide the knobs still unknown (`stuck`): in a factorial
    design every point of each phase in which one of them takes both values; reverted, B and
    their reverts. `phases`: (kind, points) of the phases so far."""
    if method == "revert":
        points = [(1,) * k] + [tuple(0 if i == j else 1 for i in range(k)) for j in stuck]
    else:
        points = []
        for kind, pts in phases:
            if kind != "more" and any(len({lv[j] for lv in pts}) == 2 for j in stuck):
                points += [lv for lv in pts if lv not in points]
    return Design("more", k, tuple(points), f"{len(points)} cells again: knob(s) {stuck} still unknown")


def next_design(
    k: int,
    method: str,
    phases: list[tuple[str, list[Levels]]],
    *,
    stuck: list[int],
    mattering: list[int],
    max_rounds: int,
) -> Design | None:
    """What to measure after the phases so far (None: done): the first design; while a knob's
    main effect is unknown, another round of the points that decide it (at most `max_rounds` in
    all); after a fraction, the full factorial of the knobs that matter."""
    if not phases:
        return first(k, method)
    kinds = [kind for kind, _ in phases]
    if stuck and kinds.count("more") < max_rounds:
        d = more(k, method, phases, stuck)
        if d.points:
            return d
    if "screening" in kinds and "active" not in kinds and mattering:
        return active(k, mattering)
    return None


def interactions_estimable(design_kinds: list[str], k: int, active_knobs: list[int]) -> list[tuple[int, int]]:
    """The knob pairs whose interaction the points measured so far can tell apart: every pair of a
    full factorial; after a screening, only pairs of the active knobs' full factorial (in a
    resolution-IV design the pairs are aliased with each other)."""
    if "factorial" in design_kinds:
        return list(itertools.combinations(range(k), 2))
    if "active" in design_kinds:
        return list(itertools.combinations(sorted(active_knobs), 2))
    return []


def cells_needed(k: int, active_count: int, method: str = "factorial") -> dict[str, int]:
    """How many cells an explanation of k knobs needs, beyond the two corners, when
    `active_count` of them turn out to matter (the benchmark's figures): the first design, the
    active knobs' factorial (its points not already in the first design), and the full factorial."""
    d = first(k, method)
    seen = set(d.points) | set(corners(k))
    extra = 0
    if d.kind == "screening" and active_count:
        extra = len(set(active(k, list(range(active_count))).points) - seen)
    return {
        "first": len(set(d.points) - set(corners(k))),
        "active": extra,
        "total": len(set(d.points) - set(corners(k))) + extra,
        "full_factorial": 2**k - 2,
    }
