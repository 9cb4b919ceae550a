"""Pure: the change points of one series of run medians (`lab history`, lab.history).

How, after what the peers learned (research/explain-and-history.md: Otava/Hunter, Chromeperf, Orion):

- Candidates: ruptures' PELT (KernelCPD), an exact penalised segmentation (deterministic: no
  permutations, no random restarts), with a least-squares cost over the logarithm of the medians (a change is a
  ratio, whatever the metric's scale), scaled by a robust first guess of the run-to-run noise (the
  median absolute successive difference, which a step moves only once), a penalty of PENALTY x ln n
  per change, and at least `min_runs` runs in every segment.
- Each candidate is then judged against the segments either side of it. Its size is the ratio of
  the segments' geometric means, minus 1. The noise it must stand out from is the series' own A/A
  noise: how far runs of the same configuration on the same host stray from their segment's mean
  (the pooled residual, n - k - 1 degrees of freedom). A change is kept when its t test gives p <
  `alpha` *and* its size is at least `min_effect_noise` times that noise *and* `min_effect_pct`.
  The weakest failing candidate is dropped and the rest judged again (their segments grew) until
  every one left passes. Its 95 % CI is the t interval of the difference of the log means.
- A window (`last`): only the newest runs are searched. A change found near the window's start,
  where the window may have cut the segment before it short, is searched again in a window twice
  as long and kept only if it is found there too, within one run (Orion's re-check of a change
  point at the edge).

A series whose values are not all positive (counts that can be 0) is segmented on its own scale;
sizes are then relative to the mean before the change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

PENALTY = 3.0  # x ln(n) per change point: BIC-like, tuned on seeded synthetic series (tests/unit/test_changepoints.py)
NOISE_FLOOR = 1e-3  # the smallest run-to-run noise assumed (0.1 %): identical medians are not infinitely precise


@dataclass(frozen=True)
class Settings:
    min_runs: int = 3  # runs on each side of a change (and in every segment)
    alpha: float = 0.001  # a change's t test must reach p below this
    min_effect_noise: float = 2.0  # ... and its size this many times the series' own run-to-run noise
    min_effect_pct: float = 1.0  # ... and at least this many percent
    last: int | None = None  # search only the newest runs (None: all)


@dataclass(frozen=True)
class ChangePoint:
    index: int  # the first run after the change, as a position in the series given
    size: float  # after / before - 1 (0.1 = +10 %); relative to |before| for a series that is not all positive
    ci: tuple[float, float]  # 95 % CI of the size
    p_value: float
    runs_before: int  # runs in the segments either side
    runs_after: int
    before: float  # the segments' level (geometric mean; mean for a series that is not all positive)
    after: float
    rechecked: bool = False  # found at the window's start, and again in a window twice as long


@dataclass(frozen=True)
class Result:
    verdict: str  # "too short" | "no change" | "changed"
    why: str  # the verdict in words
    noise: float | None  # the series' run-to-run noise (0.02: 2 %), None when too short
    change_points: tuple[ChangePoint, ...] = ()
    searched: int = 0  # runs searched (the window)


def find(values: Sequence[float], settings: Settings = Settings()) -> Result:
    """The change points of `values` (one point per run, oldest first)."""
    y = np.asarray(values, dtype=float)
    n, need = len(y), 2 * settings.min_runs
    if n < need:
        return Result(
            "too short",
            f"{n} run{'s' if n != 1 else ''}: a change needs {settings.min_runs} on each side ({need})",
            None,
        )
    start = max(0, n - settings.last) if settings.last else 0
    if n - start < need:
        start = n - need
    found, noise = _detect(y[start:], settings)
    kept = []
    for i, cp in enumerate(found):
        cp = replace(cp, index=cp.index + start)
        if start > 0 and i == 0 and cp.runs_before < need:  # the window may have cut its "before" short
            wider = max(0, start - (n - start))
            again, _ = _detect(y[wider:], settings)
            match = [c for c in again if abs(c.index + wider - cp.index) <= 1]
            if not match:
                continue
            cp = replace(match[0], index=match[0].index + wider, rechecked=True)
        kept.append(cp)
    searched = n - start
    if not kept:
        return Result("no change", f"no change over {searched} runs (noise {noise * 100:.1f} %)", noise, (), searched)
    points = f"{len(kept)} change point{'s' if len(kept) > 1 else ''}"
    return Result("changed", f"{points} over {searched} runs (noise {noise * 100:.1f} %)", noise, tuple(kept), searched)


# -- the search ------------------------------------------------------------------------------------


def _detect(y: np.ndarray, settings: Settings) -> tuple[list[ChangePoint], float]:
    """Candidates by PELT, then judged one by one (see the module's docstring); (kept, noise)."""
    import ruptures  # imported on first use: it pulls scipy (about a second), which `lab` starts without

    positive = bool(np.all(y > 0))
    x = np.log(y) if positive else y
    scale = 1.0 if positive else max(float(np.median(np.abs(x))), 1e-12)
    first_guess = max(_diff_sigma(x), NOISE_FLOOR * scale)
    z = ((x - np.median(x)) / first_guess).reshape(-1, 1)
    # the linear kernel's cost is the least-squares one; KernelCPD runs PELT over it in C (ruptures'
    # Pelt(model="l2") finds the same segments in Python: 2 s for a year of nightly runs, not 0.4 ms)
    algo = ruptures.KernelCPD(kernel="linear", min_size=settings.min_runs, jump=1).fit(z)
    cps = [int(b) for b in algo.predict(pen=PENALTY * math.log(len(x))) if b < len(x)]
    while True:
        judged = [_judge(x, cps, i, positive, settings) for i in range(len(cps))]
        failing = [(cp.p_value, -abs(cp.size), n) for n, (cp, ok) in enumerate(judged) if not ok]
        if not failing:
            return [cp for cp, _ in judged], _residual(x, cps)[0] / scale
        cps.pop(max(failing)[2])


def _judge(x: np.ndarray, cps: list[int], i: int, positive: bool, settings: Settings) -> tuple[ChangePoint, bool]:
    from scipy import stats

    bounds = [0, *cps, len(x)]
    a, b = x[bounds[i] : cps[i]], x[cps[i] : bounds[i + 2]]
    sigma, df = _residual(x, cps)
    scale = 1.0 if positive else max(float(np.median(np.abs(x))), 1e-12)
    sigma = max(sigma, 1e-12 * scale)  # runs identical within their segments: a difference is all signal
    diff = float(b.mean() - a.mean())
    se = sigma * math.sqrt(1 / len(a) + 1 / len(b))
    p = float(2 * stats.t.sf(abs(diff) / se, df))
    half = float(stats.t.ppf(0.975, df)) * se
    if positive:
        size, ci = math.expm1(diff), (math.expm1(diff - half), math.expm1(diff + half))
        before, after = math.exp(a.mean()), math.exp(b.mean())
    else:
        base = abs(float(a.mean())) or math.inf
        size, ci = diff / base, ((diff - half) / base, (diff + half) / base)
        before, after = float(a.mean()), float(b.mean())
    big = abs(diff) >= settings.min_effect_noise * sigma and abs(size) * 100 >= settings.min_effect_pct
    return ChangePoint(cps[i], size, ci, p, len(a), len(b), before, after), p < settings.alpha and big


def _residual(x: np.ndarray, cps: list[int]) -> tuple[float, int]:
    """The pooled spread of the runs around their segments' means, and its degrees of freedom."""
    bounds = [0, *cps, len(x)]
    sq = sum(float(((x[lo:hi] - x[lo:hi].mean()) ** 2).sum()) for lo, hi in zip(bounds, bounds[1:]))
    df = max(len(x) - len(cps) - 1, 1)
    return math.sqrt(sq / df), df


def _diff_sigma(x: np.ndarray) -> float:
    """A robust guess of the noise: the MAD of successive differences (a step moves one of them)."""
    d = np.diff(x)
    return float(1.4826 * np.median(np.abs(d - np.median(d))) / math.sqrt(2)) if len(d) else 0.0
