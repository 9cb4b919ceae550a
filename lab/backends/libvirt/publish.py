"""`lab images publish IMAGE HOST` for a libvirt host: on bhyve a sparse zvol (`volmode=dev`,
`lab:digest`) filled with the raw image by `dd` over SSH, plus the snapshot clones are made from;
on QEMU the images/ layout (disk, kernel, initrd, then the manifest) copied to the host's
publish directory. Idempotent for the same recipe; another recipe is refused while clones may
still use the old one."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab import proc
from lab.backends.libvirt import domain
from lab.backends.libvirt.disks import Disks, manifest_digest
from lab.backends.libvirt.owned import Inventory
from lab.errors import BackendError, UsageError
from lab.model import ImageRef

Step = tuple[list[str], str | None]  # a host command, and the local file fed on its stdin (or None)


def zvol_plan(disks: Disks, image: ImageRef, raw: str, size: int) -> list[Step]:
    """bhyve: the host commands that make `image` a golden zvol and its snapshot. `raw` is the
    image as a raw file on this machine, `size` its size in bytes."""
    snap = disks.golden_source(image)
    zvol, _, snapname = snap.partition("@")
    mib = -(-size // (1 << 20))  # a whole number of MiB: any volblocksize divides it
    props = ["-o", "volmode=dev", "-o", f"lab:image={image.name}", "-o", f"lab:digest={image.digest}"]
    argv = disks.shell.argv
    return [
        (argv(["zfs", "create", "-s", "-V", f"{mib}M", *props, zvol]), None),
        # conv=sparse: zero blocks are skipped, the zvol stays thin (GNU and FreeBSD dd)
        (argv(["dd", f"of=/dev/zvol/{zvol}", "bs=1048576", "conv=sparse"]), raw),
        (argv(["zfs", "snapshot", "-o", f"lab:digest={image.digest}", f"{zvol}@{snapname}"]), None),
    ]


def publish_zvol(disks: Disks, image: ImageRef) -> str:
    """bhyve: "zfs:POOL/DS/NAME@gold"; a failed publish leaves no half-made zvol."""
    host = disks.host
    snap = disks.golden_source(image)
    zvol = snap.partition("@")[0]
    state = disks.golden_snapshot_state(snap)
    if state is not None:
        if state in ("-", "") or not image.digest or state == image.digest:
            return f"zfs:{snap}"  # there already (or made by hand): nothing to do
        raise UsageError(
            f"golden snapshot {snap} on host {host.name!r} is recipe {state[:12]}, "
            f"not {image.digest[:12]}; clones may still depend on it",
            hint=f"put {{digest}} in {host.where}golden (a zvol per recipe), "
            "or `zfs destroy -r` the old one when no clone is left",
        )
    info = json.loads(
        proc.run(["qemu-img", "info", "--output=json", str(image.path)], timeout=60, what="qemu-img info").stdout
    )
    with tempfile.TemporaryDirectory(prefix="lab-publish-", dir="/var/tmp") as tmp:
        raw = str(image.path)
        if info.get("format") != "raw":  # bhyve reads raw only
            raw = f"{tmp}/{image.name}.raw"
            proc.run(
                ["qemu-img", "convert", "-q", "-O", "raw", str(image.path), raw],
                timeout=1800,
                what="qemu-img convert to raw",
            )
        try:
            for argv, feed in zvol_plan(disks, image, raw, int(info["virtual-size"])):
                disks.shell.run_argv(argv, timeout=3600, what="publish to zfs", stdin=feed)
        except BaseException:
            disks.shell.run(
                ["zfs", "destroy", "-r", zvol], timeout=600, check=False, what="zfs destroy (failed publish)"
            )
            raise
    return f"zfs:{snap}"


def publish_files(disks: Disks, image: ImageRef, lab_domains: Callable[[], list[str]]) -> str:
    """QEMU: "file:/DIR/NAME.qcow2". The manifest goes last, so its presence means the copy is
    complete. `lab_domains` names the lab domains on the host: a golden of another recipe is not
    replaced under them (an overlay names its golden by path)."""
    host, shell = disks.host, disks.shell
    root = disks.publish_dir()
    src = Path(image.path)
    dst = f"{root}/{src.name}"
    manifest = f"{root}/{image.name}.json"
    text = shell.read(manifest)
    if text is not None:
        if image.digest and manifest_digest(text) == image.digest:
            disks.forget_golden(image)
            return f"file:{dst}"
        busy = lab_domains()
        if busy:
            raise UsageError(
                f"{dst} on host {host.name!r} is another recipe and lab domains exist "
                f"there ({', '.join(busy[:3])}); their overlays may use it",
                hint="let the runs finish (or `lab gc`), then publish again",
            )
    files = [(src, dst)]
    given = image.manifest.get("paths")
    paths: dict[str, Any] = given if isinstance(given, dict) else {}
    for rel in ("kernel", "initrd"):
        if paths.get(rel):
            files.append((src.parent / paths[rel], f"{root}/{paths[rel]}"))
    shell.run(["mkdir", "-p", *sorted({d.rsplit("/", 1)[0] for _, d in files})], what="mkdir")
    for local, remote in files:
        part = f"{remote}.part"
        if shell.remote:
            shell.run(
                ["dd", f"of={part}", "bs=1048576", "conv=sparse"],
                timeout=3600,
                what=f"copy {local.name} to the host",
                stdin=str(local),
            )
        else:
            proc.run(["cp", "--sparse=always", str(local), part], timeout=3600, what=f"copy {local.name}")
        shell.run(["mv", "-f", part, remote], what="mv")
    shell.write(
        manifest,
        json.dumps(image.manifest or {"name": image.name, "recipe_digest": image.digest}, indent=2, sort_keys=True),
    )
    disks.refresh_pool()
    disks.forget_golden(image)
    return f"file:{dst}"


class Publishing:
    """The libvirt host's Publishing part (lab.backends.base)."""

    def __init__(self, disks: Disks, inventory: Inventory):
        self.host, self.disks, self.inventory = disks.host, disks, inventory

    def publish(self, image: ImageRef) -> str:
        """Put `image` on the host so clones can be made of it; returns where it went
        ("zfs:POOL/DS/NAME@gold" or "file:/DIR/NAME.qcow2"). Idempotent for the same recipe."""
        if self.host.test_uri:
            raise UsageError(f"host {self.host.name!r} is a test:/// URI: nothing to publish to")
        domain.require_boot(self.host, image)
        if self.host.driver == "bhyve":
            return publish_zvol(self.disks, image)
        return publish_files(self.disks, image, self._lab_domains)

    def _lab_domains(self) -> list[str]:
        """The lab's domains on the host; BackendError when some could not be read (any of them
        could stand on what is about to change)."""
        leases, unchecked = self.inventory.leases()
        if unchecked:
            raise BackendError(f"cannot tell which lab domains are on {self.host.name!r}: {'; '.join(unchecked)}")
        return [dom.name() for dom, _ in leases]
