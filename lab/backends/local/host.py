"""What the local backend makes on this machine besides files: network namespaces with a bridge,
taps, veths, cgroups and processes; and how each is found again and removed (teardown and `lab gc`).

Nothing here knows about runs or cells; names come from the caller.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from lab import proc
from lab.backends.local.qemu import QEMU, READY_MARKER
from lab.errors import BackendError, LabError, TeardownError
from lab.wait import wait_until

BRIDGE = "br0"  # the bridge inside a run's namespace

# -- network namespaces, bridges, taps -------------------------------------------------------------


def list_netns() -> list[str]:
    res = proc.run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def netns_exists(ns: str) -> bool:
    return Path(f"/run/netns/{ns}").exists()


def bridge_netns_argvs(ns: str, gateway: str, prefix: int = 24) -> list[list[str]]:
    """Pure: a namespace holding bridge br0 at gateway/prefix (a run's network)."""
    return [
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "-n", ns, "addr", "add", f"{gateway}/{prefix}", "dev", BRIDGE],
        ["ip", "-n", ns, "link", "set", BRIDGE, "up"],
    ]


def tap_argvs(ns: str, tap: str, plugged: bool = True) -> list[list[str]]:
    """Pure: a tap in `ns`, up and plugged into its bridge; or up but on no bridge (`plugged` False:
    a restored clone's, until it has its own MAC and address, see plug_tap)."""
    return [
        ["ip", "-n", ns, "tuntap", "add", tap, "mode", "tap"],
        ["ip", "-n", ns, "link", "set", tap, *(["master", BRIDGE] if plugged else []), "up"],
    ]


def plug_tap_argv(ns: str, tap: str) -> list[str]:
    """Pure: plug an up tap into its namespace's bridge."""
    return ["ip", "-n", ns, "link", "set", tap, "master", BRIDGE]


def veth_netns_argvs(
    ns: str, bridge_ns: str, veth: str, address: str, prefix: int = 24, bridge: str = BRIDGE
) -> list[list[str]]:
    """Pure: a namespace `ns` whose eth0 (address/prefix) is one end of a veth pair; the other end,
    `veth`, is plugged into `bridge` of `bridge_ns` (the bare-metal cell's network)."""
    return [
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", bridge_ns, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
        ["ip", "-n", bridge_ns, "link", "set", veth, "master", bridge, "up"],
        ["ip", "-n", ns, "addr", "add", f"{address}/{prefix}", "dev", "eth0"],
        ["ip", "-n", ns, "link", "set", "eth0", "up"],
    ]


def run_all(argvs: list[list[str]], what: str) -> None:
    for argv in argvs:
        proc.run(argv, what=f"{what}: {' '.join(argv[:6])}")


def remove_tap(ns: str, tap: str) -> None:
    """Remove a tap or a veth pair by its end in `ns` (gone already is fine; so is its namespace
    being gone)."""
    if not netns_exists(ns):
        return
    res = proc.run(["ip", "-n", ns, "link", "del", tap], check=False)
    if not res.ok and "Cannot find device" not in res.stderr:
        raise TeardownError(f"tap {tap}: {res.stderr.strip()}")


def remove_netns(ns: str) -> None:
    """Kill what still runs in the namespace, then remove it (its taps and veth ends go with it)."""
    if not netns_exists(ns):
        return
    res = proc.run(["ip", "netns", "pids", ns], check=False)
    for pid in (int(x) for x in res.stdout.split() if x.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    res = proc.run(["ip", "netns", "del", ns], check=False)
    if not res.ok:
        raise TeardownError(f"network namespace {ns}: {res.stderr.strip()}")


# -- processes ---------------------------------------------------------------------------------------


def stop_process(p: subprocess.Popen) -> None:
    """Stop a child (QEMU, nginx): SIGTERM, bounded wait, SIGKILL. The VM is disposable: no
    graceful shutdown needed."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            wait_until(
                lambda: p.poll() is not None,
                timeout=10,
                what=f"pid {p.pid} to exit after SIGTERM",
                interval=0.01,
                max_interval=0.2,
            )
        except LabError:
            p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                raise TeardownError(f"pid {p.pid} survived SIGKILL") from None
    else:
        p.wait()


def wait_console_ready(p: subprocess.Popen, vmdir: Path, name: str, timeout: float) -> None:
    """Wait for the guest's LAB-READY line in `vmdir`/console.log; BackendError if QEMU exits first."""
    console = vmdir / "console.log"

    def ready() -> bool:
        if p.poll() is not None:
            raise BackendError(
                f"{name}: QEMU exited with status {p.returncode} during boot: "
                f"{tail(vmdir / 'qemu.log') or tail(console)}"
            )
        try:
            return READY_MARKER in console.read_bytes()
        except FileNotFoundError:
            return False

    wait_until(
        ready,
        timeout=timeout,
        what=f"{name} to boot (LAB-READY on its console)",
        interval=0.1,
        max_interval=0.5,
        detail=lambda: f"console: {tail(console) or 'empty'}",
    )


def cmdline(pid: int) -> list[str]:
    """A process's argv ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def exited(pid: int) -> bool:
    """The process is gone or a zombie (it runs no more; its parent has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def qemu_name(argv: list[str], workdir: Path | None = None) -> str | None:
    """Pure: the VM name of a QEMU command line this lab started (`-name lab-<run>-<cell>`), or
    None; with `workdir`, only if its pidfile lies under it."""
    if not argv or not argv[0].endswith(QEMU) or "-name" not in argv[:-1]:
        return None
    name = argv[argv.index("-name") + 1].split(",")[0]
    if not name.startswith("lab-"):
        return None
    if workdir is not None:
        pidfile = argv[argv.index("-pidfile") + 1] if "-pidfile" in argv[:-1] else ""
        if not pidfile.startswith(str(workdir).rstrip("/") + "/"):
            return None
    return name


def qemu_processes(workdir: Path | None = None) -> list[tuple[int, str]]:
    """(pid, vm name) of every QEMU this lab started (named lab-<run>-<cell>), optionally only
    those whose pidfile lies under `workdir`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            name = qemu_name(cmdline(int(entry.name)), workdir)
            if name is not None:
                out.append((int(entry.name), name))
    return out


def kill_pid(pid: int, name: str) -> None:
    """Kill a process we did not start in this process (gc), after checking it is the one named."""
    argv = cmdline(pid)
    if not argv or not any(a.startswith(name) for a in argv):
        return  # gone, or the pid was reused by something else: not ours to kill
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        try:
            wait_until(
                lambda: exited(pid), timeout=10, what=f"pid {pid} ({name}) to exit", interval=0.01, max_interval=0.2
            )
            return
        except LabError:
            continue
    raise TeardownError(f"{name}: pid {pid} survived SIGKILL")


# -- cgroups ------------------------------------------------------------------------------------------


def cgroup_parent() -> tuple[Path, str] | None:
    """Where a CPU-accounting cgroup can be made: cgroup v2, else v1's cpuacct hierarchy."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return Path("/sys/fs/cgroup"), "cgroup v2"
    if Path("/sys/fs/cgroup/cpuacct/cpuacct.usage").exists():
        return Path("/sys/fs/cgroup/cpuacct"), "cgroup v1 cpuacct"
    return None


def remove_cgroup(path: Path) -> None:
    """Remove a cgroup the lab made (the bare-metal cell's), killing what still runs in it."""
    if not path.is_dir():
        return
    procs = path / "cgroup.procs"

    def pids() -> list[int]:
        try:
            return [int(x) for x in procs.read_text().split()]
        except (OSError, ValueError):
            return []

    def empty() -> bool:
        for pid in pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return not pids()

    try:
        wait_until(empty, timeout=10, what=f"the processes of cgroup {path} to exit", interval=0.02, max_interval=0.2)
        path.rmdir()
    except (LabError, OSError) as exc:
        raise TeardownError(f"cgroup {path}: {getattr(exc, 'strerror', None) or exc}") from None


# -- a machine as a whole -----------------------------------------------------------------------------


def remove_machine(handle: dict[str, Any], name: str) -> None:
    """Remove everything a VM's (or the bare-metal cell's) handle names, in order: its process (our
    child `proc`, else the `pid` gc found), its `tap` in `netns`, its own namespace (`own_netns`),
    its `cgroup`, its directory `dir`. Goes on past a failure; raises TeardownError naming them all."""
    problems = []
    p: subprocess.Popen | None = handle.get("proc")
    try:
        if p is not None:
            stop_process(p)
        elif handle.get("pid"):
            kill_pid(int(handle["pid"]), name)
    except LabError as exc:
        problems.append(str(exc))
    ns, tap = handle.get("netns"), handle.get("tap")
    removals = []
    if ns and tap:
        removals.append(lambda: remove_tap(ns, tap))
    if handle.get("veth"):
        # the bare-metal cell's veth, from the run's namespace first: the kernel removes a deleted
        # namespace's links asynchronously, and the next round's veth of the same name was refused
        # ("File exists") while the old one was still going
        removals.append(lambda: remove_tap(handle["veth_netns"], handle["veth"]))
    if ns and handle.get("own_netns"):  # the bare-metal cell's namespace
        removals.append(lambda: remove_netns(ns))
    if handle.get("cgroup"):
        removals.append(lambda: remove_cgroup(Path(handle["cgroup"])))
    for remove in removals:
        try:
            remove()
        except LabError as exc:
            problems.append(str(exc))
    vmdir = Path(handle.get("dir") or "")
    if vmdir.name and vmdir.exists():
        try:
            shutil.rmtree(vmdir)
        except OSError as exc:
            problems.append(f"{vmdir}: {exc.strerror}")
    if problems:
        raise TeardownError(f"{name}: teardown incomplete: {'; '.join(problems)}")


def tail(path: Path, lines: int = 2) -> str:
    """The last non-empty lines of a log, on one line (for error messages)."""
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError:
        return ""
    last = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(last)[-300:]
