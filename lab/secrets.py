"""Secrets are references in lab.toml ("env:NAME" or "file:PATH"), read only when a backend is built.

A value never appears in an error, a log line or a result, nor in a child process: every variable
a lab.toml references is removed from the environment lab.proc gives the commands it starts
(child_environment), so a guest command, ssh or QEMU never inherits a token. A relative `file:`
path is relative to the lab.toml's folder, like every other path in it; a secret file that its
group or others may read is used, with one warning line (the lab's logger; the CLI prints it).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from lab import paths
from lab.errors import ConfigError

log = logging.getLogger(__name__)

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_referenced: set[str] = set()  # environment variables named by a reference: never passed on
_warned: set[Path] = set()  # secret files already warned about in this process
KEYS = ("token", "password")  # the settings that hold a secret's reference, never its value
SECRET_LIMIT = 64 * 1024  # bytes read of a secret file: a token or password, not a disk


def problem(ref: str) -> str | None:
    """Pure: what is wrong with a secret reference (None: it is well formed)."""
    kind, sep, where = ref.partition(":")
    if not sep or kind not in ("env", "file"):
        return 'must be a reference "env:NAME" or "file:PATH", never the secret itself'
    if not where.strip():
        return f'names no {"variable" if kind == "env" else "file"} after "{kind}:"'
    if kind == "env" and not ENV_NAME.fullmatch(where):
        return "is not an environment variable name (letters, digits and _, not first a digit)"
    return None


def reference(ref: str, source: str, key: str) -> None:
    """Check a reference as lab.toml is read (ConfigError naming file, key and value) and keep its
    variable out of every child process from now on."""
    why = problem(ref)
    if why:
        raise ConfigError(source, key, ref, why)
    if ref.startswith("env:"):
        _referenced.add(ref.removeprefix("env:"))


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the referenced secrets' variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _referenced}
    env.update(extra or {})
    return env


def secret_path(where: str, source: str) -> Path:
    """A `file:` reference's path: `~` expanded, relative ones against the lab.toml's folder
    (lab.paths). ValueError when it names an unknown user's home."""
    return paths.local(where, Path(source).resolve().parent)


def resolve_secret(ref: str | None, source: str, key: str) -> str | None:
    """Read a secret from "env:NAME" or "file:PATH". Errors name the reference, never a value."""
    if ref is None:
        return None
    reference(ref, source, key)
    kind, _, where = ref.partition(":")
    if kind == "env":
        value = os.environ.get(where)
        if not value:
            raise ConfigError(source, key, ref, f"environment variable {where} is not set")
        return value.strip()
    try:
        path = secret_path(where, source)
    except ValueError as exc:
        raise ConfigError(source, key, ref, f"cannot read secret file: {exc}") from None
    try:
        mode = os.stat(path).st_mode
        # a regular file only (a FIFO would hang the read, /dev/zero never end it); a secret is short
        value = paths.read_regular(path, SECRET_LIMIT).decode("utf-8", errors="replace").strip()
    except OSError as exc:
        raise ConfigError(source, key, ref, f"cannot read secret file {path}: {exc.strerror}") from None
    if not value:
        raise ConfigError(source, key, ref, f"secret file {path} is empty")
    if mode & (stat.S_IRGRP | stat.S_IROTH) and path not in _warned:
        _warned.add(path)
        who = (
            "group and others"
            if mode & stat.S_IRGRP and mode & stat.S_IROTH
            else "its group"
            if mode & stat.S_IRGRP
            else "others"
        )
        log.warning(
            "%s: %s: secret file %s is readable by %s (mode %04o); chmod 600 it", source, key, path, who, mode & 0o777
        )
    return value
