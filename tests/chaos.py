"""The fault-injection suite: real faults injected into real `lab run`s, then `lab gc`, then a count.

    python tests/chaos.py --config short   # in `make test` (tests/test_chaos.py): a few minutes
    python tests/chaos.py --config long    # `make chaos`

Faults (each injected for real into a `lab run` subprocess while the store says it has reached
the moment; the local backend boots the golden image under QEMU):
  kill-orchestrator-boot      SIGKILL of `lab run` while its QEMU boots (the QEMU is orphaned)
  kill-orchestrator-workload  SIGKILL of `lab run` after a repetition was stored, mid-workload
  guest-killed                the guest's QEMU process killed (SIGKILL) mid-workload
  ssh-cut (long)              the guest's tap set down inside the run's own namespace mid-workload
  sshd-killed (long)          every sshd in the guest killed mid-workload
  results-disk-full           results directory on a small tmpfs, filled up mid-workload
  pve-task-fails              the PVE emulator fails the clone's qmstart task
  pve-template-locked         the emulator holds a `backup` lock on the template past the clone timeout
  pve-lock-on-teardown        the clone is locked while the lab tears it down (teardown fails)
  libvirt-refuses-start       a libvirt (qemu:///system) domain whose firmware QEMU cannot load
  kill-then-resume (long)     SIGKILL mid-workload, gc, `lab run --resume`: the run completes
After each: `lab gc` (the CLI), then the count: the exit status and message of the run (one line,
no traceback; a run killed with -9 must read "failed" with its one-line reason after gc),
leftovers (QEMU processes of the scenario's workdir, its namespaces, taps in them or on its
bridge, VM directories and disks, libvirt domains and disk files, the emulator's VMs, run lock
files), and samples lost: every sample in the store at the moment of the fault must be there
afterwards, and the store must pass `PRAGMA integrity_check`.

Prints a table and totals; exits 1 on any leak, lost sample, fault not injected or unclear error.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the PVE emulator lives beside this file
    sys.path.insert(0, str(HERE))

import libvirt_daemons  # noqa: E402
from lab import IMAGES_DIR, proc  # noqa: E402
from lab.backends import local  # noqa: E402
from lab.runlock import RUN_LOCK_DIR  # noqa: E402
from lab.wait import wait_until  # noqa: E402

LAB = [sys.executable, "-m", "lab"]
URI = libvirt_daemons.URI
SUITE = """
workloads = ["sysbench-cpu"]
repetitions = {reps}
warmup = 0
order = "sequential"
[suite.params.sysbench-cpu]
time = {seconds}
threads = [1]
"""


@dataclass
class Row:
    fault: str
    injected: bool = False
    exit_status: int | None = None
    clear: bool = False
    message: str = ""
    leaked: list[str] = field(default_factory=list)
    lost: int = 0
    integrity: str = "ok"
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.injected and self.clear and not self.leaked and not self.lost and self.integrity == "ok"


@dataclass
class Config:
    name: str
    faults: list[str]
    reps: int = 3
    seconds: int = 2


# short (in `make test`): one boot per VM fault, a 1 s workload; long adds the slower SSH faults,
# a kill followed by a resume, and the template lock
SHORT = ["kill-orchestrator-boot", "kill-orchestrator-workload", "guest-killed", "results-disk-full",
         "pve-task-fails", "pve-lock-on-teardown", "libvirt-refuses-start"]
CONFIGS = {
    "short": Config("short", SHORT, reps=3, seconds=1),
    "long": Config("long", SHORT[:4] + ["ssh-cut", "sshd-killed", "kill-then-resume"] + SHORT[4:5]
                   + ["pve-template-locked"] + SHORT[5:], reps=4, seconds=3),
}


# -- the store, read from outside (read-only: the run under test owns it) --------------------------

def peek(results: Path, sql: str, args: tuple = ()) -> list[tuple]:
    db_path = results / "lab.db"
    if not db_path.exists():
        return []
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return []
    try:
        return db.execute(sql, args).fetchall()
    except sqlite3.Error:  # the schema is not there yet
        return []
    finally:
        db.close()


def samples(results: Path) -> set[tuple]:
    return set(peek(results, "SELECT run_id, cell_id, workload, metric, repetition, value FROM samples"))


def integrity(results: Path) -> str:
    db_path = results / "lab.db"
    if not db_path.exists():
        return "no store"
    db = sqlite3.connect(db_path)
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0]
    except sqlite3.Error as exc:
        return f"unreadable: {exc}"
    finally:
        db.close()


def run_id_of(results: Path) -> str | None:
    rows = peek(results, "SELECT id FROM runs ORDER BY started_at DESC LIMIT 1")
    return rows[0][0] if rows else None


def cell_state(results: Path, cell: str) -> tuple[str, str, int]:
    """(status, stage, executions finished ok) of a cell of the newest run."""
    rid = run_id_of(results)
    if rid is None:
        return "", "", 0
    row = peek(results, "SELECT status, COALESCE(stage, '') FROM cells WHERE run_id = ? AND cell_id = ?", (rid, cell))
    ok = peek(results, "SELECT COUNT(*) FROM executions WHERE run_id = ? AND cell_id = ? AND outcome = 'ok'",
              (rid, cell))
    return (row[0][0], row[0][1], ok[0][0]) if row else ("", "", 0)


# -- a scenario's own place: workdir, results, lab.toml --------------------------------------------

class Scenario:
    def __init__(self, root: Path, name: str, cfg: Config):
        self.name, self.cfg = name, cfg
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.workdir = Path(tempfile.mkdtemp(prefix="lc", dir="/var/tmp"))  # short: unix socket paths
        self.results = self.dir / "results"
        self.toml = self.dir / "lab.toml"
        self.env: dict[str, str] = {}
        self.bridges: list[str] = []
        self.emulator = None
        self.libvirt_dir: Path | None = None

    def write(self, *, hosts: str = "", matrix: str = 'nic = ["virtio"]', reps: int | None = None) -> None:
        self.toml.write_text(textwrap.dedent(f"""
            [lab]
            name = "chaos-{self.name}"
            results = "{self.results}"

            [hosts.local]
            backend = "local"
            workdir = "{self.workdir}"
            boot_timeout = 300
            """) + textwrap.dedent(hosts) + textwrap.dedent(f"""
            [matrix]
            vcpus = [1]
            memory_mib = [768]
            """) + matrix + "\n[suite]" + SUITE.format(reps=reps or self.cfg.reps, seconds=self.cfg.seconds))

    def lab(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([*LAB, *args, "-c", str(self.toml)], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env}, cwd=self.dir)

    def start(self, *args: str) -> subprocess.Popen:
        self.stderr_path = self.dir / "run.stderr"
        return subprocess.Popen([*LAB, "run", "-c", str(self.toml), *args], stdout=subprocess.DEVNULL,
                                stderr=open(self.stderr_path, "w"), env={**os.environ, **self.env}, cwd=self.dir)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    # -- what is left -----------------------------------------------------------------------------
    def leftovers(self, run_ids: set[str]) -> list[str]:
        out = [f"qemu pid {pid} {name}" for pid, name in local.qemu_processes(self.workdir)]
        for ns in local.list_netns():
            if any(ns.startswith(f"lab-{r}") for r in run_ids):
                out.append(f"netns {ns}")
                taps = proc.run(["ip", "-n", ns, "-o", "link", "show", "type", "tun"], check=False).stdout
                out += [f"tap {line.split(':')[1].strip()} in {ns}" for line in taps.splitlines() if ":" in line]
        if self.workdir.is_dir():
            out += [f"vm dir {d.name}" for d in self.workdir.glob("lab-*") if d.is_dir()]
            out += [f"disk {p.relative_to(self.workdir)}" for p in self.workdir.rglob("*.qcow2")]
        for br in self.bridges:
            ports = proc.run(["ip", "-o", "link", "show", "master", br], check=False).stdout
            out += [f"tap {line.split(':')[1].strip().split('@')[0]} on {br}" for line in ports.splitlines()
                    if ":" in line]
        if self.libvirt_dir is not None:
            names = proc.run(["virsh", "-c", URI, "list", "--all", "--name"], check=False, timeout=30).stdout.split()
            out += [f"libvirt domain {n}" for n in names if any(n.startswith(f"lab-{r}-") for r in run_ids)]
            if self.libvirt_dir.is_dir():
                out += [f"libvirt file {p.name}" for p in self.libvirt_dir.iterdir()]
        if self.emulator is not None:
            out += [f"PVE VM {vmid}" for vmid in self.emulator.vm_ids()]
        # run locks: beside the store, in the local workdir, and those of remote backends
        out += [f"lock {p}" for p in sorted(self.results.glob("run-*.lock"))]
        out += [f"lock {p}" for p in sorted(self.workdir.glob("*.lock"))]
        out += [f"lock {p}" for r in sorted(run_ids) for p in sorted(RUN_LOCK_DIR.glob(f"*@{r}.lock"))]
        return out

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


# -- the verdicts ---------------------------------------------------------------------------------

def one_line_exit(res_rc: int | None, stderr: str, results: Path) -> tuple[bool, str]:
    """A run that ended by itself: exit status 1, no traceback, and either one `lab: error:` line
    last, or `N of M cells failed` last with each failed cell's stored error a single line."""
    lines = stderr.strip().splitlines()
    if res_rc != 1 or "Traceback" in stderr or not lines:
        return False, (lines[-1] if lines else f"exit {res_rc}, no output")[:200]
    last = lines[-1]
    if last.startswith("lab: error: "):
        return True, last.removeprefix("lab: error: ")
    if re.fullmatch(r"\d+ of \d+ cells failed; see `lab show \w+`", last):
        rid = run_id_of(results)
        errors = [e for (e,) in peek(results, "SELECT error FROM cells WHERE run_id = ? AND status = 'failed'", (rid,))]
        good = bool(errors) and all(e and "\n" not in e and "Traceback" not in e for e in errors)
        return good, "; ".join(e or "(no error)" for e in errors)
    return False, last


def killed_run_reads_failed(results: Path, run_id: str) -> tuple[bool, str]:
    """After `lab gc`: a run killed with -9 is failed, with a one-line reason."""
    row = peek(results, "SELECT status, COALESCE(error, '') FROM runs WHERE id = ?", (run_id,))
    if not row:
        return False, "run not in the store"
    status, error = row[0]
    return status == "failed" and bool(error) and "\n" not in error, f"{status}: {error}"


def gc_and_count(sc: Scenario, row: Row, before: set[tuple], run_ids: set[str]) -> None:
    res = sc.lab("gc", timeout=600)
    if res.returncode != 0:
        row.notes.append(f"lab gc exit {res.returncode}: {res.stderr.strip().splitlines()[-1:]}")
    if "Traceback" in res.stderr:
        row.clear = False
        row.notes.append("lab gc printed a traceback")
    row.leaked = sc.leftovers(run_ids)
    row.integrity = integrity(sc.results)
    row.lost = len(before - samples(sc.results))


def wait_for(what: str, pred, p: subprocess.Popen | None, timeout: float = 600):
    def check():
        if p is not None and p.poll() is not None:
            raise RuntimeError(f"`lab run` ended (exit {p.returncode}) before {what}")
        return pred()
    return wait_until(check, timeout=timeout, what=what, interval=0.2)


def finish(p: subprocess.Popen, timeout: float = 600) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return -9


def qemu_pid(sc: Scenario, vm: str) -> int | None:
    return next((pid for pid, name in local.qemu_processes(sc.workdir) if name == vm), None)


# -- local faults ---------------------------------------------------------------------------------

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
    sc.write()
    if moment == "boot":  # QEMU is up, the guest not yet ready
        before, rid = kill_when(sc, row, "the guest to start booting", lambda: cell_state(sc.results, "c01")[1] == "boot"
                                and qemu_pid(sc, f"lab-{run_id_of(sc.results)}-c01"))
    else:
        before, rid = kill_when(sc, row, "a stored repetition", lambda: cell_state(sc.results, "c01")[2] >= 1)
    gc_and_count(sc, row, before, {rid})
    ok, row.message = killed_run_reads_failed(sc.results, rid)
    row.clear = ok and not any("traceback" in n for n in row.notes)
    if moment == "workload" and not before:
        row.notes.append("no sample stored before the kill")


def mid_workload(sc: Scenario, row: Row, inject, *, reps: int | None = None) -> None:
    """Start a run, wait for a stored repetition of c01, inject, let the run end by itself."""
    sc.write(reps=reps)
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


def disk_full(sc: Scenario, row: Row) -> None:
    sc.results.mkdir()
    proc.run(["mount", "-t", "tmpfs", "-o", "size=8m", "chaos", str(sc.results)])
    try:
        def inject(rid):
            with open(sc.results / "filler", "wb") as fh:  # until ENOSPC
                try:
                    while True:
                        fh.write(b"\0" * 65536)
                        fh.flush()
                except OSError:
                    pass
        mid_workload(sc, row, inject, reps=sc.cfg.reps + 3)
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
    row.message = f"resumed: exit {res.returncode}, run {status[0][0] if status else '?'}, finished cell c01 kept: {kept}"
    row.leaked = sc.leftovers({rid})
    row.lost = len(done_before - samples(sc.results))
    row.integrity = integrity(sc.results)


# -- the PVE emulator ------------------------------------------------------------------------------

def with_emulator(sc: Scenario, row: Row, inject) -> None:
    from pve_emulator import PveEmulator
    from pve_emulator.certs import make_certs
    from pve_emulator.fixtures import FULL_ACL, TEMPLATE_VMID, TOKEN_ID, TOKEN_SECRET

    certs = make_certs(sc.dir / "tls")
    emu = PveEmulator("8.4", certs, auth_delay=0.05)
    emu.task_seconds.update({"qmclone": 0.15, "qmstart": 0.08, "qmstop": 0.05, "qmdestroy": 0.08, "qmconfig": 0.03})
    emu.add_template(TEMPLATE_VMID, "debian12")
    emu.add_token(TOKEN_ID, TOKEN_SECRET, privsep=True, acl=FULL_ACL)
    sc.emulator = emu
    sc.env["LAB_CHAOS_PVE_TOKEN"] = f"{TOKEN_ID}={TOKEN_SECRET}"
    with emu:
        sc.write(hosts=f"""
            [hosts.pve]
            backend = "proxmox"
            url = "{emu.url}"
            node = "pve1"
            token = "env:LAB_CHAOS_PVE_TOKEN"
            ca_file = "{certs.ca_file}"
            storage = "local-lvm"
            bridge = "vmbr0"
            template = {TEMPLATE_VMID}
            timeouts = {{ clone = 4, start = 5, stop = 3, destroy = 3, ready = 20, agent = 5 }}
            """, matrix='host = ["pve"]\nnic = ["virtio"]')
        watcher = inject(emu)
        res = sc.lab("run", timeout=300)
        if watcher is not None:
            watcher.join(timeout=30)
        row.injected = True
        row.exit_status = res.returncode
        (sc.dir / "run.stderr").write_text(res.stderr)
        row.clear, row.message = one_line_exit(res.returncode, res.stderr, sc.results)
        # a lock held on a VM outlives the run: gc once the lock is gone, as a user would retry
        wait_until(lambda: not any(emu.vms[v].hold_lock for v in emu.vm_ids()), timeout=60,
                   what="the held lock to expire", interval=0.5)
        gc_and_count(sc, row, set(), {run_id_of(sc.results) or "-"})
        sc.emulator = None


def pve_task_fails(sc: Scenario, row: Row) -> None:
    with_emulator(sc, row, lambda emu: emu.fail_next("qmstart", "start failed: QEMU exited with code 1"))


def pve_template_locked(sc: Scenario, row: Row) -> None:
    from pve_emulator.fixtures import TEMPLATE_VMID

    with_emulator(sc, row, lambda emu: emu.hold_lock(TEMPLATE_VMID, "backup", 12))


def pve_lock_on_teardown(sc: Scenario, row: Row) -> None:
    def inject(emu):
        emu.task_seconds["qmstart"] = 1.5
        emu.fail_next("qmstart", "start failed: QEMU exited with code 1")

        def lock_the_clone():  # while its start task runs, a backup job locks the clone for 8 s
            try:
                task = wait_until(lambda: next((t for t in list(emu.tasks.values()) if t.type == "qmstart"), None),
                                  timeout=60, what="the clone's start task", interval=0.01)
                emu.hold_lock(int(task.id), "backup", 8)
            except Exception as exc:
                row.notes.append(f"could not lock the clone: {exc}")
        t = threading.Thread(target=lock_the_clone, daemon=True)
        t.start()
        return t
    with_emulator(sc, row, inject)
    if "teardown" not in row.message:
        row.notes.append("the teardown did not fail: the lock was not in its way")


# -- libvirt ---------------------------------------------------------------------------------------

def libvirt_refuses_start(sc: Scenario, row: Row) -> None:
    t0 = time.monotonic()
    daemons = libvirt_daemons.ensure_running()
    row.notes.append(f"libvirtd ready in {time.monotonic() - t0:.0f} s")
    n = 100 + secrets.randbelow(100)
    bridge = f"labcbr{secrets.token_hex(3)}"
    proc.run(["ip", "link", "add", "name", bridge, "type", "bridge"])
    sc.bridges.append(bridge)
    sc.libvirt_dir = sc.workdir / "libvirt"
    try:
        proc.run(["ip", "addr", "add", f"10.79.{n}.1/24", "dev", bridge])
        proc.run(["ip", "link", "set", bridge, "up"])
        # The fault: firmware QEMU cannot load, so libvirt refuses to start the domain.
        sc.write(hosts=f"""
            [hosts.kvm]
            backend = "libvirt"
            uri = "{URI}"
            dir = "{sc.libvirt_dir}"
            bridge = "{bridge}"
            subnet = "10.79.{n}.0/24"
            client_address = "10.79.{n}.1"
            dac_label = "+0:+0"
            bios = "{sc.dir / 'missing-firmware.rom'}"
            boot_timeout = 60
            """, matrix='host = ["kvm"]\nnic = ["virtio"]')
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
    "pve-task-fails": pve_task_fails,
    "pve-template-locked": pve_template_locked,
    "pve-lock-on-teardown": pve_lock_on_teardown,
    "libvirt-refuses-start": libvirt_refuses_start,
    "kill-then-resume": kill_then_resume,
}


@dataclass
class Totals:
    faults: int
    clear: int
    leaked: int
    lost: int
    corrupt: int

    @property
    def ok(self) -> bool:
        return self.leaked == 0 and self.lost == 0 and self.corrupt == 0


def run_suite(config: str, *, only: list[str] | None = None, out=print) -> tuple[list[Row], Totals]:
    cfg = CONFIGS[config]
    root = Path(tempfile.mkdtemp(prefix="lab-chaos-", dir="/var/tmp"))
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
    totals = Totals(faults=sum(r.injected for r in rows), clear=sum(r.clear for r in rows),
                    leaked=sum(len(r.leaked) for r in rows), lost=sum(r.lost for r in rows),
                    corrupt=sum(r.integrity != "ok" for r in rows))
    return rows, totals


def table(rows: list[Row], totals: Totals) -> str:
    lines = [f"| {'fault':<28} | injected | exit | clear error | leaked | lost | store | s    | message",
             f"|{'-' * 30}|----------|------|-------------|--------|------|-------|------|--------"]
    for r in rows:
        lines.append(f"| {r.fault:<28} | {'yes' if r.injected else 'NO':<8} | {str(r.exit_status):>4} | "
                     f"{'yes' if r.clear else 'NO':<11} | {len(r.leaked):>6} | {r.lost:>4} | {r.integrity[:5]:<5} | "
                     f"{r.seconds:>4.0f} | {r.message[:110]}")
    lines.append("")
    lines.append(f"faults injected: {totals.faults}/{len(rows)}   runs ended with a clear one-line error: "
                 f"{totals.clear}/{len(rows)}   leaked after lab gc: {totals.leaked}   samples lost: {totals.lost}   "
                 f"stores failing integrity_check: {totals.corrupt}")
    for r in rows:
        for item in r.leaked:
            lines.append(f"LEAK {r.fault}: {item}")
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
