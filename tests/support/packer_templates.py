"""The Packer templates as the tests validate them offline: the images, each release's checksum file
in its project's format, a key, http and stage directories Packer can stat (make test's
tests/unit/test_images_os.py and test_images.py, make test-packer-modern's tests/vm/test_packer_modern.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import lab
from lab import images, proc

ISO_IMAGES = [r.name for r in images.ISO_RECIPES]


ALL_IMAGES = sorted(images.RECIPES)


# Each release's checksum file, in the format its project publishes (Packer parses it to find the
# ISO's line): GNU (hash, two spaces, name) or BSD (ALGO (name) = hash).
CHECKSUM_FORMAT = {
    "debian12": "gnu256",
    "alpine3": "gnu256",
    "freebsd14": "bsd256",
    "netbsd10": "bsd512",
    "openbsd7": "bsd256",
}


def template(name: str) -> Path:
    return lab.PACKER_DIR / images.recipe(name).packer_template


def defaults(name: str) -> dict[str, str]:
    return images.packer_defaults(template(name))


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """A key, an http dir and stage dirs Packer can stat, and a local copy of each release's
    checksum file (validate fetches `file:` checksums: offline it must be a local file)."""
    root = tmp_path_factory.mktemp("packer")
    key = root / "key"
    proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], timeout=30)
    (root / "http").mkdir()
    stage = root / "stage"
    (stage / "site").mkdir(parents=True)
    (stage / "nginx.conf").write_text("events {}\n")
    (stage / images.CONTAINER_TARBALL).write_bytes(b"")  # debian12 uploads the base container tarball
    sums = {}
    for name in ALL_IMAGES:
        iso = defaults(name)["iso_url"].rsplit("/", 1)[-1]
        fmt = CHECKSUM_FORMAT[name]
        line = {
            "gnu256": f"{'ab' * 32}  {iso}",
            "bsd256": f"SHA256 ({iso}) = {'ab' * 32}",
            "bsd512": f"SHA512 ({iso}) = {'ab' * 64}",
        }[fmt]
        sums[name] = root / f"{name}.sums"
        sums[name].write_text(f"{line.replace(iso, 'other-' + iso)}\n{line}\n")
    return {"root": root, "key": key, "stage": stage, "sums": sums}


def qemu_source_vars(name: str, fixtures: dict) -> dict:
    """The variables a `qemu.<name>` source validates with, from the `fixtures` fixture's files
    (test_images_os under Debian's Packer, test_packer_modern under Packer 1.12)."""
    return {
        "iso_checksum": f"file:{fixtures['sums'][name]}",
        "ssh_key": fixtures["key"],
        "http_dir": fixtures["root"] / "http",
        "stage_dir": fixtures["stage"],
    }


def fake_stage(tmp_path: Path) -> dict[str, str]:
    key = tmp_path / "key"
    proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], timeout=30)
    stage = tmp_path / "stage"
    (stage / "site").mkdir(parents=True)
    (stage / "nginx.conf").write_text("events {}\n")
    (stage / images.CONTAINER_TARBALL).write_bytes(b"")
    disk = tmp_path / "base.qcow2"
    disk.write_bytes(b"")
    for name in ("vmlinuz", "initrd.img"):
        (tmp_path / name).write_bytes(b"")
    return {
        "disk_in": str(disk),
        "output_dir": str(tmp_path / "out"),
        "kernel": str(tmp_path / "vmlinuz"),
        "initrd": str(tmp_path / "initrd.img"),
        "cmdline": images.DEBIAN12.cmdline,
        "ssh_key": str(key),
        "stage_dir": str(stage),
        "report_out": str(tmp_path / "report.json"),
        "console_log": str(tmp_path / "console.log"),
    }
