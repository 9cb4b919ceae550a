"""Writing a file the user named (`lab report -o`, `lab reproduce --out`, `lab images render`):
the one way the lab puts a file where it was told to.

The lab often runs as root, so a name on its command line must not become a way to replace
something that is not a plain file of the user's:

- the target must be missing or a regular file: a symbolic link, a device node (`/dev/stdout`, a
  disk), a FIFO, a socket or a directory is refused (UsageError: one line naming the file, exit
  2, nothing written);
- `replace=False` refuses an existing file too (the user's own scripts stay theirs) and never
  replaces one even if it appears meanwhile (the new file is linked in, which fails if the name
  is taken);
- the text goes to a temporary file beside the target (O_EXCL, never through a link), given its
  mode, then renamed over the target: a reader sees the old file or the new one, never half of
  one. On any error (a full disk: ENOSPC) the temporary file is removed and the one-line error
  names the target (LabError, exit 1).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from lab.errors import LabError, UsageError

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


def ordinary_mode() -> int:
    """The mode a new file gets from this process's umask (0644 under umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def problem(path: Path, *, replace: bool = True) -> str | None:
    """Why `path` cannot be written (None: it can): what it is, if it is not a regular file; that
    it exists, when it may not be replaced."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return "cannot be made: a part of its folder's path is a file, not a directory"
    except OSError as exc:
        return f"cannot be looked at: {exc.strerror}"
    kind = stat.S_IFMT(st.st_mode)
    if kind != stat.S_IFREG:
        return f"is {KINDS.get(kind, 'not a regular file')}, not a regular file: refusing to replace it"
    if not replace:
        return "exists: refusing to replace a file the lab did not write here (--force replaces it)"
    return None


def check(path: Path | str, *, replace: bool = True) -> Path:
    """`path` as a target `write` may use; UsageError (one line naming it, exit 2) if not."""
    path = Path(path)
    why = problem(path, replace=replace)
    if why:
        raise UsageError(f"{path} {why}")
    return path


def check_dir(path: Path | str) -> Path:
    """A directory the lab may write files into (made by `write` if missing): not a symbolic link,
    not a file. UsageError (one line, exit 2) otherwise."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise UsageError(f"{path} cannot be looked at: {exc.strerror}") from None
    kind = stat.S_IFMT(st.st_mode)
    if kind != stat.S_IFDIR:
        raise UsageError(f"{path} is {KINDS.get(kind, 'a regular file')}, not a directory: refusing it")
    return path


def write(path: Path | str, data: str | bytes, *, mode: int | None = None, replace: bool = True) -> Path:
    """Write `data` to `path` whole (see the module's rules). `mode`: the file's permission bits
    (default: what the umask gives a new file). Missing parent directories are made."""
    path = check(path, replace=replace)
    mode = ordinary_mode() if mode is None else mode
    blob = data.encode("utf-8") if isinstance(data, str) else data
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _failed(path, exc) from None
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
    except OSError as exc:
        raise _failed(path, exc) from None
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)  # a link planted meanwhile is replaced, never written through
        else:
            os.link(tmp, path, follow_symlinks=False)  # FileExistsError if the name was taken meanwhile
            os.unlink(tmp)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, FileExistsError):
            raise UsageError(f"{path} exists: refusing to replace a file the lab did not write here") from None
        if isinstance(exc, OSError):
            raise _failed(path, exc) from None
        raise
    return path


def _failed(path: Path, exc: OSError) -> LabError:
    return LabError(f"{path}: cannot be written: {exc.strerror or exc}; nothing was written there")
