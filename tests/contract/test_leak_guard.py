"""The test suite's leak guard (the `workdir` fixture and support.local.sweep): whatever runs of a test's
workdir left on the machine is removed at teardown, and the test errors, whether it passed or
failed. Without it a failed kill test (test_warm_start) left its killed runs' namespaces and a QEMU
on the shared CI machine: the workdir it was deleted with was the only sign they were the lab's."""

from __future__ import annotations

import os
import subprocess

import pytest
from support import local as local_support

from lab import proc
from lab.backends import local
from lab.backends.local import host
from lab.backends.local.qemu import QEMU
from lab.wait import wait_until

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]


def plant(workdir, run_id: str) -> subprocess.Popen:
    """What a killed run leaves: its run lock, its namespace, a bare-metal cell's namespace, and a
    QEMU (no machine, paused: it only has to be alive) whose pidfile is under the workdir."""
    (workdir / f"lab-{run_id}.lock").write_text("")
    vmdir = workdir / f"lab-{run_id}-c01"
    vmdir.mkdir()
    for ns in (f"lab-{run_id}", f"lab-{run_id}-bm01"):
        proc.run(["ip", "netns", "add", ns])
    parent = host.cgroup_parent()
    if parent:  # the bare-metal cell's cgroup (empty: what a kill -9 of its processes leaves)
        (parent[0] / f"lab-{run_id}-bm01").mkdir()
    argv = [QEMU, "-name", f"lab-{run_id}-c01", "-machine", "none", "-nodefaults", "-display", "none", "-S"]
    p = subprocess.Popen([*argv, "-pidfile", str(vmdir / "qemu.pid")], stdin=subprocess.DEVNULL)
    wait_until(lambda: local.qemu_processes(workdir), timeout=60, what="the planted QEMU")
    return p


def test_sweep_removes_what_the_runs_of_a_workdir_left_and_nothing_else(tmp_path):
    workdir = tmp_path / "w"
    workdir.mkdir()
    run_id, other = os.urandom(4).hex(), os.urandom(4).hex()
    p = plant(workdir, run_id)
    proc.run(["ip", "netns", "add", f"lab-{other}"])  # another run's (another test's): not this workdir's
    try:
        found = local_support.sweep(workdir)
        parent = host.cgroup_parent()
        cgroups = [f"cgroup {parent[0] / f'lab-{run_id}-bm01'}"] if parent else []
        assert sorted(found) == sorted(
            [f"qemu pid {p.pid} lab-{run_id}-c01", f"netns lab-{run_id}", f"netns lab-{run_id}-bm01", *cgroups]
        )
        assert not parent or not (parent[0] / f"lab-{run_id}-bm01").exists()
        assert p.wait(timeout=30) is not None
        assert not [n for n in local.list_netns() if n.startswith(f"lab-{run_id}")]
        assert f"lab-{other}" in local.list_netns()
        assert local_support.sweep(workdir) == []  # nothing left to find
    finally:
        p.kill()
        p.wait()
        for ns in (f"lab-{run_id}", f"lab-{run_id}-bm01", f"lab-{other}"):
            local.remove_netns(ns)
        parent = host.cgroup_parent()
        if parent:
            host.remove_cgroup(parent[0] / f"lab-{run_id}-bm01")


def test_the_workdir_fixture_fails_a_test_that_leaves_a_namespace():
    gen = local_support.own_workdir()  # the `workdir` fixture's body, driven as pytest drives it
    workdir = next(gen)
    run_id = os.urandom(4).hex()
    p = plant(workdir, run_id)
    try:
        with pytest.raises(pytest.fail.Exception, match=f"netns lab-{run_id}"):
            next(gen)  # the teardown
        assert p.wait(timeout=30) is not None and not workdir.exists()
        assert not [n for n in local.list_netns() if n.startswith(f"lab-{run_id}")]
    finally:
        p.kill()
        p.wait()
        for ns in (f"lab-{run_id}", f"lab-{run_id}-bm01"):
            local.remove_netns(ns)
