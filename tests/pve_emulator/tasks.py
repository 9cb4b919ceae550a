"""Worker tasks and the VM flock.

A task has a start and an end time (monotonic); every request first completes the tasks whose end has
passed (`advance`), so no worker threads exist besides the HTTP ones. A task holding a VM's flock
(`/var/lock/qemu-server/lock-<vmid>.conf`) waits for another holder up to flock_timeout, then fails
with PVE's `got timeout`; a synchronous call waits the same way (`flock_sync`).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from .state import Principal, PveError, Task, VmState, bad_param, fail, handler

if TYPE_CHECKING:
    from .server import PveEmulator


def flock_error(vmid: int) -> str:
    return f"can't lock file '/var/lock/qemu-server/lock-{vmid}.conf' - got timeout"


def new_task(
    emu: PveEmulator,
    node: str,
    ttype: str,
    tid: object,
    who: Principal | None,
    seconds: float,
    *,
    on_ok=None,
    on_fail=None,
    error: str | None = None,
    start_delay: float = 0.0,
    log: list[str] | None = None,
    flock: VmState | None = None,
    user: str | None = None,
) -> str:
    """A worker task; its UPID. With `flock`, the task holds that VM's flock while it runs. A task
    type queued by fail_next() fails half-way with the queued message."""
    now = time.monotonic()
    pid = next(emu._pids)
    starttime = int(time.time())
    user = user or (who.userid if who else "root@pam")
    upid = f"UPID:{node}:{pid:08X}:{pid * 7:08X}:{starttime:08X}:{ttype}:{tid}:{user}:"
    if flock is not None and error is None:
        wait = max(0.0, flock.flock_until - now - start_delay)
        if wait > emu.flock_timeout:
            error = flock_error(flock.vmid)
            start_delay, seconds = start_delay + emu.flock_timeout, 0.0
        else:
            start_delay += wait
    end = now + start_delay + seconds
    queued = emu._failures.get(ttype)
    if error is None and queued:
        error = queued.pop(0)
        end = now + start_delay + seconds / 2
    if flock is not None:
        flock.flock_until = max(flock.flock_until, end)
    emu.tasks[upid] = Task(
        upid,
        node,
        ttype,
        str(tid),
        user,
        pid,
        pid * 7,
        starttime,
        now,
        end,
        error=error,
        log=list(log or []),
        on_ok=on_ok,
        on_fail=on_fail,
    )
    return upid


def advance(emu: PveEmulator) -> None:
    """Finish every task whose end has passed, in the order they end; expire injected locks."""
    now = time.monotonic()
    for vm in emu.vms.values():
        if vm.hold_lock and vm.hold_lock[1] <= now:
            vm.hold_lock = None
    for task in sorted((t for t in emu.tasks.values() if not t.done), key=lambda t: t.end):
        if task.end > now:
            break
        task.done = True
        if task.error is None:
            try:
                if task.on_ok:
                    task.on_ok()
            except PveError as exc:
                task.error = exc.message
        if task.error is None:
            task.exitstatus = "OK"
            task.log.append("TASK OK")
        else:
            task.exitstatus = task.error.replace("\n", " ").strip()
            task.log.append(f"TASK ERROR: {task.exitstatus}")
            if task.on_fail:
                task.on_fail()


def flock_sync(emu: PveEmulator, vm: VmState) -> None:
    """A synchronous call takes the VM's flock: wait (state lock released) up to flock_timeout."""
    wait = vm.flock_until - time.monotonic()
    if wait <= 0:
        return
    emu._lock.release()
    try:
        emu._stopping.wait(min(wait, emu.flock_timeout))
    finally:
        emu._lock.acquire()
    advance(emu)
    if vm.flock_until > time.monotonic():
        raise fail(flock_error(vm.vmid))


def _task_of(emu: PveEmulator, p) -> Task:
    upid = p["upid"]
    if not re.fullmatch(
        r"UPID:[a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?:[0-9A-F]{8}:[0-9A-F]{8,9}:"
        r"[0-9A-F]{8}:[^:\s]+:[^:\s]*:[^:\s]+:",
        upid,
    ):
        raise bad_param("upid", "unable to parse worker upid")
    task = emu.tasks.get(upid)
    if task is None or task.node != p["node"]:
        raise bad_param("upid", "no such task")
    return task


@handler("GET", "/nodes/{node}/tasks/{upid}/status")
def _task_status(emu: PveEmulator, p, who):
    t = _task_of(emu, p)
    out = {
        "upid": t.upid,
        "node": t.node,
        "pid": t.pid,
        "pstart": t.pstart,
        "starttime": t.starttime,
        "type": t.type,
        "id": t.id,
        "user": t.user.split("!")[0],
        "status": "stopped" if t.done else "running",
    }
    if "!" in t.user:
        out["tokenid"] = t.user.split("!", 1)[1]
    if t.done:
        out["exitstatus"] = t.exitstatus
    return out


@handler("GET", "/nodes/{node}/tasks/{upid}/log")
def _task_log(emu: PveEmulator, p, who):
    t = _task_of(emu, p)
    lines = t.log or ["no content"]
    start, limit = p.get("start", 0), p.get("limit", 50)
    return [{"n": i + 1, "t": line} for i, line in enumerate(lines)][start : start + limit]


@handler("GET", "/nodes/{node}/tasks")
def _task_list(emu: PveEmulator, p, who):
    """The node's tasks, newest first: the caller's own (same user; a token's are its user's), or
    all of them with Sys.Audit on /nodes/<node>; `source` active/archive/all, `vmid`, `typefilter`,
    `userfilter`, `start`, `limit` as in pve-manager's Tasks.pm."""
    see_all = who is None or who.has(f"/nodes/{p['node']}", "Sys.Audit")
    mine = who.userid.split("!")[0] if who else ""
    source = p.get("source", "archive")
    out = []
    for t in sorted(emu.tasks.values(), key=lambda t: t.start, reverse=True):
        if t.node != p["node"] or (not see_all and t.user.split("!")[0] != mine):
            continue
        if (source == "active" and t.done) or (source == "archive" and not t.done):
            continue
        if "vmid" in p and t.id != str(p["vmid"]):
            continue
        if p.get("typefilter") and t.type != p["typefilter"]:
            continue
        if p.get("userfilter") and p["userfilter"] not in t.user:
            continue
        entry = {
            "upid": t.upid,
            "node": t.node,
            "pid": t.pid,
            "pstart": t.pstart,
            "starttime": t.starttime,
            "type": t.type,
            "id": t.id,
            "user": t.user.split("!")[0],
        }
        if "!" in t.user:
            entry["tokenid"] = t.user.split("!", 1)[1]
        if t.done:
            entry.update({"status": t.exitstatus, "endtime": t.starttime + max(0, int(t.end - t.start))})
        out.append(entry)
    start, limit = p.get("start", 0), p.get("limit", 50)
    return out[start : start + limit]
