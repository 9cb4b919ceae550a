"""The SmartOS backend's machines: made by `vmadm create` with a JSON payload on stdin (our own
uuid, so a create whose connection dropped can be found again), started, waited for (running, an
address, sshd answering there) and deleted, over the global zone's SSH (lab.backends.smartos.globalzone).

Addresses: a static one is in the payload's nics (chosen from `addresses` under a lock on this
machine); with DHCP the guest's MAC is looked up in the global zone's ARP table (`arp -an`), then in
this machine's neighbour table (in `client_netns`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lab import proc, runlock
from lab.backends.neighbours import parse_arp
from lab.backends.smartos import payload
from lab.backends.smartos.globalzone import CommandFailed, ConnectionLost, GlobalZone
from lab.backends.smartos.settings import Settings, address_pool
from lab.errors import BackendError, LabError, TeardownError, TimeoutError_
from lab.model import Vm, VmSpec
from lab.wait import wait_until

log = logging.getLogger(__name__)

LOOKUP_FIELDS = "uuid,alias,brand,state,customer_metadata,nics"
MAC_RE = re.compile(r"([0-9A-Fa-f]{1,2}(?::[0-9A-Fa-f]{1,2}){5})")
Payload = Callable[[str, str], dict[str, Any]]  # (uuid, ip) -> the vmadm create payload


class Machines:
    def __init__(self, backend: str, host_name: str, settings: Settings, gz: GlobalZone, address_lock: Path):
        self.backend, self.host_name, self.settings, self.gz = backend, host_name, settings, gz
        self._pool = address_pool(settings.addresses)
        self._taken: set[str] = set()  # pool addresses handed out by this process
        self._lock = threading.Lock()
        self._address_lock = address_lock

    def create(self, spec: VmSpec, make_payload: Payload) -> Vm:
        """`vmadm create` of make_payload(uuid, ip), under the address lock while a pool address is
        being chosen. On failure nothing is left: a VM the failed create left (state `failed`, or a
        create whose connection dropped) is deleted by its uuid."""
        uuid = str(uuidlib.uuid4())
        vm = Vm(spec=spec, backend=self.backend, handle={"uuid": uuid})
        with self._address_choice(spec) as ip:
            vm.handle["static_ip"] = ip
            body = payload_json(make_payload(uuid, ip))
            try:
                self.gz.run(
                    ["vmadm", "create"],
                    input=body,
                    timeout=self.settings.timeout("create"),
                    what=f"vmadm create ({spec.name})",
                )
            except ConnectionLost as exc:
                got = self.get(uuid)
                if got is None or got.get("state") not in ("stopped", "running"):
                    self.destroy_quietly(vm)
                    raise BackendError(f"{exc} (the VM it may have made is removed)") from None
                log.info("%s: the create of %s went through before the connection dropped", self.host_name, uuid)
            except BaseException:
                self.destroy_quietly(vm)  # e.g. a create that failed midway leaves a VM in state `failed`
                raise
        try:
            got = self.get(uuid)
            if got is None:
                raise BackendError(f"host {self.host_name!r}: VM {uuid} ({spec.name}) is gone right after its create")
            vm.handle["mac"] = payload.mac_of(got)
            vm.address = payload.address_of(got)
        except BaseException:
            self.destroy_quietly(vm)
            raise
        return vm

    @contextlib.contextmanager
    def _address_choice(self, spec: VmSpec) -> Iterator[str]:
        """The cell's address, else the next pool address no VM on the host has (chosen under a lock
        on this machine until the create that claims it returns), else "" (DHCP)."""
        if spec.ip or not self._pool:
            yield spec.ip
            return
        with runlock.exclusive(
            self._address_lock,
            timeout=self.settings.timeout("create"),
            what=f"the address lock of host {self.host_name!r}",
        ):
            vms = self.gz.json(["vmadm", "lookup", "-j", "-o", "uuid,nics"], what="vmadm lookup -j")
            in_use = payload.addresses_in_use(vms if isinstance(vms, list) else [])
            reserved = {self.settings.gateway, self.settings.client_address}
            with self._lock:
                ip = next((a for a in self._pool if a not in in_use | self._taken | reserved), "")
                if not ip:
                    raise BackendError(
                        f"host {self.host_name!r}: every address of `addresses` is in use "
                        f"({len(self._pool)}, {len(in_use & set(self._pool))} by VMs on the host)"
                    )
                self._taken.add(ip)
            try:
                yield ip
            finally:
                with self._lock:
                    self._taken.discard(ip)  # from now on it is in the VM's nics (or was never used)

    def start(self, vm: Vm) -> None:
        uuid = vm.handle["uuid"]
        vm.handle["started"] = time.monotonic()
        try:
            self.gz.run(["vmadm", "start", uuid], timeout=self.settings.timeout("start"), what=f"vmadm start {uuid}")
        except ConnectionLost:
            got = self.get(uuid)
            if got is None or got.get("state") not in ("running", "provisioning"):
                self.gz.run(
                    ["vmadm", "start", uuid], timeout=self.settings.timeout("start"), what=f"vmadm start {uuid}"
                )

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        uuid = vm.handle["uuid"]
        timeout = timeout or self.settings.timeout("ready")
        t0 = time.monotonic()
        label = f"host {self.host_name!r}: VM {uuid} ({vm.name})"
        last = {"state": "?"}

        def running() -> bool:
            last["state"] = self.state(uuid)
            if not last["state"]:
                raise BackendError(f"{label} vanished while booting")
            if last["state"] in ("failed", "stopped", "down"):
                raise BackendError(f"{label} is {last['state']} instead of booting")
            return last["state"] == "running"

        wait_until(
            running,
            timeout=timeout,
            what=f"{label} to run",
            interval=self.settings.poll_interval,
            max_interval=max(self.settings.poll_interval, 2.0),
            detail=lambda: f"state {last['state']}",
        )
        if vm.address:
            source = "static"
        else:
            vm.address = wait_until(
                lambda: self._dhcp_address(vm.handle.get("mac", "")),
                timeout=max(1.0, timeout - (time.monotonic() - t0)),
                what=f"{label} to get an address by DHCP (MAC {vm.handle.get('mac')})",
                interval=self.settings.poll_interval,
                max_interval=5.0,
            )
            source = "arp"
        wait_until(
            lambda: self._sshd_answers(vm.address),
            timeout=max(1.0, timeout - (time.monotonic() - t0)),
            what=f"{label}: sshd at {vm.address} to answer",
            interval=self.settings.poll_interval,
            max_interval=5.0,
        )
        vm.facts["address_source"] = source
        vm.facts["boot_seconds"] = round(time.monotonic() - vm.handle.get("started", t0), 2)
        return vm.address

    def _dhcp_address(self, mac: str) -> str:
        if not mac:
            return ""
        res = self.gz.run(["arp", "-an"], check=False, what="arp -an")
        ip = illumos_arp_address(res.stdout, mac) if res.ok else ""
        if not ip:
            local = proc.run(
                ["ip", "-4", "neigh", "show"], check=False, timeout=10, netns=self.settings.client_netns or None
            )
            ip = parse_arp(local.stdout, mac) if local.ok else ""
        return ip

    def _sshd_answers(self, address: str) -> bool:
        """sshd's banner at address:22, seen from the client side (where the lab's SSH comes from)."""
        res = proc.run(
            ["ssh-keyscan", "-T", "3", "-t", "ed25519", address],
            check=False,
            timeout=15,
            netns=self.settings.client_netns or None,
        )
        return bool(res.stdout.strip()) or "SSH-" in res.stderr

    def state(self, uuid: str) -> str:
        """The VM's state column of `vmadm list -p` ("" if there is no such VM): a cheap poll."""
        return self.gz.read(
            ["vmadm", "list", "-p", "-o", "state", f"uuid={uuid}"], what=f"vmadm list uuid={uuid}"
        ).stdout.strip()

    def get(self, uuid: str) -> dict[str, Any] | None:
        """The VM object (as `vmadm get` prints it), None if there is no such VM. A lookup, not a get:
        "no such VM" is then an empty answer, not an error message to recognise."""
        found = self.gz.json(["vmadm", "lookup", "-j", f"uuid={uuid}"], what=f"vmadm lookup -j uuid={uuid}")
        return found[0] if isinstance(found, list) and found else None

    def renew_lease(self, vm: Vm, expires_at: float) -> None:
        """`vmadm update` of the lease in the VM's (or zone's) customer_metadata (lab.runner.renewal)."""
        uuid = vm.handle["uuid"]
        self.gz.run(
            ["vmadm", "update", uuid],
            input=payload_json(payload.renewal(expires_at)),
            timeout=self.settings.timeout("command"),
            what=f"vmadm update {uuid} (lease of {vm.name})",
        )

    def destroy(self, vm: Vm) -> None:
        uuid = vm.handle.get("uuid")
        if not uuid:
            return
        try:
            self.delete(uuid, vm.name)
        except TeardownError:
            raise
        except LabError as exc:
            raise TeardownError(f"host {self.host_name!r}: could not delete VM {uuid} ({vm.name}): {exc}") from None

    def delete(self, uuid: str, name: str) -> None:
        """`vmadm delete` (it halts a running VM first), retried while the VM is in transition (e.g.
        stuck in `stopping`) until the delete timeout; a VM already gone is fine."""
        deadline = time.monotonic() + self.settings.timeout("delete")
        delay = 1.0
        while True:
            try:
                self.gz.run(
                    ["vmadm", "delete", uuid],
                    timeout=max(1.0, deadline - time.monotonic()),
                    what=f"vmadm delete {uuid}",
                )
                return
            except (CommandFailed, TimeoutError_) as exc:  # refused, or hung on a VM in transition
                got = self.get(uuid)
                if got is None:
                    return
                if time.monotonic() + delay > deadline:
                    raise TeardownError(
                        f"host {self.host_name!r}: VM {uuid} ({name}) could not be deleted"
                        f"{' (state ' + str(got.get('state')) + ')' if got else ''}: {exc}"
                    ) from None
            except ConnectionLost as exc:
                if self.get(uuid) is None:
                    return
                if time.monotonic() + delay > deadline:
                    raise TeardownError(str(exc)) from None
            log.info("%s: delete of %s not done yet; again in %.0f s", self.host_name, uuid, delay)
            time.sleep(delay)  # backoff between attempts, not a polling loop
            delay = min(delay * 2, 15.0)

    def destroy_quietly(self, vm: Vm) -> None:
        try:
            if self.get(vm.handle["uuid"]) is not None:
                self.delete(vm.handle["uuid"], vm.name)
        except LabError as exc:  # it carries the marker: `lab gc` removes it
            log.warning("%s: cleanup of VM %s after a failed create: %s", self.host_name, vm.handle["uuid"], exc)

    def lab_vms(self) -> list[dict[str, Any]]:
        vms = self.gz.json(["vmadm", "lookup", "-j", "-o", LOOKUP_FIELDS], what="vmadm lookup -j")
        return [v for v in (vms if isinstance(vms, list) else []) if payload.is_ours(v)]


def payload_json(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True)


def illumos_arp_address(text: str, mac: str) -> str:
    """The IPv4 address illumos' `arp -an` lists for `mac` ("" if none). Its lines are
    "DEVICE IP MASK [FLAGS] MAC" under a header; octets may lack their leading zero."""
    want = ":".join(p.zfill(2) for p in mac.lower().split(":"))
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or not re.fullmatch(r"\d+\.\d+\.\d+\.\d+", parts[1]):
            continue
        m = MAC_RE.fullmatch(parts[-1])
        if m and ":".join(p.zfill(2) for p in m.group(1).lower().split(":")) == want:
            return parts[1]
    return ""
