"""How the lab marks what it makes on a cluster, and finds it again.

A VM is the lab's only when its description carries the lab's own marker line (`lab-marker:
lab/vm`) and a run id (`lab-run-id:`); the description rides on the clone call already, so `lab gc`
finds a VM even if the run died before configuring it. The tag `lab`, an empty run id or a lab-like
name alone never make a VM the lab's: on a shared cluster anything else may be someone's. A
published template carries `lab-marker: lab/template` and the image's name, recipe digest, sha256
and publish time; `lab images publish` replaces only templates marked so. (Descriptions written
before the marker line existed end with the lab's own sentence, which counts as the marker.)

A node that cannot be looked at (offline, HTTP 595, the connection lost) is not "nothing there":
the listing names it and the VMs on it it could not check.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass, field

from lab.backends.proxmox.session import ApiError, Session, is_gone, is_transient
from lab.errors import AuthError, HostUnreachable
from lab.model import ImageRef, VmSpec

log = logging.getLogger(__name__)

TAG = "lab"
TEMPLATE_TAG = "lab-template"
MARKER = "lab-marker"
VM_MARK, TEMPLATE_MARK = "lab/vm", "lab/template"
# the closing sentence of descriptions written before the marker line: the lab's words only
LEGACY_MARKS = {VM_MARK: "created by lab; `lab gc` may remove it", TEMPLATE_MARK: "published by `lab images publish`"}
_TAG_OK = re.compile(r"[^a-z0-9_\-+.]")


def tag(text: str) -> str:
    """`text` in PVE's tag charset."""
    return _TAG_OK.sub("-", text.lower()).strip("-") or "x"


def vm_tags(run_id: str) -> str:
    return ";".join([TAG, "lab-run-" + tag(run_id)])


def dns_name(name: str) -> str:
    """A VM name PVE accepts (its dns-name format: no `_`, at most 63 characters)."""
    text = re.sub(r"[^a-zA-Z0-9.-]", "-", name).strip("-.") or "lab-vm"
    return re.sub(r"-+", "-", text)[:63].rstrip("-")


def mac_for(run_id: str, cell_id: str) -> str:
    """The MAC of a cell's VM: locally administered, unicast, derived from run and cell, so the lab
    knows it without reading it back and two cells never share one."""
    h = hashlib.sha256(f"lab-mac\0{run_id}\0{cell_id}".encode()).digest()
    return ":".join(f"{b:02X}" for b in [(h[0] & 0xFC) | 0x02, *h[1:6]])


def vm_description(spec: VmSpec, expires_at: float | None = None) -> str:
    """The description a cell's VM carries (`expires_at`: a renewed lease's expiry, lab.lease)."""
    return "\n".join(
        [
            f"{MARKER}: {VM_MARK}",
            f"lab-vm: {spec.name}",
            f"lab-run-id: {spec.run_id}",
            f"lab-cell: {spec.cell_id}",
            f"lab-expires: {int(spec.expires_at if expires_at is None else expires_at)}",
            *([f"lab-owner: {spec.owner}"] if spec.owner else []),
            LEGACY_MARKS[VM_MARK],
        ]
    )


def template_description(image: ImageRef, sha: str, published_at: float | None = None) -> str:
    return "\n".join(
        [
            f"{MARKER}: {TEMPLATE_MARK}",
            f"lab-image: {image.name}",
            f"lab-image-digest: {image.digest}",
            f"lab-image-sha256: {sha}",
            f"lab-published: {int(published_at or time.time())}",
            LEGACY_MARKS[TEMPLATE_MARK],
        ]
    )


def parse_description(text: str) -> dict[str, str]:
    """The `lab-*: value` lines of a VM's description."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().startswith("lab-"):
            out[key.strip()] = value.strip()
    return out


def marked(text: str, kind: str) -> bool:
    """The description carries the lab's marker of `kind` (VM_MARK, TEMPLATE_MARK)."""
    lines = [line.strip() for line in text.splitlines()]
    return f"{MARKER}: {kind}" in lines or LEGACY_MARKS[kind] in lines


def lab_run_of(text: str) -> str:
    """The run id of a VM the lab made ("" when the description is not the lab's or has none)."""
    return parse_description(text).get("lab-run-id", "") if marked(text, VM_MARK) else ""


def is_lab_vm(text: str, name: str | None = None) -> bool:
    """The lab made this VM (marker and a run id); with `name`, for that cell's VM name."""
    if not lab_run_of(text):
        return False
    return name is None or dns_name(parse_description(text).get("lab-vm", "")) == dns_name(name)


def is_lab_template(text: str, image: str | None = None) -> bool:
    """The lab published this template (marker and an image name); with `image`, of that image."""
    meta = parse_description(text)
    return marked(text, TEMPLATE_MARK) and bool(meta.get("lab-image")) and image in (None, meta.get("lab-image"))


def _tags(text: object) -> list[str]:
    return re.split(r"[;, ]", str(text or ""))


@dataclass(frozen=True)
class LabVm:
    """A VM of the lab on the cluster, made by whichever process or machine."""

    node: str
    vmid: int
    name: str
    config: dict
    meta: dict[str, str]  # the description's lab-* fields

    @property
    def run_id(self) -> str:
        return self.meta.get("lab-run-id", "")


@dataclass
class Listing:
    vms: list[LabVm] = field(default_factory=list)
    # one line per node that could not be looked at: why, and the VMs there that were not checked
    unchecked: list[str] = field(default_factory=list)


def lab_vms(session: Session, *, deadline: float | None = None) -> Listing:
    """Every VM the lab made on the cluster (not templates), and the nodes that could not be
    checked. Only VMs tagged `lab` or named like a lab VM have their description read (the
    description decides); on a node that cannot be reached those, and VMs whose name the cluster
    does not know, are named as not checked. A failing /cluster/resources raises (nothing listed)."""
    deadline = deadline if deadline is not None else time.monotonic() + session.settings.timeouts.retry
    res = session.get("GET /cluster/resources", session.api().cluster.resources, until=deadline)
    node_status = {str(r.get("node")): str(r.get("status") or "") for r in res if r.get("type") == "node"}
    listing = Listing()
    failed: dict[str, str] = {}  # node -> why it could not be looked at
    pending: dict[str, list[str]] = {}  # node -> the VMs there not checked
    for r in res:
        if r.get("type") != "qemu" or r.get("template"):
            continue
        node, vmid, name = str(r["node"]), int(r["vmid"]), str(r.get("name") or "")
        candidate = TAG in _tags(r.get("tags")) or name.startswith("lab")
        if node_status.get(node, "online") != "online" and node not in failed:
            failed[node] = f"node is {node_status[node] or 'not online'}"
        if node in failed:
            if candidate or not name:
                pending.setdefault(node, []).append(f"VM {vmid}" + (f" ({name})" if name else ""))
            continue
        if not candidate:
            continue  # not worth reading its config
        try:
            cfg = session.get(f"config of VM {vmid}", session.qemu(node, vmid).config, until=deadline)
        except AuthError as exc:  # a VM the lab's token may not even read was not made by it
            log.info("%s: VM %d (%s) not readable, so not the lab's: %s", session.host, vmid, name, exc)
            continue
        except (ApiError, HostUnreachable) as exc:
            if is_gone(exc):
                continue  # removed meanwhile
            if not is_transient(exc):
                raise
            failed[node] = (
                f"HTTP {exc.status} {exc.reason}"
                if isinstance(exc, ApiError)
                else str(exc).removeprefix(f"{session.host}: ")
            )
            pending.setdefault(node, []).append(f"VM {vmid}" + (f" ({name})" if name else ""))
            continue
        text = str(cfg.get("description") or "")
        if is_lab_vm(text):
            meta = parse_description(text)  # named as its lease is: the cell's VM name
            listing.vms.append(LabVm(node, vmid, meta.get("lab-vm") or name, cfg, meta))
    # a node down with no lab-like VM on it (the cluster's own list says so) hides nothing
    listing.unchecked = [f"node {node}: {failed[node]}; not checked: {', '.join(vms)}" for node, vms in pending.items()]
    return listing
