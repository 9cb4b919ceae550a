"""`fake-effects`: a workload whose figure has effects planted on the cell's knobs, for `lab explain`
on the fake backend. It reads the knobs off the fake guest the runner set up (its NIC driver, vCPUs,
memory, the sysctls the tuning profile set, LRO, netem), so the knobs travel the whole way: matrix,
follow-up cells, tune stage, guest. Its `ops_per_s` is `base` times, for each knob at its B value,
`main[knob]`, times `pair_ratio` when the pair's second knob is at B and its first at A (the
second knob's effect depends on the first, as e1000's cost depends on a WAN cap), times a seeded
lognormal noise of `cv`. Beside it, `cpu_busy_pct` moves with the first planted knob."""

from __future__ import annotations

import math
import random
from typing import Any

from lab.model import RawOutput, Sample
from lab.workloads import Param, PrimaryMetrics, Traits, Workload, WorkloadContext

# knob -> is it at its B value in this guest (the values the tests use for B)
AT_B = {
    "wan": lambda g: g.netem is not None,
    "nic": lambda g: g.nic_driver == "e1000",
    "vcpus": lambda g: g.vcpus == 4,
    "memory_mib": lambda g: g.memory_mib == 2048,
    "offloads": lambda g: not g.lro_on,
    "tuning": lambda g: g.sysctl.get("net.core.rmem_max") == "16777216",
}


class EffectsWorkload(Workload):
    name = "fake-effects"
    traits = Traits(
        summary="a figure with effects planted on the cell's knobs (lab explain on the fake backend)",
        params=(
            Param("base", 1000.0, "the figure with every knob at its A value"),
            Param("main", {}, "knob -> factor at its B value"),
            Param("pair", [], "[first, second]: the second's factor applies only while the first is at A"),
            Param("pair_ratio", 1.0, "the second knob's factor in the pair"),
            Param("cv", 0.03, "the coefficient of variation of the seeded lognormal noise"),
            Param("seed", 1, "the noise's seed"),
        ),
        primary_metrics=PrimaryMetrics(("ops_per_s",)),
    )

    def __init__(self) -> None:
        self.calls = 0

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        return dict(ctx.params)

    def prepare(self, ctx: WorkloadContext) -> None:
        pass

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput:
        p, g = ctx.params, ctx.guest
        ctx.guest.run(f"fake-work {repetition}")  # the fake backend's load windows count repetitions by it
        at = {k: bool(f(g)) for k, f in AT_B.items()}
        value = float(p["base"])
        for knob, factor in p["main"].items():
            if at[knob]:
                value *= factor
        if p["pair"]:
            first, second = p["pair"]
            if at[second] and not at[first]:
                value *= p["pair_ratio"]
        self.calls += 1
        rng = random.Random(f"{p['seed']}/{sorted(at.items())}/{repetition}/{self.calls}")
        value *= math.exp(rng.gauss(0.0, p["cv"]))
        first_main = next(iter(p["main"]), None)
        busy = 50.0 * (0.5 if first_main and at[first_main] else 1.0) * math.exp(rng.gauss(0.0, 0.02))
        return RawOutput(self.name, "fake-effects", f"value={value}\nbusy={busy}\n", params=dict(p), seconds=0.01)

    def parse(self, raw: RawOutput) -> list[Sample]:
        got = dict(line.split("=", 1) for line in raw.stdout.split())
        return [
            Sample("ops_per_s", float(got["value"]), "ops/s", True),
            Sample("cpu_busy_pct", float(got["busy"]), "%", False),
        ]
