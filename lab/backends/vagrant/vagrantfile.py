"""A Vagrantfile for one lab machine, rendered from templates/vagrant/Vagrantfile.j2: the same
file for a cell the vagrant backend runs and for a stored cell `lab reproduce` writes out. Pure:
nothing here runs Vagrant."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from lab import TEMPLATES_DIR, plaintext
from lab.backends.vagrant.settings import LIBVIRT_NICS
from lab.model import DiskBus, NicModel

TEMPLATE_DIR = TEMPLATES_DIR / "vagrant"

# disk bus -> (vagrant-libvirt disk_bus, the disk's target device, its controller model): libvirt
# refuses a `vda` on any bus but virtio; SCSI disks sit on a virtio-scsi controller
DISK = {
    DiskBus.VIRTIO: ("virtio", "vda", None),
    DiskBus.SCSI: ("scsi", "sda", "virtio-scsi"),
    DiskBus.SATA: ("sata", "sda", None),
    DiskBus.IDE: ("ide", "hda", None),
}


@dataclass(frozen=True)
class Network:
    """A libvirt network the machine's one NIC joins (vagrant-libvirt's management network)."""

    name: str
    address: str  # the network, e.g. "10.79.3.0/24"


@dataclass(frozen=True)
class Provisioner:
    name: str  # `vagrant provision --provision-with NAME`
    path: str  # the script, relative to the Vagrantfile's directory
    run: str  # "once" (at the first `vagrant up`) or "never" (only when named)
    comment: str


@dataclass(frozen=True)
class Machine:
    name: str  # the Vagrant machine and the libvirt domain
    image: str  # the golden image's name ("debian12")
    box: str
    box_version: str
    cpus: int
    memory_mib: int
    nic: NicModel
    disk_bus: DiskBus
    ssh_key: Path
    purpose: str  # the file's first comment line
    driver: str = "qemu"  # libvirt domain type: qemu (TCG) or kvm
    uri: str | None = None  # None: vagrant-libvirt's default (qemu:///system, or LIBVIRT_DEFAULT_URI)
    title: str = ""
    description: str = ""  # the domain's <description>: the vagrant backend's lease marker
    boot_timeout: int = 600
    storage_pool: str | None = None
    network: Network | None = None
    console_log: Path | None = None  # the serial console to a file
    provisioners: tuple[Provisioner, ...] = ()
    notes: tuple[str, ...] = field(default=())  # more comment lines at the top


def comment(value: object) -> str:
    """`value` as the rest of a Ruby comment line: one line, no control characters (a line break
    in a label read from a results store would otherwise end the comment and start Ruby code)."""
    return plaintext.one_line(value)


def ruby_string(value: object) -> str:
    """A Ruby double-quoted string literal of `value` (no interpolation can sneak in)."""
    text = str(value)
    for raw, escaped in (("\\", "\\\\"), ('"', '\\"'), ("#", "\\#"), ("\n", "\\n")):
        text = text.replace(raw, escaped)
    return f'"{text}"'


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["rb"] = ruby_string
    env.filters["comment"] = comment
    return env


def render(machine: Machine) -> str:
    bus, device, controller = DISK[machine.disk_bus]
    context = {
        "m": {
            **machine.__dict__,
            "nic_model": LIBVIRT_NICS[machine.nic],
            "disk_bus": bus,
            "disk_device": device,
            "disk_controller_model": controller,
        }
    }
    return _environment().get_template("Vagrantfile.j2").render(context)
