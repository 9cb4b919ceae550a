"""The real-VM lane's fixtures: the golden image, and the system's libvirt daemons."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def golden():
    """The golden Debian image. Missing in CI is a failure (make test builds it), not a skip."""
    from lab import images
    from lab.errors import UsageError

    try:
        return images.load("debian12")
    except UsageError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"golden image missing in CI: {exc}")
        pytest.skip(f"{exc}")


def session_pid(config) -> int:
    """The pid of the process that owns the pytest session: the xdist controller (a worker's
    parent) or pytest itself."""
    return os.getppid() if hasattr(config, "workerinput") else os.getpid()


@pytest.fixture(scope="session")
def libvirtd(pytestconfig):
    """A serving libvirtd + virtlogd for qemu:///system, shared by both xdist workers: started by
    the first test that needs them, stopped when the session ends (pytest_sessionfinish), and only
    if the session started them (tests/support/libvirt_daemons.py; the chaos suite's libvirt fault too)."""
    from support import libvirt_daemons

    if os.geteuid() != 0:
        pytest.skip("qemu:///system tests need root")
    for tool in ("libvirtd", "virtlogd", "virsh", "qemu-img", "qemu-system-x86_64"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            pytest.skip(f"{tool} is not installed (make setup)")
    libvirt_daemons.ensure_running_for_session(session_pid(pytestconfig))
