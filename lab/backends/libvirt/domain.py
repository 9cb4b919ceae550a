"""A VM's libvirt domain: the XML rendered from `templates/libvirt/<driver>.xml.j2` (one Jinja2
template per driver), how the host boots the image, and the lab lease the domain carries in its
`<metadata>`::

    <lab:lease xmlns:lab="https://lab.invalid/lease" run="RUN" cell="CELL" expires="UNIX"
               host="HOST" ip="STATIC-IP" disk="zfs:POOL/DS/NAME | file:/PATH" console="PATH"
               [owner="MACHINE-NONCE"] [warm="lab-warm-KEY"]/>

so `lab gc` finds a domain (and its disk) even when the results store is gone. The lab's own
namespace and a non-empty run id are what make a domain the lab's: nothing else is ever listed
or removed (a domain named lab-* without them, an empty run id, another namespace)."""

from __future__ import annotations

from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import jinja2

import lab
from lab import images
from lab.backends.libvirt.connection import error_code, error_message, libvirt_module
from lab.backends.libvirt.settings import Host
from lab.errors import BackendError, UsageError
from lab.model import ImageRef, VmSpec

LEASE_NS = "https://lab.invalid/lease"
DEFAULT_CMDLINE = "console=ttyS0 root=LABEL=labroot rw net.ifnames=0"
TEMPLATE_DIR = lab.TEMPLATES_DIR / "libvirt"


def mac_for(name: str) -> str:
    """A stable MAC in QEMU's 52:54:00 range, derived from the VM name."""
    h = sha256(name.encode()).digest()
    return f"52:54:00:{h[0]:02x}:{h[1]:02x}:{h[2]:02x}"


@dataclass(frozen=True)
class Placement:
    """Where a VM's things are on the host, and what names it there."""

    uuid: str
    disk_ref: str  # the lease's disk: "zfs:POOL/DS/NAME" or "file:/PATH"
    disk_path: str  # what the domain's <disk> opens
    console: str  # bhyve: the nmdm slave; QEMU: the console log
    mac: str


def boot_way(host: Host, image: ImageRef) -> str | None:
    """How `host` boots `image`: "uefi", "kernel" (direct kernel boot), "bios", or None
    (bhyveload, which reads the disk's own loader)."""
    if host.driver == "bhyve":
        return "uefi" if host.firmware == "uefi" else None
    paths = (image.manifest or {}).get("paths")
    has_kernel = isinstance(paths, dict) and bool(paths.get("kernel"))
    if host.boot == "kernel" or (host.boot == "auto" and has_kernel):
        return "kernel"
    return "bios"


def require_boot(host: Host, image: ImageRef) -> None:
    """Refuse an image that cannot boot the way this host boots it (before anything is made)."""
    way = boot_way(host, image)
    who = {
        "uefi": 'bhyve with firmware = "uefi"',
        "kernel": "QEMU direct kernel boot",
        "bios": "QEMU booting the disk by SeaBIOS",
    }
    if way:
        images.require_boot(image, way, f"host {host.name!r}: {who[way]}")


def kernel_boot(host: Host, image: ImageRef, golden_root: str | None) -> dict[str, str] | None:
    """QEMU direct kernel boot: kernel, initrd and command line from the image manifest (or beside
    the image), under `golden_root` when the image is published on the host; None: boot the disk."""
    if host.driver != "qemu" or host.boot == "disk":
        return None
    m = image.manifest or {}
    given = m.get("paths")
    paths: dict[str, Any] = given if isinstance(given, dict) else {}  # relative to images/
    base = Path(image.path).parent
    kernel, initrd = paths.get("kernel"), paths.get("initrd")
    if not kernel and (base / image.name / "vmlinuz").exists():
        kernel = str(base / image.name / "vmlinuz")
    if not initrd and (base / image.name / "initrd.img").exists():
        initrd = str(base / image.name / "initrd.img")
    if not kernel:
        if host.boot == "kernel":
            raise UsageError(
                f"image {image.name!r} has no kernel for direct kernel boot", hint='boot = "disk" or rebuild the image'
            )
        return None
    kernel_p = Path(kernel) if Path(kernel).is_absolute() else base / kernel
    initrd_p = (Path(initrd) if Path(initrd).is_absolute() else base / initrd) if initrd else None
    if golden_root:  # a published copy on the host: the same layout under its directory
        kernel_s = f"{golden_root}/{kernel_p.relative_to(base)}"
        initrd_s = f"{golden_root}/{initrd_p.relative_to(base)}" if initrd_p else ""
    else:
        kernel_s, initrd_s = str(kernel_p.resolve()), str(initrd_p.resolve()) if initrd_p else ""
    return {"kernel": kernel_s, "initrd": initrd_s, "cmdline": host.cmdline or str(m.get("cmdline") or DEFAULT_CMDLINE)}


def lease(host: Host, spec: VmSpec, placement: Placement, warm: str = "") -> dict[str, str]:
    """The lab lease's attributes (in the domain's <metadata>, and beside a QEMU clone's disk)."""
    attrs = {
        "run": spec.run_id,
        "cell": spec.cell_id,
        "expires": str(int(spec.expires_at)),
        "host": host.name,
        "ip": spec.ip.split("/")[0],
        "disk": placement.disk_ref,
        "console": placement.console,
    }
    if spec.owner:
        attrs["owner"] = spec.owner  # whose run made it (lab.lease)
    if warm:
        attrs["warm"] = warm  # the warm snapshot the disk stands on (it is kept while this domain exists)
    return attrs


def context(
    host: Host, spec: VmSpec, placement: Placement, golden_root: str | None, *, genid: str = "", warm: str = ""
) -> dict[str, Any]:
    """The template's values for `spec` on `host` (raises for an image the host cannot boot).
    `genid`: a VM generation ID device (warm snapshots); `warm`: the snapshot the clone stands on."""
    require_boot(host, spec.image)
    ctx: dict[str, Any] = {
        "name": spec.name,
        "uuid": placement.uuid,
        "lease_ns": LEASE_NS,
        "lease": lease(host, spec, placement, warm),
        "genid": genid,
        "console": placement.console,
        "memory_mib": spec.memory_mib,
        "memory_kib": spec.memory_mib * 1024,
        "vcpus": spec.vcpus,
        "topology": {"sockets": 1, "cores": spec.vcpus, "threads": 1},
        "disk_path": placement.disk_path,
        "disk_bus": spec.disk_bus.value,
        "disk_dev": host.caps.disk_dev[spec.disk_bus],
        "disk_format": host.disk_format,
        "nic": host.caps.nics[spec.nic],
        "mac": placement.mac,
        "bridge": host.bridge,
        "network": host.network,
    }
    if host.driver == "bhyve":
        short = placement.uuid.replace("-", "")[:8]
        ctx.update(
            firmware=host.firmware,
            loader=host.loader,
            nmdm_master=f"/dev/nmdm{short}A",
            nmdm_slave=f"/dev/nmdm{short}B",
        )
        if spec.vcpus == 1:
            ctx["topology"] = None  # plain `-c 1`, as in the driver's base test
        return ctx
    kb = kernel_boot(host, spec.image, golden_root)
    cmdline = ""
    if kb:
        cmdline = kb["cmdline"]
        if spec.ip:
            cmdline += f" lab.ip={spec.ip if '/' in spec.ip else f'{spec.ip}/{host.prefix}'}"
            if host.gateway:
                cmdline += f" lab.gw={host.gateway}"
    ctx.update(
        domain_type=host.domain_type,
        machine=host.machine,
        bios=host.bios,
        kernel=kb["kernel"] if kb else "",
        initrd=kb["initrd"] if kb else "",
        cmdline=cmdline,
        cpu_mode=host.cpu_mode,
        guest_agent=host.guest_agent,
        dac_label=host.dac_label,
    )
    return ctx


_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
)


def render(
    host: Host, spec: VmSpec, placement: Placement, golden_root: str | None, *, genid: str = "", warm: str = ""
) -> str:
    """The domain XML for `spec` (pure; `spec` passed the plan's checks)."""
    ctx = context(host, spec, placement, golden_root, genid=genid, warm=warm)
    return _TEMPLATES.get_template(f"{host.driver}.xml.j2").render(**ctx)


def read_lease(dom: Any) -> dict[str, str] | None:
    """The lab lease in a domain's <metadata>; None: not a lab domain (no element in the lab's
    namespace, or no run id in it), or a domain that is gone. Other libvirt errors are raised: a
    lease that could not be read is not the same as no lease."""
    libvirt = libvirt_module()
    try:
        text = dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, LEASE_NS, 0)
    except libvirt.libvirtError as exc:
        if error_code(exc) in (libvirt.VIR_ERR_NO_DOMAIN_METADATA, libvirt.VIR_ERR_NO_DOMAIN):
            return None
        raise
    return parse_lease(text)


def parse_lease(text: str) -> dict[str, str] | None:
    """The attributes of a lease element (libvirt hands it back without its namespace, having
    selected it by the namespace); None unless it carries a run id."""
    try:
        el = ET.fromstring(text)
    except ET.ParseError:
        return None
    return dict(el.attrib) if el.tag in ("lease", f"{{{LEASE_NS}}}lease") and el.get("run", "").strip() else None


def renew_lease(dom: Any, expires_at: float) -> None:
    """Move the lease in the domain's <metadata> to `expires_at` (its other attributes as they
    are), in its persistent definition and, while it runs, its live one. LabError when the domain
    carries no lab lease (any more) or libvirt refuses."""
    libvirt = libvirt_module()
    lease = read_lease(dom)
    if lease is None:
        raise BackendError("the domain carries no lab lease (any more): not renewed")
    lease["expires"] = str(int(expires_at))
    xml = ET.tostring(ET.Element("lease", lease), encoding="unicode")
    try:
        flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG | (libvirt.VIR_DOMAIN_AFFECT_LIVE if dom.isActive() else 0)
        dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, xml, "lab", LEASE_NS, flags)
    except libvirt.libvirtError as exc:
        raise BackendError(f"libvirt refused the new lease: {error_message(exc)}") from None
