"""The matrix axes, defined once. Pure: no I/O, no project imports beyond lab.model.

Each row says what an axis is and how every part of the lab treats it; the `[matrix]` model of
lab.toml (lab.config), the cell record and its label and `axes()` dict (lab.plan), the plan's
duplicate signatures, the keys `exclude` and `--a/--b` accept, and the columns of `lab plan` and
`lab show` are all built from this table. A new axis is one row here plus the code that applies
it (a VmSpec field and the backends for a machine axis, the tune stage for a guest knob).

Labels read `host/image/nic/<vcpus>c/<memory>m/disk_bus/clone/tuning`, then `/<name>=<value>` for
each optional axis that is not its default, so labels of labs that never set an optional axis
stay as they were when it did not exist.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from lab.model import CloneKind, DiskBus, Isolation, NicModel, Runtime

MAX_VCPUS = 128
MIN_MEMORY_MIB, MAX_MEMORY_MIB = 256, 1024 * 1024


@dataclass(frozen=True)
class Axis:
    name: str  # the [matrix] key, the cell's attribute, the key of its axes() dict
    element: Any  # the type of one value (an enum, or a type with pydantic constraints)
    default: Any  # the one value a lab.toml that does not name the axis gets
    column: str  # its column title in `lab plan`
    label: str = "{}"  # how a value reads in a cell label (mandatory axes; optional ones read name=value)
    cell_text: str = "{}"  # how a value reads in its `lab plan` column
    # Optional: in the label, in axes() and as a plan column only when the lab sets it (not default).
    optional: bool = False
    # Part of the machine's shape (VmSpec or the host it runs on): two cells that differ here are
    # different machines; the other axes are knobs the tune stage applies and reads back.
    machine: bool = False
    in_spec: bool = False  # a VmSpec field of the same name (the backend applies it)
    bare_metal: str = ""  # the bare-metal cell's text in its `lab plan` column
    meaning: str = ""  # one line for the docs' reference (tools/docs_reference.py)

    def plain(self, value: Any) -> Any:
        """The value as it is stored and compared (an enum's string)."""
        return value.value if isinstance(value, enum.Enum) else value

    def in_label(self, value: Any) -> str:
        if self.optional:
            return "" if value == self.default else f"/{self.name}={self.plain(value)}"
        return "/" + self.label.format(self.plain(value))

    def text(self, value: Any) -> str:
        return self.cell_text.format(self.plain(value))


AXES_TABLE: tuple[Axis, ...] = (
    Axis("host", str, "local", "host", machine=True, meaning="the [hosts.NAME] tables the cells run on"),
    Axis(
        "image",
        str,
        "debian12",
        "image",
        machine=True,
        bare_metal="the host itself (bare metal: the baseline)",
        meaning="golden images (`lab images ls`): debian12, alpine3, freebsd14, netbsd10, openbsd7",
    ),
    Axis(
        "nic",
        NicModel,
        NicModel.VIRTIO,
        "nic",
        machine=True,
        in_spec=True,
        bare_metal="veth",
        meaning="the emulated NIC model (what the backend can emulate)",
    ),
    Axis(
        "vcpus",
        Annotated[int, Field(ge=1, le=MAX_VCPUS)],
        2,
        "vcpus",
        label="{}c",
        machine=True,
        in_spec=True,
        bare_metal="all",
        meaning="virtual CPUs of the measured VM",
    ),
    Axis(
        "memory_mib",
        Annotated[int, Field(ge=MIN_MEMORY_MIB, le=MAX_MEMORY_MIB)],
        1024,
        "memory",
        label="{}m",
        cell_text="{} MiB",
        machine=True,
        in_spec=True,
        meaning="memory of the measured VM, MiB",
    ),
    Axis("disk_bus", DiskBus, DiskBus.VIRTIO, "disk", machine=True, in_spec=True, meaning="the disk's bus"),
    Axis(
        "clone",
        CloneKind,
        CloneKind.LINKED,
        "clone",
        machine=True,
        in_spec=True,
        meaning="linked (qcow2 overlay / PVE linked clone / zfs clone) or full",
    ),
    Axis(
        "tuning",
        str,
        "default",
        "tuning",
        bare_metal="as is",
        meaning='sysctl profiles, templates/sysctl/<os>/<profile>.j2; "default" changes nothing',
    ),
    Axis(
        "cc",
        str,
        "default",
        "cc",
        optional=True,
        meaning="TCP congestion control: default (the OS's, or the profile's), cubic, bbr, ...",
    ),
    Axis(
        "offloads",
        str,
        "default",
        "offloads",
        optional=True,
        meaning='NIC offloads: "default" (as the NIC comes) or e.g. "lro=off,tso=on,gro=off"',
    ),
    Axis("wan", str, "none", "wan", optional=True, meaning='"none" or a [wan.NAME] profile (netem)'),
    # cold: boot; warm: restore a post-boot memory snapshot of the same machine shape (the backend's
    # clone/start/wait_ready do it; Capabilities.snapshots says which hosts can)
    Axis(
        "start",
        Literal["cold", "warm"],
        "cold",
        "start",
        optional=True,
        machine=True,
        in_spec=True,
        meaning="cold (boot), or warm: restore a post-boot memory snapshot of the same machine shape",
    ),
    # Where the suite runs on the machine (lab.isolation): the machine itself, or a container on it.
    # A machine axis: a container cell is a different place to measure, never a twin of its VM cell.
    # Zones are the host's to make (VmSpec.isolation, in_spec); containers are made in the guest.
    Axis(
        "isolation",
        Isolation,
        Isolation.VM,
        "isolation",
        optional=True,
        machine=True,
        in_spec=True,
        meaning="where the suite runs: the VM itself, a container in it, or a SmartOS zone",
    ),
    # The container runtime of a container cell (lab.isolation.RUNTIMES); other cells have none, so
    # lab.plan.cells keeps one of them per runtime list, with the default (see ONLY_IN).
    Axis(
        "runtime",
        Runtime,
        Runtime.PODMAN,
        "runtime",
        optional=True,
        machine=True,
        meaning="the container runtime of a container cell",
    ),
)

# [matrix] exclude, for the docs' reference (lab.plan.cells applies it)
EXCLUDE_MEANING = "cells to leave out: each table names axis values, and a cell that has all of them is skipped"

# Axes that mean something only for some cells: axis -> (the axis it depends on, the value that gives
# it a meaning). A cell without that value has the default (lab.plan.cells).
ONLY_IN: dict[str, tuple[str, Any]] = {"runtime": ("isolation", Isolation.CONTAINER)}
# Axes that mean nothing for cells with one value of another axis: axis -> (that axis, the value).
# A zone (backend smartos) is made by its host, not cloned from the golden image or restored: its
# NIC is a vnic with no emulated model and its disk a ZFS dataset on no bus.
NOT_IN: dict[str, tuple[str, Any]] = {n: ("isolation", Isolation.ZONE) for n in ("nic", "disk_bus", "clone", "start")}

BY_NAME: dict[str, Axis] = {a.name: a for a in AXES_TABLE}
AXES: tuple[str, ...] = tuple(BY_NAME)  # the names, in label order
MACHINE: tuple[str, ...] = tuple(a.name for a in AXES_TABLE if a.machine)
KNOBS: tuple[str, ...] = tuple(a.name for a in AXES_TABLE if not a.machine)
SPEC: tuple[str, ...] = tuple(a.name for a in AXES_TABLE if a.in_spec)


def moot(values: Mapping[str, Any]) -> set[str]:
    """Pure: the axes that mean nothing for a cell with these axis values (ONLY_IN); the values may
    be enums or their stored strings, and a missing one is not the value that gives a meaning."""
    out = {n for n, (on, want) in ONLY_IN.items() if BY_NAME[on].plain(values.get(on)) != BY_NAME[on].plain(want)}
    return out | {n for n, (on, no) in NOT_IN.items() if BY_NAME[on].plain(values.get(on)) == BY_NAME[on].plain(no)}


def applies(name: str, unit: Any) -> bool:
    """Does axis `name` mean something for `unit` (a matrix or bare-metal cell)?"""
    return name not in moot({on: getattr(unit, on, None) for on, _ in (*ONLY_IN.values(), *NOT_IN.values())})


def axis(name: str) -> Axis:
    return BY_NAME[name]


def label(values: dict[str, Any]) -> str:
    """`values`: every axis name -> value. The cell's label (without the A/A twin's suffix)."""
    return "".join(a.in_label(values[a.name]) for a in AXES_TABLE).removeprefix("/")


def as_dict(values: dict[str, Any]) -> dict[str, Any]:
    """The axes a cell records with its samples: every mandatory axis, optional ones when set."""
    return {a.name: a.plain(values[a.name]) for a in AXES_TABLE if not (a.optional and values[a.name] == a.default)}


def knobs_set(axes: dict[str, Any]) -> bool:
    """Does a cell (its stored axes dict) set any knob the tune stage applies?"""
    return any(axes.get(a.name, a.plain(a.default)) != a.plain(a.default) for a in AXES_TABLE if not a.machine)


def shown_columns(matrix: Any) -> list[Axis]:
    """The axes `lab plan` gives a column: every mandatory one, an optional one when the lab sets it."""
    return [a for a in AXES_TABLE if not a.optional or list(getattr(matrix, a.name)) != [a.default]]
