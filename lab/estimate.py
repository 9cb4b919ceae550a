"""How long a lab will take: from what earlier runs on the same host measured, else documented defaults.

A cell costs, for each of its boots (one, or one per round of an interleaved run): its fixed
stages (a VM: clone, boot, ssh, verify, tune, teardown; the bare-metal cell: clone (namespace,
veth, cgroup), verify, teardown), then per workload its prepare and its warm-ups; and, over all
its boots, its measured repetitions (adaptive repetition: the minimum, `repetitions`), each after
its wait for a quiet host where the host is waited for ([suite] quiet_host, lab.hostload).

Each of those figures is the median of what the results store holds (Store.timings.stage_times for the
stages and prepares, Store.timings.executions for warm-ups and repetitions) for cells of the same host
and image (the bare-metal cell: the same host), over the last RECENT_RUNS runs that measured
such a cell, on the accelerator the newest of them recorded (TCG and KVM differ by 10x, and
`lab plan` does not probe), and for a workload only from runs with the same parameters. A figure
never measured there comes from the defaults below, and the estimate says which it used.

Each host also costs a run its set-up and the gaps between cells (the run's network, the host's
facts, the sweep of leftovers, the store's writes): a run's wall time minus its cells' stage
times, the median over the last RECENT_RUNS finished runs on that host alone.

Several hosts run at once, one lane each (lab.runner.lanes): each host's cells and overhead are its
lane's time (Estimate.lanes), and the run takes the longest lane, unless the network workloads of
the lanes sharing one client (this machine, or a client machine of client = "ssh:"), which take
turns on it, add up to more (Estimate.client_s).
A host with a client VM (client = "vm") adds that VM's clone, boot, SSH and teardown, as its cells'
stages measured them, to its lane, and its network workloads take turns on that VM alone. A host with several
lanes (slots, or places such as a cluster's nodes) divides its cells' time among them, but not the
measurements on this machine, which take turns on it.

The defaults (a first run): a VM's fixed stages take STAGE_DEFAULTS_S (21 s in all: a TCG boot
of the golden Debian image to SSH, plus clone, verify, tune and teardown), a workload's prepare
PREPARE_DEFAULT_S, a repetition the workload's own `estimate_seconds(params)` (iperf3, sysbench
and wrk: one run per direction, thread count or connection count; by default its "time" /
"duration" parameter plus lab.workloads.REP_OVERHEAD_S), a wait for a quiet host [suite] quiet_seconds (its
least), and a host's run overhead RUN_OVERHEAD_DEFAULT_S.
They are the medians of the stages timed in a real run of the default lab on a 2-core TCG machine
(run fafa92e3: boot 13.3 s, ssh 1.5 s, tune 1.1 s, verify 0.6 s, a prepare 0.12-0.16 s), rounded
up; the first timed run on a host replaces them. (They used to put a 2-cell run's untimed gap on
prepare, 18.5 s a workload: the 3-cell default lab's first plan then said 13m18s for a 10m18s run.)
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Any

from lab import backends, clients, plan, workloads
from lab.labconfig import LabConfig
from lab.store import Store

RECENT_RUNS = 5  # the host changes (kernel, load, a KVM that now works): recent runs speak for it
INSIDE_WORKLOADS = ("prepare", "quiet")  # timed within the workloads stage, per workload
# the fixed stages of a boot, each with its first-run default (the keys are what is summed)
STAGE_DEFAULTS_S = {"clone": 1.0, "boot": 14.0, "ssh": 2.0, "verify": 1.0, "tune": 1.5, "teardown": 1.5}
BARE_METAL_DEFAULTS_S = {"clone": 1.0, "verify": 1.0, "teardown": 1.0}
PREPARE_DEFAULT_S = 1.0
RUN_OVERHEAD_DEFAULT_S = 5.0
CLIENT_VM_STAGES = ("clone", "boot", "ssh", "teardown")  # a client VM's (lab.runner.clientvm), as a cell's


@dataclass(frozen=True)
class Estimate:
    seconds: float
    measured: dict[str, list[str]]  # host -> the earlier runs whose measurements it used
    defaulted: list[str]  # what came from the defaults: "local/debian12 boot", "local/debian12 https prepare"
    hosts: list[str]  # the hosts of the cells estimated
    # host -> its lane's time (lab.runner.lanes: the hosts run at once; `seconds` is the longest)
    lanes: dict[str, float] = field(default_factory=dict)
    client_s: float = 0.0  # the busiest client's network measurements (lanes sharing it take turns)

    @property
    def basis(self) -> str:
        """ "measured", "defaults" (a first run) or "mixed"."""
        if not self.measured:
            return "defaults"
        return "mixed" if self.defaulted else "measured"

    def describe(self) -> str:
        """One line: what the estimate is based on."""
        if not self.measured:
            return f"first-run defaults: no earlier run on host {', '.join(self.hosts) or '-'} in the results store"
        parts = [
            f"from {len(runs)} earlier run{'s' if len(runs) != 1 else ''} on host {host}"
            for host, runs in sorted(self.measured.items())
        ]
        fresh = [h for h in self.hosts if h not in self.measured]
        if fresh:
            parts.append(f"first-run defaults on host {', '.join(fresh)}")
        elif self.defaulted:
            shown = ", ".join(self.defaulted[:4]) + (
                f" and {len(self.defaulted) - 4} more" if len(self.defaulted) > 4 else ""
            )
            parts.append(f"defaults for {shown}")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        lanes = {"lanes": {h: round(t, 1) for h, t in self.lanes.items()}} if len(self.lanes) > 1 else {}
        return {
            "seconds": round(self.seconds, 1),
            "basis": self.basis,
            "runs": self.measured,
            "defaults_for": self.defaulted,
            "text": self.describe(),
            **lanes,
        }


@dataclass
class Timings:
    """The medians measured for one kind of cell (host and image, or host and bare metal)."""

    runs: list[str] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)
    prepare: dict[str, float] = field(default_factory=dict)
    warmup: dict[str, float] = field(default_factory=dict)
    repetition: dict[str, float] = field(default_factory=dict)


def default_repetition(name: str, params: dict[str, Any]) -> float:
    """One repetition of a workload by its own account (Workload.estimate_seconds)."""
    return workloads.get(name).estimate_seconds(params)


def _same(a: Any, b: Any) -> bool:
    # the store keeps a run's parameters as JSON: compare them as JSON
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _kind(unit_host: str, unit_image: str | None) -> tuple[str, str]:
    return unit_host, unit_image or plan.BARE_METAL


def measured(store: Store, host: str, image: str | None, params: dict[str, dict[str, Any]]) -> Timings:
    """The medians of what the last RECENT_RUNS runs on `host` measured for cells of `image`
    (None: the bare-metal cell), on the accelerator the newest of them recorded."""
    want = _kind(host, image)
    found: list[tuple[Any, list, list]] = []  # (run, its matching cells, its stage times), newest first
    for run in reversed(store.runs()):
        cells = [
            c
            for c in store.cells(run.id)
            if _kind(c.axes.get("host", ""), None if c.axes.get("kind") == plan.BARE_METAL else c.axes.get("image"))
            == want
        ]
        if not cells:
            continue
        times = store.timings.stage_times(run.id)
        ids = {c.cell_id for c in cells}
        if not any(t.cell_id in ids for t in times):
            continue  # measured nothing (failed at once, or written before stage times were stored)
        found.append((run, cells, times))
        if len(found) == RECENT_RUNS:
            break
    out = Timings()
    if not found:
        return out
    accel = next((c.facts.get("accel") for c in found[0][1] if c.facts.get("accel") is not None), None)
    stages: dict[str, list[float]] = {}
    prepare: dict[str, list[float]] = {}
    warm: dict[str, list[float]] = {}
    reps: dict[str, list[float]] = {}
    for run, cells, times in found:
        ids = {c.cell_id for c in cells if c.facts.get("accel") == accel}
        if not ids:
            continue
        same_params = {w for w in params if _same((run.manifest.get("workloads") or {}).get(w), params[w])}
        used = False
        for t in times:
            if t.cell_id not in ids:
                continue
            if t.stage == "prepare":  # a workload's own: its parameters must match
                if t.workload in same_params:
                    prepare.setdefault(t.workload, []).append(t.seconds)
            else:
                stages.setdefault(t.stage, []).append(t.seconds)
            used = True
        for e in store.timings.executions(run.id):
            if e.cell_id in ids and e.outcome == "ok" and e.finished_at is not None and e.workload in same_params:
                (warm if e.repetition < 0 else reps).setdefault(e.workload, []).append(e.finished_at - e.started_at)
        if used:
            out.runs.append(run.id)
    out.stages = {k: statistics.median(v) for k, v in stages.items()}
    out.prepare = {k: statistics.median(v) for k, v in prepare.items()}
    out.warmup = {k: statistics.median(v) for k, v in warm.items()}
    out.repetition = {k: statistics.median(v) for k, v in reps.items()}
    return out


def run_overhead(store: Store, host: str) -> tuple[float | None, list[str]]:
    """What the last RECENT_RUNS finished runs on `host` alone spent outside their cells' stages
    (None: no such run), and those runs."""
    spent: dict[str, float] = {}
    for run in reversed(store.runs()):
        if run.status != "done" or run.finished_at is None:
            continue
        cells = store.cells(run.id)
        times = store.timings.stage_times(run.id)
        if not times or any(c.axes.get("host") != host or c.status not in ("done", "n/a", "duplicate") for c in cells):
            continue  # another host's share cannot be told apart; a failed stage went unrecorded
        in_cells = sum(t.seconds for t in times if t.stage not in INSIDE_WORKLOADS)
        spent[run.id] = max(run.finished_at - run.started_at - in_cells, 0.0)
        if len(spent) == RECENT_RUNS:
            break
    return (statistics.median(spent.values()) if spent else None), list(spent)


def estimate(
    cfg: LabConfig,
    units: list[plan.Unit],
    params: dict[str, dict[str, Any]],
    dups: dict[str, str] | None = None,
    store: Store | None = None,
) -> Estimate:
    """The time `units` of `cfg` will take. `params`: each workload's parameters in this lab;
    `dups`: plan.equivalents, if known already; `store`: where earlier runs are (None: defaults)."""
    suite = cfg.suite
    boots = len(plan.rounds(suite.repetitions, suite.repetitions_per_boot)) if suite.order == "interleaved" else 1
    dups = plan.equivalents(cfg, units) if dups is None else dups
    cache: dict[tuple[str, str], Timings] = {}
    runs: dict[str, set[str]] = {}
    defaulted: list[str] = []
    lanes: dict[str, float] = {}  # the hosts run at once, one lane each (lab.runner.lanes)
    serial: dict[str, float] = {}  # what of a host's time its slots cannot overlap
    turns: dict[str, float] = {}  # client (lab.clients.turn_key) -> its network workloads: they take turns on it
    client_vm: dict[str, float] = {}  # host -> its client VM's making and teardown (client = "vm")
    for u in units:
        if u.id in dups:
            continue  # recorded as a duplicate, never booted
        image = None if u.kind == plan.BARE_METAL else u.image
        kind = _kind(u.host, image)
        if kind not in cache:
            cache[kind] = measured(store, u.host, image, params) if store is not None else Timings()
            if cache[kind].runs:
                runs.setdefault(u.host, set()).update(cache[kind].runs)
        got = cache[kind]
        where = "/".join(kind)

        def pick(table: dict[str, float], key: str, default: float, what: str) -> float:
            if key in table:
                return table[key]
            if f"{where} {what}" not in defaulted:
                defaulted.append(f"{where} {what}")
            return default

        stage_defaults = BARE_METAL_DEFAULTS_S if image is None else STAGE_DEFAULTS_S
        per_boot = sum(pick(got.stages, s, d, s) for s, d in stage_defaults.items())
        local = backends.capabilities(cfg.hosts[u.host]).local_host
        waits = suite.quiet_mode(local) == "wait"
        quiet = pick(got.stages, "quiet", suite.quiet_seconds, "quiet wait") if waits else 0.0
        measured_total = 0.0
        for name in suite.workloads:
            rep = pick(got.repetition, name, default_repetition(name, params[name]), name)
            warm = got.warmup.get(name, rep)  # warm-ups do not wait for a quiet host
            prepare = pick(got.prepare, name, PREPARE_DEFAULT_S, f"{name} prepare")
            per_boot += prepare + suite.warmup * warm
            measured_total += suite.repetitions * (quiet + rep)
            if workloads.get(name).traits.network:
                key = clients.turn_key(u.host, cfg.hosts[u.host].client)
                turns[key] = turns.get(key, 0.0) + boots * (prepare + suite.warmup * warm) + suite.repetitions * rep
        lanes[u.host] = lanes.get(u.host, 0.0) + boots * per_boot + measured_total
        if image is not None and cfg.hosts[u.host].client == "vm" and u.host not in client_vm:
            client_vm[u.host] = sum(pick(got.stages, s, STAGE_DEFAULTS_S[s], s) for s in CLIENT_VM_STAGES)
        if local:  # every measurement on this machine holds its client: its slots measure in turn
            serial[u.host] = serial.get(u.host, 0.0) + measured_total
    hosts = sorted({u.host for u in units if u.id not in dups})
    for host in hosts:  # a host with several slots or places runs as many lanes (lab.runner.lanes.split)
        cells = sum(1 for u in units if u.host == host and u.id not in dups)
        at_once = backends.lanes_at_once(host, cfg.hosts[host], cells)
        lanes[host] = max(lanes.get(host, 0.0) / at_once, serial.get(host, 0.0))
    for host in hosts:
        spent, spent_runs = run_overhead(store, host) if store is not None else (None, [])
        if spent is None:
            defaulted.append(f"{host} run overhead")
            spent = RUN_OVERHEAD_DEFAULT_S
        runs.setdefault(host, set()).update(spent_runs)
        lanes[host] = lanes.get(host, 0.0) + spent + client_vm.get(host, 0.0)
    # the lanes run at once, but the network measurements through one client one after the other:
    # the longest of the two (a client of one lane alone never exceeds that lane)
    client_s = max(turns.values(), default=0.0)
    seconds = max([*lanes.values(), client_s if len(lanes) > 1 else 0.0], default=0.0)
    return Estimate(seconds, {h: sorted(r) for h, r in runs.items() if r}, defaulted, hosts, lanes, client_s)
