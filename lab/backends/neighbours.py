"""Finding a guest's address from outside it: the host's neighbour table (Linux `ip -4 neigh show`,
FreeBSD `arp -an`) by MAC, the guest's own line on its serial console, an SSH banner. Pure parsers,
shared by every backend that has to look (libvirt, Proxmox)."""

from __future__ import annotations

import re
import socket

_BSD_ARP = re.compile(
    r"^\S+ \((?P<ip>\d+\.\d+\.\d+\.\d+)\) at (?P<mac>[0-9A-Fa-f:]+|\(incomplete\))"
    r" on (?P<dev>\S+)(?P<rest>.*)$"
)
# Linux `ip -4 neigh show`: "IP dev IFACE lladdr MAC [router] STATE" ("IP dev IFACE FAILED" without one)
_LINUX_NEIGH = re.compile(
    r"^(?P<ip>\d+\.\d+\.\d+\.\d+) dev (?P<dev>\S+)(?: lladdr (?P<mac>[0-9A-Fa-f:]+))?"
    r"(?P<rest>.*)$"
)


def _norm_mac(mac: str) -> str:
    """aa:b:c.. -> 0a:0b:0c..: some BSDs print octets without their leading zero."""
    parts = mac.lower().split(":")
    return ":".join(p.zfill(2) for p in parts) if len(parts) == 6 else mac.lower()


def arp_entries(text: str) -> list[tuple[str, str, str]]:
    """(ip, mac, interface) of every resolved IPv4 entry in `arp -an` (FreeBSD) or
    `ip -4 neigh show` (Linux) output; incomplete, failed and expired entries are left out."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        m = _BSD_ARP.match(line)
        if m:
            if m["mac"] == "(incomplete)" or " expired" in m["rest"]:
                continue
            out.append((m["ip"], _norm_mac(m["mac"]), m["dev"]))
            continue
        m = _LINUX_NEIGH.match(line)
        if m and m["mac"] and not re.search(r"\b(FAILED|INCOMPLETE)\b", m["rest"]):
            out.append((m["ip"], _norm_mac(m["mac"]), m["dev"]))
    return out


def parse_arp(text: str, mac: str) -> str:
    """IPv4 address the host's neighbour table holds for `mac` ("" if none)."""
    want = _norm_mac(mac)
    hits = [ip for ip, m, _ in arp_entries(text) if m == want]
    return hits[-1] if hits else ""


def parse_console_address(text: str) -> str:
    """The guest's own report of its address on the serial console (lab-net, FreeBSD dhclient)."""
    for pattern in (
        r"lab-net: \S+ (\d+\.\d+\.\d+\.\d+)",
        r"LAB-READY[ \t]+(?:ip=)?(\d+\.\d+\.\d+\.\d+)",
        r"bound to (\d+\.\d+\.\d+\.\d+)",
    ):
        hits = re.findall(pattern, text)
        if hits:
            return hits[-1]
    return ""


def ssh_banner(address: str, port: int = 22, timeout: float = 2.0) -> bool:
    """True when something at address:port speaks SSH (reads the server's identification line)."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False
