"""`fake-work`: a workload with deterministic values, registered as the real ones are
(lab.workloads.register). Each repetition runs `fake-work <rep>` on the guest (so a guest can fail
or be interrupted at a given repetition) and measures `values[rep % len(values)]` (warm-ups are
negative repetitions and measure `warmup_value`)."""

from __future__ import annotations

import time
from typing import Any

from lab.errors import UsageError
from lab.model import RawOutput, Sample
from lab.workloads import Param, PrimaryMetrics, Traits, Workload, WorkloadContext


class FakeWorkload(Workload):
    name = "fake-work"
    traits = Traits(
        summary="deterministic values, one run of `fake-work <rep>` on the guest per repetition",
        params=(
            Param("values", [100.0], "the values measured, repetition by repetition (cycled)"),
            Param("warmup_value", 1.0, "what a warm-up measures"),
            Param("seconds", 1.0, "the length each run reports"),
            Param("sleep_s", 0.0, "seconds each run sleeps"),
            # places, as git-clone's: another one is a container (Workload.own_containers)
            Param("network", ["guest"], "where it runs"),
        ),
        primary_metrics=PrimaryMetrics(("ops_per_s",)),
        container_places="network",
    )

    def __init__(self):
        self.prepared: list[str] = []

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        if not ctx.params["values"]:
            raise UsageError("fake-work: values must list at least one value")
        return dict(ctx.params)

    def prepare(self, ctx: WorkloadContext) -> None:
        self.prepared.append(ctx.guest.address)

    def run(self, ctx: WorkloadContext, repetition: int) -> RawOutput:
        ctx.guest.run(f"fake-work {repetition}")
        if ctx.params["sleep_s"]:
            time.sleep(ctx.params["sleep_s"])
        values = ctx.params["values"]
        value = ctx.params["warmup_value"] if repetition < 0 else values[repetition % len(values)]
        return RawOutput(
            self.name,
            f"fake-work {repetition}",
            f"value={value}\n",
            params=dict(ctx.params),
            seconds=float(ctx.params["seconds"]),
        )

    def parse(self, raw: RawOutput) -> list[Sample]:
        value = float(raw.stdout.strip().removeprefix("value="))
        return [Sample("ops_per_s", value, "ops/s", True), Sample("cpu_busy_pct", 50.0, "%", False)]
