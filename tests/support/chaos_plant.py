"""What another user, tool or lab left on this machine under names like the lab's, without the
lab's marker: planted before a chaos run (tests/support/chaos.py, fault "foreign-resources"), then checked
after the run, `lab gc` and `lab gc --force`: `touched()` lists every one that changed or went.

Planted:
- in the local backend's workdir: machine directories `lab-<run>-c01` whose lease.json lacks the
  lab's marker (one naming a live cgroup, one a live network namespace, one only a disk), and a
  lock file `lab-<run>.lock` that holds no pid beside a live namespace of that name;
- a cgroup (under the lab's own cgroup parent) and a network namespace, each with a process in it;
- in the lab's state directory and beside the results store: lock files named like the lab's
  run locks (`proxmox-pve@<run>.lock`, `libvirt-kvm@<run>.lock`, `run-<run>.lock`) holding no pid;
- on qemu:///system: domains named `lab-<run>-c01` without the lab's metadata.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from lab import proc
from lab.backends.local import host as local_host
from support.libvirt_daemons import URI, VIRSH_TIMEOUT

FOREIGN = "someone else's file, not a pid\n"


@dataclass
class Planted:
    files: dict[Path, str] = field(default_factory=dict)  # path -> its content
    dirs: dict[Path, list[str]] = field(default_factory=dict)  # path -> its listing
    netns: list[str] = field(default_factory=list)
    cgroups: list[Path] = field(default_factory=list)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    domains: dict[str, str] = field(default_factory=dict)  # name -> its inactive XML

    def file(self, path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.files[path] = text

    def names(self) -> set[str]:
        """What a leftover count must not take for the run's own: every planted name."""
        return (
            {p.name for p in self.files if p.parent not in self.dirs}
            | {p.name for p in self.dirs}
            | set(self.netns)
            | set(self.domains)
            | {c.name for c in self.cgroups}
        )  # never a bare disk.qcow2

    def touched(self) -> list[str]:
        out = []
        for path, text in self.files.items():
            try:
                if path.read_text() != text:
                    out.append(f"file {path} changed")
            except OSError:
                out.append(f"file {path} removed")
        for path, listing in self.dirs.items():
            if not path.is_dir():
                out.append(f"directory {path} removed")
            elif sorted(p.name for p in path.iterdir()) != listing:
                out.append(f"directory {path} changed")
        out += [f"netns {ns} removed" for ns in self.netns if not local_host.netns_exists(ns)]
        out += [f"cgroup {cg} removed" for cg in self.cgroups if not cg.is_dir()]
        out += [f"process {what} (pid {p.pid}) killed" for what, p in self.processes.items() if p.poll() is not None]
        for name, xml in self.domains.items():
            now = proc.run(["virsh", "-c", URI, "dumpxml", "--inactive", name], check=False, timeout=VIRSH_TIMEOUT)
            if not now.ok:
                out.append(f"libvirt domain {name} removed")
            elif now.stdout != xml:
                out.append(f"libvirt domain {name} changed")
        return out

    def remove(self) -> None:
        """Undo the planting (after the count)."""
        for p in self.processes.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for ns in self.netns:
            proc.run(["ip", "netns", "del", ns], check=False)
        for cg in self.cgroups:
            try:
                cg.rmdir()
            except OSError:
                pass
        for name in self.domains:
            proc.run(["virsh", "-c", URI, "undefine", name], check=False, timeout=VIRSH_TIMEOUT)


def plant_local(planted: Planted, workdir: Path, cgroup_parent: Path | None, tag: str) -> None:
    """Machine directories, a namespace with its lock file, a cgroup: `tag` makes the run ids."""
    cg = cgroup_parent / f"lab-{tag}1-c01" if cgroup_parent is not None else None
    if cg is not None:
        # a suite killed midway (a CI timeout) leaves its planted cgroup: the same foreign thing
        cg.mkdir(exist_ok=True)
        planted.cgroups.append(cg)
        sleeper = proc.spawn(["sh", "-c", f'echo $$ > "{cg}/cgroup.procs" && exec sleep 3600'])
        planted.processes[f"in cgroup {cg.name}"] = sleeper
    ns = f"lab-{tag}2"
    proc.run(["ip", "netns", "delete", ns], check=False)  # a killed suite's (as the cgroup above)
    proc.run(["ip", "netns", "add", ns])
    planted.netns.append(ns)
    planted.processes[f"in netns {ns}"] = proc.spawn(["sleep", "3600"], netns=ns)
    leases = {
        f"lab-{tag}1-c01": {
            "run_id": f"{tag}1",
            "vm": f"lab-{tag}1-c01",
            "netns": f"lab-{tag}1",
            "cgroup": str(cg) if cg else None,
            "expires_at": 1,
        },
        f"lab-{tag}2-c01": {
            "run_id": f"{tag}2",
            "vm": f"lab-{tag}2-c01",
            "netns": ns,
            "tap": "tap000",
            "expires_at": 1,
        },
    }
    for name, lease in leases.items():
        planted.file(workdir / name / "lease.json", json.dumps(lease))
        planted.dirs[workdir / name] = ["lease.json"]
    planted.file(workdir / f"lab-{tag}3-c01" / "disk.qcow2", "not a disk\n")
    planted.dirs[workdir / f"lab-{tag}3-c01"] = ["disk.qcow2"]
    planted.file(workdir / f"{ns}.lock", FOREIGN)


def plant_locks(planted: Planted, state_dir: Path, results: Path, tag: str) -> None:
    planted.file(state_dir / f"proxmox-pve@{tag}4.lock", FOREIGN)
    planted.file(state_dir / f"libvirt-kvm@{tag}5.lock", FOREIGN)
    planted.file(results / f"run-{tag}6.lock", FOREIGN)


DOMAIN = """
<domain type='qemu'>
  <name>{name}</name>
  <title>lab</title>
  <description>lab-run-id: {run}</description>
  <memory unit='MiB'>64</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type></os>
  {metadata}
</domain>
"""


def plant_domains(planted: Planted, tag: str, where: Path) -> None:
    """Two inactive domains with lab-like names and no lab metadata (one with metadata of its own)."""
    for i, metadata in (
        (7, ""),
        (8, "<metadata><x:run xmlns:x='http://example.org/not-the-lab' run='r1'/></metadata>"),
    ):
        name = f"lab-{tag}{i}-c01"
        xml = where / f"{name}.xml"
        xml.write_text(textwrap.dedent(DOMAIN.format(name=name, run=f"{tag}{i}", metadata=metadata)))
        # a planting cut short (a rerun, a timeout after libvirtd did define it) leaves the domain:
        # start from none, and let remove() undefine it whatever happens next
        proc.run(["virsh", "-c", URI, "undefine", name], check=False, timeout=VIRSH_TIMEOUT)
        planted.domains[name] = ""
        proc.run(["virsh", "-c", URI, "define", str(xml)], timeout=VIRSH_TIMEOUT)
        dumped = proc.run(["virsh", "-c", URI, "dumpxml", "--inactive", name], timeout=VIRSH_TIMEOUT)
        planted.domains[name] = dumped.stdout
