"""The fault-injection suite: real faults injected into real `lab run`s, then `lab gc`, then a count.

    python tests/support/chaos.py --config short   # in `make test` (tests/test_chaos.py): a few minutes
    python tests/support/chaos.py --config long    # `make chaos`

Faults (each injected for real into a `lab run` subprocess while the store says it has reached
the moment; the local backend boots the golden image under QEMU, or, for a fault after the boot,
restores the tests' shared warm snapshot of it):
  kill-orchestrator-boot      SIGKILL of `lab run` while its QEMU boots (the QEMU is orphaned)
  kill-orchestrator-workload  SIGKILL of `lab run` after a repetition was stored, mid-workload
  guest-killed (long)         the guest's QEMU process killed (SIGKILL) mid-workload
  ssh-cut (long)              the guest's tap set down inside the run's own namespace mid-workload
  sshd-killed (long)          every sshd in the guest killed mid-workload
  results-disk-full           results directory on a small tmpfs, filled up mid-workload
  report-disk-full            (issue 35) `lab report` of a stored run onto a results tmpfs that fills up while
                              the report is written: one line naming the file, exit 1, no partial file
  pve-task-fails              the PVE emulator fails the clone's qmstart task
  pve-template-locked         the emulator holds a `backup` lock on the template past the clone timeout
  pve-lock-on-teardown        the clone is locked while the lab tears it down (teardown fails)
  pve-*                       the faults of tests/pve_emulator/run_faults.py (issue 23): a backup during
                              teardown (and past its deadline), a slow stop task, a node offline mid-run,
                              dropped and hanging connections, the cfs lock under concurrent clones,
                              foreign VMs and templates, tokens without SDN.Use or VM.Clone
  libvirt-refuses-start       a libvirt (qemu:///system) domain whose firmware QEMU cannot load
  foreign-resources           (issue 16) planted before a run on local and pve hosts: machine directories,
                              leases without the lab's marker (naming a live cgroup and namespace), lock
                              files holding no pid, libvirt domains without the lab's metadata, foreign PVE
                              VMs and templates (tests/support/chaos_plant.py); none may be touched by the run,
                              `lab gc` or `lab gc --force`
  kill-then-resume (long)     SIGKILL mid-workload, gc, `lab run --resume`: the run completes
  pve-lease-outlives-run      (issue 35) a run on the PVE emulator longer than its lease (lease_minutes = 0.1): once
                              its first lease ran out, `lab gc` of another machine and another store that has a run
                              of the same id keeps its VM (renewed lease, another owner); nothing is left after
  host-disappears             (issue 17) a run on two lanes, local and the PVE emulator: the PVE host stops
                              answering once its clone starts; its lane ends with the reason, the local
                              lane measures its cell to the end, `lab gc` removes the clone once the host is back
After each: `lab gc` (the CLI), then the count: the exit status and message of the run (one line,
no traceback; a run killed with -9 must read "failed" with its one-line reason after gc),
leftovers (QEMU processes of the scenario's workdir, its namespaces, taps in them or on its
bridge, VM directories and disks, libvirt domains and disk files, the emulator's VMs, disks and
running tasks, run lock files), what was touched that was not the lab's, and samples lost: every
sample in the store at the moment of the fault must be there afterwards, and the store must pass
`PRAGMA integrity_check`. The suite keeps its state (run locks, the KVM verdict) in a directory of
its own ($LAB_STATE_DIR).

Prints a table and totals; exits 1 on any leak, anything foreign touched, lost sample, fault not
injected or unclear error.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # tests/: the PVE emulator and this package, run as a script
    sys.path.insert(0, str(HERE.parent))

from lab import IMAGES_DIR, proc, statedir  # noqa: E402
from lab.backends.local import kvm  # noqa: E402
from lab.model import Sample  # noqa: E402
from lab.store import Store  # noqa: E402
from support import libvirt_daemons, subnets  # noqa: E402
from support.chaos_pve import (  # noqa: E402
    foreign_resources,
    host_disappears,
    lease_outlives_run,
    pve_fault,
    pve_lock_on_teardown,
    pve_task_fails,
    pve_template_locked,
)
from support.chaos_scenario import (  # noqa: E402
    URI,
    Config,
    Row,
    Scenario,
    cell_state,
    finish,
    gc_and_count,  # noqa: E402,F401
    integrity,
    killed_run_reads_failed,
    one_line_exit,
    peek,
    qemu_pid,
    run_id_of,
    samples,
    wait_for,
)

# short (in `make test`): one boot per VM fault, a 1 s workload, the quicker PVE faults and the
# foreign resources; long adds the slower SSH faults, a kill followed by a resume, the template lock
# and every other PVE fault of run_faults
PVE_SHORT = ["pve-node-offline", "pve-token-without-vm-clone"]
# the first two wait out the runner's 90 s SSH login to a guest the bookkeeping emulator does not run
# (pve-foreign-resources' planting is in the short foreign-resources row too)
PVE_LONG = [
    "pve-dropped-connections",
    "pve-foreign-resources",
    "pve-backup-during-teardown",
    "pve-backup-past-teardown",
    "pve-slow-stop",
    "pve-hanging-connections",
    "pve-cfs-lock",
    "pve-token-without-sdn-use",
]
VM_FAULTS = ["kill-orchestrator-boot", "kill-orchestrator-workload", "guest-killed", "results-disk-full"]
# no VM: a stored run's report, written onto a disk that is full before it ends (a second or two)
STORE_FAULTS = ["report-disk-full"]
# guest-killed is long only: make test's tests/vm/test_compare_real.py kills a guest mid-measurement in
# a real interleaved run and checks the same (that cell failed, the others went on, its samples
# kept, nothing left), so the short suite does not pay a boot for it again
SHORT = [
    *(f for f in VM_FAULTS if f != "guest-killed"),
    *STORE_FAULTS,
    "pve-task-fails",
    "pve-lock-on-teardown",
    *PVE_SHORT,
    "pve-lease-outlives-run",
    "libvirt-refuses-start",
    "foreign-resources",
    "host-disappears",
]
CONFIGS = {
    "short": Config("short", SHORT, reps=3, seconds=1),
    "long": Config(
        "long",
        VM_FAULTS
        + STORE_FAULTS
        + ["ssh-cut", "sshd-killed", "kill-then-resume", "kill-with-client-vm"]
        + ["pve-task-fails", "pve-template-locked", "pve-lock-on-teardown"]
        + PVE_SHORT
        + PVE_LONG
        + ["pve-lease-outlives-run"]
        + SHORT[-3:],
        reps=4,
        seconds=3,
    ),
}


# -- local faults ---------------------------------------------------------------------------------


# The short suite in three parts (make test's tests/vm/test_chaos_vm.py), so that the two workers
# share two of them. The rows on the system's libvirt (its fault, and the planted domains) run in the
# serial pass, alone: they start and stop libvirtd themselves, as the standalone suite does, and
# `lab gc --force` (foreign-resources) removes every lab domain of qemu:///system, another worker's
# live test's too.
PARTS = {
    "libvirt": ["libvirt-refuses-start", "foreign-resources"],
    "pve": [f for f in CONFIGS["short"].faults if f.startswith("pve-")],
}


def part_of(fault: str) -> str:
    return next((name for name, faults in PARTS.items() if fault in faults), "others")


def kill_when(sc: Scenario, row: Row, what: str, pred) -> tuple[set[tuple], str]:
    """Start `lab run`, SIGKILL it (it alone: its QEMUs live on) once `pred()`; the samples stored
    at that moment and the run id."""
    p = sc.start()
    before: set[tuple] = set()
    try:
        wait_for(what, pred, p)
        before = samples(sc.results)
        p.send_signal(signal.SIGKILL)
        row.injected = True
    finally:
        row.exit_status = finish(p)
    return before, run_id_of(sc.results)


def kill_orchestrator(sc: Scenario, row: Row, moment: str) -> None:
    sc.write(warm=moment != "boot")  # the boot's kill needs a boot
    if moment == "boot":  # QEMU is up, the guest not yet ready
        before, rid = kill_when(
            sc,
            row,
            "the guest to start booting",
            lambda: cell_state(sc.results, "c01")[1] == "boot" and qemu_pid(sc, f"lab-{run_id_of(sc.results)}-c01"),
        )
    else:
        before, rid = kill_when(sc, row, "a stored repetition", lambda: cell_state(sc.results, "c01")[2] >= 1)
    gc_and_count(sc, row, before, {rid})
    ok, row.message = killed_run_reads_failed(sc.results, rid)
    row.clear = ok and not any("traceback" in n for n in row.notes)
    if moment == "workload" and not before:
        row.notes.append("no sample stored before the kill")


def kill_with_client_vm(sc: Scenario, row: Row) -> None:
    """client = "vm" (lab.runner.clientvm): SIGKILL once c01 stored a repetition, the client VM up
    beside it; `lab gc` removes both VMs (the client VM by its lease and marker, as a cell's)."""
    sc.write(hosts='client = "vm"\nclient_vcpus = 1\nclient_memory_mib = 512\n')
    before, rid = kill_when(
        sc,
        row,
        "a stored repetition beside the client VM",
        lambda: cell_state(sc.results, "c01")[2] >= 1 and qemu_pid(sc, f"lab-{run_id_of(sc.results)}-client1"),
    )
    if not qemu_pid(sc, f"lab-{rid}-client1"):
        row.notes.append("the client VM was not up at the kill")
    gc_and_count(sc, row, before, {rid})
    ok, row.message = killed_run_reads_failed(sc.results, rid)
    row.clear = ok and not any("traceback" in n for n in row.notes)


def mid_workload(sc: Scenario, row: Row, inject, *, reps: int | None = None) -> None:
    """Start a run, wait for a stored repetition of c01, inject, let the run end by itself."""
    sc.write(reps=reps, warm=True)
    p = sc.start()
    before: set[tuple] = set()
    try:
        wait_for("a stored repetition", lambda: cell_state(sc.results, "c01")[2] >= 1, p)
        before = samples(sc.results)
        inject(run_id_of(sc.results))
        row.injected = True
    finally:
        row.exit_status = finish(p)
    row.clear, row.message = one_line_exit(row.exit_status, sc.stderr(), sc.results)
    gc_and_count(sc, row, before, {run_id_of(sc.results) or "-"})


def guest_killed(sc: Scenario, row: Row) -> None:
    def inject(rid):
        pid = qemu_pid(sc, f"lab-{rid}-c01")
        os.kill(pid, signal.SIGKILL)

    mid_workload(sc, row, inject, reps=sc.cfg.reps + 3)


def ssh_cut(sc: Scenario, row: Row) -> None:
    def inject(rid):  # only the run's own namespace: the guest's tap goes down, packets are dropped
        lease = (sc.workdir / f"lab-{rid}-c01" / "lease.json").read_text()
        tap = re.search(r'"tap": "(\w+)"', lease).group(1)
        proc.run(["ip", "-n", f"lab-{rid}", "link", "set", tap, "down"])

    mid_workload(sc, row, inject, reps=sc.cfg.reps + 3)


def sshd_killed(sc: Scenario, row: Row) -> None:
    from lab.guest import Guest

    def inject(rid):
        address = re.search(r'"ip": "([\d.]+)"', (sc.workdir / f"lab-{rid}-c01" / "lease.json").read_text())
        guest = Guest(address.group(1) if address else "10.77.0.10", key=IMAGES_DIR / "lab_key", netns=f"lab-{rid}")
        try:
            guest.connect(timeout=30)
            guest.run("pkill -KILL -x sshd || true", timeout=15, check=False)
        except Exception as exc:  # its own session dies with sshd: that is the fault working
            row.notes.append(f"sshd kill: {str(exc)[:80]}")
        finally:
            guest.close()

    mid_workload(sc, row, inject, reps=sc.cfg.reps + 3)


def fill(filler: Path) -> Path:
    """Write `filler` until its disk is full (ENOSPC)."""
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    return filler


def disk_full(sc: Scenario, row: Row) -> None:
    sc.results.mkdir()
    proc.run(["mount", "-t", "tmpfs", "-o", "size=8m", "chaos", str(sc.results)])
    try:
        mid_workload(sc, row, lambda rid: fill(sc.results / "filler"), reps=sc.cfg.reps + 3)
        if "disk is full" not in row.message:
            row.clear = False
            row.notes.append("the error does not say the disk is full")
        (sc.results / "filler").unlink()  # the user frees space: the store must be whole
        res = sc.lab("gc", timeout=300)
        row.integrity = integrity(sc.results)
        st = killed_run_reads_failed(sc.results, run_id_of(sc.results) or "-")
        row.notes.append(f"after freeing space, gc exit {res.returncode}; run reads {st[1][:60]!r}")
    finally:
        subprocess.run(["umount", "-l", str(sc.results)], check=False)


def report_disk_full(sc: Scenario, row: Row) -> None:
    """A stored run whose report is larger than what is left on the results disk (its lab.toml text
    is in the report: 1 MiB of it), 256 KiB left: the report's file fails midway with ENOSPC. The
    line must name the file, no partial file may stay, the store must be whole, and once space is
    freed the same command writes the report."""
    sc.results.mkdir()
    proc.run(["mount", "-t", "tmpfs", "-o", "size=8m", "chaos", str(sc.results)])
    try:
        store = Store(sc.results)
        store.create_run(
            "full", "chaos", config_path="", config_text="# " + "x" * (1 << 20) + "\n", seed=1, lab_version="0",
            manifest={},
        )  # fmt: skip
        store.add_cell("full", "c01", 1, "local/debian12/virtio", {"nic": "virtio"})
        store.add_samples("full", "c01", None, "sysbench-cpu", 1, [Sample("events_per_s", 1234.5, "1/s", True)])
        store.finish_run("full", "done")
        store.close()
        before = samples(sc.results)
        sc.write()
        filler = fill(sc.results / "filler")
        os.truncate(filler, max(0, filler.stat().st_size - 256 * 1024))  # 256 KiB back: less than the report
        row.injected = True
        res = sc.lab("report", "full")
        row.exit_status = res.returncode
        target = sc.results / "report-full.html"
        lines = res.stderr.strip().splitlines()
        expected = f"lab: error: {target}: cannot be written: No space left on device; nothing was written there"
        row.clear = res.returncode == 1 and lines == [expected] and "Traceback" not in res.stderr
        row.message = lines[-1].removeprefix("lab: error: ") if lines else f"exit {res.returncode}, no output"
        store_files = ("lab.db", "lab.db-wal", "lab.db-shm", "filler")  # SQLite's own, and the fault's
        row.leaked = [f"file {p.name}" for p in sc.results.iterdir() if p.name not in store_files]
        row.integrity = integrity(sc.results)
        row.lost = len(before - samples(sc.results))
        filler.unlink()  # the user frees space: the same command now writes the report
        again = sc.lab("report", "full")
        if again.returncode != 0 or not target.is_file():
            row.clear = False
            row.notes.append(f"after freeing space, lab report exit {again.returncode}: {again.stderr.strip()[-120:]}")
    finally:
        subprocess.run(["umount", "-l", str(sc.results)], check=False)


def kill_then_resume(sc: Scenario, row: Row) -> None:
    sc.write(matrix='nic = ["virtio", "e1000"]')
    before, rid = kill_when(sc, row, "c02 to store a repetition", lambda: cell_state(sc.results, "c02")[2] >= 1)
    gc_and_count(sc, row, before, {rid})
    done_before = {s for s in before if s[1] == "c01"}
    res = sc.lab("run", "--resume", rid, timeout=1200)
    row.exit_status = res.returncode
    status = peek(sc.results, "SELECT status FROM runs WHERE id = ?", (rid,))
    cells = peek(sc.results, "SELECT status FROM cells WHERE run_id = ?", (rid,))
    kept = done_before <= samples(sc.results)
    row.clear = res.returncode == 0 and status == [("done",)] and {c for (c,) in cells} == {"done"} and kept
    row.message = (
        f"resumed: exit {res.returncode}, run {status[0][0] if status else '?'}, finished cell c01 kept: {kept}"
    )
    row.leaked = sc.leftovers({rid})
    row.lost = len(done_before - samples(sc.results))
    row.integrity = integrity(sc.results)


# -- libvirt ---------------------------------------------------------------------------------------


def libvirt_refuses_start(sc: Scenario, row: Row) -> None:
    t0 = time.monotonic()
    daemons = libvirt_daemons.ensure_running()
    row.notes.append(f"libvirtd ready in {time.monotonic() - t0:.0f} s")
    n = subnets.free("10.79") or 100
    bridge = f"labcbr{secrets.token_hex(3)}"
    proc.run(["ip", "link", "add", "name", bridge, "type", "bridge"])
    sc.bridges.append(bridge)
    sc.libvirt_dir = sc.workdir / "libvirt"
    try:
        proc.run(["ip", "addr", "add", f"10.79.{n}.1/24", "dev", bridge])
        proc.run(["ip", "link", "set", bridge, "up"])
        # The fault: firmware QEMU cannot load, so libvirt refuses to start the domain.
        sc.write(
            hosts=f"""
            [hosts.kvm]
            backend = "libvirt"
            uri = "{URI}"
            dir = "{sc.libvirt_dir}"
            bridge = "{bridge}"
            subnet = "10.79.{n}.0/24"
            client_address = "10.79.{n}.1"
            dac_label = "+0:+0"
            bios = "{sc.dir / "missing-firmware.rom"}"
            boot_timeout = 60
            """,
            matrix='host = ["kvm"]\nnic = ["virtio"]',
        )
        t0 = time.monotonic()
        res = sc.lab("run", timeout=300)
        row.notes.append(f"lab run took {time.monotonic() - t0:.0f} s")
        row.injected = True
        row.exit_status = res.returncode
        (sc.dir / "run.stderr").write_text(res.stderr)
        row.clear, row.message = one_line_exit(res.returncode, res.stderr, sc.results)
        if "boot" not in row.message:
            row.notes.append("the cell did not fail at boot")
        gc_and_count(sc, row, set(), {run_id_of(sc.results) or "-"})
    finally:
        proc.run(["ip", "link", "del", bridge], check=False)
        libvirt_daemons.stop(daemons)


FAULTS = {
    "kill-orchestrator-boot": lambda sc, row: kill_orchestrator(sc, row, "boot"),
    "kill-orchestrator-workload": lambda sc, row: kill_orchestrator(sc, row, "workload"),
    "guest-killed": guest_killed,
    "ssh-cut": ssh_cut,
    "sshd-killed": sshd_killed,
    "results-disk-full": disk_full,
    "report-disk-full": report_disk_full,
    "pve-task-fails": pve_task_fails,
    "pve-template-locked": pve_template_locked,
    "pve-lock-on-teardown": pve_lock_on_teardown,
    "libvirt-refuses-start": libvirt_refuses_start,
    "kill-then-resume": kill_then_resume,
    "kill-with-client-vm": kill_with_client_vm,
    "foreign-resources": foreign_resources,
    "host-disappears": host_disappears,
    "pve-lease-outlives-run": lease_outlives_run,
    **{name: (lambda sc, row, name=name: pve_fault(sc, row, name)) for name in PVE_SHORT + PVE_LONG},
}


@dataclass
class Totals:
    faults: int
    clear: int
    leaked: int
    lost: int
    corrupt: int
    touched: int = 0  # things that were not the lab's, changed or removed

    @property
    def ok(self) -> bool:
        return self.leaked == 0 and self.lost == 0 and self.corrupt == 0 and self.touched == 0


def run_suite(config: str, *, only: list[str] | None = None, out=print) -> tuple[list[Row], Totals]:
    cfg = CONFIGS[config]
    root = Path(tempfile.mkdtemp(prefix="lab-chaos-", dir="/var/tmp"))
    statedir.ensure(root / "state")  # shared by the scenarios: the KVM verdict is probed once
    # ... or not at all when this machine's lab has one: a probe of hung nested KVM spins a core for
    # its whole timeout (15 s), and make test runs the suite in three parts
    known = kvm.cached(kvm.KVM_PROBE_CACHE, kvm.probe_key())
    if known is not None:
        kvm.record(root / "state" / kvm.KVM_PROBE_FILE, kvm.probe_key(), known)
    rows = []
    try:
        for name in cfg.faults:
            if only and name not in only:
                continue
            row = Row(name)
            sc = Scenario(root, name, cfg)
            t0 = time.monotonic()
            try:
                FAULTS[name](sc, row)
            except Exception as exc:  # the harness itself failed: the row says so, the suite goes on
                row.notes.append(f"harness: {type(exc).__name__}: {exc}")
                row.leaked = row.leaked or sc.leftovers({run_id_of(sc.results) or "-"})
            finally:
                row.seconds = time.monotonic() - t0
                if not row.leaked:
                    sc.close()
            rows.append(row)
            out(f"chaos: {row.fault}: {'ok' if row.ok else 'FAILED'} in {row.seconds:.0f} s", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    totals = Totals(
        faults=sum(r.injected for r in rows),
        clear=sum(r.clear for r in rows),
        leaked=sum(len(r.leaked) for r in rows),
        lost=sum(r.lost for r in rows),
        corrupt=sum(r.integrity != "ok" for r in rows),
        touched=sum(len(r.touched) for r in rows),
    )
    return rows, totals


def table(rows: list[Row], totals: Totals) -> str:
    lines = [
        f"| {'fault':<28} | injected | exit | clear error | leaked | touched | lost | store | s    | message",
        f"|{'-' * 30}|----------|------|-------------|--------|---------|------|-------|------|--------",
    ]
    for r in rows:
        lines.append(
            f"| {r.fault:<28} | {'yes' if r.injected else 'NO':<8} | {str(r.exit_status):>4} | "
            f"{'yes' if r.clear else 'NO':<11} | {len(r.leaked):>6} | {len(r.touched):>7} | {r.lost:>4} | "
            f"{r.integrity[:5]:<5} | {r.seconds:>4.0f} | {r.message[:110]}"
        )
    lines.append("")
    lines.append(
        f"faults injected: {totals.faults}/{len(rows)}   runs ended with a clear one-line error: "
        f"{totals.clear}/{len(rows)}   leaked after lab gc: {totals.leaked}   foreign things touched: "
        f"{totals.touched}   samples lost: {totals.lost}   stores failing integrity_check: {totals.corrupt}"
    )
    for r in rows:
        for item in r.leaked:
            lines.append(f"LEAK {r.fault}: {item}")
        for item in r.touched:
            lines.append(f"TOUCHED {r.fault}: {item}")
        for n in r.notes:
            lines.append(f"note {r.fault}: {n}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="long")
    ap.add_argument("--only", action="append", choices=sorted(FAULTS), help="run only this fault (repeatable)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("chaos: needs root (namespaces, tmpfs, libvirt)", file=sys.stderr)
        return 2
    rows, totals = run_suite(args.config, only=args.only)
    print(table(rows, totals))
    all_ok = totals.ok and all(r.ok for r in rows)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
