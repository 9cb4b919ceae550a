"""A lease: what every machine the lab makes carries (the local backend's lease.json, a libvirt
domain's <metadata>, a Proxmox VM's description, a SmartOS VM's customer_metadata, a Vagrant
machine's lease.json and domain description), so that `lab gc` of any machine can tell a live
run's machine from a leftover, even when the results store is gone.

- **Expiry.** `[lab] lease_minutes` from now; renewed while the run lives (lab.runner.renewal,
  every third of it), so a run longer than its lease keeps its machines: a gc that cannot ask
  the run's own locks (another machine's, another state directory's) takes a machine only once
  its run stopped renewing it for `lease_minutes`.
- **Owner.** `<machine>-<nonce>`: the tag of the state directory that made it (one per machine
  and user, made once, kept in the state directory) and a nonce drawn by each `lab run`
  (kept in the run's manifest, `owners`). Run ids are chosen by users (`--run-id nightly`), so two
  stores, or two machines, may run the same id on one cluster: the owner, not the run id, says
  whose a machine is. `lab gc` asks this machine's run locks only about machines this machine
  made, and a store's run lock only about machines that store's runs made (lab.gc).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab import statedir
from lab.errors import LabError

# Renewal: every third of the lease, between these bounds (seconds)
MIN_RENEW_S, MAX_RENEW_S = 1.0, 600.0
# The shortest lease: renewed every second, it still has two renewals' slack
MIN_LEASE_MINUTES = 3 * MIN_RENEW_S / 60
TAG_FILE = "machine-tag"
_TAG = re.compile(r"[0-9a-f]{12}")
OWNER = re.compile(r"(?P<machine>[0-9a-f]{12})-[0-9a-f]{12}")


def expiry(lease_minutes: float, now: float | None = None) -> float:
    """When a machine whose lease is written (or renewed) now may be taken by `lab gc` anywhere."""
    return (time.time() if now is None else now) + lease_minutes * 60


def renew_interval(lease_minutes: float) -> float:
    """Seconds between two renewals of a run's leases: a third of the lease, within the bounds."""
    return min(MAX_RENEW_S, max(MIN_RENEW_S, lease_minutes * 60 / 3))


def machine_tag(state_dir: Path, *, create: bool = False) -> str:
    """This state directory's tag ("" when it has none yet and `create` is false). Made once, with
    O_EXCL (two runs starting at once agree on one), in the private state directory (lab.statedir:
    never through a symbolic link)."""
    path = Path(state_dir) / TAG_FILE
    for _ in range(3):
        try:
            text = statedir.read_text(path).strip()
        except FileNotFoundError:
            text = ""
        except OSError:
            return ""  # a symbolic link, or unreadable: not the lab's tag
        if _TAG.fullmatch(text):
            return text
        if not create:
            return ""
        statedir.ensure(Path(state_dir))
        try:
            fd = statedir.open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                continue  # another run made it meanwhile: read theirs
            raise
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(6) + "\n")
    return machine_tag(state_dir)


def new_owner(state_dir: Path) -> str:
    """A run's owner: this machine's tag and a fresh nonce."""
    return f"{machine_tag(state_dir, create=True)}-{secrets.token_hex(6)}"


def machine_of(owner: str) -> str:
    """The machine tag of an owner ("" for anything else: a lease written before owners existed)."""
    m = OWNER.fullmatch(owner or "")
    return m["machine"] if m else ""


def owner_or_empty(value: object) -> str:
    """An owner read back from a host (anything not of the owner's shape reads as none)."""
    return value if isinstance(value, str) and OWNER.fullmatch(value) else ""


def rewrite(
    where: Path, read: Callable[[], dict[str, Any]], write: Callable[[dict[str, Any]], None], **changes
) -> None:
    """Renew a lease kept in a file (`where`): `read()` it ({} when it is gone or not the lab's),
    `write` it back with `changes`. LabError when there is none to renew or it cannot be written."""
    held = read()
    if not held:
        raise LabError(f"{where} is gone or not the lab's: its lease cannot be renewed")
    try:
        write({**held, **changes})
    except OSError as exc:
        raise LabError(f"cannot write {where}: {exc.strerror}") from None
