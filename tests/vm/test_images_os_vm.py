"""Image recipes that need root or the built image: the answers and stage rendered with mmdebstrap
--mode=root, and lab images publish into the local workdir."""

from __future__ import annotations

import pytest
from support.cli import run_lab_cli

import lab
from lab import images


def test_render_writes_answers_and_stage(tmp_path):
    res = run_lab_cli("images", "render", "netbsd10", str(tmp_path / "out"), timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out/http/install.sh").is_file()
    assert (tmp_path / "out/stage/lab-facts.sh").is_file() and (tmp_path / "out/stage/lab-site").is_dir()
    assert "-only=proxmox-iso.netbsd10" in res.stdout
    assert f"packer init {lab.PACKER_DIR / 'plugins.pkr.hcl'}" in res.stdout  # before the build line
    res = run_lab_cli("images", "render", "debian12", str(tmp_path / "deb"), timeout=120)
    assert res.returncode == 0 and (tmp_path / "deb/http/preseed.cfg").is_file()
    assert (tmp_path / "deb/stage/nginx.conf").is_file()
    assert (tmp_path / f"deb/stage/{images.CONTAINER_TARBALL}").stat().st_size > 1_000_000  # podman import's input


@pytest.mark.image  # make test runs it once the image is built (its fast lane runs beside the build)
def test_publish_cli_puts_the_built_image_in_the_local_workdir(tmp_path):
    if not (lab.IMAGES_DIR / "debian12.json").is_file():
        pytest.skip("images/debian12.json is absent: run `make images` first")
    cfg = tmp_path / "lab.toml"
    cfg.write_text('[lab]\nname = "p"\n\n[hosts.local]\nbackend = "local"\nworkdir = "%s"\n' % (tmp_path / "w"))
    res = run_lab_cli("images", "publish", "debian12", "local", "-c", str(cfg), timeout=120)
    assert res.returncode == 0, res.stderr
    ref = images.load("debian12")
    published = tmp_path / "w" / "images" / "debian12" / ref.sha256[:12]
    assert str(published) in res.stdout.replace("\n", "")
    assert (published / "debian12.qcow2").stat().st_size == ref.path.stat().st_size
    assert (published / "debian12" / "vmlinuz").is_file()
