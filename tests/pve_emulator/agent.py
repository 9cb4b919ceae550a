"""The guest agent's network-get-interfaces, as qemu-server answers it through a booting guest: `No QEMU
guest agent configured` without `agent`, `VM N is not running`, `QEMU guest agent is not running`
until agent_delay after boot, then lo, a docker bridge and eth0 (net0's MAC), whose IPv4 appears
dhcp_delay later (at once with a static ipconfig0). QEMU-backed VMs ask the real agent instead."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from .state import fail, handler
from .vms import agent_enabled, find_vm, ip_config

if TYPE_CHECKING:
    from .server import PveEmulator

MAC = re.compile(r"([0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){5})")
STATS = {
    "rx-bytes": 1000,
    "rx-packets": 10,
    "tx-bytes": 900,
    "tx-packets": 9,
    "rx-errs": 0,
    "tx-errs": 0,
    "rx-dropped": 0,
    "tx-dropped": 0,
}


@handler("GET", "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces")
def _agent_ifaces(emu: PveEmulator, p, who):
    vm = find_vm(emu, p["node"], p["vmid"])
    if not agent_enabled(vm):
        raise fail("No QEMU guest agent configured")
    if not vm.running:
        raise fail(f"VM {vm.vmid} is not running")
    now = time.monotonic()
    if emu.agent_delay is None or now < vm.booted_at + emu.agent_delay:
        raise fail("QEMU guest agent is not running")
    if vm.guest is not None:  # ask the real guest, without holding the state lock meanwhile
        guest = vm.guest
        emu._lock.release()
        try:
            result = emu.backing.interfaces(guest)
        finally:
            emu._lock.acquire()
        if result is None:
            raise fail("QEMU guest agent is not running")
        return {"result": result}
    mac = MAC.search(vm.config.get("net0", ""))
    mac = mac.group(1).lower() if mac else "bc:24:11:00:00:00"
    static = re.search(r"(?:^|,)ip=[0-9.]+/", str(vm.config.get("ipconfig0", "")))
    addrs = [{"ip-address": "fe80::be24:11ff:fe00:1", "ip-address-type": "ipv6", "prefix": 64}]
    if static or now >= vm.booted_at + emu.agent_delay + emu.dhcp_delay:
        addrs.insert(0, {"ip-address": ip_config(emu, vm)[0], "ip-address-type": "ipv4", "prefix": 24})
    return {
        "result": [
            {
                "name": "lo",
                "hardware-address": "00:00:00:00:00:00",
                "statistics": STATS,
                "ip-addresses": [
                    {"ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8},
                    {"ip-address": "::1", "ip-address-type": "ipv6", "prefix": 128},
                ],
            },
            {
                "name": "docker0",
                "hardware-address": "02:42:ac:11:00:01",
                "statistics": STATS,
                "ip-addresses": [{"ip-address": "172.17.0.1", "ip-address-type": "ipv4", "prefix": 16}],
            },
            {"name": "eth0", "hardware-address": mac, "statistics": STATS, "ip-addresses": addrs},
        ]
    }
