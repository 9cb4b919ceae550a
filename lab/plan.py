"""Pure: the matrix axes minus the excludes -> the list of cells, in a recorded order."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from lab.config import AXES, LabConfig
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

    @property
    def id(self) -> str:
        """Short, stable, readable: what a user types in `lab show --cell`."""
        return f"c{self.index:02d}"

    @property
    def label(self) -> str:
        return (f"{self.host}/{self.image}/{self.nic.value}/{self.vcpus}c/{self.memory_mib}m"
                f"/{self.disk_bus.value}/{self.clone.value}/{self.tuning}")

    def axes(self) -> dict[str, object]:
        return {
            "host": self.host, "image": self.image, "nic": self.nic.value, "vcpus": self.vcpus,
            "memory_mib": self.memory_mib, "disk_bus": self.disk_bus.value, "clone": self.clone.value,
            "tuning": self.tuning,
        }


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
                                   m.clone, m.tuning):
        index += 1
        cell = Cell(index, *combo)
        if not _excluded(cell.axes(), m.exclude):
            out.append(cell)
    return out


def order(cells_: list[Cell], how: str, seed: int) -> list[Cell]:
    """Run order. "random" shuffles with a recorded seed so host drift is not mistaken for a
    difference between cells, and the same seed replays the same order."""
    if how == "random":
        shuffled = list(cells_)
        random.Random(seed).shuffle(shuffled)
        return shuffled
    return list(cells_)


assert set(AXES) == set(Cell.__dataclass_fields__) - {"index"}
