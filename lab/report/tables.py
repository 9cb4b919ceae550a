"""The report's tables: results per workload, the comparison, overhead vs bare metal, hosts,
cells and runs, as rows of strings for the template."""

from __future__ import annotations

import json
from typing import Any

from lab import analysis, compare as compare_mod, hostinfo, results, stats
from lab.model import BARE_METAL
from lab.report.data import VERDICT_CLASS, RunData, categories, direction, duration, p_text, pct, when
from lab.results import fmt


def results_rows(rd: RunData, short: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    by_wl: dict[str, list[dict[str, Any]]] = {}
    seed = rd.run.seed or 0
    all_series = list(rd.series.values())
    index = {s.key: s for s in all_series}
    cat_order = {label: i for i, label in enumerate(short)}
    order = {True: 0, False: 1, None: 2}
    rows = sorted(
        results.show_rows(all_series),
        key=lambda r: (
            r.workload,
            order[index[(r.cell, r.workload, r.metric)].higher_is_better],
            r.metric,
            cat_order.get(r.cell, len(cat_order)),
            r.cell,
        ),
    )
    previous = None
    for r in rows:
        s = index[(r.cell, r.workload, r.metric)]
        figures = {"median": "–", "ci": "–", "range": "–", "cv": "–", "n": 0}  # every sample flagged
        if s.values:
            summ = stats.summarize(s.values, seed=seed)
            figures = {
                "median": fmt(summ.median),
                "ci": f"{fmt(summ.ci_low)} – {fmt(summ.ci_high)}",
                "range": f"{fmt(summ.min)} – {fmt(summ.max)}",
                "cv": pct(summ.cv),
                "n": summ.n,
            }
        by_wl.setdefault(r.workload, []).append(
            {
                "cell": short.get(r.cell, r.cell),
                "label": r.cell,
                "metric": r.metric,
                "unit": r.unit,
                "direction": r.direction,
                **figures,
                "cpu": fmt(r.cpu_busy),
                "flagged": r.flagged,
                "first": (r.workload, r.metric) != previous,
            }
        )
        previous = (r.workload, r.metric)
    return by_wl


def _side(rd: RunData) -> analysis.Side:
    return analysis.side(rd.run.id, rd.run.seed, rd.cells, rd.samples, rd.hosts)


def _noise(sides: list[RunData]) -> dict[tuple[str, str], stats.RatioCI]:
    out: dict[tuple[str, str], stats.RatioCI] = {}
    for rd in sides:
        for k, v in analysis.noise_floor(list(rd.series.values()), seed=rd.run.seed or 0).items():
            out[k] = stats.widest(out.get(k), v)
    return out


def _answer(r: compare_mod.Row) -> dict[str, Any]:
    """A row's q, margin and verdict as the report's tables show them."""
    differs = r.verdict in (compare_mod.Verdict.BETTER, compare_mod.Verdict.WORSE)
    return {
        "q": p_text(r.q_value),
        "margin": r.margin.text() if r.margin else "–",
        "primary": r.primary,
        "verdict": r.verdict.value,
        "reverses": differs and r.siblings is not None and r.siblings.reverses,
        "cls": VERDICT_CLASS[r.verdict],
    }


def comparison(a: RunData, b: RunData, short: dict[str, str], wl_order: dict[str, int]) -> dict[str, Any]:
    noise = _noise([a, b])
    cmp = analysis.compare_sides(
        _side(a), _side(b), noise=noise, threshold_pct=analysis.threshold_of(a.run.manifest, b.run.manifest)
    )
    rows = cmp.rows
    cat_order = {label: i for i, label in enumerate(short)}
    order = {True: 0, False: 1, None: 2}
    # Grouped like the charts: workload, then throughput-like metrics first, CPU last, cells in run order.
    rows.sort(
        key=lambda r: (
            wl_order.get(r.key[1], len(wl_order)),
            r.key[1],
            r.key[2].startswith(results.CPU_METRIC),
            order[r.higher_is_better],
            r.key[2],
            cat_order.get(r.key[0], len(cat_order)),
        )
    )
    out = []
    counts: dict[str, int] = {}
    previous = None
    for r in rows:
        cell, wl, metric = r.key
        counts[r.verdict.value] = counts.get(r.verdict.value, 0) + 1
        out.append(
            {
                "cell": short.get(cell, cell),
                "label": cell,
                "workload": wl,
                "metric": metric,
                "unit": r.unit,
                "direction": direction(r.higher_is_better),
                "median_a": fmt(r.median_a),
                "median_b": fmt(r.median_b),
                "n_a": r.n_a,
                "n_b": r.n_b,
                "flagged_a": r.flagged_a,
                "flagged_b": r.flagged_b,
                "ratio": fmt(r.ratio),
                "ci": f"{fmt(r.ratio_ci[0])} – {fmt(r.ratio_ci[1])}" if r.ratio_ci else "–",
                "p": p_text(r.p_value),
                **_answer(r),
                "is_cpu": metric.startswith(results.CPU_METRIC),
                "first": (wl, metric) != previous,
            }
        )
        previous = (wl, metric)
    cells = []
    for label in categories([a, b]):
        ca, cb = a.cell_status.get(label), b.cell_status.get(label)
        cells.append(
            {
                "cell": short.get(label, label),
                "label": label,
                "a": ca.status if ca else "missing",
                "b": cb.status if cb else "missing",
            }
        )
    ns = [r.n_a for r in rows if r.n_a] + [r.n_b for r in rows if r.n_b]
    n_min = min(ns) if ns else 0
    return {
        "rows": out,
        "counts": counts,
        "cells": cells,
        "noise": bool(noise),
        "min_p": p_text(stats.min_exact_p(n_min, n_min)) if n_min else "–",
        "n_min": n_min,
        "alpha": compare_mod.DEFAULT_ALPHA,
        "margin_pct": cmp.margin_pct,
        "primary_rows": sum(1 for r in rows if r.q_value is not None),
        "families": [{"text": f.text(), "reverses": f.reverses} for f in cmp.families()],
        "load": {
            "a": cmp.a.load.text() if cmp.a.load else "not measured",
            "b": cmp.b.load.text() if cmp.b.load else "not measured",
            "diff": cmp.load_diff,
        },
    }


def host_load(rd: RunData, short: dict[str, str]) -> dict[str, Any]:
    """The host under a run's samples: how each host was watched, each cell's foreign load, and
    every flagged repetition with its reasons (shown, never averaged in)."""
    modes = rd.run.manifest.get("quiet_host") or {}
    cells = []
    for c in rd.cells:
        mine = [s for s in rd.samples if s.cell_id == c.cell_id]
        if mine:
            cells.append({"id": c.cell_id, "cell": short.get(c.label, c.label), "load": results.host_load(mine).text()})
    flagged = [
        {
            "id": f.cell_id,
            "cell": short.get(f.cell, f.cell),
            "workload": f.workload,
            "repetition": f.repetition + 1,
            "round": f.round,
            "reasons": "; ".join(f.reasons),
        }
        for f in results.flagged_repetitions(rd.samples, rd.cells)
    ]
    return {
        "run": rd.run.id,
        "modes": sorted(modes.items()),
        "threshold": analysis.threshold_of(rd.run.manifest),
        "cells": cells if modes else [],
        "flagged": flagged,
    }


def overhead(rd: RunData, short: dict[str, str], wl_order: dict[str, int]) -> dict[str, Any] | None:
    """Every cell against the bare-metal cell of its host, if the run has one."""
    if not any(analysis.kind(c) == BARE_METAL for c in rd.cells):
        return None
    found = analysis.overheads(
        rd.cells,
        rd.samples,
        analysis.parse_selector([analysis.BASELINE_DEFAULT]),
        seed=rd.run.seed or 0,
        noise=_noise([rd]),
    )
    order = {True: 0, False: 1, None: 2}
    cat_order = {label: i for i, label in enumerate(short)}
    found.sort(
        key=lambda o: (
            wl_order.get(o.row.key[1], len(wl_order)),
            o.row.key[1],
            o.row.key[2].startswith(results.CPU_METRIC),
            order[o.row.higher_is_better],
            o.row.key[2],
            cat_order.get(o.cell, len(cat_order)),
        )
    )
    rows, previous = [], None
    for o in found:
        r = o.row
        _, wl, metric = r.key
        rows.append(
            {
                "cell": short.get(o.cell, o.cell),
                "label": o.cell,
                "reference": short.get(o.reference, o.reference),
                "workload": wl,
                "metric": metric,
                "unit": r.unit,
                "direction": direction(r.higher_is_better),
                "base": fmt(r.median_a),
                "median": fmt(r.median_b),
                "n": f"{r.n_a}/{r.n_b}",
                "change": analysis.fmt_change(o.change_pct, o.change_ci_pct),
                "p": p_text(r.p_value),
                **_answer(r),
                "is_cpu": metric.startswith(results.CPU_METRIC),
                "first": (wl, metric) != previous,
            }
        )
        previous = (wl, metric)
    return {"rows": rows, "run": rd.run.id}


def hosts(sides: list[RunData]) -> dict[str, Any]:
    """Host facts as rows; with two runs, paired by host name (or the only host of each run)."""
    a = sides[0].hosts
    if len(sides) == 1:
        return {
            "pairs": [
                {
                    "name": h,
                    "rows": [{"fact": k, "a": v, "b": None, "diff": False} for k, v in hostinfo.flatten(f).items()],
                }
                for h, f in a.items()
            ],
            "ndiff": 0,
            "diffs": [],
        }
    b = sides[1].hosts
    if set(a) != set(b) and len(a) == 1 and len(b) == 1:
        pairs: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]] = [
            (f"{next(iter(a))} / {next(iter(b))}", next(iter(a.values())), next(iter(b.values())))
        ]
    else:
        pairs = [(h, a.get(h), b.get(h)) for h in sorted(set(a) | set(b), key=lambda h: (h not in a, h))]
    out, diffs = [], []
    for name, fa, fb in pairs:
        flat_a, flat_b = hostinfo.flatten(fa or {}), hostinfo.flatten(fb or {})
        keys = list(flat_a) + [k for k in flat_b if k not in flat_a]
        rows = []
        for k in keys:
            va = flat_a.get(k, "missing" if fa is None else "–")
            vb = flat_b.get(k, "missing" if fb is None else "–")
            diff = va != vb
            rows.append({"fact": k, "a": va, "b": vb, "diff": diff})
            if diff:
                diffs.append(f"{name}: {k}")
        out.append({"name": name, "rows": rows})
    return {"pairs": out, "ndiff": len(diffs), "diffs": diffs}


def cell_rows(rd: RunData, short: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for c in rd.cells:
        f = c.facts
        ver = f.get("verified") or {}
        tun = f.get("tuning") or {}
        effective = tun.get("effective") or {}
        mem = ver.get("mem_kib")
        tuning = tun.get("profile", c.axes.get("tuning", "–"))
        if tun and not tun.get("applicable", True):
            tuning += f" (n/a: {tun.get('reason') or 'not applicable'})"
        rows.append(
            {
                "id": c.cell_id,
                "cell": short.get(c.label, c.label),
                "label": c.label,
                "status": c.status,
                "stage": c.stage or "–",
                "error": c.error,
                "accel": f.get("accel", "–"),
                "nic": f"{ver['nic_driver']}" if "nic_driver" in ver else "–",
                "nic_asked": c.axes.get("nic", ""),
                "vcpus": ver.get("vcpus", "–"),
                "vcpus_asked": c.axes.get("vcpus", "–"),
                "memory": f"{mem / 1024:.0f} MiB" if isinstance(mem, (int, float)) else "–",
                "memory_asked": c.axes.get("memory_mib", ""),
                "kernel": ver.get("kernel", "–"),
                "tuning": tuning,
                "effective": [f"{k} = {v}" for k, v in effective.items()],
                "boot": fmt(f.get("boot_seconds")) if f.get("boot_seconds") is not None else "–",
                "clone": f.get("clone", c.axes.get("clone", "–")),
                "image": (f.get("image_digest") or "–")[:12],
                "image_full": f.get("image_digest") or "",
                "facts_json": json.dumps(f, indent=2, sort_keys=True),
                "skipped": [f"{w}: {why}" for w, why in (f.get("skipped_workloads") or {}).items()],
            }
        )
    return rows


def run_info(rd: RunData) -> dict[str, Any]:
    r = rd.run
    return {
        "side": rd.side,
        "colour": rd.colour,
        "id": r.id,
        "name": r.name,
        "status": r.status,
        "error": r.error,
        "started": when(r.started_at),
        "finished": when(r.finished_at),
        "duration": duration((r.finished_at - r.started_at) if r.finished_at else None),
        "seed": r.seed,
        "lab_version": rd.lab_version or "–",
        "config_path": r.config_path or "–",
        "config_text": rd.config_text or "",
        "manifest_json": json.dumps(r.manifest, indent=2, sort_keys=True),
        "cells_done": sum(1 for c in rd.cells if c.status == "done"),
        "cells_total": len(rd.cells),
        "samples": len(rd.samples),
        "schedule": _schedule(r.manifest),
        "executions": len(rd.executions),
    }


def _schedule(manifest: dict[str, Any]) -> str:
    """The repetition policy and order, in words (from the manifest lab.schedule.describe wrote)."""
    sch = manifest.get("schedule") or {}
    if not sch:
        return "–"
    text = f"{sch.get('order')}"
    if sch.get("repetitions_per_boot"):
        text += f" in {len(manifest.get('rounds', []))} round(s), {sch['repetitions_per_boot']} repetition(s) per boot"
    if sch.get("target_ci_pct"):
        text += (
            f"; adaptive: until the 95 % CI is within ±{sch['target_ci_pct']:g} %"
            + (" and the primary rows are decided against their partners" if sch.get("decide") else "")
            + ", "
            f"{sch.get('repetitions')}–{sch.get('max_repetitions')} repetitions"
            + (f", at most {sch['max_seconds']:g} s" if sch.get("max_seconds") else "")
        )
    else:
        text += f"; {sch.get('repetitions')} repetitions"
    return text + f", {sch.get('warmup')} warm-up per boot"
