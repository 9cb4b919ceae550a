"""Warm start on a libvirt QEMU host: one post-boot memory snapshot per machine shape, restored by
each warm cell instead of a cold boot.

A snapshot is three files in the clone directory, named by the hash of its shape key (image
recipe and artifact, NIC model, disk bus, vCPUs, memory, boot and firmware, the host's QEMU
settings, the network the NIC joins)::

    lab-warm-KEY.qcow2   an overlay of the golden image, frozen when the state was saved
    lab-warm-KEY.state   virDomainSave's image of the running guest (memory and devices)
    lab-warm-KEY.json    one line: the lab's marker, the key, the image digest, the save image's
                         header (its XML and cookie); written last, so it means "complete"

It is built once (under a lock on this machine): the golden image booted cold with the guest agent
channel and a VM generation ID, LAB-READY on its console, the agent answering (connected before
the save: an agent whose port was closed backs off for seconds after every restore), the guest
quiesced (sync, page cache dropped: a smaller state restores faster), then saved. SeaBIOS boots it
whatever `bios` says: qboot hangs with the VM generation ID device.

A warm cell's disk is an overlay of the frozen overlay (the restored page cache matches it); its
domain is defined as for a cold boot (so `lab gc` finds it by its lease and a failed restore can
boot it cold), and start() restores the snapshot into it from a copy of the save image whose XML
carries the cell's name, UUID, disk, console, MAC and a new VM generation ID (saveimage)."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

from lab.backends.libvirt import domain, saveimage
from lab.backends.libvirt.agent import Agent
from lab.backends.libvirt.connection import Connection, error_message, libvirt_module
from lab.backends.libvirt.console import FAILED_MARK, console_text, tail
from lab.backends.libvirt.disks import Disks
from lab.backends.libvirt.drivers import USABLE_NAME
from lab.backends.libvirt.hostshell import HostShell
from lab.backends.libvirt.settings import Host
from lab.errors import BackendError, LabError
from lab.model import CloneKind, Owned, VmSpec
from lab.runlock import exclusive
from lab.wait import wait_until

WARM_NS = "https://lab.invalid/warm"  # the marker in a snapshot's .json: nothing else is ever removed
PREFIX = "lab-warm-"
FIRMWARE = "seabios"  # see the module's docstring


def shape(host: Host, spec: VmSpec, golden: str) -> dict[str, Any]:
    """Everything a restored guest depends on; a snapshot serves exactly the specs of one shape."""
    image = spec.image
    return {
        "backend": f"libvirt/{host.driver}",
        "domain_type": host.domain_type,
        "machine": host.machine,
        "cpu_mode": host.cpu_mode,
        "image": image.name,
        "digest": image.digest,
        "sha256": image.sha256,
        "golden": golden,
        "nic": spec.nic.value,
        "disk_bus": spec.disk_bus.value,
        "vcpus": spec.vcpus,
        "memory_mib": spec.memory_mib,
        "boot": domain.boot_way(host, image) or "",
        "firmware": FIRMWARE,
        "net": f"network:{host.network}" if host.network else f"bridge:{host.bridge}" if host.bridge else "user",
    }


def snapshot_name(key: dict[str, Any]) -> str:
    return PREFIX + sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Snapshot:
    name: str
    key: dict[str, Any]
    disk: str  # the frozen overlay
    state: str  # the save image
    header: saveimage.SaveHeader
    state_bytes: int = 0
    built_seconds: float | None = None  # when this call built it


class WarmStore:
    def __init__(
        self, host: Host, shell: HostShell, connection: Connection, disks: Disks, lock_dir: Path, host_name: str
    ):
        self.host = host
        self.shell = shell
        self.connection = connection
        self.disks = disks
        self.lock_dir = lock_dir
        self.host_name = host_name

    def _path(self, name: str, suffix: str) -> str:
        return f"{self.disks.clone_dir()}/{name}{suffix}"

    # -- listing and removal ---------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """The complete snapshots' records on the host (those carrying the lab's marker)."""
        out = []
        for file, line in self.shell.records(self.disks.clone_dir(), f"{PREFIX}*.json"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if (
                isinstance(rec, dict)
                and rec.get("lab") == WARM_NS
                and f"{rec.get('name')}.json" == file
                and USABLE_NAME.match(file)
            ):
                out.append(rec)
        return out

    def owned(self, backend: str) -> list[Owned]:
        return [
            Owned(
                backend=backend,
                kind="warm",
                name=rec["name"],
                run_id="",
                detail=str(rec.get("key", {}).get("digest", "")),
            )
            for rec in self.records()
        ]

    def remove(self, name: str, users: list[str]) -> None:
        """Remove a snapshot the lab made; never one a lab domain's disk still stands on."""
        if not name.startswith(PREFIX) or not USABLE_NAME.match(name):
            raise BackendError(f"{name!r} is not a lab warm snapshot")
        rec = self._record(name)
        if rec is None:
            raise BackendError(f"no lab warm snapshot {name!r} on host {self.host_name!r}")
        if users:
            raise BackendError(
                f"warm snapshot {name} is in use by {', '.join(sorted(users)[:3])}",
                hint="let the runs finish (or `lab gc`), then remove it",
            )
        self._remove_files(name)

    def _record(self, name: str) -> dict[str, Any] | None:
        text = self.shell.read(self._path(name, ".json"))
        try:
            rec = json.loads(text) if text else None
        except ValueError:
            return None
        return rec if isinstance(rec, dict) and rec.get("lab") == WARM_NS and rec.get("name") == name else None

    def _remove_files(self, name: str) -> None:
        """Console log, state, overlay, and the record last: a half-removed snapshot is still listed."""
        for suffix in (".console.log", ".state", ".qcow2", ".json"):
            self.shell.run_argv(
                self.disks.remove_argv(f"file:{self._path(name, suffix)}"), timeout=60, what="remove warm snapshot file"
            )
        self.disks.refresh_pool()

    # -- making one ------------------------------------------------------------------------------

    def ensure(
        self,
        spec: VmSpec,
        key: dict[str, Any],
        template_xml: Callable[[str, str, str], str],
        users: Callable[[str], list[str]],
    ) -> Snapshot:
        """The snapshot of `spec`'s shape, built now if there is none (BackendError: it could not be).
        `template_xml(name, disk, console)` renders the domain to boot; `users(name)` names the lab
        domains standing on a snapshot."""
        name = snapshot_name(key)
        lock = self.lock_dir / f"libvirt-{self.host_name}-{name}.lock"
        with exclusive(
            lock, what=f"warm snapshot {name} (built by another cell)", timeout=self.host.boot_timeout + 300
        ):
            found = self._load(name)
            if found is not None:
                return found
            snap = self._build(spec, name, key, template_xml)
        self._drop_superseded(snap, users)
        return snap

    def _load(self, name: str) -> Snapshot | None:
        rec = self._record(name)
        if rec is None or rec.get("status") != "ready":
            return None
        state, disk = self._path(name, ".state"), self._path(name, ".qcow2")
        res = self.shell.run(["test", "-s", state, "-a", "-s", disk], what="test -s", check=False, timeout=30)
        if not res.ok:
            return None
        return Snapshot(
            name=name,
            key=rec["key"],
            disk=disk,
            state=state,
            header=saveimage.SaveHeader.from_dict(rec["header"]),
            state_bytes=int(rec.get("state_bytes", 0)),
        )

    def _build(
        self, spec: VmSpec, name: str, key: dict[str, Any], template_xml: Callable[[str, str, str], str]
    ) -> Snapshot:
        libvirt = libvirt_module()
        disk, state, log = self._path(name, ".qcow2"), self._path(name, ".state"), self._path(name, ".console.log")
        self._remove_files(name)  # what a build that died left (we hold the lock: nobody builds it now)
        started = time.monotonic()
        dom = None
        record = {"lab": WARM_NS, "name": name, "key": key, "image": spec.image.name}
        try:
            self.shell.run(["mkdir", "-p", self.disks.clone_dir()], what="mkdir")
            # first: a build that dies is still listed (WarmStart.snapshots), and removable
            self.shell.write(self._path(name, ".json"), json.dumps({**record, "status": "building"}) + "\n")
            self.shell.run(
                [
                    "qemu-img",
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-F",
                    "qcow2",
                    "-b",
                    self.disks.golden_source(spec.image),
                    disk,
                ],
                what="warm snapshot overlay",
                timeout=120,
            )
            try:
                dom = self.connection.get().createXML(template_xml(name, disk, log), 0)  # transient: gone once saved
            except libvirt.libvirtError as exc:
                raise BackendError(f"libvirt refused the warm snapshot's domain {name}: {error_message(exc)}") from None
            self._wait_booted(dom, name, log, spec.image.manifest)
            agent = Agent(dom)
            agent.wait(timeout=120)
            agent.exec("/bin/sync", [])
            agent.write_file("/proc/sys/vm/drop_caches", b"3\n")
            saved = time.monotonic()
            try:
                dom.save(state)
            except libvirt.libvirtError as exc:
                raise BackendError(f"saving the warm snapshot {name} failed: {error_message(exc)}") from None
            dom = None
            save_seconds = time.monotonic() - saved
            head = self.shell.read_bytes(state, saveimage.HEADER.size)
            header = saveimage.parse(self.shell.read_bytes(state, saveimage.HEADER.size + saveimage.data_length(head)))
            size = int(self.shell.run(["wc", "-c", state], what="wc -c", timeout=30).stdout.split()[0])
            built = round(time.monotonic() - started, 3)
            rec = {
                **record,
                "status": "ready",
                "created": time.time(),
                "build_seconds": built,
                "save_seconds": round(save_seconds, 3),
                "state_bytes": size,
                "header": header.as_dict(),
            }
            self.shell.write(self._path(name, ".json"), json.dumps(rec, sort_keys=True) + "\n")
            self.shell.run_argv(self.disks.remove_argv(f"file:{log}"), timeout=60, what="rm console log")
            self.disks.refresh_pool()
            return Snapshot(
                name=name, key=key, disk=disk, state=state, header=header, state_bytes=size, built_seconds=built
            )
        except BaseException as exc:
            if dom is not None:
                try:
                    dom.destroy()
                except libvirt.libvirtError:
                    pass  # gone already
            try:
                self._remove_files(name)
            except LabError as rm:
                raise BackendError(
                    f"building warm snapshot {name} failed ({exc}) and its files could not be removed: {rm}"
                ) from None
            if isinstance(exc, ValueError):  # a save image lab cannot read
                raise BackendError(f"warm snapshot {name}: {exc}") from None
            raise

    def _wait_booted(self, dom: Any, name: str, log: str, manifest: dict) -> None:
        libvirt = libvirt_module()
        marker = str((manifest or {}).get("ready_marker") or "LAB-READY")

        def ready() -> bool:
            try:
                active = dom.isActive()
            except libvirt.libvirtError:
                active = False
            text = console_text(log, None, self.shell)
            if not active or FAILED_MARK in text:
                raise BackendError(f"the warm snapshot's domain {name} failed to boot", hint=tail(text))
            return marker in text

        wait_until(
            ready, timeout=self.host.boot_timeout, what=f"{name} (warm snapshot) to print {marker}", interval=0.2
        )

    def _drop_superseded(self, snap: Snapshot, users: Callable[[str], list[str]]) -> None:
        """Snapshots of the same shape made of an older artifact of the image (rebuilt with the
        same recipe) are stale: removed when no lab domain stands on them."""
        same = {k: v for k, v in snap.key.items() if k not in ("sha256", "golden", "digest")}
        for rec in self.records():
            key = rec.get("key") or {}
            if (
                rec["name"] == snap.name
                or {k: v for k, v in key.items() if k not in ("sha256", "golden", "digest")} != same
            ):
                continue
            try:
                if not users(rec["name"]):
                    self._remove_files(rec["name"])
            except LabError:
                pass  # a stale snapshot left for `lab gc`, never a failed cell

    # -- a cell ------------------------------------------------------------------------------------

    def clone_argv(self, snap: Snapshot, spec: VmSpec, disk_path: str) -> list[list[str]]:
        """The cell's disk: an overlay of the frozen overlay (linked), or a flattened copy (full)."""
        if CloneKind(spec.clone) is CloneKind.LINKED:
            return [
                self.shell.argv(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", snap.disk, disk_path])
            ]
        return [self.shell.argv(["qemu-img", "convert", "-q", "-O", self.host.disk_format, snap.disk, disk_path])]

    def state_argv(self, snap: Snapshot, dst: str) -> list[str]:
        """The host command that writes the cell's save image: a new header and data section on
        stdin, then the snapshot's migration stream unchanged."""
        q = shlex.quote
        return self.shell.shell_argv(
            f"cat > {q(dst)}.part && tail -c +{snap.header.size + 1} {q(snap.state)} "
            f">> {q(dst)}.part && mv -f {q(dst)}.part {q(dst)}"
        )

    def write_state(self, snap: Snapshot, dst: str, xml: str) -> None:
        self.shell.run_argv(
            self.state_argv(snap, dst),
            input=saveimage.with_xml(snap.header, xml),
            text=False,
            timeout=600,
            what="copy of the warm state",
        )
