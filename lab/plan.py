"""Pure: the matrix axes minus the excludes -> the list of cells, in a recorded order.

Besides the matrix cells a run can hold two kinds of extra cell ([suite] options):
- an A/A twin (`noise_floor = true`): the first cell once more, as its own VM, so comparisons can
  show how much two identical setups differ (id `c01-aa`, label `<label>#aa`);
- a bare-metal cell per local host and isolation kind (`bare_metal = true`): the suite run on the
  host itself, the baseline of "VM x % vs bare metal" tables (id `bm01`, label `<host>/bare-metal`),
  or in a container on it (`<host>/bare-metal/isolation=container`), one per container runtime.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from lab import axes as axes_table, backends, osfacts, stats, tuning, verdicts
from lab.axes import AXES_TABLE
from lab.errors import UsageError
from lab.labconfig import KNOWN_IMAGES, LabConfig
from lab.model import BARE_METAL, MADE_BY_HOST, TWIN_SUFFIX, ImageRef, Isolation, Runtime, VmSpec
from lab.workloads import load_all
from lab.workloads.toolkit import effective_params


class _CellBase:
    """A matrix cell: `index` (its 1-based position in the matrix: the same lab.toml gives the same
    index), one attribute per axis of lab.axes (cell.nic, cell.vcpus, ...) and `replica` (2: the
    A/A twin of the cell with the same axes, [suite] noise_floor)."""

    kind: ClassVar[Literal["vm"]] = "vm"  # a Literal: `unit.kind == "vm"` tells the type checker which Unit
    index: int
    replica: int

    @property
    def id(self) -> str:
        """Short, stable, readable: what a user types in `lab show --cell`."""
        return f"c{self.index:02d}" + ("" if self.replica == 1 else "-aa")

    @property
    def label(self) -> str:
        return axes_table.label(self.values()) + ("" if self.replica == 1 else TWIN_SUFFIX)

    def values(self) -> dict[str, Any]:
        """Every axis -> this cell's value (enums as enums)."""
        return {a.name: getattr(self, a.name) for a in AXES_TABLE}

    def axes(self) -> dict[str, object]:
        """What the store records with the cell and its samples: optional axes only when set."""
        out: dict[str, object] = axes_table.as_dict(self.values())
        if self.replica != 1:
            out["replica"] = self.replica
        return out

    def machine(self) -> tuple:
        """The machine's shape (the axes marked `machine`) and the replica: part of both signatures."""
        return (*(a.plain(getattr(self, a.name)) for a in AXES_TABLE if a.machine), self.replica)


# The cell record, generic over the axes table: index, one field per axis (in table order, each
# with its axis's default), replica. Frozen and hashable; dataclasses.replace works on it.
if TYPE_CHECKING:
    # What the type checker sees: it cannot read the fields make_dataclass adds, so an axis
    # attribute (cell.nic, cell.vcpus, ...) is Any to it; index, replica and the methods are typed.
    @dataclasses.dataclass(frozen=True, init=False)
    class Cell(_CellBase):
        index: int
        replica: int = 1

        def __init__(self, index: int, *values: Any, replica: int = 1, **axes: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...
else:
    Cell = dataclasses.make_dataclass(
        "Cell",
        [
            ("index", int),
            *[(a.name, a.element, dataclasses.field(default=a.default)) for a in AXES_TABLE],
            ("replica", int, dataclasses.field(default=1)),
        ],
        bases=(_CellBase,),
        frozen=True,
    )
    Cell.__module__ = __name__


@dataclass(frozen=True)
class BareMetalCell:
    """The suite run on a host itself (lab.backends.local.baremetal): the baseline VMs are measured against."""

    index: int  # 1-based among the bare-metal cells
    host: str
    order_index: int  # position after the matrix cells (store ordering)
    isolation: Isolation = Isolation.VM  # "vm": on the host itself (lab.isolation)
    runtime: Runtime = Runtime.PODMAN  # a container's (lab.isolation.RUNTIMES)

    kind: ClassVar[Literal["bare-metal"]] = BARE_METAL

    @property
    def id(self) -> str:
        return f"bm{self.index:02d}"

    @property
    def label(self) -> str:
        return f"{self.host}/{BARE_METAL}" + "".join(
            axes_table.axis(n).in_label(getattr(self, n)) for n in ("isolation", "runtime")
        )

    def axes(self) -> dict[str, object]:
        out: dict[str, object] = {"host": self.host, "kind": BARE_METAL}
        for name in ("isolation", "runtime"):
            if getattr(self, name) != axes_table.axis(name).default:
                out[name] = getattr(self, name).value
        return out


Unit = Cell | BareMetalCell  # anything a run schedules


def _excluded(axes: dict[str, object], excludes: list[dict[str, object]]) -> bool:
    for ex in excludes:
        if ex and all(str(axes.get(k)) == str(v) for k, v in ex.items()):
            return True
    return False


# The most combinations of a matrix that are expanded (lab.check refuses more, before excludes):
# `make bench`'s scale test has 50,000; every one becomes a cell record before any check runs.
MAX_COMBINATIONS = 100_000


def combinations(matrix: Any) -> int:
    """Pure: how many combinations the axes make, before excludes (counted, not listed)."""
    return math.prod(len(getattr(matrix, a.name)) for a in AXES_TABLE)


def cells(cfg: LabConfig) -> list[Cell]:
    """Every combination of the matrix's values, in table order, minus `exclude`. An excluded
    combination keeps its index, so ids do not move when an exclude is added."""
    m = cfg.matrix
    if combinations(m) > MAX_COMBINATIONS:  # lab.check says so in one line first
        raise UsageError(f"the matrix has {combinations(m)} combinations; at most {MAX_COMBINATIONS} are expanded")
    unset = {a.name: a.plain(a.default) for a in AXES_TABLE if a.optional}  # exclude may name them
    out: list[Cell] = []
    for index, combo in enumerate(itertools.product(*(getattr(m, a.name) for a in AXES_TABLE)), start=1):
        cell = Cell(index, *combo)
        # An axis that means nothing for this cell (a VM cell's container runtime): one cell, with
        # the axis's default, stands for every value listed; the others are not cells.
        moot = axes_table.moot(cell.values())
        if any(getattr(cell, n) != getattr(m, n)[0] for n in moot):
            continue
        cell = replace(cell, **{n: axes_table.axis(n).default for n in moot})
        if not _excluded({**unset, **cell.axes()}, m.exclude):
            out.append(cell)
    return out


def vm_spec(
    cell: Cell, image: ImageRef, *, run_id: str, expires_at: float = 0.0, place: str = "", owner: str = ""
) -> VmSpec:
    """What a cell asks its host's backend to make: the VmSpec fields the axes table marks `in_spec`,
    on `place` of the host (its lane's, lab.runner.lanes) if it has places."""
    name = f"lab-{run_id}-{cell.id}"
    return VmSpec(
        name=name,
        run_id=run_id,
        cell_id=cell.id,
        image=image,
        expires_at=expires_at,
        owner=owner,
        place=place,
        labels={"run": run_id, "cell": cell.id},
        **{a.name: getattr(cell, a.name) for a in AXES_TABLE if a.in_spec},
    )


def units(cfg: LabConfig) -> list[Unit]:
    """Everything a run measures: the matrix cells, the A/A twin of the first one if
    [suite] noise_floor, and a bare-metal cell per host that can run one and per isolation kind of
    the matrix (the host itself first) if [suite] bare_metal."""
    matrix = cells(cfg)
    out: list[Unit] = list(matrix)
    last = max((c.index for c in out), default=0)
    if cfg.suite.noise_floor and matrix:
        out.append(replace(matrix[0], replica=2))
    if cfg.suite.bare_metal:
        hosts = [h for h in cfg.matrix.host if backends.capabilities(cfg.hosts[h]).bare_metal]
        # a zone is its host's machine (backend smartos): the local host has no bare-metal zone
        kinds = sorted((k for k in cfg.matrix.isolation if k not in MADE_BY_HOST), key=lambda k: k != Isolation.VM)
        places = [
            (k, rt) for k in kinds for rt in (cfg.matrix.runtime if k == Isolation.CONTAINER else [Runtime.PODMAN])
        ]
        both = [(h, k, rt) for h in hosts for k, rt in places]
        out += [BareMetalCell(i, h, last + 1 + i, k, rt) for i, (h, k, rt) in enumerate(both, start=1)]
    return out


def static_signature(cfg: LabConfig, cell: Cell) -> tuple:
    """Pure: what a cell's guest would be, as far as it is known before booting it: the machine,
    the sysctls the profile sets, the congestion control in effect (the axis, else the profile's,
    else the OS's default), the offloads asked for and the netem parameters (a profile of zeros is
    no emulation). A cell whose knobs cannot apply keeps its own names (it is n/a, not a twin)."""
    facts = osfacts.facts(KNOWN_IMAGES[cell.image])
    machine = cell.machine()
    sysctls = tuning.render(facts.name, cell.tuning)
    if sysctls is None or (cell.cc != "default" and cell.cc not in facts.cc_available):
        return machine + ("n/a", cell.tuning, cell.cc, cell.offloads, cell.wan)
    sysctls = dict(sysctls)
    cc = cell.cc if cell.cc != "default" else sysctls.get(facts.cc_key) or facts.cc_default
    sysctls.pop(facts.cc_key, None)
    wan = cfg.wan.get(cell.wan)
    wan_key = None if wan is None or wan.is_null else tuple(sorted(wan.model_dump().items()))
    return machine + (
        tuple(sorted(sysctls.items())),
        cc,
        tuple(sorted(tuning.parse_offloads(cell.offloads).items())),
        wan_key,
    )


def effective_signature(cell: Cell, in_effect: dict) -> str:
    """Pure: a booted cell's machine and the tuning read back from its guest (`in_effect`: the
    cell's "tuning" facts), never the names asked for. Two cells with the same signature ran the
    same configuration; the later is a duplicate (found by read-back)."""
    return json.dumps(
        [
            *cell.machine(),
            in_effect["effective"],
            in_effect["cc"]["effective"],
            in_effect["offloads"]["effective"],
            in_effect["wan"].get("netem"),
        ],
        sort_keys=True,
        default=str,
    )


def equivalents(cfg: LabConfig, cells_: list[Unit]) -> dict[str, str]:
    """Cells that would run the same effective configuration as an earlier cell: {later id: earlier
    id}. They are reported by `lab plan` and recorded as duplicates by `lab run`, not run twice."""
    seen: dict[tuple, str] = {}
    dup: dict[str, str] = {}
    for c in sorted((u for u in cells_ if isinstance(u, Cell)), key=lambda u: (u.replica, u.index)):
        sig = static_signature(cfg, c)
        if sig in seen:
            dup[c.id] = seen[sig]
        else:
            seen[sig] = c.id
    return dup


def store_index(unit: Unit, n_matrix: int) -> int:
    """Where a unit sorts in the store's cell list: matrix cells by index, then twins, then bare metal."""
    if isinstance(unit, BareMetalCell):
        return n_matrix + 1000 + unit.index
    return unit.index if unit.replica == 1 else n_matrix + 500 + unit.index


def order(cells_: list[Unit], how: str, seed: int) -> list[Unit]:
    """Run order. "random" and "interleaved" shuffle with a recorded seed so host drift is not
    mistaken for a difference between cells, and the same seed replays the same order."""
    if how in ("random", "interleaved"):
        shuffled = list(cells_)
        random.Random(seed).shuffle(shuffled)
        return shuffled
    return list(cells_)


def round_order(cells_: list[Unit], seed: int, round_no: int) -> list[Unit]:
    """The order of one round of an interleaved run: a fresh shuffle per round. Each cell draws its
    place from the run's seed, the round and its own id only, so the order of the others does not
    change when a cell has dropped out (failed, or measured enough) in an earlier round."""
    return sorted(cells_, key=lambda c: (random.Random(f"{seed}/round/{round_no}/{c.id}").random(), c.id))


def rounds(repetitions: int, per_boot: int) -> list[int]:
    """Fixed n in an interleaved run: how many measured repetitions each round (boot) runs."""
    full, rest = divmod(repetitions, per_boot)
    return [per_boot] * full + ([rest] if rest else [])


def comparisons(cells_: list[Unit]) -> list[tuple[str, list[str]]]:
    """The comparisons a run's cells allow: (axis, its values) for each matrix axis along which two
    cells differ in that axis only, and ("kind", ["vm", "bare-metal"]) with a bare-metal cell."""
    vms = [c for c in cells_ if isinstance(c, Cell) and c.replica == 1]
    out = []
    for axis in AXES_TABLE:
        groups: dict[tuple, set] = {}
        for c in vms:
            rest = tuple(str(axis_.plain(getattr(c, axis_.name))) for axis_ in AXES_TABLE if axis_ is not axis)
            groups.setdefault(rest, set()).add(str(axis.plain(getattr(c, axis.name))))
        paired = {v for vals in groups.values() if len(vals) > 1 for v in vals}
        if paired:
            order = [str(axis.plain(getattr(c, axis.name))) for c in vms]
            out.append((axis.name, sorted(paired, key=order.index)))
    if vms and any(isinstance(c, BareMetalCell) for c in cells_):
        out.append(("kind", ["vm", BARE_METAL]))
    return out


def comparison_pairs(cells_: list[Unit]) -> list[tuple[str, str]]:
    """The pairs of matrix cells a comparison of this run will put side by side: every two that
    differ in one axis only (the earlier cell first), in matrix order. What adaptive repetition
    decides (lab.schedule.Asked); the A/A twins and bare-metal cells are not among them."""
    vms = [c for c in cells_ if isinstance(c, Cell) and c.replica == 1]
    ids = [c.id for c in vms]
    plain = [tuple(str(a.plain(getattr(c, a.name))) for a in AXES_TABLE) for c in vms]
    found: set[tuple[int, int]] = set()
    for k in range(len(AXES_TABLE)):  # cells alike in every other axis, per axis: linear, not quadratic
        groups: dict[tuple, list[int]] = {}
        for i, values in enumerate(plain):
            groups.setdefault(values[:k] + values[k + 1 :], []).append(i)
        found.update((x, y) for same in groups.values() for j, x in enumerate(same) for y in same[j + 1 :])
    return [(ids[x], ids[y]) for x, y in sorted(found)]


def twin_pairs(cells_: list[Unit]) -> list[tuple[str, str]]:
    """(cell id, its A/A twin's id) for each twin of the run ([suite] noise_floor)."""
    return [(replace(c, replica=1).id, c.id) for c in cells_ if isinstance(c, Cell) and c.replica != 1]


def primary_rows(cfg: LabConfig) -> int:
    """How many primary rows a comparison of two cells of this lab tests: each workload's
    headline metrics (lab.workloads.PrimaryMetrics) with the lab's parameters."""
    found = load_all()
    return sum(
        found[w].primary_metrics.count(effective_params(found[w].defaults, cfg.suite.params.get(w)))
        for w in cfg.suite.workloads
        if w in found
    )


def verdict_reach(
    cells_: list[Unit],
    n: int,
    *,
    rows: int,
    setting: str,
    alpha: float = verdicts.DEFAULT_ALPHA,
    margin_pct: float = verdicts.DEFAULT_MARGIN_PCT,
) -> tuple[bool, str]:
    """Can the comparisons these cells allow give verdicts with `n` repetitions a side? Better or
    worse needs the exact Mann-Whitney test's smallest p (lab.stats.min_exact_p) corrected over the
    `rows` primary rows a comparison tests (lab.verdicts.best_q: one changed row alone) below
    alpha; "same" needs the CI of the ratio inside ±margin_pct, which depends on the metric's CV
    (lab.verdicts.same_reach_cv). (True, what it can reach) or (False, one warning line naming
    `setting` and the n that would do). (True, "") with nothing to compare."""
    found = comparisons(cells_)
    if not found:
        return True, ""
    what = " and ".join(f"{axis} {' vs '.join(values)}" for axis, values in found)
    best = stats.min_exact_p(n, n)
    if best >= alpha:
        enough = next(k for k in range(n + 1, 100) if stats.min_exact_p(k, k) < alpha)
        return False, (
            f"{setting}: {what} can reach p = {best:.2g} at best, never < {alpha:g}; "
            f"repetitions = {enough} gives {stats.min_exact_p(enough, enough):.2g}, "
            f"{enough + 1} gives {stats.min_exact_p(enough + 1, enough + 1):.2g}"
        )
    q = verdicts.best_q(n, rows)
    more = max(n + 1, 2 * n)
    same = (
        f'"same" within ±{margin_pct:g} % (or a wider A/A band) needs a CV below about '
        f"{verdicts.same_reach_cv(n, margin_pct) * 100:.1f} % (repetitions = {more}: "
        f"{verdicts.same_reach_cv(more, margin_pct) * 100:.1f} %)"
    )
    if q >= alpha:
        enough_q = verdicts.n_for_q(rows, alpha)
        return False, (
            f"{setting}: {what}: one changed primary row among the {rows} a comparison tests reaches q = {q:.2g} "
            f"at best after correction, never < {alpha:g} (rows that change together can: each reaches "
            f"{best:.2g} when all do)"
            + (
                f"; repetitions = {enough_q} lets one alone reach {verdicts.best_q(enough_q, rows):.2g}"
                if enough_q
                else ""
            )
            + f"; {same}"
        )
    return True, (
        f"{what} can reach p = {best:.2g} with {n} repetitions a side; one changed primary row among the "
        f"{rows} a comparison tests reaches q = {q:.2g} (better/worse needs < {alpha:g}); {same}"
    )
