"""Emulated `vmadm` (vmadm(8)): create / start / stop / delete / get / list / lookup / validate.

VM state as vmadm keeps it: a created VM is `stopped` (autoboot false) or `running` (autoboot: it
boots at once); `stop` of an HVM VM sends ACPI power-off and shows `stopping` (transition_to,
transition_expire) until the guest halts or the timeout (default 180 s) forces it; `stop -F` halts;
`delete` halts a running VM, then removes it and its disks; a create that failed midway leaves a
VM in state `failed`. Operations on one VM are serialised (vmadm locks per VM).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import threading
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .schema import HVM, OS, Host, validate_create

if TYPE_CHECKING:
    from .gz import GlobalZoneEmulator, Io

TYPE = {"bhyve": "BHYVE", "kvm": "KVM", "lx": "LX"}
LISTABLE = {
    "uuid",
    "type",
    "ram",
    "state",
    "alias",
    "brand",
    "zonename",
    "zone_state",
    "autoboot",
    "hostname",
    "image_uuid",
    "create_timestamp",
    "boot_timestamp",
    "cpu_cap",
    "cpu_shares",
    "max_physical_memory",
    "max_swap",
    "max_locked_memory",
    "max_lwps",
    "quota",
    "vcpus",
    "pid",
    "owner_uuid",
    "zpool",
    "zoneid",
    "zonedid",
    "billing_id",
    "zfs_io_priority",
    "hvm",
    "indestructible_zoneroot",
    "indestructible_delegated",
    "firewall_enabled",
    "do_not_inventory",
    "cpu_type",
    "dns_domain",
}
MEM_OVERHEAD = {"bhyve": 1280, "kvm": 1024}
STOP_TIMEOUT = 180
NOCLOUD_TAG = "org.smartos:cloudinit_datasource"
CIDATA_MIB = 16


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


@dataclass
class VmRecord:
    uuid: str
    brand: str
    obj: dict[str, Any]  # what `vmadm get` shows, less the live fields
    state: str = "stopped"
    zoneid: int | None = None
    boot_timestamp: str | None = None
    transition: dict[str, Any] | None = None
    guest: Any = None  # the backing's handle of a running HVM guest or zone
    backing: Any = None  # what runs it (the gz's backing, or its zones)
    files: list = field(default_factory=list)  # disk files in the emulator's root
    nocloud: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock)

    def get(self) -> dict[str, Any]:
        out = json.loads(json.dumps(self.obj))
        out["state"] = self.state
        out["zone_state"] = {"stopping": "running", "failed": "installed", "stopped": "installed"}.get(
            self.state, self.state
        )
        if self.state in ("running", "stopping"):
            out.update(
                {
                    "zoneid": self.zoneid,
                    "boot_timestamp": self.boot_timestamp,
                    "pid": getattr(self.guest, "pid", None) or 0,
                }
            )
        if self.transition:
            out.update(self.transition)
        return out


class VmadmError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """vmadm's flattening for filters and columns: disks.0.size, customer_metadata.key, ..."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = obj
    return out


def matches(vm: dict[str, Any], filters: list[tuple[str, str]]) -> bool:
    flat = flatten(vm)
    for key, want in filters:
        keys = [k for k in flat if re.fullmatch(re.escape(key).replace(r"\*", r"\d+"), k)] if "*" in key else [key]
        values = [flat.get(k) for k in keys if k in flat]
        if want.startswith("~"):
            if not any(v is not None and re.search(want[1:], _text(v)) for v in values):
                return False
        elif not any(_text(v) == want for v in values):
            return False
    return True


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return ",".join(_text(x) for x in v)
    return "" if v is None else str(v)


class Vmadm:
    def __init__(self, gz: GlobalZoneEmulator):
        self.gz = gz
        self.vms: dict[str, VmRecord] = {}
        self.lock = threading.RLock()

    # -- dispatch -----------------------------------------------------------------------------------
    def main(self, args: list[str], io: Io) -> int:
        if not args:
            io.err("Usage: vmadm <command> [-d] [-v] [command-specific arguments]\n")
            return 2
        cmd, rest = args[0], [a for a in args[1:] if a not in ("-d", "-v")]
        handler = getattr(self, f"cmd_{cmd}", None)
        if handler is None:
            io.err(f"vmadm: the emulator does not implement `vmadm {cmd}`\n")
            return 2
        try:
            return handler(rest, io)
        except VmadmError as exc:
            io.err(f"{exc}\n")
            return exc.code

    def record(self, uuid: str, what: str) -> VmRecord:
        with self.lock:
            vm = self.vms.get(uuid)
        if vm is None:
            raise VmadmError(f"Failed to {what} VM {uuid}: VM not found (no such zone configured)")
        return vm

    # -- create -------------------------------------------------------------------------------------
    def _payload(self, rest: list[str], io: Io, what: str) -> dict[str, Any]:
        if rest[:1] == ["-f"] and len(rest) >= 2:
            text = self.gz.read_file(rest[1])
        elif not rest:
            text = io.stdin_all().decode(errors="replace")
            if not text.strip():
                raise VmadmError(f"Failed to {what}: no payload on stdin")
        else:
            raise VmadmError(f"Usage: vmadm {what} [-f <filename>]", 2)
        try:
            return json.loads(text)
        except ValueError as exc:
            raise VmadmError(f"Failed to {what}: invalid JSON payload: {exc}") from None

    def host(self) -> Host:
        return Host(
            nic_tags=frozenset(self.gz.nic_tags()),
            zpools=frozenset({"zones"}),
            images={u: i.manifest for u, i in self.gz.imgadm.images.items()},
        )

    def cmd_validate(self, rest: list[str], io: Io) -> int:
        if rest[:1] != ["create"]:
            raise VmadmError("Usage: vmadm validate create [-f <filename>] (update is not emulated)", 2)
        payload = self._payload(rest[1:], io, "validate create")
        problems = validate_create(payload, self.host())
        if problems:
            io.out(json.dumps(problems.as_json(), indent=2) + "\n")
            return 1
        io.out(f"VALID create payload for {payload['brand']} brand VMs.\n")
        return 0

    def cmd_create(self, rest: list[str], io: Io) -> int:
        payload = self._payload(rest, io, "create VM")
        problems = validate_create(payload, self.host())
        if problems:
            raise VmadmError(f"Failed to create VM: {problems.line()}")
        uuid = payload.get("uuid") or str(uuidlib.uuid4())
        brand = payload["brand"]
        with self.lock:
            if uuid in self.vms:
                raise VmadmError(f"Failed to create VM: VM with UUID {uuid} already exists")
            vm = VmRecord(uuid=uuid, brand=brand, obj=self._object(uuid, payload), state="provisioning")
            self.vms[uuid] = vm
        with vm.lock:
            fault = self.gz.faults.take_create_failure()
            try:
                if fault is not None:
                    raise VmadmError(f"Failed to create VM: {fault}")
                self._make_disks(vm, payload)
            except BaseException:
                if fault is not None and self.gz.faults.create_leaves_failed:
                    vm.state = "failed"  # a provision that failed midway: the operator deletes it
                else:
                    self._remove(vm)
                raise
            vm.state = "stopped"
            if payload.get("autoboot", True):
                self._boot(vm)
        io.err(f"Successfully created VM {uuid}\n")
        return 0

    # -- update -------------------------------------------------------------------------------------
    # vmadm(8) "update": the metadata keys are changed through set_/remove_customer_metadata (a
    # payload's customer_metadata would replace the whole object). Only those two are emulated:
    # anything else is refused by name, never silently ignored.
    UPDATE_KEYS = ("set_customer_metadata", "remove_customer_metadata")

    def cmd_update(self, rest: list[str], io: Io) -> int:
        if not rest or rest[0].startswith("-"):
            raise VmadmError("Usage: vmadm update <uuid> [-f <filename>]", 2)
        uuid, rest = rest[0], rest[1:]
        payload = self._payload(rest, io, f"update VM {uuid}")
        if not isinstance(payload, dict):
            raise VmadmError(f"Failed to update VM {uuid}: the payload is not an object")
        unknown = sorted(set(payload) - set(self.UPDATE_KEYS))
        if unknown:
            raise VmadmError(f"Failed to update VM {uuid}: the emulator does not update {', '.join(unknown)}")
        sets = payload.get("set_customer_metadata", {})
        removes = payload.get("remove_customer_metadata", [])
        if not isinstance(sets, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sets.items()):
            raise VmadmError(f"Failed to update VM {uuid}: set_customer_metadata must map strings to strings")
        if not isinstance(removes, list) or not all(isinstance(k, str) for k in removes):
            raise VmadmError(f"Failed to update VM {uuid}: remove_customer_metadata must list keys")
        vm = self.record(uuid, "update")
        with vm.lock:
            if vm.state in ("provisioning", "failed"):
                raise VmadmError(f"Failed to update VM {uuid}: VM is {vm.state}")
            meta = vm.obj.setdefault("customer_metadata", {})
            meta.update(sets)
            for key in removes:
                meta.pop(key, None)
        io.err(f"Successfully updated VM {uuid}\n")
        return 0

    def _object(self, uuid: str, payload: dict[str, Any]) -> dict[str, Any]:
        brand = payload["brand"]
        zpool = payload.get("zpool", "zones")
        hvm = brand in HVM
        ram = payload.get("ram", payload.get("max_physical_memory", 256))
        obj: dict[str, Any] = {
            "uuid": uuid,
            "brand": brand,
            "type": TYPE.get(brand, "OS"),
            "alias": payload.get("alias"),
            "autoboot": payload.get("autoboot", True),
            "billing_id": "00000000-0000-0000-0000-000000000000",
            "owner_uuid": payload.get("owner_uuid", "00000000-0000-0000-0000-000000000000"),
            "create_timestamp": now_iso(),
            "cpu_shares": payload.get("cpu_shares", 100),
            "customer_metadata": dict(payload.get("customer_metadata") or {}),
            "internal_metadata": dict(payload.get("internal_metadata") or {}),
            "tags": dict(payload.get("tags") or {}),
            "hostname": payload.get("hostname", uuid),
            "hvm": hvm,
            "ram": ram,
            "max_physical_memory": payload.get("max_physical_memory", ram + MEM_OVERHEAD[brand] if hvm else ram),
            "max_lwps": payload.get("max_lwps", 2000),
            "quota": payload.get("quota", 10 if not hvm else 0),
            "zfs_io_priority": payload.get("zfs_io_priority", 100),
            "zonename": uuid,
            "zpool": zpool,
            "zonepath": f"/{zpool}/{uuid}",
            "zfs_filesystem": f"{zpool}/{uuid}",
            "zonedid": len(self.vms) + 1,
            "resolvers": list(payload.get("resolvers") or []),
            "server_uuid": self.gz.server_uuid,
            "platform_buildstamp": self.gz.live_image,
            "limit_priv": "default",
        }
        obj["max_swap"] = payload.get("max_swap", max(obj["max_physical_memory"], 256))
        obj["max_locked_memory"] = payload.get("max_locked_memory", obj["max_physical_memory"])
        for key in (
            "vcpus",
            "bootrom",
            "cpu_type",
            "image_uuid",
            "kernel_version",
            "cpu_cap",
            "do_not_inventory",
            "firewall_enabled",
            "dns_domain",
        ):
            if key in payload:
                obj[key] = payload[key]
        if hvm:
            obj.setdefault("vcpus", 1)
            if brand == "bhyve":
                obj.setdefault("bootrom", "bios")
            else:
                obj.setdefault("cpu_type", "qemu64")
        obj["nics"] = [self._nic(n, i, brand) for i, n in enumerate(payload.get("nics") or [])]
        if obj["nics"] and not any(n.get("primary") for n in obj["nics"]):
            obj["nics"][0]["primary"] = True
        return obj

    @staticmethod
    def _nic(nic: dict[str, Any], i: int, brand: str) -> dict[str, Any]:
        out = dict(nic)
        out.setdefault("interface", f"{'eth' if brand == 'lx' else 'net'}{i}")
        out["mac"] = (out.get("mac") or "90:b8:d0:" + ":".join(f"{b:02x}" for b in os.urandom(3))).lower()
        ips = out.get("ips") or ([out["ip"]] if out.get("ip") else ["dhcp"])
        out["ips"] = ips
        v4 = next((ip for ip in ips if re.match(r"^\d+\.\d+\.\d+\.\d+/\d+$", ip)), None)
        if v4:  # vmadm shows the first IPv4 in the old fields too
            iface = ipaddress.IPv4Interface(v4)
            out["ip"], out["netmask"] = str(iface.ip), str(iface.netmask)
        elif "dhcp" in ips:
            out["ip"] = "dhcp"
        if out.get("gateways"):
            out["gateway"] = out["gateways"][0]
        return out

    def _make_disks(self, vm: VmRecord, payload: dict[str, Any]) -> None:
        if vm.brand in OS:
            image = self.gz.imgadm.images[payload["image_uuid"]]
            image.clones.add(vm.uuid)
            return
        disks = []
        for i, disk in enumerate(payload.get("disks") or []):
            zpool = disk.get("zpool", vm.obj["zpool"])
            dataset = f"{zpool}/{vm.uuid}/disk{i}" if vm.brand == "bhyve" else f"{zpool}/{vm.uuid}-disk{i}"
            path = f"/dev/zvol/rdsk/{dataset}"
            out = {k: v for k, v in disk.items() if k not in ("nocreate",)}
            out.update(
                {
                    "path": path,
                    "zfs_filesystem": dataset,
                    "zpool": zpool,
                    "media": disk.get("media", "disk"),
                    "model": disk.get("model", vm.obj.get("disk_driver")),
                    "boot": disk.get("boot", False),
                    "compression": disk.get("compression", "off"),
                }
            )
            if disk.get("media", "disk") == "disk" and not disk.get("nocreate"):
                if "image_uuid" in disk:
                    image = self.gz.imgadm.images[disk["image_uuid"]]
                    out["image_size"] = out["size"] = image.manifest.get("image_size")
                    self.gz.make_clone(path, image.file)  # zfs clone of <image>@final
                    image.clones.add(vm.uuid)
                    vm.nocloud = vm.nocloud or (
                        vm.brand == "bhyve" and (image.manifest.get("tags") or {}).get(NOCLOUD_TAG) == "nocloud"
                    )
                else:
                    out["block_size"] = disk.get("block_size", 8192)
                    self.gz.make_zvol(path, int(disk["size"]))
                out["refreservation"] = out["size"]
                vm.files.append(path)
            disks.append(out)
        if vm.nocloud:  # SmartOS adds the NoCloud disk itself
            dataset = f"{vm.obj['zpool']}/{vm.uuid}/disk{len(disks)}"
            disks.append(
                {
                    "path": f"/dev/zvol/rdsk/{dataset}",
                    "zfs_filesystem": dataset,
                    "zpool": vm.obj["zpool"],
                    "media": "disk",
                    "model": "virtio",
                    "boot": False,
                    "size": CIDATA_MIB,
                    "cloudinit_datasource": "nocloud",
                }
            )
        vm.obj["disks"] = disks

    # -- power ----------------------------------------------------------------------------------------
    def _boot(self, vm: VmRecord) -> None:
        backing, zones = self.gz.backing, self.gz.zones
        if vm.brand in HVM and backing is not None:
            boot = next(d for d in vm.obj["disks"] if d.get("boot"))
            vm.guest, vm.backing = backing.start(vm, self.gz.path(boot["path"])), backing
        elif vm.brand in OS and zones is not None:
            vm.guest, vm.backing = zones.start(vm, self.gz.path(vm.obj["zonepath"])), zones
        elif vm.brand in OS and getattr(backing, "backs_zones", False):
            vm.guest, vm.backing = backing.start(vm, None), backing
        vm.zoneid = self.gz.next_zoneid()
        vm.boot_timestamp = now_iso()
        vm.state = "running"

    def _halt(self, vm: VmRecord) -> None:
        if vm.guest is not None:
            vm.backing.stop(vm.guest)
            vm.guest = None
        vm.state, vm.transition, vm.zoneid, vm.boot_timestamp = "stopped", None, None, None

    def _hang_if_stuck(self, vm: VmRecord, what: str) -> None:
        if self.gz.faults.is_stuck(vm):
            if vm.state == "running":
                vm.state = "stopping"
                vm.transition = {
                    "transition_to": "stopped",
                    "transition_expire": int(time.time() + STOP_TIMEOUT) * 1000,
                }
            time.sleep(self.gz.faults.stuck_seconds)
            raise VmadmError(
                f"Failed to {what} VM {vm.uuid}: timed out waiting for zone {vm.uuid} to halt (state {vm.state})"
            )

    def cmd_start(self, rest: list[str], io: Io) -> int:
        if not rest:
            raise VmadmError("Usage: vmadm start <uuid> [option=value ...]", 2)
        vm = self.record(rest[0], "start")
        with vm.lock:
            if vm.state != "stopped":
                raise VmadmError(f"Failed to start VM {vm.uuid}: VM is {vm.state}, not stopped")
            self._boot(vm)
        io.err(f"Successfully started VM {vm.uuid}\n")
        return 0

    def cmd_stop(self, rest: list[str], io: Io) -> int:
        force, timeout, uuid = False, None, None
        it = iter(rest)
        for a in it:
            if a == "-F":
                force = True
            elif a == "-t":
                timeout = int(next(it, "0"))
            elif uuid is None:
                uuid = a
            else:
                raise VmadmError("Usage: vmadm stop <uuid> [-F] [-t timeout]", 2)
        if uuid is None:
            raise VmadmError("Usage: vmadm stop <uuid> [-F] [-t timeout]", 2)
        vm = self.record(uuid, "stop")
        if timeout is not None and vm.brand not in HVM:
            raise VmadmError(f"Failed to stop VM {uuid}: -t is only for HVM and docker VMs")
        with vm.lock:
            if vm.state not in ("running", "stopping"):
                raise VmadmError(f"Failed to stop VM {uuid}: VM is not running (state {vm.state})")
            self._hang_if_stuck(vm, "stop")
            if not force and vm.brand in HVM and vm.guest is not None:
                self._graceful(vm, STOP_TIMEOUT if timeout is None else timeout)
            self._halt(vm)
        io.err(f"Successfully completed stop for VM {uuid}\n")
        return 0

    def _graceful(self, vm: VmRecord, timeout: int) -> None:
        """ACPI power-off; `stopping` until the guest halts or the timeout forces it."""
        vm.state = "stopping"
        vm.transition = {"transition_to": "stopped", "transition_expire": int(time.time() + timeout) * 1000}
        vm.backing.powerdown(vm.guest)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and vm.backing.running(vm.guest):
            time.sleep(0.2)

    def cmd_delete(self, rest: list[str], io: Io) -> int:
        if len(rest) != 1:
            raise VmadmError("Usage: vmadm delete <uuid>", 2)
        vm = self.record(rest[0], "delete")
        with vm.lock:
            if vm.state in ("running", "stopping"):
                self._hang_if_stuck(vm, "delete")
                self._halt(vm)
            self._remove(vm)
        io.err(f"Successfully deleted VM {vm.uuid}\n")
        return 0

    def _remove(self, vm: VmRecord) -> None:
        if vm.guest is not None:
            self._halt(vm)
        for path in vm.files:
            self.gz.remove_zvol(path)
        for image in self.gz.imgadm.images.values():
            image.clones.discard(vm.uuid)
        with self.lock:
            self.vms.pop(vm.uuid, None)

    # -- reading ----------------------------------------------------------------------------------------
    def cmd_get(self, rest: list[str], io: Io) -> int:
        if len(rest) != 1:
            raise VmadmError("Usage: vmadm get <uuid>", 2)
        io.out(json.dumps(self.record(rest[0], "get").get(), indent=2) + "\n")
        return 0

    def _select(self, filters: list[str]) -> list[dict[str, Any]]:
        parsed = []
        for f in filters:
            key, sep, value = f.partition("=")
            if not sep:
                raise VmadmError(f"Invalid filter {f!r}: want key=value or key=~regex", 2)
            parsed.append((key, value))
        with self.lock:
            vms = [vm.get() for vm in self.vms.values()]
        return [vm for vm in vms if matches(vm, parsed)]

    def cmd_lookup(self, rest: list[str], io: Io) -> int:
        as_json, one, fields, filters = False, False, None, []
        it = iter(rest)
        for a in it:
            if a == "-j":
                as_json = True
            elif a == "-1":
                one = True
            elif a == "-o":
                fields = next(it, "").split(",")
            else:
                filters.append(a)
        found = self._select(filters)
        if one and len(found) != 1:
            raise VmadmError(f"Requested unique lookup but found {len(found)} results.")
        if as_json:
            out = [{k: v for k, v in vm.items() if fields is None or k in fields} for vm in found]
            io.out(json.dumps(out, indent=2) + "\n")
        else:
            io.out("".join(f"{vm['uuid']}\n" for vm in found))
        return 0

    def cmd_list(self, rest: list[str], io: Io) -> int:
        parsable, header, fields, sort, filters = (
            False,
            True,
            ["uuid", "type", "ram", "state", "alias"],
            ["ram", "uuid"],
            [],
        )
        it = iter(rest)
        for a in it:
            if a == "-p":
                parsable, header = True, False
            elif a == "-H":
                header = False
            elif a == "-o":
                fields = next(it, "").split(",")
            elif a == "-s":
                sort = next(it, "").split(",")
            else:
                filters.append(a)
        for f in fields + [s.lstrip("-") for s in sort]:
            if f not in LISTABLE and not re.fullmatch(r"(nics|disks)\.\d+\.[a-z_]+", f):
                raise VmadmError(f"Invalid field {f!r}: it is not listable (see vmadm(8) PROPERTIES)", 2)
        rows = [flatten(vm) for vm in self._select(filters)]
        for key in reversed(sort):
            desc = key.startswith("-")
            k = key.lstrip("-")
            rows.sort(
                key=lambda r: (r.get(k) is None, r.get(k) if isinstance(r.get(k), (int, float)) else _text(r.get(k))),
                reverse=desc,
            )
        table = [[_text(r.get(f)) if r.get(f) is not None else "-" for f in fields] for r in rows]
        if parsable:
            io.out("".join(":".join(c.replace(":", "\\:") for c in row) + "\n" for row in table))
            return 0
        if header:
            table.insert(0, [f.upper() for f in fields])
        widths = [max([len(row[i]) for row in table] or [0]) for i in range(len(fields))]
        io.out("".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n" for row in table))
        return 0
