"""A guest's IPv4 address: the one it is given (the cell's, or the next free one of `addresses`,
through cloud-init's ipconfig0), and the one it is found at once it runs: the guest agent's
`network-get-interfaces` matched by net0's MAC; when the agent stays silent (or is off), the static
address; without one, the neighbour (ARP) table by MAC (lab.backends.neighbours). SSH readiness is
the caller's (lab.guest)."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
import shlex
import threading
import time
from pathlib import Path
from typing import Any

from lab import proc, runlock
from lab.backends.neighbours import parse_arp
from lab.backends.proxmox.ownership import lab_vms
from lab.backends.proxmox.session import ApiError, Session, is_transient
from lab.backends.proxmox.settings import address_pool
from lab.errors import BackendError, LabError, UsageError
from lab.model import Vm, VmSpec
from lab.wait import wait_until

log = logging.getLogger(__name__)

AGENT_NOT_YET = ("QEMU guest agent is not running", "is not running", "got timeout")
AGENT_OFF = ("No QEMU guest agent configured",)


class Addresses:
    def __init__(self, session: Session, state_dir: Path):
        self.session = session
        self.settings = session.settings
        self.host = session.host
        self.pool = address_pool(self.settings.addresses)
        self._lock_file = state_dir / f"proxmox-{_file_safe(self.host)}.addresses.lock"
        self._taken: set[str] = set()  # pool addresses this backend handed out
        self._lock = threading.Lock()

    # -- handing out ------------------------------------------------------------------------------
    def lock(self, spec: VmSpec):
        """Held from choosing a pool address until it is in the VM's config: two `lab run`s on this
        machine never choose the same one (other machines are seen once their config is written)."""
        if spec.ip or not self.pool:
            return contextlib.nullcontext()
        return runlock.exclusive(
            self._lock_file, timeout=self.settings.timeouts.config, what=f"the address lock of host {self.host!r}"
        )

    def choose(self, spec: VmSpec) -> str:
        """The cell's address, else the next free one of `addresses`, else "" (DHCP). Free means
        neither handed out here nor in the ipconfig0 of a lab VM on the cluster (another `lab run`'s,
        from here or another machine). Call it under `lock(spec)`."""
        if spec.ip:
            return spec.ip
        if not self.pool:
            return ""
        listing = lab_vms(self.session)
        if listing.unchecked:  # their VMs are down or unreachable: their addresses are not in use now
            log.warning("%s: addresses on nodes not checked: %s", self.host, "; ".join(listing.unchecked))
        in_use = {
            m.group(1)
            for vm in listing.vms
            if (m := re.search(r"(?:^|,)ip=([0-9.]+)", str(vm.config.get("ipconfig0") or "")))
        }
        with self._lock:
            for ip in self.pool:
                if (
                    ip not in self._taken
                    and ip not in in_use
                    and ip not in (self.settings.gateway, self.settings.client_address)
                ):
                    self._taken.add(ip)
                    return ip
        raise BackendError(
            f"{self.host}: every address of `addresses` is in use ({len(self.pool)}, "
            f"{len(in_use)} by lab VMs on the cluster)"
        )

    def ipconfig(self, vm: Vm, ip: str) -> str:
        """ipconfig0 for `ip` ("" = DHCP); the address is recorded in vm.handle first, so that
        destroy() gives it back even when configuring fails."""
        if not ip:
            return "ip=dhcp"
        vm.handle["static_ip"] = ip.split("/")[0]
        addr = ip if "/" in ip else f"{ip}/{self.settings.prefix_len}"
        try:
            ipaddress.IPv4Interface(addr)
        except ValueError:
            raise UsageError(f"{self.host}: VM {vm.name}: bad static address {ip!r}") from None
        return f"ip={addr}" + (f",gw={self.settings.gateway}" if self.settings.gateway else "")

    def release(self, ip: str) -> None:
        with self._lock:
            self._taken.discard(ip)

    # -- finding ----------------------------------------------------------------------------------
    def wait(self, vm: Vm, timeout: float) -> tuple[str, str]:
        """Wait until the VM runs and has an address: (address, where it came from: agent, static, arp)."""
        vmid, node = vm.handle["vmid"], vm.handle.get("node", self.settings.node)
        api = self.session.qemu(node, vmid)
        poll: dict[str, Any] = {"interval": self.settings.poll_interval, "max_interval": self.settings.poll_max}
        start = time.monotonic()
        label = f"{self.host}: VM {vmid} ({vm.name})"

        def polled(what: str, resource):
            """One poll's answer; None when the connection was lost or a node failed (the next
            poll asks again, within the wait)."""
            try:
                return self.session.get(what, resource, until=time.monotonic())
            except LabError as exc:
                if (
                    not is_transient(exc)
                    or isinstance(exc, ApiError)
                    and any(m in exc.reason for m in AGENT_OFF + AGENT_NOT_YET)
                ):
                    raise
                log.info("%s: %s; asking again", label, exc)
                return None

        def running():
            st = polled(f"status of VM {vmid}", api.status.current)
            return st is not None and st.get("status") == "running"

        wait_until(running, timeout=timeout, what=f"{label} to run", **poll)
        mac = (vm.handle.get("mac") or "").lower()
        static = vm.handle.get("static_ip") or ""
        agent_on = self.settings.guest_agent
        last = {"err": "no answer yet" if agent_on else "guest agent off (guest_agent = false)"}
        agent = {"on": agent_on, "until": start + min(max(0.0, timeout), self.settings.timeouts.agent)}

        def agent_ip():
            try:
                res = polled(f"guest agent of VM {vmid}", api.agent("network-get-interfaces"))
            except ApiError as exc:
                if any(m in exc.reason for m in AGENT_OFF):
                    agent["on"] = False  # e.g. a BSD template without agent=1: go on at once
                    last["err"] = exc.reason
                    return None
                if any(m in exc.reason for m in AGENT_NOT_YET):
                    last["err"] = exc.reason
                    return None
                raise
            if res is None:
                last["err"] = "no answer (connection lost)"
                return None
            ip = pick_ipv4(res.get("result", []) if isinstance(res, dict) else [], mac)
            if not ip:
                last["err"] = f"agent answers but reports no IPv4 for MAC {mac or '?'}"
            return ip

        def discover():
            if agent["on"]:
                ip = agent_ip()
                if ip:
                    return ip, "agent"
                if time.monotonic() < agent["until"]:
                    return None
            if static:
                log.info("%s: guest agent silent (%s); using the static address %s", label, last["err"], static)
                return static, "static"
            ip = self.arp(mac)
            if ip:
                return ip, "arp"
            last["arp"] = f"no neighbour entry for MAC {mac or '?'}"
            return None

        return wait_until(
            discover,
            timeout=max(0.0, timeout - (time.monotonic() - start)),
            what=f"{label} to report an IPv4 address for MAC {mac or '?'} (guest agent, static address, ARP)",
            detail=lambda: f"last: {last['err']}" + (f"; {last['arp']}" if "arp" in last else ""),
            **poll,
        )

    def arp(self, mac: str) -> str:
        """The neighbour table: the node's (node_ssh), else this machine's (in client_netns)."""
        if not mac:
            return ""
        argv = ["ip", "-4", "neigh", "show"]
        if self.settings.node_ssh:
            argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", *shlex.split(self.settings.node_ssh), *argv]
        try:
            res = proc.run(
                argv,
                timeout=30,
                check=False,
                what="neighbour table",
                netns=None if self.settings.node_ssh else (self.settings.client_netns or None),
            )
        except LabError:
            return ""
        return parse_arp(res.stdout, mac) if res.ok else ""


def pick_ipv4(ifaces: list[dict], mac: str) -> str | None:
    """The guest's IPv4 on the interface whose MAC is net0's; never lo, link-local or others."""
    for iface in ifaces:
        if mac and str(iface.get("hardware-address", "")).lower() != mac:
            continue
        if not mac and iface.get("name") in ("lo", "docker0"):
            continue
        for a in iface.get("ip-addresses") or []:
            if a.get("ip-address-type") != "ipv4":
                continue
            try:
                ip = ipaddress.IPv4Address(a.get("ip-address", ""))
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local:
                continue
            return str(ip)
    return None


def _file_safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)
