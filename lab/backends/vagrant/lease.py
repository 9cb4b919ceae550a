"""The lease of a Vagrant machine of the lab, in the two places `lab gc` finds it: the machine's
`lease.json` in `<workdir>/<run>/<vm>/` and its libvirt domain's <description>.

`lab gc` runs `vagrant destroy` in a machine's directory, and Vagrant runs the Vagrantfile there
(Ruby) as this user: so a directory is the lab's only when the work directory passes the state
directory's rules (lab.statedir: this user's alone), the directory is no symbolic link, and its
lease.json carries the lab's marker, is written whole (never through a symbolic link), and names
the run and machine of the directory it is in. Anything else is left alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from lab import statedir
from lab.lease import rewrite

LEASE_FILE = "lease.json"
FILE_MARKER = "lab/vagrant-lease"  # the "marker" of every lease.json the lab writes
# the domain's <description>: written raw into the domain XML by vagrant-libvirt, so plain words
MARKER = "lab-lease"
_RUN = r"[a-z0-9][a-z0-9-]*"  # lab run ids (`lab run --run-id`)
_LEASE_RE = re.compile(
    rf"^{MARKER} run=(?P<run>{_RUN}) cell=(?P<cell>\S+) expires=(?P<expires>\d+) host=(?P<host>\S+)"
    r"(?: owner=(?P<owner>[0-9a-f-]+))?$"
)


def lease_text(run_id: str, cell_id: str, expires_at: float, host: str, owner: str = "") -> str:
    text = f"{MARKER} run={run_id} cell={cell_id} expires={int(expires_at)} host={host}"
    return f"{text} owner={owner}" if owner else text


def parse_lease(text: str | None) -> dict[str, str] | None:
    """The lease a domain's <description> carries; None when it carries none (not the lab's)."""
    m = _LEASE_RE.match((text or "").strip())
    if not m:
        return None
    return {k: v for k, v in m.groupdict().items() if v is not None}


def write_lease(mdir: Path, lease: dict[str, Any]) -> None:
    statedir.write_text(mdir / LEASE_FILE, json.dumps({**lease, "marker": FILE_MARKER}, sort_keys=True) + "\n")


def read_lease(mdir: Path) -> dict[str, Any]:
    """The lease of a machine directory; {} unless the lab wrote it for this very directory (see the
    module's docstring)."""
    if mdir.is_symlink() or mdir.parent.is_symlink() or not mdir.is_dir():
        return {}
    try:
        lease = json.loads(statedir.read_text(mdir / LEASE_FILE))
    except (OSError, ValueError):
        return {}
    if not isinstance(lease, dict) or lease.get("marker") != FILE_MARKER:
        return {}
    if lease.get("run") != mdir.parent.name or lease.get("domain") != mdir.name:
        return {}
    return {k: v for k, v in lease.items() if k != "marker"}


def renew_file(mdir: Path, expires_at: float) -> None:
    rewrite(mdir / LEASE_FILE, lambda: read_lease(mdir), lambda new: write_lease(mdir, new), expires=expires_at)
