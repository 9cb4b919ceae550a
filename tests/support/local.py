"""Labs on the local backend for tests: a lab.toml in a test's directory, a run without the runner,
what a run left on the machine, and the sweep that guards the `workdir` fixture against leaks."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from lab.model import CloneKind, VmSpec

# The tests' local and emulated guests ([hosts.NAME] tcg_threads): their vCPUs on one host thread
# when pytest-xdist runs VM tests on two workers at once (make test's VM pass, 2 cores), where
# MTTCG's threads preempt each other (8 VM tests: 688 s on two workers multi-threaded, 562 s
# single-threaded, 842 s on one worker); QEMU's default alone (the serial pass: a 2-vCPU guest
# single-threaded is ~1.3x slower alone: a boot ~25 s against ~19 s)
TCG_THREADS = "single" if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else "multi"

# The tests' labs share one store of warm snapshots ([hosts.NAME] warm_dir): each machine shape is
# booted and saved once for all of make test's passes (the Makefile makes it) or for one pytest
# session (tests/conftest.py), not once per test. Tests of warm start itself keep their own
# (local_backend below, tests/vm/test_warm_start.py).
WARM_ENV = "LAB_TESTS_WARM_DIR"


def warm_dir_line() -> str:
    d = os.environ.get(WARM_ENV)
    return f'warm_dir = "{d}"\n' if d else ""


def own_workdir():
    """The `workdir` fixture's body. At teardown, passed or failed, whatever runs of the directory
    left on the machine is removed and the test errors: once the directory is gone, `lab gc` can no
    longer tell those QEMUs and namespaces are the lab's (a failed kill test left its runs'
    namespaces and a QEMU on a shared CI machine)."""
    d = Path(tempfile.mkdtemp(prefix="lw", dir="/var/tmp"))
    yield d
    left = sweep(d)
    shutil.rmtree(d, ignore_errors=True)
    if left:
        pytest.fail(f"the test left these on the machine (now removed): {', '.join(left)}", pytrace=False)


def sweep(workdir: Path) -> list[str]:
    """Kill the QEMUs whose files are under `workdir` and remove the network namespaces of the runs
    that used it (lab-<run>, lab-<run>-bm01: the runs named by its machine directories, run locks
    and QEMUs) and their bare-metal cgroups; return what was there."""
    from lab.backends import local
    from lab.backends.local import host, layout

    found, runs = [], set()
    for pid, name in local.qemu_processes(workdir):
        found.append(f"qemu pid {pid} {name}")
        runs.add(layout.run_of(name))
        host.kill_pid(pid, name)
    if workdir.is_dir():
        for p in workdir.glob("lab-*"):
            runs.add(
                layout.run_of_netns(p.name.removesuffix(".lock")) if p.suffix == ".lock" else layout.run_of(p.name)
            )
    for ns in local.list_netns():
        if ns.startswith("lab-") and layout.run_of_netns(ns) in runs - {""}:
            found.append(f"netns {ns}")
            local.remove_netns(ns)
    parent = host.cgroup_parent()  # the bare-metal cells' cgroups (lab-<run>-bm01) of those runs
    for cg in parent[0].glob("lab-*") if parent else ():
        if cg.is_dir() and layout.run_of_netns(cg.name) in runs - {""}:
            found.append(f"cgroup {cg}")
            host.remove_cgroup(cg)
    return found


def local_table(workdir: Path) -> str:
    """The tests' `[hosts.local]` table: its state in `workdir`, its guests as TCG_THREADS says."""
    return (
        f'[hosts.local]\nbackend = "local"\nworkdir = "{workdir}"\nboot_timeout = 300\ntcg_threads = "{TCG_THREADS}"\n'
        + warm_dir_line()
    )


def local_backend(workdir: Path, *, shared_warm: bool = False):
    """A local backend of tests with its state in `workdir`, its guests as TCG_THREADS says; with
    `shared_warm`, its warm snapshots in the tests' shared store (else in `workdir`)."""
    from lab.backends import local

    warm_dir = os.environ.get(WARM_ENV) if shared_warm else None
    return local.LocalBackend(
        "local",
        local.Settings(backend="local", workdir=str(workdir), tcg_threads=TCG_THREADS, warm_dir=warm_dir),
    )


def write_lab(tmp_path: Path, workdir: Path, *, matrix: str = "", suite: str = "", extra: str = "") -> Path:
    """A lab.toml for tests: local backend in `workdir`, results under tmp_path."""
    text = (
        textwrap.dedent(f"""
        [lab]
        name = "test"
        results = "{tmp_path / "results"}"

        """)
        + local_table(workdir)
        + textwrap.dedent(extra)
        + "\n[matrix]\n"
        + textwrap.dedent(matrix)
        + "\n[suite]\n"
        + textwrap.dedent(suite)
    )
    path = tmp_path / "lab.toml"
    path.write_text(text)
    return path


@contextlib.contextmanager
def local_run(workdir: Path, *, shared_warm: bool = False):
    """A run of the local backend without the runner: (backend, run id, client); the VM the test
    made is destroyed (put it in the yielded dict as "vm"), then the run's namespace."""
    backend = local_backend(workdir, shared_warm=shared_warm)
    backend.check()
    run_id = os.urandom(4).hex()
    made: dict = {"backend": backend, "run_id": run_id, "client": backend.open_run(run_id), "vm": None}
    try:
        yield made
    finally:
        if made["vm"] is not None:
            backend.destroy(made["vm"])
        backend.close_run(run_id)


def leftovers(workdir: Path, run_id: str | None = None) -> list[str]:
    """What a run left on this machine: QEMU processes and namespaces of this workdir, files in it."""
    from lab.backends import local

    out = [f"qemu pid {pid} {name}" for pid, name in local.qemu_processes(workdir)]
    for ns in local.list_netns():
        if (run_id and ns == f"lab-{run_id}") or (workdir / f"{ns}.lock").exists():
            out.append(f"netns {ns}")
    if workdir.is_dir():
        out += [f"file {p.name}" for p in workdir.iterdir() if p.name.startswith("lab-")]
    return out


def make_spec(golden, run_id, nic, vcpus=2, memory=1024, clone=CloneKind.LINKED, cell="c01", **kw):
    """A VmSpec of cell `cell` of run `run_id`, expiring in 10 minutes."""
    return VmSpec(
        name=f"lab-{run_id}-{cell}",
        run_id=run_id,
        cell_id=cell,
        image=golden,
        nic=nic,
        vcpus=vcpus,
        memory_mib=memory,
        clone=clone,
        expires_at=time.time() + 600,
        **kw,
    )
