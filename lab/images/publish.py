"""Publishing a built image into a local image store, verified by sha256."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lab.errors import LabError
from lab.images.digest import file_sha256
from lab.model import ImageRef


def publish_local(ref: ImageRef, store: Path) -> str:
    """Copy a built image (disk, boot files, manifest) into a local image store, as
    <store>/<name>/<sha256[:12]>/, verified by sha256, and point <store>/<name>/current at it.
    Publishing the same image twice copies nothing. Returns the published directory."""
    idir = ref.path.parent
    dest = store / ref.name / ref.sha256[:12]
    if not (dest / "manifest.json").is_file():
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for key, rel in ref.manifest.get("paths", {}).items():
            if key in ("ssh_key", "ssh_pubkey"):
                continue  # the key stays in images/: a store is not where secrets go
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(idir / rel, target)
        if file_sha256(tmp / ref.manifest["paths"]["disk"]) != ref.sha256:
            shutil.rmtree(tmp)
            raise LabError(f"{ref.path} does not match its manifest's sha256", hint="rebuild the image")
        (tmp / "manifest.json").write_text(json.dumps(ref.manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, dest)
    current = store / ref.name / "current"
    link_tmp = current.with_name("current.tmp")
    link_tmp.unlink(missing_ok=True)
    link_tmp.symlink_to(dest.name)
    os.replace(link_tmp, current)
    return str(dest)
