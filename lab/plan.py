"""Pure: the matrix axes minus the excludes -> the list of cells, in a recorded order.

Besides the matrix cells a run can hold two kinds of extra cell ([suite] options):
- an A/A twin (`noise_floor = true`): the first cell once more, as its own VM, so comparisons can
  show how much two identical setups differ (id `c01-aa`, label `<label>#aa`);
- a bare-metal cell per local host (`bare_metal = true`): the suite run on the host itself, the
  baseline of "VM x % vs bare metal" tables (id `bm01`, label `<host>/bare-metal`).
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, replace

from lab import osfacts, tuning
from lab.config import AXES, BARE_METAL_BACKENDS, KNOWN_IMAGES, LabConfig, parse_offloads
from lab.model import CloneKind, DiskBus, NicModel


@dataclass(frozen=True)
class Cell:
    index: int  # 1-based position in the matrix (stable: the same lab.toml gives the same index)
    host: str
    image: str
    nic: NicModel
    vcpus: int
    memory_mib: int
    disk_bus: DiskBus
    clone: CloneKind
    tuning: str
    cc: str = "default"
    offloads: str = "default"
    wan: str = "none"
    replica: int = 1  # 2: the A/A twin of the cell with the same axes ([suite] noise_floor)

    kind = "vm"

    @property
    def id(self) -> str:
        """Short, stable, readable: what a user types in `lab show --cell`."""
        return f"c{self.index:02d}" + ("" if self.replica == 1 else "-aa")

    @property
    def label(self) -> str:
        # The network axes appear only when set, so labels of labs without them stay as they were.
        net = "".join(f"/{k}={v}" for k, v in self.network_axes().items())
        return (f"{self.host}/{self.image}/{self.nic.value}/{self.vcpus}c/{self.memory_mib}m"
                f"/{self.disk_bus.value}/{self.clone.value}/{self.tuning}{net}") + ("" if self.replica == 1 else TWIN_SUFFIX)

    def network_axes(self) -> dict[str, str]:
        """cc, offloads and wan where they are not their default."""
        return {k: v for k, v, d in (("cc", self.cc, "default"), ("offloads", self.offloads, "default"),
                                     ("wan", self.wan, "none")) if v != d}

    def axes(self) -> dict[str, object]:
        axes: dict[str, object] = {
            "host": self.host, "image": self.image, "nic": self.nic.value, "vcpus": self.vcpus,
            "memory_mib": self.memory_mib, "disk_bus": self.disk_bus.value, "clone": self.clone.value,
            "tuning": self.tuning, **self.network_axes(),
        }
        if self.replica != 1:
            axes["replica"] = self.replica
        return axes


TWIN_SUFFIX = "#aa"
BARE_METAL = "bare-metal"


@dataclass(frozen=True)
class BareMetalCell:
    """The suite run on a host itself (lab.baremetal): the baseline VMs are measured against."""

    index: int  # 1-based among the bare-metal cells
    host: str
    order_index: int  # position after the matrix cells (store ordering)

    kind = BARE_METAL

    @property
    def id(self) -> str:
        return f"bm{self.index:02d}"

    @property
    def label(self) -> str:
        return f"{self.host}/{BARE_METAL}"

    def axes(self) -> dict[str, object]:
        return {"host": self.host, "kind": BARE_METAL}


Unit = Cell | BareMetalCell  # anything a run schedules


def _excluded(axes: dict[str, object], excludes: list[dict[str, object]]) -> bool:
    for ex in excludes:
        if ex and all(str(axes.get(k)) == str(v) for k, v in ex.items()):
            return True
    return False


def cells(cfg: LabConfig) -> list[Cell]:
    m = cfg.matrix
    out: list[Cell] = []
    index = 0
    for combo in itertools.product(m.host, m.image, m.nic, m.vcpus, m.memory_mib, m.disk_bus,
                                   m.clone, m.tuning, m.cc, m.offloads, m.wan):
        index += 1
        cell = Cell(index, *combo)
        if not _excluded(cell.axes(), m.exclude):
            out.append(cell)
    return out


def units(cfg: LabConfig) -> list[Unit]:
    """Everything a run measures: the matrix cells, the A/A twin of the first one if
    [suite] noise_floor, and a bare-metal cell per host that can run one if [suite] bare_metal."""
    out: list[Unit] = list(cells(cfg))
    last = max((c.index for c in out), default=0)
    if cfg.suite.noise_floor and out:
        out.append(replace(out[0], replica=2))
    if cfg.suite.bare_metal:
        hosts = [h for h in cfg.matrix.host if cfg.hosts[h].backend in BARE_METAL_BACKENDS]
        out += [BareMetalCell(i, h, last + 1 + i) for i, h in enumerate(hosts, start=1)]
    return out


def static_signature(cfg: LabConfig, cell: Cell) -> tuple:
    """Pure: what a cell's guest would be, as far as it is known before booting it: the machine,
    the sysctls the profile sets, the congestion control in effect (the axis, else the profile's,
    else the OS's default), the offloads asked for and the netem parameters (a profile of zeros is
    no emulation). A cell whose knobs cannot apply keeps its own names (it is n/a, not a twin)."""
    facts = osfacts.facts(KNOWN_IMAGES[cell.image])
    machine = (cell.host, cell.image, cell.nic.value, cell.vcpus, cell.memory_mib, cell.disk_bus.value,
               cell.clone.value, cell.replica)
    sysctls = tuning.render(facts.name, cell.tuning)
    if sysctls is None or (cell.cc != "default" and cell.cc not in facts.cc_available):
        return machine + ("n/a", cell.tuning, cell.cc, cell.offloads, cell.wan)
    sysctls = dict(sysctls)
    cc = cell.cc if cell.cc != "default" else sysctls.get(facts.cc_key) or facts.cc_default
    sysctls.pop(facts.cc_key, None)
    wan = cfg.wan.get(cell.wan)
    wan_key = None if wan is None or wan.is_null else tuple(sorted(wan.model_dump().items()))
    return machine + (tuple(sorted(sysctls.items())), cc, tuple(sorted(parse_offloads(cell.offloads).items())), wan_key)


def effective_signature(cell: Cell, in_effect: dict) -> str:
    """Pure: a booted cell's machine and the tuning read back from its guest (`in_effect`: the
    cell's "tuning" facts), never the names asked for. Two cells with the same signature ran the
    same configuration; the later is a duplicate (found by read-back)."""
    return json.dumps([cell.host, cell.image, cell.nic.value, cell.vcpus, cell.memory_mib, cell.disk_bus.value,
                       cell.clone.value, cell.replica, in_effect["effective"], in_effect["cc"]["effective"],
                       in_effect["offloads"]["effective"], in_effect["wan"].get("netem")], sort_keys=True, default=str)


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


assert set(AXES) == set(Cell.__dataclass_fields__) - {"index", "replica"}
