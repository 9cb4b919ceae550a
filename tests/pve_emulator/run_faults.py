"""Faults of the PVE emulator for a real `lab run` (the chaos suite, tests/support/chaos.py).

How the harness uses them, per fault:

    emu = PveEmulator("8.4", certs, auth_delay=0.05)       # with FULL_ACL's token, as today
    publish_template(emu, lab.images.load("debian12"))     # instead of emu.add_template(9000, ...)
    inj = FAULTS[name](emu)                                # before `lab run`
    # [hosts.pve] of lab.toml: BASE_SETTINGS, then inj.host_settings over it; inj.env into the run's env
    res = lab run ...
    inj.check_run(res.returncode, one_line)                 # -> problems (strings); [] when as expected
    if inj.gc_exit_while_faulty is not None:                # `lab gc` while the fault lasts:
        gc = lab gc ...; gc.returncode must equal it        #   a look that did not happen is exit 1
    inj.clear()                                             # the fault ends
    lab gc ...                                              # then: leftovers(emu, inj) == [] and
                                                            # inj.touched() == [] (foreign things intact)

Every function takes the running emulator, prepares the fault (a watcher thread when it must
strike mid-run) and returns an Injection saying what the run and gc must show.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lab.model import ImageRef

from . import vms as handlers
from .fixtures import FULL_ACL, TEMPLATE_VMID, lab_template_description

# [hosts.pve] keys for a chaos run against the bookkeeping emulator (no real guest: cells fail at
# ready, after clone, config and start; what is measured is the teardown and the error)
BASE_SETTINGS = {
    "template": TEMPLATE_VMID,
    "ssh_timeout": 3,  # the bookkeeping emulator runs no guest: no sshd to wait for
    "timeouts": {"http": 5, "retry": 10, "clone": 20, "start": 10, "stop": 5, "destroy": 20, "ready": 15, "agent": 5},
}
SHARED_STORAGE = "ceph"


@dataclass
class Injection:
    fault: str
    expect: str  # in words: what the run and `lab gc` must show
    exit_statuses: tuple[int, ...] = (1,)  # the run's exit status (bookkeeping cells fail at ready: 1)
    line_has: tuple[str, ...] = ()  # fragments the run's one error line must hold
    gc_exit_while_faulty: int | None = None  # `lab gc` during the fault, if the harness runs one
    host_settings: dict = field(default_factory=dict)  # over BASE_SETTINGS (nested dicts merged)
    env: dict[str, str] = field(default_factory=dict)  # into the run's environment
    watcher: threading.Thread | None = None
    foreign: set[int] = field(default_factory=set)  # VMIDs that are not the lab's: never leftovers
    clear: Callable[[], None] = lambda: None
    touched: Callable[[], list[str]] = lambda: []
    nothing_created: bool = False  # the run must not have created anything (a check refused it)
    struck: Callable[[], list[str]] = lambda: []  # problems when the fault did not do what it says

    def check_run(self, emu, exit_status: int, line: str) -> list[str]:
        """What is wrong with the run's outcome ([] when it is as expected)."""
        problems = []
        if exit_status not in self.exit_statuses:
            problems.append(f"exit {exit_status}, expected {'/'.join(map(str, self.exit_statuses))}")
        problems += [f"the error line lacks {frag!r}" for frag in self.line_has if frag not in line]
        problems += self.struck()
        if self.nothing_created:
            made = [f"{m} {path}" for m, path, _p in emu.requests if m != "GET"]
            if made:
                problems.append(f"a check should have refused before anything was made, yet: {made[:3]}")
        return problems

    def merged_settings(self) -> dict:
        out = {**BASE_SETTINGS, **self.host_settings}
        out["timeouts"] = {**BASE_SETTINGS["timeouts"], **self.host_settings.get("timeouts", {})}
        return out


def publish_template(
    emu, image: ImageRef, vmid: int = TEMPLATE_VMID, *, storage: str | None = None, published: int | None = None
) -> None:
    """Plant the template `lab images publish` makes for `image` (name lab-<image>, the lab's
    marker, the image's recipe digest and sha256), so that a `lab run` of that image clones it."""
    emu.add_template(
        vmid,
        f"lab-{image.name}",
        storage=storage,
        description=lab_template_description(
            image.name, image.digest, image.sha256 or image.digest, published or int(time.time())
        ),
    )


def leftovers(emu, injection: Injection | None = None) -> list[str]:
    """What the lab left on the emulated cluster: VMs (not templates, not the fault's foreign
    ones), their disks, and tasks still running."""
    foreign = injection.foreign if injection else set()
    out = [f"PVE VM {v}" for v in emu.vm_ids() if v not in foreign]
    out += [
        f"PVE volume {v}" for v in emu.volume_ids() if not any(f"-{f}-" in v or v.endswith(f"-{f}") for f in foreign)
    ]
    out += [f"PVE task {t.type} {t.upid}" for t in emu.active_tasks() if t.type != "vzdump"]
    return out


def _watch(
    what: str,
    until: Callable[[], object],
    then: Callable[[object], None],
    timeout: float = 120,
    stop: threading.Event | None = None,
) -> threading.Thread:
    """A thread that waits (polling the emulator) until `until()` is truthy, then calls `then`;
    it gives up at `timeout` or when `stop` is set."""
    stop = stop or threading.Event()

    def run():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop.is_set():
            hit = until()
            if hit:
                then(hit)
                return
            stop.wait(0.02)

    t = threading.Thread(target=run, name=f"chaos-{what}", daemon=True)
    t.start()
    return t


def _started_vm(emu):
    """The VMID of the first lab VM whose start task ended OK."""
    return next((int(t.id) for t in list(emu.tasks.values()) if t.type == "qmstart" and t.exitstatus == "OK"), None)


# -- a lock held by another task --------------------------------------------------------------------


def backup_during_teardown(emu, seconds: float = 25.0) -> Injection:
    """A backup job (vzdump) of the cell's VM starts as soon as it runs and holds its lock and flock
    for `seconds`, past the moment the cell ends: teardown must wait for it (within its deadline)
    and leave nothing, by itself."""
    watcher = _watch("backup", lambda: _started_vm(emu), lambda vmid: emu.backup(vmid, seconds))
    return Injection(
        "pve-backup-during-teardown",
        "the run waits for the backup and removes its VM itself",
        watcher=watcher,
        host_settings={"timeouts": {"destroy": seconds + 20}},
    )


def backup_past_the_teardown_deadline(emu, seconds: float = 40.0) -> Injection:
    """The same backup, longer than the teardown deadline: the run says in one line which VM it left
    and who holds it (the vzdump task); once the backup is over one `lab gc` removes it."""
    upids: list[str] = []
    watcher = _watch("backup", lambda: _started_vm(emu), lambda vmid: upids.append(emu.backup(vmid, seconds)))

    def clear():
        watcher.join(timeout=5)
        if upids:
            time.sleep(max(0.0, emu.tasks[upids[0]].end - time.monotonic()) + 0.2)

    return Injection(
        "pve-backup-past-teardown",
        "teardown gives up at its deadline naming the VM and vzdump; gc after the backup removes it",
        line_has=("teardown deadline", "vzdump"),
        watcher=watcher,
        host_settings={"timeouts": {"destroy": 5}},
        clear=clear,
    )


# -- a stop task that outlasts its timeout ----------------------------------------------------------


def slow_stop(emu, seconds: float = 8.0) -> Injection:
    """Every stop task takes `seconds`, longer than timeouts.stop: teardown waits for it by its UPID
    and leaves nothing by itself."""
    emu.task_seconds["qmstop"] = seconds
    return Injection(
        "pve-slow-stop",
        "teardown awaits the slow stop task and removes the VM itself",
        host_settings={"timeouts": {"stop": 2, "destroy": seconds + 20}},
    )


# -- a node answering 595 ---------------------------------------------------------------------------


def node_offline_mid_run(emu, node: str = "pve1") -> Injection:
    """The node goes offline (595) once the cell's clone is made: the cell fails, teardown cannot
    reach the VM and leaves it; `lab gc` meanwhile names the node and its VM as not checked and
    exits 1 (never "removed 0, kept 0"); the node back, one `lab gc` removes everything."""
    watcher = _watch(
        "offline",
        lambda: any(t.type == "qmclone" and t.exitstatus == "OK" for t in list(emu.tasks.values())),
        lambda _hit: emu.offline_nodes.add(node),
    )
    return Injection(
        "pve-node-offline",
        f"node {node} offline mid-run: gc exits 1 naming it; back online, gc removes all",
        gc_exit_while_faulty=1,
        watcher=watcher,
        host_settings={"timeouts": {"config": 5, "start": 5, "destroy": 5, "retry": 3}},
        clear=lambda: emu.offline_nodes.discard(node),
    )


# -- dropped and hanging connections ----------------------------------------------------------------


def dropped_connections(emu, every: int = 20, when: str = "after") -> Injection:
    """One request in `every` loses its connection (`when` "after": carried out, the answer lost;
    "before": never carried out). The run ends as it would without the fault, nothing left."""
    emu.drop_connections(every=every, when=when)
    return Injection(
        f"pve-dropped-connections-{when}",
        f"1 request in {every} dropped {when} handling: retried or looked for; the run is unaffected",
        host_settings={"timeouts": {"http": 2}},
        clear=emu.clear_connection_faults,
    )


def hanging_connections(emu, every: int = 25, seconds: float = 4.0) -> Injection:
    """One request in `every` hangs `seconds` (longer than timeouts.http) before it is carried out:
    the client gives up and retries or looks; the run is unaffected, nothing left."""
    emu.hang_connections(every=every, seconds=seconds)
    return Injection(
        "pve-hanging-connections",
        f"1 request in {every} hangs {seconds:g} s: the run is unaffected",
        host_settings={"timeouts": {"http": 1}},
        clear=emu.clear_connection_faults,
    )


# -- the cfs lock under concurrent clones -----------------------------------------------------------


def cfs_lock_contention(emu, image: ImageRef, vmid: int = TEMPLATE_VMID + 1, refusals: int = 2) -> Injection:
    """The lab's template is on shared storage where another client's full clone holds PVE's cluster
    lock: the lab's clones are refused (cfs-lock 'storage-ceph' ... got lock request timeout) and
    retried with backoff. The other client's clone ends once `refusals` of the lab's were refused
    (counted, not timed: a busy machine changes when the refusals come, not how many), so the lab's
    next attempt gets the lock within its retries. Call before `lab run`; the other client's VM is
    foreign and goes with clear()."""
    emu.add_storage(SHARED_STORAGE, "rbd", {"images"}, shared=True)
    emu.add_template(
        vmid,
        f"lab-{image.name}",
        storage=SHARED_STORAGE,
        description=lab_template_description(
            image.name, image.digest, image.sha256 or image.digest, int(time.time()) + 1
        ),
    )  # newer than the default one
    emu.storage_slots, emu.storage_lock_timeout = 1, 0.2
    other = 800
    with emu._lock:
        full_clone_seconds, emu.full_clone_seconds = emu.full_clone_seconds, 3600.0  # until ended below
        upid = handlers._clone(
            emu,
            {
                "node": emu.node,
                "vmid": vmid,
                "newid": other,
                "full": 1,
                "storage": SHARED_STORAGE,
                "name": f"someone-else-{other}",
            },
            None,
        )
        emu.full_clone_seconds = full_clone_seconds

    def refused() -> int:
        with emu._lock:
            return sum(1 for t in emu.tasks.values() if t.type == "qmclone" and "cfs-lock" in (t.error or ""))

    def end_other_clone(_hit=None) -> None:
        """The other client's clone is done now: its task ends and the storage is free."""
        with emu._lock:
            now = time.monotonic()
            task = emu.tasks[upid]
            task.end = min(task.end, now)
            emu._storage_busy = [(st, b, min(e, now) if st == SHARED_STORAGE else e) for st, b, e in emu._storage_busy]

    stop = threading.Event()
    watcher = _watch("cfs", lambda: refused() >= refusals, end_other_clone, timeout=600, stop=stop)

    def clear():
        stop.set()
        watcher.join(timeout=10)
        end_other_clone()
        deadline = time.monotonic() + 30
        while emu.active_tasks() and time.monotonic() < deadline:
            time.sleep(0.1)
        with emu._lock:  # the other client tidies up after itself
            vm = emu.vms.pop(other, None)
            if vm is not None:
                for vol in [x for x in emu.volumes.values() if x.vmid == other]:
                    emu.volumes.pop((vol.node, vol.volid), None)

    def struck() -> list[str]:
        n = refused()
        return [] if n >= refusals else [f"the cluster lock refused {n} of the lab's clones, not {refusals}"]

    return Injection(
        "pve-cfs-lock",
        f"the lab's clones refused {refusals} times by the cluster lock are retried",
        host_settings={"template": "lab-{image}"},
        watcher=watcher,
        foreign={other},
        clear=clear,
        struck=struck,
    )


# -- what the lab did not make ----------------------------------------------------------------------


def foreign_resources(emu, image: ImageRef) -> Injection:
    """A shared cluster: a hand-made template with the lab's template name and a higher VMID, the
    lab's template lines without its marker, VMs tagged `lab` with lab-like names and no, partial,
    or run-id-less descriptions. The run clones the lab's own template; neither the run, nor `lab
    gc` (even --force), nor publish touches any of them: touched() must be []."""
    name = f"lab-{image.name}"
    emu.add_template(9900, name)
    emu.add_template(
        9901,
        name,
        description=f"lab-image: {image.name}\nlab-image-digest: {image.digest}\n"
        f"lab-image-sha256: {image.sha256 or image.digest}",
    )
    planted = {9900: None, 9901: None}
    for vmid, (vm_name, tags, description) in {
        9910: ("lab-r1-c01", "lab", None),
        9911: ("lab-chaos-c01", "lab;lab-run-chaos", "lab-run-id: chaos"),
        9912: ("lab-old-c01", "lab", "lab-marker: lab/vm\nlab-vm: lab-old-c01\nlab-run-id: \nlab-expires: 1"),
    }.items():
        emu.add_template(vmid, vm_name, description=description, tags=tags)
        with emu._lock:
            emu.vms[vmid].config.pop("template")
        planted[vmid] = None
    before = {v: emu.vm(v).config for v in planted}

    def touched() -> list[str]:
        now = set(emu.vm_ids(include_templates=True))
        out = [f"VM {v} removed" for v in before if v not in now]
        out += [f"VM {v} changed" for v in before if v in now and emu.vm(v).config != before[v]]
        out += [
            f"{m} {path}"
            for m, path, _p in emu.requests
            for v in before
            if m != "GET" and (path.endswith(f"/qemu/{v}") or f"/qemu/{v}/" in path)
        ]
        return out

    return Injection(
        "pve-foreign-resources",
        "0 foreign VMs or templates touched by run, gc --force or publish",
        host_settings={"template": "lab-{image}"},
        foreign=set(before),
        touched=touched,
    )


# -- credentials without a privilege ----------------------------------------------------------------


def token_without(emu, privilege: str = "SDN.Use", env_var: str = "LAB_CHAOS_PVE_TOKEN") -> Injection:
    """The run's token lacks `privilege` (e.g. SDN.Use on the bridge's zone, VM.Clone): `lab run`
    exits 2 in one line naming it and its path before anything is created."""
    acl = {path: set(privs) - {privilege} for path, privs in FULL_ACL.items()}
    name = f"lab@pve!no-{privilege.lower().replace('.', '-')}"
    secret = f"chaos-{privilege.lower().replace('.', '-')}-secret"
    emu.add_token(name, secret, acl=acl)
    return Injection(
        f"pve-token-without-{privilege}",
        f"exit 2 naming {privilege} before anything is created",
        exit_statuses=(2,),
        line_has=("lacks a privilege", privilege),
        env={env_var: f"{name}={secret}"},
        nothing_created=True,
    )


FAULTS: dict[str, Callable[..., Injection]] = {
    "pve-backup-during-teardown": backup_during_teardown,
    "pve-backup-past-teardown": backup_past_the_teardown_deadline,
    "pve-slow-stop": slow_stop,
    "pve-node-offline": node_offline_mid_run,
    "pve-dropped-connections": dropped_connections,
    "pve-hanging-connections": hanging_connections,
    "pve-cfs-lock": cfs_lock_contention,  # (emu, image)
    "pve-foreign-resources": foreign_resources,  # (emu, image)
    "pve-token-without-sdn-use": lambda emu: token_without(emu, "SDN.Use"),
    "pve-token-without-vm-clone": lambda emu: token_without(emu, "VM.Clone"),
}
