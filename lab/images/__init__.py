"""Golden images: build them (Debian offline from packages; the other OSes from their installer ISOs),
describe them in a manifest (images/<name>.json), load them as ImageRef and publish them.

One module per job; everything the rest of the lab uses is imported from here (`lab.images.load`):

  recipes    what goes into each image (Recipe, IsoRecipe, RECIPES) and the guest-contract constants
  digest     the recipe digest over the recipe and every input file, which makes `build` idempotent
  keys       the lab's SSH key, baked into every image
  hostkeys   the image's SSH host keys: read at build, in the manifest, known_hosts lines for the Guest
  manifest   built images on disk: paths, manifest, load, boot modes, up to date, status
  sources    the Debian mirror and the installer ISO
  render     templates/ -> nginx.conf, the site, answer files, the provisioning stage
  pictures   the site's deterministic PNGs
  steps      what both pipelines share: work directory, timed stages, logged commands, packer build
  debian     the debian12 pipeline (mmdebstrap, GPT disk, Packer under TCG)
  installer  the ISO-installed images (alpine3, freebsd14, netbsd10, openbsd7)
  builder    `build`: up to date? else lock and run the pipeline
  publish    copy a built image into a local image store

The ISO is never downloaded by lab itself: Packer fetches it (and verifies its checksum) when the
machine can reach the mirror; otherwise a copy in images/iso/ or ``--iso PATH`` is used, and without
one the build stops at once with one line (exit status 2). The guest contract (command line,
readiness marker, key) is in images/README.md.
"""

from __future__ import annotations

from lab.images.builder import Progress, build
from lab.images.debian import build_container_base, container_base_argv, make_disk, stage_container_base
from lab.images.digest import file_sha256, input_files, recipe_digest
from lab.images.hostkeys import host_keys, known_hosts
from lab.images.keys import KEY_NAME, ensure_key, key_fingerprint
from lab.images.manifest import (
    BOOT_WAYS,
    artifact_paths,
    boot_modes,
    list_images,
    load,
    manifest_path,
    require_boot,
    status,
    up_to_date,
)
from lab.images.pictures import png
from lab.images.publish import publish_local
from lab.images.recipes import (
    BOOT_MODES,
    CONTAINER_TARBALL,
    DEBIAN12,
    ISO_RECIPES,
    READY_MARKER,
    RECIPE_VERSION,
    RECIPES,
    ROOT_LABEL,
    SSH_USER,
    AnyRecipe,
    ContainerBase,
    IsoRecipe,
    Recipe,
    recipe,
)
from lab.images.render import answer_context, render_answers, render_stage, render_upload
from lab.images.sources import (
    DEFAULT_MIRROR,
    DEFAULT_SECURITY_MIRROR,
    ISO_CACHE,
    IsoSource,
    debian_mirrors,
    packer_defaults,
    resolve_iso,
)
from lab.model import ImageRef

__all__ = [
    # recipes
    "AnyRecipe",
    "BOOT_MODES",
    "CONTAINER_TARBALL",
    "ContainerBase",
    "DEBIAN12",
    "ISO_RECIPES",
    "IsoRecipe",
    "READY_MARKER",
    "RECIPES",
    "RECIPE_VERSION",
    "ROOT_LABEL",
    "Recipe",
    "SSH_USER",
    "recipe",
    # digest and keys
    "KEY_NAME",
    "ensure_key",
    "file_sha256",
    "input_files",
    "key_fingerprint",
    "recipe_digest",
    # the image's SSH host keys
    "host_keys",
    "known_hosts",
    # built images
    "BOOT_WAYS",
    "ImageRef",
    "artifact_paths",
    "boot_modes",
    "list_images",
    "load",
    "manifest_path",
    "require_boot",
    "status",
    "up_to_date",
    # sources
    "DEFAULT_MIRROR",
    "DEFAULT_SECURITY_MIRROR",
    "ISO_CACHE",
    "IsoSource",
    "debian_mirrors",
    "packer_defaults",
    "resolve_iso",
    # rendering
    "answer_context",
    "png",
    "render_answers",
    "render_stage",
    "render_upload",
    # building and publishing
    "Progress",
    "build",
    "build_container_base",
    "container_base_argv",
    "make_disk",
    "publish_local",
    "stage_container_base",
]
