"""The DHCP-lease link of the address chain on a real libvirt network (qemu:///system): libvirt
starts dnsmasq for an isolated network the test defines; a DHCP client with the VM's MAC asks it
for a lease; the backend must find that address by MAC in `network.DHCPLeases()` — the source a
bhyve host with a libvirt network offers on every libvirt version (interfaceAddresses only from
12.3). No VM boots: the client is udhcpc in a network namespace of its own on a veth whose peer
is enslaved to the network's bridge. Everything is the test's own and is removed afterwards.
"""

from __future__ import annotations

import secrets
import shutil
import time
from pathlib import Path

import pytest
from support import subnets
from support.libvirt_daemons import URI as LIBVIRT_URI

from lab import proc
from lab.model import DiskBus, ImageRef, NicModel, Vm, VmSpec
from lab.wait import wait_until

libvirt = pytest.importorskip("libvirt")

from lab.backends.libvirt.backend import LibvirtBackend  # noqa: E402
from lab.backends.libvirt.domain import mac_for  # noqa: E402
from lab.backends.libvirt.settings import Settings  # noqa: E402

# No VM boots, but the system's libvirtd does (root): marked vm so the fast lane, which other runs
# share the machine with, never starts or stops the daemon under a VM test.
pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]


@pytest.fixture
def lab_network(libvirtd):
    for tool in ("dnsmasq", "udhcpc"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed (make setup)")
    n = subnets.free("10.79")
    if n is None:
        pytest.skip("no free 10.79.x.0/24 subnet")
    tag = secrets.token_hex(3)
    name, bridge = f"labnet{tag}", f"labdbr{tag}"
    conn = libvirt.open(LIBVIRT_URI)
    # isolated: no <forward>, so no NAT and no route out; DHCP only
    net = conn.networkCreateXML(
        f"<network><name>{name}</name><bridge name='{bridge}'/>"
        f"<ip address='10.79.{n}.1' netmask='255.255.255.0'>"
        f"<dhcp><range start='10.79.{n}.100' end='10.79.{n}.150'/></dhcp></ip></network>"
    )
    try:
        yield name, bridge, n
    finally:
        try:
            net.destroy()  # transient: gone with its dnsmasq and lease file
        finally:
            conn.close()


@pytest.fixture
def dhcp_client(lab_network):
    """A DHCP client on the network with a given MAC: veth pair, one end on the bridge, the other
    in a namespace of its own."""
    name, bridge, n = lab_network
    tag = secrets.token_hex(3)
    ns, host_end, ns_end = f"labdhcp{tag}", f"lvd{tag}a", f"lvd{tag}b"
    proc.run(["ip", "netns", "add", ns], timeout=10)
    try:
        proc.run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end], timeout=10)
        proc.run(["ip", "link", "set", host_end, "master", bridge, "up"], timeout=10)
        proc.run(["ip", "link", "set", ns_end, "netns", ns], timeout=10)

        def lease(mac: str) -> proc.Result:
            proc.run(["ip", "-n", ns, "link", "set", ns_end, "address", mac, "up"], timeout=10)
            # -n: give up without a lease, -q: exit once bound, -s /bin/true: change nothing here
            return proc.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "udhcpc",
                    "-i",
                    ns_end,
                    "-n",
                    "-q",
                    "-f",
                    "-t",
                    "10",
                    "-T",
                    "1",
                    "-s",
                    "/bin/true",
                ],
                timeout=60,
                what="udhcpc",
            )

        yield lease, n
    finally:
        proc.run(["ip", "link", "del", host_end], timeout=10, check=False)
        proc.run(["ip", "netns", "del", ns], timeout=10, check=False)


def test_address_from_the_networks_dhcp_leases(lab_network, dhcp_client):
    name, _, _ = lab_network
    lease, n = dhcp_client
    vm_name = f"lab-dhcp{secrets.token_hex(3)}-c1"
    mac = mac_for(vm_name)
    image = ImageRef(name="debian12", os="debian", path=Path("/nonexistent.qcow2"), digest="d")
    vm = Vm(
        spec=VmSpec(
            name=vm_name,
            run_id="dhcp",
            cell_id="c1",
            image=image,
            nic=NicModel.VIRTIO,
            vcpus=1,
            memory_mib=256,
            disk_bus=DiskBus.VIRTIO,
        ),
        backend="libvirt",
        handle={"mac": mac},
    )
    backend = LibvirtBackend("kvm", Settings(backend="libvirt", uri=LIBVIRT_URI, network=name))
    backend.check()
    assert backend.addresses.find(vm) == ""  # no lease yet: the chain answers nothing rather than guess

    res = lease(mac)
    assert f"10.79.{n}." in res.stdout + res.stderr, res.stdout + res.stderr
    t0 = time.monotonic()
    # dnsmasq hands the lease to libvirt's lease helper just after its ACK: a moment, bounded
    # (meanwhile the host's ARP table may know the address already: the next link of the chain)
    addr = wait_until(lambda: backend.addresses.network_leases(vm), timeout=15, what=f"a lease for {mac} in libvirt")
    print(f"\nlease for {mac}: {addr} ({time.monotonic() - t0:.3f} s until libvirt had it)")
    assert addr.startswith(f"10.79.{n}.") and 100 <= int(addr.rsplit(".", 1)[1]) <= 150
    assert backend.addresses.find(vm) == addr and vm.facts["address_source"] == "dhcp-leases"  # before ARP

    # another MAC on the same network gets another lease; each VM finds only its own
    other = Vm(spec=vm.spec, backend="libvirt", handle={"mac": "52:54:00:fe:dc:ba"})
    assert backend.addresses.network_leases(other) == ""
    lease("52:54:00:fe:dc:ba")
    other_addr = wait_until(lambda: backend.addresses.network_leases(other), timeout=15, what="the second lease")
    assert other_addr != addr
    assert backend.addresses.network_leases(vm) == addr
    backend.connection.close()
