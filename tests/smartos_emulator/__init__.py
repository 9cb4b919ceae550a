"""An emulator of a SmartOS host's global zone for contract tests of lab.backends.smartos, reached
over real SSH: an OpenSSH sshd in a network namespace the test makes, whose root login runs the
emulated `vmadm`, `imgadm`, `sysinfo` (gz.py, vmadm.py, imgadm.py). Every vmadm payload is
validated against vmadm(8)'s documented properties (schema.py); bhyve- and KVM-brand VMs are backed
by real QEMU guests of the golden image (backing.py) or, in the fast lane, by SSH-banner stubs.
Faults: a failing `vmadm create` (optionally leaving a `failed` VM), VMs stuck in `stopping`, SSH
connections dropped before or after a command (gz.Faults)."""

from .emulator import GzNetwork, SmartosEmulator, gz_network
from .gz import Faults, GlobalZoneEmulator
from .schema import Host, Problems, validate_create

__all__ = [
    "Faults",
    "GlobalZoneEmulator",
    "GzNetwork",
    "Host",
    "Problems",
    "SmartosEmulator",
    "gz_network",
    "validate_create",
]
