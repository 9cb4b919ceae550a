"""What the lab's credentials may do, asked before anything is created.

`GET /access/permissions` answers, for the caller (a user, or a token: a privilege-separated token
has only its own ACLs), the effective privileges at each path of the ACL tree, each with its
propagate flag. What the cells need is compared with it, and every privilege missing is named with
its path in one AuthError (exit 2): nothing is created with credentials that would fail halfway.

What the cells need (qemu-server's checks, PVE 7.4-9.x):
- a new VM (/vms, whatever its VMID): VM.Allocate (clone target, destroy), VM.Audit (status),
  VM.PowerMgmt (start, stop), VM.Config.Network/CPU/Memory/Cloudinit/Options/Disk (the one config
  call: net0, cores, memory, cloud-init, agent and tags, the disk on the cell's bus), and the guest
  agent's (VM.Monitor; on 9.x VM.GuestAgent.Audit or .Unrestricted) when `guest_agent` is on;
- the template (/vms/<id>): VM.Audit (its config is read) and VM.Clone;
- Datastore.AllocateSpace on `storage` (full clones) and on every storage the template's disks
  and cloud-init drive are on (linked clones and their cloud-init drive are allocated there);
- PVE 8+: SDN.Use on /sdn/zones/<zone>/<bridge> for `bridge` (net0) and for every bridge of the
  template's NICs (clone checks the source's): <zone> is the bridge's SDN zone when it is a vnet,
  else `localnetwork`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lab.backends.proxmox.session import Session
from lab.backends.proxmox.settings import Settings
from lab.errors import AuthError, LabError

NEW_VM = (
    "VM.Allocate",
    "VM.Audit",
    "VM.PowerMgmt",
    "VM.Config.Network",
    "VM.Config.CPU",
    "VM.Config.Memory",
    "VM.Config.Cloudinit",
    "VM.Config.Options",
    "VM.Config.Disk",
)
PUBLISH_VM = (
    "VM.Allocate",
    "VM.Audit",
    "VM.Config.Disk",
    "VM.Config.CPU",
    "VM.Config.Memory",
    "VM.Config.Network",
    "VM.Config.Options",
    "VM.Config.HWType",
)
LOCAL_ZONE = "localnetwork"  # the SDN zone of a plain Linux bridge (PVE 8+)
BRIDGE = re.compile(r"(?:^|,)bridge=([^,]+)")
DISK_KEY = re.compile(r"(scsi|virtio|sata|ide|efidisk|tpmstate)\d+")


@dataclass(frozen=True)
class Need:
    """One of `privileges` on one of `paths` (a VM's path, or its pool's)."""

    paths: tuple[str, ...]
    privileges: tuple[str, ...]

    def text(self) -> str:
        return f"{'|'.join(self.privileges)} on {' or '.join(self.paths)}"


def effective(dump: dict, path: str) -> set[str]:
    """The privileges at `path` from the permissions dump: those at the path itself if it is in the
    dump, else the propagating ones of its nearest ancestor in it."""
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts), -1, -1):
        at = "/" + "/".join(parts[:i])
        if at in dump:
            privs = dump[at] or {}
            return {k for k, prop in privs.items() if i == len(parts) or _flag(prop)}
    return set()


def _flag(value: object) -> bool:
    return str(value).strip().lower() in ("1", "true")


def agent_privileges(release: tuple[int, ...]) -> tuple[str, ...]:
    return ("VM.GuestAgent.Audit", "VM.GuestAgent.Unrestricted") if release >= (9,) else ("VM.Monitor",)


def for_cells(settings: Settings, release: tuple[int, ...]) -> list[Need]:
    """What any cell of this host needs, whatever its image."""
    vms = [Need(("/vms",), (p,)) for p in NEW_VM]
    if settings.guest_agent:
        vms.append(Need(("/vms",), agent_privileges(release)))
    return [*vms, Need((f"/storage/{settings.storage}",), ("Datastore.AllocateSpace",))]


def for_template(vmid: int, config: dict, pool: str = "") -> list[Need]:
    """What cloning this template needs (its SDN.Use: `sdn_needs` with `bridges_of(config)`)."""
    paths = (f"/vms/{vmid}",) + ((f"/pool/{pool}",) if pool else ())
    storages = dict.fromkeys(
        str(v).split(":", 1)[0] for k, v in config.items() if DISK_KEY.fullmatch(k) and ":" in str(v)
    )
    return [
        Need(paths, ("VM.Audit",)),
        Need(paths, ("VM.Clone",)),
        *[Need((f"/storage/{s}",), ("Datastore.AllocateSpace",)) for s in storages],
    ]


def for_publish(settings: Settings) -> list[Need]:
    """What `lab images publish` needs: the upload (and its removal), the template's VM and disk."""
    return [
        Need((f"/storage/{settings.import_storage}",), ("Datastore.AllocateTemplate",)),
        Need((f"/storage/{settings.import_storage}",), ("Datastore.Allocate",)),
        Need((f"/storage/{settings.storage}",), ("Datastore.AllocateSpace",)),
        *[Need(("/vms",), (p,)) for p in PUBLISH_VM],
    ]


def bridges_of(config: dict) -> list[str]:
    return list(
        dict.fromkeys(
            m.group(1) for k, v in config.items() if re.fullmatch(r"net\d+", k) and (m := BRIDGE.search(str(v)))
        )
    )


class Privileges:
    """The caller's permissions dump (read once) and the SDN zones of bridges."""

    def __init__(self, session: Session):
        self.session = session
        self._dump: dict | None = None
        self._zones: dict[str, str] | None = None

    def dump(self) -> dict:
        if self._dump is None:
            self._dump = dict(self.session.get("GET /access/permissions", self.session.api().access.permissions))
        return self._dump

    def sdn_needs(self, bridges: list[str]) -> list[Need]:
        """SDN.Use on each bridge (PVE 8+; 7.x has no such check)."""
        if self.session.release() < (8,):
            return []
        needs = []
        for bridge in dict.fromkeys(bridges):
            zone = self._zone_of(bridge)
            paths = (f"/sdn/zones/{zone}/{bridge}",)
            if zone == LOCAL_ZONE:  # maybe a vnet the token may not list: its grant names the zone
                paths += tuple(
                    p
                    for p in self.dump()
                    if re.fullmatch(rf"/sdn/zones/[^/]+/{re.escape(bridge)}", p) and p not in paths
                )
            needs.append(Need(paths, ("SDN.Use",)))
        return needs

    def _zone_of(self, bridge: str) -> str:
        if self._zones is None:
            try:  # lists only the vnets the caller may audit; a plain bridge is in none
                vnets = self.session.get("GET /cluster/sdn/vnets", self.session.api().cluster.sdn.vnets)
                self._zones = {str(v.get("vnet")): str(v.get("zone")) for v in vnets if v.get("zone")}
            except LabError:  # no SDN (501), or not allowed to look: a plain bridge
                self._zones = {}
        return self._zones.get(bridge, LOCAL_ZONE)

    def require(self, needs: list[Need], what: str) -> None:
        """AuthError naming every need the dump does not meet (in `needs`' order)."""
        dump = self.dump()
        missing = [n for n in dict.fromkeys(needs) if not any(set(n.privileges) & effective(dump, p) for p in n.paths)]
        if not missing:
            return
        who = self.session.credentials.principal
        first = missing[0]
        text = (
            f"{self.session.host}: {who} lacks a privilege: Permission check failed "
            f"({first.paths[0]}, {'|'.join(first.privileges)})"
        )
        if len(missing) > 1:
            text += "; also missing: " + ", ".join(n.text() for n in missing[1:])
        raise AuthError(
            f"{text} ({what}; nothing was created)",
            hint="grant them to the "
            + (
                "token (a privilege-separated token needs its own ACLs)"
                if self.session.credentials.token_name
                else "user"
            )
            + ", e.g. pveum acl modify PATH --tokens USER@REALM!TOKEN --roles ROLE",
        )
