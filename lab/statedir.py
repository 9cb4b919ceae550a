"""The lab's private state on this machine, and how it is opened so that no other local user can
plant anything in it.

What lives there: the run locks of backends whose VMs live elsewhere (libvirt, Proxmox), the
KVM probe's verdict, and the local backend's default workdir (clones, leases, run locks). Root
reads those files and acts on them (`lab gc` removes what a lease names), so each directory must
be this user's alone:

- the state directory is `$LAB_STATE_DIR` when set, else /var/lib/lab for root, else
  `$XDG_STATE_HOME/lab` (~/.local/state/lab). One place per machine rather than one per results
  directory: `lab gc` of any lab here must tell a live run from a dead one, and whether KVM works
  is a fact of the machine, not of a lab;
- a private directory is made with mode 0700; an existing one that is a symbolic link, not owned
  by this user, or writable by group or others is refused (UsageError: one line, exit 2), and
  so is one whose parent others may write to without the sticky bit (they could swap it);
- files in it are opened with O_NOFOLLOW (a planted symlink is never followed) and written
  whole: a temporary file made with O_EXCL, then renamed over the old one.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from lab import paths
from lab.errors import UsageError

STATE_ENV = "LAB_STATE_DIR"
ROOT_STATE_DIR = Path("/var/lib/lab")
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


# Where the state directory of a user with no home would be (HOME unset, no passwd entry): no
# directory, but a name that check and ensure refuse with a line saying why, so that the lab
# imports and its commands that need no state (plan, show, report) still work.
NO_HOME = Path("/nonexistent/lab-state")


home, no_home = paths.home, paths.no_home  # one rule for ~ (lab.paths)


def expand_user(path: str) -> Path:
    """`path` with a leading ~ expanded; ValueError (a setting's validators make it one line) when
    there is no home to expand it to."""
    return paths.expand(path)


def default_dir() -> Path:
    """This machine's state directory for the running user (read each time: tests set the variable)."""
    given = os.environ.get(STATE_ENV)
    if given:
        return Path(given)
    if os.geteuid() == 0:
        return ROOT_STATE_DIR
    if os.environ.get("XDG_STATE_HOME"):
        return Path(os.environ["XDG_STATE_HOME"]) / "lab"
    where = home()
    return where / ".local" / "state" / "lab" if where is not None else NO_HOME


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def problem(path: Path) -> str | None:
    """Why an existing directory cannot hold the lab's private state (None: it can, or it does not exist)."""
    if _homeless(path):
        return f"cannot be found: {no_home()} (set ${STATE_ENV})"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"is owned by {_user(st.st_uid)}, not by this user ({_user(os.geteuid())})"
    if st.st_mode & 0o022:
        who = "group and others" if st.st_mode & 0o002 else "its group"
        return f"is writable by {who} (mode {st.st_mode & 0o777:04o})"
    return _open_parent(path)


def _open_parent(path: Path) -> str | None:
    """Why `path`'s folder makes it unsafe: anyone may write to it without the sticky bit (they
    could rename `path` away and put their own in its place)."""
    try:
        parent = os.stat(path.parent)
    except OSError:
        return None
    if parent.st_mode & 0o002 and not parent.st_mode & stat.S_ISVTX:
        return f"lies in {path.parent}, which anyone may write to (no sticky bit)"
    return None


def _refuse(path: Path, what: str, why: str) -> UsageError:
    return UsageError(
        f"{what} {path} {why}: refusing it (its contents may not be the lab's)",
        hint=f"remove it, or choose another directory (${STATE_ENV} for the state directory)",
    )


def _homeless(path: Path) -> bool:
    return path == NO_HOME or NO_HOME in path.parents


def check(path: Path, what: str = "state directory") -> None:
    """Can `path` hold private state? Creates nothing (checks come before anything is made): an
    existing directory must pass `problem`; a missing one needs an existing ancestor that is a
    directory this user can write to."""
    path = Path(path)
    if _homeless(path):
        raise UsageError(f"{what} {path} {problem(path)}")
    why = problem(path)
    if why:
        raise _refuse(path, what, why)
    if path.exists():
        return
    why = _open_parent(path)  # ensure would make it, then refuse it for this: refused now instead
    if why:
        raise _refuse(path, what, why)
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(
            f"{what} {path} cannot be created: {ancestor} is not a directory this user can write to",
            hint="choose another directory, or create it with mode 0700",
        )


def ensure(path: Path, what: str = "state directory") -> Path:
    """`path` as a private directory: made with mode 0700 (its missing parents with 0755) if it does
    not exist, refused (UsageError) if it exists and is not this user's alone."""
    path = Path(path)
    if _homeless(path):
        raise UsageError(f"{what} {path} {problem(path)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)  # mkdir's mode went through the umask
        finally:
            os.close(fd)
    except FileExistsError:
        pass  # made earlier, or by someone else: checked below
    except OSError as exc:
        raise UsageError(f"{what} {path} cannot be created: {exc.strerror}") from None
    why = problem(path)
    if why:
        raise _refuse(path, what, why)
    return path


def open_file(path: Path, flags: int, mode: int = 0o600) -> int:
    """os.open that never follows a symbolic link at `path` (ELOOP instead)."""
    return os.open(path, flags | NOFOLLOW, mode)


def read_text(path: Path) -> str:
    """A file's text, read without following a symbolic link (OSError if it is one)."""
    fd = open_file(path, os.O_RDONLY)
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as fh:
        return fh.read()


def write_text(path: Path, text: str) -> None:
    """Replace `path` whole with `text` (mode 0600): a reader sees the old file or the new one,
    never half of one, and a symbolic link planted at either name is never followed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)  # rename replaces a symlink at `path`; it does not write through it
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
