"""vmadm's create payload, as vmadm(8) documents it (smartos-live src/vm/man/vmadm.8.md, PROPERTIES),
with the per-brand table of src/vm/node_modules/proptable.js where the man page is vaguer (which
brands take a property). Facts only: the table below is written for this emulator.

`validate_create(payload, host)` answers as `vmadm validate create` does: a dict with
`bad_brand`, `bad_properties` (unknown, or not for this brand, or not at create), `bad_values`
(wrong type or value) and `missing_properties`; empty when the payload is valid.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

OS = frozenset({"joyent", "joyent-minimal", "lx", "builder"})  # vmtype OS
HVM = frozenset({"bhyve", "kvm"})  # vmtype HVM
ANY = OS | HVM
BRANDS = ANY
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MAC = re.compile(r"^[0-9a-fA-F]{1,2}(:[0-9a-fA-F]{1,2}){5}$")
COMPRESSION = re.compile(r"^(on|off|gzip|gzip-[1-9]|lz4|lzjb|zle)$")
ZPOOL = re.compile(r"^[A-Za-z][A-Za-z0-9_.:-]*$")
NIC_MODELS = {"kvm": ("virtio", "e1000", "rtl8139"), "bhyve": ("virtio", "e1000")}
DISK_MODELS = {"kvm": ("virtio", "ide", "scsi"), "bhyve": ("virtio", "ahci", "nvme")}


@dataclass(frozen=True)
class Prop:
    type: str  # string, integer, boolean, uuid, list, flat-object, object-array, zpool
    brands: frozenset[str]
    values: tuple | Callable[[str], tuple] | None = None  # allowed values (per brand if a function)
    min: int | None = None
    max: int | None = None
    check: Callable[[Any], str] | None = None  # extra value rule: "" if fine, else why not


def _ipv4(v: Any) -> str:
    try:
        ipaddress.IPv4Address(str(v))
    except ValueError:
        return "not an IPv4 address"
    return ""


def _ips(v: Any) -> str:
    if len(v) > 20:
        return "more than 20 addresses"
    for ip in v:
        if ip in ("dhcp", "addrconf"):
            continue
        if "/" not in str(ip):
            return f"{ip!r}: addresses need their routing prefix (CIDR)"
        try:
            ipaddress.ip_interface(str(ip))
        except ValueError:
            return f"{ip!r} is not an address with a prefix, dhcp or addrconf"
    return ""


def _power_of_two(v: Any) -> str:
    return "" if 512 <= v <= 131072 and v & (v - 1) == 0 else "must be a power of 2 from 512 to 131072"


def _mac(v: Any) -> str:
    return "" if MAC.match(str(v)) else "not a MAC address"


def _primary(v: Any) -> str:
    return "" if v is True else "only true is valid"


def _pci_slot(v: Any) -> str:
    return "" if re.fullmatch(r"(\d{1,3}:)?\d{1,2}(:\d)?", str(v)) else "not <bus>:<device>:<function>"


def _block_sizes(v: Any) -> str:
    return "" if re.fullmatch(r"\d+(/\d+)?", str(v)) else 'not "NNN" or "NNN/NNN"'


P = Prop
PROPERTIES: dict[str, Prop] = {
    "alias": P("string", ANY),
    "archive_on_delete": P("boolean", ANY),
    "autoboot": P("boolean", ANY),
    "billing_id": P("string", ANY),
    "bhyve_extra_opts": P("string", frozenset({"bhyve"})),
    "boot": P("string", HVM),
    "bootrom": P("string", frozenset({"bhyve"}), values=("bios", "uefi")),
    "brand": P("string", ANY, values=tuple(sorted(BRANDS))),
    "com1": P("string", frozenset({"bhyve"})),
    "com2": P("string", frozenset({"bhyve"})),
    "cpu_cap": P("integer", ANY, min=0),
    "cpu_shares": P("integer", ANY, min=0),
    "cpu_type": P("string", frozenset({"kvm"}), values=("qemu64", "host")),
    "customer_metadata": P("flat-object", ANY),
    "delegate_dataset": P("boolean", OS),
    "disks": P("object-array", HVM),
    "disk_driver": P("string", HVM, values=lambda b: DISK_MODELS[b]),
    "do_not_inventory": P("boolean", ANY),
    "docker": P("boolean", frozenset({"lx", "joyent-minimal"})),
    "dns_domain": P("string", OS),
    "filesystems": P("object-array", OS),
    "firewall_enabled": P("boolean", ANY),
    "flexible_disk_size": P("integer", frozenset({"bhyve"}), min=0),
    "fs_allowed": P("list", OS),
    "hostname": P("string", ANY),
    "image_uuid": P("uuid", ANY),
    "indestructible_delegated": P("boolean", ANY),
    "indestructible_zoneroot": P("boolean", ANY),
    "init_name": P("string", OS),
    "internal_metadata": P("flat-object", ANY),
    "internal_metadata_namespaces": P("list", ANY),
    "kernel_version": P("string", frozenset({"lx"})),
    "limit_priv": P("list", ANY),
    "maintain_resolvers": P("boolean", OS),
    "max_locked_memory": P("integer", ANY, min=0),
    "max_lwps": P("integer", ANY, min=0),
    "max_msg_ids": P("integer", ANY, min=0),
    "max_physical_memory": P("integer", ANY, min=0),
    "max_sem_ids": P("integer", ANY, min=0),
    "max_shm_ids": P("integer", ANY, min=0),
    "max_shm_memory": P("integer", ANY, min=0),
    "max_swap": P("integer", ANY, min=256),
    "mdata_exec_timeout": P("integer", OS, min=0),
    "nics": P("object-array", ANY),
    "nic_driver": P("string", frozenset({"kvm"}), values=NIC_MODELS["kvm"]),
    "nowait": P("boolean", OS),
    "owner_uuid": P("uuid", ANY),
    "package_name": P("string", ANY - {"bhyve"}),
    "package_version": P("string", ANY - {"bhyve"}),
    "qemu_opts": P("string", frozenset({"kvm"})),
    "qemu_extra_opts": P("string", frozenset({"kvm"})),
    "quota": P("integer", ANY, min=0),
    "ram": P("integer", ANY, min=0),
    "resolvers": P("list", ANY),
    "restart_init": P("boolean", OS),
    "routes": P("flat-object", ANY),
    "spice_opts": P("string", frozenset({"kvm"})),
    "spice_password": P("string", frozenset({"kvm"})),
    "spice_port": P("integer", frozenset({"kvm"}), min=-1),
    "tags": P("flat-object", ANY),
    "tmpfs": P("integer", OS, min=0),
    "uuid": P("uuid", ANY),
    "vcpus": P("integer", HVM, min=1),
    "vga": P("string", frozenset({"kvm"}), values=("cirrus", "std", "vmware", "qxl", "xenfb")),
    "virtio09": P("boolean", frozenset({"bhyve"})),
    "virtio1": P("boolean", frozenset({"bhyve"})),
    "virtio_txburst": P("integer", frozenset({"kvm"}), min=0),
    "virtio_txtimer": P("integer", frozenset({"kvm"}), min=0),
    "vnc_password": P("string", HVM),
    "vnc_port": P("integer", HVM, min=-1),
    "zfs_data_compression": P("string", OS, check=lambda v: "" if COMPRESSION.match(v) else "not a compression"),
    "zfs_data_recsize": P("integer", OS, check=_power_of_two),
    "zfs_filesystem_limit": P("integer", ANY, min=0),
    "zfs_io_priority": P("integer", ANY, min=0),
    "zfs_root_compression": P("string", ANY, check=lambda v: "" if COMPRESSION.match(v) else "not a compression"),
    "zfs_root_recsize": P("integer", ANY, check=_power_of_two),
    "zfs_snapshot_limit": P("integer", ANY, min=0),
    "zlog_max_size": P("integer", OS, min=0),
    "zone_dataset_uuid": P("uuid", HVM),
    "zonename": P("string", ANY),
    "zpool": P("zpool", ANY),
}
DISK_PROPERTIES: dict[str, Prop] = {
    "block_size": P("integer", HVM, check=_power_of_two),
    "boot": P("boolean", HVM),
    "compression": P("string", HVM, check=lambda v: "" if COMPRESSION.match(v) else "not a compression"),
    "guest_block_size": P("string", frozenset({"bhyve"}), check=_block_sizes),
    "image_name": P("string", frozenset({"kvm"})),
    "image_size": P("integer", HVM, min=0),
    "image_uuid": P("uuid", HVM),
    "media": P("string", HVM, values=("disk", "cdrom")),
    "model": P("string", HVM, values=lambda b: DISK_MODELS[b]),
    "nocreate": P("boolean", HVM),
    "notrim": P("boolean", frozenset({"bhyve"})),
    "path": P("string", HVM),
    "pci_slot": P("string", frozenset({"bhyve"}), check=_pci_slot),
    "refreservation": P("integer", HVM, min=0),
    "size": P("integer", HVM, min=1),
    "uuid": P("uuid", frozenset({"bhyve"})),
    "zpool": P("zpool", HVM),
}
NIC_PROPERTIES: dict[str, Prop] = {
    "allow_dhcp_spoofing": P("boolean", ANY),
    "allow_ip_spoofing": P("boolean", ANY),
    "allow_mac_spoofing": P("boolean", ANY),
    "allow_restricted_traffic": P("boolean", ANY),
    "allow_unfiltered_promisc": P("boolean", HVM),
    "allowed_ips": P("list", ANY),
    "allowed_dhcp_cids": P("list", ANY),
    "blocked_outgoing_ports": P("list", ANY),
    "dhcp_server": P("boolean", ANY),
    "gateway": P("string", ANY, check=_ipv4),
    "gateways": P("list", ANY, check=lambda v: next((f"{g!r}: {why}" for g in v if (why := _ipv4(g))), "")),
    "interface": P("string", ANY, check=lambda v: "" if re.fullmatch(r"(net|eth)\d+", v) else "not netX"),
    "ip": P("string", ANY, check=lambda v: "" if v == "dhcp" else _ipv4(v)),
    "ips": P("list", ANY, check=_ips),
    "mac": P("string", ANY, check=_mac),
    "model": P("string", HVM, values=lambda b: NIC_MODELS[b]),
    "mtu": P("integer", ANY, min=576, max=9000),
    "netmask": P("string", ANY, check=_ipv4),
    "network_uuid": P("uuid", ANY),
    "nic_tag": P("string", ANY),
    "primary": P("boolean", ANY, check=_primary),
    "vlan_id": P("integer", ANY, min=0, max=4095),
    "vrrp_primary_ip": P("string", OS, check=_ipv4),
    "vrrp_vrid": P("integer", OS, min=0, max=255),
}
REQUIRED = {"image_uuid": OS, "kernel_version": frozenset({"lx"})}


@dataclass
class Problems:
    bad_brand: str | None = None
    bad_properties: list[str] = field(default_factory=list)
    bad_values: list[str] = field(default_factory=list)
    missing_properties: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)  # property -> reason (the emulator's addition)

    def __bool__(self) -> bool:
        return bool(self.bad_brand or self.bad_properties or self.bad_values or self.missing_properties)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.bad_brand:
            out["bad_brand"] = self.bad_brand
        for key in ("bad_properties", "bad_values", "missing_properties"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out

    def line(self) -> str:
        """One line for `vmadm create`'s failure."""
        parts = [f"bad brand {self.bad_brand!r}"] if self.bad_brand else []
        for label, keys in (
            ("invalid properties", self.bad_properties),
            ("invalid values", self.bad_values),
            ("missing properties", self.missing_properties),
        ):
            if keys:
                parts.append(f"{label}: " + ", ".join(f"{k} ({self.why[k]})" if k in self.why else k for k in keys))
        return "; ".join(parts)


@dataclass(frozen=True)
class Host:
    """What validation needs to know of the host: NIC tags, zpools, installed images (uuid -> manifest)."""

    nic_tags: frozenset[str]
    zpools: frozenset[str] = frozenset({"zones"})
    images: dict[str, dict] = field(default_factory=dict)


def _type_error(prop: Prop, value: Any) -> str:
    t = prop.type
    if t == "string" and not isinstance(value, str):
        return "must be a string"
    if t == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        return "must be an integer"
    if t == "boolean" and not isinstance(value, bool):
        return "must be true or false"
    if t == "uuid" and not (isinstance(value, str) and UUID.match(value)):
        return "must be a UUID"
    if t == "zpool" and not (isinstance(value, str) and ZPOOL.match(value)):
        return "must be a zpool name"
    if t == "list" and not (
        isinstance(value, list) and all(isinstance(x, (str, int)) for x in value) or isinstance(value, str)
    ):
        return "must be a list of strings (or a comma-separated string)"
    if t == "flat-object" and not (
        isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    ):
        return "must be an object of string keys and string values"
    if t == "object-array" and not (isinstance(value, list) and all(isinstance(x, dict) for x in value)):
        return "must be an array of objects"
    return ""


def _value_error(prop: Prop, value: Any, brand: str) -> str:
    why = _type_error(prop, value)
    if why:
        return why
    if prop.type == "list" and isinstance(value, str):
        value = [x for x in value.split(",") if x]
    allowed = prop.values(brand) if callable(prop.values) else prop.values
    if allowed is not None and value not in allowed:
        return f"{value!r} is not one of {', '.join(allowed)} (brand {brand})"
    if prop.min is not None and value < prop.min:
        return f"less than {prop.min}"
    if prop.max is not None and value > prop.max:
        return f"more than {prop.max}"
    return prop.check(value) if prop.check else ""


def _check_props(table: dict[str, Prop], obj: dict, brand: str, prefix: str, out: Problems) -> None:
    for key, value in obj.items():
        name = f"{prefix}{key}"
        prop = table.get(key)
        if prop is None or brand not in prop.brands:
            out.bad_properties.append(name)
            out.why[name] = "unknown property" if prop is None else f"not a property of {brand} VMs"
            continue
        why = _value_error(prop, value, brand)
        if why:
            out.bad_values.append(name)
            out.why[name] = why


def validate_create(payload: Any, host: Host) -> Problems:
    out = Problems()
    if not isinstance(payload, dict):
        out.bad_values.append("payload")
        out.why["payload"] = "must be a JSON object"
        return out
    brand = payload.get("brand")
    if brand is None:
        out.missing_properties.append("brand")
        return out
    if brand not in BRANDS:
        out.bad_brand = str(brand)
        return out
    _check_props(PROPERTIES, payload, brand, "", out)
    for key, brands in REQUIRED.items():
        if brand in brands and key not in payload:
            out.missing_properties.append(key)
    if brand in HVM:
        for i, disk in enumerate(payload.get("disks") or [] if isinstance(payload.get("disks"), list) else []):
            if isinstance(disk, dict):
                _check_disk(disk, i, brand, payload, host, out)
        if sum(1 for d in payload.get("disks") or [] if isinstance(d, dict) and d.get("boot")) > 1:
            out.bad_values.append("disks")
            out.why["disks"] = "more than one disk with boot=true"
    nics = payload.get("nics") if isinstance(payload.get("nics"), list) else []
    for i, nic in enumerate(nics):
        if isinstance(nic, dict):
            _check_nic(nic, i, brand, payload, host, out)
    if sum(1 for n in nics if isinstance(n, dict) and n.get("primary")) > 1:
        out.bad_values.append("nics")
        out.why["nics"] = "more than one NIC is primary"
    _check_refs(payload, brand, host, out)
    return out


def _check_disk(disk: dict, i: int, brand: str, payload: dict, host: Host, out: Problems) -> None:
    prefix = f"disks.{i}."
    _check_props(DISK_PROPERTIES, disk, brand, prefix, out)
    media = disk.get("media", "disk")
    if "model" not in disk and "disk_driver" not in payload:
        out.missing_properties.append(prefix + "model")
    if media == "disk" and not disk.get("nocreate"):
        if "image_uuid" in disk and "size" in disk:
            out.bad_properties.append(prefix + "size")
            out.why[prefix + "size"] = "not allowed with image_uuid (the image's size is the disk's)"
        if "image_uuid" not in disk and "size" not in disk:
            out.missing_properties.append(prefix + "size")
        if "image_uuid" not in disk and "image_size" in disk:
            out.bad_properties.append(prefix + "image_size")
            out.why[prefix + "image_size"] = "only with image_uuid"
        if "image_uuid" in disk and "block_size" in disk:
            out.bad_properties.append(prefix + "block_size")
            out.why[prefix + "block_size"] = "the image's volblocksize is the clone's"
    zpool = disk.get("zpool")
    if isinstance(zpool, str) and zpool not in host.zpools:
        out.bad_values.append(prefix + "zpool")
        out.why[prefix + "zpool"] = f"no zpool {zpool!r}"


def _check_nic(nic: dict, i: int, brand: str, payload: dict, host: Host, out: Problems) -> None:
    prefix = f"nics.{i}."
    _check_props(NIC_PROPERTIES, nic, brand, prefix, out)
    if "nic_tag" not in nic:
        out.missing_properties.append(prefix + "nic_tag")
    elif isinstance(nic["nic_tag"], str) and nic["nic_tag"] not in host.nic_tags:
        out.bad_values.append(prefix + "nic_tag")
        out.why[prefix + "nic_tag"] = f"no NIC tag {nic['nic_tag']!r} on this host"
    if brand in HVM and "model" not in nic and "nic_driver" not in payload:
        out.missing_properties.append(prefix + "model")
    ips = nic.get("ips")
    if brand == "kvm" and isinstance(ips, list) and len([ip for ip in ips if ip != "addrconf"]) > 1:
        out.bad_values.append(prefix + "ips")
        out.why[prefix + "ips"] = "a kvm NIC gets one IPv4 address (QEMU hands it out by DHCP)"
    if "ip" in nic and "ips" in nic:
        out.bad_properties.append(prefix + "ip")
        out.why[prefix + "ip"] = "give ips (or the deprecated ip), not both"


def _check_refs(payload: dict, brand: str, host: Host, out: Problems) -> None:
    """References to things on the host: zpools, images (installed, of the right type and brand)."""
    zpool = payload.get("zpool")
    if isinstance(zpool, str) and zpool not in host.zpools:
        out.bad_values.append("zpool")
        out.why["zpool"] = f"no zpool {zpool!r}"
    refs = []
    if brand in OS and isinstance(payload.get("image_uuid"), str):
        refs.append(("image_uuid", payload["image_uuid"], ("zone-dataset", "lx-dataset", "docker")))
    if brand in HVM:
        for i, disk in enumerate(payload.get("disks") or []):
            if isinstance(disk, dict) and isinstance(disk.get("image_uuid"), str):
                refs.append((f"disks.{i}.image_uuid", disk["image_uuid"], ("zvol",)))
    for key, uuid, types in refs:
        if key in out.bad_values:
            continue
        manifest = host.images.get(uuid)
        if manifest is None:
            out.bad_values.append(key)
            out.why[key] = f"image {uuid} is not installed (imgadm list)"
        elif manifest.get("type") not in types:
            out.bad_values.append(key)
            out.why[key] = f"image {uuid} is of type {manifest.get('type')}, not {' or '.join(types)}"
        elif (manifest.get("requirements") or {}).get("brand") not in (None, "", brand):
            out.bad_values.append(key)
            out.why[key] = f"image {uuid} requires brand {manifest['requirements']['brand']}"
