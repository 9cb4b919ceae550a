"""Hosts over time (issue 36): every stored run of one configuration on one host as a series, its
change points, and the host facts that changed across each one. Reads the store, writes nothing.

A series is one host (one machine: two orchestrators' `local` hosts, merged by `lab import`, are
two) x one cell configuration (its label: every axis; the image build it ran; the workload's
parameters) x one metric. A run whose configuration differs in any of those is another series,
never mixed in. Each run is a point: the median of its samples that count (lab.flags) with its
bootstrap CI, its time, its host's fingerprint and the host's load under those samples. A run whose
every sample is flagged is shown and left out of the search.

Change points are lab.changepoints'; each is named with its verdict (worse, better, or changed for
an informational metric), its size and CI, and what differed between the last run before it and
the first after it: the host's facts (kernel, QEMU, libvirt or PVE version, microcode, governor,
memory, NIC drivers, mitigations, the lab's CPU quota, ...), the accelerator, the lab's version,
and the host's foreign load during the samples. A series whose newest change point is a worse one
on a primary metric is a regression (`lab history --fail-on-regression`).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lab import analysis, changepoints, hostinfo, results, stats
from lab.store import CellRow, RunRow, SampleRow, Store
from lab.workloads import load_all

# Host facts that are not the host's: how the backend's last probe went (lab.hostinfo.fingerprint
# leaves it out too; the accelerator the cell really ran on is compared instead).
NOT_COMPARED = ("backend_accel", "host_facts_error", "backend_facts_error")
RUN_FACTS = ("accel", "lab version", "foreign load")  # compared too, but the run's, not the host's


def primary(workload: str, metric: str, higher_is_better: bool | None) -> bool:
    """The metrics `--fail-on-regression` watches: the workload's declared headline metrics
    (lab.workloads.PrimaryMetrics, those a comparison answers). A workload this lab does not know
    (a stored run of one since removed): the throughput-like ones (higher is better, not a CPU figure)."""
    known = load_all().get(workload)
    if known is not None:
        return known.primary_metrics.pattern_of(metric) is not None
    return higher_is_better is True and not metric.startswith("cpu_")


@dataclass(frozen=True)
class SeriesKey:
    host: str
    machine: str  # the host's machine_id fact ("" where the host does not say)
    cell: str  # the cell's label: every axis
    image_digest: str  # the image build the cell ran ("" for a bare-metal cell)
    workload: str
    metric: str
    params: str  # the workload's parameters, as sorted JSON


@dataclass(frozen=True)
class Point:
    """One run of a series."""

    run_id: str
    started_at: float
    median: float | None  # None: every sample flagged
    ci: tuple[float, float] | None
    n: int  # samples that count
    flagged: int
    load: results.HostLoadSummary
    fingerprint: str  # the host's, "" if the run stored none
    context: dict[str, str]  # what is compared across a change point: host facts (dotted), then RUN_FACTS

    @property
    def host_facts(self) -> dict[str, str]:
        return {k: v for k, v in self.context.items() if k not in RUN_FACTS}


@dataclass(frozen=True)
class Change:
    at: changepoints.ChangePoint
    run_id: str  # the first run after the change
    before_run: str  # the last run before it
    verdict: str  # worse | better | changed
    facts: tuple[tuple[str, str, str], ...]  # (fact, before, after): what differed between those two runs


@dataclass(frozen=True)
class History:
    key: SeriesKey
    unit: str
    higher_is_better: bool | None
    primary: bool
    points: tuple[Point, ...]
    result: changepoints.Result
    changes: tuple[Change, ...]

    @property
    def regression(self) -> Change | None:
        """The newest change point, when it made a primary metric worse: the newest run is past it."""
        if self.primary and self.changes and self.changes[-1].verdict == "worse":
            return self.changes[-1]
        return None


@dataclass
class _Gathered:
    unit: str = ""
    higher_is_better: bool | None = None
    points: list[Point] = field(default_factory=list)


def histories(
    store: Store,
    *,
    host: str | None = None,
    selector: dict[str, str] | None = None,
    workload: str | None = None,
    metric: str | None = None,
    everything: bool = False,
    settings: changepoints.Settings | None = None,
) -> list[History]:
    """Every series of the store that the filters select, each with its change points."""
    runs = store.runs()
    versions = dict(store.db.execute("SELECT id, lab_version FROM runs").fetchall())
    machines = _machines(store, runs)
    gathered: dict[SeriesKey, _Gathered] = {}
    for run in runs:
        cells = [
            c
            for c in store.cells(run.id)
            if c.status == "done"
            and analysis.matches(c, selector or {})
            and (host is None or str(c.axes.get("host")) == host)
        ]
        if not cells:
            continue
        hosts = store.host_facts.of_run(run.id)
        samples = [s for s in store.samples(run.id) if workload is None or s.workload == workload]
        for cell in cells:
            mine = [s for s in samples if s.cell_id == cell.cell_id]
            _add_points(gathered, run, cell, mine, hosts, machines, versions.get(run.id) or "", metric, everything)
    out = []
    for key, g in sorted(gathered.items(), key=lambda kv: (kv[0].host, kv[0].cell, kv[0].workload, kv[0].metric)):
        out.append(_judge(key, g, settings or changepoints.Settings()))
    return out


def _machines(store: Store, runs: list[RunRow]) -> dict[tuple[str, str], str]:
    """(run id, host) -> the machine it ran on. A run from before hosts said which machine they are
    belongs to the host's one machine, when the store knows exactly one of that name."""
    seen: dict[tuple[str, str], str] = {}
    for run in runs:
        for host, facts in store.host_facts.of_run(run.id).items():
            seen[(run.id, host)] = str(facts.get("machine_id") or "")
    known: dict[str, set[str]] = {}
    for (_, host), machine in seen.items():
        if machine:
            known.setdefault(host, set()).add(machine)
    return {
        (rid, host): machine or (next(iter(known[host])) if len(known.get(host, ())) == 1 else "")
        for (rid, host), machine in seen.items()
    }


def _add_points(
    gathered: dict[SeriesKey, _Gathered],
    run: RunRow,
    cell: CellRow,
    samples: list[SampleRow],
    hosts: dict[str, dict[str, Any]],
    machines: dict[tuple[str, str], str],
    lab_version: str,
    metric: str | None,
    everything: bool,
) -> None:
    host = str(cell.axes.get("host"))
    facts = hosts.get(host, {})
    image = (run.manifest.get("images") or {}).get(str(cell.axes.get("image")), {})
    threshold = analysis.threshold_of(run.manifest)
    by_workload: dict[str, list[SampleRow]] = {}
    for s in samples:
        by_workload.setdefault(s.workload, []).append(s)
    for wl, rows in by_workload.items():
        params = json.dumps((run.manifest.get("workloads") or {}).get(wl), sort_keys=True, default=str)
        load = results.host_load(rows)
        accel = next((str(s.labels["accel"]) for s in rows if s.labels.get("accel")), "")
        context = {
            **{k: v for k, v in hostinfo.flatten(facts).items() if k.split(".")[0] not in NOT_COMPARED},
            **({"accel": accel} if accel else {}),
            "lab version": lab_version,
            "foreign load": _load_fact(load, threshold),
        }
        context.pop("fingerprint", None)
        for ser in results.series(rows, [cell]):
            if (metric is not None and ser.metric != metric) or (not everything and not results.show_rows([ser])):
                continue
            key = SeriesKey(
                host,
                machines.get((run.id, host), ""),
                cell.label,
                str(image.get("digest") or ""),
                wl,
                ser.metric,
                params,
            )
            g = gathered.setdefault(key, _Gathered(ser.unit, ser.higher_is_better))
            g.points.append(
                Point(
                    run.id,
                    run.started_at,
                    statistics.median(ser.values) if ser.values else None,
                    stats.median_ci(ser.values, seed=run.seed or 0) if ser.values else None,
                    len(ser.values),
                    ser.flagged,
                    load,
                    str(facts.get("fingerprint") or ""),
                    context,
                )
            )


def _load_fact(load: results.HostLoadSummary, threshold: float) -> str:
    """The host's load under a run's samples as a fact that changes when it matters, not with
    every reading: how many repetitions were flagged for it."""
    if not load.repetitions:
        return "not measured"
    return f"{load.flagged} of {load.repetitions} repetitions over {threshold:g} % of one core"


def _judge(key: SeriesKey, g: _Gathered, settings: changepoints.Settings) -> History:
    measured = [p for p in g.points if p.median is not None]
    result = changepoints.find([p.median for p in measured if p.median is not None], settings)
    changes = []
    for cp in result.change_points:
        before, after = measured[cp.index - 1], measured[cp.index]
        if g.higher_is_better is None:
            verdict = "changed"
        else:
            verdict = "better" if (cp.size > 0) == g.higher_is_better else "worse"
        changes.append(
            Change(cp, after.run_id, before.run_id, verdict, tuple(hostinfo.differences(before.context, after.context)))
        )
    return History(
        key,
        g.unit,
        g.higher_is_better,
        primary(key.workload, key.metric, g.higher_is_better),
        tuple(g.points),
        result,
        tuple(changes),
    )


# -- in words --------------------------------------------------------------------------------------


def pct(v: float) -> str:
    return f"{v * 100:+.1f} %"


def facts_text(facts: Iterable[tuple[str, str, str]]) -> str:
    shown = [f"{k} {a} -> {b}" for k, a, b in facts]
    return "; ".join(shown) if shown else "no host fact changed"


def change_text(h: History, c: Change) -> str:
    """One line: the verdict, size and CI, where, and the facts that changed."""
    lo, hi = c.at.ci
    measured = sum(1 for p in h.points if p.median is not None)
    where = f"run {c.run_id} (the {_ordinal(c.at.index + 1)} of {measured} measured)"
    recheck = ", re-checked in a wider window" if c.at.rechecked else ""
    return (
        f"{c.verdict} {pct(c.at.size)} [{pct(lo)}, {pct(hi)}], p {c.at.p_value:.1e}, at {where}"
        f" after {c.at.runs_before} runs{recheck}; changed: {facts_text(c.facts)}"
    )


def regression_line(h: History, c: Change) -> str:
    """`--fail-on-regression`'s line: host, cell, metric, size, what changed."""
    lo, hi = c.at.ci
    k = h.key
    return (
        f"regression: host {k.host}, cell {k.cell}, {k.workload} {k.metric}: {pct(c.at.size)} "
        f"[{pct(lo)}, {pct(hi)}] since run {c.run_id}; changed: {facts_text(c.facts)}"
    )


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(points: Iterable[Point]) -> str:
    """The medians as one line of block characters ("·" for a run with no median)."""
    values = [p.median for p in points]
    known = [v for v in values if v is not None]
    if not known:
        return ""
    lo, hi = min(known), max(known)
    span = hi - lo or 1.0
    return "".join("·" if v is None else SPARKS[round((v - lo) / span * (len(SPARKS) - 1))] for v in values)
