"""Storages and their volumes (VM disks, cloud-init drives, uploads): the per-storage allocation lock
that parallel clones contend for, volume paths as PVE shows them, and the storage endpoints: list,
content (list, get, delete) and the multipart upload (iso, vztmpl, and `import` from 8.3)."""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .auth import require
from .state import PveError, Storage, VmState, Volume, bad_param, fail, handler
from .tasks import new_task

if TYPE_CHECKING:
    from .server import PveEmulator

IMPORT_EXT = re.compile(r"\.(ova|qcow2|raw|vmdk)$")
UPLOAD_EXT = {"iso": re.compile(r"\.(iso|img)$"), "vztmpl": re.compile(r"\.tar\.(gz|xz|zst)$"), "import": IMPORT_EXT}
CONTENT_DIRS = {"iso": "template/iso", "vztmpl": "template/cache", "import": "import", "images": "images"}


def add_volume(
    emu: PveEmulator,
    node: str,
    volid: str,
    content: str,
    fmt: str,
    size: int,
    vmid: int | None,
    *,
    parent: str | None = None,
    file: Path | None = None,
    external: bool = False,
) -> Volume:
    storage = emu.storages[volid.split(":", 1)[0]]
    key = ("" if storage.shared else node, volid)
    vol = Volume(volid, key[0], content, fmt, size, vmid, parent, file, external)
    emu.volumes[key] = vol
    return vol


def find_volume(emu: PveEmulator, node: str, volid: str) -> Volume | None:
    storage = emu.storages.get(volid.split(":", 1)[0])
    if storage is None:
        return None
    return emu.volumes.get(("" if storage.shared else node, volid))


def drop_volume(emu: PveEmulator, vol: Volume) -> None:
    emu.volumes.pop((vol.node, vol.volid), None)
    if vol.file is not None and not vol.external:
        vol.file.unlink(missing_ok=True)


def vm_volumes(emu: PveEmulator, vm: VmState) -> list[Volume]:
    return [v for v in emu.volumes.values() if v.vmid == vm.vmid and v.node in ("", vm.node)]


def file_for(emu: PveEmulator, node: str, volid: str, suffix: str = "") -> Path:
    """Where the data of a volume lives on this machine (QEMU backing and uploads)."""
    d = emu._data_dir / node / volid.split(":", 1)[0]
    d.mkdir(parents=True, exist_ok=True)
    return d / (volid.split(":", 1)[1].replace("/", "_") + suffix)


def storage_start(emu: PveEmulator, storage: str, seconds: float) -> float | None:
    """Earliest delay (from now) at which an allocation may hold the storage lock, or None when the
    wait would exceed storage_lock_timeout (storage_slots allocations hold it at once)."""
    now = time.monotonic()
    emu._storage_busy = [b for b in emu._storage_busy if b[2] > now]
    busy = [(s, e) for st, s, e in emu._storage_busy if st == storage]
    for t in sorted({now, *(e for _, e in busy)}):
        overlapping = sum(1 for s, e in busy if s < t + seconds and e > t)
        if overlapping < emu.storage_slots:
            if t - now > emu.storage_lock_timeout:
                return None
            emu._storage_busy.append((storage, t, t + seconds))
            return t - now
    return None


def storage_lock_error(emu: PveEmulator, storage: str) -> str:
    """A node-local storage's file lock; a shared one's is pmxcfs's cluster lock (cfs_lock_storage)."""
    if emu.storages[storage].shared:
        return f"clone failed: cfs-lock 'storage-{storage}' error: got lock request timeout"
    return f"clone failed: can't lock file '/var/lock/pve-manager/pve-storage-{storage}' - got timeout"


def volume_path(emu: PveEmulator, vol: Volume) -> str:
    st = emu.storages[vol.storage]
    if st.type == "dir" and st.path:
        sub = CONTENT_DIRS.get(vol.content, "images")
        name = vol.name.split("/", 1)[1] if "/" in vol.name else vol.name
        return f"{st.path}/{sub}/{name}"
    if st.type == "lvmthin":
        return f"/dev/pve/{vol.name}"
    return f"/dev/{st.name}/{vol.name}"


def storage_of(emu: PveEmulator, name: str) -> Storage:
    st = emu.storages.get(name)
    if st is None:
        raise fail(f"storage '{name}' does not exist")
    return st


def _volume_entry(vol: Volume) -> dict:
    out = {"volid": vol.volid, "content": vol.content, "format": vol.format, "size": vol.size, "ctime": vol.ctime}
    if vol.vmid is not None:
        out["vmid"] = vol.vmid
    if vol.parent:
        out["parent"] = vol.parent.split(":", 1)[1]
    return out


@handler("GET", "/nodes/{node}/storage")
def _storage_list(emu: PveEmulator, p, who):
    want = set(filter(None, re.split(r"[,;\s]+", p.get("content", ""))))
    out = []
    for st in emu.storages.values():
        if want and not want & st.content:
            continue
        out.append(
            {
                "storage": st.name,
                "type": st.type,
                "content": ",".join(sorted(st.content)),
                "active": 1,
                "enabled": 1,
                "shared": int(st.shared),
                "total": 100 * 1024**3,
                "used": 10 * 1024**3,
                "avail": 90 * 1024**3,
            }
        )
    return out


@handler("GET", "/nodes/{node}/storage/{storage}/content")
def _content_list(emu: PveEmulator, p, who):
    st = storage_of(emu, p["storage"])
    return [
        _volume_entry(v)
        for v in emu.volumes.values()
        if v.storage == st.name and v.node in ("", p["node"]) and p.get("content") in (None, v.content)
    ]


def _content_volume(emu: PveEmulator, p) -> Volume:
    st = storage_of(emu, p["storage"])
    volid = p["volume"] if ":" in p["volume"] else f"{st.name}:{p['volume']}"
    vol = find_volume(emu, p["node"], volid)
    if vol is None or vol.storage != st.name:
        raise fail(f"volume '{volid}' does not exist")
    return vol


@handler("GET", "/nodes/{node}/storage/{storage}/content/{volume}")
def _content_get(emu: PveEmulator, p, who):
    vol = _content_volume(emu, p)
    return {"path": volume_path(emu, vol), "size": vol.size, "used": vol.size, "format": vol.format}


@handler("DELETE", "/nodes/{node}/storage/{storage}/content/{volume}")
def _content_delete(emu: PveEmulator, p, who):
    vol = _content_volume(emu, p)
    require(who, f"/storage/{vol.storage}", "Datastore.Allocate")
    if vol.vmid is not None and vol.vmid in emu.vms:
        raise fail(f"unable to delete '{vol.volid}' - volume is used by VM {vol.vmid}")
    return new_task(emu, p["node"], "imgdel", "", who, emu.task_seconds["imgdel"], on_ok=lambda: drop_volume(emu, vol))


@handler("POST", "/nodes/{node}/storage/{storage}/upload")
def _upload(emu: PveEmulator, p, who):
    st = storage_of(emu, p["storage"])
    upload = emu._upload
    if upload is None:
        raise bad_param("filename", "no file uploaded")
    if p["node"] != emu.node:  # uploads are never proxied to another node
        raise fail("unable to proxy file uploads")
    content = p["content"]
    if content not in st.content:
        raise fail(f"storage '{st.name}' does not support '{content}' content")
    name = p["filename"]
    if not re.fullmatch(r"[-\w.]+", name) or not UPLOAD_EXT[content].search(name):
        raise bad_param(
            "filename", "invalid filename or wrong extension" if content == "import" else "wrong file extension"
        )
    volid = f"{st.name}:{content}/{name}"  # local:iso/x.img, local:import/x.qcow2
    if find_volume(emu, p["node"], volid) is not None:
        raise fail(f"refusing to override existing file '{name}'")  # wording approximated
    tmp, size = upload
    path = tmp + ".task"
    os.replace(tmp, path)  # the task owns the file now (the HTTP layer removes what nobody took)
    fmt = name.rsplit(".", 1)[-1] if content == "import" else content

    def ok():
        if p.get("checksum"):
            algo = p.get("checksum-algorithm", "sha256")
            with open(path, "rb") as fh:
                got = hashlib.file_digest(fh, algo).hexdigest()
            if got != p["checksum"].lower():
                raise fail(f"checksum mismatch: got '{got}' != expected '{p['checksum']}'")
        vol = add_volume(emu, p["node"], volid, content, fmt, size, None)
        vol.file = file_for(emu, p["node"], volid)
        os.replace(path, vol.file)

    def failed():
        Path(path).unlink(missing_ok=True)

    return new_task(
        emu,
        p["node"],
        "imgcopy",
        "",
        who,
        emu.task_seconds["imgcopy"],
        on_ok=ok,
        on_fail=failed,
        log=[
            f"starting file import from: {path}",
            f"target node: {p['node']}",
            f"target file: {volume_path(emu, Volume(volid, '', content, fmt, size))}",
            f"file size is: {size}",
        ],
    )


def import_source(emu: PveEmulator, node: str, key: str, source: str, who) -> Volume:
    """The volume `import-from=` names, with PVE's checks (qemu-server's import-from handling)."""
    if source.startswith("/"):
        if who is None or who.userid != "root@pam":  # tokens are never root
            raise PveError(403, "Permission check failed (Only root can pass arbitrary filesystem paths.)")
        for vol in emu.volumes.values():
            if vol.node in ("", node) and volume_path(emu, vol) == source:
                return vol
        raise fail(f"could not get size of '{source}'")
    vol = find_volume(emu, node, source)
    if vol is None:
        raise fail(f"no such volume '{source}'")
    if vol.content not in ("images", "import"):
        raise bad_param(key, f"{source} has wrong type '{vol.content}' - needs to be 'images' or 'import'")
    return vol
