"""`build`, the one way to build an image: skip an image that is up to date, else take the build lock and run
its pipeline (lab.images.debian or lab.images.installer)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import lab
from lab.errors import LabError, UsageError
from lab.images import packer
from lab.images.debian import build_debian
from lab.images.digest import recipe_digest
from lab.images.installer import build_iso
from lab.images.manifest import resolve_dir, up_to_date
from lab.images.recipes import IsoRecipe, recipe
from lab.images.sources import resolve_iso
from lab.model import ImageRef

Progress = Callable[[str], None] | None  # hears each stage of a build as it starts


def build(
    name: str = "debian12",
    force: bool = False,
    progress: Progress = None,
    images_dir: Path | None = None,
    iso: str | None = None,
    iso_checksum: str | None = None,
) -> ImageRef:
    """Build image `name` unless it is up to date; return it. `progress(stage)` hears each stage.
    `iso`/`iso_checksum` (ISO-installed images only) name a local copy of the installer ISO."""
    r = recipe(name)
    say = progress or (lambda _msg: None)
    idir = resolve_dir(images_dir)
    digest = recipe_digest(name)
    if r.kind == "debootstrap" and (iso or iso_checksum):
        raise UsageError(f"image {name!r} is built from Debian packages, not from an ISO: drop --iso")
    if not force:
        ref = up_to_date(name, idir, digest)
        if ref is not None:
            say(f"up to date ({digest[:12]})")
            return ref
    if r.kind == "debootstrap" and os.geteuid() != 0:
        raise LabError(
            "building a golden image needs root (mmdebstrap --mode=root, chroot)", hint=f"run `sudo {lab.BUILD_IMAGE}`"
        )
    packer.ensure_plugins(say)  # a modern Packer's plugins, before anything is made
    source = resolve_iso(r, idir, iso, iso_checksum) if isinstance(r, IsoRecipe) else None
    work = lab.BUILD_DIR / name
    work.parent.mkdir(parents=True, exist_ok=True)
    lock = open(work.parent / f"{name}.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise LabError(f"another build of {name!r} is running (lock {lock.name})") from None
    try:
        if isinstance(r, IsoRecipe):
            assert source is not None  # resolved above for every ISO recipe
            return build_iso(r, work, idir, digest, say, source)
        return build_debian(r, name, work, idir, digest, say)
    finally:
        lock.close()
