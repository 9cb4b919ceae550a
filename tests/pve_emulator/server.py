"""A small Proxmox VE API emulator: a real HTTPS server that proxmoxer talks to over the network.

Every request goes through PVE's pipeline, in PVE's order (`PveEmulator.handle`): route (unknown
path/method: 501), authenticate (auth.py: API token header or ticket cookie + CSRF; 401 delayed like
pveproxy; tickets expire), validate parameters against the official schema of the chosen version
(schema.py: 400 `Parameter verification failed.`), check the schema's permission rule (403
`Permission check failed (/vms/100, VM.Clone)`), then run a hand-written handler. Errors put the
message in the HTTP reason phrase and send `{"data":null}` (9.1 adds `"message"`), like
pve-http-server.

The handlers, by job: cluster.py (version, nextid, resources, nodes and their status), vms.py (list,
clone, create with import-from, template, config, status, start, stop, destroy), agent.py
(network-get-interfaces), storage.py (storages, content, uploads), tasks.py (tasks and the VM flock:
state is advanced lazily, every request first completes the tasks whose end has passed, so no worker
threads exist besides the HTTP ones), auth.py (login). faults.py holds the fault switches,
transport.py the HTTP server. Everything else: 501.

Modelled state: nodes (online/offline: 595 for an offline node), storages (type, content types,
shared or node-local) and their volumes (disks of every VM, unused disks, uploads), per-VM config
locks and flocks (`can't lock file ... got timeout`), per-storage allocation locks, tasks, tickets.

With `backing=QemuBacking(...)` (qemu.py) every started VM is a real local QEMU guest of the
golden image: disks are real qcow2 files on the bus of their config key, `ipconfig0` reaches the
guest, the guest agent answers from the real guest. Without it, VMs are bookkeeping only.

Not modelled: pending config on running VMs, HA start/stop requests (an HA-managed VM only refuses
destroy without purge), snapshots, agent exec, migration, resize, allocating disks through config.
"""

from __future__ import annotations

import copy
import itertools
import shutil
import ssl
import tempfile
import threading
from pathlib import Path
from urllib.parse import unquote

# each registers its handlers; storage under another name: `storage` is a keyword argument below
from . import agent, auth, cluster, storage as _storage, tasks, vms  # noqa: F401
from .certs import CertSet
from .faults import FaultSwitches
from .schema import Schema, validate
from .state import ALL, HANDLERS, Principal, PveError, Storage, Task, VmState, Volume, fail
from .transport import Server


class PveEmulator(FaultSwitches):
    """Start with `with PveEmulator(version, certs) as emu:`; `emu.url` is the base URL.

    Scenario knobs (set before or during a test):
      task_seconds[type]  duration of qmclone/qmstart/qmstop/qmdestroy/qmconfig/qmcreate/imgcopy
      full_clone_seconds  duration of a full clone
      agent_delay         seconds after boot until the guest agent answers (None: never);
                          QEMU-backed: the agent answers once the real guest is up
      dhcp_delay          seconds after the agent until a DHCP address shows up
      auth_delay          pveproxy's 401 delay (3 s on real PVE)
      ticket_lifetime     seconds a login ticket is valid (2 h on PVE)
      strict_booleans     top-level booleans accept only 1/0 (real PVE); False = lenient
      node_maxmem, cpu_model, cpu_sockets, cpu_cores, cpu_threads, cpu_flags   what each node is
    and the fault switches of faults.py (flocks, locks, failing tasks, stolen VMIDs, latency,
    offline nodes, HA). Users and tokens: add_user()/add_token() with ACLs; add_storage(),
    add_template().
    """

    def __init__(
        self,
        version: str = "8.4",
        certs: CertSet | None = None,
        *,
        node: str = "pve1",
        nodes: tuple[str, ...] = ("pve1", "pve2"),
        storage: str = "local-lvm",
        auth_delay: float = 3.0,
        backing=None,
    ):
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
        self.task_seconds = {
            "qmclone": 0.3,
            "qmstart": 0.15,
            "qmstop": 0.1,
            "qmdestroy": 0.15,
            "qmconfig": 0.05,
            "qmcreate": 0.2,
            "qmtemplate": 0.1,
            "imgcopy": 0.1,
            "imgdel": 0.05,
        }
        self.full_clone_seconds = 0.6
        self.agent_delay: float | None = 0.2
        self.dhcp_delay = 0.1
        self.strict_booleans = True
        self.node_maxmem = 16 * 1024**3
        self.cpu_model = "Intel(R) Core(TM) i7-7500U CPU @ 2.70GHz"
        self.cpu_sockets, self.cpu_cores, self.cpu_threads = 1, 2, 4
        self.cpu_flags = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 vmx est tm2 ssse3"
        self._init_faults()
        self.vms: dict[int, VmState] = {}
        self.tasks: dict[str, Task] = {}
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, params) for assertions
        self._lock = threading.RLock()
        self._tokens: dict[str, tuple[str, Principal]] = {}
        self._users: dict[str, tuple[str, Principal]] = {}
        self._tickets: dict[str, tuple[str, Principal, float]] = {}
        self._storage_busy: list[tuple[str, float, float]] = []
        self._pids = itertools.count(0x1A2B3)
        self._macs = itertools.count(0x100)
        self._upload = None  # the file part of the multipart request being handled
        self._data_dir: Path | None = None
        self._stopping = threading.Event()
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self.add_user("root@pam", "rootpass", acl=ALL)

    @property
    def release(self) -> tuple[int, int]:
        major, minor = self.version.split(".")
        return int(major), int(minor)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> PveEmulator:
        self._data_dir = Path(tempfile.mkdtemp(prefix="pve-emu-", dir="/var/tmp"))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(self.certs.cert_file), str(self.certs.key_file))
        self._server = Server(("127.0.0.1", 0), self, ctx)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="pve-emulator", daemon=True
        )
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

    def __enter__(self) -> PveEmulator:
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

    def add_token(
        self, tokenid: str, secret: str, *, privsep: bool = True, acl: dict[str, set[str]] | object | None = None
    ) -> None:
        """tokenid is `user@realm!name`. With privsep the token has only `acl` (default: none);
        without, it has its user's privileges."""
        user = tokenid.split("!", 1)[0]
        if privsep:
            eff = acl if acl is not None else {}
        else:
            eff = self._users[user][1].acl if user in self._users else {}
        self._tokens[tokenid] = (secret, Principal(tokenid, eff))

    def add_storage(self, name: str, type_: str, content: set[str], *, shared: bool = False, path: str = "") -> None:
        self.storages[name] = Storage(name, type_, set(content), shared, path)

    def add_template(
        self,
        vmid: int = 9000,
        name: str = "debian12",
        node: str | None = None,
        memory: int = 1024,
        storage: str | None = None,
        disk: Path | None = None,
        description: str | None = None,
        tags: str | None = None,
    ) -> None:
        """A template VM whose disk is `disk` (e.g. the golden image; never deleted) or nothing;
        `description` as the lab's publish writes it (fixtures.lab_template_description) or not."""
        with self._lock:
            vms.add_template(self, vmid, name, node or self.node, memory, storage or self.storage, disk)
            if description is not None:
                self.vms[vmid].config["description"] = description
            if tags is not None:
                self.vms[vmid].config["tags"] = tags

    def vm_ids(self, include_templates: bool = False) -> list[int]:
        with self._lock:
            tasks.advance(self)
            return sorted(v.vmid for v in self.vms.values() if include_templates or not v.config.get("template"))

    def vm(self, vmid: int) -> VmState:
        with self._lock:
            tasks.advance(self)
            return copy.deepcopy(self.vms[vmid])

    def active_tasks(self) -> list[Task]:
        with self._lock:
            tasks.advance(self)
            return [t for t in self.tasks.values() if not t.done]

    def volume_ids(self, include_templates: bool = False) -> list[str]:
        """Every volume on the emulated cluster (disks, cloud-init drives, uploads)."""
        with self._lock:
            tasks.advance(self)
            tmpl = {v.vmid for v in self.vms.values() if v.config.get("template")}
            return sorted(
                v.volid for v in self.volumes.values() if include_templates or v.vmid is None or v.vmid not in tmpl
            )

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
        api_path = path[len("/api2/json") :].rstrip("/") or "/"
        found = self.schema.route(api_path)
        if found is None or method not in found[0].info:
            raise PveError(501, f"Method '{method} {api_path}' not implemented")
        route, path_params = found
        path_params = {k: unquote(v) for k, v in path_params.items()}  # a volid's "/" comes as %2F
        api_path = unquote(api_path)
        info = route.info[method]
        principal = auth.authenticate(self, method, info, headers)
        delay = self.latency.get(f"{method} {route.path}", 0.0)
        if delay:
            self._stopping.wait(delay)  # a slow synchronous call (outside the state lock)
        with self._lock:
            self.requests.append((method, api_path, dict(params)))
            typed, errors = validate(info, {**params, **path_params}, strict_booleans=self.strict_booleans)
            if errors:
                raise PveError(400, "Parameter verification failed.", errors)
            if principal is not None:
                auth.check_permissions(info.get("permissions") or {}, typed, principal)
            handler = HANDLERS.get((method, route.path))
            if handler is None:
                raise PveError(501, f"Method '{method} {api_path}' not implemented")
            if "node" in typed and typed["node"] not in self.nodes:
                raise fail(
                    f"hostname lookup '{typed['node']}' failed - failed to get address info "
                    f"for: {typed['node']}: Name or service not known"
                )
            if typed.get("node") in self.offline_nodes | self.unreachable_nodes:  # pveproxy cannot reach it
                raise PveError(595, "No route to host")
            tasks.advance(self)
            self._upload = upload
            try:
                return handler(self, typed, principal)
            finally:
                self._upload = None
