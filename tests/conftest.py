"""Shared fixtures. Real parts only: VM tests boot the golden image built by `make images`."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import lab
from libvirt_daemons import URI as LIBVIRT_URI

SHARED = lab.PROJECT_ROOT.parent / "shared"
LAB = [sys.executable, "-m", "lab"]


GROUPS_SCATTERED = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` (make test), xdist keeps the tests of one `xdist_group` on one
    worker by a suffix it adds to their node ids after collection. pytest 9.2 ignores that suffix
    (pytest-xdist#1386): the groups are then scattered, and the libvirt tests start and stop
    libvirtd under each other. Every grouped test then fails with the reason instead of flaking."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under loadgroup only
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and not item.nodeid.endswith("@" + "_".join(names)):
            config.stash[GROUPS_SCATTERED] = (
                f"pytest {pytest.__version__} with this pytest-xdist ignores xdist_group: tests sharing "
                "a daemon would run on two workers; install pytest<9.2 (pyproject.toml, pytest-xdist#1386)")
            return


def pytest_runtest_setup(item):
    reason = item.config.stash.get(GROUPS_SCATTERED, None)
    if reason and item.get_closest_marker("xdist_group"):
        pytest.fail(reason, pytrace=False)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"{SHARED} is missing: tests load the PVE schema and bhyve data from ../shared")
    return SHARED


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


@pytest.fixture
def workdir():
    """A short path (unix socket paths are limited to 108 bytes) that only this test uses."""
    d = Path(tempfile.mkdtemp(prefix="lw", dir="/var/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def write_lab(tmp_path: Path, workdir: Path, *, matrix: str = "", suite: str = "", extra: str = "") -> Path:
    """A lab.toml for tests: local backend in `workdir`, results under tmp_path."""
    text = textwrap.dedent(f"""
        [lab]
        name = "test"
        results = "{tmp_path / 'results'}"

        [hosts.local]
        backend = "local"
        workdir = "{workdir}"
        boot_timeout = 300
        """) + textwrap.dedent(extra) + "\n[matrix]\n" + textwrap.dedent(matrix) + "\n[suite]\n" + textwrap.dedent(suite)
    path = tmp_path / "lab.toml"
    path.write_text(text)
    return path


def run_lab_cli(*args: str, cwd: Path | None = None, timeout: float = 1800, env: dict | None = None):
    return subprocess.run([*LAB, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


@contextlib.contextmanager
def local_run(workdir: Path):
    """A run of the local backend without the runner: (backend, run id, client); the VM the test
    made is destroyed (put it in the yielded dict as "vm"), then the run's namespace."""
    from lab.backends import local

    backend = local.LocalBackend("local", {"workdir": str(workdir), "accel": "auto"})
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


@pytest.fixture(scope="session")
def libvirtd():
    """A serving libvirtd + virtlogd for qemu:///system; stops only what it started. Tests using
    it share the xdist group "libvirt-qemu-system", so one worker starts and stops the daemons
    (tests/libvirt_daemons.py; the chaos suite's libvirt fault uses the same)."""
    import libvirt_daemons

    if os.geteuid() != 0:
        pytest.skip("qemu:///system tests need root")
    for tool in ("libvirtd", "virtlogd", "virsh", "qemu-img", "qemu-system-x86_64"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            pytest.skip(f"{tool} is not installed (make setup)")
    started = libvirt_daemons.ensure_running()
    try:
        yield
    finally:
        libvirt_daemons.stop(started)


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0"]


def chromium_render(page: Path, shot: Path, profile: Path, size: tuple[int, int] = (1280, 2000)):
    """Open `page` in headless Chromium (a fresh profile: the machine's network is closed), take a
    screenshot, dump the DOM. Returns (dom, console lines). Missing Chromium fails in CI (CI set),
    skips elsewhere. As root Chromium needs --no-sandbox."""
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (apt-get install chromium); required in CI")
        pytest.skip("chromium not installed (apt-get install -y chromium); CI runs this test")
    proc = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={shot}",
         f"--window-size={size[0]},{size[1]}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # page errors and failed loads are what the console shows; they must not happen
    console = [line for line in proc.stderr.splitlines()
               if "CONSOLE" in line or "Uncaught" in line or "net::ERR" in line or "Failed to load" in line]
    return proc.stdout, console


@pytest.fixture
def proxmox_run_locks(tmp_path, monkeypatch):
    """The Proxmox backend's run locks (taken by open_run) in the test's own directory, not in
    /var/tmp/lab: parallel tests use the same run ids."""
    from lab.backends import proxmox

    monkeypatch.setattr(proxmox, "RUN_LOCK_DIR", tmp_path)
