"""Shared fixtures. Real parts only: VM tests boot the golden image built by `make images`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import lab

# Tests run several labs at once (-n 2): each one's VMs are the others' foreign load. Unless a
# test's lab.toml says otherwise, no lab waits for a quiet host or flags its samples for that
# (lab.labconfig: $LAB_QUIET_HOST is the default of [suite] quiet_host); host-load tests set it.
os.environ.setdefault("LAB_QUIET_HOST", "off")
from libvirt_daemons import URI as LIBVIRT_URI  # noqa: E402,F401 - the libvirt tests import it from here

SHARED = lab.PROJECT_ROOT.parent / "shared"
LAB = [sys.executable, "-m", "lab"]


GROUPS_SCATTERED = pytest.StashKey[str]()

# Tests that need root whose modules do not say so yet (their owners will mark them `root`): the
# fast lane runs without root and leaves them out. node id prefix -> why.
NEEDS_ROOT = {
    "tests/test_baremetal.py::": "the bare-metal cell makes network namespaces and cgroups",
    "tests/test_images_os.py::test_render_writes_answers_and_stage": "mmdebstrap --mode=root (the container base)",
    "tests/test_proxmox_cluster.py::test_guest_without_agent_and_without_static_address_is_found_by_arp": (
        "a network namespace stands in for the node's neighbours"
    ),
}


# A real-VM test boots TCG guests on 2 shared cores beside another worker's VMs; CI lost whole
# submissions to one such test hanging once in ~20 runs where it passed alone and in 10 loaded loops
# here (test_firmware_boot, test_host_load_vm). One rerun, shown as R in the summary (make test runs
# -rsR), keeps a rare environmental stall from failing a run; a test that fails twice still fails.
VM_RERUNS = 1


def pytest_itemcollected(item):
    if any(item.nodeid.startswith(prefix) for prefix in NEEDS_ROOT) and not item.get_closest_marker("root"):
        item.add_marker(pytest.mark.root)
    if item.get_closest_marker("vm") and not item.get_closest_marker("flaky"):
        item.add_marker(pytest.mark.flaky(reruns=VM_RERUNS, reruns_delay=5))


# Seconds a test of these files takes in make test's parallel pass (CI of stop 29, two workers; the
# libvirt ones as measured here once /dev/kvm was udev's, times 1.5), for the order below; a file
# not listed counts as SECONDS_VM (a real-VM test) or 0.
SECONDS = {
    "test_apps_lab.py": 630,
    "test_compare_real.py": 410,
    "test_chaos.py": 300,
    "test_lanes_vm.py": 220,
    "test_isolation_vm.py": 350,
    "test_smartos_e2e.py": 200,
    "test_reliability.py": 160,
    "test_slots_vm.py": 160,
    "test_tuning_vm.py": 140,
    "test_vagrant_vm.py": 120,
    "test_proxmox_e2e.py": 110,
    "test_libvirt_warm.py": 90,
    "test_firmware_boot.py": 90,
    "test_libvirt_e2e.py": 50,
    "test_smartos_zones.py": 40,
    "test_history_vm.py": 130,  # serial
    "test_explain_vm.py": 180,  # serial
    "test_package.py": 90,  # not a VM: a wheel, pipx unpacking numpy/scipy/matplotlib, four lab commands
}
SECONDS_VM = 60


def expected_seconds(item) -> int:
    name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
    return SECONDS.get(name, SECONDS_VM if item.get_closest_marker("vm") else 0)


def group_of(item) -> str:
    """The item's xdist group as xdist names it ("a_b" for two; "" for none)."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The longest work first (a stable sort; an xdist group weighs what its tests add up to; make
    test passes --no-loadscope-reorder, which would put the groups with most tests first): each
    worker takes the next test when it is almost out of work, so the parallel pass then ends on
    short ones, which even out the two workers' last minutes, instead of on a long VM test that
    leaves one core idle.

    Under `--dist loadgroup` (make test), xdist keeps the tests of one `xdist_group` on one
    worker by a suffix it adds to their node ids after collection. pytest 9.2 ignores that suffix
    (pytest-xdist#1386): the groups are then scattered (vagrant-libvirt's global network and box
    store used from two workers, the four-lane tests' ten guests at once). Every grouped test then
    fails with the reason instead of flaking."""
    group = {item: group_of(item) for item in items}
    weight: dict[str, int] = {}
    for item in items:
        weight[group[item]] = weight.get(group[item], 0) + expected_seconds(item)
    items.sort(key=lambda item: -(weight[group[item]] if group[item] else expected_seconds(item)))
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under loadgroup only
        return
    for item in items:
        if group[item] and not item.nodeid.endswith("@" + group[item]):
            config.stash[GROUPS_SCATTERED] = (
                f"pytest {pytest.__version__} with this pytest-xdist ignores xdist_group: tests sharing "
                "a daemon would run on two workers; install pytest<9.2 (pyproject.toml, pytest-xdist#1386)"
            )
            return


# Why each rerun test failed its first try: pytest-rerunfailures reports only the name, and a CI
# log is all we get of a flake. Kept by the process that prints the summary (xdist's controller,
# which receives its workers' reports).
RERUN_REASONS: list[str] = []


def pytest_runtest_logreport(report):
    if report.outcome == "rerun":
        lines = (report.longreprtext or "").strip().splitlines()
        RERUN_REASONS.append(f"{report.nodeid} ({report.when}, {report.duration:.0f} s):")
        RERUN_REASONS.extend("    " + line for line in lines[-16:])


def pytest_terminal_summary(terminalreporter):
    if RERUN_REASONS:
        terminalreporter.section("why the rerun tests failed first")
        for line in RERUN_REASONS:
            terminalreporter.write_line(line)


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
    """A short path (unix socket paths are limited to 108 bytes) that only this test uses, guarded
    against leaks (own_workdir)."""
    yield from own_workdir()


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


def write_lab(tmp_path: Path, workdir: Path, *, matrix: str = "", suite: str = "", extra: str = "") -> Path:
    """A lab.toml for tests: local backend in `workdir`, results under tmp_path."""
    text = (
        textwrap.dedent(f"""
        [lab]
        name = "test"
        results = "{tmp_path / "results"}"

        [hosts.local]
        backend = "local"
        workdir = "{workdir}"
        boot_timeout = 300
        """)
        + textwrap.dedent(extra)
        + "\n[matrix]\n"
        + textwrap.dedent(matrix)
        + "\n[suite]\n"
        + textwrap.dedent(suite)
    )
    path = tmp_path / "lab.toml"
    path.write_text(text)
    return path


def run_lab_cli(*args: str, cwd: Path | None = None, timeout: float = 1800, env: dict | None = None):
    """`lab ARGS` as a process of its own: for runs that boot VMs, signals, and the entry point."""
    return subprocess.run(
        [*LAB, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})}
    )


@dataclasses.dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def lab_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> CliResult:
    """`lab ARGS` in this process through click's CliRunner (no interpreter start-up): the same
    group, exit statuses and one-line errors as the program. `env`: variables to set (None: unset)."""
    from click.testing import CliRunner

    from lab.cli import cli

    with contextlib.chdir(cwd or Path.cwd()):
        res = CliRunner().invoke(cli, list(args), env=env, prog_name="lab", catch_exceptions=False)
    return CliResult(res.exit_code, res.stdout, res.stderr)


@contextlib.contextmanager
def local_run(workdir: Path):
    """A run of the local backend without the runner: (backend, run id, client); the VM the test
    made is destroyed (put it in the yielded dict as "vm"), then the run's namespace."""
    from lab.backends import local

    backend = local.LocalBackend("local", local.Settings(backend="local", workdir=str(workdir), accel="auto"))
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


def session_pid(config) -> int:
    """The pid of the process that owns the pytest session: the xdist controller (a worker's
    parent) or pytest itself."""
    return os.getppid() if hasattr(config, "workerinput") else os.getpid()


@pytest.fixture(scope="session")
def libvirtd(pytestconfig):
    """A serving libvirtd + virtlogd for qemu:///system, shared by both xdist workers: started by
    the first test that needs them, stopped when the session ends (pytest_sessionfinish), and only
    if the session started them (tests/libvirt_daemons.py; the chaos suite's libvirt fault too)."""
    import libvirt_daemons

    if os.geteuid() != 0:
        pytest.skip("qemu:///system tests need root")
    for tool in ("libvirtd", "virtlogd", "virsh", "qemu-img", "qemu-system-x86_64"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            pytest.skip(f"{tool} is not installed (make setup)")
    libvirt_daemons.ensure_running_for_session(session_pid(pytestconfig))


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput") and os.geteuid() == 0:
        import libvirt_daemons

        libvirt_daemons.stop_session(os.getpid())


CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
]


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
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--screenshot={shot}",
            f"--window-size={size[0]},{size[1]}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # page errors and failed loads are what the console shows; they must not happen
    console = [
        line
        for line in proc.stderr.splitlines()
        if "CONSOLE" in line or "Uncaught" in line or "net::ERR" in line or "Failed to load" in line
    ]
    return proc.stdout, console


@pytest.fixture
def proxmox_run_locks(tmp_path, monkeypatch):
    """The Proxmox backend's run locks (taken by open_run) in the test's own directory, not in
    /var/tmp/lab: parallel tests use the same run ids."""
    from lab.backends.proxmox import backend as proxmox

    monkeypatch.setattr(proxmox, "RUN_LOCK_DIR", tmp_path)


# -- the fake backend, guest and workload (tests/fakes): the runner without root, QEMU or SSH -----


class FakeLab:
    """A lab on the fake backend in a test's directory: `write()` its lab.toml, `load()` it."""

    def __init__(self, tmp_path: Path, workload):
        self.dir, self.workload = tmp_path, workload
        self.path = tmp_path / "lab.toml"

    def write(self, *, matrix: str = "", suite: str = "", host: str = "", extra: str = "", name: str = "fake") -> Path:
        suite = textwrap.dedent(suite)
        given = {line.split("=")[0].strip() for line in suite.splitlines()}
        defaults = "".join(
            f"{k} = {v}\n"
            for k, v in (("workloads", '["fake-work"]'), ("repetitions", 2), ("warmup", 1))
            if k not in given
        )
        text = (
            f'[lab]\nname = {json.dumps(name)}\nresults = "results"\n\n[hosts.f]\nbackend = "fake"\n'
            + textwrap.dedent(host)
            + "\n"
            + textwrap.dedent(extra)
            + '\n[matrix]\nhost = ["f"]\n'
            + textwrap.dedent(matrix)
            + "\n[suite]\n"
            + defaults
            + suite
        )
        if "[hosts.local]" not in text:
            # the always-defined local host gets this test's own workdir: a test's `lab gc` or
            # listing must never see (or remove) this machine's real leases and warm snapshots
            text += f'\n[hosts.local]\nbackend = "local"\nworkdir = {json.dumps(str(self.dir / "local"))}\n'
        self.path.write_text(text)
        return self.path

    def load(self):
        from lab import config

        return config.load(self.path)


@pytest.fixture
def fake_lab(tmp_path, monkeypatch):
    """The fake backend registered as "fake" (lab.backends.register), the fake workload as
    "fake-work", and built images faked (images.load): undone after the test."""
    import fakes.backend
    from fakes.workload import FakeWorkload

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
    yield FakeLab(tmp_path, workload)
    fakes.backend.reset()
    workloads.unregister("fake-work")
    backends.REGISTRY.pop("fake", None)
