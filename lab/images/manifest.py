"""Built images on disk: where their files go, the manifest (images/<name>.json) that describes them,
loading one as an ImageRef, how it boots, whether it is up to date, and the state of every image."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import lab
from lab.errors import LabError, UsageError
from lab.images.digest import recipe_digest
from lab.images.keys import KEY_NAME, key_fingerprint
from lab.images.recipes import DEBIAN12, RECIPES, recipe
from lab.model import ImageRef


def resolve_dir(images_dir: Path | None) -> Path:
    """`images_dir`, or the project's images/ when None (read at call time: tests point it elsewhere)."""
    return Path(images_dir or lab.IMAGES_DIR)


def manifest_path(name: str, images_dir: Path | None = None) -> Path:
    return resolve_dir(images_dir) / f"{name}.json"


def write_manifest(mpath: Path, manifest: dict[str, Any]) -> None:
    """Replace the manifest at once: a reader sees the old one or the new one, never half of one."""
    tmp = mpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, mpath)


def nginx_entry(nginx: dict[str, Any], guest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's nginx entry: the recipe's settings and what the guest's version report says
    about the certificate, the bulk files and the site."""
    return {
        "root": nginx["root"],
        "ports": [80, 443],
        "certificate": nginx["ssl_certificate"],
        "certificate_sha256": guest.get("nginx_cert_sha256", ""),
        "bulk": ["/bulk/1m.bin", "/bulk/64m.bin"],
        "bulk_sha256": guest.get("bulk_sha256", {}),
        "site_files": guest.get("site_files"),
    }


def _not_built(name: str) -> UsageError:
    how = lab.BUILD_IMAGE if name == "debian12" else f"lab images build {name}"
    return UsageError(f"image {name!r} is not built: run `{how}`")


def load(name: str, images_dir: Path | None = None) -> ImageRef:
    """The built image `name`, as its manifest describes it."""
    recipe(name)  # unknown names fail first, listing the known ones
    idir = resolve_dir(images_dir)
    mpath = manifest_path(name, idir)
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise _not_built(name) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LabError(
            f"{mpath} is not valid JSON: {exc}", hint=f"rebuild it: run `lab images build {name} --force`"
        ) from None
    try:
        disk = idir / manifest["paths"]["disk"]
        ref = ImageRef(
            name=manifest["name"],
            os=manifest["os"],
            path=disk,
            digest=manifest["recipe_digest"],
            sha256=manifest["sha256"],
            manifest=manifest,
        )
    except (KeyError, TypeError) as exc:
        raise LabError(f"{mpath} lacks {exc}", hint=f"rebuild it: run `lab images build {name} --force`") from None
    if not disk.is_file():
        raise _not_built(name)
    return ref


BOOT_WAYS = {
    "kernel": "direct kernel boot",
    "bios": "BIOS firmware (SeaBIOS)",
    "uefi": "UEFI firmware",
    "disk": "firmware from its disk",
}


def boot_modes(manifest: dict[str, Any]) -> set[str] | None:
    """How an image can boot, from its manifest: a subset of BOOT_MODES, with "disk" for the
    ISO-installed images (firmware boot of their own installer's kind). None: not recorded."""
    boot = manifest.get("boot")
    if isinstance(boot, list):
        return {str(b) for b in boot}
    if isinstance(boot, str):
        return {boot}
    if isinstance(manifest.get("paths"), dict) and "kernel" in manifest["paths"]:
        return {"kernel"}  # a debian12 built before recipe version 2: a bare filesystem, no bootloader
    return None


def require_boot(image: ImageRef, mode: str, who: str) -> None:
    """Refuse (UsageError, before anything is created) an image that cannot boot the way `who`
    boots it: `mode` is "kernel", "bios" or "uefi"."""
    modes = boot_modes(image.manifest or {})
    if modes is None or mode in modes or (mode != "kernel" and "disk" in modes):
        return
    how = ", ".join(BOOT_WAYS.get(m, m) for m in sorted(modes)) or "nothing"
    hint = (
        f"rebuild it: `lab images build {image.name} --force`"
        if recipe(image.name).kind == "debootstrap"
        else "run it on a libvirt or proxmox host"
    )
    raise UsageError(f"image {image.name!r} cannot boot by {BOOT_WAYS[mode]} ({who}); it boots by {how}", hint=hint)


def list_images(images_dir: Path | None = None) -> list[ImageRef]:
    """Every known image that is built (has a manifest and its disk)."""
    out = []
    for name in sorted(RECIPES):
        try:
            out.append(load(name, images_dir))
        except UsageError:
            continue
    return out


def artifact_paths(name: str, images_dir: Path | None = None) -> dict[str, Path]:
    idir = resolve_dir(images_dir)
    paths = {"disk": idir / f"{name}.qcow2"}
    if RECIPES.get(name, DEBIAN12).kind == "debootstrap":  # direct kernel boot; ISO images boot from disk
        paths |= {"kernel": idir / name / "vmlinuz", "initrd": idir / name / "initrd.img"}
    return paths | {"ssh_key": idir / KEY_NAME, "ssh_pubkey": idir / f"{KEY_NAME}.pub"}


def up_to_date(name: str, images_dir: Path | None = None, digest: str | None = None) -> ImageRef | None:
    """The built image if its manifest has the current recipe digest, all artifacts exist, the disk
    has the recorded size and the SSH key is the one baked in; else None."""
    try:
        ref = load(name, images_dir)
    except LabError:
        return None
    m = ref.manifest
    if m.get("recipe_digest") != (digest or recipe_digest(name)):
        return None
    paths = artifact_paths(name, images_dir)
    if not all(p.is_file() for p in paths.values()):
        return None
    if paths["disk"].stat().st_size != m.get("size"):
        return None
    try:
        if key_fingerprint(paths["ssh_pubkey"].read_text()) != m.get("ssh_key_fingerprint"):
            return None
    except (ValueError, OSError):
        return None
    return ref


def status(images_dir: Path | None = None, now: float | None = None) -> list[dict[str, Any]]:
    """One row per known image, built or not: state (built, outdated, not built), the current recipe
    digest, the built image's digest, age and tool versions."""
    idir = resolve_dir(images_dir)
    now = time.time() if now is None else now
    rows = []
    for name in sorted(RECIPES):
        r = RECIPES[name]
        current = recipe_digest(name)
        row: dict[str, Any] = {
            "name": name,
            "os": r.os,
            "release": r.release,
            "kind": r.kind,
            "recipe_digest": current,
            "state": "not built",
            "built_digest": "",
            "built_at": "",
            "age_s": None,
            "tools": {},
            "size": None,
        }
        try:
            ref = load(name, idir)
        except LabError:
            rows.append(row)
            continue
        m = ref.manifest
        row.update(
            built_digest=ref.digest,
            built_at=m.get("built_at", ""),
            tools=m.get("tools", {}),
            size=m.get("size"),
            sha256=ref.sha256,
        )
        row["state"] = "built" if up_to_date(name, idir, current) is not None else "outdated"
        try:
            row["age_s"] = max(0.0, now - datetime.fromisoformat(m["built_at"]).timestamp())
        except (KeyError, TypeError, ValueError):
            pass
        rows.append(row)
    return rows
