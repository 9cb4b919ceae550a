"""The Proxmox VE backend: linked or full clones of a golden template through the PVE API (proxmoxer).

The Backend seam, put together from the package's parts:
- settings.py: the keys of `[hosts.NAME] backend = "proxmox"`, their defaults, capabilities;
- session.py: login (API token or ticket), TLS, the guard that maps errors, tasks by UPID, retries;
- host.py: the checks before anything is created, a node's facts, the host's load (its LoadMeter
  part); privileges.py: what the credentials may do, against what the cells need;
- templates.py: the template the lab published for an image; publish.py: `lab images publish` (its
  Publishing part);
- placement.py: VMIDs, nodes, clone/destroy slots; vms.py: clone, configure, start; teardown.py: destroy;
- addresses.py: the guest's address (pool, static, agent, ARP);
- ownership.py: the marker and description by which `lab gc` finds what the lab made, and nothing else.

A serial console cannot be read through the API: console_text() is "" (the base's default).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab import runlock
from lab.backends.base import Backend, BackendEnv, Capabilities, PlainClient
from lab.backends.proxmox import host
from lab.backends.proxmox.addresses import Addresses
from lab.backends.proxmox.ownership import lab_vms
from lab.backends.proxmox.placement import Placement, Slots, Vmids
from lab.backends.proxmox.privileges import Need, Privileges, bridges_of, for_cells, for_template
from lab.backends.proxmox.publish import Publisher
from lab.backends.proxmox.session import ApiError, Credentials, Session
from lab.backends.proxmox.settings import Settings, capabilities
from lab.backends.proxmox.teardown import destroy_vmid
from lab.backends.proxmox.templates import Templates
from lab.backends.proxmox.vms import Machines
from lab.errors import HostUnreachable, IncompleteListing, LabError, SettingError, TeardownError
from lab.lease import owner_or_empty
from lab.model import ImageRef, Owned, Vm, VmSpec
from lab.runlock import RunLocks


class ProxmoxBackend(Backend):
    name = "proxmox"
    settings_model = Settings
    settings: Settings

    def __init__(self, host_name: str, settings: Settings, env: BackendEnv | None = None):
        super().__init__(host_name, settings, env)
        self.session = Session(host_name, settings, Credentials.resolve(host_name, settings, self.env.source))
        self.vmids = Vmids(self.session)
        self.templates = Templates(self.session)
        self.privileges = Privileges(self.session)
        self.slots = Slots(self.session)
        self.addresses = Addresses(self.session, self.env.state_dir)
        self.machines = Machines(
            self.session,
            vmids=self.vmids,
            placement=Placement(self.session),
            templates=self.templates,
            addresses=self.addresses,
            slots=self.slots,
            ssh_keys=self._ssh_keys(),
        )
        self.publishing = Publisher(self.session, self.templates, self.vmids, self.privileges, self.env.source)
        self.load_meter = host.LoadMeter(self.session)
        self._run_locks = RunLocks(self._run_lock_path)

    def __repr__(self) -> str:
        return (
            f"ProxmoxBackend(host={self.host_name!r}, url={self.settings.url!r}, node={self.settings.node!r}, "
            f"auth={self.session.credentials.principal!r})"
        )

    def _ssh_keys(self) -> list[str]:
        """What cloud-init authorises: `ssh_keys`, else the lab's own public key."""
        keys = self.settings.ssh_keys
        if not keys:
            pub = self.env.ssh_key.with_suffix(".pub")
            return [pub.read_text().strip()] if pub.exists() else []
        return [keys] if isinstance(keys, str) else list(keys)

    # -- what it can make (no host contact) -------------------------------------------------------
    @classmethod
    def capabilities(cls, settings: Settings) -> Capabilities:  # type: ignore[override]
        return capabilities(settings)

    @classmethod
    def plan_check(cls, host_name: str, settings: Settings, specs: Sequence[VmSpec]) -> None:  # type: ignore[override]
        super().plan_check(host_name, settings, specs)
        names = sorted({s.image.name for s in specs})
        if "{image}" not in str(settings.template) and len(names) > 1:
            raise SettingError(
                "template",
                settings.template,
                f"is one template for the images {', '.join(names)} of host {host_name!r}: "
                "every cell would clone the same disk",
                hint='name it per image, e.g. template = "lab-{image}" (the default)',
            )

    # -- the host ---------------------------------------------------------------------------------------
    def check(self) -> None:
        """Before anything is created: the API, the nodes, and every privilege a cell needs that
        does not depend on its image (the template's: check_images). Unreachable: exit 2."""
        with host.before_anything():
            host.check(self.session, self.env.source)
            needs: list[Need] = []
            if str(self.settings.template).isdigit():  # a pinned template: its own privileges first
                needs += for_template(int(self.settings.template), {})
            needs += for_cells(self.settings, self.session.release())
            needs += self.privileges.sdn_needs([self.settings.bridge])
            self.privileges.require(needs, "what every cell needs")

    def check_images(self, images: Sequence[ImageRef]) -> None:
        """Before anything is created: every image has a template the lab published for it (its
        recipe digest and sha256) that this host can clone on every node it may place a VM on, and
        the credentials may clone it."""
        with host.before_anything():
            for image in images:
                self.templates.check(image)
                for n in self.settings.clone_nodes:
                    t = self.templates.choose(image, n)
                    self.privileges.require(
                        for_template(t.vmid, t.config, t.pool) + self.privileges.sdn_needs(bridges_of(t.config)),
                        f"cloning template {t.vmid} for {image.name}",
                    )

    def describe_images(self, images: Sequence[ImageRef]) -> list[str]:
        """Which template each image's cells clone (per node), and what of that name was passed
        over: for the plan to print. Raises like check_images."""
        with host.before_anything():
            return [line for image in images for line in self.templates.describe(image)]

    def facts(self) -> dict[str, Any]:
        version = self.session.version()
        return {
            "hypervisor": "proxmox",
            "pve_release": version.get("release", ""),
            "pve_version": version.get("version", ""),
            "node": self.settings.node,
            "nodes": self.settings.clone_nodes,
            "cpu_type": self.settings.cpu_type,
        }

    def host_facts(self) -> dict[str, Any]:
        """The template node's facts; those of the other nodes clones may run on under `node_facts`.
        The template node unreachable: HostUnreachable (exit 1); bad token or CA: AuthError (2)."""
        facts = host.node_facts(self.session, self.settings.node)
        others = [n for n in self.settings.clone_nodes if n != self.settings.node]
        if others:
            facts["node_facts"] = {}
            for n in others:
                try:
                    facts["node_facts"][n] = host.node_facts(self.session, n)
                except (ApiError, HostUnreachable) as exc:  # e.g. 595: that node is down; the others still count
                    facts["node_facts"][n] = {"error": str(exc).removeprefix(f"{self.host_name}: ")}
        return facts

    # -- per run --------------------------------------------------------------------------------------------
    def _run_lock_path(self, run_id: str) -> Path:
        return self.env.state_dir / f"proxmox-{re.sub(r'[^A-Za-z0-9_.-]', '_', self.host_name)}@{run_id}.lock"

    def open_run(self, run_id: str) -> PlainClient:
        # Held for the run's life on this machine: `lab gc` here removes the VMs of a run killed
        # with -9 at once instead of waiting for their leases to expire.
        self._run_locks.acquire(run_id, what=f"the lock of run {run_id} on host {self.host_name!r}")
        return PlainClient(self.settings.client_address, self.settings.client_netns or None)

    def outside_netns(self) -> str | None:
        return self.settings.client_netns or None  # where this machine's SSH to the host's side goes

    def close_run(self, run_id: str) -> None:
        self._run_locks.release(run_id)

    def run_is_live(self, run_id: str) -> bool | None:
        return self._run_locks.live(run_id)

    # -- per VM ---------------------------------------------------------------------------------------------
    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        return self.machines.clone(image, spec, self.name)

    def start(self, vm: Vm) -> None:
        self.machines.start(vm)

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        vm.address, vm.facts["address_source"] = self.addresses.wait(vm, timeout or self.settings.timeouts.ready)
        return vm.address

    def renew_lease(self, vm: Vm, expires_at: float) -> None:
        self.machines.renew(vm, expires_at)

    def destroy(self, vm: Vm) -> None:
        vmid = vm.handle.get("vmid")
        if vmid is None:
            return
        try:
            self.machines.destroy(vm)
        except TeardownError:
            raise
        except Exception as exc:
            raise TeardownError(f"{self.host_name}: could not destroy VM {vmid} ({vm.name}): {exc}") from None

    # -- garbage collection -----------------------------------------------------------------------------------
    def list_owned(self) -> list[Owned]:
        """The VMs the lab made (its marker and a run id: nothing else, ever) and this machine's run
        locks. A node that could not be looked at: IncompleteListing, naming it and its VMs."""
        listing = lab_vms(self.session)
        owned = [
            Owned(
                backend=self.name,
                kind="vm",
                name=vm.name,
                run_id=vm.run_id,
                expires_at=float(vm.meta.get("lab-expires", 0) or 0),
                detail=f"{vm.node}/{vm.vmid}",
                owner=owner_or_empty(vm.meta.get("lab-owner")),
            )
            for vm in listing.vms
        ]
        owned += self._run_locks.owned(self.name)  # a run killed with -9 leaves its lock file
        if listing.unchecked:
            raise IncompleteListing(
                f"{self.host_name}: could not look at every node: {'; '.join(listing.unchecked)}",
                owned,
                list(listing.unchecked),
                hint="run `lab gc` again once the node is back",
            )
        return owned

    def remove_owned(self, item: Owned) -> None:
        if item.kind == "lock":
            self._remove_run_lock(item)
            return
        node, _, vmid = item.detail.partition("/")
        try:
            destroy_vmid(self.session, int(vmid), node, item.name, slots=self.slots)
        except TeardownError:
            raise
        except Exception as exc:
            raise TeardownError(f"{self.host_name}: could not remove VM {vmid} ({item.name}): {exc}") from None

    def _remove_run_lock(self, item: Owned) -> None:
        """The lock tells the next `lab gc` that its run is dead: it goes last, only once no VM of
        the run is left on any node (every node looked at), and never while the run is live."""
        if runlock.held(Path(item.detail)) is not False:  # live (held), or already gone
            return
        listing = lab_vms(self.session)
        left = [f"VM {vm.vmid} ({vm.name}) on {vm.node}" for vm in listing.vms if vm.run_id == item.run_id]
        if left:
            raise LabError(f"{self.host_name}: kept the lock of run {item.run_id}: {', '.join(left)} still there")
        if listing.unchecked:
            raise LabError(f"{self.host_name}: kept the lock of run {item.run_id}: {'; '.join(listing.unchecked)}")
        runlock.remove_if_dead(Path(item.detail))


BACKEND = ProxmoxBackend
