"""VMs and their config: list, clone (linked/full, `target` node), create (with import-from), template,
config GET/PUT/POST, status/current, start, stop, destroy.

Checks sit where qemu-server puts them: clone, config, template and destroy pre-checks answer a
synchronous 500; start, stop and destroy check the lock inside their task. Config follows
update_vm_api for a stopped VM: deletes first (a deleted disk becomes unusedN), then the new values
(a disk key may name an existing volume: it is attached), then `unusedN` entries whose volume is
attached again are dropped (write_vm_config); a boot order must name devices that exist.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .auth import require
from .schema import parse_property_string
from .state import PveError, VmState, Volume, bad_param, fail, handler, new_uuid
from .storage import (
    add_volume,
    drop_volume,
    file_for,
    find_volume,
    import_source,
    storage_lock_error,
    storage_start,
    vm_volumes,
)
from .tasks import flock_sync, new_task

if TYPE_CHECKING:
    from .server import PveEmulator

DISK = re.compile(r"(scsi|virtio|sata|ide|efidisk|tpmstate)\d+")
UNUSED = re.compile(r"unused\d+")
# qemu-server's check_vm_modify_config_perm: the privilege each config key needs (else VM.Config.Options)
KEY_PRIVILEGES = [
    (re.compile(r"net\d+"), "VM.Config.Network"),
    (re.compile(r"cores|sockets|cpu|cpulimit|cpuunits|vcpus|affinity|numa\d*"), "VM.Config.CPU"),
    (re.compile(r"memory|balloon|shares"), "VM.Config.Memory"),
    (re.compile(r"ci\w+|sshkeys|ipconfig\d+|nameserver|searchdomain"), "VM.Config.Cloudinit"),
    (re.compile(r"(scsi|virtio|sata|ide|efidisk|tpmstate|unused)\d+"), "VM.Config.Disk"),
    (re.compile(r"vga|scsihw|machine|bios|hotplug|tablet|keyboard|serial\d+"), "VM.Config.HWType"),
]


# -- lookups ----------------------------------------------------------------------------------------


def find_vm(emu: PveEmulator, node: str, vmid: int) -> VmState:
    vm = emu.vms.get(vmid)
    if vm is None or vm.node != node:
        raise fail(f"Configuration file 'nodes/{node}/qemu-server/{vmid}.conf' does not exist")
    return vm


def lock_of(vm: VmState) -> str | None:
    if vm.hold_lock:
        return vm.hold_lock[0]
    return vm.config.get("lock")


def check_lock(vm: VmState) -> None:
    lock = lock_of(vm)
    if lock:
        raise fail(f"VM is locked ({lock})")


def memory_mib(vm: VmState) -> int:
    return int(str(vm.config.get("memory", 512)).split("=")[-1])


def new_mac(emu: PveEmulator) -> str:
    n = next(emu._macs)
    return f"BC:24:11:{(n >> 16) & 0xFF:02X}:{(n >> 8) & 0xFF:02X}:{n & 0xFF:02X}"


def is_disk(key: str, value: object) -> bool:
    """A drive holding a volume (not a CD-ROM, not the cloud-init drive)."""
    return bool(DISK.fullmatch(key)) and ":" in str(value) and "media=cdrom" not in str(value)


def disk_keys(cfg: dict) -> list[str]:
    return [k for k, v in cfg.items() if is_disk(k, v)]


def boot_order(cfg: dict) -> list[str]:
    boot = str(cfg.get("boot") or "")
    return [d for d in boot.removeprefix("order=").split(";") if d] if boot.startswith("order=") else []


def boot_disk(cfg: dict) -> str:
    """The config key of the disk the VM boots from ("" if none): the first disk of the boot order,
    else the legacy `bootdisk`, else the first disk."""
    for key in [*boot_order(cfg), str(cfg.get("bootdisk") or ""), *disk_keys(cfg)]:
        if key in cfg and is_disk(key, cfg[key]):
            return key
    return ""


def vm_summary(emu: PveEmulator, vm: VmState) -> dict:
    entry = {
        "vmid": vm.vmid,
        "name": vm.config.get("name", f"VM {vm.vmid}"),
        "status": "running" if vm.running else "stopped",
        "template": 1 if vm.config.get("template") else 0,
        "maxmem": memory_mib(vm) * 1024 * 1024,
        "cpus": int(vm.config.get("cores", 1)) * int(vm.config.get("sockets", 1)),
        "uptime": int(time.monotonic() - vm.booted_at) if vm.running and vm.booted_at else 0,
    }
    lock = lock_of(vm)
    if lock:
        entry["lock"] = lock
    if vm.config.get("tags"):
        entry["tags"] = vm.config["tags"]
    return entry


def digest(vm: VmState) -> str:
    return hashlib.sha1(json.dumps(vm.config, sort_keys=True).encode()).hexdigest()


def key_privilege(key: str) -> str:
    return next((priv for rx, priv in KEY_PRIVILEGES if rx.fullmatch(key)), "VM.Config.Options")


def require_sdn_use(emu: PveEmulator, who, cfg: dict) -> None:
    """PVE 8+: SDN.Use on the zone path of every bridge the NICs of `cfg` use (a plain bridge is
    in the `localnetwork` zone; check_bridge_access)."""
    if emu.release < (8, 0):
        return
    for key, value in cfg.items():
        m = re.search(r"(?:^|,)bridge=([^,]+)", str(value)) if re.fullmatch(r"net\d+", key) else None
        if m:
            require(who, f"/sdn/zones/localnetwork/{m.group(1)}", "SDN.Use")


def _normalise_net(emu: PveEmulator, text: str) -> str:
    """net0 as PVE stores it: `model=MAC,...` (a MAC is generated when none is given)."""
    fmt = emu.schema.param_schema("/nodes/{node}/qemu/{vmid}/config", "PUT", "net0")["format"]
    _errs, vals = parse_property_string(fmt, text)
    model = vals.pop("model")
    mac = vals.pop("macaddr", None) or new_mac(emu)
    rest = ",".join(f"{k}={v}" for k, v in vals.items())
    return f"{model}={mac}" + (f",{rest}" if rest else "")


def ip_config(emu: PveEmulator, vm: VmState) -> tuple[str, int, str]:
    """(address, prefix, gateway) the guest gets: ipconfig0's static address (cloud-init), else the
    bridge's DHCP answer."""
    ipconf = str(vm.config.get("ipconfig0", "ip=dhcp"))
    m = re.search(r"(?:^|,)ip=([0-9.]+)/(\d+)", ipconf)
    gw = re.search(r"(?:^|,)gw=([0-9.]+)", ipconf)
    if m:
        return m.group(1), int(m.group(2)), gw.group(1) if gw else ""
    if emu.backing is not None:
        return vm.dhcp_ip, emu.backing.prefix, emu.backing.gateway
    return vm.dhcp_ip, 24, ""


def add_template(
    emu: PveEmulator, vmid: int, name: str, node: str, memory: int, storage: str, disk: Path | None
) -> None:
    cfg = {
        "name": name,
        "template": 1,
        "agent": "1",
        "cores": 1,
        "sockets": 1,
        "memory": memory if emu.version == "7.4" else str(memory),
        "net0": f"virtio={new_mac(emu)},bridge=vmbr0",
        "ostype": "l26",
        "scsihw": "virtio-scsi-single",
        "scsi0": f"{storage}:base-{vmid}-disk-0,size=4G",
        "ide2": f"{storage}:vm-{vmid}-cloudinit,media=cdrom",
        "boot": "order=scsi0",
        "serial0": "socket",
        "vga": "serial0",
        "smbios1": f"uuid={new_uuid()}",
    }
    emu.vms[vmid] = VmState(vmid, node, cfg)
    add_volume(
        emu,
        node,
        f"{storage}:base-{vmid}-disk-0",
        "images",
        "qcow2",
        4 * 1024**3,
        vmid,
        file=disk,
        external=disk is not None,
    )
    add_volume(emu, node, f"{storage}:vm-{vmid}-cloudinit", "images", "raw", 4 * 1024**2, vmid)


# -- handlers ---------------------------------------------------------------------------------------


@handler("GET", "/nodes/{node}/qemu")
def _list(emu: PveEmulator, p, who):
    return [vm_summary(emu, vm) for vm in emu.vms.values() if vm.node == p["node"]]


@handler("POST", "/nodes/{node}/qemu/{vmid}/clone")
def _clone(emu: PveEmulator, p, who):
    node, vmid, newid = p["node"], p["vmid"], p["newid"]
    src = find_vm(emu, node, vmid)
    if newid in emu.vms:
        raise fail(f"unable to create VM {newid}: config file already exists")
    check_lock(src)
    is_tmpl = bool(src.config.get("template"))
    full = p.get("full", 0 if is_tmpl else 1)
    disks = disk_keys(src.config)
    first = str(src.config.get(disks[0], "")).split(",")[0] if disks else ""
    src_storage = emu.storages[first.split(":", 1)[0]] if first else None
    if not full:
        if not is_tmpl:
            drive = disks[0] if disks else "scsi0"
            where = f"for drive '{drive}'" if emu.version == "7.4" else f"({drive})"
            raise fail(f"Linked clone feature is not supported for '{first}' {where}")
        for key in ("storage", "format"):
            if key in p:
                raise fail(f"parameter '{key}' not allowed for linked clones")
    target = p.get("target", node)
    if target != node:
        if target not in emu.nodes:
            raise fail(f"no such cluster node '{target}'")
        if target in emu.offline_nodes:
            raise fail(f"target node '{target}' is not online")
        if src_storage is not None and not src_storage.shared:
            raise fail(f"can't clone VM to node '{target}' (VM uses local storage)")
    storage = p.get("storage", src_storage.name if src_storage else emu.storage)
    if storage not in emu.storages:
        raise fail(f"storage '{storage}' does not exist")
    if "images" not in emu.storages[storage].content:
        raise bad_param("storage", f"storage '{storage}' does not support vm images")
    if full and target != node and not emu.storages[storage].shared:
        raise fail(f"can't clone VM to node '{target}' (VM uses local storage)")
    require(who, f"/storage/{storage}", "Datastore.AllocateSpace")  # "on any used storage"
    require_sdn_use(emu, who, src.config)  # "and 'SDN.Use' on any used bridge/vnet" (8+)
    cfg = {k: v for k, v in copy.deepcopy(src.config).items() if k not in ("template", "lock")}
    cfg["name"] = p.get("name", f"Copy-of-VM-{src.config.get('name', vmid)}")
    if "description" in p:
        cfg["description"] = p["description"]
    for key in [k for k in cfg if re.fullmatch(r"net\d+", k)]:
        model = cfg[key].split(",")[0].split("=")[0]
        cfg[key] = re.sub(r"^[^,]+", f"{model}={new_mac(emu)}", cfg[key])
    copies: list[tuple[str, str]] = []  # (source volid, new volid)
    for i, key in enumerate(disks):
        base, *options = str(src.config[key]).split(",")
        new_volid = f"{storage}:vm-{newid}-disk-{i}" if full else f"{base}/vm-{newid}-disk-{i}"
        copies.append((base, new_volid))
        cfg[key] = ",".join([new_volid, *options])
    ci_storage = storage if full else (src_storage.name if src_storage else storage)
    for key in [k for k, v in cfg.items() if "-cloudinit" in str(v)]:
        cfg[key] = f"{ci_storage}:vm-{newid}-cloudinit,media=cdrom"
    cfg["smbios1"] = f"uuid={new_uuid()}"
    cfg["lock"] = "clone"
    new = VmState(newid, target, cfg, linked_base=None if full else vmid)
    emu.vms[newid] = new
    seconds = emu.full_clone_seconds if full else emu.task_seconds["qmclone"]
    delay = storage_start(emu, storage, seconds)
    error = None
    if delay is None:
        delay, seconds, error = 0.0, emu.storage_lock_timeout, storage_lock_error(emu, storage)

    def ok():
        for base_volid, new_volid in copies:
            base = find_volume(emu, node, base_volid)
            vol = add_volume(
                emu, target, new_volid, "images", "qcow2", 4 * 1024**3, newid, parent=None if full else base_volid
            )
            if emu.backing is not None and base is not None and base.file is not None:
                vol.file = file_for(emu, target, vol.volid, ".qcow2")
                emu.backing.make_disk(vol.file, base.file, linked=not full)
        if any("-cloudinit" in str(v) for v in cfg.values()):
            add_volume(emu, target, f"{ci_storage}:vm-{newid}-cloudinit", "images", "raw", 4 * 1024**2, newid)
        new.config.pop("lock", None)

    def failed():  # PVE removes the half-made clone: config and disks
        if emu.vms.get(newid) is new:
            for v in vm_volumes(emu, new):
                drop_volume(emu, v)
            del emu.vms[newid]

    kind = "full" if full else "linked"
    return new_task(
        emu,
        node,
        "qmclone",
        vmid,
        who,
        seconds,
        on_ok=ok,
        on_fail=failed,
        error=error,
        start_delay=delay,  # the new VM is guarded by `lock: clone`, not the flock
        log=[f"create {kind} clone of drive {key} ({base})" for key, (base, _new) in zip(disks, copies)],
    )


@handler("POST", "/nodes/{node}/qemu")
def _create(emu: PveEmulator, p, who):
    node, vmid = p["node"], p["vmid"]
    if vmid in emu.vms:
        raise fail(f"unable to create VM {vmid} - VM {vmid} already exists on node '{emu.vms[vmid].node}'")
    skip = {"node", "vmid", "start", "storage", "pool", "unique", "force", "archive", "live-restore", "bwlimit"}
    cfg = {}
    imports: list[tuple[str, str, Volume | None]] = []  # (config key, new volid, source)
    for key, value in p.items():
        if key in skip:
            continue
        if re.fullmatch(r"net\d+", key):
            value = _normalise_net(emu, value)
        elif re.fullmatch(r"(scsi|virtio|sata|ide)\d+", key) and ":" in str(value):
            parts = str(value).split(",")
            src = next((x.split("=", 1)[1] for x in parts[1:] if x.startswith("import-from=")), None)
            stor, _, size = parts[0].partition(":")
            if src is not None and size != "0":
                raise bad_param(key, "'import-from' requires special syntax - use <storage ID>:0,import-from=<source>")
            if size == "cloudinit":
                volid = f"{stor}:vm-{vmid}-cloudinit"
                value = f"{volid},media=cdrom"
                imports.append((key, volid, None))
            elif re.fullmatch(r"\d+", size):  # STOR:SIZE[,import-from=SRC]: allocate (and import)
                if stor not in emu.storages or "images" not in emu.storages[stor].content:
                    raise fail(f"storage '{stor}' does not support vm images")
                source = import_source(emu, node, key, src, who) if src is not None else None
                volid = f"{stor}:vm-{vmid}-disk-{key[-1]}"
                rest = ",".join(x for x in parts[1:] if not x.startswith("import-from="))
                value = volid + (f",{rest}" if rest else "")  # import-from is not stored
                imports.append((key, volid, source))
        cfg[key] = value
    cfg["lock"] = "create"
    vm = VmState(vmid, node, cfg)
    emu.vms[vmid] = vm

    def ok():
        for _key, volid, source in imports:
            size = source.size if source is not None else (4 * 1024**2 if volid.endswith("cloudinit") else 1024**3)
            fmt = "raw" if volid.endswith("cloudinit") else "qcow2"
            vol = add_volume(emu, node, volid, "images", fmt, size, vmid)
            if source is not None and source.file is not None:
                vol.file = file_for(emu, node, volid, ".qcow2")
                _copy_file(source.file, vol.file)
        vm.config.pop("lock", None)
        if p.get("start"):
            vm.running, vm.booted_at = True, time.monotonic()

    def failed():
        if emu.vms.get(vmid) is vm:
            del emu.vms[vmid]

    log = [f"importing disk '{src.volid}' to VM {vmid} ..." for _k, _v, src in imports if src is not None]
    return new_task(
        emu, node, "qmcreate", vmid, who, emu.task_seconds["qmcreate"], on_ok=ok, on_fail=failed, flock=vm, log=log
    )


def _copy_file(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # the emulator never writes a source again: a hard link is a copy
    except OSError:
        shutil.copyfile(src, dst)


@handler("POST", "/nodes/{node}/qemu/{vmid}/template")
def _template(emu: PveEmulator, p, who):
    vm = find_vm(emu, p["node"], p["vmid"])
    check_lock(vm)
    if vm.config.get("template"):
        raise fail("you can't convert a template to a template")
    if vm.running:
        raise fail("you can't convert a VM to template if VM is running")

    def ok():
        for vol in [v for v in vm_volumes(emu, vm) if f"vm-{vm.vmid}-disk-" in v.volid]:
            emu.volumes.pop((vol.node, vol.volid))
            vol.volid = vol.volid.replace(f"vm-{vm.vmid}-disk-", f"base-{vm.vmid}-disk-")
            emu.volumes[(vol.node, vol.volid)] = vol
        for key, value in list(vm.config.items()):
            if isinstance(value, str) and f"vm-{vm.vmid}-disk-" in value:
                vm.config[key] = value.replace(f"vm-{vm.vmid}-disk-", f"base-{vm.vmid}-disk-")
        vm.config["template"] = 1

    return new_task(emu, p["node"], "qmtemplate", vm.vmid, who, emu.task_seconds["qmtemplate"], on_ok=ok, flock=vm)


@handler("GET", "/nodes/{node}/qemu/{vmid}/config")
def _config_get(emu: PveEmulator, p, who):
    vm = find_vm(emu, p["node"], p["vmid"])
    out = dict(vm.config)
    if vm.hold_lock:
        out["lock"] = vm.hold_lock[0]
    out["digest"] = digest(vm)
    return out


def _apply_config(emu: PveEmulator, vm: VmState, p: dict, who) -> None:
    changes = {
        k: v
        for k, v in p.items()
        if k not in ("node", "vmid", "digest", "delete", "skiplock", "revert", "force", "background_delay")
    }
    deletes = [k for k in re.split(r"[,;\s]+", p.get("delete", "")) if k]
    if not changes and not deletes:
        raise fail("no options specified")
    if "digest" in p and p["digest"] != digest(vm):
        raise fail("checksum mismatch (file change by other user?)")
    if p.get("skiplock"):
        raise PveError(500, "Only root may use this option.")
    for key in [*changes, *deletes]:
        require(who, f"/vms/{vm.vmid}", key_privilege(key))
    require_sdn_use(emu, who, {k: v for k, v in changes.items() if re.fullmatch(r"net\d+", k)})
    flock_sync(emu, vm)
    check_lock(vm)
    for dev in boot_order(changes) if "boot" in changes else []:
        if dev not in vm.config and dev not in changes or dev in deletes:
            raise fail(f"invalid bootorder: device '{dev}' does not exist'")
    attach = {k: _attachable(emu, vm, k, v, who) for k, v in changes.items() if DISK.fullmatch(k) and ":" in str(v)}
    for key in deletes:
        old = vm.config.pop(key, None)
        if old is None:
            continue
        if is_disk(key, old) and not vm.running:  # detached, not destroyed
            _add_unused(vm, str(old).split(",")[0])
        if key in boot_order(vm.config) and "boot" not in changes:
            rest = [d for d in boot_order(vm.config) if d != key]
            if rest:
                vm.config["boot"] = "order=" + ";".join(rest)
            else:  # print_bootorder of no device is ""
                del vm.config["boot"]
    for key, value in changes.items():
        if re.fullmatch(r"net\d+", key):
            value = _normalise_net(emu, value)
        elif key in attach:
            value = ",".join([attach[key].volid, *str(value).split(",")[1:]])
        vm.config[key] = value
    attached = {str(v).split(",")[0] for k, v in vm.config.items() if DISK.fullmatch(k)}
    for key in [k for k, v in vm.config.items() if UNUSED.fullmatch(k) and v in attached]:
        del vm.config[key]  # write_vm_config: "remove 'unusedX' settings if we re-add a volume"


def _attachable(emu: PveEmulator, vm: VmState, key: str, value: object, who) -> Volume:
    """The existing volume a disk key names (create_disks, an existing volume): it must exist, and
    another VM's volume needs Datastore.Allocate on its storage (check_volume_access)."""
    volid = str(value).split(",")[0]
    stor, _, name = volid.partition(":")
    if re.fullmatch(r"\d+(\.\d+)?", name):
        raise PveError(501, f"emulator: allocating a new disk through config ({key}={volid}) is not modelled")
    vol = find_volume(emu, vm.node, volid)
    if vol is None:
        raise fail(f"volume {volid} does not exist")
    if vol.content not in ("images", "iso"):
        raise fail(f"cannot use volume {volid} - content type needs to be 'images' or 'iso'")
    if vol.vmid != vm.vmid:
        require(who, f"/storage/{stor}", "Datastore.Allocate")
    return vol


def _add_unused(vm: VmState, volid: str) -> None:
    if volid in {v for k, v in vm.config.items() if UNUSED.fullmatch(k)}:
        return
    n = next(i for i in range(256) if f"unused{i}" not in vm.config)
    vm.config[f"unused{n}"] = volid


@handler("PUT", "/nodes/{node}/qemu/{vmid}/config")
def _config_put(emu: PveEmulator, p, who):
    _apply_config(emu, find_vm(emu, p["node"], p["vmid"]), p, who)
    return None


@handler("POST", "/nodes/{node}/qemu/{vmid}/config")
def _config_post(emu: PveEmulator, p, who):
    vm = find_vm(emu, p["node"], p["vmid"])
    _apply_config(emu, vm, p, who)  # the lock check runs before the fork: sync 500
    return new_task(emu, p["node"], "qmconfig", vm.vmid, who, emu.task_seconds["qmconfig"], flock=vm)


def agent_enabled(vm: VmState) -> bool:
    value = str(vm.config.get("agent", "0"))
    first = value.split(",")[0]
    first = first.split("=", 1)[1] if first.startswith("enabled=") else first
    return first.lower() in ("1", "on", "yes", "true")


@handler("GET", "/nodes/{node}/qemu/{vmid}/status/current")
def _status(emu: PveEmulator, p, who):
    vm = find_vm(emu, p["node"], p["vmid"])
    out = vm_summary(emu, vm)
    out.update({"qmpstatus": out["status"], "ha": {"managed": int(vm.ha_managed)}})
    if agent_enabled(vm):
        out["agent"] = 1
    if not out["template"]:
        del out["template"]
    if vm.running:
        out["pid"] = vm.guest.pid if vm.guest is not None else 4000 + vm.vmid
    return out


@handler("POST", "/nodes/{node}/qemu/{vmid}/status/start")
def _start(emu: PveEmulator, p, who):
    vm = find_vm(emu, p["node"], p["vmid"])
    error = None  # all checks run inside the worker
    if vm.config.get("template"):
        error = "you can't start a vm if it's a template"
    elif vm.running:
        error = f"VM {vm.vmid} already running"
    elif lock_of(vm):
        error = f"VM is locked ({lock_of(vm)})"

    def ok():
        if not vm.dhcp_ip:
            vm.dhcp_ip = (
                emu.backing.dhcp_address(vm.vmid)
                if emu.backing is not None
                else f"10.99.{vm.vmid // 250 % 250}.{vm.vmid % 250 + 2}"
            )
        if emu.backing is not None:
            key = boot_disk(vm.config)
            disk = find_volume(emu, vm.node, str(vm.config.get(key, "")).split(",")[0]) if key else None
            if disk is None or disk.file is None:
                raise fail(f"start failed: no disk data for VM {vm.vmid} ({key or 'no boot disk'})")
            ip, prefix, gw = ip_config(emu, vm)
            try:
                vm.guest = emu.backing.start(
                    vm.vmid, vm.config, disk.file, bus=re.sub(r"\d+$", "", key), ip=ip, prefix=prefix, gateway=gw
                )
            except Exception as exc:  # QEMU refused: PVE reports it in the task
                raise fail(f"start failed: {exc}") from None
        vm.running, vm.booted_at = True, time.monotonic()

    return new_task(
        emu, p["node"], "qmstart", vm.vmid, who, emu.task_seconds["qmstart"], on_ok=ok, error=error, flock=vm
    )


def _power_off(emu: PveEmulator, vm: VmState) -> None:
    if vm.guest is not None:
        emu.backing.stop(vm.guest)
        vm.guest = None
    vm.running, vm.booted_at = False, None


@handler("POST", "/nodes/{node}/qemu/{vmid}/status/stop")
def _stop(emu: PveEmulator, p, who):
    vm = find_vm(emu, p["node"], p["vmid"])
    error = f"VM is locked ({lock_of(vm)})" if lock_of(vm) and not p.get("skiplock") else None
    return new_task(
        emu,
        p["node"],
        "qmstop",
        vm.vmid,
        who,
        emu.task_seconds["qmstop"],
        on_ok=lambda: _power_off(emu, vm),
        error=error,
        flock=vm,
    )


@handler("DELETE", "/nodes/{node}/qemu/{vmid}")
def _destroy(emu: PveEmulator, p, who):
    vm = find_vm(emu, p["node"], p["vmid"])
    if vm.running:
        raise fail(f"VM {vm.vmid} is running - destroy failed")
    if vm.ha_managed and not p.get("purge"):
        raise fail(f"unable to remove VM {vm.vmid} - used in HA resources and purge parameter not set.")
    error = None
    if lock_of(vm) and not p.get("skiplock"):
        error = f"VM is locked ({lock_of(vm)})"
    elif vm.config.get("template") and any(v.linked_base == vm.vmid for v in emu.vms.values()):
        base = str(vm.config.get(boot_disk(vm.config), "")).split(",")[0]
        error = f"base volume '{base}' is still in use by linked cloned"

    def ok():
        if lock_of(vm):  # locked while the destroy task ran
            raise fail(f"VM is locked ({lock_of(vm)})")
        for vol in vm_volumes(emu, vm):
            drop_volume(emu, vol)
        emu.vms.pop(vm.vmid, None)

    return new_task(
        emu, p["node"], "qmdestroy", vm.vmid, who, emu.task_seconds["qmdestroy"], on_ok=ok, error=error, flock=vm
    )
