"""The package as a person installs it: the wheel built from this checkout, installed by pipx into a
fresh virtual environment, runs `lab --version`, `lab plan`, `lab images render debian12` and `lab
doctor` from a directory outside the checkout, finding its templates and Packer templates inside the
installed package and its images where $LAB_IMAGES_DIR says.

Nothing is downloaded but, once per checkout, the wheels of the dependencies (build/wheelhouse/,
from the package index, at the versions this checkout's venv runs); the wheel is built without
build isolation and pipx installs from that wheelhouse with --no-index.

Marked `image`: `lab images render debian12` stages the built image's base container tarball (the
checkout's images/ and build/, through $LAB_IMAGES_DIR and $LAB_BUILD_DIR); without a built image,
root's render would make one with mmdebstrap (minutes, and the Debian mirror). About a minute:
most of it pipx unpacking numpy, scipy and matplotlib.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lab
from lab import images, proc

pytestmark = [
    pytest.mark.image,
    pytest.mark.skipif(shutil.which("pipx") is None, reason="pipx is not installed (make setup)"),
]

WHEELHOUSE = lab.PROJECT_ROOT / "build" / "wheelhouse"
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def build_wheel(out: Path, scratch: Path) -> Path:
    """The wheel of the checkout's files as git sees them (tracked, or new and not ignored), built in a
    copy: setuptools' build/lib of an earlier build in the checkout would slip stale files in."""
    src = scratch / "src"
    listed = proc.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=lab.PROJECT_ROOT, timeout=60).stdout
    for rel in filter(None, listed.split("\0")):
        origin = lab.PROJECT_ROOT / rel
        if not origin.is_symlink() and not origin.is_file():
            continue  # deleted in the work tree, not yet in git
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(origin, src / rel, follow_symlinks=False)  # lab/templates, lab/packer stay links
    proc.run([*PIP, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, src], timeout=300)
    (wheel,) = out.glob("vmlab-*.whl")
    return wheel


def fill_wheelhouse(wheel: Path, scratch: Path) -> None:
    """The wheels of `wheel`'s dependencies in WHEELHOUSE: offline when it has them all, else from the
    package index at the versions this venv runs (its pip freeze as constraints)."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    offline = [*PIP, "download", "-q", "--no-index", "--find-links", WHEELHOUSE, "--dest", WHEELHOUSE, wheel, "pip"]
    if not proc.run(offline, timeout=300, check=False).ok:
        constraints = scratch / "constraints.txt"
        constraints.write_text(proc.run([*PIP, "freeze", "--exclude-editable"], timeout=60).stdout)
        proc.run([*PIP, "download", "-q", "-c", constraints, "--dest", WHEELHOUSE, wheel, "pip"], timeout=1200)
    for copied in WHEELHOUSE.glob("vmlab-*.whl"):  # pip download copies the wheel itself too
        copied.unlink()


def test_wheel_installs_with_pipx_and_runs_from_any_directory(tmp_path):
    if images.up_to_date("debian12") is None:
        pytest.skip("the debian12 image is not built or not current: run `make images`")
    wheel = build_wheel(tmp_path / "dist", tmp_path)
    fill_wheelhouse(wheel, tmp_path)
    pipx = tmp_path / "pipx"
    # A clean environment: no PYTHONPATH or venv of this checkout; pip offline, from the wheelhouse.
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(tmp_path / "home"),
        "PIPX_HOME": str(pipx / "home"),
        "PIPX_BIN_DIR": str(pipx / "bin"),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(WHEELHOUSE),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "LAB_STATE_DIR": str(tmp_path / "state"),
    }
    res = subprocess.run(["pipx", "install", wheel], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    lab_cmd = pipx / "bin" / "lab"
    site = next((pipx / "home" / "venvs" / "vmlab" / "lib").glob("python3*/site-packages"))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert not elsewhere.resolve().is_relative_to(lab.PROJECT_ROOT)

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [lab_cmd, *args], cwd=elsewhere, env=env | extra, capture_output=True, text=True, timeout=300
        )

    res = run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"lab, version {lab.__version__}", res.stdout + res.stderr

    # lab plan of the lab a person writes (here the checkout's default lab.toml, copied)
    shutil.copy(lab.PROJECT_ROOT / "lab.toml", elsewhere / "lab.toml")
    res = run("plan")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "estimated time:" in res.stdout and "virtio" in res.stdout

    # render: the package's own templates, the checkout's built image (the only copy of the files
    # the digest covers in the installed package: the digests match only if every file shipped)
    paths = {"LAB_IMAGES_DIR": str(lab.PROJECT_ROOT / "images"), "LAB_BUILD_DIR": str(lab.PROJECT_ROOT / "build")}
    res = run("images", "render", "debian12", "out", **paths)
    assert res.returncode == 0, res.stdout + res.stderr
    out = " ".join(res.stdout.split())  # rich wraps long lines
    assert f"-var recipe_digest={images.recipe_digest('debian12')}" in out
    assert f"packer init {site / 'lab' / 'packer' / 'plugins.pkr.hcl'}" in out
    assert f"{site / 'lab' / 'packer' / 'debian12.pkr.hcl'}" in out
    for rendered in ("http/preseed.cfg", "stage/nginx.conf", "stage/site/index.html", "stage/lab-base.tar.zst"):
        assert (elsewhere / "out" / rendered).is_file(), rendered
    assert "lab-debian12" in (elsewhere / "out" / "http" / "preseed.cfg").read_text()

    res = run("doctor", "--json", **paths)
    assert res.returncode == 0, res.stdout + res.stderr
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["files"]["status"] == "ok"
    assert checks["files"]["detail"] == f"templates {site / 'lab' / 'templates'}, packer {site / 'lab' / 'packer'}"
    assert checks["images"]["status"] == "ok"
    assert checks["images"]["detail"].endswith(f" in {lab.PROJECT_ROOT / 'images'}")
    assert "debian12" in checks["images"]["detail"]

    # without $LAB_IMAGES_DIR an installed package keeps its images outside site-packages
    res = run("doctor", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    detail = {c["name"]: c for c in json.loads(res.stdout)["checks"]}["images"]["detail"]
    default = "/var/lib/lab/images" if os.geteuid() == 0 else str(tmp_path / "home" / ".local/share/lab/images")
    assert f" in {default}" in detail, detail
