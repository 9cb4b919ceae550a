"""Pure: what `lab compare`, `lab show` and `lab report` put side by side.

- Sides: the cells of a run, or a selection of them by axes (`nic=virtio`, `host=pve1`,
  `kind=bare-metal`), so two runs, two hosts or any two cell selections can be compared.
- Pairing: which cell of A goes with which cell of B (`pair`), cells on one side only are kept
  (lab.compare makes them "missing in A/B" rows, never drops them).
- The A/A noise floor: a cell and its twin ([suite] noise_floor) measured in the same run give,
  per workload metric, the ratio two identical setups produce (lab.stats.noise_floor); it is the
  margin of that metric's verdicts (lab.verdicts.margin_for): a difference inside it is not called.
- Primary metrics: each workload declares its headline metrics (lab.workloads.PrimaryMetrics);
  those rows are answered and corrected together, the others are exploratory (lab.compare).
- Overhead vs a baseline: every cell against the bare-metal cell (or a chosen reference cell)
  of its host, as "VM -0.52 % [CI] vs bare metal".
- Host fact differences between the two sides (lab.hostinfo.differences), next to the results,
  and the host's load under each side's samples (lab.hostload): a line when the sides differ in it.

Nothing here reads the store or prints; callers pass what the store holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lab import compare as compare_mod, hostinfo, results, stats, verdicts
from lab.axes import AXES, AXES_TABLE, axis, moot
from lab.errors import UsageError
from lab.model import BARE_METAL, TWIN_SUFFIX
from lab.store import CellRow, SampleRow
from lab.workloads import load_all

Key = tuple[str, str, str]  # (pair label, workload, metric)
ISOLATION_DEFAULT = axis("isolation").plain(axis("isolation").default)
BASELINE_DEFAULT = f"kind={BARE_METAL}"
DEFAULT_THRESHOLD = 10.0  # % of one core: [suite] foreign_load_pct's default, for runs that did not record one


def threshold_of(*manifests: dict[str, Any]) -> float:
    """The foreign-load threshold the runs' samples were flagged at (the lower of two runs')."""
    found = [
        float(m.get("schedule", {}).get("foreign_load_pct"))
        for m in manifests
        if isinstance(m.get("schedule", {}).get("foreign_load_pct"), (int, float))
    ]
    return min(found) if found else DEFAULT_THRESHOLD


# -- selections ------------------------------------------------------------------------------------


def parse_selector(items: Iterable[str] | None, option: str = "--a", extra: tuple[str, ...] = ()) -> dict[str, str]:
    """["nic=virtio", "tuning=default,vcpus=2"] -> {"nic": "virtio", ...}. UsageError if malformed.
    `extra`: keys the caller takes out before selecting cells (lab.variants' `variant`)."""
    out: dict[str, str] = {}
    for item in items or ():
        for part in filter(None, (p.strip() for p in item.split(","))):
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key or not value:
                raise UsageError(f"{option} {part!r}: expected AXIS=VALUE, e.g. nic=virtio")
            if key not in (*AXES, "kind", "replica", *extra):
                raise UsageError(f"{option} {part!r}: unknown axis {key!r}; axes: {', '.join((*AXES, 'kind', *extra))}")
            if key in out and out[key] != value:
                raise UsageError(f"{option}: axis {key!r} given twice ({out[key]!r} and {value!r})")
            out[key] = value
    return out


def kind(cell: CellRow) -> str:
    return str(cell.axes.get("kind", "vm"))


def is_twin(cell: CellRow) -> bool:
    return cell.label.endswith(TWIN_SUFFIX)


def matches(cell: CellRow, selector: dict[str, str]) -> bool:
    """Every k=v of the selector holds. A/A twins only when the selector asks for a replica."""
    if is_twin(cell) and "replica" not in selector:
        return False
    # optional axes are stored only when set (lab.axes): cc=default selects the cells without one;
    # a bare-metal cell has two of them: isolation (vm: on the host itself) and a container's runtime
    unset = {a.name: a.plain(a.default) for a in AXES_TABLE if a.optional}
    if kind(cell) != "vm":
        unset = {k: unset[k] for k in ("isolation", "runtime")}
    axes = {**unset, **cell.axes, "kind": kind(cell)}
    for name in moot(axes):  # an axis that means nothing for the cell: it has none
        axes.pop(name, None)
    return all(str(axes.get(k)) == v for k, v in selector.items())


def select(cells: Sequence[CellRow], selector: dict[str, str]) -> list[CellRow]:
    return [c for c in cells if matches(c, selector)]


# -- sides -----------------------------------------------------------------------------------------


@dataclass
class Side:
    """One side of a comparison: the (selected) cells of one run and their series."""

    run_id: str
    seed: int
    cells: list[CellRow]
    series: list[results.Series]
    hosts: dict[str, dict[str, Any]]  # host name -> stored facts, for the hosts of these cells
    selector: dict[str, str] = field(default_factory=dict)
    load: results.HostLoadSummary | None = None  # the host's load under these cells' samples

    def by_label(self) -> dict[str, dict[tuple[str, str], results.Series]]:
        out: dict[str, dict[tuple[str, str], results.Series]] = {}
        for s in self.series:
            out.setdefault(s.cell, {})[(s.workload, s.metric)] = s
        return out


def side(
    run_id: str,
    seed: int | None,
    cells: Sequence[CellRow],
    samples: Sequence[SampleRow],
    host_facts: dict[str, dict[str, Any]],
    selector: dict[str, str] | None = None,
) -> Side:
    selector = selector or {}
    chosen = select(cells, selector)
    ids = {c.cell_id for c in chosen}
    mine = [s for s in samples if s.cell_id in ids]
    hosts = {h: f for h, f in host_facts.items() if h in {str(c.axes.get("host")) for c in chosen}}
    return Side(run_id, seed or 0, chosen, results.series(mine, chosen), hosts, selector, results.host_load(mine))


def comparable(s: results.Series, everything: bool = False) -> bool:
    """The metrics a comparison shows: what `lab show` shows and the guest CPU busy % that goes
    with it; with `everything`, every metric."""
    return everything or bool(results.show_rows([s])) or s.metric.startswith(results.CPU_METRIC)


# -- pairing ---------------------------------------------------------------------------------------


def reduced_label(cell: CellRow, drop: set[str]) -> str:
    """The cell's axes without those the selectors name, in matrix order: what pairs it."""
    axes = {**cell.axes, "kind": kind(cell)}
    keys = [k for k in (*AXES, "kind") if k not in drop and k in axes and not (k == "kind" and axes[k] == "vm")]
    return "/".join(str(axes[k]) for k in keys) or cell.label


def pair(a: Side, b: Side) -> list[tuple[str, CellRow | None, CellRow | None]]:
    """(pair label, A cell, B cell) for every cell of either side.

    With selectors: one cell on each side -> those two; one cell on one side and several on the
    other -> the single one is the reference for each; otherwise cells pair by the axes the
    selectors do not name. Without selectors (two runs): by label. A cell with no partner is kept
    with None on the other side. Two cells of one side that would take the same partner are a
    UsageError: the selection is ambiguous."""
    selected = bool(a.selector or b.selector)
    if selected and len(a.cells) == 1 and len(b.cells) == 1:
        ca, cb = a.cells[0], b.cells[0]
        return [(cb.label if ca.label == cb.label else f"{ca.label} → {cb.label}", ca, cb)]
    if selected and len(a.cells) == 1 and len(b.cells) > 1:
        return [(cb.label, a.cells[0], cb) for cb in b.cells]
    if selected and len(b.cells) == 1 and len(a.cells) > 1:
        return [(ca.label, ca, b.cells[0]) for ca in a.cells]
    drop = set(a.selector) | set(b.selector)
    keyed: list[dict[str, CellRow]] = []
    for s, name in ((a, "A"), (b, "B")):
        m: dict[str, CellRow] = {}
        for c in s.cells:
            k = reduced_label(c, drop) if selected else c.label
            if k in m:
                raise UsageError(
                    f"selection {name} ({_sel(s.selector)}) matches {m[k].cell_id} and {c.cell_id}, "
                    f"which differ only in axes the selections name; narrow it down"
                )
            m[k] = c
        keyed.append(m)
    ma, mb = keyed
    return [(k, ma.get(k), mb.get(k)) for k in sorted(set(ma) | set(mb))]


def _sel(selector: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in selector.items()) or "all cells"


# -- noise floor -----------------------------------------------------------------------------------


def noise_floor(series: Iterable[results.Series], seed: int = 0) -> dict[tuple[str, str], stats.RatioCI]:
    """(workload, metric) -> the A/A ratio CI of a cell and its twin in one run (None if no twin).

    With several twins (several hosts), the widest band counts: the floor is what identical
    setups can differ by anywhere in the run."""
    by_cell: dict[str, dict[tuple[str, str], results.Series]] = {}
    for s in series:
        by_cell.setdefault(s.cell, {})[(s.workload, s.metric)] = s
    out: dict[tuple[str, str], stats.RatioCI] = {}
    for label, twin_series in by_cell.items():
        if not label.endswith(TWIN_SUFFIX):
            continue
        original = by_cell.get(label.removesuffix(TWIN_SUFFIX), {})
        for wm, t in twin_series.items():
            o = original.get(wm)
            if o is None or len(o.values) < 2 or len(t.values) < 2:
                continue
            ci = stats.noise_floor(o.values, t.values, seed=seed)
            out[wm] = stats.widest(out.get(wm), ci)
    return out


# -- comparisons -----------------------------------------------------------------------------------


@dataclass
class Comparison:
    a: Side
    b: Side
    rows: list[compare_mod.Row]  # key = (pair label, workload, metric)
    pairs: list[tuple[str, CellRow | None, CellRow | None]]
    noise: dict[tuple[str, str], stats.RatioCI]  # (workload, metric) -> A/A
    host_diffs: list[tuple[str, str, str, str]]  # (host, fact, A, B)
    load_diff: str = ""  # how the host's load under the two sides differs, "" if it does not
    margin_pct: float = verdicts.DEFAULT_MARGIN_PCT  # the stated minimum effect the margins start from

    def families(self) -> list[compare_mod.Siblings]:
        """Each sibling family of the primary rows once, in row order."""
        seen: dict[str, compare_mod.Siblings] = {}
        for r in self.rows:
            if r.siblings is not None:
                seen.setdefault(r.siblings.family, r.siblings)
        return list(seen.values())


def compare_sides(
    a: Side,
    b: Side,
    *,
    noise: dict[tuple[str, str], stats.RatioCI] | None = None,
    everything: bool = False,
    alpha: float = compare_mod.DEFAULT_ALPHA,
    n_resamples: int = stats.DEFAULT_N_RESAMPLES,
    threshold_pct: float = DEFAULT_THRESHOLD,
    margin_pct: float = verdicts.DEFAULT_MARGIN_PCT,
) -> Comparison:
    pairs = pair(a, b)
    la, lb = a.by_label(), b.by_label()
    side_a: dict[Key, compare_mod.MetricSeries] = {}
    side_b: dict[Key, compare_mod.MetricSeries] = {}
    for label, ca, cb in pairs:
        for cell, by, out in ((ca, la, side_a), (cb, lb, side_b)):
            if cell is None:
                continue
            for (wl, metric), s in by.get(cell.label, {}).items():
                if comparable(s, everything):
                    out[(label, wl, metric)] = metric_series(s)
    rows = compare_mod.compare(
        side_a,
        side_b,
        alpha=alpha,
        seed=a.seed,
        n_resamples=n_resamples,
        noise_floor=bands(noise, set(side_a) | set(side_b)),
        margin_pct=margin_pct,
    )
    return Comparison(
        a,
        b,
        rows,
        pairs,
        noise or {},
        host_differences(a.hosts, b.hosts),
        load_difference(a.load, b.load, threshold_pct),
        margin_pct,
    )


def bands(noise: dict[tuple[str, str], stats.RatioCI] | None, keys: set[Key]) -> dict[Key, stats.RatioCI]:
    """The A/A band of each row's (workload, metric), for the rows that have one."""
    noise = noise or {}
    return {k: noise[(k[1], k[2])] for k in keys if (k[1], k[2]) in noise}


def metric_series(s: results.Series) -> compare_mod.MetricSeries:
    """A stored series for lab.compare: primary when its workload declares the metric a headline
    one (a workload this version does not know has none), its family named by that pattern."""
    known = load_all().get(s.workload)
    pattern = known.primary_metrics.pattern_of(s.metric) if known is not None else None
    family = f"{s.workload} {pattern}" if pattern else None
    return compare_mod.MetricSeries(s.values, s.unit, s.higher_is_better, s.flagged, pattern is not None, family)


def load_difference(
    a: results.HostLoadSummary | None, b: results.HostLoadSummary | None, threshold_pct: float = DEFAULT_THRESHOLD
) -> str:
    """A line when the host was busier under one side's samples than under the other's: medians
    more than half the flag threshold apart, or flagged repetitions on one side only; "" if not."""
    if a is None or b is None or a.median_pct is None or b.median_pct is None:
        if a is not None and b is not None and (a.median_pct is None) != (b.median_pct is None):
            return (
                f"host load measured under side {'A' if a.median_pct is not None else 'B'} only: "
                "the other side's host could not tell or was not watched"
            )
        return ""
    out = []
    if abs(a.median_pct - b.median_pct) > threshold_pct / 2:
        busier = "A" if a.median_pct > b.median_pct else "B"
        out.append(
            f"the host was busier under side {busier} (foreign load median {a.median_pct:.0f} % vs "
            f"{b.median_pct:.0f} % of one core)"
        )
    if bool(a.flagged) != bool(b.flagged):
        out.append(
            f"side {'A' if a.flagged else 'B'} has repetitions flagged for host load "
            f"({a.flagged or b.flagged}), the other none"
        )
    return "; ".join(out)


def host_differences(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(host, fact, value in A, value in B) for each differing fact. Hosts pair by name; one host
    on each side under different names (two hosts compared) pair with each other."""
    if set(a) != set(b) and len(a) == 1 and len(b) == 1:
        (ha, fa), (hb, fb) = next(iter(a.items())), next(iter(b.items()))
        pairs: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]] = [(f"{ha} / {hb}", fa, fb)]
    else:
        pairs = [(h, a.get(h), b.get(h)) for h in sorted(set(a) | set(b))]
    out = []
    for name, facts_a, facts_b in pairs:
        out += [(name, k, va, vb) for k, va, vb in hostinfo.differences(facts_a, facts_b)]
    return out


# -- overhead vs a baseline ------------------------------------------------------------------------


@dataclass(frozen=True)
class Overhead:
    cell: str  # the cell's label
    reference: str  # the baseline cell's label
    row: compare_mod.Row  # A = baseline, B = the cell

    @property
    def change_pct(self) -> float | None:
        return None if self.row.ratio is None else (self.row.ratio - 1.0) * 100.0

    @property
    def change_ci_pct(self) -> tuple[float, float] | None:
        ci = self.row.ratio_ci
        return None if ci is None else ((ci[0] - 1.0) * 100.0, (ci[1] - 1.0) * 100.0)


def baselines(cells: Sequence[CellRow], selector: dict[str, str]) -> dict[str, CellRow]:
    """host -> its baseline cell. The default selector picks the bare-metal cell of each host; a
    chosen one (`nic=virtio`) must match one cell per host."""
    if selector.get("kind") == BARE_METAL and "isolation" not in selector:
        # the host itself: with isolation = ["vm", "container"] a host has a bare-metal cell of each
        selector = {**selector, "isolation": ISOLATION_DEFAULT}
    chosen = select(cells, selector)
    if not chosen:
        what = (
            "no bare-metal cell (set [suite] bare_metal = true)"
            if selector.get("kind") == BARE_METAL
            else f"no cell matches {_sel(selector)}"
        )
        raise UsageError(f"--baseline: this run has {what}")
    out: dict[str, CellRow] = {}
    for c in chosen:
        host = str(c.axes.get("host"))
        if host in out:
            raise UsageError(
                f"--baseline {_sel(selector)} matches {out[host].cell_id} and {c.cell_id} on host "
                f"{host}; it must name one cell per host"
            )
        out[host] = c
    return out


def overheads(
    cells: Sequence[CellRow],
    samples: Sequence[SampleRow],
    selector: dict[str, str],
    *,
    seed: int = 0,
    everything: bool = False,
    n_resamples: int = stats.DEFAULT_N_RESAMPLES,
    noise: dict[tuple[str, str], stats.RatioCI] | None = None,
    margin_pct: float = verdicts.DEFAULT_MARGIN_PCT,
) -> list[Overhead]:
    """Every (non-twin) cell against the baseline cell of its host, per metric, as one comparison
    (its primary rows corrected together; `noise`: the run's A/A bands, the margins). A host
    without a baseline cell compares against the only baseline there is, if there is exactly one."""
    refs = baselines(cells, selector)
    ref_ids = {c.cell_id for c in refs.values()}
    by_label: dict[str, dict[tuple[str, str], results.Series]] = {}
    for s in results.series(samples, cells):
        by_label.setdefault(s.cell, {})[(s.workload, s.metric)] = s
    side_a: dict[Key, compare_mod.MetricSeries] = {}
    side_b: dict[Key, compare_mod.MetricSeries] = {}
    reference: dict[str, str] = {}  # cell label -> its baseline's
    for c in cells:
        if c.cell_id in ref_ids or is_twin(c):
            continue
        ref = refs.get(str(c.axes.get("host"))) or (next(iter(refs.values())) if len(refs) == 1 else None)
        if ref is None:
            continue
        reference[c.label] = ref.label
        base, mine = by_label.get(ref.label, {}), by_label.get(c.label, {})
        for wm in set(base) | set(mine):
            if not comparable(mine.get(wm) or base[wm], everything):
                continue
            for found, out in ((base.get(wm), side_a), (mine.get(wm), side_b)):
                if found is not None:
                    out[(c.label, *wm)] = metric_series(found)
    rows = compare_mod.compare(
        side_a,
        side_b,
        seed=seed,
        n_resamples=n_resamples,
        noise_floor=bands(noise, set(side_a) | set(side_b)),
        margin_pct=margin_pct,
    )
    order = {label: i for i, label in enumerate(c.label for c in cells)}
    rows.sort(key=lambda r: (order[r.key[0]], r.key[1], r.key[2]))  # cells in run order, as before
    return [Overhead(r.key[0], reference[r.key[0]], r) for r in rows]


def fmt_change(pct: float | None, ci: tuple[float, float] | None = None) -> str:
    """-0.52 % [-0.91, -0.13] (a real minus sign)."""
    if pct is None or math.isnan(pct):
        return "–"

    def one(v: float) -> str:
        if math.isinf(v):
            return "∞" if v > 0 else "−∞"
        return f"{v:+.2f}".replace("-", "−")

    text = f"{one(pct)} %"
    if ci is not None:
        text += f" [{one(ci[0])}, {one(ci[1])}]"
    return text
