"""Fixtures every lane uses; the lanes' own are in tests/<lane>/conftest.py, helpers in tests/support.
Real parts only: VM tests boot the golden image built by `make images`."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Labs may run at once (two in one test, or under `pytest -n 2`): each one's VMs are the others'
# foreign load. Unless a test's lab.toml says otherwise, no lab waits for a quiet host or flags its
# samples for that (lab.labconfig: $LAB_QUIET_HOST is the default of [suite] quiet_host); host-load
# tests set it.
os.environ.setdefault("LAB_QUIET_HOST", "off")

# the order of the tests by the last run's durations, the xdist group check, the root and rerun marks
pytest_plugins = ["support.xdist_groups", "support.durations", "support.marking"]


@pytest.fixture
def workdir():
    """A short path (unix socket paths are limited to 108 bytes) that only this test uses, guarded
    against leaks (own_workdir)."""
    from support.local import own_workdir

    yield from own_workdir()


@pytest.fixture(scope="module")
def module_workdir():
    """The same, shared by a module's tests (a fixture of the module that boots once and that its
    tests only read); swept when the module ends."""
    from support.local import own_workdir

    yield from own_workdir()


WARM_MADE = pytest.StashKey[str]()


def pytest_configure(config):
    # one warm snapshot store for the session (support.local.WARM_ENV), unless make test gave one to
    # all its passes; made here, on the controller, before xdist starts the workers that inherit it
    from support.local import WARM_ENV

    if not hasattr(config, "workerinput") and os.geteuid() == 0 and not os.environ.get(WARM_ENV):
        os.environ[WARM_ENV] = config.stash[WARM_MADE] = tempfile.mkdtemp(prefix="lab-warm-", dir="/var/tmp")


def pytest_unconfigure(config):
    made = config.stash.get(WARM_MADE, None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


def pytest_sessionfinish(session):
    # here, not in tests/vm/conftest.py: xdist's controller, which alone outlives both workers, loads
    # only this conftest
    if not hasattr(session.config, "workerinput") and os.geteuid() == 0:
        from support import libvirt_daemons

        libvirt_daemons.stop_session(os.getpid())


@pytest.fixture
def fake_lab(tmp_path, monkeypatch):
    """The fake backend registered as "fake" (lab.backends.register), the fake workload as
    "fake-work", and built images faked (images.load): undone after the test."""
    import fakes.backend
    from fakes.workload import FakeWorkload
    from support import fakelab

    from lab import backends, images, workloads

    def fake_image(name, images_dir=None):
        return images.ImageRef(
            name=name,
            os=images.RECIPES[name].os,
            path=Path(f"/fake/{name}.qcow2"),
            digest=f"digest-{name}",
            sha256="f" * 64,
            manifest={"boot": list(images.BOOT_MODES), "tools": {"fake": "1"}},
        )

    backends.register("fake", "fakes")
    workload = FakeWorkload()
    workloads.load_all()  # the real ones first
    workloads.register(workload)
    monkeypatch.setattr(images, "load", fake_image)
    fakes.backend.reset()
    yield fakelab.FakeLab(tmp_path, workload)
    fakes.backend.reset()
    workloads.unregister("fake-work")
    backends.REGISTRY.pop("fake", None)
