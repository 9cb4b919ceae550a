"""How many cells `lab explain` needs against the full factorial, for 4 to 8 knobs.

`python -m lab.explain.bench` (and `make bench`): for each k, a seeded simulation of the whole
explanation (the phases of lab.explain.design.next_design, each point's samples drawn from a
planted model, each phase judged by lab.explain.effects as `lab explain` judges it): one strong
knob (x0.2), one whose x0.5 holds only while the strong one is at A's value (an interaction), the
others null; n = 3 per cell, CV 3 %. Printed per k: the cells the first design needs, the active
knobs' factorial, the cells measured again while a knob was unknown, the total beside 2^k, and
whether the planted knobs and only they came out "matters". Pure CPU: no VM, no store.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from lab import verdicts
from lab.explain import design, effects

STRONG, WEAK, N, CV = 0.2, 0.5, 3, 0.03


def draw(levels: design.Levels, rng: np.random.Generator, n: int = N, cv: float = CV) -> tuple[float, ...]:
    value = 1000.0 * (STRONG if levels[0] else 1.0) * (WEAK if levels[1] and not levels[0] else 1.0)
    return tuple(value * np.exp(rng.normal(0.0, cv, n)))


def simulate(k: int, seed: int, *, max_rounds: int = 2, n_resamples: int = 999) -> dict:
    """One explanation of k knobs on planted data: cells per phase and what it found."""
    rng = np.random.default_rng(seed)
    points: list[effects.Point] = [effects.Point(lv, draw(lv, rng)) for lv in design.corners(k)]
    phases: list[tuple[str, list[design.Levels]]] = []
    measured: dict[str, int] = {}
    found: tuple[list[effects.KnobEffect], list[effects.Interaction]] = ([], [])
    stuck: list[int] = []
    mattering: list[int] = []
    while True:
        d = design.next_design(k, "factorial", phases, stuck=stuck, mattering=mattering, max_rounds=max_rounds)
        if d is None:
            break
        have = {p.levels for p in points}
        new = [lv for lv in d.points if d.kind == "more" or lv not in have]
        points += [effects.Point(lv, draw(lv, rng)) for lv in new]
        measured[d.kind] = measured.get(d.kind, 0) + len(new)
        phases.append((d.kind, list(d.points)))
        kinds = [kind for kind, _ in phases]
        act = next(
            (sorted({j for lv in pts for j in range(k) if lv[j]}) for kind, pts in phases if kind == "active"), []
        )
        pairs = design.interactions_estimable(kinds, k, act)
        est = effects.estimate(k, points, pairs=pairs, seed=seed, n_resamples=n_resamples)
        ((knobs, inter, _),) = effects.judge([est], higher_is_better=[True], margins=[verdicts.Margin.stated()])
        found = (knobs, inter)
        stuck = sorted(x.knob for x in knobs if not x.answer.decided and x.evidence is not None)
        mattering = [x.knob for x in knobs if x.answer.differs]
    knobs, inter = found
    right = mattering == [0, 1] and [(x.first, x.second) for x in inter if x.answer.differs] == [(0, 1)]
    return {"measured": measured, "total": sum(measured.values()), "right": right}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="seeded simulations per k (default 20)")
    args = parser.parse_args(argv)
    print(f"lab explain: follow-up cells needed beyond the two corners ({args.trials} seeded trials per k,")
    print(f"one strong knob x{STRONG}, one x{WEAK} only while the strong one is at A, n = {N}, CV {CV:.0%})")
    heads = (("k", 2), ("first design", 12), ("active", 6), ("again", 5), ("total", 5), ("2^k - 2", 7))
    print("  ".join(f"{h:>{w}}" for h, w in (*heads, ("saved", 5), ("right", 5))))
    started = time.process_time()
    for k in range(4, 9):
        runs = [simulate(k, seed) for seed in range(args.trials)]
        first = _median([r["measured"].get("screening", 0) for r in runs])
        act = _median([r["measured"].get("active", 0) for r in runs])
        again = _median([r["measured"].get("more", 0) for r in runs])
        total = _median([r["total"] for r in runs])
        full = 2**k - 2
        right = sum(r["right"] for r in runs)
        print(
            f"{k:>2}  {first:>12.0f}  {act:>6.0f}  {again:>5.0f}  {total:>5.0f}  {full:>7}  "
            f"{1 - total / full:>5.0%}  {right:>2}/{len(runs)}"
        )
    print("(medians over the trials; first design = the resolution IV fraction less its two corners;")
    print(f" again = cells measured once more while a knob was unknown; {time.process_time() - started:.1f} s of CPU)")


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else math.nan


if __name__ == "__main__":
    main()
