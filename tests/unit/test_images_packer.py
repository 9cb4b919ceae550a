"""lab.images.packer's parsers on real captured outputs (tests/data/packer/), and what it does with
the Packer this machine has (Debian's 1.6.6: builders built in, nothing to install). The modern
Packer's side runs for real in tests/vm/test_packer_modern.py (make test-packer-modern)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import lab
from lab.images import packer

DATA = Path(__file__).parents[1] / "data" / "packer"
SOURCES = ["github.com/hashicorp/qemu", "github.com/hashicorp/proxmox", "github.com/hashicorp/vagrant"]


def test_version_of_debian_and_modern_packer():
    assert packer.parse_version((DATA / "version-1.6.6.txt").read_text()) == (1, 6, 6)
    assert packer.parse_version((DATA / "version-1.12.0.txt").read_text()) == (1, 12, 0)
    # a checkpoint notice after the version line changes nothing; no version line is no version
    assert packer.parse_version("Packer v1.11.2\n\nYour version of Packer is out of date!\n") == (1, 11, 2)
    assert packer.parse_version("Usage: packer [--version]") is None


def test_required_plugins_are_the_plugins_files_sources():
    assert packer.required_plugins((lab.PACKER_DIR / packer.PLUGINS_FILE).read_text()) == SOURCES


def test_installed_plugins_from_packer_plugins_installed():
    listing = (DATA / "plugins-installed-1.12.0.txt").read_text()
    assert packer.installed_plugins(listing) == set(SOURCES)
    assert packer.installed_plugins("\n".join(listing.splitlines()[1:])) == set(SOURCES) - {SOURCES[1]}
    assert packer.installed_plugins("") == set()
    # a binary outside the plugin's own directory is not an installed plugin
    assert packer.installed_plugins("/tmp/packer-plugin-qemu_v1.1.4_x5.0_linux_amd64") == set()


def test_init_failure_is_the_reason_in_a_few_words():
    text = (DATA / "init-offline-1.12.0.txt").read_text()
    assert packer.init_failure(text) == (
        "api.github.com: proxyconnect tcp: dial tcp 127.0.0.1:9: connect: connection refused"
    )
    assert packer.init_failure("Error: something else\n") == "Error: something else"


@pytest.mark.skipif(shutil.which("packer") is None, reason="packer is not installed (make setup)")
def test_debian_packer_has_its_builders_built_in():
    v = packer.version()
    if v >= packer.REQUIRED_PLUGINS_SINCE:
        pytest.skip(f"the packer on PATH is {v}, not Debian's 1.6.6")
    said: list[str] = []
    assert packer.ensure_plugins(said.append) == v
    assert said == [] and packer.missing_plugins(v) == []
    assert packer.plugins_state() == f"Packer {'.'.join(map(str, v))}: builders built in"
