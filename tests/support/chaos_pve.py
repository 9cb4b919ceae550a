"""The chaos suite's faults on the PVE emulator (tests/support/chaos.py): three injected here, the rest
from tests/pve_emulator/run_faults.py, and the foreign resources planted on a local, a libvirt and a
PVE host (tests/support/chaos_plant.py)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time

from pve_emulator import PveEmulator, run_faults
from pve_emulator.certs import make_certs
from pve_emulator.fixtures import FULL_ACL, TEMPLATE_VMID, TOKEN_ID, TOKEN_SECRET

from lab import images, statedir
from lab.backends.local import host as local_host
from lab.store import Store
from lab.wait import wait_until
from support import chaos_plant, libvirt_daemons
from support.chaos_scenario import (
    LAB,
    URI,
    Row,
    Scenario,
    cell_state,
    finish,
    gc_and_count,
    integrity,
    one_line,
    one_line_exit,
    peek,
    run_id_of,
    wait_for,
)

# -- the PVE emulator ------------------------------------------------------------------------------

# [hosts.pve] of the three faults injected here (run_faults' own faults bring their settings)
PVE_SETTINGS = {
    "template": TEMPLATE_VMID,
    # the bookkeeping emulator runs no guest: a clone that gets an address has no sshd to wait for
    "ssh_timeout": 3,
    "timeouts": {"clone": 4, "start": 5, "stop": 3, "destroy": 3, "ready": 20, "agent": 5},
}
NEEDS_IMAGE = {"pve-cfs-lock", "pve-foreign-resources"}  # run_faults' faults called (emu, image)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    return "[" + ", ".join(toml_value(x) for x in v) + "]"


def pve_host(emu, settings: dict) -> str:
    """[hosts.pve] on the emulator: its URL, CA and the lab's token, then `settings`."""
    table = {
        "backend": "proxmox",
        "url": emu.url,
        "node": "pve1",
        "token": "env:LAB_CHAOS_PVE_TOKEN",
        "ca_file": str(emu.certs.ca_file),
        "storage": "local-lvm",
        "bridge": "vmbr0",
        **settings,
    }
    return "[hosts.pve]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in table.items())


@contextlib.contextmanager
def emulator(sc: Scenario):
    """A PVE emulator with the lab's token (FULL_ACL) and the lab's own template of debian12, as
    `lab images publish` leaves it (run_faults.publish_template: a template without the lab's
    marker is refused)."""
    emu = PveEmulator("8.4", make_certs(sc.dir / "tls"), auth_delay=0.05)
    emu.task_seconds.update({"qmclone": 0.15, "qmstart": 0.08, "qmstop": 0.05, "qmdestroy": 0.08, "qmconfig": 0.03})
    emu.add_token(TOKEN_ID, TOKEN_SECRET, privsep=True, acl=FULL_ACL)
    run_faults.publish_template(emu, images.load("debian12"))
    sc.emulator = emu
    sc.env["LAB_CHAOS_PVE_TOKEN"] = f"{TOKEN_ID}={TOKEN_SECRET}"
    try:
        with emu:
            yield emu
    finally:
        sc.emulator = None


def with_emulator(sc: Scenario, row: Row, inject) -> None:
    with emulator(sc) as emu:
        sc.write(hosts=pve_host(emu, PVE_SETTINGS), matrix='host = ["pve"]\nnic = ["virtio"]')
        watcher = inject(emu)
        res = sc.lab("run", timeout=300)
        if watcher is not None:
            watcher.join(timeout=30)
        row.injected = True
        row.exit_status = res.returncode
        (sc.dir / "run.stderr").write_text(res.stderr)
        row.clear, row.message = one_line_exit(res.returncode, res.stderr, sc.results)
        # a lock held on a VM outlives the run: gc once the lock is gone, as a user would retry
        wait_until(
            lambda: not any(emu.vms[v].hold_lock for v in emu.vm_ids()),
            timeout=60,
            what="the held lock to expire",
            interval=0.5,
        )
        gc_and_count(sc, row, set(), {run_id_of(sc.results) or "-"})


def pve_fault(sc: Scenario, row: Row, name: str) -> None:
    """One fault of tests/pve_emulator/run_faults.py, as its docstring says the harness uses it:
    injected before `lab run`; the run's exit status and line checked (Injection.check_run); `lab gc`
    while the fault lasts, where it says; the fault cleared; `lab gc`; nothing left, nothing foreign
    touched."""
    with emulator(sc) as emu:
        make = run_faults.FAULTS[name]
        inj = make(emu, images.load("debian12")) if name in NEEDS_IMAGE else make(emu)
        sc.injection = inj
        sc.env.update(inj.env)
        sc.write(hosts=pve_host(emu, inj.merged_settings()), matrix='host = ["pve"]\nnic = ["virtio"]')
        res = sc.lab("run", timeout=600)
        if inj.watcher is not None:
            inj.watcher.join(timeout=120)
        row.injected = True
        row.exit_status = res.returncode
        (sc.dir / "run.stderr").write_text(res.stderr)
        clear, row.message = one_line(res.stderr, sc.results)
        problems = inj.check_run(emu, res.returncode, row.message)
        row.notes += problems
        row.clear = clear and not problems
        if inj.gc_exit_while_faulty is not None:
            gc = sc.lab("gc", timeout=600)
            if gc.returncode != inj.gc_exit_while_faulty or "Traceback" in gc.stderr:
                row.clear = False
                row.notes.append(
                    f"lab gc during the fault: exit {gc.returncode}, expected "
                    f"{inj.gc_exit_while_faulty}: {gc.stderr.strip().splitlines()[-1:]}"
                )
        inj.clear()
        gc_and_count(sc, row, set(), {run_id_of(sc.results) or "-"})
        row.touched = inj.touched()
        if inj.nothing_created:  # refused before anything was made: that includes the results store
            if row.integrity == "no store":
                row.integrity = "ok"
            else:
                row.clear = False
                row.notes.append("a results store was made by a run refused at its checks")


def pve_task_fails(sc: Scenario, row: Row) -> None:
    with_emulator(sc, row, lambda emu: emu.fail_next("qmstart", "start failed: QEMU exited with code 1"))


def pve_template_locked(sc: Scenario, row: Row) -> None:
    with_emulator(sc, row, lambda emu: emu.hold_lock(TEMPLATE_VMID, "backup", 12))


def pve_lock_on_teardown(sc: Scenario, row: Row) -> None:
    def inject(emu):
        emu.task_seconds["qmstart"] = 1.5
        emu.fail_next("qmstart", "start failed: QEMU exited with code 1")

        def lock_the_clone():  # while its start task runs, a backup job locks the clone for 8 s
            try:
                task = wait_until(
                    lambda: next((t for t in list(emu.tasks.values()) if t.type == "qmstart"), None),
                    timeout=60,
                    what="the clone's start task",
                    interval=0.01,
                )
                emu.hold_lock(int(task.id), "backup", 8)
            except Exception as exc:
                row.notes.append(f"could not lock the clone: {exc}")

        t = threading.Thread(target=lock_the_clone, daemon=True)
        t.start()
        return t

    with_emulator(sc, row, inject)
    if "teardown" not in row.message:
        row.notes.append("the teardown did not fail: the lock was not in its way")


# -- a host lost mid-run (issue 17) ------------------------------------------------------------------


def host_disappears(sc: Scenario, row: Row) -> None:
    """A run on two lanes, this machine and the PVE emulator: once the PVE clone's start task
    exists, the PVE host stops answering (every connection dropped, until cleared). Its lane ends
    with the reason while the local lane measures its cell to the end; the run exits 1 with one
    line; once the host is back, `lab gc` removes the clone the lost lane could not."""
    with emulator(sc) as emu:
        settings = {**PVE_SETTINGS, "timeouts": {**PVE_SETTINGS["timeouts"], "retry": 5, "destroy": 8, "http": 5}}
        sc.write(hosts=pve_host(emu, settings), matrix='host = ["local", "pve"]\nnic = ["virtio"]')
        p = sc.start()
        try:
            started = lambda: any(t.type == "qmstart" for t in list(emu.tasks.values()))  # noqa: E731
            wait_for("the PVE clone's start task", started, p)
            emu.drop_connections()  # every request from now on: the host is gone
            row.injected = True
        finally:
            row.exit_status = finish(p)
        row.clear, row.message = one_line_exit(row.exit_status, sc.stderr(), sc.results)
        rid = run_id_of(sc.results) or "-"
        states = {c: cell_state(sc.results, c) for c in ("c01", "c02")}
        pve_cell = next(c for c in states if cell_host(sc.results, rid, c) == "pve")
        local_cell = next(c for c in states if c != pve_cell)
        if states[local_cell][0] != "done" or states[local_cell][2] < sc.cfg.reps:
            row.clear = False
            row.notes.append(f"the local lane did not run to the end: {local_cell} {states[local_cell]}")
        if states[pve_cell][0] != "failed" or "pve" not in row.message:
            row.clear = False
            row.notes.append(f"the lost host's cell: {pve_cell} {states[pve_cell]}; run: {row.message}")
        emu.clear_connection_faults()  # the host is back: gc can look at it
        gc_and_count(sc, row, set(), {rid})


def cell_host(results, run_id: str, cell_id: str) -> str:
    rows = peek(results, "SELECT axes FROM cells WHERE run_id = ? AND cell_id = ?", (run_id, cell_id))
    return str(json.loads(rows[0][0]).get("host", "")) if rows else ""


# -- a lease outliving a long run (issue 35) -------------------------------------------------------------

LEASE_MINUTES = 0.1  # 6 s: renewed every 2 s while the run lives
LEASE_RUN_ID = "chaoslease"


def lease_outlives_run(sc: Scenario, row: Row) -> None:
    """A run on the PVE emulator longer than its lease (lease_minutes = 0.1: its cell waits 20 s for
    an sshd the bookkeeping emulator does not run), `--run-id chaoslease`. Once the lease it was
    cloned with has run out, `lab gc` of another machine (a state directory of its own) and another
    store, which has a finished run of the same id, looks at the cluster: it must keep the VM (its
    lease renewed, its owner not that store's run). The run then ends by itself (its cell fails at
    ssh, one line), `lab gc` removes nothing of another's, and nothing is left."""
    with emulator(sc) as emu:
        settings = {**PVE_SETTINGS, "ssh_timeout": 20}
        sc.write(
            hosts=pve_host(emu, settings),
            matrix='host = ["pve"]\nnic = ["virtio"]',
            lab=f"lease_minutes = {LEASE_MINUTES}",
        )
        elsewhere = sc.dir / "elsewhere"  # the other machine: its lab.toml, store and state directory
        elsewhere.mkdir()
        other_toml = elsewhere / "lab.toml"
        other_toml.write_text(sc.toml.read_text().replace(str(sc.results), str(elsewhere / "results")))
        other_state = statedir.ensure(elsewhere / "state")
        other = Store(elsewhere / "results")
        other.create_run(
            LEASE_RUN_ID, "elsewhere", config_path="", config_text="", seed=1, lab_version="0", manifest={}
        )
        other.finish_run(LEASE_RUN_ID, "done")
        other.close()
        p = sc.start("--run-id", LEASE_RUN_ID)
        try:
            vms = wait_for("the run's VM", lambda: [v for v in emu.vm_ids() if emu.vms[v].config.get("description")], p)
            first = expiry(emu, vms[0])
            t0 = time.monotonic()
            wait_for("its first lease to run out", lambda: time.monotonic() - t0 > LEASE_MINUTES * 60 + 2, p)
            gc = subprocess.run(
                [*LAB, "gc", "-c", str(other_toml)],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, **sc.env, statedir.STATE_ENV: str(other_state)},
                cwd=elsewhere,
            )
            row.injected = True
            kept = vms[0] in emu.vm_ids()
            renewed = expiry(emu, vms[0]) if kept else 0
        finally:
            row.exit_status = finish(p)
        row.clear, line = one_line_exit(row.exit_status, sc.stderr(), sc.results)
        if gc.returncode != 0 or "Traceback" in gc.stderr:
            row.clear = False
            row.notes.append(f"the other machine's lab gc: exit {gc.returncode}: {gc.stderr.strip().splitlines()[-1:]}")
        if not kept or "keep   pve vm lab-chaoslease-c01 (lease not expired" not in gc.stdout:
            row.clear = False
            row.notes.append(f"the other machine's gc took the live run's VM: {gc.stdout.strip()!r}")
        if not renewed > first:
            row.clear = False
            row.notes.append(f"the lease was not renewed ({first} then {renewed})")
        row.message = f"kept by another machine's gc, lease renewed by {renewed - first:.0f} s; run: {line}"
        gc_and_count(sc, row, set(), {LEASE_RUN_ID})


def expiry(emu, vmid: int) -> int:
    """The lab-expires line of a VM's description on the emulator (0 if none)."""
    text = str(emu.vms[vmid].config.get("description") or "")
    found = [line.split(":", 1)[1] for line in text.splitlines() if line.startswith("lab-expires:")]
    return int(found[0]) if found else 0


# -- what the lab did not make (issue 16) -------------------------------------------------------------


def foreign_resources(sc: Scenario, row: Row) -> None:
    """Things named like the lab's, without its marker, planted before a run of a local and a PVE
    cell (tests/support/chaos_plant.py; run_faults.foreign_resources on the emulator): after the run, after
    `lab gc` and after `lab gc --force`, none was touched, and the run left nothing of its own."""
    daemons = libvirt_daemons.ensure_running()
    planted = sc.planted = chaos_plant.Planted()
    sc.libvirt_dir = sc.workdir / "libvirt"
    sc.libvirt_dir.mkdir()
    try:
        parent = local_host.cgroup_parent()
        chaos_plant.plant_local(planted, sc.workdir, parent[0] if parent else None, "zz")
        statedir.ensure(sc.state)
        chaos_plant.plant_locks(planted, sc.state, sc.results, "zz")
        chaos_plant.plant_domains(planted, "zz", sc.dir)
        with emulator(sc) as emu:
            inj = sc.injection = run_faults.foreign_resources(emu, images.load("debian12"))
            sc.write(
                hosts=pve_host(emu, inj.merged_settings())
                + f'[hosts.kvm]\nbackend = "libvirt"\nuri = "{URI}"\ndir = "{sc.libvirt_dir}"\n',
                # the local cell a restore (no boot in the serial pass), the PVE one as PVE starts it
                matrix='host = ["local", "pve"]\nnic = ["virtio"]\nstart = ["cold", "warm"]\n'
                'exclude = [{ host = "local", start = "cold" }, { host = "pve", start = "warm" }]\n',
                warm=True,
            )
            res = sc.lab("run", timeout=900)
            row.injected = True
            row.exit_status = res.returncode
            (sc.dir / "run.stderr").write_text(res.stderr)
            row.clear, line = one_line_exit(res.returncode, res.stderr, sc.results)  # the PVE cell fails at ready
            seen = {"run": planted.touched() + inj.touched()}
            for argv in (["gc"], ["gc", "--force"]):
                gc = sc.lab(*argv, timeout=600)
                if gc.returncode != 0 or "Traceback" in gc.stderr:
                    row.clear = False
                    row.notes.append(
                        f"lab {' '.join(argv)}: exit {gc.returncode}: {gc.stderr.strip().splitlines()[-1:]}"
                    )
                seen[" ".join(["lab", *argv])] = planted.touched() + inj.touched()
            row.touched = sorted({t for ts in seen.values() for t in ts})
            row.message = ", ".join(f"{len(ts)} touched after {when}" for when, ts in seen.items()) + f"; run: {line}"
            row.leaked = sc.leftovers({run_id_of(sc.results) or "-"})
            row.integrity = integrity(sc.results)
    finally:
        planted.remove()
        libvirt_daemons.stop(daemons)
