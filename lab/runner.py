"""A lab run: per cell, lease -> clone -> boot -> verify -> tune -> workloads -> teardown.

A cell that fails is marked failed with the stage it reached and the error; the other cells go
on, and everything already measured stays stored. Teardown runs in `finally` (Ctrl-C and
SIGTERM included); a teardown failure fails the run loudly.

Order ([suite] order): "sequential" runs the cells in matrix order, "random" in a seeded shuffle,
each cell booted once for all its repetitions. "interleaved" runs rounds: in each round every
cell still being measured is booted, runs the warm-ups and `repetitions_per_boot` measured
repetitions of each workload, and is destroyed, in a fresh seeded shuffle per round. Drift of the
host over the run (thermal, a neighbour, a cache warming up) then spreads over every cell instead
of landing on whichever ran last, and each cell's repetitions come from several boots, so its CI
also covers boot-to-boot variation. Only one VM is up at a time, so memory is never the limit
and no idle VM disturbs a measurement; the price is a boot per round. Every workload execution
is recorded in the store as it starts and ends (Store.executions): the executed order.

Repetitions: fixed n, or adaptive (target_ci_pct): repeat until the 95 % CI of the median of
each throughput-like metric is within the target, or a budget (max_repetitions, max_seconds per
cell and workload) is spent (lab.schedule).
"""

from __future__ import annotations

import contextlib
import json
import random
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lab import IMAGES_DIR, __version__, hostinfo, images, osfacts, plan, schedule, tuning, wan
from lab.backends import backend_class
from lab.config import LabConfig, host_settings, parse_offloads
from lab.errors import LabError, TeardownError, VerificationError
from lab.guest import Guest
from lab.model import CellStatus, RawOutput, Vm, VmSpec
from lab.runlock import RunLock, run_lock_path
from lab.store import Store
from lab.workloads import WorkloadContext, load_all

STAGES = ("lease", "clone", "boot", "ssh", "verify", "tune", "workloads", "teardown")


class Interrupted(BaseException):
    """Raised from the SIGTERM/SIGINT handler so every `finally` runs (BaseException: no
    `except Exception` on the way may swallow it)."""


@contextlib.contextmanager
def shielded():
    """Teardown must finish: hold SIGINT/SIGTERM until it has (they are delivered after)."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Reporter(Protocol):
    def run_started(self, run_id: str, cells: list[plan.Cell], estimate_s: float) -> None: ...
    def cell_started(self, cell: plan.Cell, position: int, total: int) -> None: ...
    def stage(self, cell: plan.Cell, stage: str, detail: str = "") -> None: ...
    def cell_finished(self, cell: plan.Cell, status: str, error: str | None) -> None: ...
    def warn(self, message: str) -> None: ...


class SilentReporter:
    def run_started(self, *a, **k): ...
    def cell_started(self, *a, **k): ...
    def stage(self, *a, **k): ...
    def cell_finished(self, *a, **k): ...
    def warn(self, *a, **k): ...


def new_run_id() -> str:
    return secrets.token_hex(4)


def workload_params(cfg: LabConfig, name: str) -> dict[str, Any]:
    wl = load_all()[name]
    return {**getattr(wl, "defaults", {}), **cfg.suite.params.get(name, {})}


BOOT_ESTIMATE_S = 35.0  # TCG boot to SSH of the golden image, plus clone and teardown


def estimate_seconds(cfg: LabConfig, cells: list[plan.Unit], dups: dict[str, str] | None = None) -> float:
    """Rough: boots + per workload (duration + overhead) x (repetitions + warm-ups). Adaptive
    repetition counts its minimum (suite.repetitions). `dups`: plan.equivalents, if known already."""
    suite = cfg.suite
    boots = len(plan.rounds(suite.repetitions, suite.repetitions_per_boot)) if suite.order == "interleaved" else 1
    per_rep = 0.0
    for name in suite.workloads:
        wl = load_all()[name]
        params = workload_params(cfg, name)
        est = getattr(wl, "estimate_seconds", None)
        per_rep += est(params) if est else float(params.get("time", params.get("duration", 10))) + 3
    total = 0.0
    dups = plan.equivalents(cfg, cells) if dups is None else dups
    for c in cells:
        if c.id in dups:
            continue  # recorded as a duplicate, never booted
        total += (0 if c.kind == plan.BARE_METAL else boots * BOOT_ESTIMATE_S)
        total += (suite.repetitions + boots * suite.warmup) * per_rep
    return total


@dataclass
class RunContext:
    cfg: LabConfig
    store: Store
    run_id: str
    reporter: Reporter
    backends: dict[str, Any] = field(default_factory=dict)
    clients: dict[str, Any] = field(default_factory=dict)
    host_fp: dict[str, int] = field(default_factory=dict)
    teardown_failures: list[str] = field(default_factory=list)
    # repetition policy state per (cell id, workload): what was measured, why it stopped
    tallies: dict[tuple[str, str], schedule.Tally] = field(default_factory=dict)
    rounds: list[list[str]] = field(default_factory=list)  # interleaved: the cells of each round, in order
    # equivalent cells: plan-time {later id: earlier id}; read-back signatures -> the first cell with it
    duplicates: dict[str, str] = field(default_factory=dict)
    signatures: dict[str, str] = field(default_factory=dict)


def build_backends(cfg: LabConfig, hosts: set[str]) -> dict[str, Any]:
    out = {}
    for name in sorted(hosts):
        hc = cfg.hosts[name]
        cls = backend_class(hc.backend)
        settings = host_settings(cfg, name)
        pub = IMAGES_DIR / "lab_key.pub"
        if hc.backend == "proxmox" and not settings.get("ssh_keys") and pub.exists():
            settings["ssh_keys"] = pub.read_text().strip()  # cloud-init gets the lab's key
        out[name] = cls(name, settings)
    return out


def prepare(cfg: LabConfig) -> tuple[list[plan.Unit], dict[str, Any], dict[str, Any]]:
    """Everything that can fail before anything is created: cells, images, backends' checks."""
    cells = plan.units(cfg)
    # Secrets and hosts first: a wrong token or an unreachable host is the first thing to fix.
    backends = build_backends(cfg, {c.host for c in cells})
    for b in backends.values():
        b.check()
    imgs = {name: images.load(name) for name in sorted({c.image for c in cells if c.kind == "vm"})}
    for host, b in backends.items():
        if hasattr(b, "check_images"):  # e.g. Proxmox: a template per image on every node it may use
            b.check_images([imgs[name] for name in sorted({c.image for c in cells if c.kind == "vm" and c.host == host})])
    return cells, imgs, backends


def run_lab(cfg: LabConfig, store: Store, reporter: Reporter | None = None, *, run_id: str | None = None,
            config_text: str = "", prepared=None, resume: str | None = None) -> str:
    reporter = reporter or SilentReporter()
    cells, imgs, backends = prepared or prepare(cfg)
    manifest = {"images": {n: {"digest": i.digest, "sha256": i.sha256, "tools": i.manifest.get("tools", {})}
                           for n, i in imgs.items()},
                "workloads": {w: workload_params(cfg, w) for w in cfg.suite.workloads}}
    if resume:
        run_id, seed, todo = _resumable(store, resume, cells, manifest)
    else:
        run_id = run_id or new_run_id()
        seed = cfg.suite.seed if cfg.suite.seed is not None else random.SystemRandom().randrange(2**31)
    # Held for the run's whole life (released after its status is final): `lab gc` tells a run
    # killed with -9 (still "running" in the store) from a live one, and marks it failed.
    run_lock = RunLock(run_lock_path(store.dir, run_id))
    run_lock.acquire(what=f"the lock of run {run_id} in {store.dir} (is another `lab run` on it?)")
    try:
        return _run_locked(cfg, store, reporter, run_id, seed, cells, imgs, backends, manifest, config_text,
                           todo if resume else None)
    finally:
        run_lock.release()


def _run_locked(cfg: LabConfig, store: Store, reporter: Reporter, run_id: str, seed: int, cells, imgs, backends,
                manifest: dict[str, Any], config_text: str, todo: set[str] | None) -> str:
    resume = todo is not None
    ordered = plan.order(cells, cfg.suite.order, seed)
    manifest["order"] = [c.id for c in ordered]
    manifest["schedule"] = schedule.describe(cfg.suite, seed)
    if resume:
        ordered = [c for c in ordered if c.id in todo]
        for c in ordered:
            store.reset_cell(run_id, c.id)
        store.reopen_run(run_id)
    else:
        store.create_run(run_id, cfg.lab.name, config_path=str(Path(cfg.source).resolve()), config_text=config_text,
                         seed=seed, lab_version=__version__, manifest=manifest)
        n_matrix = sum(1 for c in cells if c.kind == "vm" and c.replica == 1)
        for c in cells:
            store.add_cell(run_id, c.id, plan.store_index(c, n_matrix), c.label, c.axes())
    # Leftovers of dead runs on these hosts go before anything new is made.
    from lab import gc

    swept = gc.collect(cfg, hosts=list(backends), backends=backends)
    for line in swept.lines:
        if line.startswith("removed"):
            reporter.warn(f"swept a leftover of an earlier run: {line.removeprefix('removed ')}")
    for e in swept.errors:
        reporter.warn(f"could not sweep: {e}")
    dups = plan.equivalents(cfg, cells)
    ctx = RunContext(cfg, store, run_id, reporter, backends, duplicates=dups)
    interleaved = cfg.suite.order == "interleaved"
    n_rounds = len(plan.rounds(cfg.suite.repetitions, cfg.suite.repetitions_per_boot)) if interleaved else 1
    reporter.run_started(run_id, ordered * n_rounds, estimate_seconds(cfg, ordered, dups))
    status, error = "failed", None
    try:
        for host, backend in backends.items():
            ctx.clients[host] = backend.open_run(run_id)
            facts = hostinfo.snapshot(host, backend)
            ctx.host_fp[host] = store.add_host_facts(run_id, host, hostinfo.fingerprint(facts), facts)
            mtu = hostinfo.run_bridge_mtu(ctx.clients[host])
            if mtu:
                manifest.setdefault("run_bridge_mtu", {})[host] = mtu
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
        raise
    finally:
        with shielded():
            for host, backend in backends.items():
                try:
                    backend.close_run(run_id)
                except LabError as exc:
                    ctx.teardown_failures.append(f"{host}: {exc}")
        manifest["backends"] = {h: b.facts() for h, b in backends.items()}
        manifest["repetitions"] = schedule.outcome(ctx.tallies)
        if ctx.rounds:
            manifest["rounds"] = ctx.rounds
        store.update_manifest(run_id, manifest)
        if ctx.teardown_failures:
            status = "failed"
            error = "teardown failed: " + "; ".join(ctx.teardown_failures)
        store.finish_run(run_id, status, error)
    if ctx.teardown_failures:
        raise TeardownError(f"run {run_id}: teardown failed: {'; '.join(ctx.teardown_failures)}",
                            hint="run `lab gc` to remove what is left")
    return run_id


def _resumable(store: Store, ref: str, cells: list[plan.Cell], manifest: dict[str, Any]) -> tuple[str, int, set[str]]:
    """A run can be resumed with the same matrix, images and tool versions only: a resumed run
    must not mix measurements of different images."""
    from lab.errors import UsageError

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
            raise UsageError(f"cannot resume run {run.id}: image {name} changed since (recipe "
                             f"{str(then.get('digest'))[:12]} then, {now['digest'][:12]} now)")
    if run.manifest.get("workloads") != manifest["workloads"]:
        raise UsageError(f"cannot resume run {run.id}: the suite's workloads or parameters changed")
    todo = {cid for cid, c in stored.items() if c.status not in (CellStatus.DONE, CellStatus.NA, CellStatus.DUPLICATE)}
    return run.id, int(run.seed or 0), todo


def run_unit(ctx: RunContext, unit: plan.Unit, imgs: dict[str, Any], position: int, total: int, *,
             round_no: int = 1, quota: int | None = None, final: bool = True) -> str:
    """One boot of a cell (or one set-up of the bare-metal cell); its status afterwards."""
    if unit.id in ctx.duplicates:  # known before booting: the same effective configuration as an earlier cell
        return record_duplicate(ctx, unit, ctx.duplicates[unit.id], {}, "plan")
    if unit.kind == plan.BARE_METAL:
        return run_bare_metal(ctx, unit, position, total, round_no=round_no, quota=quota, final=final)
    return run_cell(ctx, unit, imgs[unit.image], position, total, round_no=round_no, quota=quota, final=final)


def run_rounds(ctx: RunContext, units: list[plan.Unit], imgs: dict[str, Any], seed: int) -> None:
    """order = "interleaved": rounds of boot -> warm-ups + a few repetitions -> destroy, each round
    in its own seeded order, until every cell has its repetitions (or, adaptive, its CI or budget).
    A cell that fails or is n/a leaves the rounds; the others go on."""
    suite = ctx.cfg.suite
    fixed = plan.rounds(suite.repetitions, suite.repetitions_per_boot) if suite.target_ci_pct is None else None
    live = list(units)
    position, planned = 0, len(units) * len(fixed or [1])
    round_no = 0
    while live:
        round_no += 1
        if fixed is not None and round_no > len(fixed):
            break
        order = plan.round_order(live, seed, round_no)
        ctx.rounds.append([u.id for u in order])
        quota = fixed[round_no - 1] if fixed is not None else suite.repetitions_per_boot
        statuses = {}
        for unit in order:
            position += 1
            statuses[unit.id] = run_unit(ctx, unit, imgs, position, max(planned, position), round_no=round_no,
                                         quota=quota, final=False)
        live = [u for u in order if statuses[u.id] == CellStatus.PENDING
                and not all(ctx.tallies[(u.id, w)].stopped for w in suite.workloads if (u.id, w) in ctx.tallies)]
    for cell in ctx.store.cells(ctx.run_id):  # measured to the end: pending (between rounds) becomes done
        if cell.status == CellStatus.PENDING and cell.cell_id in {u.id for u in units}:
            ctx.store.cell_update(ctx.run_id, cell.cell_id, status=CellStatus.DONE)


def run_cell(ctx: RunContext, cell: plan.Cell, image, position: int, total: int, *, round_no: int = 1,
             quota: int | None = None, final: bool = True) -> str:
    cfg, store, rid = ctx.cfg, ctx.store, ctx.run_id
    backend = ctx.backends[cell.host]
    client = ctx.clients[cell.host]
    facts = osfacts.facts(image.os)
    vm_name = f"lab-{rid}-{cell.id}"
    expires = time.time() + cfg.lab.lease_minutes * 60
    spec = VmSpec(name=vm_name, run_id=rid, cell_id=cell.id, image=image, nic=cell.nic, vcpus=cell.vcpus,
                  memory_mib=cell.memory_mib, disk_bus=cell.disk_bus, clone=cell.clone, expires_at=expires,
                  labels={"run": rid, "cell": cell.id})
    ctx.reporter.cell_started(cell, position, total)
    store.cell_update(rid, cell.id, status=CellStatus.RUNNING, stage="lease", vm_name=vm_name, started=round_no == 1)
    stage = "lease"
    cell_facts: dict[str, Any] = {"image_digest": image.digest, "image_sha256": image.sha256,
                                  "clone": cell.clone.value, "host_facts_id": ctx.host_fp.get(cell.host)}

    def enter(name: str, detail: str = "") -> None:
        nonlocal stage
        stage = name
        store.cell_update(rid, cell.id, stage=name)
        ctx.reporter.stage(cell, name, detail)

    lease_id = store.add_lease(rid, cell.id, cell.host, backend.name, vm_name, expires)
    vm: Vm | None = None
    guest: Guest | None = None
    emulation: wan.Emulation | None = None
    status, error = CellStatus.FAILED, None
    try:
        enter("clone")
        vm = backend.clone(image, spec)
        enter("boot")
        backend.start(vm)
        address = backend.wait_ready(vm)
        cell_facts.update(vm.facts)
        enter("ssh")
        guest = Guest(address, key=_key_for(image), netns=getattr(client, "netns", None),
                      control_dir=Path(vm.handle["dir"]) if "dir" in vm.handle else None, os=image.os)
        guest.connect(timeout=90)
        enter("verify")
        cell_facts["verified"] = verify(guest, facts, spec)
        enter("tune", cell.tuning)
        applied = tuning.apply(guest, facts, cell.tuning)
        cell_facts["tuning"] = {"profile": applied.profile, "applicable": applied.applicable,
                                "effective": applied.effective, "reason": applied.reason}
        if not applied.applicable:
            status, error = CellStatus.NA, applied.reason
            return status
        emulation, reason = tune_network(ctx, cell, vm, guest, facts, cell_facts)
        if reason:
            status, error = CellStatus.NA, reason
            return status
        first = ctx.signatures.setdefault(plan.effective_signature(cell, cell_facts["tuning"]), cell.id)
        if first != cell.id:  # found by reading back: the guest is configured as an earlier cell was
            status = record_duplicate(ctx, cell, first, cell_facts, "read-back", finish=False)
            error = f"duplicate of {first} (same effective configuration, read back)"
            return status
        enter("workloads")
        labels_base = {**cell.axes(), "image_digest": image.digest, "clone": cell.clone.value,
                       "accel": vm.facts.get("accel"), "host_facts_id": ctx.host_fp.get(cell.host),
                       "tools": image.manifest.get("tools", {})}
        store.cell_update(rid, cell.id, facts=cell_facts)
        run_workloads(ctx, cell, guest, client, image.os, address, labels_base, enter, round_no=round_no,
                      quota=quota)
        status = CellStatus.DONE if final else CellStatus.PENDING
        return status
    except LabError as exc:
        error = f"{stage}: {exc}"
        ctx.reporter.warn(f"{cell.id} failed at {stage}: {exc}")
        return status
    except Interrupted:
        error = f"{stage}: interrupted"
        raise
    finally:
        with shielded():
            if status == CellStatus.FAILED and vm is not None:
                cell_facts["console_tail"] = _console_tail(backend, vm)
            ctx.reporter.stage(cell, "teardown")
            if emulation is not None:
                try:
                    emulation.remove()
                except LabError as exc:  # the VM (and its tap) goes next anyway; say so
                    ctx.reporter.warn(f"{cell.id}: could not remove netem: {exc}")
            if guest is not None:
                guest.close()
            status, error = finish_cell(ctx, cell, backend, vm, lease_id, status, error, cell_facts)


def tune_network(ctx: RunContext, cell: plan.Cell, vm: Vm, guest: Guest, facts: osfacts.OsFacts,
                 cell_facts: dict[str, Any]) -> tuple[wan.Emulation | None, str]:
    """The tune stage's network knobs, each read back into cell_facts["tuning"]: congestion control,
    offloads of the cell's NIC, netem. Returns the emulation to remove after the cell and the reason
    the cell is n/a ("" if every knob applied)."""
    rec = cell_facts["tuning"]
    cc = tuning.apply_cc(guest, facts, cell.cc)
    rec["cc"] = {"asked": cell.cc, "effective": cc.effective}
    if not cc.applicable:
        return None, cc.reason
    dev = facts.device(cell.nic)
    off = tuning.apply_offloads(guest, facts, dev, parse_offloads(cell.offloads))
    rec["offloads"] = {"asked": cell.offloads, "effective": off.effective}
    if not off.applicable:
        return None, off.reason
    profile = ctx.cfg.wan.get(cell.wan)
    if profile is None or profile.is_null:  # "none", or a profile of zeros: nothing to emulate
        rec["wan"] = {"asked": cell.wan, "netem": None}
        return None, ""
    where, why = wan.place(ctx.backends[cell.host].name, facts)
    if not where:
        return None, f"wan {cell.wan!r}: {why}"
    emulation = (wan.Emulation(profile, where, dev=vm.handle["tap"], netns=vm.handle["netns"]) if where == "lab"
                 else wan.Emulation(profile, where, guest=guest, facts=facts, dev=dev))
    rec["wan"] = {"asked": cell.wan, "placement": why, **emulation.apply()}
    want = {k: float(v) for k, v in profile.model_dump().items()}
    if rec["wan"]["netem"] != want:
        return emulation, f"wan {cell.wan!r}: asked netem {want}, in effect {rec['wan']['netem']}"
    return emulation, ""


def record_duplicate(ctx: RunContext, cell: plan.Unit, first: str, cell_facts: dict[str, Any], found: str,
                     *, finish: bool = True) -> str:
    """A cell whose effective configuration is an earlier cell's: recorded, pointing at it, not measured."""
    cell_facts.update({"duplicate_of": first, "duplicate_found": found})
    if finish:
        error = f"duplicate of {first} (same effective configuration, {'known at plan time' if found == 'plan' else found})"
        ctx.store.cell_update(ctx.run_id, cell.id, status=CellStatus.DUPLICATE, error=error, facts=cell_facts,
                              finished=True)
        ctx.reporter.cell_finished(cell, CellStatus.DUPLICATE, error)
    return CellStatus.DUPLICATE


def finish_cell(ctx: RunContext, cell: plan.Unit, backend, vm: Vm | None, lease_id: int, status: str,
                error: str | None, cell_facts: dict[str, Any]) -> tuple[str, str | None]:
    """The end of a cell's life (in its `finally`): destroy what was made, release the lease only
    then, record the outcome. A teardown failure fails the cell and, loudly, the run."""
    if vm is not None:
        try:
            backend.destroy(vm)
        except LabError as exc:
            ctx.teardown_failures.append(str(exc))
            status, error = CellStatus.FAILED, f"teardown: {exc}"
        else:
            ctx.store.release_lease(lease_id)
    else:
        ctx.store.release_lease(lease_id)
    ctx.store.cell_update(ctx.run_id, cell.id, status=status, error=error, facts=cell_facts, finished=True)
    ctx.reporter.cell_finished(cell, status, error)
    return status, error


def run_workloads(ctx: RunContext, cell: plan.Unit, guest, client, os_name: str, address: str,
                  labels_base: dict[str, Any], enter, *, vcpus: int | None = None, round_no: int = 1,
                  quota: int | None = None, skipped: dict[str, str] | None = None) -> None:
    """Warm-ups (discarded), then measured repetitions of each workload until the repetition
    policy stops it (lab.schedule), or `quota` repetitions in this boot (interleaved rounds).
    Every execution is recorded as it starts and ends; raw output is stored before parsing.
    `skipped`: a workload whose prepare fails is recorded there and skipped instead of failing the
    cell (the bare-metal cell: a tool the host lacks)."""
    cfg, store, rid = ctx.cfg, ctx.store, ctx.run_id
    workloads = load_all()
    seed = store.run(rid).seed or 0
    for name in cfg.suite.workloads:
        tally = ctx.tallies.setdefault((cell.id, name), schedule.Tally())
        if tally.stopped:
            continue  # measured enough in an earlier round, or skipped
        wl = workloads[name]
        wctx = WorkloadContext(guest=guest, client=client, os=os_name, vcpus=vcpus or cell.vcpus,
                               params=workload_params(cfg, name), guest_address=address)
        enter("workloads", f"{name}: prepare")
        try:
            wl.prepare(wctx)
        except LabError as exc:
            if skipped is None:
                raise
            skipped[name] = str(exc)
            tally.stop(f"skipped: {exc}")
            continue
        where = f" (round {round_no})" if quota is not None else ""

        def execute(rep: int, detail: str) -> None:
            enter("workloads", f"{name} {detail}{where}")
            eid = store.start_execution(rid, cell.id, round_no, name, rep)
            try:
                raw = wl.run(wctx, rep)
                raw_id = store.add_raw(rid, cell.id, rep, raw)  # stored before parsing: nothing is lost
                if rep >= 0:
                    samples = wl.parse(raw)
                    stamped = [type(s)(s.metric, s.value, s.unit, s.higher_is_better,
                                       {**labels_base, **s.labels, "repetition": rep, "round": round_no})
                               for s in samples]
                    store.add_samples(rid, cell.id, raw_id, name, rep, stamped)
                    tally.add(stamped, raw.seconds)
            except BaseException as exc:
                store.finish_execution(eid, "failed", error=str(exc) or type(exc).__name__)
                raise
            store.finish_execution(eid, "ok", raw_id=raw_id)

        for w in range(cfg.suite.warmup):
            execute(w - cfg.suite.warmup, "warm-up")  # warm-ups are negative and yield no samples
        done = 0
        while not tally.stopped and (quota is None or done < quota):
            execute(tally.n, f"{tally.n + 1}/{schedule.planned(cfg.suite)}")
            done += 1
            tally.update(cfg.suite, seed=seed)


def run_bare_metal(ctx: RunContext, cell: plan.BareMetalCell, position: int, total: int, *, round_no: int = 1,
                   quota: int | None = None, final: bool = True) -> str:
    """The bare-metal cell's life, as run_cell's: lease -> namespace, veth, cgroup (and nginx) ->
    workloads -> teardown in `finally`. A workload whose tool the host lacks is skipped, recorded."""
    from lab import baremetal

    cfg, store, rid = ctx.cfg, ctx.store, ctx.run_id
    backend, client = ctx.backends[cell.host], ctx.clients[cell.host]
    name = f"lab-{rid}-{cell.id}"
    expires = time.time() + cfg.lab.lease_minutes * 60
    ctx.reporter.cell_started(cell, position, total)
    store.cell_update(rid, cell.id, status=CellStatus.RUNNING, stage="lease", vm_name=name, started=round_no == 1)
    stage = "lease"
    cell_facts: dict[str, Any] = {"kind": plan.BARE_METAL, "accel": "none", "host_facts_id": ctx.host_fp.get(cell.host)}

    def enter(stage_name: str, detail: str = "") -> None:
        nonlocal stage
        stage = stage_name
        store.cell_update(rid, cell.id, stage=stage_name)
        ctx.reporter.stage(cell, stage_name, detail)

    lease_id = store.add_lease(rid, cell.id, cell.host, backend.name, name, expires)
    bm = None
    status, error = CellStatus.FAILED, None
    skipped: dict[str, str] = {}
    try:
        enter("clone", "namespace, veth, cgroup")
        bm = baremetal.create(backend, rid, cell, expires, bridge_ns=client.netns)
        cell_facts.update(bm.facts)
        enter("verify")
        cell_facts["verified"] = baremetal.describe(bm)
        cell_facts["tuning"] = baremetal.effective_tuning(bm)
        web = [w for w in ("http", "https") if w in cfg.suite.workloads
               and not ctx.tallies.get((cell.id, w), schedule.Tally()).stopped]
        if web:
            why = baremetal.start_nginx(bm, cfg.matrix.image[0])
            cell_facts.update({k: v for k, v in bm.facts.items() if k == "nginx"})
            for w in web if why else ():
                skipped[w] = why
                ctx.tallies.setdefault((cell.id, w), schedule.Tally()).stop(f"skipped: {why}")
        enter("workloads")
        labels_base = {**cell.axes(), "accel": "none", "host_facts_id": ctx.host_fp.get(cell.host)}
        store.cell_update(rid, cell.id, facts=cell_facts)
        run_workloads(ctx, cell, bm.guest, client, baremetal.OS, bm.address, labels_base, enter,
                      vcpus=cell_facts["verified"]["vcpus"], round_no=round_no, quota=quota, skipped=skipped)
        status = CellStatus.DONE if final else CellStatus.PENDING
        return status
    except LabError as exc:
        error = f"{stage}: {exc}"
        ctx.reporter.warn(f"{cell.id} failed at {stage}: {exc}")
        return status
    except Interrupted:
        error = f"{stage}: interrupted"
        raise
    finally:
        with shielded():
            if skipped:
                ctx.reporter.warn(f"{cell.id}: skipped on bare metal: "
                                  + "; ".join(f"{w}: {r}" for w, r in skipped.items()))
            gone = schedule.skipped(ctx.tallies, cell.id)  # this round's and earlier rounds'
            if gone:
                cell_facts["skipped_workloads"] = gone
            ctx.reporter.stage(cell, "teardown")
            status, error = finish_cell(ctx, cell, backend, bm.vm if bm else None, lease_id, status, error, cell_facts)


def verify(guest: Guest, facts: osfacts.OsFacts, spec: VmSpec) -> dict[str, Any]:
    """Read back from inside the guest what the cell asked for; refuse to measure a mismatch."""
    out = guest.run(f"echo nic=$({facts.nic_driver_cmd}); echo cpus=$({facts.ncpu_cmd}); "
                    f"echo mem=$({facts.mem_kib_cmd}); uname -sr", timeout=30).stdout
    seen = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    observed = {"nic_driver": seen.get("nic", "").strip(), "vcpus": _int(seen.get("cpus")),
                "mem_kib": _int(seen.get("mem")), "kernel": out.splitlines()[-1].strip() if out else ""}
    want_driver = facts.nic_driver.get(spec.nic)
    problems = []
    if observed["nic_driver"] != want_driver:
        problems.append(f"NIC driver is {observed['nic_driver'] or 'none'!r}, cell asked for {spec.nic.value} "
                        f"({want_driver})")
    if observed["vcpus"] != spec.vcpus:
        problems.append(f"guest sees {observed['vcpus']} vCPUs, cell asked for {spec.vcpus}")
    mem_mib = (observed["mem_kib"] or 0) / 1024
    # The kernel keeps some memory for itself: MemTotal is 85-100 % of what QEMU gives.
    if not (0.80 * spec.memory_mib <= mem_mib <= spec.memory_mib * 1.01):
        problems.append(f"guest sees {mem_mib:.0f} MiB, cell asked for {spec.memory_mib} MiB")
    if problems:
        raise VerificationError("; ".join(problems))
    return observed


def _int(value: str | None) -> int | None:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


def _key_for(image) -> Path:
    from lab.backends.local import lab_key

    return lab_key()


def _console_tail(backend, vm: Vm, lines: int = 15) -> str:
    """The end of what the guest printed on its serial console (backends that can read it)."""
    if hasattr(backend, "console_text"):
        text = backend.console_text(vm)
    elif "dir" in vm.handle:
        try:
            text = (Path(vm.handle["dir"]) / "console.log").read_text(errors="replace")
        except OSError:
            text = ""
    else:
        text = ""
    return "\n".join(text.splitlines()[-lines:])


def reparse(store: Store, run_id: str) -> int:
    """Rebuild a run's samples from its stored raw outputs (after a parser fix)."""
    workloads = load_all()
    cells = {c.cell_id: c for c in store.cells(run_id)}
    old = {}
    for s in store.samples(run_id):
        old.setdefault((s.cell_id, s.workload, s.repetition), s.labels)
    rows, count = [], 0
    for raw_id, cell_id, rep, raw in store.raw_outputs(run_id):
        if rep < 0 or raw.workload not in workloads:
            continue
        base = {k: v for k, v in old.get((cell_id, raw.workload, rep), {}).items()}
        if not base and cell_id in cells:
            base = {**cells[cell_id].axes, "repetition": rep}
        samples = workloads[raw.workload].parse(raw)
        stamped = [type(s)(s.metric, s.value, s.unit, s.higher_is_better, {**base, **s.labels, "repetition": rep})
                   for s in samples]
        rows.append((cell_id, raw_id, raw.workload, rep, stamped))
        count += len(stamped)
    store.replace_samples(run_id, rows)  # parsed first, swapped in one transaction
    return count


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
