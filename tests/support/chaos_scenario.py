"""The chaos suite's scenario (tests/support/chaos.py): a fault's own workdir, results store and lab.toml,
the `lab` CLI run in it, what it left behind, and the verdicts on a run's outcome."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from pve_emulator import run_faults

from lab import proc, statedir
from lab.backends import local
from lab.wait import wait_until
from support import chaos_plant, libvirt_daemons
from support.libvirt_daemons import VIRSH_TIMEOUT
from support.local import local_table

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
    touched: list[str] = field(default_factory=list)  # what was not the lab's and changed or went

    @property
    def ok(self) -> bool:
        return (
            self.injected
            and self.clear
            and not self.leaked
            and not self.touched
            and not self.lost
            and self.integrity == "ok"
        )


@dataclass
class Config:
    name: str
    faults: list[str]
    reps: int = 3
    seconds: int = 2


# short (in `make test`): one boot per VM fault, a 1 s workload, the quicker PVE faults and the


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
    ok = peek(
        results, "SELECT COUNT(*) FROM executions WHERE run_id = ? AND cell_id = ? AND outcome = 'ok'", (rid, cell)
    )
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
        self.state = root / "state"  # the suite's own state directory (run locks, the KVM verdict)
        self.env: dict[str, str] = {statedir.STATE_ENV: str(self.state)}
        self.bridges: list[str] = []
        self.emulator = None
        self.injection = None  # the run_faults Injection of a PVE fault
        self.planted: chaos_plant.Planted | None = None
        self.libvirt_dir: Path | None = None

    def write(
        self,
        *,
        hosts: str = "",
        matrix: str = 'nic = ["virtio"]',
        reps: int | None = None,
        lab: str = "",
        warm: bool = False,
    ) -> None:
        """The scenario's lab.toml. `warm`: its local cells are restores of the tests' shared
        snapshot of the 2-vCPU shape most tests use (a fault after the boot needs no boot of its own);
        a `matrix` that names `start` itself says which cells (another host's cells boot)."""
        shape = "vcpus = [1]\nmemory_mib = [768]\n"
        if warm:
            shape = "vcpus = [2]\nmemory_mib = [1024]\n" + ("" if "start =" in matrix else 'start = ["warm"]\n')
        self.toml.write_text(
            textwrap.dedent(f"""
            [lab]
            name = "chaos-{self.name}"
            results = "{self.results}"
            {lab}

            """)
            + local_table(self.workdir)
            + textwrap.dedent(hosts)
            + "\n[matrix]\n"
            + shape
            + matrix
            + "\n[suite]"
            + SUITE.format(reps=reps or self.cfg.reps, seconds=self.cfg.seconds)
        )

    def lab(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*LAB, *args, "-c", str(self.toml)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env},
            cwd=self.dir,
        )

    def start(self, *args: str) -> subprocess.Popen:
        self.stderr_path = self.dir / "run.stderr"
        with open(self.stderr_path, "w") as err:  # the child has its own copy
            return subprocess.Popen(
                [*LAB, "run", "-c", str(self.toml), *args],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env={**os.environ, **self.env},
                cwd=self.dir,
            )

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
            out += [
                f"tap {line.split(':')[1].strip().split('@')[0]} on {br}" for line in ports.splitlines() if ":" in line
            ]
        if self.libvirt_dir is not None:
            listed = proc.run(["virsh", "-c", URI, "list", "--all", "--name"], check=False, timeout=VIRSH_TIMEOUT)
            names = listed.stdout.split()
            out += [f"libvirt domain {n}" for n in names if any(n.startswith(f"lab-{r}-") for r in run_ids)]
            if self.libvirt_dir.is_dir():
                out += [f"libvirt file {p.name}" for p in self.libvirt_dir.iterdir()]
        if self.emulator is not None:
            out += run_faults.leftovers(self.emulator, self.injection)
        # run locks: beside the store, in the local workdir, and those of remote backends
        out += [f"lock {p}" for p in sorted(self.results.glob("run-*.lock"))]
        out += [f"lock {p}" for p in sorted(self.workdir.glob("*.lock"))]
        out += [f"lock {p}" for r in sorted(run_ids) for p in sorted(self.state.glob(f"*@{r}.lock"))]
        if self.planted is not None:  # what was planted is not the run's: it is counted as touched or not
            names = self.planted.names()
            out = [o for o in out if not any(n in o for n in names)]
        return out

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


# -- the verdicts ---------------------------------------------------------------------------------


def one_line_exit(res_rc: int | None, stderr: str, results: Path) -> tuple[bool, str]:
    """A run that ended by itself: exit status 1, no traceback, and either one `lab: error:` line
    last, or `N of M cells failed` last with each failed cell's stored error a single line."""
    lines = stderr.strip().splitlines()
    if res_rc != 1:
        return False, (lines[-1] if lines else f"exit {res_rc}, no output")[:200]
    return one_line(stderr, results)


def one_line(stderr: str, results: Path) -> tuple[bool, str]:
    """one_line_exit whatever the exit status (the PVE faults say which one they expect)."""
    lines = stderr.strip().splitlines()
    if "Traceback" in stderr or not lines:
        return False, (lines[-1] if lines else "no output")[:200]
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


def wait_for(what: str, pred, p: subprocess.Popen | None, timeout: float = 600, detail=None):
    def check():
        if p is not None and p.poll() is not None:
            raise RuntimeError(f"`lab run` ended (exit {p.returncode}) before {what}")
        return pred()

    return wait_until(check, timeout=timeout, what=what, interval=0.2, detail=detail)


def finish(p: subprocess.Popen, timeout: float = 600) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return -9


def qemu_pid(sc: Scenario, vm: str) -> int | None:
    return next((pid for pid, name in local.qemu_processes(sc.workdir) if name == vm), None)
