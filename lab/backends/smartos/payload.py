"""Pure: what the SmartOS backend asks of vmadm and imgadm (create payloads, the image manifest) and
what it reads back (leases from customer_metadata, addresses from nics). No I/O.

The lease rides on the VM itself, in `customer_metadata` (string keys and values):
`lab:managed` (the marker: nothing without it is ever listed or touched), `lab:run`, `lab:cell`,
`lab:vm` (the VM name, also its alias), `lab:expires` (unix time), `lab:owner` (whose run:
lab.lease). `lab gc` finds VMs by it even when the results store is gone."""

from __future__ import annotations

import ipaddress
from typing import Any

from lab import osfacts
from lab.backends.smartos.settings import DISK_MODELS, NIC_MODELS, Settings
from lab.model import ImageRef, VmSpec

MARKER = "lab:managed"
MARKER_VALUE = "true"
RUN, CELL, NAME, EXPIRES, OWNER = "lab:run", "lab:cell", "lab:vm", "lab:expires", "lab:owner"
# An image SmartOS builds a NoCloud (cidata) disk for from the VM's nics: how a bhyve guest without
# SmartOS's metadata agent learns its static address (SmartOS 20260306 and later).
NOCLOUD_TAG = "org.smartos:cloudinit_datasource"
ZONE_BRANDS = ("joyent", "lx")


def lease(spec: VmSpec) -> dict[str, str]:
    return {
        MARKER: MARKER_VALUE,
        RUN: spec.run_id,
        CELL: spec.cell_id,
        NAME: spec.name,
        EXPIRES: str(int(spec.expires_at)),
        **({OWNER: spec.owner} if spec.owner else {}),
    }


def renewal(expires_at: float) -> dict[str, Any]:
    """`vmadm update` of a live run's VM: its lease's expiry moved (lab.runner.renewal)."""
    return {"set_customer_metadata": {EXPIRES: str(int(expires_at))}}


def owner_of(vm: dict[str, Any]) -> str:
    """The owner in a lab VM's lease ("" when it has none)."""
    meta = vm.get("customer_metadata") or {}
    return str(meta.get(OWNER) or "") if isinstance(meta, dict) else ""


def is_ours(vm: dict[str, Any]) -> bool:
    """A VM object of `vmadm get`/`lookup -j` that carries the lab's marker."""
    meta = vm.get("customer_metadata") or {}
    return isinstance(meta, dict) and meta.get(MARKER) == MARKER_VALUE


def lease_of(vm: dict[str, Any]) -> tuple[str, str, float]:
    """(run id, VM name, expiry) of a lab VM object."""
    meta = vm.get("customer_metadata") or {}
    try:
        expires = float(meta.get(EXPIRES) or 0)
    except ValueError:
        expires = 0.0
    return str(meta.get(RUN) or ""), str(meta.get(NAME) or vm.get("alias") or ""), expires


def nic(settings: Settings, ip: str, *, model: str | None, mac: str = "") -> dict[str, Any]:
    """The VM's one NIC on the host's nic_tag: a static address (with the gateway), or DHCP."""
    out: dict[str, Any] = {"nic_tag": settings.nic_tag, "primary": True}
    if model is not None:
        out["model"] = model
    if ip:
        out["ips"] = [f"{ip}/{settings.prefix_len}"]
        if settings.gateway:
            out["gateways"] = [settings.gateway]
    else:
        out["ips"] = ["dhcp"]
    if settings.vlan_id:
        out["vlan_id"] = settings.vlan_id
    if mac:
        out["mac"] = mac.lower()
    return out


def vm_payload(settings: Settings, spec: VmSpec, *, uuid: str, image_uuid: str, ip: str) -> dict[str, Any]:
    """`vmadm create` for a cell: the brand's VM with the cell's vCPUs, RAM, disk bus and NIC model,
    its disk a clone of the published image, not booted (the lab starts it), the lease in
    customer_metadata."""
    brand = settings.brand
    payload: dict[str, Any] = {
        "uuid": uuid,
        "brand": brand,
        "alias": spec.name,
        "hostname": spec.name,
        "autoboot": False,
        "do_not_inventory": True,  # short-lived: not for a management system's inventory
        "ram": spec.memory_mib,
        "vcpus": spec.vcpus,
        "zpool": settings.zpool,
        "disks": [
            {
                "boot": True,
                "model": DISK_MODELS[brand][spec.disk_bus],
                "image_uuid": image_uuid,
                "zpool": settings.zpool,
            }
        ],
        "nics": [nic(settings, ip, model=NIC_MODELS[brand][spec.nic], mac=spec.mac)],
        "customer_metadata": lease(spec),
    }
    if brand == "bhyve":
        payload["bootrom"] = settings.bootrom
    else:
        payload["cpu_type"] = settings.cpu_type
    if settings.resolvers:
        payload["resolvers"] = list(settings.resolvers)
    return payload


def zone_payload(
    settings: Settings,
    spec: VmSpec,
    *,
    uuid: str,
    brand: str,
    image_uuid: str,
    ip: str,
    authorized_keys: str,
    kernel_version: str = "",
    quota_gib: int = 10,
) -> dict[str, Any]:
    """`vmadm create` for an OS-virtualised cell: a joyent (SmartOS) or lx (Linux) zone of a zone image.
    Memory caps the zone (max_physical_memory), the vCPUs become a CPU cap (100 per CPU); root's SSH
    key comes from the `root_authorized_keys` metadata key, as SmartOS zones read it."""
    if brand not in ZONE_BRANDS:
        raise ValueError(f"zone brand must be one of {', '.join(ZONE_BRANDS)}, not {brand!r}")
    if brand == "lx" and not kernel_version:
        raise ValueError("an lx zone needs the Linux kernel version to emulate (its image's tags say it)")
    payload: dict[str, Any] = {
        "uuid": uuid,
        "brand": brand,
        "alias": spec.name,
        "hostname": spec.name,
        "autoboot": False,
        "do_not_inventory": True,
        "image_uuid": image_uuid,
        "zpool": settings.zpool,
        "max_physical_memory": spec.memory_mib,
        "cpu_cap": 100 * spec.vcpus,
        "quota": quota_gib,
        "nics": [nic(settings, ip, model=None, mac=spec.mac)],
        "customer_metadata": {**lease(spec), "root_authorized_keys": authorized_keys},
    }
    if brand == "lx":
        payload["kernel_version"] = kernel_version
    if settings.resolvers:
        payload["resolvers"] = list(settings.resolvers)
    return payload


def proto_payload(settings: Settings, image: ImageRef, *, uuid: str, alias: str, expires_at: float) -> dict[str, Any]:
    """The VM `lab images publish` fills with the image and makes the imgadm image from (`imgadm create`):
    one empty disk of the image's virtual size, no NIC, never booted."""
    size_mib = -(-int(image.manifest.get("virtual_size") or 0) // (1 << 20))
    if size_mib <= 0:
        raise ValueError(f"image {image.name!r}: its manifest has no virtual_size")
    brand = settings.brand
    payload: dict[str, Any] = {
        "uuid": uuid,
        "brand": brand,
        "alias": alias,
        "autoboot": False,
        "do_not_inventory": True,
        "ram": 256,
        "vcpus": 1,
        "zpool": settings.zpool,
        "disks": [{"boot": True, "model": "virtio", "size": size_mib, "zpool": settings.zpool}],
        "customer_metadata": {
            MARKER: MARKER_VALUE,
            RUN: f"publish-{image.name}",
            NAME: alias,
            EXPIRES: str(int(expires_at)),
        },
    }
    if brand == "bhyve":
        payload["bootrom"] = settings.bootrom
    return payload


def image_name(settings: Settings, image: ImageRef) -> str:
    return settings.image.replace("{image}", image.name)


def image_manifest(settings: Settings, image: ImageRef) -> dict[str, Any]:
    """The manifest fields `imgadm create -m -` merges into the image it makes: the lab's marker,
    the image's name, recipe digest and sha256 (what `check_images` and publish compare)."""
    sha = image.sha256 or image.digest
    tags: dict[str, Any] = {
        MARKER: MARKER_VALUE,
        "lab:image": image.name,
        "lab:digest": image.digest,
        "lab:sha256": sha,
    }
    if settings.brand == "bhyve":
        tags[NOCLOUD_TAG] = "nocloud"
    return {
        "name": image_name(settings, image),
        "version": f"{image.digest[:12]}-{sha[:12]}",
        "description": f"lab golden image {image.name} (recipe {image.digest[:12]}), published by `lab images publish`",
        "os": osfacts.facts(image.os).imgadm_os,
        "requirements": {"brand": settings.brand},
        "tags": tags,
    }


def _lab_images(entries: list[dict[str, Any]], settings: Settings, image: ImageRef) -> list[dict[str, Any]]:
    """Manifests (from `imgadm list -j`) of the lab's images named for `image`, for this host's brand."""
    name = image_name(settings, image)
    return [
        m
        for m in (e.get("manifest") or {} for e in entries)
        if m.get("name") == name
        and (m.get("tags") or {}).get(MARKER) == MARKER_VALUE
        and (m.get("requirements") or {}).get("brand") in (None, "", settings.brand)
    ]


def published(entries: list[dict[str, Any]], settings: Settings, image: ImageRef) -> tuple[str | None, list[str]]:
    """(uuid of the installed image holding `image` for this host's brand, uuids of the other lab images
    of the same name) from `imgadm list -j`."""
    sha = image.sha256 or image.digest
    same, older = None, []
    for m in _lab_images(entries, settings, image):
        if m["tags"].get("lab:sha256") == sha and same is None:
            same = str(m["uuid"])
        else:
            older.append(str(m["uuid"]))
    return same, older


def usable_image(entries: list[dict[str, Any]], settings: Settings, image: ImageRef) -> tuple[str | None, str]:
    """(uuid, "") of the installed image a cell of `image` clones on this host, else (None, why not)."""
    candidates = _lab_images(entries, settings, image)
    for key, want in (("lab:sha256", image.sha256 or image.digest), ("lab:digest", image.digest)):
        for m in candidates:  # the same build first, then the same recipe
            if m["tags"].get(key) == want:
                return str(m["uuid"]), ""
    name = image_name(settings, image)
    if candidates:
        return None, (
            f"holds {name} of another recipe ({str(candidates[0]['tags'].get('lab:digest', '?'))[:12]}, "
            f"this build is {image.digest[:12]})"
        )
    return None, f"has no image {name} for the {settings.brand} brand"


def address_of(vm: dict[str, Any]) -> str:
    """The static IPv4 address of a VM object's primary NIC ("" for DHCP)."""
    nics = vm.get("nics") or []
    primary = next((n for n in nics if n.get("primary")), nics[0] if nics else {})
    for ip in primary.get("ips") or ([primary["ip"]] if primary.get("ip") else []):
        try:
            return str(ipaddress.IPv4Interface(ip).ip)
        except ValueError:
            continue  # "dhcp", "addrconf", IPv6
    return ""


def mac_of(vm: dict[str, Any]) -> str:
    nics = vm.get("nics") or []
    primary = next((n for n in nics if n.get("primary")), nics[0] if nics else {})
    return str(primary.get("mac") or "").lower()


def addresses_in_use(vms: list[dict[str, Any]]) -> set[str]:
    """Every static IPv4 address on any VM of the host (a lab pool address is never handed out twice)."""
    used = set()
    for vm in vms:
        for n in vm.get("nics") or []:
            for ip in n.get("ips") or ([n["ip"]] if n.get("ip") else []):
                try:
                    used.add(str(ipaddress.IPv4Interface(ip).ip))
                except ValueError:
                    continue
    return used
