"""Paths of this machine that a lab.toml names, read one way everywhere.

The rule: `~` and `~user` are expanded as a shell would, and a relative path is relative to the
lab.toml's folder (never to the directory `lab` happens to run in). That holds for `[lab] results`,
secret files (`file:PATH`), `ca_file`, `client_identity`, `client_known_hosts` and `ssh_key`. A
directory the lab keeps state in for every lab of the machine (a `workdir`, `vagrant_home`) must be
absolute once `~` is expanded: a relative one would be another directory for each lab.toml.

A file the lab reads (a key, a certificate, a known_hosts file, a secret) must be a regular file:
a directory, a FIFO, a socket or a device is refused in one line, never opened (a FIFO would hang
the read, a device would be read as if it were the file). Paths on a remote host (a libvirt
host's `dir`, a SmartOS image) are the host's and are taken as they are.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def home() -> Path | None:
    """This user's home: $HOME, else its passwd entry's; None when it has neither."""
    if os.environ.get("HOME"):
        return Path(os.environ["HOME"])
    try:
        return Path(pwd.getpwuid(os.geteuid()).pw_dir)
    except KeyError:
        return None


def no_home() -> str:
    return f"HOME is not set and uid {os.geteuid()} has no passwd entry"


def expand(value: str) -> Path:
    """`value` with `~` / `~user` expanded; ValueError when that home cannot be found."""
    if value == "~" or value.startswith("~/"):
        where = home()
        if where is None:
            raise ValueError(f"cannot expand ~: {no_home()}")
        return where / value[2:] if len(value) > 2 else where
    try:
        return Path(value).expanduser()
    except RuntimeError:  # ~user with no such user
        raise ValueError(f"{value}: names a home directory that cannot be found") from None


def local(value: str, base_dir: Path | str | None) -> Path:
    """A path a lab.toml names: `~` expanded, a relative one against `base_dir` (the lab.toml's
    folder; this process's directory when there is none)."""
    path = expand(value)
    return path if path.is_absolute() else Path(base_dir or Path.cwd()) / path


def absolute_dir(value: str) -> Path:
    """A state directory a lab.toml names: `~` expanded, and then absolute (ValueError if not)."""
    path = expand(value)
    if not path.is_absolute():
        raise ValueError("must be an absolute path (or start with ~): it is shared by every lab of this machine")
    return path


def not_regular(path: Path) -> str | None:
    """Why `path` is no regular file (following a symbolic link, as opening it would), or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return exc.strerror or str(exc)
    if stat.S_ISREG(mode):
        return None
    return "is " + KINDS.get(stat.S_IFMT(mode), "not a regular file")


def read_regular(path: Path, limit: int = 1 << 20) -> bytes:
    """Up to `limit` bytes of a regular file. OSError (its strerror says why) for anything else: the
    file is opened without blocking and checked before a byte is read, so a FIFO put in its place
    never hangs the lab and a device is never read."""
    why = not_regular(path)  # a device is not even opened (opening one may do something)
    if why:
        raise OSError(0, why)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped meanwhile
            raise OSError(0, "is " + KINDS.get(stat.S_IFMT(mode), "not a regular file"))
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
