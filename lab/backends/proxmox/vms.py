"""Making a cell's VM: a linked (or full) clone of the image's published template under a fresh VMID
on its node, then one config call that sets net0 (the cell's NIC model on `bridge`, with the
cell's own MAC), cores, memory, CPU type, the guest agent, cloud-init (user, SSH keys, ipconfig0),
the lab's tags and description, and moves the disk to the cell's bus; then start. On any failure
nothing is left behind.

The clone call creates something, so it is never repeated blindly: when its answer is lost (the
connection dropped or timed out, a proxy failed), the VM is looked for under the VMID it was
given and by the cell's marker, and adopted once its clone task has ended, or found absent (then
the clone is tried again). Clone calls queue for a slot of their node and storage (`Slots`).
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import quote

from lab.backends.proxmox.addresses import Addresses
from lab.backends.proxmox.ownership import dns_name, is_lab_vm, mac_for, parse_description, vm_description, vm_tags
from lab.backends.proxmox.placement import Placement, Slots, Vmids
from lab.backends.proxmox.session import (
    ApiError,
    Session,
    TaskFailed,
    failure_text,
    is_gone,
    is_lock_error,
    is_transient,
    remaining,
)
from lab.backends.proxmox.settings import DISK_KEYS, NET_MODELS
from lab.backends.proxmox.teardown import BUSY_LOCKS, destroy_vmid, remove_leftover
from lab.backends.proxmox.templates import Template, Templates, boot_disk
from lab.errors import HostUnreachable, LabError
from lab.model import CloneKind, DiskBus, ImageRef, Vm, VmSpec
from lab.wait import wait_until

log = logging.getLogger(__name__)

EXISTS_ERRORS = ("already exists", "config file already exists")
MAX_COLLISIONS = 20
# drive options that mean the same on every bus (the rest, e.g. scsi's `ssd` or `iothread`, stay behind)
PORTABLE_DRIVE_OPTIONS = ("cache", "discard", "aio", "backup", "replicate", "snapshot")


def flag(value: bool) -> int:
    return 1 if value else 0  # PVE accepts only 1/0 for top-level booleans


def answer_lost(exc: BaseException) -> bool:
    """A call whose outcome is unknown: the request may have been carried out."""
    return isinstance(exc, HostUnreachable) or (
        isinstance(exc, ApiError) and is_transient(exc) and not is_lock_error(exc)
    )


class Machines:
    def __init__(
        self,
        session: Session,
        *,
        vmids: Vmids,
        placement: Placement,
        templates: Templates,
        addresses: Addresses,
        slots: Slots,
        ssh_keys: list[str],
    ):
        self.session, self.settings, self.host = session, session.settings, session.host
        self.vmids, self.placement, self.templates, self.addresses = vmids, placement, templates, addresses
        self.slots = slots
        self.ssh_keys = ssh_keys

    # -- clone ----------------------------------------------------------------------------------------
    def clone(self, image: ImageRef, spec: VmSpec, backend: str) -> Vm:
        node = self.placement.node_for(spec)
        tmpl = self.templates.choose(image, node)
        full = spec.clone == CloneKind.FULL
        deadline = time.monotonic() + self.settings.timeouts.clone
        # full clones allocate on `storage`; linked ones (and their cloud-init drive) beside the template
        storage = self.settings.storage if full else boot_disk(tmpl.config)[1].split(":", 1)[0]
        with self.slots.hold(
            node=tmpl.node,
            storage=storage or self.settings.storage,
            deadline=deadline,
            what=f"clone of template {tmpl.vmid} ({spec.name})",
        ):
            vmid = self._clone_new_vmid(tmpl, node, spec, full, deadline)
        mac = (spec.mac or mac_for(spec.run_id, spec.cell_id)).lower()
        vm = Vm(
            spec=spec,
            backend=backend,
            handle={"vmid": vmid, "node": node, "mac": mac},
            facts={
                "clone": "full" if full else "linked",
                **tmpl.facts(),
                "node": node,
                "disk_bus": spec.disk_bus.value,
                "mac": mac,
            },
        )
        try:
            self._configure(vm)
        except BaseException:
            self._destroy_quietly(vm)
            raise
        return vm

    def _clone_new_vmid(self, tmpl: Template, node: str, spec: VmSpec, full: bool, deadline: float) -> int:
        src = self.session.qemu(tmpl.node, tmpl.vmid)
        # the description rides on the clone already, so `lab gc` finds a VM even if we die before
        # configuring it (tags come with the config), and a lost answer can be checked
        params: dict[str, Any] = {"name": dns_name(spec.name), "full": flag(full), "description": vm_description(spec)}
        if full:
            params["storage"] = self.settings.storage
        if node != tmpl.node:
            params["target"] = node
        what = f"clone of template {tmpl.vmid}"
        collisions = 0
        pauses = self.session.backoffs(deadline, self.settings.lock_retries)
        while True:
            vmid = self.vmids.candidate()
            try:
                try:
                    upid = self.session.call(what, lambda: src.clone.post(newid=vmid, **params))
                except LabError as exc:
                    if not answer_lost(exc):
                        raise
                    if self._adopt(vmid, node, spec, deadline):
                        return vmid
                    raise  # nothing was made: tried again below
                self.session.wait_task(
                    upid, timeout=remaining(deadline), what=f"clone of template {tmpl.vmid} to VM {vmid} ({spec.name})"
                )
                return vmid
            except LabError as exc:
                text = failure_text(exc) if isinstance(exc, (ApiError, TaskFailed)) else str(exc)
                if any(m in text for m in EXISTS_ERRORS):  # keep it reserved: someone else's now
                    collisions += 1
                    if collisions > MAX_COLLISIONS:
                        raise
                    log.info("%s: VMID %d taken by someone else; trying the next one", self.host, vmid)
                    continue
                self._cleanup_failed_clone(vmid, spec.name, node)
                delay = next(pauses, None) if is_transient(exc) else None
                if delay is not None:
                    log.info("%s: %s: %s; retry in %.2f s", self.host, what, text, delay)
                    time.sleep(delay)  # a backoff between attempts
                    continue
                if isinstance(exc, TaskFailed) and exc.log_tail:
                    raise TaskFailed(
                        f"{exc} (log: {' | '.join(exc.log_tail[-3:])})", exc.exitstatus, exc.log_tail
                    ) from None
                raise
            except BaseException:
                self._cleanup_failed_clone(vmid, spec.name, node, settle=2 * self.settings.timeouts.http)
                raise

    def _adopt(self, vmid: int, node: str, spec: VmSpec, deadline: float) -> bool:
        """The clone call's answer was lost. Look under `vmid`: the cell's VM (by its marker) whose
        clone task has ended is adopted (True); absent (the call never ran, or its task failed and
        PVE removed the VM) or someone else's is False. A call that may still be on its way gets
        2 x timeouts.http to show up."""
        api = self.session.qemu(node, vmid)
        settle_until = min(deadline, time.monotonic() + 2 * self.settings.timeouts.http)

        def state():
            try:
                cfg = self.session.get(f"config of VM {vmid}", api.config, until=deadline)
            except ApiError as exc:
                if not is_gone(exc):
                    raise
                return ("absent", None) if time.monotonic() >= settle_until else None
            return None if cfg.get("lock") in BUSY_LOCKS else ("there", cfg)  # its clone task still runs

        kind, cfg = wait_until(
            state,
            timeout=remaining(deadline),
            what=f"the outcome of the clone to VM {vmid}",
            interval=self.settings.poll_interval,
            max_interval=self.settings.poll_max,
        )
        text = str((cfg or {}).get("description") or "")
        if kind == "there" and is_lab_vm(text, spec.name) and parse_description(text).get("lab-cell") == spec.cell_id:
            log.info("%s: the clone to VM %d was made although its answer was lost: adopted", self.host, vmid)
            return True
        return False

    def _cleanup_failed_clone(self, vmid: int, name: str, node: str, *, settle: float = 0.0) -> None:
        try:
            remove_leftover(self.session, vmid, node, name, settle=settle, slots=self.slots)
        finally:
            self.vmids.forget(vmid)

    # -- configure ------------------------------------------------------------------------------------
    def _configure(self, vm: Vm) -> None:
        spec, vmid = vm.spec, vm.handle["vmid"]
        api = self.session.qemu(vm.handle["node"], vmid)
        deadline = time.monotonic() + self.settings.timeouts.config
        # the MAC is the lab's, set here: address discovery never depends on reading it back
        net = f"model={NET_MODELS[spec.nic]},bridge={self.settings.bridge},macaddr={vm.handle['mac'].upper()}"
        params: dict[str, Any] = {
            "net0": net,
            "cores": int(spec.vcpus),
            "sockets": 1,
            "memory": str(int(spec.memory_mib)),
            "cpu": self.settings.cpu_type,
            "agent": f"enabled={flag(self.settings.guest_agent)}",
            "ciuser": self.settings.ci_user,
            "tags": vm_tags(spec.run_id),
            "description": vm_description(spec),
        }
        if self.ssh_keys:
            params["sshkeys"] = quote("\n".join(self.ssh_keys), safe="")  # %20, never '+'
        if self.session.release() >= (8,):
            params["ciupgrade"] = 0  # 8.x+: skip the first-boot package upgrade
        cfg = self.session.get(f"config of VM {vmid}", api.config, until=deadline)
        params.update(disk_on_bus(cfg, spec.disk_bus))
        with self.addresses.lock(spec):
            params["ipconfig0"] = self.addresses.ipconfig(vm, self.addresses.choose(spec))
            # the same values again change nothing: a lost answer or a lock is retried
            self.session.retrying(
                f"config of VM {vmid}",
                lambda: self.session.call(f"config of VM {vmid}", lambda: api.config.put(**params)),
                deadline=deadline,
                limit=self.settings.lock_retries,
            )
        vm.handle.setdefault("static_ip", "")

    def renew(self, vm: Vm, expires_at: float) -> None:
        """A live run's VM keeps its lease: its description again, with the new expiry."""
        vmid = vm.handle["vmid"]
        api = self.session.qemu(vm.handle["node"], vmid)
        what = f"lease of VM {vmid} ({vm.name})"
        description = vm_description(vm.spec, expires_at)
        self.session.retrying(
            what,
            lambda: self.session.call(what, lambda: api.config.put(description=description)),
            deadline=time.monotonic() + self.settings.timeouts.config,
            limit=self.settings.lock_retries,
        )

    # -- start, destroy ---------------------------------------------------------------------------------
    def start(self, vm: Vm) -> None:
        vmid = vm.handle["vmid"]
        api = self.session.qemu(vm.handle["node"], vmid)
        deadline = time.monotonic() + self.settings.timeouts.start
        what = f"start of VM {vmid} ({vm.name})"

        def running() -> bool:
            st = self.session.get(f"status of VM {vmid}", api.status.current, until=deadline)
            return st.get("status") == "running"

        def once():
            try:
                upid = self.session.call(f"start VM {vmid}", lambda: api.status.start.post())
            except LabError as exc:
                if answer_lost(exc) and running():  # it was carried out
                    return
                raise
            try:
                self.session.wait_task(upid, timeout=remaining(deadline), what=what)
            except TaskFailed as exc:
                if "already running" not in exc.exitstatus:  # a start repeated after a lost answer
                    raise

        self.session.retrying(what, once, deadline=deadline, limit=self.settings.lock_retries)

    def destroy(self, vm: Vm) -> None:
        vmid = int(vm.handle["vmid"])
        destroy_vmid(self.session, vmid, vm.handle.get("node", self.settings.node), vm.name, slots=self.slots)
        self.vmids.forget(vmid)
        self.addresses.release(vm.handle.get("static_ip") or "")

    def _destroy_quietly(self, vm: Vm) -> None:
        try:
            self.destroy(vm)
        except Exception as exc:  # the caller raises the configure's own error
            log.warning("%s: cleanup of VM %s after a failed configure: %s", self.host, vm.handle.get("vmid"), exc)


def disk_on_bus(cfg: dict, bus: DiskBus) -> dict[str, str]:
    """Config changes that re-attach the clone's boot disk on `bus` (none when it is there already):
    the same volume under the bus's key, the old key deleted, the boot order following. PVE applies
    the delete first (the volume becomes unusedN) and drops unusedN again once the volume is
    attached under the new key (qemu-server's write_vm_config), so nothing is copied or lost."""
    key, value = boot_disk(cfg)
    new = DISK_KEYS[bus]
    if not key or key == new:
        return {}
    volume, *options = value.split(",")
    kept = [o for o in options if o.split("=", 1)[0] in PORTABLE_DRIVE_OPTIONS]
    boot = str(cfg.get("boot") or "")
    order = boot.removeprefix("order=").split(";") if boot.startswith("order=") else [key]
    return {
        new: ",".join([volume, *kept]),
        "delete": key,
        "boot": "order=" + ";".join(new if k == key else k for k in order),
    }
