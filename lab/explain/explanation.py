"""An explanation, computed from its record (lab.explain.record) and the samples in the store:
what `lab explain` prints, its --json, and the section of `lab report`. Reads the store only."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from lab import hostinfo, stats, verdicts
from lab.explain import effects, record as rec
from lab.explain.design import Levels
from lab.explain.knobs import HOST_WHY, Untestable
from lab.store import Store


@dataclass(frozen=True)
class PointInfo:
    levels: Levels
    sources: list[rec.Source]  # the cells whose samples it holds (a duplicate: the cell it repeats)
    samples: int  # of the first metric, counted


@dataclass
class Explanation:
    record: rec.Record
    answers: list[effects.MetricAnswer]
    points: list[PointInfo]
    host_changes: list[Untestable]  # host facts that changed between the parent and the follow-up runs
    # pair -> the runs that measured each side of its interaction, where no run measured both sides
    run_aliased: dict[tuple[int, int], tuple[list[str], list[str]]] = field(default_factory=dict)

    def knob_name(self, j: int) -> str:
        return self.record.knobs[j].name

    def stuck(self) -> list[int]:
        """The knobs whose main effect is unknown in some metric although it was estimated: more
        repetitions may tell (one the cells cannot estimate stays unknown whatever is repeated)."""
        return sorted({k.knob for a in self.answers for k in a.knobs if not k.answer.decided and k.evidence})

    def mattering(self) -> list[int]:
        """The knobs that matter in some metric, in knob order."""
        found = {k.knob for a in self.answers for k in a.knobs if k.answer.differs}
        return sorted(found)


def explain(store: Store, record: rec.Record, *, n_resamples: int = stats.DEFAULT_N_RESAMPLES) -> Explanation:
    samples = rec.Samples(store)
    margins = rec.margins(store, record)
    method = "revert" if record.method == "revert" else "factorial"
    pairs = record.pairs()
    estimates, hib, shown = [], [], []
    for w, m in record.metrics:
        pts = rec.points(record, samples, w, m)
        unit, better = rec.metric_facts(samples, record, w, m)
        estimates.append(
            effects.estimate(record.k, pts, method=method, pairs=pairs, seed=record.seed, n_resamples=n_resamples)
        )
        hib.append(bool(better) if better is not None else True)
        shown.append((w, m, unit, pts))
    judged = effects.judge(estimates, higher_is_better=hib, margins=[margins[wm] for wm in record.metrics])
    answers = []
    for (w, m, unit, pts), est, better, (knobs, inter, gap_answer) in zip(shown, estimates, hib, judged, strict=True):
        answer = effects.MetricAnswer(w, m, unit, better, margins[(w, m)], est.gap, gap_answer, knobs, inter)
        at = effects.by_levels(pts)
        answer.median_a = _median(at.get((0,) * record.k, ()))
        answer.median_b = _median(at.get((1,) * record.k, ()))
        top = answer.top
        if top is not None:
            context = {
                cm: (cu, rec.points(record, samples, w, cm))
                for cm, cu in rec.context_metrics(samples, record, w, m).items()
            }
            loads = {
                name: rec.load_points(record, samples, w, which)
                for name, which in (("host foreign load", "host"), ("client busy", "client"))
            }
            loads = {name: found for name, found in loads.items() if any(p.values for p in found)}
            answer.moved = effects.moved_with(
                record.k, top.knob, context, loads, method=method, seed=record.seed, n_resamples=n_resamples
            )
        available = {s.metric for src in record.sources.get((0,) * record.k, []) for s in samples.rows(src, w)}
        parts = rec.parts_of(w, m, available)
        if parts:
            answer.step = effects.step_of(record.k, {p: rec.points(record, samples, w, p) for p in parts}, pts)
        answers.append(answer)
    first = record.metrics[0] if record.metrics else None
    infos = []
    for levels, sources in record.sources.items():
        resolved = [r for r in dict.fromkeys(samples.resolve(s) for s in sources) if r is not None]
        n = 0
        if first is not None:
            n = next((len(p.values) for p in rec.points(record, samples, *first) if p.levels == levels), 0)
        infos.append(PointInfo(levels, resolved, n))
    pairs_measured = sorted({(x.first, x.second) for a in answers for x in a.interactions})
    aliased = run_aliased(infos, pairs_measured)
    return Explanation(record, answers, infos, host_changes(store, record), aliased)


def run_aliased(
    points: list[PointInfo], pairs: list[tuple[int, int]]
) -> dict[tuple[int, int], tuple[list[str], list[str]]]:
    """The interactions a change of the host between runs would read as: those whose two sides
    (the points where the pair's product is +1, and -1) were measured in runs that share none. The
    usual case: the 2^2 factorial from a parent run's two corners, the other two cells measured
    later in the follow-up run (main effects are balanced across the runs; this contrast is the
    run itself)."""
    out = {}
    for pair in pairs:
        sides: dict[int, set[str]] = {1: set(), -1: set()}
        for p in points:
            sides[effects.column(p.levels, pair)].update(run for run, _ in p.sources)
        if sides[1] and sides[-1] and not sides[1] & sides[-1]:
            out[pair] = (sorted(sides[1]), sorted(sides[-1]))
    return out


def aliased_text(ex: Explanation, pair: tuple[int, int]) -> str:
    """ "or a change of the host between run 1234 and run 5678: ..." for an interaction run_aliased names."""
    plus, minus = ex.run_aliased[pair]
    return (
        f"or a change of the host between {'run' if len(plus) == 1 else 'runs'} {', '.join(plus)} and "
        f"{'run' if len(minus) == 1 else 'runs'} {', '.join(minus)}, which each measured one side of it: the "
        "design cannot tell the two apart"
    )


def _median(values) -> float | None:
    return float(statistics.median(values)) if values else None


def host_changes(store: Store, record: rec.Record) -> list[Untestable]:
    """Host facts that differ between a parent run and the follow-up runs (a kernel updated since):
    the corners measured then are pooled with cells measured now."""
    out: list[Untestable] = []
    parent = store.host_facts.of_run(record.a.run)
    seen: set[tuple[str, str, str]] = set()
    for rid in record.runs:
        try:
            facts = store.host_facts.of_run(rid)
        except Exception:  # noqa: BLE001 - a follow-up run deleted since: nothing to compare
            continue
        for host, f in facts.items():
            if host not in parent:
                continue
            for fact, va, vb in hostinfo.differences(parent[host], f):
                if fact in ("fingerprint", "bridges") or fact.startswith("bridges."):
                    continue  # other labs' bridges come and go on a shared host
                if (host, fact, vb) not in seen:
                    seen.add((host, fact, vb))
                    out.append(Untestable(f"host {host}: {fact} (parent run / follow-up run {rid})", va, vb, HOST_WHY))
    return out


# -- as a document -------------------------------------------------------------------------------------


def _ci(ci: tuple[float, float] | None) -> list[float] | None:
    return None if ci is None else [float(ci[0]), float(ci[1])]


def _finite(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else float(v)


def document(ex: Explanation) -> dict[str, Any]:
    """The `lab explain --json` document (without its schema key)."""
    r = ex.record
    knobs = r.knobs
    metrics = []
    for a in ex.answers:
        gap = a.gap
        metrics.append(
            {
                "workload": a.workload,
                "metric": a.metric,
                "unit": a.unit,
                "higher_is_better": a.higher_is_better,
                "margin": a.margin.as_dict(),
                "median_a": a.median_a,
                "median_b": a.median_b,
                "gap": {
                    "ratio": _finite(gap.ratio) if gap else None,
                    "ci": _ci(gap.ci) if gap else None,
                    "verdict": a.gap_answer.value,
                },
                "knobs": [
                    {
                        **knobs[k.knob].as_dict(),
                        "effect_ratio": _finite(k.ratio),
                        "ci": _ci(k.ci),
                        "share_of_gap": _finite(k.share),
                        "verdict": k.verdict,
                        "answer": k.answer.value,
                        "p": None if k.evidence is None else k.evidence.p,
                        "q": k.q,
                        "n": None if k.evidence is None else [k.evidence.n_a, k.evidence.n_b],
                        "why": k.why or None,
                    }
                    for k in a.knobs
                ],
                "top": None if a.top is None else knobs[a.top.knob].name,
                "interactions": [
                    {
                        "knobs": [knobs[x.first].name, knobs[x.second].name],
                        "text": interaction_text(ex, x),
                        "ratio": _finite(x.ratio),
                        "ci": _ci(x.ci),
                        "effect_at_a": _finite(x.effect_at_a),
                        "effect_at_b": _finite(x.effect_at_b),
                        "verdict": x.verdict,
                        "q": x.q,
                        "aliased_with_runs": (
                            None
                            if (x.first, x.second) not in ex.run_aliased
                            else [list(side) for side in ex.run_aliased[(x.first, x.second)]]
                        ),
                    }
                    for x in a.interactions
                ],
                "moved_with_top": [
                    {
                        "metric": mv.metric,
                        "unit": mv.unit,
                        "ratio": _finite(mv.ratio),
                        "ci": _ci(mv.ci),
                        "median_a": mv.median_a,
                        "median_b": mv.median_b,
                    }
                    for mv in a.moved
                ],
                "step": None if a.step is None else dict(a.step.__dict__),
            }
        )
    return {
        "question_id": r.question_id,
        "a": r.a.as_dict(),
        "b": r.b.as_dict(),
        "method": r.method,
        "knobs": [k.as_dict() for k in knobs],
        "metrics": metrics,
        "untestable": [u.as_dict() for u in r.untestable + ex.host_changes],
        "same_in_effect": r.same_in_effect,
        "design": {"phases": r.phases, "cells": len(ex.points), "full_factorial": 2**r.k if r.k else 0},
        "cells": [
            {
                "levels": list(p.levels),
                "axes": point_values(r, p.levels),
                "sources": [{"run": s[0], "cell": s[1]} for s in p.sources],
                "samples": p.samples,
            }
            for p in ex.points
        ],
        "runs": r.runs,
    }


def point_values(r: rec.Record, levels: Levels) -> dict[str, Any]:
    """What a point sets: knob name -> its value there."""
    return {k.name: k.value(v) for k, v in zip(r.knobs, levels, strict=True)}


def ratio_text(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "–"
    if math.isinf(v):
        return "×∞"
    return f"×{v:.3g}"


def interaction_text(ex: Explanation, x: effects.Interaction) -> str:
    """ "nic (virtio → e1000): ×0.40 with wan none, ×0.99 with wan cap100" """
    first, second = ex.record.knobs[x.first], ex.record.knobs[x.second]
    return (
        f"{second.name} ({second.a} → {second.b}): {ratio_text(x.effect_at_a)} with {first.name} {first.a}, "
        f"{ratio_text(x.effect_at_b)} with {first.name} {first.b}"
    )


def margin_text(m: verdicts.Margin) -> str:
    return m.text()
