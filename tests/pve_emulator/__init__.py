"""A schema-driven Proxmox VE API emulator for contract tests of lab.backends.proxmox.

A real threaded HTTPS server on 127.0.0.1 (self-signed CA made with the openssl CLI) that validates
every request against the official PVE API schema (7.4, 8.4 or 9.1, loaded from ../shared/pve at
test time) and models tasks, locks and flocks, vmid races, auth, storages and uploads, nodes and the
guest agent. See server.py; qemu.py backs started VMs with real QEMU guests of the golden image.
"""

from .certs import CertSet, make_ca, make_certs
from .schema import Schema, validate
from .server import PveEmulator
from .state import PveError

__all__ = ["CertSet", "PveEmulator", "PveError", "Schema", "make_ca", "make_certs", "validate"]
