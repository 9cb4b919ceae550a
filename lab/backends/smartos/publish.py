"""`lab images publish NAME HOST` for a SmartOS host: the golden image as an imgadm zvol image.

SmartOS makes images only from ZFS (an image file is a `zfs send` stream), so the disk goes in the
way an operator would do it by hand, with nothing but argv commands in the global zone:
1. `vmadm create` a proto VM with one empty disk of the image's virtual size (never booted; it
   carries the lab's marker, so a publish that dies midway leaves nothing `lab gc` cannot find);
2. the raw disk's data streamed over SSH into its zvol, one `dd of=/dev/zvol/rdsk/... bs=1048576
   seek=N` per run of data (a new zvol reads as zeros: the image's holes, three quarters of the golden
   image's 4 GiB, are not sent; illumos dd lseeks the output by seek x bs and leaves a device as it is);
3. `imgadm create -m - -o /var/tmp/...` with the manifest fields (name, version, os, the lab's
   marker, image name, recipe digest and sha256 in `tags`; on bhyve the NoCloud tag, so SmartOS
   hands the guest its address on a cidata disk), then `imgadm install` of the files it wrote;
4. the proto VM and the files removed; older lab images of that name deleted once unused.
Publishing an image already there (same sha256, same brand) changes nothing."""

from __future__ import annotations

import errno
import json
import logging
import os
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
            _stream(gz, raw, disk, Path(tmp) / "run", deadline)
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


BLOCK = 1 << 20  # dd's bs: runs start on a block, so that seek=N lands them where they belong
MERGE_GAP = 16 << 20  # a hole shorter than this is sent as zeros: one SSH session costs more
MAX_RUN = 256 << 20  # at most this much in one dd (and in the local file that feeds it)


def data_runs(raw: Path) -> list[tuple[int, int]]:
    """(offset, length) of the parts of the raw disk `raw` that hold data, from its holes (qemu-img
    convert leaves a hole where the image reads zeros): block-aligned, holes shorter than MERGE_GAP
    merged, runs cut at MAX_RUN. On a file system that cannot tell holes: the whole disk."""
    size = raw.stat().st_size
    merged: list[list[int]] = []
    with open(raw, "rb") as fh:
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fh.fileno(), pos, os.SEEK_DATA)
                end = os.lseek(fh.fileno(), start, os.SEEK_HOLE)
            except OSError as exc:  # ENXIO: nothing but a hole from pos to the end
                if exc.errno != errno.ENXIO:  # no SEEK_DATA here: all of it
                    merged = [[0, size]]
                break
            lo, hi = start // BLOCK * BLOCK, min(size, -(-end // BLOCK) * BLOCK)
            if merged and lo - merged[-1][1] < MERGE_GAP:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
            pos = end
    return [(off, min(MAX_RUN, hi - off)) for lo, hi in merged for off in range(lo, hi, MAX_RUN)]


def _stream(gz: GlobalZone, raw: Path, disk: str, part: Path, deadline: float) -> None:
    """The data of `raw` into the host's zvol `disk` (zeros: a fresh zvol), a run per `dd`."""
    runs = data_runs(raw)
    log.info(
        "%s: %d MiB of data of a %d MiB disk to %s in %d dd run(s)",
        gz.host_name,
        sum(n for _, n in runs) >> 20,
        raw.stat().st_size >> 20,
        disk,
        len(runs),
    )
    with open(raw, "rb") as src:
        for offset, length in runs:
            with open(part, "wb") as out:
                _copy_range(src.fileno(), out.fileno(), offset, length)
            gz.run(
                ["dd", f"of={disk}", f"bs={BLOCK}", f"seek={offset // BLOCK}"],
                stdin_path=part,
                timeout=_left(deadline),
                what=f"dd of={disk} seek={offset // BLOCK}",
            )
    part.unlink(missing_ok=True)


def _copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """`length` bytes of `src` from `offset` to the end of `dst`: in the kernel (copy_file_range)
    where it can."""
    done = 0
    while done < length:
        want = min(length - done, BLOCK * 16)
        try:
            n = os.copy_file_range(src, dst, want, offset + done)
        except OSError:
            data = os.pread(src, want, offset + done)
            n = len(data) and os.write(dst, data)
        if n == 0:
            raise LabError(f"the raw disk ended before byte {offset + length}")
        done += n


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
