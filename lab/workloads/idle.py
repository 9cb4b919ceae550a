"""idle: nothing runs for a fixed window; what the guest and its host spend on an idle VM.

Seed 002 compared hypervisors by the CPU an idle guest costs. One repetition is `sleep <duration>`
in the guest between two CPU snapshots (lab.workloads.cpu), so the guest's own busy % over the
window is measured as every workload measures it:

  cpu_busy_pct (+ user/sys, steal on Linux)   the guest's CPUs, all together, over the window

and, when the runner watched the host over the repetition (lab.hostload; [suite] quiet_host not
"off"), what the host saw in the same window, folded into the raw output by the runner
(`records_host_load`) so that `lab reparse` rebuilds it too:

  host_vm_cpu_pct        the lab's VM on its host, % of one host core (the cost of an idle guest)
  host_foreign_cpu_pct   everything else on the host, % of one core (the window's context)

It is also the cheap, fixed-length workload of concurrency tests (lanes).
"""

from __future__ import annotations

import json
from typing import Any

from lab.errors import UsageError
from lab.model import RawOutput, Sample
from lab.workloads import Param, PrimaryMetrics, Traits, WorkloadContext, register
from lab.workloads.cpu import cpu_samples
from lab.workloads.toolkit import GuestCommand, effective_params

MAX_DURATION_S = 3600


def host_samples(extra: dict[str, str]) -> list[Sample]:
    """Pure: the host's figures of the window from raw.extra["host_load"] (hostload.label as JSON);
    none when the host was not watched or could not tell its load."""
    text = extra.get("host_load")
    if not text:
        return []
    load: dict[str, Any] = json.loads(text)
    out = []
    for key, metric in (("lab_pct", "host_vm_cpu_pct"), ("foreign_pct", "host_foreign_cpu_pct")):
        if key in load:
            out.append(Sample(metric, float(load[key]), "%", False, {}))
    return out


class Idle(GuestCommand):
    name = "idle"
    traits = Traits(
        summary="an idle guest: the CPU it and its host spend over a window where nothing runs",
        params=(Param("duration", 10, "seconds of the idle window (at most 3600)"),),
        primary_metrics=PrimaryMetrics(("host_vm_cpu_pct",)),  # what the idle VM costs its host
        records_host_load=True,  # the runner folds the host's load window into the raw output
    )

    def params(self, ctx: WorkloadContext) -> dict[str, Any]:
        p = effective_params(self.defaults, ctx.params)
        d = p["duration"]
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= MAX_DURATION_S:
            raise UsageError(f"{self.name}: duration must be a number of seconds in (0, {MAX_DURATION_S}], got {d!r}")
        return p

    def estimate_seconds(self, params: dict[str, Any]) -> float:
        return float(params["duration"]) + 1.0

    def command(self, ctx: WorkloadContext) -> str:
        return f"sleep {self.params(ctx)['duration']:g}"  # sleep is everywhere: nothing to install

    def timeout(self, params: dict[str, Any]) -> float:
        return float(params["duration"]) + 60

    def parse(self, raw: RawOutput) -> list[Sample]:
        labels = {"duration": raw.params.get("duration")}
        return cpu_samples(raw, labels=labels) + [
            Sample(s.metric, s.value, s.unit, s.higher_is_better, dict(labels)) for s in host_samples(raw.extra)
        ]


IDLE = register(Idle())
