"""Golden images as libvirt Vagrant boxes.

The box is made by the image's own Packer template (packer/debian12.pkr.hcl, post-processors
`box-info` and `box`; `lab images build` passes the recipe digest) in the same build as the
image: `images/NAME.box` holds the golden qcow2 byte for byte as `box.img`, a Vagrantfile and
`NAME.box.json`; the same JSON lies beside the box
(image name, recipe digest, the disk's sha256). A box belongs to exactly one build: publishing
refuses a box whose JSON names another digest or sha256 than the image's manifest.

`vagrant box add` takes it through a one-version catalog (`images/NAME.box.catalog.json`: the box
file's sha256, checked by Vagrant), as `lab/NAME` version `1.0.0-<digest[:12]>.<sha256[:12]>`:
the version names the recipe and the build, so every build is its own version and a Vagrantfile
pinned to one boots exactly that disk (vagrant-libvirt names its base volume by the version).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lab.backends.vagrant.tools import Vagrant
from lab.errors import LabError, UsageError
from lab.images import file_sha256
from lab.model import ImageRef

BOX_ORG = "lab"
PROVIDER = "libvirt"


def box_name(image: str) -> str:
    return f"{BOX_ORG}/{image}"


def box_version(digest: str, sha256: str) -> str:
    """A valid Vagrant (RubyGems) version naming the recipe digest and the disk: a pre-release
    of 1.0.0, so it also satisfies Vagrant's default constraint ">= 0"."""
    return f"1.0.0-{digest[:12]}.{sha256[:12]}"


def base_volume(name: str, version: str) -> str:
    """The volume vagrant-libvirt uploads the box's disk to in the storage pool, at the first
    `vagrant up` of that version (its HandleBoxImage.get_volume_name)."""
    return f"{name.replace('/', '-VAGRANTSLASH-')}_vagrant_box_image_{version}_box.img"


def paths(image: ImageRef) -> dict[str, Path]:
    idir = image.path.parent
    return {
        "box": idir / f"{image.name}.box",
        "info": idir / f"{image.name}.box.json",
        "catalog": idir / f"{image.name}.box.catalog.json",
    }


@dataclass(frozen=True)
class Box:
    image: str
    name: str  # lab/NAME
    version: str
    path: Path
    digest: str
    sha256: str  # of the golden disk inside


def built_box(image: ImageRef) -> Box:
    """The box made with this build of `image`. Raises UsageError (with what to do) when it is
    missing or belongs to another build."""
    p = paths(image)
    rebuild = f"rebuild the image with its box: lab images build {image.name} --force"
    if not p["box"].is_file() or not p["info"].is_file():
        raise UsageError(f"image {image.name!r} has no Vagrant box ({p['box']} and {p['info'].name})", hint=rebuild)
    try:
        info = json.loads(p["info"].read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{p['info']}: unreadable ({exc})", hint=rebuild) from None
    digest, sha = str(info.get("recipe_digest", "")), str(info.get("sha256", ""))
    # the disk's sha256 names the build; a box built without the digest passed (an older
    # `lab images build`) still belongs to it, and takes the manifest's
    if sha != image.sha256 or digest not in ("", image.digest):
        raise UsageError(
            f"{p['box']} is of another build of {image.name} (recipe {digest[:12] or 'unknown'}, "
            f"disk {sha[:12]}; the image is recipe {image.digest[:12]}, disk {image.sha256[:12]})",
            hint=rebuild,
        )
    return Box(image.name, box_name(image.name), box_version(image.digest, sha), p["box"], image.digest, sha)


def catalog(box: Box, box_sha256: str) -> dict:
    """Vagrant's box metadata (a catalog of one version) for `vagrant box add`."""
    about = f"lab golden image {box.image}: recipe digest {box.digest}, disk sha256 {box.sha256}"
    return {
        "name": box.name,
        "description": about,
        "versions": [
            {
                "version": box.version,
                "description": about,
                "providers": [
                    {
                        "name": PROVIDER,
                        "url": box.path.resolve().as_uri(),
                        "checksum_type": "sha256",
                        "checksum": box_sha256,
                    }
                ],
            }
        ],
    }


def installed(vagrant: Vagrant, name: str, version: str) -> bool:
    return (name, PROVIDER, version) in vagrant.boxes()


def publish(image: ImageRef, vagrant: Vagrant) -> str:
    """Add this build's box to Vagrant (nothing to do when that version is there already).
    Returns "lab/NAME VERSION"."""
    box = built_box(image)
    where = f"{box.name} {box.version}"
    if installed(vagrant, box.name, box.version):
        return where
    cat = paths(image)["catalog"]
    tmp = cat.with_suffix(".tmp")
    tmp.write_text(json.dumps(catalog(box, file_sha256(box.path)), indent=2) + "\n")
    tmp.replace(cat)
    res = vagrant.run(
        ["box", "add", "--provider", PROVIDER, "--box-version", box.version, str(cat)],
        timeout=1800,
        what="vagrant box add",
        check=False,
    )
    if not res.ok:
        raise LabError(
            f"vagrant box add {box.name} {box.version} failed: "
            f"{' | '.join((res.stderr or res.stdout).strip().splitlines()[-3:])}"
        )
    return where


class BoxPublishing:
    """The vagrant host's Publishing part (lab.backends.base): the image's box added to Vagrant."""

    def __init__(self, vagrant: Vagrant):
        self.vagrant = vagrant

    def publish(self, image: ImageRef) -> str:
        return publish(image, self.vagrant)
