"""pytest fixtures for the PVE emulator. Import them into a test module:

    from pve_emulator.fixtures import pve_certs_fixture, pve_fixture  # noqa: F401  (fixtures)
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from .certs import CertSet, make_certs
from .server import PveEmulator

TOKEN_ID = "lab@pve!lab"
TOKEN_SECRET = "5ec2e75e-c2e7-4b00-9e11-d0n07l0g1t00"
VM_PRIVS = {"VM.Audit", "VM.Clone", "VM.Allocate", "VM.PowerMgmt", "VM.Config.Network",
            "VM.Config.CPU", "VM.Config.Memory", "VM.Config.Cloudinit", "VM.Config.Options",
            "VM.Config.Disk", "VM.Config.HWType", "VM.Monitor", "VM.GuestAgent.Audit"}
FULL_ACL = {"/vms": VM_PRIVS, "/storage": {"Datastore.AllocateSpace", "Datastore.Audit",
                                           "Datastore.AllocateTemplate", "Datastore.Allocate"},
            "/nodes": {"Sys.Audit"}}
TEMPLATE_VMID = 9000


@pytest.fixture(scope="session", name="pve_certs")
def pve_certs_fixture(tmp_path_factory) -> CertSet:
    return make_certs(Path(tmp_path_factory.mktemp("pve-tls")))


@pytest.fixture(name="pve")
def pve_fixture(request, pve_certs):
    """A running emulator (default schema 8.4; parametrize indirectly with "7.4"/"8.4"/"9.1")
    with template 9000 `debian12` and the token lab@pve!lab holding FULL_ACL. Fast timings."""
    version = getattr(request, "param", "8.4")
    before = set(threading.enumerate())
    emu = PveEmulator(version, pve_certs, auth_delay=0.05)
    emu.task_seconds.update({"qmclone": 0.15, "qmstart": 0.08, "qmstop": 0.05, "qmdestroy": 0.08,
                             "qmconfig": 0.03})
    emu.full_clone_seconds = 0.25
    emu.agent_delay, emu.dhcp_delay = 0.1, 0.05
    emu.add_template(TEMPLATE_VMID, "debian12")
    emu.add_token(TOKEN_ID, TOKEN_SECRET, privsep=True, acl=FULL_ACL)
    with emu:
        yield emu
    leaked = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not leaked, f"emulator left threads behind: {leaked}"


def backend_settings(emu: PveEmulator, **over) -> dict:
    settings = {"url": emu.url, "node": "pve1", "storage": "local-lvm", "bridge": "vmbr0",
                "token": f"{TOKEN_ID}={TOKEN_SECRET}", "verify_tls": True,
                "ca_file": str(emu.certs.ca_file), "template": TEMPLATE_VMID, "concurrency": 2,
                "ssh_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFake+key/with=chars lab@test"],
                "gateway": "10.0.0.1", "poll_interval": 0.02, "poll_max": 0.1, "retry_backoff": 0.05,
                "timeouts": {"http": 10, "clone": 20, "config": 10, "start": 10, "stop": 10,
                             "destroy": 10, "ready": 10, "agent": 0.6}}
    settings.update(over)
    return settings
