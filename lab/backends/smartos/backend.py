"""SmartOS backend: bhyve- or KVM-brand VMs made by `vmadm` in the global zone, over SSH.

Per cell: `vmadm create` with a JSON payload on stdin (our own uuid, so a create whose connection
dropped can be found again), its disk a `zfs clone` of the published image (`lab images publish`),
the cell's vCPUs, RAM, disk model and NIC model, a static address from `addresses` (or DHCP), the
lease in `customer_metadata`; `vmadm start`; `vmadm delete` at teardown (it halts a running VM
first). `lab gc` finds VMs by the lease's marker and never touches one without it.

Addresses: a static one is in the payload's nics (bhyve guests read it from the NoCloud cidata disk
SmartOS makes for images tagged so, since platform 20260306: `check` refuses static addresses on
bhyve hosts older than that; the KVM brand's QEMU hands it out by DHCP); with DHCP the
guest's MAC is looked up in the global zone's ARP table (`arp -an`), then in this machine's
neighbour table (in `client_netns`). Ready means: running, an address, and sshd answering there.

Zones for the isolation axis (lab.backends.smartos.zones): a cell whose spec asks for a zone gets an lx
zone of the zone image `zone_images` names, made by `create_zone`; it then lives and dies through the
same start / wait_ready / destroy as a VM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
import uuid as uuidlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab import proc, runlock, statedir
from lab.backends.base import Backend, BackendEnv, Capabilities, PlainClient
from lab.backends.neighbours import parse_arp
from lab.backends.smartos import payload, publish, zones
from lab.backends.smartos.globalzone import CommandFailed, ConnectionLost, GlobalZone
from lab.backends.smartos.settings import DISK_MODELS, NIC_MODELS, Settings, address_pool, capabilities
from lab.errors import BackendError, ConfigError, LabError, SettingError, TeardownError, TimeoutError_, UsageError
from lab.lease import owner_or_empty
from lab.model import Client, ImageRef, Isolation, Owned, Vm, VmSpec
from lab.runlock import RunLocks
from lab.wait import wait_until

log = logging.getLogger(__name__)

LOOKUP_FIELDS = "uuid,alias,brand,state,customer_metadata,nics"
NOCLOUD_SINCE = "20260306T044811Z"  # the first platform that hands bhyve guests a NoCloud (cidata) disk
MAC_RE = re.compile(r"([0-9A-Fa-f]{1,2}(?::[0-9A-Fa-f]{1,2}){5})")


class SmartosBackend(Backend):
    name = "smartos"
    settings_model = Settings
    settings: Settings

    def __init__(self, host_name: str, settings: Settings, env: BackendEnv | None = None):
        super().__init__(host_name, settings, env)
        self.gz = GlobalZone(host_name, settings)
        self._pool = address_pool(settings.addresses)
        self._sysinfo: dict[str, Any] | None = None
        self._images: dict[str, str] = {}  # image name -> imgadm uuid of its published image
        self._zones: dict[str, dict[str, str]] = {}  # image name -> its zone image (zones.zone_image)
        self._taken: set[str] = set()  # pool addresses handed out by this process
        self._lock = threading.Lock()
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", host_name)
        self._run_locks = RunLocks(lambda run_id: self.env.state_dir / f"smartos-{host}@{run_id}.lock")
        self._address_lock = self.env.state_dir / f"smartos-{host}.addresses.lock"

    @classmethod
    def capabilities(cls, settings: Settings) -> Capabilities:  # type: ignore[override]
        return capabilities(settings)

    @classmethod
    def plan_check(cls, host_name: str, settings: Settings, specs: Sequence[VmSpec]) -> None:  # type: ignore[override]
        super().plan_check(host_name, settings, specs)
        for spec in specs:
            if spec.isolation == Isolation.ZONE and spec.image.name not in settings.zone_images:
                raise SettingError(
                    f"zone_images.{spec.image.name}",
                    None,
                    f"a zone cell of image {spec.image.name!r} needs the installed lx zone image it is made from",
                    hint=f'zone_images = {{ {spec.image.name} = "<uuid from imgadm list>" }}',
                )

    # -- the host -----------------------------------------------------------------------------------
    def sysinfo(self) -> dict[str, Any]:
        if self._sysinfo is None:
            info = self.gz.json(["sysinfo"], what="sysinfo")
            if not isinstance(info, dict) or "Live Image" not in info:
                raise UsageError(
                    f"host {self.host_name!r}: {self.settings.ssh} does not answer `sysinfo` as a "
                    "SmartOS global zone does",
                    hint="point `ssh` at the global zone, not a zone",
                )
            self._sysinfo = info
        return self._sysinfo

    def check(self) -> None:
        info = self.sysinfo()
        brand = self.settings.brand
        capable = info.get("Bhyve Capable") if brand == "bhyve" else info.get("VM Capable")
        if not capable:
            raise UsageError(
                f"host {self.host_name!r}: the global zone says it cannot run {brand} VMs "
                f"(platform {info.get('Live Image')}, CPU virtualization "
                f"{info.get('CPU Virtualization', '?')})"
            )
        platform = str(info.get("Live Image") or "")
        if brand == "bhyve" and self._pool and platform < NOCLOUD_SINCE:
            raise ConfigError(
                self.env.source,
                f"hosts.{self.host_name}.addresses",
                self.settings.addresses,
                f"platform {platform} predates SmartOS's NoCloud disk ({NOCLOUD_SINCE}): a bhyve "
                "guest cannot learn a static address there",
                hint='set addresses = "" (DHCP on the nic_tag\'s network), or upgrade the platform',
            )
        tags = nic_tags(info)
        if self.settings.nic_tag not in tags:
            raise ConfigError(
                self.env.source,
                f"hosts.{self.host_name}.nic_tag",
                self.settings.nic_tag,
                f"the host has no such NIC tag; it has {', '.join(sorted(tags)) or 'none'}",
            )

    def check_specs(self, specs: Sequence[VmSpec]) -> None:
        """The capabilities' limits, then what this host said: bhyve's vCPU limit and its memory."""
        super().check_specs(specs)
        info = self.sysinfo()
        where = f"host {self.host_name!r} ({info.get('Live Image')})"
        max_vcpus = info.get("Bhyve Max Vcpus") if self.settings.brand == "bhyve" else None
        memory = int(info.get("MiB of Memory") or 0)
        entries = publish.installed(self.gz) if any(s.isolation == Isolation.ZONE for s in specs) else []
        for spec in specs:
            zone = spec.isolation == Isolation.ZONE  # its vCPUs are a CPU cap, not bhyve's
            if zone:
                name = spec.image.name
                self._zones[name] = zones.zone_image(entries, self.settings.zone_images[name], name, self.host_name)
            if not zone and isinstance(max_vcpus, int) and spec.vcpus > max_vcpus:
                raise SettingError("vcpus", spec.vcpus, f"more than the {max_vcpus} vCPUs bhyve takes on {where}")
            if memory and spec.memory_mib > memory:
                raise SettingError("memory_mib", spec.memory_mib, f"more than the {memory} MiB {where} has")

    def check_images(self, images: Sequence[ImageRef]) -> None:
        entries = publish.installed(self.gz)
        for image in images:
            found, why = payload.usable_image(entries, self.settings, image)
            if found is None:
                raise UsageError(
                    f"host {self.host_name!r} {why}", hint=f"lab images publish {image.name} {self.host_name}"
                )
            self._images[image.name] = found

    def facts(self) -> dict[str, Any]:
        info = self.sysinfo()
        out = {
            "hypervisor": "smartos",
            "brand": self.settings.brand,
            "platform": info.get("Live Image"),
            "nic_tag": self.settings.nic_tag,
        }
        if self.settings.brand == "bhyve":
            out["bootrom"] = self.settings.bootrom
        return out

    def host_facts(self) -> dict[str, Any]:
        info = self.sysinfo()
        memory = info.get("MiB of Memory")
        return {
            "cpu_model": info.get("HW Version") or info.get("CPU Type"),
            "cores": info.get("CPU Online Count") or info.get("CPU Total Cores"),
            "sockets": info.get("CPU Socket Count") or info.get("CPU Physical Cores"),
            "mem_kib": int(str(memory)) * 1024 if str(memory or "").isdigit() else None,
            "kernel": info.get("Live Image"),
            "os": f"SmartOS {info.get('Live Image')}",
            "virt_flags": [v for v in [info.get("CPU Virtualization")] if v not in (None, "none")],
            "smt": (info.get("Psrinfo") or {}).get("smt_enabled"),
            "bhyve_capable": info.get("Bhyve Capable"),
            "bhyve_max_vcpus": info.get("Bhyve Max Vcpus"),
            "hvm_api": info.get("HVM API"),
            "zpool": info.get("Zpool"),
            "product": " ".join(str(info.get(k) or "") for k in ("Manufacturer", "Product")).strip(),
        }

    # -- images ---------------------------------------------------------------------------------------
    def publish_image(self, image: ImageRef) -> str:
        self.check()
        name = publish.publish(self.gz, self.settings, image, work_dir=self._work_dir())
        self._images.pop(image.name, None)
        return name

    def _image_uuid(self, image: ImageRef) -> str:
        if image.name not in self._images:
            self.check_images([image])
        return self._images[image.name]

    def _work_dir(self) -> Path:
        return statedir.ensure(self.env.state_dir)  # private: run locks and the address lock live here

    # -- per run ----------------------------------------------------------------------------------------
    def open_run(self, run_id: str) -> Client:
        # Held for the run's life: `lab gc` here removes a killed run's VMs at once.
        self._work_dir()
        self._run_locks.acquire(run_id, what=f"the lock of run {run_id} on host {self.host_name!r}")
        return PlainClient(self.settings.client_address, self.settings.client_netns or None)

    def outside_netns(self) -> str | None:
        return self.settings.client_netns or None  # where this machine's SSH to the host's side goes

    def close_run(self, run_id: str) -> None:
        try:
            self.gz.close()
        finally:
            self._run_locks.release(run_id)

    def run_is_live(self, run_id: str) -> bool | None:
        return self._run_locks.live(run_id)

    # -- per VM -------------------------------------------------------------------------------------------
    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        if spec.isolation == Isolation.ZONE:
            return self._zone(image, spec)
        brand = self.settings.brand
        if spec.nic not in NIC_MODELS[brand] or spec.disk_bus not in DISK_MODELS[brand]:
            raise UsageError(
                f"host {self.host_name!r}: the {brand} brand has no {spec.nic} NIC or {spec.disk_bus} disk"
            )
        image_uuid = self._image_uuid(image)
        t0 = time.monotonic()
        vm = self._create(
            spec, lambda uuid, ip: payload.vm_payload(self.settings, spec, uuid=uuid, image_uuid=image_uuid, ip=ip)
        )
        vm.facts.update(
            {
                "brand": brand,
                "image_uuid": image_uuid,
                "clone": "linked",
                "clone_seconds": round(time.monotonic() - t0, 2),
            }
        )
        return vm

    def create_zone(self, spec: VmSpec, *, brand: str, image_uuid: str, kernel_version: str = "") -> Vm:
        """A joyent or lx zone for a cell (the isolation axis): `image_uuid` is an installed zone image
        (`imgadm list`), root's key the lab's. It lives and dies through start / wait_ready / destroy."""
        key = self.env.ssh_key.with_suffix(".pub")
        if not key.exists():
            raise UsageError(f"the lab's public key {key} is missing", hint="run `make images`")
        vm = self._create(
            spec,
            lambda uuid, ip: payload.zone_payload(
                self.settings,
                spec,
                uuid=uuid,
                brand=brand,
                image_uuid=image_uuid,
                ip=ip,
                authorized_keys=key.read_text().strip(),
                kernel_version=kernel_version,
            ),
        )
        vm.facts.update({"brand": brand, "image_uuid": image_uuid, "isolation": "zone"})
        return vm

    def _zone(self, image: ImageRef, spec: VmSpec) -> Vm:
        """A zone cell's machine (lab.backends.smartos.zones): an lx zone of the zone image for `image`,
        its caps read back and checked; nothing is left if they differ."""
        if image.name not in self._zones:
            self.check_specs([spec])
        made = self._zones[image.name]
        t0 = time.monotonic()
        vm = self.create_zone(spec, brand="lx", image_uuid=made["uuid"], kernel_version=made["kernel_version"])
        try:
            got = self._get(vm.handle["uuid"]) or {}
            caps = zones.caps(got)
            vm.handle["zonepath"] = caps["zonepath"]
            vm.facts.update(
                {
                    "zone_image": made["image"],
                    "kernel_version": made["kernel_version"],
                    "clone_seconds": round(time.monotonic() - t0, 2),
                    "caps": zones.verify_zone(caps, spec),
                    "cpu_accounting": zones.CPU_ACCOUNTING,
                }
            )
        except BaseException:
            self._destroy_quietly(vm)
            raise
        return vm

    def known_hosts(self, vm: Vm) -> str:
        """A zone's host key is made at its first boot: read from its root through the global zone."""
        if vm.spec.isolation != Isolation.ZONE:
            return super().known_hosts(vm)
        path = f"{vm.handle['zonepath']}/{zones.HOST_KEY}"
        return zones.known_hosts(vm.address, self.gz.read(["cat", path], what=f"cat {path}").stdout)

    def _create(self, spec: VmSpec, make_payload) -> Vm:
        """`vmadm create` of make_payload(uuid, ip), under the address lock while a pool address is
        being chosen. On failure nothing is left: a VM the failed create left (state `failed`, or a
        create whose connection dropped) is deleted by its uuid."""
        uuid = str(uuidlib.uuid4())
        vm = Vm(spec=spec, backend=self.name, handle={"uuid": uuid})
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
                got = self._get(uuid)
                if got is None or got.get("state") not in ("stopped", "running"):
                    self._destroy_quietly(vm)
                    raise BackendError(f"{exc} (the VM it may have made is removed)") from None
                log.info("%s: the create of %s went through before the connection dropped", self.host_name, uuid)
            except BaseException:
                self._destroy_quietly(vm)  # e.g. a create that failed midway leaves a VM in state `failed`
                raise
        try:
            got = self._get(uuid)
            if got is None:
                raise BackendError(f"host {self.host_name!r}: VM {uuid} ({spec.name}) is gone right after its create")
            vm.handle["mac"] = payload.mac_of(got)
            vm.address = payload.address_of(got)
        except BaseException:
            self._destroy_quietly(vm)
            raise
        return vm

    @contextlib.contextmanager
    def _address_choice(self, spec: VmSpec):
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
            got = self._get(uuid)
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
            last["state"] = self._state(uuid)
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

    def _state(self, uuid: str) -> str:
        """The VM's state column of `vmadm list -p` ("" if there is no such VM): a cheap poll."""
        return self.gz.read(
            ["vmadm", "list", "-p", "-o", "state", f"uuid={uuid}"], what=f"vmadm list uuid={uuid}"
        ).stdout.strip()

    def _get(self, uuid: str) -> dict[str, Any] | None:
        """The VM object (as `vmadm get` prints it), None if there is no such VM. A lookup, not a get:
        "no such VM" is then an empty answer, not an error message to recognise."""
        found = self.gz.json(["vmadm", "lookup", "-j", f"uuid={uuid}"], what=f"vmadm lookup -j uuid={uuid}")
        return found[0] if isinstance(found, list) and found else None

    def renew_lease(self, vm: Vm, expires_at: float) -> None:
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
            self._delete(uuid, vm.name)
        except TeardownError:
            raise
        except LabError as exc:
            raise TeardownError(f"host {self.host_name!r}: could not delete VM {uuid} ({vm.name}): {exc}") from None

    def _delete(self, uuid: str, name: str) -> None:
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
                got = self._get(uuid)
                if got is None:
                    return
                if time.monotonic() + delay > deadline:
                    raise TeardownError(
                        f"host {self.host_name!r}: VM {uuid} ({name}) could not be deleted"
                        f"{' (state ' + str(got.get('state')) + ')' if got else ''}: {exc}"
                    ) from None
            except ConnectionLost as exc:
                if self._get(uuid) is None:
                    return
                if time.monotonic() + delay > deadline:
                    raise TeardownError(str(exc)) from None
            log.info("%s: delete of %s not done yet; again in %.0f s", self.host_name, uuid, delay)
            time.sleep(delay)  # backoff between attempts, not a polling loop
            delay = min(delay * 2, 15.0)

    def _destroy_quietly(self, vm: Vm) -> None:
        try:
            if self._get(vm.handle["uuid"]) is not None:
                self._delete(vm.handle["uuid"], vm.name)
        except LabError as exc:  # it carries the marker: `lab gc` removes it
            log.warning("%s: cleanup of VM %s after a failed create: %s", self.host_name, vm.handle["uuid"], exc)

    # -- garbage collection ---------------------------------------------------------------------------------
    def _lab_vms(self) -> list[dict[str, Any]]:
        vms = self.gz.json(["vmadm", "lookup", "-j", "-o", LOOKUP_FIELDS], what="vmadm lookup -j")
        return [v for v in (vms if isinstance(vms, list) else []) if payload.is_ours(v)]

    def list_owned(self) -> list[Owned]:
        out = []
        for vm in self._lab_vms():
            run_id, name, expires = payload.lease_of(vm)
            out.append(
                Owned(
                    backend=self.name,
                    kind="vm",
                    name=name,
                    run_id=run_id,
                    expires_at=expires,
                    detail=str(vm["uuid"]),
                    owner=owner_or_empty(payload.owner_of(vm)),
                )
            )
        return out + self._run_locks.owned(self.name)

    def remove_owned(self, item: Owned) -> None:
        if item.kind == "lock":
            runlock.remove_if_dead(Path(item.detail))  # never the lock of a live run
            return
        got = self._get(item.detail)
        if got is None:
            return
        if not payload.is_ours(got):  # the uuid was reused, or the item was forged: not ours to delete
            raise BackendError(f"host {self.host_name!r}: VM {item.detail} does not carry the lab's marker; left alone")
        self._delete(item.detail, item.name)


def payload_json(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True)


def nic_tags(info: dict[str, Any]) -> set[str]:
    """Every NIC tag sysinfo lists (physical and virtual NICs, overlays), plus the link names: vmadm
    takes an etherstub or device name as a nic_tag too."""
    tags: set[str] = set()
    for group in ("Network Interfaces", "Virtual Network Interfaces"):
        for link, nic in (info.get(group) or {}).items():
            tags.add(str(link))
            tags.update(str(t) for t in nic.get("NIC Names") or [])
            tags.update(t.strip() for t in str(nic.get("Overlay Nic Tags") or "").split(",") if t.strip())
    return tags


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


BACKEND = SmartosBackend
