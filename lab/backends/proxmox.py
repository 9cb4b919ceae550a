"""Proxmox VE backend: linked/full clones of a golden template through the PVE API (proxmoxer).

Settings (one `[hosts.<name>]` table of lab.toml, secrets already resolved by the config layer):

    url            https://pve1.example:8006 (required)
    node           node that holds the template (and where `publish_image` puts it) (required)
    nodes          nodes the scheduler may place clones on (default: [node]); a node without its
                   own template of the same name gets clones through `target=` (shared storage)
    placement      "pack" (default: the first listed node that is online and has the memory free,
                   so the cells of a comparison share a node) or "spread" (the node with the fewest
                   of this run's VMs so far, then the most free memory)
    storage        target storage of full clones and of published templates (linked clones stay on
                   the template's storage)
    import_storage storage that receives uploads for `publish_image` (default "local")
    bridge         bridge of net0 (default "vmbr0")
    token          "user@realm!tokenid=secret" (API token; preferred), or
    user/password  ticket login (user@realm + password); an expired ticket is renewed once
    verify_tls     verify the server certificate (default True)
    ca_file        CA bundle to verify against (PVE's /etc/pve/pve-root-ca.pem)
    template       vmid (int or digits) or name of the golden template; "{image}" is replaced by
                   the image name; default "lab-{image}"
    concurrency    clones in flight per storage and per template (default 2)
    cpu_type       VM cpu type (default "host")
    ci_user        cloud-init user (default "lab")
    ssh_keys       public key(s) for cloud-init, a string or a list
    addresses      static guest addresses handed out per VM (cloud-init ipconfig0), a range
                   "10.0.0.100-10.0.0.150" or a CIDR "10.0.0.96/27"; default "" = DHCP. One
                   in the ipconfig0 of any lab VM on the cluster is never handed out again
    gateway        IPv4 gateway for static addresses ("" = none)
    prefix_len     prefix length for static addresses (default 24; `subnet_prefix` is accepted too)
    client_address this machine's address as seen from the guests (default "")
    client_netns   network namespace on this machine that load generators and SSH run in
                   (default "": this machine's own network)
    guest_agent    enable and ask the QEMU guest agent (default True; False for images without one)
    node_ssh       ssh destination/arguments of the node (e.g. "root@pve1") for the ARP fallback;
                   default: read this machine's neighbour table (in client_netns if set)
    timeouts       {phase: seconds}: http 30, clone 600, config 60, start 120, stop 120,
                   destroy 300, ready 600 (when wait_ready gets no timeout), agent 60 (how long
                   to wait for the guest agent before falling back to the static address or ARP),
                   publish 1800 (upload + import + template)
    lock_retries   retries on `can't lock file` / `VM is locked` (default 6)
    retry_backoff  first backoff in seconds, doubled per retry, capped at 30 (default 2.0)
    poll_interval  first task/agent poll interval (default 0.25); poll_max (default 2.0)

`token` and `password` may also be config references ("env:NAME", "file:/path"); they are then
resolved with lab.config.resolve_secret at construction. Unknown keys (e.g. `backend`, `source`)
are ignored. Secrets are kept in private attributes only; they never appear in repr(), logs or
exception messages.

Ownership: every VM carries the tags `lab` and `lab-run-<run id>` (PVE tag charset, lower case,
`;`-separated, valid on 7.x-9.x) and a description with `lab-run-id:`, `lab-cell:`, `lab-vm:` and
`lab-expires:` lines (already set by the clone call), so `lab gc` finds it even without the store.

Readiness: wait_ready() waits for `status/current` = running and an IPv4 address: the guest agent's
`network-get-interfaces` matched by net0's MAC; when the agent stays silent (or is off), the static
address the VM was given; without one, the neighbour (ARP) table by MAC. SSH readiness is the
caller's (lab.guest).

Publishing (`publish_image`): PVE >= 8.3 uploads the qcow2 as `import` content and creates the
template with `import-from=<volid>` (a token suffices); 7.2-8.2 upload it as `iso` content
(`.img`) and import from its absolute path, which PVE allows only root@pam with a password
(ticket); < 7.2 has no import-from (Packer's proxmox builder or `qm importdisk` over SSH).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
import shlex
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote, urlsplit

from lab import images, proc, runlock
from lab.backends import register
from lab.errors import (AuthError, BackendError, ConfigError, LabError, TeardownError, TimeoutError_,
                        UnreachableError, UsageError)
from lab.model import CloneKind, ImageRef, NicModel, Owned, Vm, VmSpec
from lab.runlock import RUN_LOCK_DIR, RunLocks
from lab.wait import wait_until

log = logging.getLogger(__name__)

DEFAULT_TIMEOUTS = {"http": 30.0, "clone": 600.0, "config": 60.0, "start": 120.0, "stop": 120.0,
                    "destroy": 300.0, "ready": 600.0, "agent": 60.0, "publish": 1800.0}
LOCK_ERRORS = ("can't lock file", "VM is locked", "got timeout", "got lock request timeout")
EXISTS_ERRORS = ("already exists", "config file already exists")
GONE_ERRORS = ("does not exist",)
AGENT_NOT_YET = ("QEMU guest agent is not running", "is not running", "got timeout")
AGENT_OFF = ("No QEMU guest agent configured",)
TAG_OK = re.compile(r"[^a-z0-9_\-+.]")
MAC_RE = re.compile(r"([0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){5})")


class TaskFailed(BackendError):
    """A PVE task ended with an exitstatus other than OK / WARNINGS: n."""

    def __init__(self, message: str, exitstatus: str, log_tail: list[str]):
        super().__init__(message)
        self.exitstatus, self.log_tail = exitstatus, log_tail


class ApiError(BackendError):
    """PVE answered an API call with an HTTP error (other than 401/403)."""

    def __init__(self, message: str, status: int, reason: str):
        super().__init__(message)
        self.status, self.reason = status, reason


@dataclass
class _Client:
    """The load generators' side: this machine, or a network namespace on it (client_netns)."""

    address: str
    netns: str | None = None

    def argv(self, argv: list[str]) -> list[str]:
        return proc.netns_prefix(self.netns) + list(argv)


def _bool(value: bool) -> int:
    return 1 if value else 0  # PVE accepts only 1/0 for top-level booleans


def _tag(text: str) -> str:
    tag = TAG_OK.sub("-", text.lower()).strip("-")
    return tag or "x"


@register
class ProxmoxBackend:
    name = "proxmox"
    nic_models = frozenset({NicModel.VIRTIO, NicModel.E1000, NicModel.E1000E, NicModel.RTL8139,
                            NicModel.VMXNET3})

    def __init__(self, host_name: str, settings: Any):
        s = dict(settings) if isinstance(settings, dict) else dict(vars(settings))
        self.host = host_name
        self.url = str(s.get("url") or "").rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme != "https" or not parts.hostname:
            raise UsageError(f"{host_name}: url must look like https://host:8006, got {self.url!r}")
        self.node = str(s.get("node") or "")
        if not self.node:
            raise UsageError(f"{host_name}: node is required")
        nodes = s.get("nodes") or [self.node]
        self.nodes = [str(n) for n in ([nodes] if isinstance(nodes, str) else nodes)]
        self.placement = s.get("placement") or "pack"
        if self.placement not in ("pack", "spread"):
            raise UsageError(f"{host_name}: placement must be pack or spread, got {self.placement!r}")
        self.source = str(s.get("source") or "lab.toml")
        self.storage = s.get("storage") or None
        self.import_storage = s.get("import_storage") or "local"
        self.bridge = s.get("bridge") or "vmbr0"
        self.template = s.get("template") if s.get("template") not in (None, "") else "lab-{image}"
        self.guest_agent = bool(s.get("guest_agent", True))
        self.node_ssh = str(s.get("node_ssh") or "")
        self.client_netns = str(s.get("client_netns") or "") or None
        self._pool = _address_pool(str(s.get("addresses") or ""), host_name)
        self.cpu_type = s.get("cpu_type") or "host"
        self.ci_user = s.get("ci_user") or "lab"
        keys = s.get("ssh_keys") or []
        self.ssh_keys = [keys] if isinstance(keys, str) else list(keys)
        self.gateway = s.get("gateway") or ""
        self.prefix_len = int(s.get("prefix_len") or s.get("subnet_prefix") or 24)
        self.client_address = s.get("client_address") or ""
        self.concurrency = max(1, int(s.get("concurrency") or 2))
        self.timeouts = {**DEFAULT_TIMEOUTS, **{k: float(v) for k, v in (s.get("timeouts") or {}).items()}}
        self.lock_retries = int(s.get("lock_retries", 6))
        self.retry_backoff = float(s.get("retry_backoff", 2.0))
        self.poll_interval = float(s.get("poll_interval", 0.25))
        self.poll_max = float(s.get("poll_max", 2.0))
        verify = s.get("verify_tls", True)
        ca_file = s.get("ca_file") or None
        self._verify: bool | str = (str(ca_file) if ca_file else True) if verify else False
        self._host_port = parts.netloc
        token = self._secret(s, "token")
        password = self._secret(s, "password")
        if token:
            m = re.fullmatch(r"([^!\s]+@[^!\s]+)!([^=\s]+)=(\S+)", str(token))
            if not m:
                raise UsageError(f"{host_name}: token must look like user@realm!tokenid=SECRET "
                                 "(value not shown)")
            self.principal = f"{m.group(1)}!{m.group(2)}"
            self._auth = {"user": m.group(1), "token_name": m.group(2), "token_value": m.group(3)}
        elif s.get("user") and password:
            self.principal = str(s["user"])
            self._auth = {"user": str(s["user"]), "password": password}
        else:
            raise UsageError(f"{host_name}: give either token or user and password")
        self._tls = threading.local()
        self._slots: dict[tuple, threading.BoundedSemaphore] = {}
        self._slots_lock = threading.Lock()
        self._reserved: set[int] = set()
        self._reserved_lock = threading.Lock()
        self._release = ""
        self._version = ""
        self._templates: dict[tuple[str, str], tuple[int, str]] = {}  # (name, node) -> (vmid, its node)
        self._taken: set[str] = set()  # addresses of our VMs
        self._placed: dict[str, int] = {}  # VMs placed per node (placement "spread")
        self._run_locks = RunLocks(self._run_lock_path)

    def _secret(self, s: dict, key: str) -> str | None:
        """The value itself, or a config reference ("env:NAME", "file:/path") resolved now."""
        value = s.get(key)
        if value and str(value).startswith(("env:", "file:")):
            from lab.config import resolve_secret

            return resolve_secret(str(value), str(s.get("source") or "lab.toml"), f"hosts.{self.host}.{key}")
        return str(value) if value else None

    def __repr__(self) -> str:
        return f"ProxmoxBackend(host={self.host!r}, url={self.url!r}, node={self.node!r}, auth={self.principal!r})"

    # --- API plumbing ------------------------------------------------------------------------

    def _api(self):
        api = getattr(self._tls, "api", None)
        if api is None:
            from proxmoxer import ProxmoxAPI
            from proxmoxer.core import AuthenticationError

            kwargs = dict(self._auth)
            try:
                api = self._guard("login", lambda: ProxmoxAPI(self._host_port, backend="https",
                                  verify_ssl=self._verify, timeout=self.timeouts["http"], **kwargs))
            except AuthenticationError as exc:  # the ticket login was refused
                code = re.search(r"code: (\d+)", str(exc))
                raise AuthError(f"{self.host}: authentication failed ({code.group(1) if code else '?'}) "
                                f"for user {self.principal}", hint="check user and password") from None
            self._tls.api = api
        return api

    def _guard(self, what: str, fn: Callable[[], Any], *, relogin: bool = True) -> Any:
        """Run one API call; translate transport and HTTP errors into lab errors (no secrets)."""
        import requests
        from proxmoxer.core import AuthenticationError, ResourceException

        try:
            return fn()
        except ResourceException as exc:
            reason = str(exc.content or "")
            if exc.errors is not None:  # proxmoxer appends " - {errors}" to the reason phrase
                reason = reason.removesuffix(f" - {exc.errors}")
            reason = reason.strip()
            if exc.status_code == 401 and relogin and "password" in self._auth:
                # the ticket expired (PVE: 2 h; proxmoxer renews only by its own clock): log in
                # again, in place, so every resource object of this session gets the new ticket
                log.info("%s: ticket refused (%s); logging in again", self.host, reason)
                try:
                    self._api()._backend.auth._get_new_tokens(password=self._auth["password"])
                except AuthenticationError:
                    raise AuthError(f"{self.host}: authentication failed (401) for user {self.principal}",
                                    hint="check the user and password") from None
                return self._guard(what, fn, relogin=False)
            if exc.status_code == 401:
                kind = "token" if "token_value" in self._auth else "user"
                raise AuthError(f"{self.host}: authentication failed (401) for {kind} {self.principal}",
                                hint="check the token/password and that it is not expired") from None
            if exc.status_code == 403:
                raise AuthError(f"{self.host}: {self.principal} lacks a privilege: {reason} ({what})",
                                hint="grant the privilege on that path to the token (privsep tokens "
                                     "need their own ACLs)") from None
            detail = reason
            if exc.errors:
                detail += " " + "; ".join(f"{k}: {str(v).strip()}" for k, v in dict(exc.errors).items())
            raise ApiError(f"{self.host}: {what} failed: {exc.status_code} {detail}",
                           exc.status_code, reason) from None
        except requests.exceptions.SSLError as exc:
            raise UnreachableError(f"{self.host}: TLS verification failed for {self.url}: "
                                   f"{_short(exc)}",
                                   hint="set ca_file to the PVE CA (pve-root-ca.pem) or verify_tls = false")\
                from None
        except requests.exceptions.Timeout as exc:
            raise UnreachableError(f"{self.host}: {what}: no answer from {self.url} within "
                                   f"{self.timeouts['http']:g} s: {_short(exc)}",
                                   hint="raise timeouts.http for this host") from None
        except requests.exceptions.ConnectionError as exc:
            raise UnreachableError(f"{self.host}: cannot reach {self.url}: {_short(exc)}") from None

    def _nodeapi(self, node: str | None = None):
        return self._api().nodes(node or self.node)

    def _wait_task(self, upid: str, *, timeout: float, what: str) -> dict:
        node = upid.split(":")[1] if upid.count(":") >= 8 else self.node  # poll the UPID's node
        tasks = self._nodeapi(node).tasks(upid)

        def done():
            st = self._guard(f"task status of {what}", lambda: tasks.status.get())
            return st if st.get("status") == "stopped" else None

        status = wait_until(done, timeout=timeout, what=f"{self.host}: {what} (task {upid})",
                            interval=self.poll_interval, max_interval=self.poll_max)
        exitstatus = str(status.get("exitstatus", ""))
        if exitstatus == "OK" or re.fullmatch(r"WARNINGS: \d+", exitstatus):
            return status
        tail: list[str] = []
        try:
            lines = self._guard("task log", lambda: tasks.log.get(start=0, limit=500))
            tail = [str(x.get("t", "")) for x in lines][-10:]
        except BackendError:
            pass
        raise TaskFailed(f"{self.host}: {what} failed: {exitstatus}", exitstatus, tail)

    def _retrying(self, what: str, fn: Callable[[], Any], *, deadline: float) -> Any:
        """Retry fn on lock contention with exponential backoff, within the phase deadline."""
        delay = self.retry_backoff
        for attempt in range(self.lock_retries + 1):
            try:
                return fn()
            except (ApiError, TaskFailed) as exc:
                text = exc.exitstatus if isinstance(exc, TaskFailed) else exc.reason
                if not any(m in text for m in LOCK_ERRORS) or attempt == self.lock_retries \
                        or time.monotonic() + delay > deadline:
                    raise
                log.info("%s: %s hit a lock (%s); retry %d in %.1f s", self.host, what, text,
                         attempt + 1, delay)
                time.sleep(delay)  # backoff between attempts, not a polling loop
                delay = min(delay * 2, 30.0)

    # --- Backend protocol --------------------------------------------------------------------

    def check(self) -> None:
        ver = self._guard("GET /version", lambda: self._api().version.get())
        self._release = str(ver.get("release") or "")
        self._version = str(ver.get("version") or "")
        if not re.fullmatch(r"\d+\.\d+", self._release):
            raise UnreachableError(f"{self.host}: {self.url} does not look like a PVE API "
                                   f"(release {self._release!r})")
        self._check_nodes()
        if "{image}" not in str(self.template):
            self._check_template(None)

    def check_images(self, images: list[ImageRef]) -> None:
        """Before anything is created: every image has a template this host can clone on every node
        it may place a VM on."""
        for image in images:
            self._check_template(image)

    def _check_nodes(self) -> None:
        res = self._guard("GET /nodes", lambda: self._api().nodes.get())
        known = {str(r.get("node")): str(r.get("status", "")) for r in res}
        listed = [("node", self.node)] + [(f"nodes[{i}]", n) for i, n in enumerate(self.nodes)]
        for key, n in listed:
            if n not in known:
                raise ConfigError(self.source, f"hosts.{self.host}.{key}", n,
                                  f"no such node in the cluster at {self.url}; its nodes: "
                                  f"{', '.join(sorted(known)) or 'none'}")
        if not any(known[n] == "online" for n in self.nodes):
            raise UnreachableError(f"{self.host}: none of the nodes {', '.join(self.nodes)} is online")

    def _check_template(self, image: ImageRef | None) -> None:
        for n in self.nodes:
            vmid, src_node = self._source_template(image, n)
            try:
                cfg = self._guard(f"GET config of template {vmid}",
                                  lambda: self._nodeapi(src_node).qemu(vmid).config.get())
            except ApiError as exc:
                if exc.status == 500 and any(m in exc.reason for m in GONE_ERRORS + ("hostname lookup",)):
                    raise UsageError(f"{self.host}: template {vmid} not found on node {src_node}: {exc.reason}",
                                     hint="check node and template for this host") from None
                raise
            if not cfg.get("template"):
                raise UsageError(f"{self.host}: VM {vmid} on node {src_node} is not a template",
                                 hint="convert the golden VM to a template (linked clones need one)")
            if src_node != n:  # clones reach node n through `target=`: PVE needs shared storage
                storage = str(cfg.get("scsi0", "")).split(":", 1)[0]
                stores = self._guard(f"GET storage of node {src_node}",
                                     lambda: self._nodeapi(src_node).storage.get())
                if not any(st.get("storage") == storage and st.get("shared") for st in stores):
                    raise UsageError(
                        f"{self.host}: node {n} has no template {self._template_name(image)!r} of its own, "
                        f"and template {vmid} on {src_node} is on local storage {storage!r}: PVE cannot "
                        f"clone it to {n}", hint="publish the image on that node too, or keep the "
                        "template on shared storage")

    def _run_lock_path(self, run_id: str) -> Path:
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", self.host)
        return RUN_LOCK_DIR / f"proxmox-{host}@{run_id}.lock"

    def open_run(self, run_id: str) -> _Client:
        # Held for the run's life on this machine: `lab gc` here removes the VMs of a run killed
        # with -9 at once instead of waiting for their leases to expire.
        self._run_locks.acquire(run_id, what=f"the lock of run {run_id} on host {self.host!r}")
        return _Client(self.client_address, self.client_netns)

    def close_run(self, run_id: str) -> None:
        self._run_locks.release(run_id)

    def run_is_live(self, run_id: str) -> bool | None:
        return self._run_locks.live(run_id)

    def facts(self) -> dict[str, object]:
        if not self._release:
            self.check()
        return {"hypervisor": "proxmox", "pve_release": self._release, "pve_version": self._version,
                "node": self.node, "nodes": list(self.nodes), "cpu_type": self.cpu_type}

    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        if spec.nic not in self.nic_models:
            raise UsageError(f"{self.host}: NIC model {spec.nic} is not available on Proxmox")
        node = self._place(spec)
        tmpl, src_node = self._source_template(image, node)
        full = spec.clone == CloneKind.FULL
        deadline = time.monotonic() + self.timeouts["clone"]
        storage_key = self.storage if full and self.storage else f"template-storage/{src_node}/{tmpl}"
        with self._slot(("storage", storage_key)), self._slot(("template", src_node, tmpl)):
            vmid = self._clone_new_vmid(tmpl, src_node, node, spec, full, deadline)
        vm = Vm(spec=spec, backend=self.name, handle={"vmid": vmid, "node": node},
                facts={"clone": "full" if full else "linked", "template": tmpl, "node": node})
        try:
            self._configure(vm)
        except BaseException:
            self._destroy_quietly(vm)
            raise
        return vm

    def start(self, vm: Vm) -> None:
        api = self._nodeapi(vm.handle["node"]).qemu(vm.handle["vmid"])
        deadline = time.monotonic() + self.timeouts["start"]

        def once():
            upid = self._guard(f"start VM {vm.handle['vmid']}", lambda: api.status.start.post())
            self._wait_task(upid, timeout=max(1.0, deadline - time.monotonic()),
                            what=f"start of VM {vm.handle['vmid']} ({vm.name})")

        self._retrying("start", once, deadline=deadline)

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        timeout = timeout or self.timeouts["ready"]
        vmid, node = vm.handle["vmid"], vm.handle.get("node", self.node)
        api = self._nodeapi(node).qemu(vmid)
        start = time.monotonic()
        label = f"{self.host}: VM {vmid} ({vm.name})"

        def running():
            st = self._guard(f"status of VM {vmid}", lambda: api.status.current.get())
            return st.get("status") == "running"

        wait_until(running, timeout=timeout, what=f"{label} to run", interval=self.poll_interval,
                   max_interval=self.poll_max)
        mac = (vm.handle.get("mac") or "").lower()
        static = vm.handle.get("static_ip") or ""
        last = {"err": "no answer yet" if self.guest_agent else "guest agent off (guest_agent = false)"}
        agent = {"on": self.guest_agent, "until": start + min(max(0.0, timeout), self.timeouts["agent"])}

        def agent_ip():
            try:
                res = self._guard(f"guest agent of VM {vmid}",
                                  lambda: api.agent("network-get-interfaces").get())
            except ApiError as exc:
                if any(m in exc.reason for m in AGENT_OFF):
                    agent["on"] = False  # e.g. a BSD template without agent=1: go on at once
                    last["err"] = exc.reason
                    return None
                if any(m in exc.reason for m in AGENT_NOT_YET):
                    last["err"] = exc.reason
                    return None
                raise
            ip = _pick_ipv4(res.get("result", []) if isinstance(res, dict) else [], mac)
            if not ip:
                last["err"] = f"agent answers but reports no IPv4 for MAC {mac or '?'}"
            return ip

        def discover():
            if agent["on"]:
                ip = agent_ip()
                if ip:
                    return ip, "agent"
                if time.monotonic() < agent["until"]:
                    return None
            if static:
                log.info("%s: guest agent silent (%s); using the static address %s", label, last["err"], static)
                return static, "static"
            ip = self._arp_ip(mac)
            if ip:
                return ip, "arp"
            last["arp"] = f"no neighbour entry for MAC {mac or '?'}"
            return None

        remaining = max(0.0, timeout - (time.monotonic() - start))
        ip, source = wait_until(discover, timeout=remaining,
                                what=f"{label} to report an IPv4 address for MAC {mac or '?'} (guest agent, "
                                     f"static address, ARP)",
                                interval=self.poll_interval, max_interval=self.poll_max,
                                detail=lambda: f"last: {last['err']}"
                                + (f"; {last['arp']}" if "arp" in last else ""))
        vm.address = ip
        vm.facts["address_source"] = source
        return ip

    def _arp_ip(self, mac: str) -> str:
        """The neighbour table: the node's (node_ssh), else this machine's (in client_netns)."""
        from lab.backends.libvirt import parse_arp  # one ARP parser for every backend

        if not mac:
            return ""
        argv = ["ip", "-4", "neigh", "show"]
        if self.node_ssh:
            argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", *shlex.split(self.node_ssh), *argv]
        try:
            res = proc.run(argv, timeout=30, check=False, netns=None if self.node_ssh else self.client_netns,
                           what="neighbour table")
        except LabError:
            return ""
        return parse_arp(res.stdout, mac) if res.ok else ""

    def destroy(self, vm: Vm) -> None:
        vmid, node = vm.handle.get("vmid"), vm.handle.get("node", self.node)
        if vmid is None:
            return
        try:
            self._destroy_vmid(int(vmid), node, vm.name)
        except TeardownError:
            raise
        except Exception as exc:
            raise TeardownError(f"{self.host}: could not destroy VM {vmid} ({vm.name}): {exc}") from None
        with self._reserved_lock:
            self._taken.discard(vm.handle.get("static_ip") or "")

    def _lab_vms(self) -> list[tuple[dict, dict, dict[str, str]]]:
        """(cluster resource, config, description fields) of every lab VM on the cluster, made by
        whichever process or machine: tagged `lab`, or carrying a lab run id."""
        res = self._guard("GET /cluster/resources", lambda: self._api().cluster.resources.get(type="vm"))
        found = []
        for r in res:
            if r.get("type") != "qemu" or r.get("template"):
                continue
            tags = re.split(r"[;, ]", str(r.get("tags") or ""))
            if "lab" not in tags and not str(r.get("name") or "").startswith("lab-"):
                continue
            try:
                cfg = self._guard(f"config of VM {r['vmid']}",
                                  lambda: self._nodeapi(r["node"]).qemu(r["vmid"]).config.get())
            except ApiError:
                continue  # vanished meanwhile
            meta = _parse_description(str(cfg.get("description") or ""))
            if "lab" not in re.split(r"[;, ]", str(cfg.get("tags") or "")) and "lab-run-id" not in meta:
                continue  # a lab-like name alone is not ours
            found.append((r, cfg, meta))
        return found

    def list_owned(self) -> list[Owned]:
        owned = [Owned(backend=self.name, kind="vm", name=str(r.get("name") or "") or meta.get("lab-vm", ""),
                       run_id=meta.get("lab-run-id", ""), expires_at=float(meta.get("lab-expires", 0) or 0),
                       detail=f"{r['node']}/{r['vmid']}")
                 for r, _cfg, meta in self._lab_vms()]
        return owned + self._run_locks.owned(self.name)  # a run killed with -9 leaves its lock file

    def remove_owned(self, item: Owned) -> None:
        if item.kind == "lock":
            runlock.remove_if_dead(Path(item.detail))  # never the lock of a live run
            return
        node, _, vmid = item.detail.partition("/")
        try:
            self._destroy_vmid(int(vmid), node, item.name)
        except TeardownError:
            raise
        except Exception as exc:
            raise TeardownError(f"{self.host}: could not remove VM {vmid} ({item.name}): {exc}") from None

    # --- publishing a golden image as a template -----------------------------------------------

    def publish_image(self, image: ImageRef) -> str:
        """Make `image` a PVE template on `node` (upload + import-from + template) and return its
        name. A template of that name made from the same image (sha256) is reused; older ones of
        the same name are removed when nothing is cloned from them any more."""
        images.require_boot(image, "bios", f"a Proxmox VE template on {self.host} boots its disk by SeaBIOS")
        self.check()
        name = self._template_name(image)
        if name.isdigit():
            raise UsageError(f"{self.host}: template = {name} is a VMID; publishing needs a template name",
                             hint='set template = "lab-{image}" (the default) for this host')
        sha = image.sha256 or image.digest
        same, older = self._published(name, sha)
        if same is not None:
            log.info("%s: template %s (VM %d) already holds %s", self.host, name, same, image.name)
            return name
        release = tuple(int(x) for x in self._release.split("."))
        if release < (7, 2):
            raise UsageError(f"{self.host}: PVE {self._release} cannot import a disk through the API "
                             "(import-from needs 7.2+)", hint="build the template on the host with Packer's "
                             "proxmox builder, or `qm importdisk` over SSH")
        by_path = release < (8, 3)  # no `import` content before 8.3: upload as iso, import by path
        if by_path and self.principal != "root@pam":
            raise UsageError(f"{self.host}: publishing on PVE {self._release} imports from an absolute path, "
                             f"which PVE allows only root@pam with a password, not {self.principal}",
                             hint="set user = \"root@pam\" and password for this once, use Packer's proxmox "
                                  "builder, or upgrade to PVE 8.3+ (token-friendly `import` content)")
        deadline = time.monotonic() + self.timeouts["publish"]
        content, ext = ("iso", "img") if by_path else ("import", "qcow2")
        filename = f"{name}-{sha[:12]}.{ext}"
        volid = self._upload(image.path, content, filename, sha, deadline)
        try:
            source = volid
            if by_path:
                st = self._nodeapi().storage(self.import_storage)
                source = str(self._guard("GET volume path",
                                         lambda: st.content(quote(volid, safe="")).get())["path"])
            vmid = self._create_template(image, name, sha, source, deadline)
        finally:
            self._delete_volume(volid, deadline)
        for old in older:
            try:
                self._destroy_vmid(old, self.node, name)
            except LabError as exc:  # linked clones still use it: it goes when they are gone
                log.warning("%s: kept the older template %d of %s: %s", self.host, old, name, exc)
        self._templates.pop((name, self.node), None)
        log.info("%s: published %s as template %s (VM %d)", self.host, image.name, name, vmid)
        return name

    def _published(self, name: str, sha: str) -> tuple[int | None, list[int]]:
        """(template of this name holding this image, other templates of this name) on `node`."""
        res = self._guard("GET /cluster/resources", lambda: self._api().cluster.resources.get(type="vm"))
        same, older = None, []
        for r in res:
            if not (r.get("template") and r.get("name") == name and r.get("node") == self.node):
                continue
            cfg = self._guard(f"config of template {r['vmid']}",
                              lambda: self._nodeapi().qemu(r["vmid"]).config.get())
            meta = _parse_description(str(cfg.get("description") or ""))
            if meta.get("lab-image-sha256") == sha:
                same = int(r["vmid"])
            else:
                older.append(int(r["vmid"]))
        return same, older

    def _upload(self, path: Path, content: str, filename: str, sha: str, deadline: float) -> str:
        st = self._nodeapi().storage(self.import_storage)
        volid = f"{self.import_storage}:{content}/{filename}"
        try:  # the upload of a publish that died midway: replace it
            self._guard("GET volume", lambda: st.content(quote(volid, safe="")).get())
            self._delete_volume(volid, deadline)
        except ApiError:
            pass
        with tempfile.TemporaryDirectory(prefix="lab-publish-") as tmp:
            named = Path(tmp) / filename  # the multipart file name is what PVE calls the volume
            named.symlink_to(Path(path).resolve())
            with open(named, "rb") as fh:
                params: dict[str, Any] = {"content": content, "filename": fh}
                if re.fullmatch(r"[0-9a-f]{64}", sha):
                    params.update({"checksum": sha, "checksum-algorithm": "sha256"})
                upid = self._guard(f"upload of {filename} to {self.import_storage}",
                                   lambda: st.upload.post(**params))
        self._wait_task(upid, timeout=max(1.0, deadline - time.monotonic()),
                        what=f"upload of {filename} to {self.node}/{self.import_storage}")
        return volid

    def _create_template(self, image: ImageRef, name: str, sha: str, source: str, deadline: float) -> int:
        storage = self.storage or "local-lvm"
        desc = "\n".join([f"lab-image: {image.name}", f"lab-image-digest: {image.digest}",
                          f"lab-image-sha256: {sha}", "published by `lab images publish`"])
        params: dict[str, Any] = {
            "name": _dns_name(name), "description": desc, "tags": "lab-template",
            "memory": "1024", "cores": 1, "sockets": 1, "cpu": self.cpu_type,
            "ostype": "l26" if image.os in ("debian", "alpine", "ubuntu") else "other",
            "scsihw": "virtio-scsi-single", "scsi0": f"{storage}:0,import-from={source}",
            "ide2": f"{storage}:cloudinit", "boot": "order=scsi0", "serial0": "socket", "vga": "serial0",
            "agent": f"enabled={_bool(self.guest_agent)}", "net0": f"model=virtio,bridge={self.bridge}"}
        qemu = self._nodeapi().qemu
        for _ in range(20):
            vmid = self._candidate_vmid()
            try:
                upid = self._guard(f"create of template {name}", lambda: qemu.post(vmid=vmid, **params))
            except ApiError as exc:
                if any(m in exc.reason for m in EXISTS_ERRORS):
                    continue  # someone else took the id meanwhile
                self._forget(vmid)
                raise
            try:
                self._wait_task(upid, timeout=max(1.0, deadline - time.monotonic()),
                                what=f"import of {image.name} into VM {vmid}")
                api = qemu(vmid)
                self._retrying(f"template of VM {vmid}", lambda: self._wait_task(
                    self._guard(f"template of VM {vmid}", lambda: api.template.post()),
                    timeout=max(1.0, deadline - time.monotonic()), what=f"conversion of VM {vmid} to a template"),
                    deadline=deadline)
                return vmid
            except BaseException:
                self._cleanup_failed_clone(vmid, name, self.node)  # a half-made template goes
                self._forget(vmid)
                raise
        raise BackendError(f"{self.host}: could not find a free VMID for template {name}")

    def _delete_volume(self, volid: str, deadline: float) -> None:
        st = self._nodeapi().storage(self.import_storage)
        try:
            upid = self._guard(f"removal of {volid}", lambda: st.content(quote(volid, safe="")).delete())
            if upid:
                self._wait_task(upid, timeout=max(1.0, deadline - time.monotonic()), what=f"removal of {volid}")
        except LabError as exc:  # the template is made; the upload is only a leftover file
            log.warning("%s: could not remove the uploaded %s: %s", self.host, volid, exc)

    # --- helpers -----------------------------------------------------------------------------

    def _slot(self, key: tuple) -> threading.BoundedSemaphore:
        with self._slots_lock:
            if key not in self._slots:
                self._slots[key] = threading.BoundedSemaphore(self.concurrency)
            return self._slots[key]

    def _template_name(self, image: ImageRef | None) -> str:
        want = str(self.template)
        if "{image}" in want:
            if image is None:
                raise UsageError(f"{self.host}: no template configured",
                                 hint="set template = <vmid or name> for this host")
            want = want.replace("{image}", image.name)
        return want

    def _source_template(self, image: ImageRef | None, node: str) -> tuple[int, str]:
        """(template vmid, its node) to clone for a VM on `node`: a template of that name on the node
        itself, else the one on `node` of the settings (cloned with `target=`)."""
        want = self._template_name(image)
        if want.isdigit():
            return int(want), self.node
        for where in dict.fromkeys([node, self.node]):
            hit = self._templates.get((want, where))
            if hit is None:
                res = self._guard("GET /cluster/resources", lambda: self._api().cluster.resources.get(type="vm"))
                hits = sorted((int(r["vmid"]) for r in res if r.get("template") and r.get("name") == want
                               and r.get("node") == where), reverse=True)  # the newest first
                if hits:
                    hit = self._templates[(want, where)] = (hits[0], where)
            if hit is not None:
                return hit
        raise UsageError(f"{self.host}: no template named {want!r} on node {self.node}",
                         hint=f"publish the golden image as a PVE template first (lab images publish "
                              f"{image.name if image else 'IMAGE'} {self.host})")

    def _place(self, spec: VmSpec) -> str:
        """The node for a new VM: online, with the memory free; see `placement`."""
        if len(self.nodes) == 1:
            node = self.nodes[0]
        else:
            res = self._guard("GET /cluster/resources", lambda: self._api().cluster.resources.get(type="node"))
            info = {str(r.get("node")): r for r in res if r.get("type") == "node"}
            need = spec.memory_mib * 1024 * 1024
            fits = []
            for order, n in enumerate(self.nodes):
                r = info.get(n) or {}
                free = int(r.get("maxmem") or 0) - int(r.get("mem") or 0)
                if r.get("status") == "online" and free >= need:
                    fits.append((n, order, free))
            if not fits:
                raise BackendError(f"{self.host}: no node of {', '.join(self.nodes)} is online with "
                                   f"{spec.memory_mib} MiB free for {spec.name}")
            with self._reserved_lock:
                if self.placement == "spread":
                    node = min(fits, key=lambda f: (self._placed.get(f[0], 0), -f[2], f[1]))[0]
                else:
                    node = fits[0][0]
        with self._reserved_lock:
            self._placed[node] = self._placed.get(node, 0) + 1
        return node

    def _static_address(self, spec: VmSpec) -> str:
        """The cell's address, else the next free one of `addresses`, else "" (DHCP). Free means
        neither taken by this process nor in the ipconfig0 of a lab VM on the cluster (another
        `lab run`'s, from here or another machine); the caller holds the address lock until the
        chosen one is in the VM's config."""
        if spec.ip:
            return spec.ip
        if not self._pool:
            return ""
        in_use = {m.group(1) for _r, cfg, _meta in self._lab_vms()
                  if (m := re.search(r"(?:^|,)ip=([0-9.]+)", str(cfg.get("ipconfig0") or "")))}
        with self._reserved_lock:
            for ip in self._pool:
                if ip not in self._taken and ip not in in_use and ip not in (self.gateway, self.client_address):
                    self._taken.add(ip)
                    return ip
        raise BackendError(f"{self.host}: every address of `addresses` is in use ({len(self._pool)}, "
                           f"{len(in_use)} by lab VMs on the cluster)")

    def _address_lock(self, spec: VmSpec):
        """Held from choosing a pool address until it is in the VM's config: two `lab run`s on this
        machine never choose the same one (other machines are seen once their config is written)."""
        if spec.ip or not self._pool:
            return contextlib.nullcontext()
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", self.host)
        return runlock.exclusive(RUN_LOCK_DIR / f"proxmox-{host}.addresses.lock", timeout=self.timeouts["config"],
                                 what=f"the address lock of host {self.host!r}")

    def _candidate_vmid(self) -> int:
        """nextid is not a reservation: keep our own set so parallel workers of this process never
        pick the same id; other clients are handled by retrying on `already exists`."""
        nextid = self._api().cluster.nextid
        vmid = int(self._guard("GET /cluster/nextid", lambda: nextid.get()))
        for _ in range(1000):
            with self._reserved_lock:
                if vmid not in self._reserved:
                    self._reserved.add(vmid)
                    return vmid
            vmid += 1
            while vmid < 1_000_000_000:  # the next id that is free on the cluster (400 when taken)
                try:
                    vmid = int(self._guard("GET /cluster/nextid", lambda: nextid.get(vmid=vmid)))
                    break
                except ApiError as exc:
                    if exc.status != 400:
                        raise
                    vmid += 1
        raise BackendError(f"{self.host}: could not find a free VMID")

    def _clone_new_vmid(self, tmpl: int, src_node: str, node: str, spec: VmSpec, full: bool,
                        deadline: float) -> int:
        src = self._nodeapi(src_node).qemu(tmpl)
        # the description rides on the clone already, so `lab gc` finds a VM even if we die before
        # configuring it (tags come with the config)
        params: dict[str, Any] = {"name": _dns_name(spec.name), "full": _bool(full),
                                  "description": _description(spec)}
        if full and self.storage:
            params["storage"] = self.storage
        if node != src_node:
            params["target"] = node
        collisions = 0
        delay = self.retry_backoff
        lock_attempts = 0
        while True:
            vmid = self._candidate_vmid()
            try:
                upid = self._guard(f"clone of template {tmpl}", lambda: src.clone.post(newid=vmid, **params))
                self._wait_task(upid, timeout=max(1.0, deadline - time.monotonic()),
                                what=f"clone of template {tmpl} to VM {vmid} ({spec.name})")
                return vmid
            except (ApiError, TaskFailed) as exc:
                text = exc.exitstatus if isinstance(exc, TaskFailed) else exc.reason
                if any(m in text for m in EXISTS_ERRORS):  # keep it reserved: someone else's now
                    collisions += 1
                    if collisions > 20:
                        raise
                    log.info("%s: VMID %d taken by someone else; trying the next one", self.host, vmid)
                    continue
                self._cleanup_failed_clone(vmid, spec.name, node)
                self._forget(vmid)
                if any(m in text for m in LOCK_ERRORS) and lock_attempts < self.lock_retries \
                        and time.monotonic() + delay < deadline:
                    lock_attempts += 1
                    log.info("%s: clone hit a lock (%s); retry %d in %.1f s", self.host, text,
                             lock_attempts, delay)
                    time.sleep(delay)  # backoff between attempts
                    delay = min(delay * 2, 30.0)
                    continue
                if isinstance(exc, TaskFailed) and exc.log_tail:
                    raise TaskFailed(f"{exc} (log: {' | '.join(exc.log_tail[-3:])})", exc.exitstatus,
                                     exc.log_tail) from None
                raise
            except BaseException as exc:
                settle = 2 * self.timeouts["http"] if isinstance(exc, UnreachableError) else 0.0
                self._cleanup_failed_clone(vmid, spec.name, node, settle=settle)
                self._forget(vmid)
                raise

    def _forget(self, vmid: int) -> None:
        with self._reserved_lock:
            self._reserved.discard(vmid)

    def _cleanup_failed_clone(self, vmid: int, name: str, node: str, *, settle: float = 0.0) -> None:
        """PVE removes the config of a failed clone itself; make sure nothing of ours is left. After
        a call that timed out on our side (settle > 0) the node may still carry it out: watch for
        the VM that long before deciding nothing was made."""
        api = self._nodeapi(node).qemu(vmid)

        def config():
            try:
                return self._guard(f"config of VM {vmid}", lambda: api.config.get())
            except Exception:
                return None  # gone (the normal case) or unreadable

        cfg = config()
        if cfg is None and settle > 0:
            try:
                cfg = wait_until(config, timeout=settle, what=f"VM {vmid} of a clone call that timed out",
                                 interval=self.poll_interval, max_interval=self.poll_max)
            except TimeoutError_:
                return
        if cfg and cfg.get("name") == _dns_name(name):
            try:
                self._destroy_vmid(vmid, node, name)
            except Exception as exc:
                log.warning("%s: leftover VM %d of a failed clone: %s", self.host, vmid, exc)

    def _configure(self, vm: Vm) -> None:
        spec = vm.spec
        vmid = vm.handle["vmid"]
        api = self._nodeapi(vm.handle["node"]).qemu(vmid)
        net = f"model={spec.nic.value},bridge={self.bridge}"
        if spec.mac:
            net += f",macaddr={spec.mac.upper()}"
        params: dict[str, Any] = {"net0": net, "cores": int(spec.vcpus), "sockets": 1,
                                  "memory": str(int(spec.memory_mib)), "cpu": self.cpu_type,
                                  "agent": f"enabled={_bool(self.guest_agent)}", "ciuser": self.ci_user,
                                  "tags": ";".join(["lab", "lab-run-" + _tag(spec.run_id)]),
                                  "description": _description(spec)}
        if self.ssh_keys:
            params["sshkeys"] = quote("\n".join(self.ssh_keys), safe="")  # %20, never '+'
        if not self._release:
            self._release = str(self._guard("GET /version", lambda: self._api().version.get()).get("release", ""))
        if self._release and int(self._release.split(".")[0]) >= 8:
            params["ciupgrade"] = 0  # 8.x+: skip the first-boot package upgrade
        static = ""
        with self._address_lock(spec):
            ip = self._static_address(spec)
            if ip:
                vm.handle["static_ip"] = ip.split("/")[0]  # released by destroy, even if config fails
                addr = ip if "/" in ip else f"{ip}/{self.prefix_len}"
                try:
                    ipaddress.IPv4Interface(addr)
                except ValueError:
                    raise UsageError(f"{self.host}: VM {spec.name}: bad static address {ip!r}") from None
                static = addr.split("/")[0]
                params["ipconfig0"] = f"ip={addr}" + (f",gw={self.gateway}" if self.gateway else "")
            else:
                params["ipconfig0"] = "ip=dhcp"
            deadline = time.monotonic() + self.timeouts["config"]
            self._retrying(f"config of VM {vmid}",
                           lambda: self._guard(f"config of VM {vmid}", lambda: api.config.put(**params)),
                           deadline=deadline)
        cfg = self._guard(f"config of VM {vmid}", lambda: api.config.get())
        m = MAC_RE.search(str(cfg.get("net0", "")))
        vm.handle["mac"] = m.group(1).lower() if m else spec.mac.lower()
        vm.handle["static_ip"] = static

    def _destroy_vmid(self, vmid: int, node: str, name: str) -> None:
        api = self._nodeapi(node).qemu(vmid)
        deadline = time.monotonic() + self.timeouts["destroy"]

        def gone_ok(fn):
            try:
                return fn()
            except ApiError as exc:
                if any(m in exc.reason for m in GONE_ERRORS):
                    return None
                raise

        def stop_and_delete():
            st = gone_ok(lambda: self._guard(f"status of VM {vmid}", lambda: api.status.current.get()))
            if st is None:
                return
            if st.get("status") != "stopped":
                upid = self._guard(f"stop VM {vmid}", lambda: api.status.stop.post())
                self._wait_task(upid, timeout=min(self.timeouts["stop"], max(1.0, deadline - time.monotonic())),
                                what=f"stop of VM {vmid} ({name})")
            upid = gone_ok(lambda: self._guard(f"destroy VM {vmid}", lambda: api.delete(
                purge=1, **{"destroy-unreferenced-disks": 1})))
            if upid is None:
                return
            try:
                self._wait_task(upid, timeout=max(1.0, deadline - time.monotonic()),
                                what=f"destroy of VM {vmid} ({name})")
            except TaskFailed as exc:
                if any(m in exc.exitstatus for m in GONE_ERRORS):
                    return
                raise

        self._retrying(f"destroy of VM {vmid}", stop_and_delete, deadline=deadline)
        self._forget(vmid)

    def _destroy_quietly(self, vm: Vm) -> None:
        try:
            self.destroy(vm)
        except Exception as exc:
            log.warning("%s: cleanup of VM %s after a failed configure: %s", self.host,
                        vm.handle.get("vmid"), exc)


def _address_pool(spec: str, host: str) -> list[str]:
    """ "10.0.0.100-10.0.0.150" or "10.0.0.96/27" -> the addresses, in order."""
    if not spec:
        return []
    try:
        if "-" in spec:
            first, last = (ipaddress.IPv4Address(x.strip()) for x in spec.split("-", 1))
            if last < first:
                raise ValueError("range ends before it starts")
            return [str(ipaddress.IPv4Address(i)) for i in range(int(first), int(last) + 1)]
        return [str(ip) for ip in ipaddress.IPv4Network(spec.strip(), strict=False).hosts()]
    except ValueError as exc:
        raise UsageError(f"{host}: addresses = {spec!r}: {exc} (want FIRST-LAST or a CIDR)") from None


def _short(exc: Exception) -> str:
    text = str(exc)
    m = re.search(r"\[SSL[^\]]*\][^')\"]*", text)
    if m:
        return m.group(0).strip()
    m = re.search(r"(Connection refused|Name or service not known|timed out|No route to host)", text)
    return m.group(1) if m else type(exc).__name__


def _dns_name(name: str) -> str:
    text = re.sub(r"[^a-zA-Z0-9.-]", "-", name).strip("-.") or "lab-vm"
    return re.sub(r"-+", "-", text)[:63].rstrip("-")


def _description(spec: VmSpec) -> str:
    return "\n".join([f"lab-vm: {spec.name}", f"lab-run-id: {spec.run_id}", f"lab-cell: {spec.cell_id}",
                      f"lab-expires: {int(spec.expires_at)}", "created by lab; `lab gc` may remove it"])


def _parse_description(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().startswith("lab-"):
            out[key.strip()] = value.strip()
    return out


def _pick_ipv4(ifaces: list[dict], mac: str) -> str | None:
    """The guest's IPv4 on the interface whose MAC is net0's; never lo, link-local or others."""
    for iface in ifaces:
        if mac and str(iface.get("hardware-address", "")).lower() != mac:
            continue
        if not mac and iface.get("name") in ("lo", "docker0"):
            continue
        for a in iface.get("ip-addresses") or []:
            if a.get("ip-address-type") != "ipv4":
                continue
            try:
                ip = ipaddress.IPv4Address(a.get("ip-address", ""))
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local:
                continue
            return str(ip)
    return None
