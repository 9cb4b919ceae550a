"""Pure: what differs between cell A and cell B, sorted into what the lab can flip and what not.

Knobs (the lab flips them in follow-up cells):
- every matrix axis whose value differs (lab.axes: nic, vcpus, tuning, cc, offloads, wan, start,
  isolation, runtime, host, image, ...). An axis that means something only with another one's value
  (a container's runtime with isolation = container) rides with that knob (`Knob.also`);
- every parameter of an explained workload that differs between the two runs' recorded parameters
  (the manifest's "workloads": [suite.params] as the run used them).

Untestable differences (listed, never dropped): the host facts that differ (CPU, microcode,
kernel, QEMU or hypervisor version: lab.hostinfo), an image rebuilt between the two runs, the
accelerator each cell ran under. With a host knob, its facts ride with it: the lab flips the host
as a whole, not its facts one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lab import hostinfo
from lab.axes import AXES_TABLE, BY_NAME, NOT_IN, ONLY_IN, moot
from lab.store import CellRow


@dataclass(frozen=True)
class Knob:
    name: str  # an axis ("nic") or a workload parameter ("iperf3-tcp.streams")
    a: Any  # its value in cell A (as stored: an enum's string)
    b: Any
    workload: str = ""  # a parameter's workload; "" for an axis
    # axes that mean something only with this one's value (runtime rides with isolation): (axis, A's, B's)
    also: tuple[tuple[str, Any, Any], ...] = ()

    @property
    def kind(self) -> str:
        return "param" if self.workload else "axis"

    @property
    def param(self) -> str:
        """A parameter knob's key in [suite.params.<workload>]."""
        return self.name.removeprefix(f"{self.workload}.")

    def value(self, level: int) -> Any:
        return self.b if level else self.a

    def text(self) -> str:
        extra = "".join(f", {n} {va} → {vb}" for n, va, vb in self.also)
        return f"{self.name} {_shown(self.a)} → {_shown(self.b)}{extra}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "axis": self.name if self.kind == "axis" else None,
            "workload": self.workload or None,
            "a": self.a,
            "b": self.b,
            "also": [{"axis": n, "a": va, "b": vb} for n, va, vb in self.also],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Knob:
        also = tuple((x["axis"], x["a"], x["b"]) for x in d.get("also") or [])
        return cls(d["name"], d["a"], d["b"], d.get("workload") or "", also)


@dataclass(frozen=True)
class Untestable:
    what: str  # "host local: kernel", "image debian12: build"
    a: str
    b: str
    why: str

    def as_dict(self) -> dict[str, str]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Untestable:
        return cls(d["what"], d["a"], d["b"], d["why"])


def _shown(v: Any) -> str:
    return ",".join(str(x) for x in v) if isinstance(v, list) else str(v)


def full_axes(cell: CellRow) -> dict[str, Any]:
    """Every axis of a VM cell with its value (the default where the store left an optional one
    out); an axis that means nothing for the cell (a VM cell's runtime) is None."""
    values = {a.name: cell.axes.get(a.name, a.plain(a.default)) for a in AXES_TABLE}
    for name in moot(values):
        values[name] = None
    return values


def _controller(name: str) -> str:
    return (ONLY_IN.get(name) or NOT_IN[name])[0]


def axis_knobs(a: CellRow, b: CellRow) -> list[Knob]:
    """The axes whose values differ, in matrix order; a dependent axis rides with its controller."""
    fa, fb = full_axes(a), full_axes(b)
    differing = [x.name for x in AXES_TABLE if fa[x.name] != fb[x.name]]
    riders: dict[str, list[tuple[str, Any, Any]]] = {}
    own = []
    for name in differing:
        if fa[name] is None or fb[name] is None:  # means nothing on one side: rides with its controller
            default = BY_NAME[name].plain(BY_NAME[name].default)
            va, vb = (default if v is None else v for v in (fa[name], fb[name]))
            if va != vb:
                riders.setdefault(_controller(name), []).append((name, va, vb))
        else:
            own.append(name)
    return [Knob(n, fa[n], fb[n], also=tuple(riders.get(n, ()))) for n in own]


def param_knobs(
    params_a: dict[str, dict[str, Any]], params_b: dict[str, dict[str, Any]], workloads: list[str]
) -> list[Knob]:
    """Each parameter of an explained workload whose recorded value differs between the runs."""
    out = []
    for w in workloads:
        pa, pb = params_a.get(w) or {}, params_b.get(w) or {}
        for key in sorted(set(pa) | set(pb)):
            if key in pa and key in pb and pa[key] != pb[key]:
                out.append(Knob(f"{w}.{key}", pa[key], pb[key], workload=w))
    return out


HOST_WHY = "a fact of the host: the lab cannot change it"
WITH_HOST_WHY = "differs with the host: flipping the host flips it too, never alone"


def untestable(
    a: CellRow,
    b: CellRow,
    facts_a: dict[str, dict[str, Any]],
    facts_b: dict[str, dict[str, Any]],
    *,
    same_run: bool,
) -> list[Untestable]:
    """What differs between A and B that no follow-up cell can flip. `facts_*`: the host facts of
    each side's run (host -> facts, lab.store)."""
    out: list[Untestable] = []
    host_a, host_b = str(a.axes.get("host")), str(b.axes.get("host"))
    if host_a != host_b or not same_run:
        why = WITH_HOST_WHY if host_a != host_b else HOST_WHY
        name = host_a if host_a == host_b else f"{host_a} / {host_b}"
        for fact, va, vb in hostinfo.differences(facts_a.get(host_a), facts_b.get(host_b)):
            if fact in ("host", "fingerprint"):
                continue
            out.append(Untestable(f"host {name}: {fact}", va, vb, why))
    for fact, label in (("image_digest", "recipe digest"), ("image_sha256", "build (sha256)")):
        fa, fb = a.facts.get(fact), b.facts.get(fact)
        if fa and fb and fa != fb and a.axes.get("image") == b.axes.get("image"):
            out.append(
                Untestable(
                    f"image {a.axes.get('image')}: {label}",
                    str(fa)[:12],
                    str(fb)[:12],
                    "the image was rebuilt between the runs: the lab measures the build it has now",
                )
            )
    acc_a, acc_b = a.facts.get("accel"), b.facts.get("accel")
    if acc_a and acc_b and acc_a != acc_b:
        why = "the backend's probe decides it (KVM usable or not)"
        out.append(Untestable("accelerator", str(acc_a), str(acc_b), why))
    return out
