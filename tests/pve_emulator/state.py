"""The emulated cluster's records (principals, tasks, VMs, storages, volumes), PVE's error, and the
handler registry each endpoint module adds its handlers to."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

VERSIONS = {"7.4": "7.4-3", "8.4": "8.4.1", "9.1": "9.1.2"}  # GET /version's `version` per schema
ALL = object()  # every privilege (root@pam)


class PveError(Exception):
    """An answer other than 200: the message goes into the HTTP reason phrase, like pve-http-server."""

    def __init__(self, status: int, message: str, errors: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.errors = status, message, errors


def fail(message: str) -> PveError:
    """PVE's most common answer: a plain 500 with the handler's `die` message."""
    return PveError(500, message)


def bad_param(name: str, message: str) -> PveError:
    return PveError(400, "Parameter verification failed.", {name: message})


@dataclass
class Principal:
    userid: str  # user@realm, or user@realm!tokenid for a token
    acl: dict[str, set[str]] | object  # path -> privileges, or ALL

    def privs_at(self, path: str) -> set[str] | object:
        if self.acl is ALL:
            return ALL
        got: set[str] = set()
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts) + 1):
            got |= set(self.acl.get("/" + "/".join(parts[:i]), ()))  # ACLs propagate down
        return got

    def has(self, path: str, priv: str) -> bool:
        have = self.privs_at(path)
        return have is ALL or priv in have


@dataclass
class Task:
    upid: str
    node: str
    type: str
    id: str
    user: str
    pid: int
    pstart: int
    starttime: int
    start: float
    end: float
    error: str | None = None  # final exitstatus when it fails
    log: list[str] = field(default_factory=list)
    on_ok: Callable[[], None] | None = None
    on_fail: Callable[[], None] | None = None
    done: bool = False
    exitstatus: str | None = None


@dataclass
class VmState:
    vmid: int
    node: str
    config: dict
    running: bool = False
    booted_at: float | None = None
    linked_base: int | None = None  # template vmid a linked clone depends on
    hold_lock: tuple[str, float] | None = None  # (lock, until) injected by a test
    dhcp_ip: str = ""
    created_at: float = field(default_factory=time.monotonic)
    flock_until: float = 0.0  # the flock on /var/lock/qemu-server/lock-<vmid>.conf is held until
    ha_managed: bool = False
    guest: object | None = None  # the QEMU guest behind a running VM (QemuBacking)


@dataclass
class Storage:
    name: str
    type: str  # dir, lvmthin, rbd, ...
    content: set[str]
    shared: bool = False
    path: str = ""  # dir storages: the mount point files live under on the node


@dataclass
class Volume:
    volid: str  # storage:name
    node: str  # "" when the storage is shared
    content: str  # images, rootdir, iso, import, vztmpl
    format: str
    size: int
    vmid: int | None = None
    parent: str | None = None  # base volume of a linked clone
    file: Path | None = None  # real data (uploads; disks when QEMU-backed)
    external: bool = False  # the file belongs to someone else (the golden image): never deleted
    ctime: int = field(default_factory=lambda: int(time.time()))

    @property
    def storage(self) -> str:
        return self.volid.split(":", 1)[0]

    @property
    def name(self) -> str:
        return self.volid.split(":", 1)[1]


def new_uuid() -> str:
    h = secrets.token_hex(16)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# (METHOD, schema path) -> handler(emu, typed params, principal or None)
HANDLERS: dict[tuple[str, str], Callable] = {}


def handler(method: str, path: str):
    def deco(fn):
        HANDLERS[(method, path)] = fn
        return fn

    return deco
