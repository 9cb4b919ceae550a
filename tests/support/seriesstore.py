"""Stores of many runs of one configuration, made with the Store API as `lab run` stores them: a
cell per run, its host facts, one sample per repetition with the host's load label (lab.hostload).
For the history, import and report tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab import hostinfo
from lab.model import RawOutput, Sample
from lab.store import Store

AXES = {
    "host": "local",
    "image": "debian12",
    "nic": "virtio",
    "vcpus": 1,
    "memory_mib": 1024,
    "disk_bus": "virtio",
    "clone": "linked",
    "tuning": "default",
}
LABEL = "local/debian12/virtio/1c/1024m/virtio/linked/default"
FACTS = {
    "cpu_model": "AMD EPYC",
    "kernel": "6.1.0-28-amd64",
    "microcode": "0xa0011d5",
    "cpu_quota": "none",
    "machine_id": "m-one",
    "tools": {"qemu": "QEMU emulator version 7.2.15"},
}


def add_runs(
    where: Path | Store,
    medians: Sequence[float],
    *,
    facts: Sequence[dict[str, Any]] | None = None,
    prefix: str = "r",
    first: int = 0,
    digest: str = "d1",
    params: dict[str, Any] | None = None,
    axes: dict[str, Any] | None = None,
    foreign: Sequence[float] | None = None,
    spread: float = 0.004,
) -> list[str]:
    """One run per median: three repetitions at median x (1 - spread, 1, 1 + spread) of
    sysbench-cpu events_per_s_1t (higher is better) and its cpu_busy_pct. `facts[i]` are run i's
    host facts (default FACTS), `foreign[i]` the foreign load under its samples (% of one core;
    above 10 the samples are flagged, as the runner flags them)."""
    store = where if isinstance(where, Store) else Store(where)
    axes = {**AXES, **(axes or {})}
    label = label_of(axes)
    ids = []
    for i, median in enumerate(medians):
        rid = f"{prefix}{first + i}"
        manifest = {
            "images": {str(axes["image"]): {"digest": digest}},
            "workloads": {"sysbench-cpu": params or {"time": 1, "threads": [1]}},
            "schedule": {"foreign_load_pct": 10.0},
        }
        store.create_run(
            rid, "nightly", config_path="lab.toml", config_text="", seed=i, lab_version="0.1.0", manifest=manifest
        )
        store.add_cell(rid, "c01", 1, label, axes)
        f = dict((facts[i] if facts else None) or FACTS)
        fid = store.host_facts.add(rid, str(axes["host"]), hostinfo.fingerprint(f), f)
        load = foreign[i] if foreign else 0.0
        host_load = {"seconds": 1.0, "foreign_pct": load, "lab_pct": 100.0}
        if load > 10:
            host_load["flag"] = f"foreign load {load:.0f} % of one core on the host (> 10 %)"
        for rep, factor in enumerate((1 - spread, 1.0, 1 + spread)):
            raw = store.add_raw(rid, "c01", rep, RawOutput("sysbench-cpu", "sysbench cpu run", f"{median * factor}"))
            labels = {**axes, "accel": "tcg", "host_facts_id": fid, "repetition": rep, "host_load": host_load}
            store.add_samples(
                rid,
                "c01",
                raw,
                "sysbench-cpu",
                rep,
                [
                    Sample("events_per_s_1t", median * factor, "events/s", True, labels),
                    Sample("cpu_busy_pct", 99.0, "%", None, labels),
                ],
            )
            ex = store.timings.start_execution(rid, "c01", 1, "sysbench-cpu", rep)
            store.timings.finish_execution(ex, "ok", raw)
        store.timings.add_stage_time(rid, "c01", 1, "boot", 1.5)
        store.cell_update(
            rid, "c01", status="done", stage="teardown", facts={"accel": "tcg"}, started=True, finished=True
        )
        store.finish_run(rid, "done")
        ids.append(rid)
    if store is not where:
        store.close()  # the last connection: the WAL is checkpointed into lab.db
    return ids


def label_of(axes: dict[str, Any] | None = None) -> str:
    a = {**AXES, **(axes or {})}
    machine = f"{a['host']}/{a['image']}/{a['nic']}/{a['vcpus']}c/{a['memory_mib']}m"
    return f"{machine}/{a['disk_bus']}/{a['clone']}/{a['tuning']}"
