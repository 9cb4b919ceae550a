"""A small Proxmox VE API emulator: a real HTTPS server that proxmoxer talks to over the network.

Every request goes through PVE's pipeline, in PVE's order: route (unknown path/method: 501),
authenticate (API token header or ticket cookie + CSRF; 401 delayed like pveproxy; tickets
expire), validate parameters against the official schema of the chosen version (400 `Parameter
verification failed.`), check the schema's permission rule (403 `Permission check failed
(/vms/100, VM.Clone)`), then run a hand-written handler. Errors put the message in the HTTP
reason phrase and send `{"data":null}` (9.1 adds `"message"`), like pve-http-server.

State is evaluated lazily: tasks have a start and an end time (monotonic); every request first
completes the tasks whose end has passed. So no worker threads exist besides the HTTP ones.

Endpoints: version, access/ticket, cluster/nextid, cluster/resources, nodes (list), nodes/{node}/
qemu (list, create with import-from), clone (linked/full, `target` node), template, config
GET/PUT/POST, status/current, status/start, status/stop, DELETE qemu/{vmid}, tasks/{upid}/status
and /log, agent/network-get-interfaces, storage (list), storage content (list, GET, DELETE),
storage upload (multipart). Everything else: 501.

Modelled state: nodes (online/offline: 595 for an offline node), storages (type, content types,
shared or node-local) and their volumes (disks of every VM, uploads), per-VM config locks and
flocks (`can't lock file ... got timeout`), per-storage allocation locks, tasks, tickets.

With `backing=QemuBacking(...)` (qemu.py) every started VM is a real local QEMU guest of the
golden image: disks are real qcow2 files, `ipconfig0` reaches the guest, the guest agent answers
from the real guest. Without it, VMs are bookkeeping only.

Not modelled: pending config on running VMs, HA start/stop requests (an HA-managed VM only refuses
destroy without purge), snapshots, agent exec, migration, resize.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from typing import Callable
from urllib.parse import parse_qsl, unquote, urlsplit

from multipart import MultipartParser, parse_options_header

from .certs import CertSet
from .schema import Schema, parse_property_string, validate

VERSIONS = {"7.4": "7.4-3", "8.4": "8.4.1", "9.1": "9.1.2"}
ALL = object()  # every privilege (root@pam)


class PveError(Exception):
    def __init__(self, status: int, message: str, errors: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.errors = status, message, errors


def _fail(message: str) -> PveError:
    return PveError(500, message)


@dataclass
class Principal:
    userid: str  # user@realm, or user@realm!tokenid for a token
    acl: dict[str, set[str]] | object  # path -> privileges, or ALL

    def privs_at(self, path: str) -> set[str] | object:
        if self.acl is ALL:
            return ALL
        got: set[str] = set()
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts) + 1):
            got |= set(self.acl.get("/" + "/".join(parts[:i]), ()))  # ACLs propagate down
        return got


@dataclass
class Task:
    upid: str
    node: str
    type: str
    id: str
    user: str
    pid: int
    pstart: int
    starttime: int
    start: float
    end: float
    error: str | None = None  # final exitstatus when it fails
    log: list[str] = field(default_factory=list)
    on_ok: Callable[[], None] | None = None
    on_fail: Callable[[], None] | None = None
    done: bool = False
    exitstatus: str | None = None


@dataclass
class VmState:
    vmid: int
    node: str
    config: dict
    running: bool = False
    booted_at: float | None = None
    linked_base: int | None = None  # template vmid a linked clone depends on
    hold_lock: tuple[str, float] | None = None  # (lock, until) injected by a test
    dhcp_ip: str = ""
    created_at: float = field(default_factory=time.monotonic)
    flock_until: float = 0.0  # the flock on /var/lock/qemu-server/lock-<vmid>.conf is held until
    ha_managed: bool = False
    guest: object | None = None  # the QEMU guest behind a running VM (QemuBacking)


@dataclass
class Storage:
    name: str
    type: str  # dir, lvmthin, rbd, ...
    content: set[str]
    shared: bool = False
    path: str = ""  # dir storages: the mount point files live under on the node

    def supports_linked_clones(self) -> bool:
        return self.type in ("lvmthin", "zfspool", "rbd", "dir", "nfs", "cifs")


@dataclass
class Volume:
    volid: str  # storage:name
    node: str  # "" when the storage is shared
    content: str  # images, rootdir, iso, import, vztmpl
    format: str
    size: int
    vmid: int | None = None
    parent: str | None = None  # base volume of a linked clone
    file: Path | None = None  # real data (uploads; disks when QEMU-backed)
    external: bool = False  # the file belongs to someone else (the golden image): never deleted
    ctime: int = field(default_factory=lambda: int(time.time()))

    @property
    def storage(self) -> str:
        return self.volid.split(":", 1)[0]

    @property
    def name(self) -> str:
        return self.volid.split(":", 1)[1]


class PveEmulator:
    """Start with `with PveEmulator(version, certs) as emu:`; `emu.url` is the base URL.

    Scenario knobs (set before or during a test):
      task_seconds[type]  duration of qmclone/qmstart/qmstop/qmdestroy/qmconfig/qmcreate/imgcopy
      full_clone_seconds  duration of a full clone
      storage_slots / storage_lock_timeout   parallel clones per storage before `can't lock file`
      flock_timeout       how long a call waits for a VM's flock (10 s on PVE) before `got timeout`
      agent_delay         seconds after boot until the guest agent answers (None: never);
                          QEMU-backed: the agent answers once the real guest is up
      dhcp_delay          seconds after the agent until a DHCP address shows up
      auth_delay          pveproxy's 401 delay (3 s on real PVE)
      ticket_lifetime     seconds a login ticket is valid (2 h on PVE)
      strict_booleans     top-level booleans accept only 1/0 (real PVE); False = lenient
      nextid_lag          nextid overlooks VMs created less than this ago (a certain nextid race)
      latency["METHOD /path/template"]  seconds a call takes before it is handled (slow sync calls)
      offline_nodes       nodes that are down: any call for them answers 595
    Fault injection: fail_next(), hold_lock(), hold_flock(), steal_next_vmid(), set_ha(),
    add_token()/add_user() ACLs, add_storage().
    """

    def __init__(self, version: str = "8.4", certs: CertSet | None = None, *, node: str = "pve1",
                 nodes: tuple[str, ...] = ("pve1", "pve2"), storage: str = "local-lvm",
                 auth_delay: float = 3.0, backing=None):
        self.version = version
        self.schema = Schema(version)
        self.certs = certs
        self.node, self.nodes, self.storage = node, tuple(nodes), storage
        self.backing = backing
        self.storages: dict[str, Storage] = {}
        self.add_storage(storage, "lvmthin", {"images", "rootdir"})
        local_content = {"iso", "vztmpl", "backup"}
        if self.release >= (8, 3):
            local_content.add("import")  # 8.3+: the content type the import path needs
        self.add_storage("local", "dir", local_content, path="/var/lib/vz")
        self.volumes: dict[tuple[str, str], Volume] = {}  # (node or "" if shared, volid)
        self.auth_delay = auth_delay
        self.ticket_lifetime = 7200.0
        self.task_seconds = {"qmclone": 0.3, "qmstart": 0.15, "qmstop": 0.1, "qmdestroy": 0.15,
                             "qmconfig": 0.05, "qmcreate": 0.2, "qmtemplate": 0.1, "imgcopy": 0.1,
                             "imgdel": 0.05}
        self.full_clone_seconds = 0.6
        self.storage_slots = 2
        self.storage_lock_timeout = 10.0
        self.flock_timeout = 10.0
        self.agent_delay: float | None = 0.2
        self.dhcp_delay = 0.1
        self.strict_booleans = True
        self.nextid_lag = 0.0  # nextid overlooks VMs younger than this: makes the nextid race certain
        self.latency: dict[str, float] = {}
        self.offline_nodes: set[str] = set()
        self.node_maxmem = 16 * 1024**3
        self.vms: dict[int, VmState] = {}
        self.tasks: dict[str, Task] = {}
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, params) for assertions
        self._lock = threading.RLock()
        self._failures: dict[str, list[str]] = {}
        self._steal = 0
        self._principals_by_token: dict[str, tuple[str, Principal]] = {}
        self._users: dict[str, tuple[str, Principal]] = {}
        self._tickets: dict[str, tuple[str, Principal, float]] = {}
        self._storage_busy: list[tuple[str, float, float]] = []
        self._pids = itertools.count(0x1A2B3)
        self._macs = itertools.count(0x100)
        self._upload = None  # the file part of the multipart request being handled
        self._data_dir: Path | None = None
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.add_user("root@pam", "rootpass", acl=ALL)

    @property
    def release(self) -> tuple[int, int]:
        major, minor = self.version.split(".")
        return int(major), int(minor)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "PveEmulator":
        self._data_dir = Path(tempfile.mkdtemp(prefix="pve-emu-", dir="/var/tmp"))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(self.certs.cert_file), str(self.certs.key_file))
        self._server = _Server(("127.0.0.1", 0), self, ctx)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="pve-emulator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.close_connections()
            self._server.server_close()  # joins the handler threads
            self._thread.join(timeout=10)
            self._server = None
        with self._lock:
            if self.backing is not None:
                for vm in self.vms.values():  # a test that failed midway: no QEMU outlives us
                    if vm.guest is not None:
                        self.backing.stop(vm.guest)
                        vm.guest = None
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def __enter__(self) -> "PveEmulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    # --- scenario API ------------------------------------------------------------------------

    def add_user(self, userid: str, password: str, acl=None) -> None:
        self._users[userid] = (password, Principal(userid, acl if acl is not None else {}))

    def add_token(self, tokenid: str, secret: str, *, privsep: bool = True,
                  acl: dict[str, set[str]] | object | None = None) -> None:
        """tokenid is `user@realm!name`. With privsep the token has only `acl` (default: none);
        without, it has its user's privileges."""
        user = tokenid.split("!", 1)[0]
        if privsep:
            eff = acl if acl is not None else {}
        else:
            eff = self._users[user][1].acl if user in self._users else {}
        self._principals_by_token[tokenid] = (secret, Principal(tokenid, eff))

    def add_storage(self, name: str, type_: str, content: set[str], *, shared: bool = False,
                    path: str = "") -> None:
        self.storages[name] = Storage(name, type_, set(content), shared, path)

    def add_template(self, vmid: int = 9000, name: str = "debian12", node: str | None = None,
                     memory: int = 1024, storage: str | None = None, disk: Path | None = None) -> None:
        """A template VM whose disk is `disk` (e.g. the golden image; never deleted) or nothing."""
        node = node or self.node
        storage = storage or self.storage
        cfg = {"name": name, "template": 1, "agent": "1", "cores": 1, "sockets": 1,
               "memory": memory if self.version == "7.4" else str(memory),
               "net0": f"virtio={self._new_mac()},bridge=vmbr0", "ostype": "l26",
               "scsihw": "virtio-scsi-single", "scsi0": f"{storage}:base-{vmid}-disk-0,size=4G",
               "ide2": f"{storage}:vm-{vmid}-cloudinit,media=cdrom", "boot": "order=scsi0",
               "serial0": "socket", "vga": "serial0", "smbios1": f"uuid={_uuid()}"}
        with self._lock:
            self.vms[vmid] = VmState(vmid, node, cfg)
            self._add_volume(node, f"{storage}:base-{vmid}-disk-0", "images", "qcow2", 4 * 1024**3, vmid,
                             file=disk, external=disk is not None)
            self._add_volume(node, f"{storage}:vm-{vmid}-cloudinit", "images", "raw", 4 * 1024**2, vmid)

    def expire_tickets(self) -> None:
        """Every ticket handed out so far is now older than ticket_lifetime."""
        with self._lock:
            for t, (csrf, who, _born) in list(self._tickets.items()):
                self._tickets[t] = (csrf, who, time.monotonic() - self.ticket_lifetime - 1)

    def set_ha(self, vmid: int, managed: bool = True) -> None:
        with self._lock:
            self.vms[vmid].ha_managed = managed

    def hold_flock(self, vmid: int, seconds: float) -> None:
        """Another process (vzdump, a qm command) holds the VM's flock for a while."""
        with self._lock:
            self.vms[vmid].flock_until = time.monotonic() + seconds

    def fail_next(self, task_type: str, message: str, count: int = 1) -> None:
        """The next `count` tasks of this type fail half-way with `message` as exitstatus."""
        with self._lock:
            self._failures.setdefault(task_type, []).extend([message] * count)

    def hold_lock(self, vmid: int, lock: str, seconds: float) -> None:
        """Put a config lock (`clone`, `backup`, ...) on a VM for a while."""
        with self._lock:
            self.vms[vmid].hold_lock = (lock, time.monotonic() + seconds)

    def steal_next_vmid(self, count: int = 1) -> None:
        """After the next `count` nextid answers, another client takes that id at once."""
        with self._lock:
            self._steal += count

    def vm_ids(self, include_templates: bool = False) -> list[int]:
        with self._lock:
            self._advance()
            return sorted(v.vmid for v in self.vms.values()
                          if include_templates or not v.config.get("template"))

    def vm(self, vmid: int) -> VmState:
        with self._lock:
            self._advance()
            return copy.deepcopy(self.vms[vmid])

    def active_tasks(self) -> list[Task]:
        with self._lock:
            self._advance()
            return [t for t in self.tasks.values() if not t.done]

    def volume_ids(self, include_templates: bool = False) -> list[str]:
        """Every volume on the emulated cluster (disks, cloud-init drives, uploads)."""
        with self._lock:
            self._advance()
            tmpl = {v.vmid for v in self.vms.values() if v.config.get("template")}
            return sorted(v.volid for v in self.volumes.values()
                          if include_templates or v.vmid is None or v.vmid not in tmpl)

    def guests(self) -> list[object]:
        """The QEMU guests behind running VMs (QEMU-backed emulators)."""
        with self._lock:
            return [v.guest for v in self.vms.values() if v.guest is not None]

    # --- request pipeline --------------------------------------------------------------------

    def handle(self, method: str, path: str, params: dict, headers, upload=None) -> tuple[int, str, dict]:
        try:
            return 200, "OK", {"data": self._handle(method, path, params, headers, upload)}
        except PveError as exc:
            reason = exc.message.replace("\n", " ").strip()
            body: dict = {"data": None}
            if exc.errors is not None:
                body["errors"] = exc.errors
            if self.version == "9.1":
                body["message"] = exc.message if exc.message.endswith("\n") else exc.message + "\n"
            return exc.status, reason, body
        except Exception as exc:  # a bug in the emulator: say so instead of dropping the connection
            return 500, f"emulator bug: {type(exc).__name__}: {exc}".replace("\n", " ")[:200], {"data": None}

    def _handle(self, method: str, path: str, params: dict, headers, upload=None):
        if not path.startswith("/api2/json/"):
            raise PveError(501, f"Method '{method} {path}' not implemented")
        api_path = path[len("/api2/json"):].rstrip("/") or "/"
        found = self.schema.route(api_path)
        if found is None or method not in found[0].info:
            raise PveError(501, f"Method '{method} {api_path}' not implemented")
        route, path_params = found
        path_params = {k: unquote(v) for k, v in path_params.items()}  # a volid's "/" comes as %2F
        api_path = unquote(api_path)
        info = route.info[method]
        principal = self._authenticate(method, route.path, info, headers)
        delay = self.latency.get(f"{method} {route.path}", 0.0)
        if delay:
            self._stopping.wait(delay)  # a slow synchronous call (outside the state lock)
        with self._lock:
            self.requests.append((method, api_path, dict(params)))
            all_params = {**params, **path_params}
            typed, errors = validate(info, all_params, strict_booleans=self.strict_booleans)
            if errors:
                raise PveError(400, "Parameter verification failed.", errors)
            if principal is not None:
                self._check_permissions(info.get("permissions") or {}, typed, principal)
            handler = HANDLERS.get((method, route.path))
            if handler is None:
                raise PveError(501, f"Method '{method} {api_path}' not implemented")
            if "node" in typed and typed["node"] not in self.nodes:
                raise _fail(f"hostname lookup '{typed['node']}' failed - failed to get address info "
                            f"for: {typed['node']}: Name or service not known")
            if typed.get("node") in self.offline_nodes:  # pveproxy cannot reach it
                raise PveError(595, "No route to host")
            self._advance()
            self._upload = upload
            try:
                return handler(self, typed, principal)
            finally:
                self._upload = None

    def _authenticate(self, method: str, path: str, info: dict, headers) -> Principal | None:
        perms = info.get("permissions") or {}
        if perms.get("user") == "world":
            return None
        auth = headers.get("Authorization") or ""
        cookie = headers.get("Cookie") or ""
        if auth.startswith("PVEAPIToken="):
            m = re.fullmatch(r"PVEAPIToken=([^!=\s]+![^=\s]+)[=:](\S+)", auth)
            entry = self._principals_by_token.get(m.group(1)) if m else None
            if entry is None or not secrets.compare_digest(entry[0], m.group(2)):
                self._unauthorized("Authentication failed!")
            if not info.get("allowtoken", 1):
                raise PveError(403, "Permission check failed (API tokens are not allowed here)")
            return entry[1]
        m = re.search(r"PVEAuthCookie=([^;]+)", cookie)
        if m:
            entry = self._tickets.get(unquote(m.group(1)))
            if entry is None or time.monotonic() - entry[2] > self.ticket_lifetime:
                self._unauthorized("Authentication failed!")  # unknown or expired ticket
            if method != "GET" and headers.get("CSRFPreventionToken") != entry[0]:
                self._unauthorized("Permission denied - invalid csrf token")
            return entry[1]
        self._unauthorized("No ticket")

    def _unauthorized(self, message: str):
        self._stopping.wait(self.auth_delay)  # pveproxy: "always delay unauthorized calls"
        raise PveError(401, message)

    def _check_permissions(self, perms: dict, params: dict, who: Principal) -> None:
        if perms.get("user") in ("all", "world") or "check" not in perms:
            return
        self._eval_check(perms["check"], params, who, noerr=False)

    def _eval_check(self, check: list, params: dict, who: Principal, noerr: bool) -> bool:
        kind = check[0]
        if kind == "and":
            return all(self._eval_check(c, params, who, noerr) for c in check[1:])
        if kind == "or":
            if any(self._eval_check(c, params, who, True) for c in check[1:]):
                return True
            if noerr:
                return False
            raise PveError(403, "Permission check failed")
        if kind == "perm":
            tmpl, privs, opts = check[1], check[2], check[3:]
            opt = dict(zip(opts[::2], opts[1::2]))
            if "require_param" in opt and opt["require_param"] not in params:
                return False
            try:
                path = re.sub(r"\{(\w+)\}", lambda m: str(params[m.group(1)]), tmpl)
            except KeyError:
                return False
            have = who.privs_at(path)
            if have is ALL:
                return True
            if opt.get("any"):
                if any(p in have for p in privs):
                    return True
                if noerr:
                    return False
                raise PveError(403, f"Permission check failed ({path}, {'|'.join(privs)})")
            for p in privs:
                if p not in have:
                    if noerr:
                        return False
                    raise PveError(403, f"Permission check failed ({path}, {p})")
            return True
        return True  # userid-param, userid-group, ...: not modelled

    # --- state helpers -----------------------------------------------------------------------

    def _advance(self) -> None:
        now = time.monotonic()
        for vm in self.vms.values():
            if vm.hold_lock and vm.hold_lock[1] <= now:
                vm.hold_lock = None
        for task in sorted((t for t in self.tasks.values() if not t.done), key=lambda t: t.end):
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

    def _vm(self, node: str, vmid: int) -> VmState:
        vm = self.vms.get(vmid)
        if vm is None or vm.node != node:
            raise _fail(f"Configuration file 'nodes/{node}/qemu-server/{vmid}.conf' does not exist")
        return vm

    @staticmethod
    def _lock_of(vm: VmState) -> str | None:
        if vm.hold_lock:
            return vm.hold_lock[0]
        return vm.config.get("lock")

    def _check_lock(self, vm: VmState) -> None:
        lock = self._lock_of(vm)
        if lock:
            raise _fail(f"VM is locked ({lock})")

    def _new_mac(self) -> str:
        n = next(self._macs)
        return f"BC:24:11:{(n >> 16) & 0xFF:02X}:{(n >> 8) & 0xFF:02X}:{n & 0xFF:02X}"

    def _task(self, node: str, ttype: str, tid: object, who: Principal | None, seconds: float,
              *, on_ok=None, on_fail=None, error: str | None = None, start_delay: float = 0.0,
              log: list[str] | None = None, flock: VmState | None = None) -> str:
        """A worker task. With `flock`, the task holds that VM's flock while it runs; if another
        holder keeps it longer than flock_timeout, the task fails with PVE's `got timeout`."""
        now = time.monotonic()
        pid = next(self._pids)
        starttime = int(time.time())
        user = who.userid if who else "root@pam"
        upid = f"UPID:{node}:{pid:08X}:{pid * 7:08X}:{starttime:08X}:{ttype}:{tid}:{user}:"
        if flock is not None and error is None:
            wait = max(0.0, flock.flock_until - now - start_delay)
            if wait > self.flock_timeout:
                error = _flock_error(flock.vmid)
                start_delay, seconds = start_delay + self.flock_timeout, 0.0
            else:
                start_delay += wait
        end = now + start_delay + seconds
        queued = self._failures.get(ttype)
        if error is None and queued:
            error = queued.pop(0)
            end = now + start_delay + seconds / 2  # fails half-way
        if flock is not None:
            flock.flock_until = max(flock.flock_until, end)
        self.tasks[upid] = Task(upid, node, ttype, str(tid), user, pid, pid * 7, starttime, now, end,
                                error=error, log=list(log or []), on_ok=on_ok, on_fail=on_fail)
        return upid

    def _flock_sync(self, vm: VmState) -> None:
        """A synchronous call takes the VM's flock: wait (state lock released) up to flock_timeout."""
        wait = vm.flock_until - time.monotonic()
        if wait <= 0:
            return
        self._lock.release()
        try:
            self._stopping.wait(min(wait, self.flock_timeout))
        finally:
            self._lock.acquire()
        self._advance()
        if vm.flock_until > time.monotonic():
            raise _fail(_flock_error(vm.vmid))

    def _add_volume(self, node: str, volid: str, content: str, fmt: str, size: int, vmid: int | None,
                    *, parent: str | None = None, file: Path | None = None, external: bool = False) -> Volume:
        storage = self.storages[volid.split(":", 1)[0]]
        key = ("" if storage.shared else node, volid)
        vol = Volume(volid, key[0], content, fmt, size, vmid, parent, file, external)
        self.volumes[key] = vol
        return vol

    def _volume(self, node: str, volid: str) -> Volume | None:
        storage = self.storages.get(volid.split(":", 1)[0])
        if storage is None:
            return None
        return self.volumes.get(("" if storage.shared else node, volid))

    def _drop_volume(self, vol: Volume) -> None:
        self.volumes.pop((vol.node, vol.volid), None)
        if vol.file is not None and not vol.external:
            vol.file.unlink(missing_ok=True)

    def _vm_volumes(self, vm: VmState) -> list[Volume]:
        return [v for v in self.volumes.values() if v.vmid == vm.vmid and v.node in ("", vm.node)]

    def _file_for(self, node: str, volid: str, suffix: str = "") -> Path:
        """Where the data of a volume lives on this machine (QEMU backing and uploads)."""
        d = self._data_dir / node / volid.split(":", 1)[0]
        d.mkdir(parents=True, exist_ok=True)
        return d / (volid.split(":", 1)[1].replace("/", "_") + suffix)

    def _storage_start(self, storage: str, seconds: float) -> float | None:
        """Earliest delay (from now) at which a clone may hold the storage lock, or None when the
        wait would exceed storage_lock_timeout."""
        now = time.monotonic()
        self._storage_busy = [b for b in self._storage_busy if b[2] > now]
        busy = [(s, e) for st, s, e in self._storage_busy if st == storage]
        for t in sorted({now, *(e for _, e in busy)}):
            overlapping = sum(1 for s, e in busy if s < t + seconds and e > t)
            if overlapping < self.storage_slots:
                if t - now > self.storage_lock_timeout:
                    return None
                self._storage_busy.append((storage, t, t + seconds))
                return t - now
        return None

    def _digest(self, vm: VmState) -> str:
        return hashlib.sha1(json.dumps(vm.config, sort_keys=True).encode()).hexdigest()

    def _normalise_net(self, text: str) -> str:
        fmt = self.schema.param_schema("/nodes/{node}/qemu/{vmid}/config", "PUT", "net0")["format"]
        _errs, vals = parse_property_string(fmt, text)
        model = vals.pop("model")
        mac = vals.pop("macaddr", None) or self._new_mac()
        rest = ",".join(f"{k}={v}" for k, v in vals.items())
        return f"{model}={mac}" + (f",{rest}" if rest else "")

    def _ip_config(self, vm: VmState) -> tuple[str, int, str]:
        """(address, prefix, gateway) the guest gets: ipconfig0's static address (cloud-init), else
        the bridge's DHCP answer."""
        ipconf = str(vm.config.get("ipconfig0", "ip=dhcp"))
        m = re.search(r"(?:^|,)ip=([0-9.]+)/(\d+)", ipconf)
        gw = re.search(r"(?:^|,)gw=([0-9.]+)", ipconf)
        if m:
            return m.group(1), int(m.group(2)), gw.group(1) if gw else ""
        if self.backing is not None:
            return vm.dhcp_ip, self.backing.prefix, self.backing.gateway
        return vm.dhcp_ip, 24, ""


# --- handlers -----------------------------------------------------------------------------------

HANDLERS: dict[tuple[str, str], Callable] = {}


def handler(method: str, path: str):
    def deco(fn):
        HANDLERS[(method, path)] = fn
        return fn
    return deco


@handler("GET", "/version")
def _version(emu: PveEmulator, p, who):
    return {"version": VERSIONS[emu.version], "release": emu.version, "repoid": "0a1b2c3d"}


@handler("POST", "/access/ticket")
def _ticket(emu: PveEmulator, p, who):
    entry = emu._users.get(p["username"])
    renew = emu._tickets.get(p["password"])  # renewal: the current ticket as the password
    if renew is not None and renew[1].userid == p["username"] \
            and time.monotonic() - renew[2] <= emu.ticket_lifetime:
        entry = (p["password"], renew[1])
    if entry is None or not secrets.compare_digest(entry[0], p["password"]):
        emu._lock.release()
        try:
            emu._unauthorized("authentication failure")
        finally:
            emu._lock.acquire()
    ticket = f"PVE:{p['username']}:{int(time.time()):08X}::{secrets.token_hex(16)}"
    csrf = f"{int(time.time()):08X}:{secrets.token_hex(12)}"
    emu._tickets[ticket] = (csrf, entry[1], time.monotonic())
    return {"ticket": ticket, "CSRFPreventionToken": csrf, "username": p["username"], "cap": {}}


@handler("GET", "/cluster/nextid")
def _nextid(emu: PveEmulator, p, who):
    if "vmid" in p:
        if p["vmid"] in emu.vms:
            raise PveError(400, "Parameter verification failed.", {"vmid": f"VM {p['vmid']} already exists"})
        vmid = p["vmid"]
    else:
        now = time.monotonic()
        vmid = next(i for i in itertools.count(100)
                    if i not in emu.vms or now - emu.vms[i].created_at < emu.nextid_lag)
    if emu._steal > 0:  # someone else creates it right after we answered
        emu._steal -= 1
        emu.vms[vmid] = VmState(vmid, emu.node, {"name": f"someone-else-{vmid}", "memory": 512})
    return str(vmid)  # a JSON string, although the schema says integer


def _vm_summary(emu: PveEmulator, vm: VmState) -> dict:
    entry = {"vmid": vm.vmid, "name": vm.config.get("name", f"VM {vm.vmid}"),
             "status": "running" if vm.running else "stopped",
             "template": 1 if vm.config.get("template") else 0,
             "maxmem": int(str(vm.config.get("memory", 512)).split("=")[-1]) * 1024 * 1024,
             "cpus": int(vm.config.get("cores", 1)) * int(vm.config.get("sockets", 1)),
             "uptime": int(time.monotonic() - vm.booted_at) if vm.running and vm.booted_at else 0}
    lock = emu._lock_of(vm)
    if lock:
        entry["lock"] = lock
    if vm.config.get("tags"):
        entry["tags"] = vm.config["tags"]
    return entry


def _node_entry(emu: PveEmulator, n: str) -> dict:
    if n in emu.offline_nodes:
        return {"id": f"node/{n}", "type": "node", "node": n, "status": "offline"}
    used = sum(_memory_mib(v) * 1024 * 1024 for v in emu.vms.values() if v.node == n and v.running)
    return {"id": f"node/{n}", "type": "node", "node": n, "status": "online", "maxcpu": 8, "cpu": 0.02,
            "maxmem": emu.node_maxmem, "mem": 2 * 1024**3 + used, "uptime": 86400, "level": ""}


def _memory_mib(vm: VmState) -> int:
    return int(str(vm.config.get("memory", 512)).split("=")[-1])


@handler("GET", "/cluster/resources")
def _resources(emu: PveEmulator, p, who):
    out = []
    if p.get("type") in (None, "vm"):
        for vm in sorted(emu.vms.values(), key=lambda v: v.vmid):
            entry = _vm_summary(emu, vm)
            entry.update({"id": f"qemu/{vm.vmid}", "type": "qemu", "node": vm.node,
                          "maxcpu": entry.pop("cpus")})
            out.append(entry)
    if p.get("type") in (None, "node"):
        out += [_node_entry(emu, n) for n in emu.nodes]
    if p.get("type") in (None, "storage"):
        for n in emu.nodes:
            out += [{"id": f"storage/{n}/{st.name}", "type": "storage", "node": n, "storage": st.name,
                     "plugintype": st.type, "content": ",".join(sorted(st.content)), "shared": int(st.shared),
                     "status": "available"} for st in emu.storages.values()]
    return out


@handler("GET", "/nodes")
def _nodes(emu: PveEmulator, p, who):
    return [_node_entry(emu, n) for n in emu.nodes]


@handler("GET", "/nodes/{node}/qemu")
def _list(emu: PveEmulator, p, who):
    return [_vm_summary(emu, vm) for vm in emu.vms.values() if vm.node == p["node"]]


def _disk_keys(cfg: dict) -> list[str]:
    return [k for k in cfg if re.fullmatch(r"(scsi|virtio|sata|ide|efidisk|tpmstate)\d+", k)
            and ":" in str(cfg[k]) and "media=cdrom" not in str(cfg[k])]


@handler("POST", "/nodes/{node}/qemu/{vmid}/clone")
def _clone(emu: PveEmulator, p, who):
    node, vmid, newid = p["node"], p["vmid"], p["newid"]
    src = emu._vm(node, vmid)
    if newid in emu.vms:
        raise _fail(f"unable to create VM {newid}: config file already exists")
    emu._check_lock(src)
    is_tmpl = bool(src.config.get("template"))
    full = p.get("full", 0 if is_tmpl else 1)
    src_disk = str(src.config.get("scsi0", "")).split(",")[0]
    src_storage = emu.storages[src_disk.split(":", 1)[0]]
    if not full:
        if not is_tmpl:
            where = "for drive 'scsi0'" if emu.version == "7.4" else "(scsi0)"
            raise _fail(f"Linked clone feature is not supported for '{src_disk}' {where}")
        for key in ("storage", "format"):
            if key in p:
                raise _fail(f"parameter '{key}' not allowed for linked clones")
    target = p.get("target", node)
    if target != node:
        if target not in emu.nodes:
            raise _fail(f"no such cluster node '{target}'")
        if target in emu.offline_nodes:
            raise _fail(f"target node '{target}' is not online")
        if not src_storage.shared:
            raise _fail(f"can't clone VM to node '{target}' (VM uses local storage)")
    storage = p.get("storage", src_storage.name)
    if storage not in emu.storages:
        raise _fail(f"storage '{storage}' does not exist")
    if "images" not in emu.storages[storage].content:
        raise PveError(400, "Parameter verification failed.",
                       {"storage": f"storage '{storage}' does not support vm images"})
    if full and target != node and not emu.storages[storage].shared:
        raise _fail(f"can't clone VM to node '{target}' (VM uses local storage)")
    cfg = {k: v for k, v in copy.deepcopy(src.config).items() if k not in ("template", "lock")}
    cfg["name"] = p.get("name", f"Copy-of-VM-{src.config.get('name', vmid)}")
    if "description" in p:
        cfg["description"] = p["description"]
    for key in [k for k in cfg if re.fullmatch(r"net\d+", k)]:
        model = cfg[key].split(",")[0].split("=")[0]
        cfg[key] = re.sub(r"^[^,]+", f"{model}={emu._new_mac()}", cfg[key])
    disk_vol = f"{storage}:vm-{newid}-disk-0"
    cfg["scsi0"] = f"{disk_vol},size=4G" if full else f"{src_disk}/vm-{newid}-disk-0,size=4G"
    ci_storage = storage if full else src_storage.name
    cfg["ide2"] = f"{ci_storage}:vm-{newid}-cloudinit,media=cdrom"
    cfg["smbios1"] = f"uuid={_uuid()}"
    cfg["lock"] = "clone"
    new = VmState(newid, target, cfg, linked_base=None if full else vmid)
    emu.vms[newid] = new
    seconds = emu.full_clone_seconds if full else emu.task_seconds["qmclone"]
    delay = emu._storage_start(storage, seconds)
    error = None
    if delay is None:
        delay, seconds = 0.0, emu.storage_lock_timeout
        error = f"clone failed: can't lock file '/var/lock/pve-manager/pve-storage-{storage}' - got timeout"

    def ok():
        base = emu._volume(node, src_disk)
        vol_name = disk_vol if full else f"{src_disk}/vm-{newid}-disk-0"
        vol = emu._add_volume(target, vol_name, "images", "qcow2", 4 * 1024**3, newid,
                              parent=None if full else src_disk)
        emu._add_volume(target, f"{ci_storage}:vm-{newid}-cloudinit", "images", "raw", 4 * 1024**2, newid)
        if emu.backing is not None and base is not None and base.file is not None:
            vol.file = emu._file_for(target, vol.volid, ".qcow2")
            emu.backing.make_disk(vol.file, base.file, linked=not full)
        new.config.pop("lock", None)

    def failed():  # PVE removes the half-made clone: config and disks
        if emu.vms.get(newid) is new:
            for v in emu._vm_volumes(new):
                emu._drop_volume(v)
            del emu.vms[newid]

    kind = "full" if full else "linked"
    return emu._task(node, "qmclone", vmid, who, seconds, on_ok=ok, on_fail=failed, error=error,
                     start_delay=delay,  # the new VM is guarded by `lock: clone`, not the flock
                     log=[f"create {kind} clone of drive scsi0 ({src_disk})"])


IMPORT_EXT = re.compile(r"\.(ova|qcow2|raw|vmdk)$")


def _import_source(emu: PveEmulator, node: str, source: str, who: Principal | None) -> Volume:
    """The volume `import-from=` names, with PVE's checks (qemu-server's import-from handling)."""
    if source.startswith("/"):
        if who is None or who.userid != "root@pam":  # tokens are never root
            raise PveError(403, "Permission check failed (Only root can pass arbitrary filesystem paths.)")
        for vol in emu.volumes.values():
            if vol.node in ("", node) and _volume_path(emu, vol) == source:
                return vol
        raise _fail(f"could not get size of '{source}'")
    vol = emu._volume(node, source)
    if vol is None:
        raise _fail(f"no such volume '{source}'")
    if vol.content not in ("images", "import"):
        raise PveError(400, "Parameter verification failed.",
                       {"scsi0": f"{source} has wrong type '{vol.content}' - needs to be 'images' or 'import'"})
    return vol


@handler("POST", "/nodes/{node}/qemu")
def _create(emu: PveEmulator, p, who):
    node, vmid = p["node"], p["vmid"]
    if vmid in emu.vms:
        raise _fail(f"unable to create VM {vmid} - VM {vmid} already exists on node '{emu.vms[vmid].node}'")
    skip = {"node", "vmid", "start", "storage", "pool", "unique", "force", "archive", "live-restore", "bwlimit"}
    cfg = {}
    imports: list[tuple[str, str, Volume | None]] = []  # (config key, new volid, source)
    for key, value in p.items():
        if key in skip:
            continue
        if re.fullmatch(r"net\d+", key):
            value = emu._normalise_net(value)
        elif re.fullmatch(r"(scsi|virtio|sata|ide)\d+", key) and ":" in str(value):
            parts = str(value).split(",")
            src = next((x.split("=", 1)[1] for x in parts[1:] if x.startswith("import-from=")), None)
            stor, _, size = parts[0].partition(":")
            if src is not None and size != "0":
                raise PveError(400, "Parameter verification failed.",
                               {key: "'import-from' requires special syntax - use <storage ID>:0,import-from=<source>"})
            if size == "cloudinit":
                volid = f"{stor}:vm-{vmid}-cloudinit"
                value = f"{volid},media=cdrom"
                imports.append((key, volid, None))
            elif re.fullmatch(r"\d+", size):  # STOR:SIZE[,import-from=SRC]: allocate (and import)
                if stor not in emu.storages or "images" not in emu.storages[stor].content:
                    raise _fail(f"storage '{stor}' does not support vm images")
                source = _import_source(emu, node, src, who) if src is not None else None
                volid = f"{stor}:vm-{vmid}-disk-{key[-1]}"
                rest = ",".join(x for x in parts[1:] if not x.startswith("import-from="))
                value = volid + (f",{rest}" if rest else "")  # import-from is not stored
                imports.append((key, volid, source))
        cfg[key] = value
    cfg["lock"] = "create"
    vm = VmState(vmid, node, cfg)
    emu.vms[vmid] = vm

    def ok():
        for _key, volid, source in imports:
            size = source.size if source is not None else (4 * 1024**2 if volid.endswith("cloudinit") else 1024**3)
            fmt = "raw" if volid.endswith("cloudinit") else "qcow2"
            vol = emu._add_volume(node, volid, "images", fmt, size, vmid)
            if source is not None and source.file is not None:
                vol.file = emu._file_for(node, volid, ".qcow2")
                _copy_file(source.file, vol.file)
        vm.config.pop("lock", None)
        if p.get("start"):
            vm.running, vm.booted_at = True, time.monotonic()

    def failed():
        if emu.vms.get(vmid) is vm:
            del emu.vms[vmid]

    log = [f"importing disk '{src.volid}' to VM {vmid} ..." for _k, _v, src in imports if src is not None]
    return emu._task(node, "qmcreate", vmid, who, emu.task_seconds["qmcreate"], on_ok=ok, on_fail=failed,
                     flock=vm, log=log)


def _copy_file(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # the emulator never writes a source again: a hard link is a copy
    except OSError:
        shutil.copyfile(src, dst)


@handler("POST", "/nodes/{node}/qemu/{vmid}/template")
def _template(emu: PveEmulator, p, who):
    vm = emu._vm(p["node"], p["vmid"])
    emu._check_lock(vm)
    if vm.config.get("template"):
        raise _fail("you can't convert a template to a template")
    if vm.running:
        raise _fail("you can't convert a VM to template if VM is running")

    def ok():
        for vol in [v for v in emu._vm_volumes(vm) if f"vm-{vm.vmid}-disk-" in v.volid]:
            emu.volumes.pop((vol.node, vol.volid))
            vol.volid = vol.volid.replace(f"vm-{vm.vmid}-disk-", f"base-{vm.vmid}-disk-")
            emu.volumes[(vol.node, vol.volid)] = vol
        for key, value in list(vm.config.items()):
            if isinstance(value, str) and f"vm-{vm.vmid}-disk-" in value:
                vm.config[key] = value.replace(f"vm-{vm.vmid}-disk-", f"base-{vm.vmid}-disk-")
        vm.config["template"] = 1

    return emu._task(p["node"], "qmtemplate", vm.vmid, who, emu.task_seconds["qmtemplate"], on_ok=ok, flock=vm)


@handler("GET", "/nodes/{node}/qemu/{vmid}/config")
def _config_get(emu: PveEmulator, p, who):
    vm = emu._vm(p["node"], p["vmid"])
    out = dict(vm.config)
    if vm.hold_lock:
        out["lock"] = vm.hold_lock[0]
    out["digest"] = emu._digest(vm)
    return out


def _apply_config(emu: PveEmulator, vm: VmState, p: dict) -> None:
    changes = {k: v for k, v in p.items() if k not in ("node", "vmid", "digest", "delete", "skiplock",
                                                      "revert", "force", "background_delay")}
    if not changes and "delete" not in p:
        raise _fail("no options specified")
    if "digest" in p and p["digest"] != emu._digest(vm):
        raise _fail("checksum mismatch (file change by other user?)")
    if p.get("skiplock"):
        raise PveError(500, "Only root may use this option.")
    emu._flock_sync(vm)
    emu._check_lock(vm)
    for key in re.split(r"[,;\s]+", p.get("delete", "")):
        if key:
            vm.config.pop(key, None)
    for key, value in changes.items():
        if re.fullmatch(r"net\d+", key):
            value = emu._normalise_net(value)
        vm.config[key] = value


@handler("PUT", "/nodes/{node}/qemu/{vmid}/config")
def _config_put(emu: PveEmulator, p, who):
    _apply_config(emu, emu._vm(p["node"], p["vmid"]), p)
    return None


@handler("POST", "/nodes/{node}/qemu/{vmid}/config")
def _config_post(emu: PveEmulator, p, who):
    vm = emu._vm(p["node"], p["vmid"])
    _apply_config(emu, vm, p)  # the lock check runs before the fork: sync 500
    return emu._task(p["node"], "qmconfig", vm.vmid, who, emu.task_seconds["qmconfig"], flock=vm)


@handler("GET", "/nodes/{node}/qemu/{vmid}/status/current")
def _status(emu: PveEmulator, p, who):
    vm = emu._vm(p["node"], p["vmid"])
    out = _vm_summary(emu, vm)
    out.update({"qmpstatus": out["status"], "ha": {"managed": int(vm.ha_managed)}})
    if _agent_enabled(vm):
        out["agent"] = 1
    if not out["template"]:
        del out["template"]
    if vm.running:
        out["pid"] = vm.guest.pid if vm.guest is not None else 4000 + vm.vmid
    return out


@handler("POST", "/nodes/{node}/qemu/{vmid}/status/start")
def _start(emu: PveEmulator, p, who):
    vm = emu._vm(p["node"], p["vmid"])
    error = None  # all checks run inside the worker
    if vm.config.get("template"):
        error = "you can't start a vm if it's a template"
    elif vm.running:
        error = f"VM {vm.vmid} already running"
    elif emu._lock_of(vm):
        error = f"VM is locked ({emu._lock_of(vm)})"

    def ok():
        if not vm.dhcp_ip:
            vm.dhcp_ip = emu.backing.dhcp_address(vm.vmid) if emu.backing is not None else \
                f"10.99.{vm.vmid // 250 % 250}.{vm.vmid % 250 + 2}"
        if emu.backing is not None:
            disk = emu._volume(vm.node, str(vm.config.get("scsi0", "")).split(",")[0])
            if disk is None or disk.file is None:
                raise _fail(f"start failed: no disk data for VM {vm.vmid} (scsi0)")
            ip, prefix, gw = emu._ip_config(vm)
            try:
                vm.guest = emu.backing.start(vm.vmid, vm.config, disk.file, ip=ip, prefix=prefix, gateway=gw)
            except Exception as exc:  # QEMU refused: PVE reports it in the task
                raise _fail(f"start failed: {exc}") from None
        vm.running, vm.booted_at = True, time.monotonic()

    return emu._task(p["node"], "qmstart", vm.vmid, who, emu.task_seconds["qmstart"], on_ok=ok, error=error,
                     flock=vm)


def _power_off(emu: PveEmulator, vm: VmState) -> None:
    if vm.guest is not None:
        emu.backing.stop(vm.guest)
        vm.guest = None
    vm.running, vm.booted_at = False, None


@handler("POST", "/nodes/{node}/qemu/{vmid}/status/stop")
def _stop(emu: PveEmulator, p, who):
    vm = emu._vm(p["node"], p["vmid"])
    error = f"VM is locked ({emu._lock_of(vm)})" if emu._lock_of(vm) and not p.get("skiplock") else None
    return emu._task(p["node"], "qmstop", vm.vmid, who, emu.task_seconds["qmstop"],
                     on_ok=lambda: _power_off(emu, vm), error=error, flock=vm)


@handler("DELETE", "/nodes/{node}/qemu/{vmid}")
def _destroy(emu: PveEmulator, p, who):
    vm = emu._vm(p["node"], p["vmid"])
    if vm.running:
        raise _fail(f"VM {vm.vmid} is running - destroy failed")
    if vm.ha_managed and not p.get("purge"):
        raise _fail(f"unable to remove VM {vm.vmid} - used in HA resources and purge parameter not set.")
    error = None
    if emu._lock_of(vm) and not p.get("skiplock"):
        error = f"VM is locked ({emu._lock_of(vm)})"
    elif vm.config.get("template") and any(v.linked_base == vm.vmid for v in emu.vms.values()):
        base = str(vm.config.get("scsi0", "")).split(",")[0]
        error = f"base volume '{base}' is still in use by linked cloned"

    def ok():
        if emu._lock_of(vm):  # locked while the destroy task ran
            raise _fail(f"VM is locked ({emu._lock_of(vm)})")
        for vol in emu._vm_volumes(vm):
            emu._drop_volume(vol)
        emu.vms.pop(vm.vmid, None)

    return emu._task(p["node"], "qmdestroy", vm.vmid, who, emu.task_seconds["qmdestroy"], on_ok=ok,
                     error=error, flock=vm)


# --- storage ------------------------------------------------------------------------------------

UPLOAD_EXT = {"iso": re.compile(r"\.(iso|img)$"), "vztmpl": re.compile(r"\.tar\.(gz|xz|zst)$"),
              "import": IMPORT_EXT}
CONTENT_DIRS = {"iso": "template/iso", "vztmpl": "template/cache", "import": "import", "images": "images"}


def _storage_of(emu: PveEmulator, name: str) -> Storage:
    st = emu.storages.get(name)
    if st is None:
        raise _fail(f"storage '{name}' does not exist")
    return st


def _volume_path(emu: PveEmulator, vol: Volume) -> str:
    st = emu.storages[vol.storage]
    if st.type == "dir" and st.path:
        sub = CONTENT_DIRS.get(vol.content, "images")
        name = vol.name.split("/", 1)[1] if "/" in vol.name else vol.name
        return f"{st.path}/{sub}/{name}"
    if st.type == "lvmthin":
        return f"/dev/pve/{vol.name}"
    return f"/dev/{st.name}/{vol.name}"


def _volume_entry(emu: PveEmulator, vol: Volume) -> dict:
    out = {"volid": vol.volid, "content": vol.content, "format": vol.format, "size": vol.size,
           "ctime": vol.ctime}
    if vol.vmid is not None:
        out["vmid"] = vol.vmid
    if vol.parent:
        out["parent"] = vol.parent.split(":", 1)[1]
    return out


@handler("GET", "/nodes/{node}/storage")
def _storage_list(emu: PveEmulator, p, who):
    want = set(filter(None, re.split(r"[,;\s]+", p.get("content", ""))))
    out = []
    for st in emu.storages.values():
        if want and not want & st.content:
            continue
        out.append({"storage": st.name, "type": st.type, "content": ",".join(sorted(st.content)),
                    "active": 1, "enabled": 1, "shared": int(st.shared), "total": 100 * 1024**3,
                    "used": 10 * 1024**3, "avail": 90 * 1024**3})
    return out


@handler("GET", "/nodes/{node}/storage/{storage}/content")
def _content_list(emu: PveEmulator, p, who):
    st = _storage_of(emu, p["storage"])
    return [_volume_entry(emu, v) for v in emu.volumes.values()
            if v.storage == st.name and v.node in ("", p["node"])
            and p.get("content") in (None, v.content)]


def _content_volume(emu: PveEmulator, p) -> Volume:
    st = _storage_of(emu, p["storage"])
    volid = p["volume"] if ":" in p["volume"] else f"{st.name}:{p['volume']}"
    vol = emu._volume(p["node"], volid)
    if vol is None or vol.storage != st.name:
        raise _fail(f"volume '{volid}' does not exist")
    return vol


@handler("GET", "/nodes/{node}/storage/{storage}/content/{volume}")
def _content_get(emu: PveEmulator, p, who):
    vol = _content_volume(emu, p)
    return {"path": _volume_path(emu, vol), "size": vol.size, "used": vol.size, "format": vol.format}


@handler("DELETE", "/nodes/{node}/storage/{storage}/content/{volume}")
def _content_delete(emu: PveEmulator, p, who):
    vol = _content_volume(emu, p)
    if who is not None and "Datastore.Allocate" not in _privs(who, f"/storage/{vol.storage}"):
        raise PveError(403, f"Permission check failed (/storage/{vol.storage}, Datastore.Allocate)")
    if vol.vmid is not None and vol.vmid in emu.vms:
        raise _fail(f"unable to delete '{vol.volid}' - volume is used by VM {vol.vmid}")
    return emu._task(p["node"], "imgdel", "", who, emu.task_seconds["imgdel"],
                     on_ok=lambda: emu._drop_volume(vol))


def _privs(who: Principal, path: str) -> set[str] | frozenset:
    have = who.privs_at(path)
    return frozenset({"Datastore.Allocate", "Datastore.AllocateTemplate", "Datastore.AllocateSpace",
                      "Datastore.Audit"}) if have is ALL else have


@handler("POST", "/nodes/{node}/storage/{storage}/upload")
def _upload(emu: PveEmulator, p, who):
    st = _storage_of(emu, p["storage"])
    upload = emu._upload
    if upload is None:
        raise PveError(400, "Parameter verification failed.", {"filename": "no file uploaded"})
    if p["node"] != emu.node:  # uploads are never proxied to another node
        raise _fail("unable to proxy file uploads")
    content = p["content"]
    if content not in st.content:
        raise _fail(f"storage '{st.name}' does not support '{content}' content")
    name = p["filename"]
    if not re.fullmatch(r"[-\w.]+", name) or not UPLOAD_EXT[content].search(name):
        msg = "invalid filename or wrong extension" if content == "import" else "wrong file extension"
        raise PveError(400, "Parameter verification failed.", {"filename": msg})
    volid = f"{st.name}:{content}/{name}"  # local:iso/x.img, local:import/x.qcow2
    if emu._volume(p["node"], volid) is not None:
        raise _fail(f"refusing to override existing file '{name}'")  # wording approximated
    tmp, size = upload
    path = tmp + ".task"
    os.replace(tmp, path)  # the task owns the file now (the HTTP layer removes what nobody took)
    fmt = name.rsplit(".", 1)[-1] if content == "import" else content

    def ok():
        if p.get("checksum"):
            algo = p.get("checksum-algorithm", "sha256")
            with open(path, "rb") as fh:
                got = hashlib.file_digest(fh, algo).hexdigest()
            if got != p["checksum"].lower():
                raise _fail(f"checksum mismatch: got '{got}' != expected '{p['checksum']}'")
        vol = emu._add_volume(p["node"], volid, content, fmt, size, None)
        vol.file = emu._file_for(p["node"], volid)
        os.replace(path, vol.file)

    def failed():
        Path(path).unlink(missing_ok=True)

    return emu._task(p["node"], "imgcopy", "", who, emu.task_seconds["imgcopy"], on_ok=ok, on_fail=failed,
                     log=[f"starting file import from: {path}", f"target node: {p['node']}",
                          f"target file: {_volume_path(emu, Volume(volid, '', content, fmt, size))}",
                          f"file size is: {size}"])


def _task_of(emu: PveEmulator, p) -> Task:
    upid = p["upid"]
    if not re.fullmatch(r"UPID:[a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?:[0-9A-F]{8}:[0-9A-F]{8,9}:"
                        r"[0-9A-F]{8}:[^:\s]+:[^:\s]*:[^:\s]+:", upid):
        raise PveError(400, "Parameter verification failed.", {"upid": "unable to parse worker upid"})
    task = emu.tasks.get(upid)
    if task is None or task.node != p["node"]:
        raise PveError(400, "Parameter verification failed.", {"upid": "no such task"})
    return task


@handler("GET", "/nodes/{node}/tasks/{upid}/status")
def _task_status(emu: PveEmulator, p, who):
    t = _task_of(emu, p)
    out = {"upid": t.upid, "node": t.node, "pid": t.pid, "pstart": t.pstart, "starttime": t.starttime,
           "type": t.type, "id": t.id, "user": t.user.split("!")[0],
           "status": "stopped" if t.done else "running"}
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
    return [{"n": i + 1, "t": line} for i, line in enumerate(lines)][start:start + limit]


def _agent_enabled(vm: VmState) -> bool:
    value = str(vm.config.get("agent", "0"))
    first = value.split(",")[0]
    first = first.split("=", 1)[1] if first.startswith("enabled=") else first
    return first.lower() in ("1", "on", "yes", "true")


@handler("GET", "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces")
def _agent_ifaces(emu: PveEmulator, p, who):
    vm = emu._vm(p["node"], p["vmid"])
    if not _agent_enabled(vm):
        raise _fail("No QEMU guest agent configured")
    if not vm.running:
        raise _fail(f"VM {vm.vmid} is not running")
    now = time.monotonic()
    if emu.agent_delay is None or now < vm.booted_at + emu.agent_delay:
        raise _fail("QEMU guest agent is not running")
    if vm.guest is not None:  # ask the real guest, without holding the state lock meanwhile
        guest = vm.guest
        emu._lock.release()
        try:
            result = emu.backing.interfaces(guest)
        finally:
            emu._lock.acquire()
        if result is None:
            raise _fail("QEMU guest agent is not running")
        return {"result": result}
    mac = re.search(r"([0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){5})", vm.config.get("net0", ""))
    mac = mac.group(1).lower() if mac else "bc:24:11:00:00:00"
    static = re.search(r"(?:^|,)ip=[0-9.]+/", str(vm.config.get("ipconfig0", "")))
    addrs = [{"ip-address": "fe80::be24:11ff:fe00:1", "ip-address-type": "ipv6", "prefix": 64}]
    if static or now >= vm.booted_at + emu.agent_delay + emu.dhcp_delay:
        addrs.insert(0, {"ip-address": emu._ip_config(vm)[0], "ip-address-type": "ipv4", "prefix": 24})
    stats = {"rx-bytes": 1000, "rx-packets": 10, "tx-bytes": 900, "tx-packets": 9,
             "rx-errs": 0, "tx-errs": 0, "rx-dropped": 0, "tx-dropped": 0}
    return {"result": [
        {"name": "lo", "hardware-address": "00:00:00:00:00:00", "statistics": stats,
         "ip-addresses": [{"ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8},
                          {"ip-address": "::1", "ip-address-type": "ipv6", "prefix": 128}]},
        {"name": "docker0", "hardware-address": "02:42:ac:11:00:01", "statistics": stats,
         "ip-addresses": [{"ip-address": "172.17.0.1", "ip-address-type": "ipv4", "prefix": 16}]},
        {"name": "eth0", "hardware-address": mac, "statistics": stats, "ip-addresses": addrs},
    ]}


def _flock_error(vmid: int) -> str:
    return f"can't lock file '/var/lock/qemu-server/lock-{vmid}.conf' - got timeout"


def _uuid() -> str:
    h = secrets.token_hex(16)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# --- HTTP plumbing ------------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "pve-api-daemon/3.0"
    timeout = 30

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        pairs = parse_qsl(url.query, keep_blank_values=True)
        ctype = self.headers.get("Content-Type", "")
        upload = None
        body = b""
        if ctype.startswith("multipart/form-data"):  # uploads: the file part streams to disk
            pairs, upload = self._multipart(ctype, length)
        elif length:
            body = self.rfile.read(length)
        if body and "application/json" in ctype:
            for k, v in json.loads(body).items():
                if isinstance(v, bool):
                    v = "1" if v else "0"  # JSON true/false are real booleans in a JSON body
                pairs.append((k, v if isinstance(v, list) else str(v)))
        elif body:
            pairs += parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
        params: dict[str, object] = {}
        for k, v in pairs:
            if k in params:  # repeated keys become arrays
                prev = params[k]
                params[k] = (prev if isinstance(prev, list) else [prev]) + [v]
            else:
                params[k] = v
        status, reason, payload = self.server.emulator.handle(method, url.path, params, self.headers,
                                                              upload)
        if upload is not None:
            Path(upload[0]).unlink(missing_ok=True)  # not taken by a successful upload task
        data = json.dumps(payload).encode()
        self.send_response(status, reason)
        self.send_header("Content-Type", "application/json;charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "max-age=0")
        self.end_headers()
        self.wfile.write(data)


    def _multipart(self, ctype: str, length: int) -> tuple[list[tuple[str, str]], tuple[str, int] | None]:
        boundary = parse_options_header(ctype)[1].get("boundary", "")
        pairs: list[tuple[str, str]] = []
        upload = None
        spool = self.server.emulator._data_dir
        for part in MultipartParser(self.rfile, boundary, length, spool_limit=1024 * 1024,
                                    memory_limit=1024 * 1024):
            if part.filename:  # PVE takes the file's name as the `filename` parameter
                fd, tmp = tempfile.mkstemp(prefix="upload-", dir=spool)
                os.close(fd)
                part.save_as(tmp)
                upload = (tmp, part.size)
                pairs.append((part.name, part.filename))
            else:
                pairs.append((part.name, part.value))
            part.close()
        return pairs, upload


class _Server(ThreadingMixIn, HTTPServer):
    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, addr, emulator: PveEmulator, ctx: ssl.SSLContext):
        self.emulator, self.ctx = emulator, ctx
        self._conns: set = set()
        self._conns_lock = threading.Lock()
        super().__init__(addr, _Handler)

    def finish_request(self, request, client_address) -> None:
        request.settimeout(10)
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and body are 2 writes
        try:
            tls = self.ctx.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return  # e.g. the client does not trust our CA
        with self._conns_lock:
            self._conns.add(tls)
        try:
            self.RequestHandlerClass(tls, client_address, self)
        except (OSError, ssl.SSLError):
            pass
        finally:
            with self._conns_lock:
                self._conns.discard(tls)
            try:
                tls.close()
            except OSError:
                pass

    def close_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request, client_address) -> None:
        pass
