"""pytest fixtures for the SmartOS emulator. Import them into a test module:

from smartos_emulator.fixtures import smartos_net_fixture, smartos_fixture  # noqa: F401  (fixtures)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from .emulator import SmartosEmulator, gz_network
from .sshd import ensure_sshd


@pytest.fixture(name="smartos_workdir")
def smartos_workdir_fixture():
    """A short path (unix sockets: 108 bytes) only this test uses."""
    d = Path(tempfile.mkdtemp(prefix="sm", dir="/var/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def skip_unless_emulator_can_run() -> None:
    """The emulator needs root (a network namespace) and sshd (installed here if missing)."""
    if os.geteuid() != 0:
        pytest.skip("the SmartOS emulator needs root (a network namespace and sshd)")
    why = ensure_sshd()
    if why:
        pytest.skip(why)


@pytest.fixture(name="smartos_net")
def smartos_net_fixture():
    skip_unless_emulator_can_run()
    with gz_network() as net:
        yield net


@pytest.fixture(name="smartos")
def smartos_fixture(smartos_net, smartos_workdir):
    """An emulated SmartOS host whose guests are SSH-banner stubs (no VMs: the fast lane)."""
    with SmartosEmulator(smartos_workdir, smartos_net, backing="stub") as emu:
        yield emu
    assert not emu.gz.internal_errors, emu.gz.internal_errors
