"""Warm snapshots from the user's side, on the fake backend: `lab images ls --warm` lists each host's
with the image build it is of, and `lab gc` removes those whose build is gone (lab.gc)."""

from __future__ import annotations

import json
from pathlib import Path

import fakes.backend as fake
from click.testing import CliRunner

from lab import images
from lab.cli import cli


def test_images_ls_warm_and_gc(fake_lab, monkeypatch):
    built = images.ImageRef(
        name="debian12", os="debian", path=Path("/fake/debian12.qcow2"), digest="digest-debian12", sha256="f" * 64
    )
    monkeypatch.setattr(images, "list_images", lambda images_dir=None: [built])
    # the always-defined local host gets a workdir of the test's own: this machine's real warm
    # snapshots are neither listed nor (by the gc below) removed
    path = fake_lab.write(
        host='warm = { lab-warm-a = "' + "f" * 64 + '", lab-warm-b = "' + "0" * 64 + '" }\n',
        extra=f'[hosts.local]\nbackend = "local"\nworkdir = "{fake_lab.dir / "local"}"\n',
    )
    res = CliRunner().invoke(cli, ["images", "ls", "--warm", "--json", "-c", str(path)])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.output)
    # local is always defined and keeps snapshots too (issue 18); its workdir here has none
    assert shown["schema"] == "lab.images.warm/1" and shown["hosts"] == ["f", "local"]
    assert {(w["name"], w["current"], w["image"]) for w in shown["warm"]} == {
        ("lab-warm-a", True, f"debian12 ({'f' * 12})"),
        ("lab-warm-b", False, ""),
    }
    res = CliRunner().invoke(cli, ["images", "ls", "--warm", "-c", str(path)])
    assert res.exit_code == 0 and "stale: `lab gc` removes it" in res.output and "lab-warm-a" in res.output
    res = CliRunner().invoke(cli, ["gc", "-c", str(path)])
    assert res.exit_code == 0, res.output
    assert ("remove_warm", "lab-warm-b") in fake.JOURNAL and ("remove_warm", "lab-warm-a") not in fake.JOURNAL
