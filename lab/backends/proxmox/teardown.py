"""Removing a VM the lab made: stop it, then delete it with purge=1 and destroy-unreferenced-disks=1.

Teardown waits where PVE asks it to: a backup's lock, a flock that times out, a stop task slower
than `timeouts.stop` (awaited by its UPID), a lost connection: it keeps trying, with backoff, until
the teardown deadline (`timeouts.destroy`, minutes). Then it leaves the VM to `lab gc` and says so
in one line with the VM id and who holds its lock. A VM already gone is fine, and so is a VMID that
is no longer the lab's VM (freed, then taken by someone else): it is never touched.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from lab.backends.proxmox.ownership import TEMPLATE_MARK, VM_MARK, is_lab_template, is_lab_vm, marked
from lab.backends.proxmox.session import ApiError, Session, is_gone, remaining
from lab.backends.proxmox.templates import boot_disk
from lab.errors import LabError, TeardownError, TimeoutError_
from lab.wait import wait_until

if TYPE_CHECKING:
    from lab.backends.proxmox.placement import Slots

log = logging.getLogger(__name__)

BUSY_LOCKS = ("clone", "create")  # a task still making the VM: its description may not be written yet


def destroy_vmid(
    session: Session, vmid: int, node: str, name: str, *, image: str | None = None, slots: Slots | None = None
) -> None:
    """Stop and delete VM `vmid` on `node` if it is still the lab's VM `name` (with `image`: the
    lab's template of that image). TeardownError (one line: VM, node, lock holder) when it is
    still there at the teardown deadline."""
    api = session.qemu(node, vmid)
    timeouts = session.settings.timeouts
    deadline = time.monotonic() + timeouts.destroy
    label = f"VM {vmid} ({name})"

    def ours(cfg: dict) -> bool:
        text = str(cfg.get("description") or "")
        return is_lab_template(text, image) if image is not None else is_lab_vm(text, name)

    def config() -> dict | None:
        """The VM's config once no task is still making it; None when it is gone."""

        def settled():
            try:
                cfg = session.get(f"config of {label}", api.config, until=deadline)
            except ApiError as exc:
                if is_gone(exc):
                    return {"gone": True}
                raise
            busy = cfg.get("lock") in BUSY_LOCKS and not marked(
                str(cfg.get("description") or ""), TEMPLATE_MARK if image else VM_MARK
            )
            return None if busy else cfg

        cfg = wait_until(
            settled,
            timeout=remaining(deadline),
            what=f"the task making {label} to end",
            interval=session.settings.poll_interval,
            max_interval=session.settings.poll_max,
        )
        return None if cfg.get("gone") else cfg

    def stop_and_delete() -> None:
        cfg = config()
        if cfg is None:
            return
        if not ours(cfg):
            log.warning("%s: VM %d is not the lab's %s (any more): left alone", session.host, vmid, name)
            return
        st = session.get(f"status of {label}", api.status.current, until=deadline)
        if st.get("status") != "stopped":
            # the lab's own VM: a stop repeated after a lost answer changes nothing
            upid = session.call(
                f"stop {label}", lambda: api.status.stop.post(timeout=max(1, int(timeouts.stop))), until=deadline
            )
            # awaited by its UPID until the teardown deadline, however long beyond timeouts.stop
            session.wait_task(upid, timeout=remaining(deadline), what=f"stop of {label}")
        storage = boot_disk(cfg)[1].split(":", 1)[0] or session.settings.storage
        with (
            slots.hold(node=node, storage=storage, deadline=deadline, what=f"destroy of {label}")
            if slots
            else contextlib.nullcontext()
        ):
            try:
                session.run_task(
                    f"destroy of {label}",
                    lambda: api.delete(purge=1, **{"destroy-unreferenced-disks": 1}),
                    deadline=deadline,
                    idempotent=True,
                )
            except LabError as exc:
                if not is_gone(exc):
                    raise

    try:
        session.retrying(f"teardown of {label}", stop_and_delete, deadline=deadline)
    except TeardownError:
        raise
    except LabError as exc:
        raise TeardownError(
            f"{session.host}: could not destroy {label} on node {node} within the teardown "
            f"deadline ({timeouts.destroy:g} s): {_reason(session, exc)}; {lock_holder(session, node, vmid)}; "
            f"left for `lab gc`",
            hint="`lab gc` removes it once its lock is released",
        ) from None


def _reason(session: Session, exc: Exception) -> str:
    return str(exc).removeprefix(f"{session.host}: ")


def lock_holder(session: Session, node: str, vmid: int) -> str:
    """Who holds VM `vmid`: its config lock and the tasks running on it (those the caller may see)."""
    until = time.monotonic() + session.settings.timeouts.http
    parts = []
    try:
        st = session.get(f"status of VM {vmid}", session.qemu(node, vmid).status.current, until=until)
        if st.get("lock"):
            parts.append(f"lock {st['lock']}")
        tasks = session.get(f"tasks of VM {vmid}", session.node(node).tasks, until=until, vmid=vmid, source="active")
        parts += [f"task {t.get('type')} of {t.get('user')} ({t.get('upid')})" for t in tasks]
    except LabError as exc:
        return f"lock holder unknown ({_reason(session, exc)})"
    return "held by " + ", ".join(parts) if parts else "no lock or task holds it now"


def remove_leftover(
    session: Session,
    vmid: int,
    node: str,
    name: str,
    *,
    settle: float = 0.0,
    image: str | None = None,
    slots: Slots | None = None,
) -> None:
    """After a create or clone that failed: PVE removes a failed task's VM itself; make sure no VM
    of the lab named `name` (with `image`: a template of that image) is left under `vmid`. After a
    call whose answer was lost (settle > 0) the node may still carry it out: watch for the VM that
    long before deciding nothing was made.
    Never raises (the caller is already handling the failure); what cannot be removed is logged
    for `lab gc`."""
    api = session.qemu(node, vmid)

    def exists():
        try:
            return session.get(
                f"config of VM {vmid}", api.config, until=time.monotonic() + session.settings.timeouts.http
            )
        except LabError:  # gone (the normal case) or unreadable
            return None

    cfg = exists()
    if cfg is None and settle > 0:
        try:
            cfg = wait_until(
                exists,
                timeout=settle,
                what=f"VM {vmid} of a call whose answer was lost",
                interval=session.settings.poll_interval,
                max_interval=session.settings.poll_max,
            )
        except TimeoutError_:
            return
    if cfg:
        try:
            destroy_vmid(session, vmid, node, name, image=image, slots=slots)
        except LabError as exc:
            log.warning("%s: leftover VM %d (%s) of a failed call: %s", session.host, vmid, name, exc)
