"""Settings keys that several backends have, each checked one way (a key two backends share must not
be accepted by one and refused by the other, nor mean two things).

Each function is a pydantic field validator's body: it returns the value (normalised) or raises
ValueError with the problem, which lab.config turns into one line naming file, key and value.
Values that end up inside another syntax are held to what that syntax can carry unquoted: an SSH
destination never starts with "-" (ssh would read it as an option), a bridge, a CPU type or a
storage name has no comma (Proxmox VE property strings, QEMU options) and no space.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationInfo

from lab import paths

# [USER@]HOST: letters, digits, . _ - (IPv6 in brackets); never a leading "-" (ssh's options)
# a host name or address as a client or a guest reaches it
_HOST = r"[A-Za-z0-9.][A-Za-z0-9.-]*|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*|\[[0-9A-Fa-f:.]+\]"
HOST = re.compile(_HOST)
SSH_DESTINATION = re.compile(rf"(?:[A-Za-z0-9_.][A-Za-z0-9_.-]*@)?(?:{_HOST})")
# a network interface (Linux and FreeBSD: at most 15 characters) that is also a PVE bridge id
BRIDGE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,14}")
# `ip netns` names: a file name in /run/netns
NETNS = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63}")
# a PVE storage id (pve-storage-id) and CPU type (pve-vm-cpu-conf's cputype): what their property strings carry
PVE_STORAGE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]")
CPU_TYPE = re.compile(r"[A-Za-z0-9_.-]+")


def ip_address(v: str) -> str:
    """An IP address (v4 or v6), or "" (none)."""
    if v:
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError("must be an IP address such as 10.0.0.5") from None
    return v


def ssh_destination(v: str) -> str:
    """An SSH destination USER@HOST or HOST, or "" (none)."""
    if v and not SSH_DESTINATION.fullmatch(v):
        raise ValueError('must be an SSH destination such as "root@host.example" (no options, no spaces)')
    return v


def host(v: str) -> str:
    """A host name or an IP address, or "" (none)."""
    if v and (not HOST.fullmatch(v) or v in (".", "..")):
        raise ValueError("must be a host name or an IP address (letters, digits, . - :)")
    return v


def bridge(v: str | None) -> str | None:
    """A bridge's interface name (None or "": the backend's default)."""
    if v and (not BRIDGE.fullmatch(v) or v in (".", "..")):
        raise ValueError("must be a bridge's name: at most 15 letters, digits, . _ - (not first a -)")
    return v


def netns(v: str) -> str:
    """A network namespace of this machine, or "" (none)."""
    if v and (not NETNS.fullmatch(v) or v in (".", "..")):
        raise ValueError("must be a network namespace's name (letters, digits, . _ -; not first a -)")
    return v


def pve_storage(v: str) -> str:
    if not PVE_STORAGE.fullmatch(v):
        raise ValueError("is not a Proxmox VE storage id (letters, digits, . _ -)")
    return v


def cpu_type(v: str) -> str:
    if not CPU_TYPE.fullmatch(v):
        raise ValueError('must be a CPU type such as "host" or "x86-64-v2-AES" (letters, digits, . _ -)')
    return v


def base_dir(info: ValidationInfo) -> Path | None:
    """The lab.toml's folder, which lab.config hands every settings model as context."""
    given: Any = (info.context or {}).get("base_dir")
    return Path(given) if given else None


def regular_file(v: str, info: ValidationInfo, what: str, *, must_exist: bool = True) -> str:
    """A file of this machine the lab reads (lab.paths: `~` expanded, relative to lab.toml's folder):
    a regular file; with must_exist=False a missing one is accepted (its user says what is missing)."""
    path = paths.local(v, base_dir(info))
    if not path.exists() and not path.is_symlink():
        if must_exist:
            raise ValueError(f"no such file: {path} ({what})")
        return str(path)
    why = paths.not_regular(path)
    if why:
        raise ValueError(f"{path} {why if why.startswith('is ') else 'cannot be read: ' + why} ({what})")
    return str(path)


def state_dir(v: str) -> str:
    """A directory the lab keeps its state in for every lab of this machine (lab.paths.absolute_dir)."""
    if re.search(r"[\x00-\x1f\x7f]", v):
        raise ValueError("holds a control character")
    path = paths.absolute_dir(v)
    if ".." in path.parts or str(path) == "/":
        raise ValueError("must be a directory of its own (no '..', not /)")
    return str(path)
