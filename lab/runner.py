"""A lab run: per cell, lease -> clone -> boot -> verify -> tune -> workloads -> teardown.

A cell that fails is marked failed with the stage it reached and the error; the other cells go
on, and everything already measured stays stored. Teardown runs in `finally` (Ctrl-C and
SIGTERM included); a teardown failure fails the run loudly.
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

from lab import IMAGES_DIR, __version__, hostinfo, images, osfacts, plan, tuning
from lab.backends import BACKENDS
from lab.config import LabConfig
from lab.errors import LabError, TeardownError, VerificationError
from lab.guest import Guest
from lab.model import CellStatus, RawOutput, Vm, VmSpec
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


def estimate_seconds(cfg: LabConfig, cells: list[plan.Cell]) -> float:
    """Rough: boot + per workload (duration + overhead) x (repetitions + warm-up)."""
    per_cell = BOOT_ESTIMATE_S
    runs = cfg.suite.repetitions + cfg.suite.warmup
    for name in cfg.suite.workloads:
        wl = load_all()[name]
        params = workload_params(cfg, name)
        est = getattr(wl, "estimate_seconds", None)
        per_cell += runs * (est(params) if est else float(params.get("time", params.get("duration", 10))) + 3)
    return per_cell * len(cells)


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


def build_backends(cfg: LabConfig, hosts: set[str]) -> dict[str, Any]:
    out = {}
    for name in sorted(hosts):
        hc = cfg.hosts[name]
        cls = BACKENDS.get(hc.backend)
        if cls is None:
            _import_backend(hc.backend)
            cls = BACKENDS[hc.backend]
        settings = hc.model_dump()
        settings["source"] = cfg.source
        pub = IMAGES_DIR / "lab_key.pub"
        if hc.backend == "proxmox" and not settings.get("ssh_keys") and pub.exists():
            settings["ssh_keys"] = pub.read_text().strip()  # cloud-init gets the lab's key
        out[name] = cls(name, settings)
    return out


def _import_backend(name: str) -> None:
    import importlib

    importlib.import_module(f"lab.backends.{name}")


def prepare(cfg: LabConfig) -> tuple[list[plan.Cell], dict[str, Any], dict[str, Any]]:
    """Everything that can fail before anything is created: cells, images, backends' checks."""
    cells = plan.cells(cfg)
    # Secrets and hosts first: a wrong token or an unreachable host is the first thing to fix.
    backends = build_backends(cfg, {c.host for c in cells})
    for b in backends.values():
        b.check()
    imgs = {name: images.load(name) for name in sorted({c.image for c in cells})}
    for host, b in backends.items():
        if hasattr(b, "check_images"):  # e.g. Proxmox: a template per image on every node it may use
            b.check_images([imgs[name] for name in sorted({c.image for c in cells if c.host == host})])
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
    ordered = plan.order(cells, cfg.suite.order, seed)
    manifest["order"] = [c.id for c in ordered]
    if resume:
        ordered = [c for c in ordered if c.id in todo]
        for c in ordered:
            store.reset_cell(run_id, c.id)
        store.reopen_run(run_id)
    else:
        store.create_run(run_id, cfg.lab.name, config_path=str(Path(cfg.source).resolve()), config_text=config_text,
                         seed=seed, lab_version=__version__, manifest=manifest)
        for c in cells:
            store.add_cell(run_id, c.id, c.index, c.label, c.axes())
    # Leftovers of dead runs on these hosts go before anything new is made.
    from lab import gc

    swept = gc.collect(cfg, hosts=list(backends), backends=backends)
    for line in swept.lines:
        if line.startswith("removed"):
            reporter.warn(f"swept a leftover of an earlier run: {line.removeprefix('removed ')}")
    for e in swept.errors:
        reporter.warn(f"could not sweep: {e}")
    ctx = RunContext(cfg, store, run_id, reporter, backends)
    reporter.run_started(run_id, ordered, estimate_seconds(cfg, ordered))
    status, error = "failed", None
    try:
        for host, backend in backends.items():
            ctx.clients[host] = backend.open_run(run_id)
            facts = hostinfo.snapshot(host, backend)
            ctx.host_fp[host] = store.add_host_facts(run_id, host, hostinfo.fingerprint(facts), facts)
        for pos, cell in enumerate(ordered, start=1):
            run_cell(ctx, cell, imgs[cell.image], pos, len(ordered))
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
    todo = {cid for cid, c in stored.items() if c.status not in (CellStatus.DONE, CellStatus.NA)}
    return run.id, int(run.seed or 0), todo


def run_cell(ctx: RunContext, cell: plan.Cell, image, position: int, total: int) -> str:
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
    store.cell_update(rid, cell.id, status=CellStatus.RUNNING, stage="lease", vm_name=vm_name, started=True)
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
        enter("workloads")
        labels_base = {**cell.axes(), "image_digest": image.digest, "clone": cell.clone.value,
                       "accel": vm.facts.get("accel"), "host_facts_id": ctx.host_fp.get(cell.host),
                       "tools": image.manifest.get("tools", {})}
        store.cell_update(rid, cell.id, facts=cell_facts)
        run_workloads(ctx, cell, guest, client, image.os, address, labels_base, enter)
        status = CellStatus.DONE
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
            if status == CellStatus.FAILED and vm is not None and "dir" in vm.handle:
                cell_facts["console_tail"] = _console_tail(Path(vm.handle["dir"]) / "console.log")
            ctx.reporter.stage(cell, "teardown")
            if guest is not None:
                guest.close()
            if vm is not None:
                try:
                    backend.destroy(vm)
                except LabError as exc:
                    ctx.teardown_failures.append(str(exc))
                    status, error = CellStatus.FAILED, f"teardown: {exc}"
                else:
                    store.release_lease(lease_id)
            else:
                store.release_lease(lease_id)
            store.cell_update(rid, cell.id, status=status, error=error, facts=cell_facts, finished=True)
            ctx.reporter.cell_finished(cell, status, error)


def run_workloads(ctx: RunContext, cell: plan.Cell, guest: Guest, client, os_name: str, address: str,
                  labels_base: dict[str, Any], enter) -> None:
    cfg, store, rid = ctx.cfg, ctx.store, ctx.run_id
    workloads = load_all()
    for name in cfg.suite.workloads:
        wl = workloads[name]
        wctx = WorkloadContext(guest=guest, client=client, os=os_name, vcpus=cell.vcpus,
                               params=workload_params(cfg, name), guest_address=address)
        enter("workloads", f"{name}: prepare")
        wl.prepare(wctx)
        total = cfg.suite.warmup + cfg.suite.repetitions
        for i in range(total):
            rep = i - cfg.suite.warmup  # warm-ups are negative and yield no samples
            enter("workloads", f"{name} {'warm-up' if rep < 0 else f'{rep + 1}/{cfg.suite.repetitions}'}")
            raw = wl.run(wctx, rep)
            raw_id = store.add_raw(rid, cell.id, rep, raw)  # stored before parsing: nothing is lost
            if rep < 0:
                continue
            samples = wl.parse(raw)
            stamped = [type(s)(s.metric, s.value, s.unit, s.higher_is_better,
                               {**labels_base, **s.labels, "repetition": rep}) for s in samples]
            store.add_samples(rid, cell.id, raw_id, name, rep, stamped)


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


def _console_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def reparse(store: Store, run_id: str) -> int:
    """Rebuild a run's samples from its stored raw outputs (after a parser fix)."""
    workloads = load_all()
    cells = {c.cell_id: c for c in store.cells(run_id)}
    old = {}
    for s in store.samples(run_id):
        old.setdefault((s.cell_id, s.workload, s.repetition), s.labels)
    store.delete_samples(run_id)
    count = 0
    for raw_id, cell_id, rep, raw in store.raw_outputs(run_id):
        if rep < 0 or raw.workload not in workloads:
            continue
        base = {k: v for k, v in old.get((cell_id, raw.workload, rep), {}).items()}
        if not base and cell_id in cells:
            base = {**cells[cell_id].axes, "repetition": rep}
        samples = workloads[raw.workload].parse(raw)
        stamped = [type(s)(s.metric, s.value, s.unit, s.higher_is_better, {**base, **s.labels, "repetition": rep})
                   for s in samples]
        store.add_samples(run_id, cell_id, raw_id, raw.workload, rep, stamped)
        count += len(stamped)
    return count


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
