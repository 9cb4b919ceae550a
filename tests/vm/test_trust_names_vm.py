"""Names on a real QEMU process: a sweep for run nightly leaves run nightly-1's QEMU alone."""

from __future__ import annotations

import os
import subprocess

import pytest

from lab import config, gc, runlock
from lab.backends import local
from lab.backends.local import layout


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a QEMU process of a workdir, as root runs them")
def test_a_sweep_for_run_nightly_leaves_run_nightly_1s_qemu_alone(tmp_path):
    """The issue's example, for real: a run `nightly-1` (made by a lab that allowed "-") is live, its
    QEMU running; another run's sweep of the workdir (gc.collect, as `lab run` starts) must not take
    it for the dead run `nightly`'s and kill it."""
    workdir = tmp_path / "w"
    workdir.mkdir(mode=0o700)
    vmdir = workdir / "lab-nightly-1-c01"
    vmdir.mkdir()
    layout.write_lease(vmdir, {"run_id": "nightly-1", "vm": vmdir.name, "netns": "lab-nightly-1", "expires_at": 0})
    lock = runlock.RunLock(layout.run_lock_path(workdir, "nightly-1"))
    lock.acquire("the test")
    argv = [local.QEMU, "-name", vmdir.name, "-machine", "none", "-nodefaults", "-display", "none", "-S"]
    qemu = subprocess.Popen([*argv, "-pidfile", str(vmdir / "qemu.pid")], stdin=subprocess.DEVNULL)
    try:
        from lab.wait import wait_until

        wait_until(lambda: local.qemu_processes(workdir), timeout=60, what="the planted QEMU")
        cfg = config.parse(
            {
                "lab": {"results": str(tmp_path / "results")},
                "hosts": {"local": {"backend": "local", "workdir": str(workdir)}},
            }
        )
        swept = gc.collect(cfg, hosts=["local"])
        assert qemu.poll() is None, swept.lines
        assert vmdir.is_dir() and not [ln for ln in swept.lines if ln.startswith("removed")], swept.lines
    finally:
        qemu.kill()
        qemu.wait()
        lock.release()
