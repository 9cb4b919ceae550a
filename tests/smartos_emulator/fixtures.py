"""pytest fixtures for the SmartOS emulator. Import them into a test module:

from smartos_emulator.fixtures import smartos_net_fixture, smartos_fixture  # noqa: F401  (fixtures)
"""

from __future__ import annotations

import json
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


ZONE_IMAGE = "7b5981c4-1889-11e7-b4c5-3f3bdfc9b88b"  # the uuid imgadm shows for an imported lx image


def lab_toml(path: Path, host: dict, *, matrix: str, suite: str) -> Path:
    """lab.toml of one SmartOS host `sm` with these [matrix] and [suite] lines, results beside it."""
    path.write_text(
        "\n".join(
            [
                f'[lab]\nresults = "{path.parent / "results"}"',
                "[hosts.sm]",
                *(f"{k} = {toml_value(v)}" for k, v in host.items()),
                '[matrix]\nhost = ["sm"]',
                matrix,
                "[suite]",
                suite,
                "",
            ]
        )
    )
    return path


def toml_value(v) -> str:
    """A Python value as a TOML value (an inline table for a dict)."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)
