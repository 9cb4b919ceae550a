"""A guest's address, asked in order of trust: the static address lab gave it; libvirt's DHCP
leases (`interfaceAddresses(LEASE)` where the driver has it, bhyve only from libvirt 12.3; the
libvirt network's `DHCPLeases()` on any version); libvirt's ARP source (QEMU hosts); the host's
neighbour table by MAC (`arp -an` on FreeBSD, `ip neigh` on Linux, over SSH for remote hosts);
the serial console last. And the static addresses lab hands out from a host's `subnet`."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from lab.backends.libvirt.connection import Connection, libvirt_module
from lab.backends.libvirt.domain import mac_for
from lab.backends.libvirt.drivers import too_old
from lab.backends.libvirt.hostshell import HostShell
from lab.backends.libvirt.settings import Host
from lab.backends.neighbours import parse_arp, parse_console_address
from lab.errors import BackendError, LabError
from lab.model import Vm


class AddressChain:
    def __init__(self, host: Host, connection: Connection, shell: HostShell, console_text: Callable[[Vm], str]):
        self.host = host
        self.connection = connection
        self.shell = shell
        self.console_text = console_text
        self.links: list[tuple[str, Callable[[Vm], str]]] = [
            ("static", self.static),
            ("lease", self.lease),
            ("dhcp-leases", self.network_leases),
            ("arp", self.libvirt_arp),
            ("host-arp", self.host_arp),
            ("console", self.console),
        ]

    def find(self, vm: Vm) -> str:
        """The first link that knows the guest's address ("" when none does yet); the link is
        recorded in vm.facts["address_source"]."""
        for source, link in self.links:
            try:
                ip = link(vm)
            except LabError:  # a link that cannot answer (host unreachable for arp): the next one
                ip = ""
            if ip:
                vm.facts["address_source"] = source
                vm.address = ip
                return ip
        return ""

    @staticmethod
    def mac(vm: Vm) -> str:
        return (vm.handle.get("mac") or vm.spec.mac or mac_for(vm.name)).lower()

    def static(self, vm: Vm) -> str:
        return vm.spec.ip.split("/")[0]

    def _interface_addresses(self, vm: Vm, source: str) -> str:
        libvirt = libvirt_module()
        if self.host.driver == "bhyve" and too_old(self.host.caps, "interface-addresses", self.connection.lib_version):
            return ""
        dom = self.connection.lookup(vm.name)
        if dom is None:
            return ""
        try:
            ifaces = dom.interfaceAddresses(getattr(libvirt, source), 0) or {}
        except libvirt.libvirtError:
            return ""  # NO_SUPPORT / ARGUMENT_UNSUPPORTED / no leases yet: next source
        mac = self.mac(vm)
        for info in ifaces.values():
            if (info.get("hwaddr") or "").lower() != mac:
                continue
            for a in info.get("addrs") or []:
                if a.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4 and a.get("addr"):
                    return a["addr"]
        return ""

    def lease(self, vm: Vm) -> str:
        return self._interface_addresses(vm, "VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE")

    def libvirt_arp(self, vm: Vm) -> str:
        if self.host.driver == "bhyve":
            return ""  # libvirt's ARP reader is Linux netlink only
        return self._interface_addresses(vm, "VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_ARP")

    def network_leases(self, vm: Vm) -> str:
        if not self.host.network:
            return ""
        libvirt = libvirt_module()
        try:
            leases = self.connection.get().networkLookupByName(self.host.network).DHCPLeases(self.mac(vm), 0) or []
        except libvirt.libvirtError:
            return ""
        for lease in leases:
            if lease.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4 and lease.get("ipaddr"):
                return lease["ipaddr"]
        return ""

    def arp_argv(self) -> list[str]:
        """The host's neighbour table: `arp -an` on FreeBSD, `ip -4 neigh show` on Linux."""
        return self.shell.argv(["arp", "-an"] if self.host.driver == "bhyve" else ["ip", "-4", "neigh", "show"])

    def host_arp(self, vm: Vm) -> str:
        res = self.shell.run_argv(self.arp_argv(), timeout=30, check=False, what="arp table")
        return parse_arp(res.stdout, self.mac(vm)) if res.ok else ""

    def console(self, vm: Vm) -> str:
        return parse_console_address(self.console_text(vm))


def free_address(host: Host, taken: Iterable[str]) -> str:
    """The first address of the host's subnet from .10 up that is not the gateway, the client's,
    or in `taken` (the static addresses in other domains' leases)."""
    busy = {host.gateway, host.client_address, *taken}
    assert host.subnet is not None
    for i, addr in enumerate(host.subnet.hosts()):
        if i >= 9 and str(addr) not in busy:
            return str(addr)
    raise BackendError(f"no free address left in {host.subnet} on {host.name!r}", hint="`lab gc`, or a larger subnet")
