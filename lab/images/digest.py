"""The recipe digest (sha256 over the recipe constants and every input file): same digest and
artifacts present = nothing to build. Also the image file's own sha256."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import lab
from lab.errors import LabError
from lab.images.recipes import recipe


def input_files(
    name: str, *, packer_dir: Path | None = None, templates_dir: Path | None = None
) -> list[tuple[str, Path]]:
    """Every file the image is made from, as (stable label, path), sorted by label."""
    r = recipe(name)
    pdir = Path(packer_dir or lab.PACKER_DIR)
    tdir = Path(templates_dir or lab.TEMPLATES_DIR)
    out: list[tuple[str, Path]] = []
    for rel in (r.packer_template, *r.scripts):
        out.append((f"packer/{rel}", pdir / rel))
    for rel in r.template_paths:
        p = tdir / rel
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts:
                    out.append((f"templates/{f.relative_to(tdir).as_posix()}", f))
        else:
            out.append((f"templates/{rel}", p))
    return sorted(out)


def recipe_digest(name: str, *, packer_dir: Path | None = None, templates_dir: Path | None = None) -> str:
    """sha256 over the recipe constants and every input file (path, executable bit, content)."""
    h = hashlib.sha256()
    h.update(json.dumps(recipe(name).constants(), sort_keys=True).encode())
    for label, path in input_files(name, packer_dir=packer_dir, templates_dir=templates_dir):
        try:
            data = path.read_bytes()
            mode = "x" if os.access(path, os.X_OK) else "-"
        except FileNotFoundError:
            raise LabError(f"image input {path} is missing", hint="is the checkout complete?") from None
        h.update(f"\0{label}\0{mode}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
