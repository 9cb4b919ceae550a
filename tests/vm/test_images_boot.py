"""The golden image booted for real (local backend, QEMU): every clone offers the host keys its
manifest records, OpenSSH refuses any other, and the image drives every NIC model and disk bus
lab.osfacts says Debian has a driver for. The five clones boot at once, in one run (one test each
reads its own): five single-vCPU TCG guests share the 2 cores, 77 s here against 84 s two at a
time and 118 s one by one."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import pytest
from support.local import local_run

from lab import images, proc
from lab.backends import local
from lab.guest import Guest
from lab.model import DiskBus, NicModel, VmSpec
from lab.osfacts import facts
from lab.runner import verify

pytestmark = [pytest.mark.vm, pytest.mark.image]

# Five boots cover every NIC model and every disk bus once.
BOOTS = [
    (NicModel.VIRTIO, DiskBus.VIRTIO),
    (NicModel.E1000, DiskBus.SCSI),
    (NicModel.E1000E, DiskBus.SATA),
    (NicModel.RTL8139, DiskBus.IDE),
    (NicModel.VMXNET3, DiskBus.NVME),
]

# The drivers of every device between the root disk and the PCI bus (virtio-scsi: virtio-pci,
# virtio_scsi, sd), read from sysfs in the guest.
DISK_DRIVERS = (
    'r=$(basename "$(findmnt -no SOURCE /)"); d=$(readlink -f "/sys/class/block/$r/..");'
    ' while [ "$d" != / ]; do [ -e "$d/driver" ] && basename "$(readlink "$d/driver")"; d=$(dirname "$d");'
    " done"
)


def strict_ssh(address: str, known_hosts: Path, netns: str | None, command: str) -> proc.Result:
    """One fresh connection that OpenSSH lets through only if the guest shows a key of known_hosts."""
    argv = [
        "ssh",
        "-i",
        str(local.lab_key()),
        "-o",
        "BatchMode=yes",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        "ControlPath=none",
        "-o",
        "ConnectTimeout=10",
        f"root@{address}",
        command,
    ]
    return proc.run(argv, timeout=60, check=False, netns=netns, what="ssh with the image's host keys")


@pytest.fixture(scope="module")
def booted(golden, module_workdir):
    """The five clones of BOOTS started together and ready: {(nic, bus): (address, vm, netns)}."""
    if "ssh_host_keys" not in golden.manifest:
        pytest.skip("images/debian12.json predates the host keys: `lab images build debian12 --force`")
    with local_run(module_workdir) as made:
        backend, run_id, client = made["backend"], made["run_id"], made["client"]
        vms = {}
        try:
            for i, (nic, bus) in enumerate(BOOTS, 1):
                spec = VmSpec(
                    name=f"lab-{run_id}-c0{i}",
                    run_id=run_id,
                    cell_id=f"c0{i}",
                    image=golden,
                    nic=nic,
                    vcpus=1,
                    memory_mib=768,
                    disk_bus=bus,
                    expires_at=time.time() + 900,
                )
                vms[nic, bus] = backend.clone(golden, spec)
                backend.start(vms[nic, bus])
            yield {k: (backend.wait_ready(vm), vm, client.netns) for k, vm in vms.items()}
        finally:
            for vm in vms.values():
                backend.destroy(vm)


@pytest.mark.xdist_group("boot")
@pytest.mark.parametrize("nic,bus", BOOTS, ids=[f"{n.value}-{b.value}" for n, b in BOOTS])
def test_clone_offers_the_image_host_keys_and_drives_the_osfacts_devices(golden, booted, tmp_path, nic, bus):
    address, vm, netns = booted[nic, bus]
    with Guest(address, key=local.lab_key(), netns=netns) as guest:
        guest.connect(timeout=60)
        observed = verify(guest, facts("debian"), vm.spec)  # raises unless the NIC driver is osfacts'
        assert observed["nic_driver"] == facts("debian").nic_driver[nic]
        drivers = guest.run("sh -c " + shlex.quote(DISK_DRIVERS)).stdout.split()
        assert facts("debian").disk_driver[bus] in drivers, drivers

    known = tmp_path / "known_hosts"
    known.write_text(images.known_hosts(golden, [address]))
    res = strict_ssh(address, known, netns, "cat /etc/ssh/ssh_host_ed25519_key.pub")
    assert res.returncode == 0, res.stderr
    key = next(k for k in images.host_keys(golden) if k["type"] == "ssh-ed25519")
    assert res.stdout.split()[:2] == ["ssh-ed25519", key["key"]]  # the clone still has the image's key

    # A machine at that address with any other key is refused.
    other = tmp_path / "other"
    proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", other], timeout=30)
    known.write_text(
        f"{address} {(tmp_path / 'other.pub').read_text().split()[0]} "
        f"{(tmp_path / 'other.pub').read_text().split()[1]}\n"
    )
    res = strict_ssh(address, known, netns, "true")
    assert res.returncode == 255 and "Host key verification failed" in res.stderr, res.stderr
