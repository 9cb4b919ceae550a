"""`lab images publish NAME HOST` for a SmartOS host: the golden image as an imgadm zvol image.

SmartOS makes images only from ZFS (an image file is a `zfs send` stream), so the disk goes in the
way an operator would do it by hand, with nothing but argv commands in the global zone:
1. `vmadm create` a proto VM with one empty disk of the image's virtual size (never booted; it
   carries the lab's marker, so a publish that dies midway leaves nothing `lab gc` cannot find);
2. the raw disk streamed over SSH into its zvol (`dd of=/dev/zvol/rdsk/...`);
3. `imgadm create -m - -o /var/tmp/...` with the manifest fields (name, version, os, the lab's
   marker, image name, recipe digest and sha256 in `tags`; on bhyve the NoCloud tag, so SmartOS
   hands the guest its address on a cidata disk), then `imgadm install` of the files it wrote;
4. the proto VM and the files removed; older lab images of that name deleted once unused.
Publishing an image already there (same sha256, same brand) changes nothing."""

from __future__ import annotations

import json
import logging
import tempfile
import time
import uuid as uuidlib
from collections.abc import Callable
from pathlib import Path

from lab import images, proc
from lab.backends.smartos import payload
from lab.backends.smartos.globalzone import CommandFailed, GlobalZone
from lab.backends.smartos.settings import Settings
from lab.errors import LabError
from lab.model import ImageRef

log = logging.getLogger(__name__)


def installed(gz: GlobalZone) -> list[dict]:
    entries = gz.json(["imgadm", "list", "-j"], what="imgadm list -j")
    return entries if isinstance(entries, list) else []


def publish(gz: GlobalZone, settings: Settings, image: ImageRef, *, work_dir: Path) -> str:
    """Put `image` on the host as an imgadm image; returns its name."""
    images.require_boot(image, settings.bootrom, f"a SmartOS {settings.brand} VM boots its disk by firmware")
    name = payload.image_name(settings, image)
    same, older = payload.published(installed(gz), settings, image)
    if same is not None:
        log.info("%s: image %s (%s) already holds %s", gz.host_name, name, same, image.name)
        return name
    deadline = time.monotonic() + settings.timeout("publish")
    proto = str(uuidlib.uuid4())
    alias = f"lab-publish-{image.name}-{(image.sha256 or image.digest)[:12]}"
    spool = f"/var/tmp/{alias}"  # imgadm create writes <spool>.imgmanifest and <spool>.zfs
    gz.run(
        ["vmadm", "create"],
        input=json.dumps(
            payload.proto_payload(
                settings, image, uuid=proto, alias=alias, expires_at=time.time() + settings.timeout("publish")
            )
        ),
        timeout=settings.timeout("create"),
        what="vmadm create (publish)",
    )
    try:
        disk = gz.json(["vmadm", "get", proto], what=f"vmadm get {proto}")["disks"][0]["path"]
        with tempfile.TemporaryDirectory(prefix="lab-publish-", dir=work_dir) as tmp:
            raw = Path(tmp) / f"{image.name}.raw"
            proc.run(
                ["qemu-img", "convert", "-O", "raw", str(image.path), str(raw)],
                timeout=_left(deadline),
                what="qemu-img convert (raw for the zvol)",
            )
            gz.run(["dd", f"of={disk}", "bs=1048576"], stdin_path=raw, timeout=_left(deadline), what=f"dd of={disk}")
        gz.run(
            ["imgadm", "create", "-m", "-", "-o", spool, "-c", "none", proto],
            input=json.dumps(payload.image_manifest(settings, image)),
            timeout=_left(deadline),
            what="imgadm create",
        )
        gz.run(
            ["imgadm", "install", "-m", f"{spool}.imgmanifest", "-f", f"{spool}.zfs"],
            timeout=_left(deadline),
            what="imgadm install",
        )
    finally:
        for cleanup in (["rm", "-f", f"{spool}.imgmanifest", f"{spool}.zfs"], ["vmadm", "delete", proto]):
            try:
                gz.run(cleanup, check=False, what=" ".join(cleanup[:2]))
            except LabError as exc:  # the proto VM carries the marker: `lab gc` removes it later
                log.warning("%s: publish cleanup `%s`: %s", gz.host_name, " ".join(cleanup), exc)
    for old in older:
        try:
            gz.run(["imgadm", "delete", old], what=f"imgadm delete {old}")
        except CommandFailed as exc:  # clones still use it: it goes when they are gone
            log.warning("%s: kept the older image %s of %s: %s", gz.host_name, old, name, exc)
    log.info("%s: published %s as image %s", gz.host_name, image.name, name)
    return name


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())


class Publishing:
    """The SmartOS host's Publishing part (lab.backends.base): the host checked first, then the image
    published; `published` is told so that the backend looks its image up again."""

    def __init__(
        self,
        gz: GlobalZone,
        settings: Settings,
        check: Callable[[], None],
        work_dir: Callable[[], Path],
        published: Callable[[ImageRef], object],
    ):
        self.gz, self.settings, self.check, self.work_dir, self.published = gz, settings, check, work_dir, published

    def publish(self, image: ImageRef) -> str:
        self.check()
        name = publish(self.gz, self.settings, image, work_dir=self.work_dir())
        self.published(image)
        return name
