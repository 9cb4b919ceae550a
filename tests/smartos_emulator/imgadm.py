"""Emulated `imgadm` (imgadm(8)): list / get / install / create / delete / import / sources.

An image is a manifest plus a file. On SmartOS the file is a (compressed) `zfs send` stream of the
image's dataset; here an uncompressed one is a qcow2 of the zvol (GlobalZoneEmulator.zfs_send:
about the size of the data, as a send stream is) and a gzip'd one the zvol's raw bytes: only this
emulator reads it.
`install` checks the manifest's required fields and the file's size and sha1 against
`files[0]`, as imgadm does; `create` makes both from a stopped VM's boot disk; `delete` refuses an
image VMs are cloned from. No image source is configured (the host is offline): `import` fails.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab.errors import LabError

from .schema import HVM, UUID

if TYPE_CHECKING:
    from .gz import GlobalZoneEmulator, Io

REQUIRED = ("v", "uuid", "name", "version", "type", "os", "files")
TYPES = ("zone-dataset", "lx-dataset", "zvol", "docker", "other")
OSES = ("smartos", "linux", "windows", "bsd", "illumos", "other")
COMPRESSION = {"none": "", "gzip": ".gz"}


@dataclass
class Image:
    manifest: dict[str, Any]
    file: Path  # the dataset's content: raw zvol bytes
    clones: set[str] = field(default_factory=set)

    def entry(self) -> dict[str, Any]:
        return {"manifest": self.manifest, "zpool": "zones", "clones": len(self.clones)}


class ImgadmError(Exception):
    def __init__(self, kind: str, message: str, code: int = 1):
        super().__init__(f"imgadm: error ({kind}): {message}")
        self.code = code


def sha1_of(path: Path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Imgadm:
    def __init__(self, gz: GlobalZoneEmulator):
        self.gz = gz
        self.images: dict[str, Image] = {}

    def main(self, args: list[str], io: Io) -> int:
        if not args:
            io.err("usage: imgadm [<options>] <command> [<args>...]\n")
            return 2
        handler = getattr(self, f"cmd_{args[0]}", None)
        if handler is None:
            io.err(f"imgadm: the emulator does not implement `imgadm {args[0]}`\n")
            return 2
        try:
            return handler(args[1:], io)
        except ImgadmError as exc:
            io.err(f"{exc}\n")
            return exc.code

    @staticmethod
    def _opts(rest: list[str], with_value: str, flags: str = "") -> tuple[dict[str, str | bool], list[str]]:
        opts: dict[str, str | bool] = {}
        args = []
        it = iter(rest)
        for a in it:
            if len(a) == 2 and a[0] == "-" and a[1] in with_value:
                value = next(it, None)
                if value is None:
                    raise ImgadmError("Usage", f"option {a} needs a value", 2)
                opts[a[1]] = value
            elif len(a) == 2 and a[0] == "-" and a[1] in flags:
                opts[a[1]] = True
            elif a.startswith("-") and a != "-":
                raise ImgadmError("Usage", f"unknown option {a}", 2)
            else:
                args.append(a)
        return opts, args

    def _pool(self, opts: dict) -> None:
        if opts.get("P", "zones") != "zones":
            raise ImgadmError("Usage", f"no zpool {opts['P']!r}", 2)

    def image(self, uuid: str) -> Image:
        image = self.images.get(uuid)
        if image is None:
            raise ImgadmError("ImageNotInstalled", f"image {uuid} was not found on zpool zones", 3)
        return image

    # -- reading ----------------------------------------------------------------------------------------
    def cmd_list(self, rest: list[str], io: Io) -> int:
        opts, filters = self._opts(rest, "os", "jH")
        found = []
        for image in self.images.values():
            flat = {k: v for k, v in image.manifest.items() if not isinstance(v, (dict, list))}
            ok = True
            for f in filters:
                key, _, want = f.partition("=")
                have = str(flat.get(key, "")).lower() if isinstance(flat.get(key), bool) else str(flat.get(key, ""))
                ok = ok and (want[1:] in have if want.startswith("~") else have == want)
            if ok:
                found.append(image)
        if opts.get("j"):
            io.out(json.dumps([i.entry() for i in found], indent=2) + "\n")
            return 0
        fields = str(opts.get("o", "uuid,name,version,os,published")).split(",")
        rows = [
            [
                str(i.manifest.get(f) if f != "published" else i.manifest.get("published_at", "")[:19] + "Z")
                for f in fields
            ]
            for i in found
        ]
        if not opts.get("H"):
            rows.insert(0, [f.upper() for f in fields])
        io.out("".join("  ".join(row) + "\n" for row in rows))
        return 0

    def cmd_get(self, rest: list[str], io: Io) -> int:
        opts, args = self._opts(rest, "P", "r")
        self._pool(opts)
        if len(args) != 1:
            raise ImgadmError("Usage", "imgadm get [-P <pool>] <uuid>", 2)
        io.out(json.dumps(self.image(args[0]).entry(), indent=2) + "\n")
        return 0

    def cmd_sources(self, rest: list[str], io: Io) -> int:
        opts, _ = self._opts(rest, "adt", "jvcefk")
        if any(k in opts for k in "ade"):
            raise ImgadmError("Usage", "the emulated host is offline: sources cannot be edited", 2)
        io.out("[]\n" if opts.get("j") else "")
        return 0

    def cmd_import(self, rest: list[str], io: Io) -> int:
        _, args = self._opts(rest, "PCS", "q")
        raise ImgadmError(
            "ActiveImageNotFound",
            f"an active image {' '.join(args)} was not found in image sources "
            "(none is configured: the emulated host is offline)",
        )

    # -- writing --------------------------------------------------------------------------------------------
    def cmd_install(self, rest: list[str], io: Io) -> int:
        opts, args = self._opts(rest, "Pmf", "q")
        self._pool(opts)
        if args or "m" not in opts or "f" not in opts:
            raise ImgadmError("Usage", "imgadm install [-P <pool>] -m <manifest> -f <file>", 2)
        try:
            manifest = json.loads(self.gz.read_file(str(opts["m"])))
        except ValueError as exc:
            raise ImgadmError("InvalidManifest", f"{opts['m']} is not JSON: {exc}") from None
        missing = [k for k in REQUIRED if k not in manifest]
        if missing:
            raise ImgadmError("InvalidManifest", f"manifest lacks {', '.join(missing)}")
        if not UUID.match(str(manifest["uuid"])) or manifest["type"] not in TYPES or manifest["os"] not in OSES:
            raise ImgadmError("InvalidManifest", "bad uuid, type or os in the manifest")
        if manifest["uuid"] in self.images:
            io.err(f"Image {manifest['uuid']} ({manifest['name']}@{manifest['version']}) is already installed\n")
            return 0
        src = self.gz.path(str(opts["f"]))
        if not src.is_file():
            raise ImgadmError("FileNotFound", f"{opts['f']}: no such file")
        files = manifest["files"]
        if not (isinstance(files, list) and files and {"sha1", "size", "compression"} <= set(files[0])):
            raise ImgadmError("InvalidManifest", "files[0] needs sha1, size and compression")
        if src.stat().st_size != files[0]["size"]:
            raise ImgadmError(
                "DownloadError", f"image file size {src.stat().st_size} is not the manifest's {files[0]['size']}"
            )
        if sha1_of(src) != files[0]["sha1"]:
            raise ImgadmError("DownloadError", "image file sha1 is not the manifest's files[0].sha1")
        dest = self.gz.path(f"/zones/{manifest['uuid']}/final.img")  # "zfs receive" + @final
        dest.parent.mkdir(parents=True)
        if files[0]["compression"] == "gzip":
            with gzip.open(src, "rb") as fin, open(dest, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
        else:
            try:
                self.gz.zfs_receive(src, dest)
            except LabError as exc:
                shutil.rmtree(dest.parent, ignore_errors=True)
                raise ImgadmError("ZfsReceiveError", f"{opts['f']}: not a stream zfs receive takes: {exc}") from None
        manifest = {**manifest, "state": "active"}
        self.images[manifest["uuid"]] = Image(manifest, dest)
        self.gz.write_file(f"/var/imgadm/images/zones-{manifest['uuid']}.json", json.dumps(manifest))
        io.err(f"Installed image {manifest['uuid']} ({manifest['name']}@{manifest['version']})\n")
        return 0

    def cmd_create(self, rest: list[str], io: Io) -> int:
        opts, args = self._opts(rest, "moscp", "iq")
        for flag, what in (
            ("s", "a prepare-image script (-s)"),
            ("p", "publishing (-p)"),
            ("i", "incremental images (-i)"),
        ):
            if flag in opts:
                raise ImgadmError("Usage", f"the emulator does not do {what}", 2)
        if not args:
            raise ImgadmError("Usage", "imgadm create [<options>] <vm-uuid> [<manifest-field>=<value> ...]", 2)
        vm = self.gz.vmadm.record(args[0], "create an image of")
        fields: dict[str, Any] = {}
        if "m" in opts:
            text = io.stdin_all().decode() if opts["m"] == "-" else self.gz.read_file(str(opts["m"]))
            fields.update(json.loads(text))
        for a in args[1:]:
            key, _, value = a.partition("=")
            try:
                fields[key] = json.loads(value)
            except ValueError:
                fields[key] = value
        comp = str(opts.get("c", "none"))
        if comp not in COMPRESSION:
            raise ImgadmError("Usage", f"compression {comp!r}: the emulator writes none or gzip", 2)
        if vm.brand not in HVM:
            raise ImgadmError("NotSupported", "the emulator makes images of bhyve and kvm VMs only")
        if vm.state != "stopped":
            raise ImgadmError("VmNotStopped", f"VM {vm.uuid} is {vm.state}: stop it first")
        for key in ("name", "version", "os"):
            if key not in fields:
                raise ImgadmError("ManifestValidation", f"manifest field {key!r} is required")
        boot = next((d for d in vm.obj.get("disks", []) if d.get("boot")), None)
        if boot is None:
            raise ImgadmError("NotSupported", f"VM {vm.uuid} has no boot disk")
        base = self.gz.path(str(opts.get("o", f"/var/tmp/{fields['name']}-{fields['version']}")))
        out_file = base.parent / f"{base.name}.zfs{COMPRESSION[comp]}"
        disk = self.gz.path(boot["path"])
        if comp == "gzip":
            with open(disk, "rb") as fin, gzip.open(out_file, "wb", compresslevel=1) as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
        else:
            self.gz.zfs_send(disk, out_file)
        manifest = {
            "v": 2,
            "uuid": str(uuidlib.uuid4()),
            "owner": "00000000-0000-0000-0000-000000000000",
            "state": "active",
            "disabled": False,
            "public": False,
            "published_at": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
            "type": "zvol",
            "requirements": {"brand": vm.brand},
            "image_size": int(boot["size"]),
            **fields,
            "files": [{"sha1": sha1_of(out_file), "size": out_file.stat().st_size, "compression": comp}],
        }
        (base.parent / f"{base.name}.imgmanifest").write_text(json.dumps(manifest, indent=2))
        io.err(f"Created image {manifest['uuid']} ({manifest['name']}@{manifest['version']}) in {base}.*\n")
        return 0

    def cmd_delete(self, rest: list[str], io: Io) -> int:
        opts, args = self._opts(rest, "P")
        self._pool(opts)
        if len(args) != 1:
            raise ImgadmError("Usage", "imgadm delete [-P <pool>] <uuid>", 2)
        image = self.image(args[0])
        if image.clones:
            raise ImgadmError(
                "ImageHasDependentClones", f"image {args[0]} has dependent clones: {', '.join(sorted(image.clones))}"
            )
        del self.images[args[0]]
        shutil.rmtree(image.file.parent, ignore_errors=True)
        self.gz.path(f"/var/imgadm/images/zones-{args[0]}.json").unlink(missing_ok=True)
        io.err(f"Deleted image {args[0]}\n")
        return 0
