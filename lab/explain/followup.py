"""The follow-up cells of an explanation as a lab: the parent run's lab.toml with its matrix made of
the knobs' two values, its suite narrowed to the explained workloads, and the design's points as
cells of that matrix (lab.plan), handed to the runner as a plan of cells.

Also here: which knobs give one configuration whatever their value (cc = cubic on a guest whose
default is cubic: lab.plan.static_signature), whether the hosts can make every follow-up cell
(lab.check: a warm start where the host keeps no snapshots is refused before anything exists),
and which cells the store already holds with the same configuration, to be reused.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from typing import Any

from lab import config, images, plan
from lab.axes import AXES_TABLE, moot
from lab.errors import ConfigError, LabError, UsageError
from lab.explain import record as rec
from lab.explain.design import Levels
from lab.explain.knobs import Knob
from lab.labconfig import LabConfig
from lab.store import CellRow, RunRow, Store

HEADER = (
    "# lab explain: a follow-up run of {parents}. Its cells are not this file's matrix: they are the\n"
    "# points of the design in the run's manifest (\"explain\"), made from the knobs' two values.\n"
)


@dataclass
class Base:
    """What the follow-up labs are made from: the parent's lab.toml, A's axes and parameters."""

    data: dict[str, Any]  # the parent run's lab.toml, parsed
    source: str  # where it was read from (relative paths in it are relative to its folder)
    text: str
    axes_a: dict[str, Any]  # every axis of cell A (lab.explain.knobs.full_axes)
    params_a: dict[str, dict[str, Any]]  # workload -> A's run's parameters (its manifest)


def base(store: Store, run: RunRow, axes_a: dict[str, Any], params_a: dict[str, dict[str, Any]]) -> Base:
    text = store.config_text(run.id)
    if not text.strip():
        raise UsageError(f"run {run.id} holds no lab.toml text to make follow-up cells from")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"run {run.id}: its stored lab.toml does not parse any more: {exc}") from None
    return Base(data, run.config_path or "lab.toml", text, axes_a, params_a)


def point_axes(b: Base, knobs: list[Knob], levels: Levels) -> dict[str, Any]:
    """Every axis of a point: A's, with each axis knob at the point's level (and its riders)."""
    out = dict(b.axes_a)
    for knob, level in zip(knobs, levels, strict=True):
        if knob.kind != "axis":
            continue
        out[knob.name] = knob.value(level)
        for name, va, vb in knob.also:
            out[name] = vb if level else va
    for name in moot(out):
        out[name] = None
    return out


def point_params(b: Base, knobs: list[Knob], levels: Levels, workloads: list[str]) -> dict[str, dict[str, Any]]:
    """The explained workloads' parameters at a point: A's, with each parameter knob at its level."""
    out = {w: dict(b.params_a.get(w) or {}) for w in workloads}
    for knob, level in zip(knobs, levels, strict=True):
        if knob.kind == "param" and knob.workload in out:
            out[knob.workload][knob.param] = knob.value(level)
    return out


def lab_for(
    b: Base,
    knobs: list[Knob],
    params: dict[str, dict[str, Any]],
    *,
    workloads: list[str],
    repetitions: int | None,
) -> LabConfig:
    """The follow-up lab: the parent's, with a matrix of the knobs' values (A's elsewhere), the
    explained workloads only, with `params`, no A/A twin and no bare-metal cell. A knob a host
    cannot flip is one line naming it (UsageError, exit 2), as the config check words it."""
    matrix: dict[str, list[Any]] = {}
    for axis in AXES_TABLE:
        value = b.axes_a.get(axis.name)
        matrix[axis.name] = [axis.plain(axis.default) if value is None else value]
    for knob in knobs:
        if knob.kind != "axis":
            continue
        matrix[knob.name] = list(dict.fromkeys([knob.a, knob.b]))
        for name, va, vb in knob.also:
            matrix[name] = list(dict.fromkeys([va, vb]))
    suite = dict(b.data.get("suite") or {})
    suite.update(workloads=list(workloads), noise_floor=False, bare_metal=False, params=params)
    if repetitions is not None:
        suite["repetitions"] = repetitions
    data = {**b.data, "matrix": {**matrix, "exclude": []}, "suite": suite}
    try:
        return config.parse(data, b.source)
    except ConfigError as exc:
        which = _which(knobs, exc)
        if which is None:
            raise UsageError(f"lab explain: the follow-up cells cannot be made here: {exc}", hint=exc.hint) from None
        raise UsageError(
            f"lab explain: knob {which.text()} cannot be tested here: {exc.problem}", hint=exc.hint
        ) from None


def _which(knobs: list[Knob], exc: ConfigError) -> Knob | None:
    """The knob a config error is about (its matrix axis or workload parameter), if any."""
    for knob in knobs:
        axes = [knob.name] if knob.kind == "axis" else []
        axes += [n for n, _, _ in knob.also]
        if any(exc.key == f"matrix.{n}" or exc.key.startswith((f"matrix.{n}[", f"matrix.{n}.")) for n in axes):
            return knob
        if knob.kind == "param" and exc.key.startswith(f"suite.params.{knob.workload}"):
            return knob
    return None


def cells_for(cfg: LabConfig, b: Base, knobs: list[Knob], points: list[Levels]) -> dict[Levels, plan.Cell]:
    """The matrix cell of each point (lab.plan: its id and label, as any run's)."""
    by_axes = {_key(_plain(c)): c for c in plan.cells(cfg)}
    out = {}
    for levels in points:
        cell = by_axes.get(_key(point_axes(b, knobs, levels)))
        if cell is None:  # the matrix is made of the knobs' values: every point is one of its cells
            raise LabError(f"lab explain: no follow-up cell for point {levels} (a bug)")
        out[levels] = cell
    return out


def _plain(cell: plan.Cell) -> dict[str, Any]:
    values = {a.name: a.plain(getattr(cell, a.name)) for a in AXES_TABLE}
    for name in moot(values):
        values[name] = None
    return values


def _key(axes: dict[str, Any]) -> tuple:
    return tuple(str(axes.get(a.name)) for a in AXES_TABLE)


def same_in_effect(cfg: LabConfig, b: Base, knobs: list[Knob]) -> list[tuple[Knob, str]]:
    """The axis knobs whose two values give the same configuration (the guest's default cc named,
    a WAN profile of zeros): (knob, why), known before any cell boots."""
    k = len(knobs)
    base_levels = (0,) * k
    flips = [tuple(1 if i == j else 0 for i in range(k)) for j in range(k)]
    cells = cells_for(cfg, b, knobs, [base_levels, *flips])
    a_sig = plan.static_signature(cfg, cells[base_levels])
    out = []
    for j, levels in enumerate(flips):
        knob = knobs[j]
        if knob.kind == "axis" and plan.static_signature(cfg, cells[levels]) == a_sig:
            out.append((knob, f"{knob.name} = {knob.b} is the same configuration as {knob.a} here"))
    return out


# -- cells the store already holds -------------------------------------------------------------------


def image_digest(name: str) -> str | None:
    """The recipe digest of the image as built now (None: not built, nothing to reuse against)."""
    try:
        return images.load(name).digest
    except LabError:
        return None


def candidate_runs(store: Store, record: rec.Record, lab_name: str) -> list[RunRow]:
    """Runs whose cells may stand for a point: the parent runs, earlier follow-ups of the question,
    and other runs of the same lab on hosts with the same fingerprint as the parent's."""
    family = set(record.parents) | set(record.runs)
    parent_fp = {h: f.get("fingerprint") for h, f in store.host_facts.of_run(record.a.run).items()}
    out = []
    for run in store.runs():
        if run.id in family:
            out.append(run)
        elif run.name == lab_name and rec.KEY not in run.manifest:
            fps = {h: f.get("fingerprint") for h, f in store.host_facts.of_run(run.id).items()}
            if fps and all(parent_fp.get(h) == fp for h, fp in fps.items()):
                out.append(run)
    return out


def reusable(
    store: Store,
    runs: list[RunRow],
    axes: dict[str, Any],
    params: dict[str, dict[str, Any]],
    digest: str | None,
) -> list[rec.Source]:
    """The stored cells with a point's configuration: the same axes, the same image build, the same
    parameters of every explained workload, done (or a duplicate of a done cell); no A/A twin."""
    out = []
    for run in runs:
        recorded = run.manifest.get("workloads") or {}
        if any(recorded.get(w) != p for w, p in params.items()):
            continue
        for cell in store.cells(run.id):
            if _matches(cell, axes, digest):
                out.append((run.id, cell.cell_id))
    return out


def _matches(cell: CellRow, axes: dict[str, Any], digest: str | None) -> bool:
    if cell.status not in ("done", "duplicate") or "replica" in cell.axes or cell.axes.get("kind", "vm") != "vm":
        return False
    if digest is not None and cell.facts.get("image_digest") not in (None, digest):
        return False
    values = {a.name: cell.axes.get(a.name, a.plain(a.default)) for a in AXES_TABLE}
    for name in moot(values):
        values[name] = None
    return _key(values) == _key(axes)


def config_text(b: Base, parents: list[str]) -> str:
    """What a follow-up run stores as its lab.toml: the parent's, with a header saying its cells
    are the design's (the file itself never had them)."""
    return HEADER.format(parents=", ".join(parents)) + b.text
