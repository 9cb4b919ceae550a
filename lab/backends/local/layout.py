"""How the local backend names what it makes, and the files `lab gc` finds it all by.

- a run: network namespace `lab-<run>`, held by the lock file `<workdir>/lab-<run>.lock` while a
  `lab run` process lives;
- a VM (and the bare-metal cell): directory `<workdir>/lab-<run>-<cell>/` whose `lease.json`
  (run id, expiry, namespace, tap, pid, cgroup) is written before anything else is made, so
  whatever exists can be found and removed even when the results store is gone.

Root removes what a lease names (`lab gc`), so a lease is trusted only when the lab wrote it: it
carries the lab's marker, is written whole (lab.statedir.write_text: never half a file, never
through a symbolic link), names the run and machine of its own directory, and only names what
the lab would have made for that machine (trusted_handle): its run's namespace, a tap of the
lab's naming, the cgroup of that name under the lab's own cgroup parent.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

from lab import names, statedir
from lab.lease import rewrite

LEASE = "lease.json"
MARKER = "lab/local-lease"  # the "marker" of every lease the lab writes
TAP = re.compile(r"tap\d{3}")


def netns_name(run_id: str) -> str:
    """The run's network namespace (its bridge, taps and load generator live there)."""
    return f"lab-{run_id}"


def run_lock_path(workdir: Path, run_id: str) -> Path:
    return workdir / f"{netns_name(run_id)}.lock"


def run_of(name: str) -> str:
    """Pure: the run id in `lab-<run>-<cell>` ("" for a name of another shape: its run cannot be
    told, so `lab gc` never takes it for a dead run's; lab.names)."""
    return names.run_of_machine(name)


def run_of_netns(ns: str) -> str:
    """Pure: the run of `lab-<run>` or of a bare-metal cell's `lab-<run>-bm01` ("" as above)."""
    return names.run_of_netns(ns)


def write_lease(vmdir: Path, lease: dict[str, Any]) -> None:
    statedir.write_text(vmdir / LEASE, json.dumps({**lease, "marker": MARKER}))


def read_lease(vmdir: Path) -> dict[str, Any]:
    """The lease of a machine's directory; {} when it is missing, unreadable, or not the lab's (no
    marker, or a symbolic link)."""
    try:
        lease = json.loads(statedir.read_text(vmdir / LEASE))
    except (OSError, ValueError):
        return {}
    if not isinstance(lease, dict) or lease.get("marker") != MARKER:
        return {}
    return {k: v for k, v in lease.items() if k != "marker"}


_updating = threading.Lock()  # a lease is read, changed and written whole: one change at a time


def update_lease(vmdir: Path, **changes: Any) -> None:
    with _updating:
        write_lease(vmdir, {**read_lease(vmdir), **changes})


def renew_lease(vmdir: Path, expires_at: float) -> None:
    """A live run's machine keeps its lease (lab.runner.renewal); LabError when it has none of the lab's."""
    with _updating:
        rewrite(vmdir / LEASE, lambda: read_lease(vmdir), lambda new: write_lease(vmdir, new), expires_at=expires_at)


def trusted_handle(vmdir: Path, lease: dict[str, Any], cgroup_parent: Path | None) -> dict[str, Any] | None:
    """Pure: what `lab gc` may remove for the machine directory `vmdir` after a crash, from its
    lease (host.remove_machine's handle), or None when the lease is not this directory's (another
    run or machine named in it). Whatever the lab would not have named is dropped: a namespace
    other than the run's (or, for a bare-metal cell, its own), a tap of another shape, a cgroup
    anywhere but `<cgroup_parent>/<directory name>`."""
    name = vmdir.name
    run_id = run_of(name)
    if not lease or not run_id or lease.get("run_id") != run_id or lease.get("vm") != name:
        return None
    own = lease.get("own_netns") is True
    ns = lease.get("netns")
    handle: dict[str, Any] = {"dir": str(vmdir)}
    if ns == (name if own else netns_name(run_id)):
        handle["netns"] = ns
        handle["own_netns"] = own
        if isinstance(lease.get("tap"), str) and TAP.fullmatch(lease["tap"]):
            handle["tap"] = lease["tap"]
    cgroup = lease.get("cgroup")
    if cgroup_parent is not None and isinstance(cgroup, str) and Path(cgroup) == cgroup_parent / name:
        handle["cgroup"] = cgroup
    return handle
