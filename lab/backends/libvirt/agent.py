"""The guest agent (qemu-guest-agent on the org.qemu.guest_agent.0 channel) through libvirt: how a
restored warm clone is given its own identity before anything is measured. Every fix-up avoids
starting guest processes where the agent can do it alone (under TCG each process start costs
0.3-1 s): the clock by guest-set-time, files by guest-file-*, the network by one `ip -batch`."""

from __future__ import annotations

import base64
import ipaddress
import json
import time
from typing import Any

from lab.backends.libvirt.connection import error_message, libvirt_module, libvirt_qemu_module
from lab.errors import BackendError
from lab.wait import wait_until

READY_LINE = "\r\nLAB-READY\r\n"  # what the image's lab-ready prints on ttyS0 after a cold boot


def network_batch(address: str, mac: str, gateway: str = "", dev: str = "eth0") -> str:
    """`ip -batch` lines that give `dev` the clone's MAC and address (ADDR/PREFIX). The old address
    goes first, the MAC changes with the link down, and the new address is in place when the link
    comes up: with arp_notify set, the kernel's gratuitous ARP announces the new pair, so the host
    forgets whichever MAC had that address before (a cell of an earlier round)."""
    ipaddress.ip_interface(address)  # ValueError for anything but ADDR/PREFIX
    lines = [
        f"addr flush dev {dev}",
        f"link set {dev} down",
        f"link set {dev} address {mac}",
        f"addr add {address} dev {dev}",
        f"link set {dev} up",
    ]
    if gateway:
        lines.append(f"route replace default via {gateway} dev {dev}")
    return "\n".join(lines) + "\n"


class Agent:
    """One domain's guest agent. Errors are BackendErrors naming the command."""

    def __init__(self, dom: Any, timeout: int = 30):
        self.dom = dom
        self.timeout = timeout

    def command(self, execute: str, **arguments: Any) -> Any:
        libvirt = libvirt_module()
        cmd: dict[str, Any] = {"execute": execute}
        if arguments:
            cmd["arguments"] = arguments
        try:
            answer = libvirt_qemu_module().qemuAgentCommand(self.dom, json.dumps(cmd), self.timeout, 0)
        except libvirt.libvirtError as exc:
            raise BackendError(f"guest agent {execute}: {error_message(exc)}") from None
        return json.loads(answer).get("return")

    def wait(self, timeout: float) -> None:
        """Until the agent answers (libvirt syncs with it before each command)."""
        state = {"last": ""}

        def answers() -> bool:
            try:
                self.command("guest-ping")
                return True
            except BackendError as exc:
                state["last"] = str(exc)
                return False

        wait_until(
            answers, timeout=timeout, what="the guest agent to answer", interval=0.3, detail=lambda: state["last"]
        )

    def write_file(self, path: str, data: bytes) -> None:
        handle = self.command("guest-file-open", path=path, mode="w")
        try:
            self.command("guest-file-write", handle=handle, **{"buf-b64": base64.b64encode(data).decode()})
        finally:
            self.command("guest-file-close", handle=handle)

    def exec(self, path: str, args: list[str], stdin: str = "", timeout: float = 60) -> str:
        """Run a program in the guest and wait for it; its output, or BackendError with it."""
        extra: dict[str, Any] = {"input-data": base64.b64encode(stdin.encode()).decode()} if stdin else {}
        pid = self.command("guest-exec", path=path, arg=args, **{"capture-output": True}, **extra)["pid"]
        status: dict[str, Any] = {}

        def exited() -> bool:
            status.update(self.command("guest-exec-status", pid=pid))
            return bool(status.get("exited"))

        wait_until(exited, timeout=timeout, what=f"{path} in the guest", interval=0.05)
        out = base64.b64decode(status.get("out-data", "")).decode(errors="replace")
        err = base64.b64decode(status.get("err-data", "")).decode(errors="replace")
        if status.get("exitcode", 0) != 0 or status.get("signal"):
            raise BackendError(
                f"{path} {' '.join(args)} in the guest failed "
                f"(exit {status.get('exitcode')}): {(err or out).strip()[:300]}"
            )
        return out

    def set_clock(self) -> float:
        """Step the guest's clock to this machine's (guest-set-time: settimeofday at once, then
        the agent syncs the RTC). Returns the host time it was given."""
        libvirt = libvirt_module()
        now = time.time_ns()
        try:
            self.dom.setTime({"seconds": now // 1_000_000_000, "nseconds": now % 1_000_000_000}, 0)
        except libvirt.libvirtError as exc:
            raise BackendError(f"guest agent guest-set-time: {error_message(exc)}") from None
        return now / 1e9


def give_identity(agent: Agent, address: str, mac: str, gateway: str = "") -> None:
    """The clone's own clock, MAC and address, then LAB-READY on its console (the line wait_ready
    and the console stream look for, as after a cold boot)."""
    agent.set_clock()
    agent.write_file("/proc/sys/net/ipv4/conf/eth0/arp_notify", b"1\n")
    agent.exec("/sbin/ip", ["-batch", "-"], stdin=network_batch(address, mac, gateway))
    agent.write_file("/dev/ttyS0", READY_LINE.encode())
