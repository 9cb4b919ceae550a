"""pytest fixtures for the PVE emulator. Import them into a test module:

from pve_emulator.fixtures import pve_certs_fixture, pve_env_fixture, pve_fixture  # noqa: F401  (fixtures)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from pathlib import Path

import pytest

from lab.backends import BackendEnv, default_env
from lab.model import ImageRef

from .certs import CertSet, make_certs
from .server import PveEmulator

TOKEN_ID = "lab@pve!lab"
TOKEN_SECRET = "5ec2e75e-c2e7-4b00-9e11-d0n07l0g1t00"
VM_PRIVS = {
    "VM.Audit",
    "VM.Clone",
    "VM.Allocate",
    "VM.PowerMgmt",
    "VM.Config.Network",
    "VM.Config.CPU",
    "VM.Config.Memory",
    "VM.Config.Cloudinit",
    "VM.Config.Options",
    "VM.Config.Disk",
    "VM.Config.HWType",
    "VM.Monitor",
    "VM.GuestAgent.Audit",
}
FULL_ACL = {
    "/vms": VM_PRIVS,
    "/storage": {"Datastore.AllocateSpace", "Datastore.Audit", "Datastore.AllocateTemplate", "Datastore.Allocate"},
    "/nodes": {"Sys.Audit"},
    "/sdn/zones": {"SDN.Use"},
}
TEMPLATE_VMID = 9000
IMAGE_DIGEST = "d1"  # the recipe digest of the tests' image
TEST_IMAGE = ImageRef(name="debian12", os="debian", path=Path("debian12"), digest=IMAGE_DIGEST)
# a backend's timeouts in a fault test: short, so a fault that is not handled fails fast
FAST_TIMEOUTS = {
    "http": 2,
    "retry": 3,
    "clone": 20,
    "config": 10,
    "start": 10,
    "stop": 10,
    "destroy": 10,
    "ready": 10,
    "agent": 0.6,
}


def lab_template_description(
    image: str = "debian12", digest: str = IMAGE_DIGEST, sha256: str = "", published: int = 1_700_000_000
) -> str:
    """A template description as `lab images publish` writes it (the format is the contract: the
    backend clones only templates that carry it)."""
    return "\n".join(
        [
            "lab-marker: lab/template",
            f"lab-image: {image}",
            f"lab-image-digest: {digest}",
            f"lab-image-sha256: {sha256 or digest}",
            f"lab-published: {published}",
            "published by `lab images publish`",
        ]
    )


@pytest.fixture(scope="session", name="pve_certs")
def pve_certs_fixture(tmp_path_factory) -> CertSet:
    return make_certs(Path(tmp_path_factory.mktemp("pve-tls")))


@pytest.fixture(name="pve_env")
def pve_env_fixture(tmp_path) -> BackendEnv:
    """The environment of a Proxmox backend in a test: its run and address locks (state_dir) in the
    test's own directory, not in /var/tmp/lab (parallel tests use the same run ids and host names)."""
    return dataclasses.replace(default_env(), state_dir=tmp_path)


@pytest.fixture(name="pve")
def pve_fixture(request, pve_certs):
    """A running emulator (default schema 8.4; parametrize indirectly with "7.4"/"8.4"/"9.1")
    with template 9000 `debian12` and the token lab@pve!lab holding FULL_ACL. Fast timings."""
    version = getattr(request, "param", "8.4")
    before = set(threading.enumerate())
    emu = PveEmulator(version, pve_certs, auth_delay=0.05)
    emu.task_seconds.update({"qmclone": 0.15, "qmstart": 0.08, "qmstop": 0.05, "qmdestroy": 0.08, "qmconfig": 0.03})
    emu.full_clone_seconds = 0.25
    emu.agent_delay, emu.dhcp_delay = 0.1, 0.05
    emu.add_template(TEMPLATE_VMID, "debian12", description=lab_template_description())
    emu.add_token(TOKEN_ID, TOKEN_SECRET, privsep=True, acl=FULL_ACL)
    with emu:
        yield emu
    leaked = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not leaked, f"emulator left threads behind: {leaked}"


def backend_settings(emu: PveEmulator, **over):
    """The typed settings of a Proxmox host on the emulator. Secrets become references, as lab.toml
    demands: a literal token or password is put in an environment variable of its own."""
    from lab.backends.proxmox.settings import Settings

    table = {k: v for k, v in backend_table(emu, **over).items() if v is not None and k != "source"}
    for key in ("token", "password"):
        value = table.get(key)
        if value and not str(value).startswith(("env:", "file:")):
            var = f"LAB_TEST_PVE_{key.upper()}_{hashlib.sha256(str(value).encode()).hexdigest()[:12]}"
            os.environ[var] = str(value)
            table[key] = f"env:{var}"
    return Settings.model_validate({"backend": "proxmox", **table})


def backend_table(emu: PveEmulator, **over) -> dict:
    settings = {
        "url": emu.url,
        "node": "pve1",
        "storage": "local-lvm",
        "bridge": "vmbr0",
        "token": f"{TOKEN_ID}={TOKEN_SECRET}",
        "verify_tls": True,
        "ca_file": str(emu.certs.ca_file),
        "template": TEMPLATE_VMID,
        "concurrency": 2,
        "ssh_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFake+key/with=chars lab@test"],
        "gateway": "10.0.0.1",
        "poll_interval": 0.02,
        "poll_max": 0.1,
        "retry_backoff": 0.05,
        "timeouts": {
            "http": 10,
            "clone": 20,
            "config": 10,
            "start": 10,
            "stop": 10,
            "destroy": 10,
            "ready": 10,
            "agent": 0.6,
        },
    }
    settings.update(over)
    return settings


def fast_backend(emu: PveEmulator, env: BackendEnv, **over):
    """A Proxmox backend "pve1" on the emulator with FAST_TIMEOUTS (`timeouts` in `over` merged in)."""
    from lab.backends.proxmox import ProxmoxBackend

    over["timeouts"] = {**FAST_TIMEOUTS, **over.get("timeouts", {})}
    return ProxmoxBackend("pve1", backend_settings(emu, **over), env)


def in_threads(fn, count: int, timeout: float = 60) -> tuple[list, list[Exception]]:
    """fn(0) ... fn(count - 1) at once, one thread each: (their results, their exceptions)."""
    results, errors = [], []

    def one(i):
        try:
            results.append(fn(i))
        except Exception as exc:  # reported to the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results, errors
