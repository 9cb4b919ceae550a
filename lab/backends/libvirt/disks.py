"""Disks on a libvirt host: where golden images are (a zvol snapshot on bhyve; the images/ layout
in a directory or storage pool on QEMU), how a VM's clone is made of one (`zfs clone` or
`zfs send | zfs recv`; a qcow2 overlay or `qemu-img convert`), and how clones are removed,
including those whose domain is gone. Host commands are built as argv first (pure: tests check
them), then run through the host shell."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from xml.etree import ElementTree as ET

from lab.backends.libvirt.connection import Connection, error_message, libvirt_module
from lab.backends.libvirt.domain import LEASE_NS
from lab.backends.libvirt.drivers import USABLE_NAME
from lab.backends.libvirt.hostshell import HostShell
from lab.backends.libvirt.settings import Host
from lab.errors import CommandError, LabError, TeardownError, UsageError
from lab.model import CloneKind, ImageRef, Owned, VmSpec
from lab.wait import wait_until


def manifest_digest(text: str) -> str:
    """The recipe digest an image manifest (images/NAME.json) records ("" if none)."""
    try:
        m = json.loads(text)
    except ValueError:
        return ""
    return str(m.get("recipe_digest") or m.get("digest") or "") if isinstance(m, dict) else ""


class Disks:
    def __init__(self, host: Host, shell: HostShell, connection: Connection):
        self.host = host
        self.shell = shell
        self.connection = connection
        self._dir: str | None = None
        self._golden_roots: dict[str, str | None] = {}  # image name -> host dir (None: in place)

    # -- the QEMU host's directory ----------------------------------------------------------------

    def clone_dir(self) -> str:
        """QEMU: where clones and console logs go: the pool's target path, else `dir`."""
        if self._dir is None:
            self._dir = (self._pool_path() if self.host.pool else self.host.dir).rstrip("/")
        return self._dir

    def _pool_path(self) -> str:
        libvirt = libvirt_module()
        try:
            pool = self.connection.get().storagePoolLookupByName(self.host.pool)
            path = ET.fromstring(pool.XMLDesc(0)).findtext("target/path")
        except libvirt.libvirtError as exc:
            raise UsageError(f"{self.host.where}pool = {self.host.pool!r}: {error_message(exc)}") from None
        if not path:
            raise UsageError(f"{self.host.where}pool = {self.host.pool!r} has no target path")
        return path

    def refresh_pool(self) -> None:
        """Let libvirt list what lab added to or removed from the pool's directory."""
        if self.host.pool:
            try:
                self.connection.get().storagePoolLookupByName(self.host.pool).refresh(0)
            except Exception:  # a listing that lags is harmless; the files are what counts
                pass

    # -- a VM's disk ----------------------------------------------------------------------------------

    def disk_for(self, spec: VmSpec) -> tuple[str, str]:
        """(disk reference for the lease, path the domain uses)."""
        if self.host.driver == "bhyve":
            ds = f"{self.host.dataset}/{spec.name}"
            return f"zfs:{ds}", f"/dev/zvol/{ds}"
        path = f"{self.clone_dir()}/{spec.name}.{self.host.disk_format}"
        return f"file:{path}", path

    def console_path(self, spec: VmSpec, vm_uuid: str) -> str:
        """bhyve: the nmdm slave of the domain's serial port; QEMU: its console log."""
        if self.host.driver == "bhyve":
            return f"/dev/nmdm{vm_uuid.replace('-', '')[:8]}B"
        return f"{self.clone_dir()}/{spec.name}.console.log"

    def clone_argv(self, image: ImageRef, spec: VmSpec) -> list[list[str]]:
        """The host commands that create the VM's disk."""
        src = self.golden_source(image)
        ref, path = self.disk_for(spec)
        kind = CloneKind(spec.clone)
        if self.host.driver == "bhyve":
            ds = ref.split(":", 1)[1]
            props = ["-o", "volmode=dev", "-o", f"lab:run={spec.run_id}", "-o", f"lab:expires={int(spec.expires_at)}"]
            if kind is CloneKind.LINKED:
                return [self.shell.argv(["zfs", "clone", *props, src, ds])]
            pipeline = (
                f"zfs send {shlex.quote(src)} | zfs recv "
                + " ".join(shlex.quote(p) for p in props)
                + f" {shlex.quote(ds)}"
            )
            return [self.shell.shell_argv(pipeline)]
        cmds = [self.shell.argv(["mkdir", "-p", self.clone_dir()])]
        if kind is CloneKind.LINKED:
            cmds.append(self.shell.argv(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", src, path]))
        else:
            cmds.append(self.shell.argv(["qemu-img", "convert", "-q", "-O", self.host.disk_format, src, path]))
        return cmds

    def remove_argv(self, disk_ref: str) -> list[str]:
        """The host command that removes a clone (or console log); refuses anything not lab's."""
        kind, _, target = disk_ref.partition(":")
        name = target.rsplit("/", 1)[-1]
        dataset = self.host.dataset
        if kind == "zfs":
            if (
                self.host.driver != "bhyve"
                or not target.startswith(f"{dataset}/")
                or "@" in target
                or "/" in target[len(dataset) + 1 :]
                or not USABLE_NAME.match(name)
            ):
                raise TeardownError(f"refusing to destroy {target!r}: not a clone under {dataset!r}")
            return self.shell.argv(["zfs", "destroy", target])
        if kind == "file":
            d = self.clone_dir()
            if not target.startswith(f"{d}/") or "/" in target[len(d) + 1 :] or ".." in name:
                raise TeardownError(f"refusing to remove {target!r}: not in {d!r}")
            return self.shell.argv(["rm", "-f", "--", target])
        raise TeardownError(f"unknown disk reference {disk_ref!r}")

    def remove(self, disk_ref: str) -> None:
        """Remove a clone (nothing for ""); a zvol bhyve still holds for a moment is retried."""
        if not disk_ref:
            return
        argv = self.remove_argv(disk_ref)
        if disk_ref.startswith("zfs:"):

            def attempt() -> bool:  # "busy": try again; "does not exist": done already
                res = self.shell.run_argv(argv, timeout=120, check=False, what="zfs destroy")
                out = (res.stderr + res.stdout).lower()
                if res.ok or "does not exist" in out:
                    return True
                if "busy" in out:
                    return False
                raise CommandError(argv, res.returncode, res.stdout, res.stderr, what="zfs destroy")

            wait_until(attempt, timeout=60, what=f"zfs destroy of {disk_ref[4:]}", interval=0.5)
        else:
            self.shell.run_argv(argv, timeout=60, what="rm disk")
        self.refresh_pool()

    # -- what gc may remove ----------------------------------------------------------------------------
    # A clone is the lab's only when the lab's naming (lab-*, directly in the clone directory or
    # under the dataset) AND its lease say so: on QEMU a one-line lease file beside the disk (the
    # lab's namespace and a run id), on bhyve the zvol's lab:run property. Nothing else is listed.

    def lease_path(self, name: str) -> str:
        """QEMU: the lease file of the clone `name` (beside its disk, written before it)."""
        return f"{self.clone_dir()}/{name}.lease"

    def clone_files(self, name: str) -> list[str]:
        """QEMU: what a clone may leave in the clone directory besides its disk (console log, the
        copy of a warm state), the lease file last."""
        d = self.clone_dir()
        return [f"{d}/{name}.console.log", f"{d}/{name}.state", f"{d}/{name}.state.part", self.lease_path(name)]

    def write_lease(self, name: str, lease: dict[str, str]) -> None:
        self.shell.run(["mkdir", "-p", self.clone_dir()], what="mkdir")
        self.shell.write(
            self.lease_path(name), json.dumps({"lab": LEASE_NS, "name": name, **lease}, sort_keys=True) + "\n"
        )

    def _qemu_lease(self, record: dict) -> dict | None:
        """A lease file's record when it is the lab's, for a clone in this directory."""
        name = str(record.get("name", ""))
        if (
            record.get("lab") != LEASE_NS
            or not str(record.get("run", "")).strip()
            or not name.startswith("lab-")
            or not USABLE_NAME.match(name)
        ):
            return None
        disk = f"file:{self.clone_dir()}/{name}."
        return record if str(record.get("disk", "")) in (disk + "qcow2", disk + "raw") else None

    def orphans(self, backend: str) -> list[Owned]:
        """Every clone the lab's naming and lease prove its own (the caller drops those a domain
        still uses). CommandError or UsageError when the host's disks cannot be listed."""
        found: list[Owned] = []
        if self.host.driver == "bhyve":
            res = self.shell.run(
                ["zfs", "list", "-H", "-p", "-t", "volume", "-o", "name,lab:run,lab:expires", "-r", self.host.dataset],
                what="zfs list",
                check=False,
                timeout=60,
            )
            if not res.ok:
                raise CommandError(res.argv, res.returncode, res.stdout, res.stderr, what="zfs list")
            for line in res.stdout.splitlines():
                parts = line.split("\t")
                if len(parts) != 3 or parts[1].strip() in ("-", "") or not self._is_clone_dataset(parts[0]):
                    continue
                expires = float(parts[2]) if parts[2].isdigit() else 0.0
                found.append(
                    Owned(
                        backend=backend,
                        kind="disk",
                        name=parts[0].rsplit("/", 1)[-1],
                        run_id=parts[1],
                        expires_at=expires,
                        detail=f"zfs:{parts[0]}",
                    )
                )
            return found
        for file, line in self.shell.records(self.clone_dir(), "lab-*.lease"):
            try:
                record = self._qemu_lease(json.loads(line))
            except (ValueError, AttributeError):
                continue
            if record is not None and file == f"{record['name']}.lease":
                found.append(
                    Owned(
                        backend=backend,
                        kind="disk",
                        name=record["name"],
                        run_id=record["run"],
                        expires_at=float(record.get("expires") or 0),
                        detail=record["disk"],
                    )
                )
        return found

    def _is_clone_dataset(self, ds: str) -> bool:
        name = ds[len(self.host.dataset) + 1 :]
        return ds.startswith(f"{self.host.dataset}/") and name.startswith("lab-") and bool(USABLE_NAME.match(name))

    def still_owned(self, item: Owned) -> bool:
        """Before gc removes a disk it listed: is it still the lab's, of that run?"""
        if self.host.driver == "bhyve":
            ds = item.detail.removeprefix("zfs:")
            res = self.shell.run(
                ["zfs", "get", "-H", "-p", "-o", "value", "lab:run", ds], what="zfs get", check=False, timeout=60
            )
            return res.ok and self._is_clone_dataset(ds) and res.stdout.strip() == item.run_id
        text = self.shell.read(self.lease_path(item.name))
        try:
            record = self._qemu_lease(json.loads(text)) if text else None
        except (ValueError, AttributeError):
            return False
        return record is not None and record["run"] == item.run_id and record["disk"] == item.detail

    def remove_clone(self, name: str, disk_ref: str, problems: list[str]) -> None:
        """A clone's disk, then (QEMU) its other files and its lease; what fails joins `problems`
        (the lease stays while its disk does: gc finds it again)."""
        try:
            self.remove(disk_ref)
        except LabError as exc:
            problems.append(f"disk {disk_ref}: {exc}")
            return
        if self.host.driver != "qemu" or not name:
            return
        for path in self.clone_files(name):
            try:
                self.shell.run_argv(self.remove_argv(f"file:{path}"), timeout=60, what="rm")
            except LabError as exc:
                problems.append(f"{path}: {exc}")

    # -- golden images ----------------------------------------------------------------------------------

    def golden_source(self, image: ImageRef) -> str:
        """bhyve: the golden snapshot clones are made from; QEMU: the golden qcow2 on the host."""
        if self.host.driver == "bhyve":
            return self.host.golden.format(dataset=self.host.dataset, image=image.name, digest=image.digest)
        path = Path(image.path)
        root = self.golden_root(image)
        return f"{root}/{path.name}" if root else str(path.resolve())

    def publish_dir(self) -> str:
        """QEMU: where goldens are published: images_dir, else the clone directory."""
        return (self.host.images_dir or self.clone_dir()).rstrip("/")

    def golden_root(self, image: ImageRef) -> str | None:
        """QEMU: the host directory holding `image` in the images/ layout (NAME.qcow2, NAME/vmlinuz,
        NAME/initrd.img, NAME.json), or None when the host is this machine and the image is used
        where `lab images build` left it. A published copy whose manifest names another recipe
        digest is stale and refused: a run must measure the image it records."""
        if image.name in self._golden_roots:
            return self._golden_roots[image.name]
        root = self.publish_dir()
        text = self.shell.read(f"{root}/{image.name}.json")
        found: str | None = None
        if text is not None:
            digest = manifest_digest(text)
            if image.digest and digest != image.digest:
                raise UsageError(
                    f"image {image.name!r} on host {self.host.name!r} ({root}) is recipe "
                    f"{digest[:12] or 'unknown'}, this lab's is {image.digest[:12]}",
                    hint=f"lab images publish {image.name} {self.host.name}",
                )
            found = root
        elif self.host.images_dir:
            found = root  # a directory the user fills by hand: trusted as it is
        elif self.shell.remote:
            raise UsageError(
                f"image {image.name!r} is not on host {self.host.name!r} (no {root}/{image.name}.json)",
                hint=f"lab images publish {image.name} {self.host.name}",
            )
        self._golden_roots[image.name] = found
        return found

    def forget_golden(self, image: ImageRef) -> None:
        """A publish changed where the image is: look again on next use."""
        self._golden_roots.pop(image.name, None)

    def golden_snapshot_state(self, snap: str) -> str | None:
        """bhyve: the lab:digest property of the golden snapshot ("-" when unset), None if absent."""
        res = self.shell.run(
            ["zfs", "list", "-H", "-t", "snapshot", "-o", "name,lab:digest", snap],
            what="zfs list",
            check=False,
            timeout=60,
        )
        if not res.ok:
            return None
        parts = res.stdout.strip().split("\t")
        return parts[1] if len(parts) == 2 else "-"

    def check_image(self, image: ImageRef) -> None:
        """The golden image is on the host and is this recipe; UsageError naming what to publish."""
        if self.host.test_uri:
            return
        if self.host.driver == "qemu":
            self.golden_root(image)
            return
        snap = self.golden_source(image)
        state = self.golden_snapshot_state(snap)
        if state is None:
            raise UsageError(
                f"golden snapshot {snap} of image {image.name!r} is not on host {self.host.name!r}",
                hint=f"lab images publish {image.name} {self.host.name}",
            )
        if state not in ("-", "") and image.digest and state != image.digest:
            raise UsageError(
                f"golden snapshot {snap} on host {self.host.name!r} is recipe {state[:12]}, "
                f"this lab's is {image.digest[:12]}",
                hint=f"put {{digest}} in {self.host.where}golden, then lab images publish",
            )
