"""What the cluster is, asked before anything is created: a PVE API at the URL, the nodes the settings
name, what the credentials may do (privileges.py), and the facts of a node (`lab snapshot`)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from lab.backends.proxmox.session import ApiError, Session, is_transient
from lab.errors import ConfigError, HostUnreachable, UnreachableError
from lab.hostload import CpuRates, LoadWindow, PollingWindow
from lab.model import Vm

# PVE updates a rate at most every 1000 ticks of all CPUs (1.25 s on 8 CPUs): poll a little slower
HOST_LOAD_POLL_S = 2.0

PRECHECK_RETRY = 5.0  # a host that does not answer to a look is reported soon, not retried for long


def soon(session: Session) -> float:
    """The deadline of a look (a check, a snapshot): a few seconds of retries at most."""
    return time.monotonic() + min(PRECHECK_RETRY, session.settings.timeouts.retry)


def check(session: Session, source: str) -> None:
    """A PVE API answers at the URL, and every node of the settings is in the cluster, one online.
    Runs before anything is created: unreachable is UnreachableError (exit 2)."""
    until = soon(session)
    try:
        release = session.version(until=until).get("release", "")
        if not re.fullmatch(r"\d+\.\d+", release):
            raise UnreachableError(f"{session.host}: {session.url} does not look like a PVE API (release {release!r})")
        res = session.get("GET /nodes", session.api().nodes, until=until)
    except UnreachableError:
        raise
    except HostUnreachable as exc:
        raise UnreachableError(str(exc), exc.hint) from None
    settings = session.settings
    known = {str(r.get("node")): str(r.get("status", "")) for r in res}
    listed = [("node", settings.node)] + [(f"nodes[{i}]", n) for i, n in enumerate(settings.nodes or [])]
    for key, n in listed:
        if n not in known:
            raise ConfigError(
                source,
                f"hosts.{session.host}.{key}",
                n,
                f"no such node in the cluster at {session.url}; its nodes: {', '.join(sorted(known)) or 'none'}",
            )
    if not any(known[n] == "online" for n in settings.clone_nodes):
        raise UnreachableError(f"{session.host}: none of the nodes {', '.join(settings.clone_nodes)} is online")


def node_facts(session: Session, node: str) -> dict[str, Any]:
    """A node's fingerprint from GET /nodes/{node}/status, in lab.hostinfo's words: CPU model and
    topology, memory, kernel, PVE version, boot mode. What changes by itself (load, free memory,
    clock speed) is left out. A node that cannot be reached (595, lost connection) is
    HostUnreachable (exit 1): its facts were not looked at."""
    try:
        st = session.get(f"GET status of node {node}", session.node(node).status, until=soon(session))
    except ApiError as exc:
        if is_transient(exc):
            raise HostUnreachable(
                f"{session.host}: node {node} cannot be reached: HTTP {exc.status} {exc.reason}"
            ) from None
        raise
    cpu = st.get("cpuinfo") or {}
    kernel = (st.get("current-kernel") or {}).get("release") or _kernel_of(str(st.get("kversion") or ""))
    facts: dict[str, Any] = {
        "cpu_model": cpu.get("model"),
        "cores": cpu.get("cpus"),  # logical CPUs, as os.cpu_count() counts them for the local host
        "physical_cores": cpu.get("cores"),
        "sockets": cpu.get("sockets"),
        "mem_kib": int((st.get("memory") or {}).get("total") or 0) // 1024 or None,
        "kernel": kernel or None,
        "os": st.get("pveversion"),
        "boot_mode": (st.get("boot-info") or {}).get("mode"),
    }
    flags = str(cpu.get("flags") or "").split()
    if flags:
        facts["virt_flags"] = sorted(set(flags) & {"vmx", "svm", "hypervisor"})
    return {k: v for k, v in facts.items() if v is not None}


def _kernel_of(kversion: str) -> str:
    """ "Linux 6.8.12-4-pve #1 SMP PREEMPT_DYNAMIC ..." (PVE 7's only kernel field) -> "6.8.12-4-pve"."""
    parts = kversion.split()
    return parts[1] if len(parts) > 1 else ""


def cpu_rates(session: Session, node: str, vmids: list[int]) -> CpuRates:
    """One poll of a node's CPU and the lab's VMs' share of it, in cores (lab.hostload.CpuRates).

    PVE answers rates, each over the seconds since the previous call (of that pveproxy worker):
    the node's `cpu` is the busy part of all its CPUs (guest time and steal included) and `cpuinfo.cpus`
    their number; a VM's `cpu` is its QEMU process's part of the VM's `cpus` (vCPU time included).
    Steal is inside the node's figure, not reported on its own (None)."""
    at = time.monotonic()
    st = session.get(f"GET status of node {node}", session.node(node).status, until=soon(session))
    cpus = int((st.get("cpuinfo") or {}).get("cpus") or 1)
    lab = 0.0
    for vmid in vmids:
        vs = session.get(f"GET status of VM {vmid}", session.qemu(node, vmid).status.current, until=soon(session))
        lab += float(vs.get("cpu") or 0.0) * int(vs.get("cpus") or 1)
    return CpuRates(at=at, busy_cores=float(st.get("cpu") or 0.0) * cpus, lab_cores=lab, steal_cores=None, cpus=cpus)


class LoadMeter:
    """The host's load under a repetition: the node the cell's VM runs on, its CPU from the API
    minus the lab's own VMs on it, polled every HOST_LOAD_POLL_S while the window is open (PVE gives
    rates, not counters)."""

    def __init__(self, session: Session):
        self.session = session

    def window(self, vms: Sequence[Vm]) -> LoadWindow:
        node = next((vm.handle["node"] for vm in vms if vm.handle.get("node")), self.session.settings.node)
        vmids = [int(vm.handle["vmid"]) for vm in vms if vm.handle.get("node") == node and vm.handle.get("vmid")]
        return PollingWindow(lambda: cpu_rates(self.session, node, vmids), interval=HOST_LOAD_POLL_S)


@contextmanager
def before_anything() -> Iterator[None]:
    """Checks run before anything is created: a host that cannot be reached then is UnreachableError
    (a UsageError, exit 2), not the runtime HostUnreachable (exit 1)."""
    try:
        yield
    except UnreachableError:
        raise
    except HostUnreachable as exc:
        raise UnreachableError(str(exc), exc.hint) from None
