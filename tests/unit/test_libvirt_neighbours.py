"""The one neighbour-table and console-address parser every backend uses (lab.backends.neighbours),
on real outputs: FreeBSD's and pfSense's `arp -an` as published (tests/data/README.md names the
sources), Linux's `ip -4 neigh show` and guest consoles captured here. Pure: no libvirt needed."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from lab.backends.neighbours import arp_entries, parse_arp, parse_console_address, ssh_banner

DATA = Path(__file__).parents[1] / "data" / "libvirt"


def test_arp_on_freebsd_captures():
    """`arp -an` as FreeBSD prints it (tests/data/README.md names the sources)."""
    vtnet = (DATA / "published-freebsd-arp-an-vtnet0.txt").read_text()
    assert parse_arp(vtnet, "fa:16:3e:7f:19:ef") == "140.211.10.66"
    assert parse_arp(vtnet, "FA:16:3E:BA:3E:25") == "140.211.10.91"  # permanent entries count
    assert parse_arp(vtnet, "52:54:00:00:00:01") == ""
    bridge = (DATA / "published-pfsense-arp-an-bridge0.txt").read_text()
    assert parse_arp(bridge, "f8:e4:3b:34:ba:0b") == "10.10.197.13"  # a bhyve host's bridge: [bridge]
    assert ("10.10.197.13", "f8:e4:3b:34:ba:0b", "bridge0") in arp_entries(bridge)
    assert all(ip != "5.2.251.1" for ip, _, _ in arp_entries(bridge))  # (incomplete) ... expired
    pending = (DATA / "published-pfsense-2.8-arp-an-incomplete.txt").read_text()
    assert [ip for ip, _, _ in arp_entries(pending)] == ["192.0.2.1", "192.0.2.30", "192.0.2.31"]
    # octets without their leading zero (how some BSD builds print them) still match
    assert (
        parse_arp("? (10.0.0.9) at 52:54:0:a:b:c on bridge0 expires in 9 seconds [bridge]", "52:54:00:0a:0b:0c")
        == "10.0.0.9"
    )


def test_arp_on_linux_capture():
    """`ip -4 neigh show` captured on this machine beside a running lab guest."""
    text = (DATA / "linux-ip-neigh.txt").read_text()
    entries = arp_entries(text)
    assert entries and all(len(mac) == 17 for _, mac, _ in entries)
    ip, mac, dev = next(e for e in entries if e[2].startswith("labvbr"))
    assert parse_arp(text, mac.upper()) == ip
    assert (
        parse_arp(
            "10.78.1.11 dev labvbr0 lladdr 52:54:00:aa:bb:cc FAILED\n10.78.1.12 dev labvbr0 INCOMPLETE\n",
            "52:54:00:aa:bb:cc",
        )
        == ""
    )


def test_console_address_on_real_consoles():
    debian = (DATA / "linux-debian12-console.log").read_text(errors="replace")
    assert "LAB-READY" in debian
    assert parse_console_address(debian) == "10.78.130.10"
    assert parse_console_address(debian.split("lab-net")[0]) == ""  # LAB-READY alone names no address
    # the same guest through libvirt's console stream (the pty, raw: CR CR LF line ends)
    stream = (DATA / "linux-debian12-console-stream.log").read_bytes().decode()  # keep the CRs
    assert "\r\r\nLAB-READY" in stream and parse_console_address(stream) == "10.78.130.10"
    freebsd = (DATA / "published-freebsd-console-dhclient.log").read_text()
    assert parse_console_address(freebsd) == "10.0.2.15"  # dhclient's "bound to" line
    assert parse_console_address(freebsd.split("Starting dhclient.")[0]) == ""  # before DHCP: nothing
    assert parse_console_address("nothing") == ""


def listener(greeting: bytes) -> tuple[socket.socket, int]:
    """A server on 127.0.0.1 that sends `greeting` to the first client, and its port."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.sendall(greeting)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_ssh_banner_tells_sshd_from_other_listeners():
    srv, port = listener(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n")
    with srv:
        assert ssh_banner("127.0.0.1", port)
    srv, port = listener(b"HTTP/1.1 400 Bad Request\r\n")
    with srv:
        assert not ssh_banner("127.0.0.1", port)
    assert not ssh_banner("127.0.0.1", port, timeout=0.5)  # nothing listens any more
