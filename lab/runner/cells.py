"""The cells of a run: a VM cell (clone -> boot -> ssh -> verify -> tune -> workloads) and the
bare-metal cell (the host itself, set up by its backend), both inside one lifecycle
(lab.lifecycle.CellLife: lease first, teardown always, the failing stage recorded)."""

from __future__ import annotations

import time
from typing import Any

from lab import isolation, osfacts, plan, schedule, tuning, wan, workloads
from lab.errors import VerificationError
from lab.guest import Machine
from lab.lifecycle import CellLife, Interrupted, lease_expiry
from lab.model import MADE_BY_HOST, CellStatus, ImageRef, Isolation, Runtime, Vm, VmSpec
from lab.runner.context import RunContext, workload_params
from lab.runner.measure import run_workloads


def run_unit(
    ctx: RunContext,
    unit: plan.Unit,
    imgs: dict[str, ImageRef],
    position: int,
    total: int,
    *,
    round_no: int = 1,
    quota: int | None = None,
    final: bool = True,
) -> str:
    """One boot of a cell (or one set-up of the bare-metal cell); its status afterwards. Its wall
    time, lease to teardown, goes into ctx.spans (the run manifest's overlaps)."""
    if unit.id in ctx.duplicates:  # known before booting: the same effective configuration as an earlier cell
        return record_duplicate(ctx, unit, ctx.duplicates[unit.id])
    if ctx.cancel.is_set():  # a lane between two cells when the run was interrupted
        raise Interrupted("cancelled: the run was interrupted")
    started = time.time()
    try:
        if unit.kind == plan.BARE_METAL:
            return run_bare_metal(ctx, unit, position, total, round_no=round_no, quota=quota, final=final)
        return run_cell(ctx, unit, imgs[unit.image], position, total, round_no=round_no, quota=quota, final=final)
    finally:
        ctx.spans.append((unit.id, str(unit.host), started, time.time()))


def _life(
    ctx: RunContext, unit: plan.Unit, position: int, total: int, round_no: int, facts: dict[str, Any], expires_at: float
) -> CellLife:
    return CellLife(
        store=ctx.store,
        run_id=ctx.run_id,
        reporter=ctx.reporter,
        cell=unit,
        backend=ctx.backends[unit.host],
        expires_at=expires_at,
        position=position,
        total=total,
        first_boot=round_no == 1,
        teardown_failures=ctx.teardown_failures,
        facts=facts,
        round_no=round_no,
        cancel=ctx.cancel,
        lost_hosts=ctx.lost_hosts,
        leases=ctx.leases,
    )


def run_cell(
    ctx: RunContext,
    cell: plan.Cell,
    image: ImageRef,
    position: int,
    total: int,
    *,
    round_no: int = 1,
    quota: int | None = None,
    final: bool = True,
) -> str:
    expires = lease_expiry(ctx.cfg.lab.lease_minutes)
    spec = plan.vm_spec(cell, image, run_id=ctx.run_id, expires_at=expires, place=ctx.place, owner=ctx.owner)
    life = _life(
        ctx,
        cell,
        position,
        total,
        round_no,
        expires_at=expires,
        facts={
            "image_digest": image.digest,
            "image_sha256": image.sha256,
            "clone": cell.clone.value,
            "host_facts_id": ctx.host_fp.get(cell.host),
        },
    )
    with life:
        _vm_cell(ctx, life, cell, image, spec, round_no=round_no, quota=quota, final=final)
    return life.status


def _vm_cell(
    ctx: RunContext,
    life: CellLife,
    cell: plan.Cell,
    image: ImageRef,
    spec: VmSpec,
    *,
    round_no: int,
    quota: int | None,
    final: bool,
) -> None:
    backend, client = ctx.backends[cell.host], ctx.clients[cell.host]
    facts = osfacts.facts(image.os)
    life.enter("clone")
    vm = life.vm = backend.clone(image, spec)
    life.enter("boot")
    backend.start(vm)
    address = backend.wait_ready(vm)
    life.facts.update(vm.facts)
    life.enter("ssh")
    guest = backend.guest(vm, client)
    life.on_teardown("close SSH", guest.close)
    guest.connect(timeout=backend.settings.ssh_timeout)
    life.enter("verify")
    life.facts["verified"] = verify(guest, facts, spec, vm.facts.get("caps"))
    life.enter("tune", cell.tuning)
    applied = tuning.apply(guest, facts, cell.tuning)
    life.facts["tuning"] = {
        "profile": applied.profile,
        "applicable": applied.applicable,
        "effective": applied.effective,
        "reason": applied.reason,
    }
    if not applied.applicable:
        return life.finish(CellStatus.NA, applied.reason)
    emulation, reason = tune_network(ctx, cell, vm, guest, facts, life.facts)
    if emulation is not None:
        life.on_teardown("remove netem", emulation.remove)  # before the VM (and its tap) goes
    if reason:
        return life.finish(CellStatus.NA, reason)
    first = ctx.signatures.setdefault(plan.effective_signature(cell, life.facts["tuning"]), cell.id)
    if first != cell.id:  # found by reading back: the guest is configured as an earlier cell was
        life.facts.update({"duplicate_of": first, "duplicate_found": "read-back"})
        return life.finish(CellStatus.DUPLICATE, f"duplicate of {first} (same effective configuration, read back)")
    where = isolate(ctx, life, cell.isolation, guest, image.os, runtime=cell.runtime)
    if where is None:
        return
    life.enter("workloads")
    labels_base = {
        **cell.axes(),
        "image_digest": image.digest,
        "clone": cell.clone.value,
        "accel": vm.facts.get("accel"),
        "host_facts_id": ctx.host_fp.get(cell.host),
        "tools": image.manifest.get("tools", {}),
        **isolation_labels(where),
    }
    ctx.store.cell_update(ctx.run_id, cell.id, facts=life.facts)
    generator = ctx.generators.get(cell.host, client)
    run_workloads(
        ctx,
        life,
        where.guest,
        generator,
        image.os,
        address,
        labels_base,
        vcpus=cell.vcpus,
        round_no=round_no,
        quota=quota,
    )
    life.finish(CellStatus.DONE if final else CellStatus.PENDING)


def isolate(
    ctx: RunContext,
    life: CellLife,
    kind: Isolation,
    machine: Machine,
    os_name: str,
    *,
    runtime: Runtime = Runtime.PODMAN,
    host_cgroup: bool = False,
    serve_web: bool = True,
    where: str = "the guest",
) -> isolation.Place | None:
    """The last step of the tune stage: where the workloads run (lab.isolation), removed at
    teardown. None: the machine cannot make it, the cell is n/a with the reason."""
    if kind != Isolation.VM:
        life.enter("tune", f"isolation {kind.value}")
    try:
        place = isolation.enter(
            kind,
            machine,
            name=life.name,
            os_name=os_name,
            network=ctx.cfg.isolation.network,
            runtime=runtime,
            labels={"lab.run": ctx.run_id, "lab.cell": life.cell.id},
            host_cgroup=host_cgroup,
            serve_web=serve_web,
            where=where,
            tuned=tuned_sysctls(life.facts.get("tuning") or {}, os_name),
            nested=any(workloads.get(w).own_containers(workload_params(ctx.cfg, w)) for w in ctx.cfg.suite.workloads),
            # the bare-metal host is not reached by SSH: its scp is skipped, no sshd is started for it
            sshd=not host_cgroup and any(workloads.get(w).traits.serves_ssh for w in ctx.cfg.suite.workloads),
        )
    except isolation.Unavailable as exc:
        life.finish(CellStatus.NA, str(exc))
        return None
    if place.facts:
        life.facts["isolation"] = place.facts  # the same dict: what remove() adds is stored at teardown
        life.on_teardown(f"remove the {kind.value}", place.remove)
    return place


def tuned_sysctls(tuning: dict[str, Any], os_name: str) -> dict[str, str]:
    """The sysctls the tune stage set, read back: the profile's (the default profile sets none: what
    it reads back is the guest's own), and congestion control if asked."""
    out = {}
    if tuning.get("profile", "default") != "default":
        out = {k: str(v) for k, v in (tuning.get("effective") or {}).items()}
    cc = tuning.get("cc") or {}
    if cc.get("asked", "default") != "default" and cc.get("effective"):
        out[osfacts.facts(os_name).cc_key] = str(cc["effective"])
    return out


def isolation_labels(place: isolation.Place) -> dict[str, Any]:
    """What every sample of a cell in a container carries: the container it was measured in."""
    if not place.name:
        return {}
    return {
        "container": place.facts["id"][:12],
        "container_network": place.facts["network"],
        "container_runtime": place.facts["runtime"],
    }


def tune_network(
    ctx: RunContext, cell: plan.Cell, vm: Vm, guest: Machine, facts: osfacts.OsFacts, cell_facts: dict[str, Any]
) -> tuple[wan.Emulation | None, str]:
    """The tune stage's network knobs, each read back into cell_facts["tuning"]: congestion control,
    offloads of the cell's NIC, netem. Returns the emulation to remove after the cell and the reason
    the cell is n/a ("" if every knob applied)."""
    rec = cell_facts["tuning"]
    cc = tuning.apply_cc(guest, facts, cell.cc)
    rec["cc"] = {"asked": cell.cc, "effective": cc.effective}
    if not cc.applicable:
        return None, cc.reason
    sysctls = rec.get("effective") or {}
    if facts.cc_key in sysctls and cc.effective:  # the knob comes after the profile (wan-16m sets bbr): its value holds
        sysctls[facts.cc_key] = cc.effective
    dev = facts.device(cell.nic)
    off = tuning.apply_offloads(guest, facts, dev, tuning.parse_offloads(cell.offloads))
    rec["offloads"] = {"asked": cell.offloads, "effective": off.effective}
    if not off.applicable:
        return None, off.reason
    profile = ctx.cfg.wan.get(cell.wan)
    if profile is None or profile.is_null:  # "none", or a profile of zeros: nothing to emulate
        rec["wan"] = {"asked": cell.wan, "netem": None}
        return None, ""
    backend = ctx.backends[cell.host]
    caps = backend.capabilities(backend.settings)
    link = backend.lab_link(vm)
    where, why = wan.place(caps.lab_side_link and link is not None, caps.description, facts)
    if not where:
        return None, f"wan {cell.wan!r}: {why}"
    emulation = (
        wan.Emulation(profile, where, dev=link.dev, netns=link.netns)
        if where == "lab" and link
        else wan.Emulation(profile, where, guest=guest, facts=facts, dev=dev)
    )
    rec["wan"] = {"asked": cell.wan, "placement": why, **emulation.apply()}
    want = {k: float(v) for k, v in profile.model_dump().items()}
    if rec["wan"]["netem"] != want:
        return emulation, f"wan {cell.wan!r}: asked netem {want}, in effect {rec['wan']['netem']}"
    return emulation, ""


def record_duplicate(ctx: RunContext, cell: plan.Unit, first: str) -> str:
    """A cell known at plan time to have an earlier cell's effective configuration: recorded,
    pointing at it, never booted."""
    error = f"duplicate of {first} (same effective configuration, known at plan time)"
    ctx.store.cell_update(
        ctx.run_id,
        cell.id,
        status=CellStatus.DUPLICATE,
        error=error,
        facts={"duplicate_of": first, "duplicate_found": "plan"},
        finished=True,
    )
    ctx.reporter.cell_finished(cell, CellStatus.DUPLICATE, error)
    return CellStatus.DUPLICATE


def run_bare_metal(
    ctx: RunContext,
    cell: plan.BareMetalCell,
    position: int,
    total: int,
    *,
    round_no: int = 1,
    quota: int | None = None,
    final: bool = True,
) -> str:
    """The suite on the host itself: its backend sets the host up as a cell (namespace, veth,
    cgroup), nothing is tuned, and a workload whose tool the host lacks is skipped, recorded."""
    expires = lease_expiry(ctx.cfg.lab.lease_minutes)
    life = _life(
        ctx,
        cell,
        position,
        total,
        round_no,
        expires_at=expires,
        facts={"kind": plan.BARE_METAL, "accel": "none", "host_facts_id": ctx.host_fp.get(cell.host)},
    )
    skipped: dict[str, str] = {}

    def record_skipped() -> None:
        if skipped:
            ctx.reporter.warn(
                f"{cell.id}: skipped on bare metal: " + "; ".join(f"{w}: {r}" for w, r in skipped.items())
            )
        gone = schedule.skipped(ctx.tallies, cell.id)  # this round's and earlier rounds'
        if gone:
            life.facts["skipped_workloads"] = gone

    life.on_teardown("record the skipped workloads", record_skipped)
    with life:
        _bare_metal_cell(ctx, life, cell, expires, skipped, round_no=round_no, quota=quota, final=final)
    return life.status


def _bare_metal_cell(
    ctx: RunContext,
    life: CellLife,
    cell: plan.BareMetalCell,
    expires: float,
    skipped: dict[str, str],
    *,
    round_no: int,
    quota: int | None,
    final: bool,
) -> None:
    cfg, client = ctx.cfg, ctx.clients[cell.host]
    life.enter("clone", "namespace, veth, cgroup")
    backend = ctx.backends[cell.host]
    if backend.bare_metal is None:
        raise backend.lacks("cannot run a bare-metal cell")
    bm = backend.bare_metal.make(ctx.run_id, cell.id, cell.index, expires, client)
    life.vm = bm.vm
    life.facts.update(bm.facts)
    life.enter("verify")
    life.facts["verified"] = bm.describe()
    life.facts["tuning"] = bm.effective_tuning()
    # The host's podman, if any: the container stays in the cell's cgroup (its CPU accounting)
    where = isolate(
        ctx,
        life,
        cell.isolation,
        bm.guest,
        bm.guest.os,
        runtime=cell.runtime,
        host_cgroup=True,
        serve_web=False,
        where="this host",
    )
    if where is None:
        return
    web = [
        w
        for w in cfg.suite.workloads
        if workloads.get(w).traits.serves_web and not ctx.tallies.get((cell.id, w), schedule.Tally()).stopped
    ]
    if web:
        why = (
            bm.start_web(cfg.matrix.image[0])
            if where.guest is bm.guest
            else "nginx in a container on the host is not set up (the cell's nginx runs on the host)"
        )
        life.facts.update({k: v for k, v in bm.facts.items() if k == "nginx"})
        for w in web if why else ():
            skipped[w] = str(why)
            ctx.tallies.setdefault((cell.id, w), schedule.Tally()).stop(f"skipped: {why}")
    life.enter("workloads")
    labels_base = {
        **cell.axes(),
        "accel": "none",
        "host_facts_id": ctx.host_fp.get(cell.host),
        **isolation_labels(where),
    }
    ctx.store.cell_update(ctx.run_id, cell.id, facts=life.facts)
    run_workloads(
        ctx,
        life,
        where.guest,
        ctx.generators.get(cell.host, client),
        bm.guest.os,
        bm.address,
        labels_base,
        vcpus=life.facts["verified"]["vcpus"],
        round_no=round_no,
        quota=quota,
        skipped=skipped,
    )
    life.finish(CellStatus.DONE if final else CellStatus.PENDING)


def verify(guest: Machine, facts: osfacts.OsFacts, spec: VmSpec, caps: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read back from inside the guest what the cell asked for; refuse to measure a mismatch. A
    machine its host makes in place of a VM (a zone) has caps instead, which its backend read back
    and checked (`caps`): inside, it sees its host's CPUs and has no emulated NIC."""
    if spec.isolation in MADE_BY_HOST:
        if not caps:
            raise VerificationError(f"the host read back no caps of this {spec.isolation.value}")
        return {**caps, "kernel": guest.run("uname -sr", timeout=30).stdout.strip()}
    out = guest.run(
        f"echo nic=$({facts.nic_driver_cmd}); echo cpus=$({facts.ncpu_cmd}); "
        f"echo mem=$({facts.mem_kib_cmd}); uname -sr",
        timeout=30,
    ).stdout
    seen = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    observed: dict[str, Any] = {
        "nic_driver": seen.get("nic", "").strip(),
        "vcpus": _int(seen.get("cpus")),
        "mem_kib": _int(seen.get("mem")),
        "kernel": out.splitlines()[-1].strip() if out else "",
    }
    want_driver = facts.nic_driver.get(spec.nic)
    problems = []
    if observed["nic_driver"] != want_driver:
        problems.append(
            f"NIC driver is {observed['nic_driver'] or 'none'!r}, cell asked for {spec.nic.value} ({want_driver})"
        )
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
