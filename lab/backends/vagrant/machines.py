"""The machine directories of a Vagrant host's work directory, `<workdir>/<run>/<vm>/`: which are the
lab's (lab.backends.vagrant.lease), and how one is removed (`vagrant destroy`, then whatever of its
domain and volume is left, then the directory).

Vagrant runs the Vagrantfile of the directory it is run in (Ruby) as this user, so it runs only in a
directory the lab made for that machine, in a work directory this user alone may write to: a
directory planted there, or a lease.json that is not the lab's, is never run. A `vagrant up` of a
dead run still running there is stopped first; a domain define it had already sent to libvirtd may
land a moment after the machine was removed, so its removal watches for SETTLE_S and removes that
too (the next `lab gc` would otherwise find it: lab.gc knows its run is dead).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

from lab import statedir
from lab.backends.vagrant.lease import LEASE_FILE, parse_lease, read_lease
from lab.backends.vagrant.settings import Settings
from lab.backends.vagrant.tools import Vagrant, Virsh
from lab.errors import LabError, TeardownError
from lab.wait import wait_until

# after gc stopped a `vagrant up` of a dead run, how long a domain define it had sent may take to
# land in libvirtd (and is then removed too)
SETTLE_S = 10.0


def processes_in(directory: Path) -> list[int]:
    """`vagrant` processes working in `directory` (the ones lab started there)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")[:2]
                if Path(os.readlink(entry / "cwd")) == directory and any(a.endswith(b"vagrant") for a in argv):
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile, or a kernel thread
                continue
    return pids


def stop_processes_in(directory: Path, timeout: float = 30.0) -> None:
    """End a `vagrant up` still running for a machine whose run died (killed with -9: lab's child
    outlives it in its own session), so `vagrant destroy` gets the machine's lock. SIGTERM to each
    one's process group, SIGKILL to what is left after `timeout`."""
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        pids = processes_in(directory)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), sig)
        with contextlib.suppress(LabError):
            wait_until(lambda: not processes_in(directory), timeout=wait_s, what=f"vagrant in {directory} to end")
    if processes_in(directory):
        raise TeardownError(f"processes in {directory} do not end: {processes_in(directory)}")


class Machines:
    def __init__(self, workdir: Path, vagrant: Vagrant, virsh: Virsh, settings: Settings):
        self.workdir, self.vagrant, self.virsh, self.settings = workdir, vagrant, virsh, settings

    def found(self) -> dict[str, Path]:
        """Machine directories carrying the lab's lease for themselves (lab.backends.vagrant.lease):
        those Vagrant's machine index lists under the work directory (the index is pruned of the
        dead on the way), and those a run killed before `vagrant up` registered the machine left."""
        found: dict[str, Path] = {}
        for path in self.workdir.glob(f"*/*/{LEASE_FILE}"):
            if read_lease(path.parent):
                found[path.parent.name] = path.parent
        for entry in self.vagrant.global_status():
            home = Path(entry.directory)
            if home.parent.parent == self.workdir and read_lease(home):
                found[home.name] = home
        return found

    def remove(self, mdir: Path, domain: str) -> list[str]:
        """`vagrant destroy`, then the domain and its volume by hand if anything is left, then the
        machine's directory. Returns what could not be removed. Vagrant runs only in a machine
        directory the lab made for this domain (`trusted`): never in one planted in its place."""
        problems: list[str] = []
        said = ""
        trusted = self.trusted(mdir, domain)
        interrupted = False
        if trusted:
            interrupted = bool(processes_in(mdir))
            stop_processes_in(mdir)
            if (mdir / "Vagrantfile").is_file():
                res = self.vagrant.run(
                    ["destroy", "-f"],
                    cwd=mdir,
                    timeout=self.settings.destroy_timeout,
                    what="vagrant destroy",
                    check=False,
                )
                if not res.ok:
                    said = ((res.stderr or res.stdout).strip().splitlines() or [f"exit {res.returncode}"])[-1]
        try:
            self.remove_domain(domain)
            if interrupted:  # a `vagrant up` stopped midway: a define it sent may still land in libvirtd
                self.settle(domain)
        except LabError as exc:
            problems.append(str(exc))
        if self.virsh.description(domain) is not None:
            problems.append(f"domain {domain} is still defined" + (f" (vagrant destroy: {said})" if said else ""))
        if f"{domain}.img" in {n for n, _ in self.virsh.volumes(self.settings.storage_pool)}:
            problems.append(f"volume {domain}.img is still in pool {self.settings.storage_pool}")
        if not problems and trusted:
            shutil.rmtree(mdir, ignore_errors=True)
        return problems

    def remove_domain(self, domain: str) -> None:
        if parse_lease(self.virsh.description(domain)) is not None:  # never a domain without the marker
            self.virsh.remove_domain(domain)
        self.virsh.remove_volume(self.settings.storage_pool, f"{domain}.img")

    def settle(self, domain: str) -> None:
        """For SETTLE_S: a domain of this name with the lab's lease that appears is removed too."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if domain in self.virsh.domains():
                self.remove_domain(domain)

    def trusted(self, mdir: Path, domain: str) -> bool:
        """`mdir` is the directory the lab made for `domain`, in a work directory this user alone
        may write to, with the lab's lease for it (lab.backends.vagrant.lease)."""
        return (
            mdir.name == domain
            and mdir.parent.parent == self.workdir
            and statedir.problem(self.workdir) is None
            and bool(read_lease(mdir))
        )
