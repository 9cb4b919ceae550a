"""A lab run: its cells, in order or in rounds, each through its lifecycle (lab.lifecycle).

A cell that fails is marked failed with the stage it reached and the error; the other cells go
on, and everything already measured stays stored. Teardown runs in `finally` (Ctrl-C and
SIGTERM included); a teardown failure fails the run loudly.

Order ([suite] order): "sequential" runs the cells in matrix order, "random" in a seeded shuffle,
each cell booted once for all its repetitions. "interleaved" runs rounds: in each round every
cell still being measured is booted, runs the warm-ups and `repetitions_per_boot` measured
repetitions of each workload, and is destroyed, in a fresh seeded shuffle per round. Drift of the
host over the run (thermal, a neighbour, a cache warming up) then spreads over every cell instead
of landing on whichever ran last, and each cell's repetitions come from several boots, so its CI
also covers boot-to-boot variation. Only one VM is up at a time on a host, so memory is never
the limit and no idle VM disturbs a measurement; the price is a boot per round.

Several hosts: one lane per host, the lanes at once (lab.runner.lanes), each in the order above
with its own rounds; one host alone runs inline. The manifest records the lanes, each boot's span
and which cells overlapped in time. Every workload execution
is recorded in the store as it starts and ends (Store.timings.executions): the executed order.

Repetitions: fixed n, or adaptive (target_ci_pct): repeat until the 95 % CI of the median of
each throughput-like metric is within the target, or a budget (max_repetitions, max_seconds per
cell and workload) is spent (lab.schedule).
"""

from __future__ import annotations

import random
import secrets
import threading
from pathlib import Path
from typing import Any

from lab import __version__, check, clients, estimate, gc, hostinfo, images, lease, plan, schedule, statedir
from lab.backends import Backend, host_lanes
from lab.errors import LabError, SettingError, TeardownError, UsageError
from lab.labconfig import LabConfig
from lab.lifecycle import Interrupted, Reporter, SilentReporter, shielded
from lab.model import MADE_BY_HOST, CellStatus, ImageRef
from lab.runlock import RunLock, run_lock_path
from lab.runner import clientssh, lanes
from lab.runner.cells import run_unit
from lab.runner.clientvm import ClientVms
from lab.runner.context import RunContext, workload_params
from lab.runner.renewal import Renewal
from lab.store import Store


def new_run_id() -> str:
    return secrets.token_hex(4)


BOOT_ESTIMATE_S = sum(estimate.STAGE_DEFAULTS_S.values())  # a VM's fixed stages on a first run


def estimate_seconds(
    cfg: LabConfig, cells: list[plan.Unit], dups: dict[str, str] | None = None, store: Store | None = None
) -> float:
    """How long `cells` will take (lab.estimate): from the runs in `store` on the same hosts, else
    the first-run defaults. `dups`: plan.equivalents, if known already."""
    params = {w: workload_params(cfg, w) for w in cfg.suite.workloads}
    return estimate.estimate(cfg, cells, params, dups, store).seconds


def prepare(
    cfg: LabConfig, units: list[plan.Unit] | None = None
) -> tuple[list[plan.Unit], dict[str, ImageRef], dict[str, Backend]]:
    """Everything that can fail before anything is created: cells, images, backends' checks.
    `units`: the plan's cells when they are not the lab's matrix (the follow-up cells of `lab
    explain`: some cells of a matrix, lab.explain.followup); default: lab.plan.units(cfg)."""
    cells = plan.units(cfg) if units is None else list(units)
    # The run's locks (and the local backend's default workdir) live in the state directory: one
    # that cannot be had (someone else's, no home to put it in) is said now, with nothing made; a
    # run's leases name its tag (lab.lease).
    statedir.check(cfg.backend_env().state_dir)
    # Secrets and hosts first: a wrong token or an unreachable host is the first thing to fix.
    backends = cfg.open_backends({c.host for c in cells})
    for host, b in backends.items():
        with check.reaching(cfg, host):
            b.check()
    imgs = {name: images.load(name) for name in sorted({c.image for c in cells if c.kind == "vm"})}
    for host, b in backends.items():
        vms = [c for c in cells if c.kind == "vm" and c.host == host]
        # what the host answered in check() (its versions) against every cell it is given
        try:
            b.check_specs([plan.vm_spec(c, imgs[c.image], run_id="check") for c in vms])
        except SettingError as exc:
            raise check.located(cfg, host, exc) from None
        b.check_images(cloned_images(cells, imgs, host))
        if clients.ssh_target(b.settings.client) is not None:
            clientssh.check(cfg.source, host, b)
    return cells, imgs, backends


def image_lines(prepared: tuple[list[plan.Unit], dict[str, ImageRef], dict[str, Backend]]) -> list[str]:
    """What each host's cells start from (the template, the golden volume), from each backend."""
    cells, imgs, backends = prepared
    lines = []
    for host, b in backends.items():
        lines += b.describe_images(cloned_images(cells, imgs, host))
    return lines


def cloned_images(cells: list[plan.Unit], imgs: dict[str, ImageRef], host: str) -> list[ImageRef]:
    """The golden images `host` clones for its cells: a zone is made from the host's zone image
    (its backend's check_specs), not from one of them."""
    return [
        imgs[n]
        for n in sorted(
            {c.image for c in cells if c.kind == "vm" and c.host == host and c.isolation not in MADE_BY_HOST}
        )
    ]


def run_lab(
    cfg: LabConfig,
    store: Store,
    reporter: Reporter | None = None,
    *,
    run_id: str | None = None,
    config_text: str = "",
    prepared=None,
    resume: str | None = None,
    record: dict[str, Any] | None = None,
) -> str:
    """`record`: what the caller keeps in the run's manifest beside the runner's own keys (`lab
    explain` records a follow-up run's question and design there, lab.explain.record)."""
    reporter = reporter or SilentReporter()
    cells, imgs, backends = prepared or prepare(cfg)
    manifest: dict[str, Any] = {
        **(record or {}),
        "images": {
            n: {"digest": i.digest, "sha256": i.sha256, "tools": i.manifest.get("tools", {})} for n, i in imgs.items()
        },
        "workloads": {w: workload_params(cfg, w) for w in cfg.suite.workloads},
    }
    if resume:
        run_id, seed, todo = resumable(store, resume, cells, manifest)
        earlier = gc.run_owners(store.run(run_id).manifest)
    else:
        run_id = run_id or new_run_id()
        seed = cfg.suite.seed if cfg.suite.seed is not None else random.SystemRandom().randrange(2**31)
        earlier = set()
    # whose this attempt's machines are (lab.lease): every attempt's owner stays in the manifest
    owner = lease.new_owner(statedir.default_dir())
    manifest["owners"] = [*sorted(earlier), owner]
    # Held for the run's whole life (released after its status is final): `lab gc` tells a run
    # killed with -9 (still "running" in the store) from a live one, and marks it failed.
    run_lock = RunLock(run_lock_path(store.dir, run_id))
    run_lock.acquire(what=f"the lock of run {run_id} in {store.dir} (is another `lab run` on it?)")
    try:
        return _run_locked(
            cfg,
            store,
            reporter,
            run_id,
            seed,
            cells,
            imgs,
            backends,
            manifest,
            config_text,
            todo if resume else None,
            owner,
        )
    finally:
        run_lock.release()


def _run_locked(
    cfg: LabConfig,
    store: Store,
    reporter: Reporter,
    run_id: str,
    seed: int,
    cells,
    imgs,
    backends,
    manifest: dict[str, Any],
    config_text: str,
    todo: set[str] | None,
    owner: str,
) -> str:
    ordered = plan.order(cells, cfg.suite.order, seed)
    manifest["order"] = [c.id for c in ordered]
    manifest["schedule"] = schedule.describe(cfg.suite, seed)
    manifest["quiet_host"] = {
        h: cfg.suite.quiet_mode(b.capabilities(b.settings).local_host) for h, b in backends.items()
    }
    if todo is not None:  # resuming: only the cells not done yet
        ordered = [c for c in ordered if c.id in todo]
        for c in ordered:
            store.reset_cell(run_id, c.id)
        store.reopen_run(run_id)
        # this attempt's owner, before it makes anything: `lab gc` of this store knows its machines
        store.update_manifest(run_id, {**store.run(run_id).manifest, "owners": manifest["owners"]})
    else:
        store.create_run(
            run_id,
            cfg.lab.name,
            config_path=str(Path(cfg.source).resolve()),
            config_text=config_text,
            seed=seed,
            lab_version=__version__,
            manifest=manifest,
        )
        n_matrix = sum(1 for c in cells if c.kind == "vm" and c.replica == 1)
        for c in cells:
            store.add_cell(run_id, c.id, plan.store_index(c, n_matrix), c.label, c.axes())
    # Leftovers of dead runs on these hosts go before anything new is made.
    swept = gc.collect(cfg, hosts=list(backends), backends=backends)
    for line in swept.lines:
        if line.startswith("removed"):
            reporter.warn(f"swept a leftover of an earlier run: {line.removeprefix('removed ')}")
    for e in swept.errors:
        reporter.warn(f"could not sweep: {e}")
    dups = plan.equivalents(cfg, cells)
    renewal = Renewal(store, cfg.lab.lease_minutes, reporter.warn)
    # the comparisons the run will be asked: adaptive repetition goes on while one is unknown
    asked = schedule.Asked(tuple(plan.comparison_pairs(cells)), tuple(plan.twin_pairs(cells)), plan.primary_rows(cfg))
    ctx = RunContext(
        cfg, store, run_id, reporter, backends, duplicates=dups, seed=seed, owner=owner, leases=renewal, asked=asked
    )
    client_vms = ClientVms(store, run_id, cfg.lab.lease_minutes, list(cfg.matrix.host), owner=owner, leases=renewal)
    client_machines = clientssh.SshClients()
    for host in backends:  # every client's lock exists before the lanes start
        ctx.client_locks.setdefault(clients.turn_key(host, cfg.hosts[host].client), threading.Lock())
    interleaved = cfg.suite.order == "interleaved"
    n_rounds = len(plan.rounds(cfg.suite.repetitions, cfg.suite.repetitions_per_boot)) if interleaved else 1
    by_lane = lanes.split(ordered, {h: [n for n, _ in host_lanes(h, cfg.hosts[h])] for h in backends})
    manifest["lanes"] = {lane: [c.id for c in units] for lane, units in by_lane.items()}
    reporter.run_started(
        run_id,
        ordered * n_rounds,
        estimate_seconds(cfg, ordered, dups, store),
        {c.id: lane for lane, units in by_lane.items() for c in units},
    )
    status, error, refused = "failed", None, False

    def open_host(ctx: RunContext, host: str) -> None:
        backend = backends[host]
        ctx.clients[host] = backend.open_run(run_id)
        facts = hostinfo.snapshot(host, backend)
        ctx.host_fp[host] = store.host_facts.add(run_id, host, hostinfo.fingerprint(facts), facts)
        mtu = hostinfo.run_bridge_mtu(ctx.clients[host])
        if mtu:
            manifest.setdefault("run_bridge_mtu", {})[host] = mtu
        if cfg.hosts[host].client == "vm":
            image = next((imgs[c.image] for c in ordered if c.host == host and c.kind == "vm"), None)
            if image is None:
                raise UsageError(f'host {host}: client = "vm" needs a VM cell\'s golden image to clone; it has none')
            made = client_vms.open(host, backend, ctx.clients[host], image)
            ctx.generators[host] = made
            manifest.setdefault("client_vms", {})[host] = {"name": made.name, "address": made.address}
        elif clients.ssh_target(cfg.hosts[host].client) is not None:
            machine = client_machines.open(host, backend)
            ctx.generators[host] = machine
            manifest.setdefault("client_machines", {})[host] = {"target": machine.name, "address": machine.address}

    def run_lane(ctx: RunContext, units: list[plan.Unit]) -> None:
        if interleaved:
            run_rounds(ctx, units, imgs, seed, lane=True)
        else:
            for pos, cell in enumerate(units, start=1):
                run_unit(ctx, cell, imgs, pos, len(units))
                lanes.check_host(ctx, cell)

    renewal.start()
    try:
        if len(by_lane) > 1:
            lanes.run_lanes(ctx, by_lane, open_host, run_lane)
        else:  # one host, one slot: inline, as a run always was
            for host in backends:
                open_host(ctx, host)
            ctx.place = lanes.place_of(next(iter(by_lane), ""))
            if interleaved:
                run_rounds(ctx, ordered, imgs, seed)
            else:
                for pos, cell in enumerate(ordered, start=1):
                    run_unit(ctx, cell, imgs, pos, len(ordered))
        status = "done"
    except Interrupted:
        status, error = "interrupted", "interrupted by signal"
        raise
    except LabError as exc:
        error = str(exc)
        # Refused by a host's own checks as it opened (bad input, exit 2) before any cell started: the
        # run was never more than its first rows, and it is recorded nowhere.
        refused = isinstance(exc, UsageError) and todo is None and not started(store, run_id)
        raise
    finally:
        with shielded():
            ctx.teardown_failures += client_vms.close_all()  # after the cells, before the hosts' run set-up
            renewal.stop()  # every machine is gone (or left to `lab gc` with the lease it has)
            client_machines.close_all()
            for host, backend in backends.items():
                try:
                    backend.close_run(run_id)
                except LabError as exc:
                    ctx.teardown_failures.append(f"{host}: {exc}")
        if refused and not ctx.teardown_failures:
            store.discard_run(run_id)
        else:
            record_outcome(ctx, manifest, backends, status, error)
    if ctx.teardown_failures:
        raise TeardownError(
            f"run {run_id}: teardown failed: {'; '.join(ctx.teardown_failures)}",
            hint="run `lab gc` to remove what is left",
        )
    return run_id


def started(store: Store, run_id: str) -> bool:
    """Whether any cell of the run has left "pending" (booted, measured, failed, or was n/a)."""
    return any(c.status != CellStatus.PENDING for c in store.cells(run_id))


def record_outcome(
    ctx: RunContext, manifest: dict[str, Any], backends: dict[str, Backend], status: str, error: str | None
) -> None:
    """The run's manifest (backends' facts, repetitions, rounds, spans and overlaps) and its status."""
    manifest["backends"] = {h: b.facts() for h, b in backends.items()}
    manifest["repetitions"] = schedule.outcome(ctx.tallies)
    if ctx.rounds:
        manifest["rounds"] = ctx.rounds
    manifest["spans"] = lanes.spans_by_cell(ctx.spans)
    manifest["overlaps"], complete = lanes.overlaps(ctx.spans)
    if not complete:
        manifest["overlaps_cut_at"] = lanes.OVERLAPS_KEPT  # the spans say the rest
    ctx.store.update_manifest(ctx.run_id, manifest)
    if ctx.teardown_failures:
        status = "failed"
        error = "teardown failed: " + "; ".join(ctx.teardown_failures)
    ctx.store.finish_run(ctx.run_id, status, error)


def resumable(store: Store, ref: str, cells: list[plan.Unit], manifest: dict[str, Any]) -> tuple[str, int, set[str]]:
    """A run can be resumed with the same matrix, images and tool versions only: a resumed run
    must not mix measurements of different images."""
    run = store.run(ref)
    stored = {c.cell_id: c for c in store.cells(run.id)}
    for c in cells:
        if c.id not in stored or stored[c.id].label != c.label:
            raise UsageError(f"cannot resume run {run.id}: the matrix changed (cell {c.id} is now {c.label})")
    if len(stored) != len(cells):
        raise UsageError(f"cannot resume run {run.id}: the matrix changed ({len(stored)} cells then, {len(cells)} now)")
    for name, now in manifest["images"].items():
        then = run.manifest.get("images", {}).get(name, {})
        if then.get("digest") != now["digest"] or then.get("tools") != now["tools"]:
            raise UsageError(
                f"cannot resume run {run.id}: image {name} changed since (recipe "
                f"{str(then.get('digest'))[:12]} then, {now['digest'][:12]} now)"
            )
    if run.manifest.get("workloads") != manifest["workloads"]:
        raise UsageError(f"cannot resume run {run.id}: the suite's workloads or parameters changed")
    todo = {cid for cid, c in stored.items() if c.status not in (CellStatus.DONE, CellStatus.NA, CellStatus.DUPLICATE)}
    return run.id, int(run.seed or 0), todo


def run_rounds(ctx: RunContext, units: list[plan.Unit], imgs: dict[str, Any], seed: int, *, lane: bool = False) -> None:
    """order = "interleaved": rounds of boot -> warm-ups + a few repetitions -> destroy, each round
    in its own seeded order, until every cell has its repetitions (or, adaptive, its CI or budget).
    A cell that fails or is n/a leaves the rounds; the others go on. `lane`: the units are one lane
    of several (lab.runner.lanes), which ends when a cell loses its host."""
    suite = ctx.cfg.suite
    fixed = plan.rounds(suite.repetitions, suite.repetitions_per_boot) if suite.target_ci_pct is None else None
    live = list(units)
    position, planned = 0, len(units) * len(fixed or [1])
    round_no = 0
    while live:
        round_no += 1
        # fixed n: its rounds, then (remeasure_flagged) rounds for repetitions flagged for load
        if fixed is not None and round_no > len(fixed) + suite.remeasure_flagged:
            break
        order = plan.round_order(live, seed, round_no)
        ctx.rounds.append([u.id for u in order])
        quota = fixed[round_no - 1] if fixed is not None and round_no <= len(fixed) else suite.repetitions_per_boot
        statuses = {}
        for unit in order:
            position += 1
            statuses[unit.id] = run_unit(
                ctx, unit, imgs, position, max(planned, position), round_no=round_no, quota=quota, final=False
            )
            if lane:
                lanes.check_host(ctx, unit)
        live = [
            u
            for u in order
            if statuses[u.id] == CellStatus.PENDING
            and not all(ctx.tallies[(u.id, w)].stopped for w in suite.workloads if (u.id, w) in ctx.tallies)
        ]
    for cell in ctx.store.cells(ctx.run_id):  # measured to the end: pending (between rounds) becomes done
        if cell.status == CellStatus.PENDING and cell.cell_id in {u.id for u in units}:
            ctx.store.cell_update(ctx.run_id, cell.cell_id, status=CellStatus.DONE)
