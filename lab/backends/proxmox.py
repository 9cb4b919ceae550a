"""Proxmox VE backend: linked/full clones of a golden template through the PVE API (proxmoxer).

Settings (one `[hosts.<name>]` table of lab.toml, secrets already resolved by the config layer):

    url            https://pve1.example:8006 (required)
    node           node that holds the template and the clones (required)
    storage        target storage of full clones (linked clones stay on the template's storage)
    bridge         bridge of net0 (default "vmbr0")
    token          "user@realm!tokenid=secret" (API token; preferred), or
    user/password  ticket login (user@realm + password)
    verify_tls     verify the server certificate (default True)
    ca_file        CA bundle to verify against (PVE's /etc/pve/pve-root-ca.pem)
    template       vmid (int or digits) or name of the golden template; default: the image name
    concurrency    clones in flight per (storage, template) (default 2)
    cpu_type       VM cpu type (default "host")
    ci_user        cloud-init user (default "lab")
    ssh_keys       public key(s) for cloud-init, a string or a list
    gateway        IPv4 gateway for static addresses ("" = none)
    prefix_len     prefix length for static addresses (default 24; `subnet_prefix` is accepted too)
    client_address this machine's address as seen from the guests (default "")
    timeouts       {phase: seconds}: http 30, clone 600, config 60, start 120, stop 120,
                   destroy 300, ready 600 (when wait_ready gets no timeout), agent 60 (how long
                   to wait for the guest agent before falling back to the static address)
    lock_retries   retries on `can't lock file` / `VM is locked` (default 6)
    retry_backoff  first backoff in seconds, doubled per retry, capped at 30 (default 2.0)
    poll_interval  first task/agent poll interval (default 0.25); poll_max (default 2.0)

`token` and `password` may also be config references ("env:NAME", "file:/path"); they are then
resolved with lab.config.resolve_secret at construction. Unknown keys (e.g. `backend`, `source`,
`addresses`) are ignored. Secrets are kept in private attributes only; they never appear in
repr(), logs or exception messages.

Ownership: every VM carries the tags `lab` and `lab-run-<run id>` (PVE tag charset, lower case,
`;`-separated, valid on 7.x-9.x) and a description with `lab-run-id:`, `lab-cell:`, `lab-vm:` and
`lab-expires:` lines (already set by the clone call), so `lab gc` finds it even without the store.

Readiness: wait_ready() waits for `status/current` = running and an IPv4 address (guest agent
`network-get-interfaces` matched by net0's MAC, else the static address the cell configured). SSH
readiness is the caller's (lab.guest). TODO: ARP/neighbour table on the node as a third source;
real QEMU-backed tests; template publishing (upload + import-from); multi-node placement.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import quote, urlsplit

from lab.backends import register
from lab.errors import AuthError, BackendError, TeardownError, TimeoutError_, UnreachableError, UsageError
from lab.model import CloneKind, ImageRef, NicModel, Owned, Vm, VmSpec
from lab.wait import wait_until

log = logging.getLogger(__name__)

DEFAULT_TIMEOUTS = {"http": 30.0, "clone": 600.0, "config": 60.0, "start": 120.0, "stop": 120.0,
                    "destroy": 300.0, "ready": 600.0, "agent": 60.0}
LOCK_ERRORS = ("can't lock file", "VM is locked", "got timeout", "got lock request timeout")
EXISTS_ERRORS = ("already exists", "config file already exists")
GONE_ERRORS = ("does not exist",)
AGENT_NOT_YET = ("QEMU guest agent is not running", "is not running", "got timeout",
                 "No QEMU guest agent configured")
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
    address: str

    def argv(self, argv: list[str]) -> list[str]:
        return list(argv)


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
        self.storage = s.get("storage") or None
        self.bridge = s.get("bridge") or "vmbr0"
        self.template = s.get("template")
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
        self._template_vmid: int | None = None

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

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run one API call; translate transport and HTTP errors into lab errors (no secrets)."""
        import requests
        from proxmoxer.core import ResourceException

        try:
            return fn()
        except ResourceException as exc:
            reason = str(exc.content or "")
            if exc.errors is not None:  # proxmoxer appends " - {errors}" to the reason phrase
                reason = reason.removesuffix(f" - {exc.errors}")
            reason = reason.strip()
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
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
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
        vmid = self._resolve_template()
        try:
            cfg = self._guard(f"GET config of template {vmid}", lambda: self._nodeapi().qemu(vmid).config.get())
        except ApiError as exc:
            if exc.status == 500 and any(m in exc.reason for m in GONE_ERRORS + ("hostname lookup",)):
                raise UsageError(f"{self.host}: template {vmid} not found on node {self.node}: {exc.reason}",
                                 hint="check node and template for this host") from None
            raise
        if not cfg.get("template"):
            raise UsageError(f"{self.host}: VM {vmid} on node {self.node} is not a template",
                             hint="convert the golden VM to a template (linked clones need one)")

    def open_run(self, run_id: str) -> _Client:
        return _Client(self.client_address)

    def close_run(self, run_id: str) -> None:
        return None

    def facts(self) -> dict[str, object]:
        if not self._release:
            self.check()
        return {"hypervisor": "proxmox", "pve_release": self._release, "pve_version": self._version,
                "node": self.node, "cpu_type": self.cpu_type}

    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        if spec.nic not in self.nic_models:
            raise UsageError(f"{self.host}: NIC model {spec.nic} is not available on Proxmox")
        tmpl = self._resolve_template(image)
        full = spec.clone == CloneKind.FULL
        deadline = time.monotonic() + self.timeouts["clone"]
        with self._slot(self.storage if full else "template-storage", tmpl):
            vmid = self._clone_new_vmid(tmpl, spec, full, deadline)
        vm = Vm(spec=spec, backend=self.name, handle={"vmid": vmid, "node": self.node},
                facts={"clone": "full" if full else "linked", "template": tmpl})
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
        last = {"err": "no answer yet"}

        def agent_ip():
            try:
                res = self._guard(f"guest agent of VM {vmid}",
                                  lambda: api.agent("network-get-interfaces").get())
            except ApiError as exc:
                if any(m in exc.reason for m in AGENT_NOT_YET):
                    last["err"] = exc.reason
                    return None
                raise
            ip = _pick_ipv4(res.get("result", []) if isinstance(res, dict) else [], mac)
            if not ip:
                last["err"] = f"agent answers but reports no IPv4 for MAC {mac or '?'}"
            return ip

        remaining = max(0.0, timeout - (time.monotonic() - start))
        agent_budget = min(remaining, self.timeouts["agent"]) if static else remaining
        try:
            ip = wait_until(agent_ip, timeout=agent_budget,
                            what=f"{label} guest agent to report an IPv4 address for MAC {mac or '?'}",
                            interval=self.poll_interval, max_interval=self.poll_max,
                            detail=lambda: f"last: {last['err']}")
            source = "agent"
        except TimeoutError_:
            if not static:
                raise
            log.info("%s: guest agent silent (%s); using the static address %s", label, last["err"], static)
            ip, source = static, "static"
        vm.address = ip
        vm.facts["address_source"] = source
        return ip

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

    def list_owned(self) -> list[Owned]:
        res = self._guard("GET /cluster/resources", lambda: self._api().cluster.resources.get(type="vm"))
        owned = []
        for r in res:
            if r.get("type") != "qemu" or r.get("template"):
                continue
            tags = re.split(r"[;, ]", str(r.get("tags") or ""))
            name = str(r.get("name") or "")
            if "lab" not in tags and not name.startswith("lab-"):
                continue
            try:
                cfg = self._guard(f"config of VM {r['vmid']}",
                                  lambda: self._nodeapi(r["node"]).qemu(r["vmid"]).config.get())
            except ApiError:
                continue  # vanished meanwhile
            meta = _parse_description(str(cfg.get("description") or ""))
            if "lab" not in re.split(r"[;, ]", str(cfg.get("tags") or "")) and "lab-run-id" not in meta:
                continue  # a lab-like name alone is not ours
            owned.append(Owned(backend=self.name, kind="vm", name=name or meta.get("lab-vm", ""),
                               run_id=meta.get("lab-run-id", ""),
                               expires_at=float(meta.get("lab-expires", 0) or 0),
                               detail=f"{r['node']}/{r['vmid']}"))
        return owned

    def remove_owned(self, item: Owned) -> None:
        node, _, vmid = item.detail.partition("/")
        try:
            self._destroy_vmid(int(vmid), node, item.name)
        except TeardownError:
            raise
        except Exception as exc:
            raise TeardownError(f"{self.host}: could not remove VM {vmid} ({item.name}): {exc}") from None

    # --- helpers -----------------------------------------------------------------------------

    def _slot(self, storage: str | None, tmpl: int) -> threading.BoundedSemaphore:
        key = (storage, tmpl)
        with self._slots_lock:
            if key not in self._slots:
                self._slots[key] = threading.BoundedSemaphore(self.concurrency)
            return self._slots[key]

    def _resolve_template(self, image: ImageRef | None = None) -> int:
        want = self.template if self.template not in (None, "") else (image.name if image else None)
        if want is None:
            raise UsageError(f"{self.host}: no template configured",
                             hint="set template = <vmid or name> for this host")
        if isinstance(want, int) or str(want).isdigit():
            return int(want)
        if self._template_vmid is not None and self.template:
            return self._template_vmid
        res = self._guard("GET /cluster/resources", lambda: self._api().cluster.resources.get(type="vm"))
        hits = [r for r in res if r.get("template") and r.get("name") == want and r.get("node") == self.node]
        if not hits:
            raise UsageError(f"{self.host}: no template named {want!r} on node {self.node}",
                             hint="publish the golden image as a PVE template first")
        vmid = int(hits[0]["vmid"])
        if self.template:
            self._template_vmid = vmid
        return vmid

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

    def _clone_new_vmid(self, tmpl: int, spec: VmSpec, full: bool, deadline: float) -> int:
        src = self._nodeapi().qemu(tmpl)
        # the description rides on the clone already, so `lab gc` finds a VM even if we die before
        # configuring it (tags come with the config)
        params: dict[str, Any] = {"name": _dns_name(spec.name), "full": _bool(full),
                                  "description": _description(spec)}
        if full and self.storage:
            params["storage"] = self.storage
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
                self._cleanup_failed_clone(vmid, spec.name)
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
            except BaseException:
                self._cleanup_failed_clone(vmid, spec.name)
                self._forget(vmid)
                raise

    def _forget(self, vmid: int) -> None:
        with self._reserved_lock:
            self._reserved.discard(vmid)

    def _cleanup_failed_clone(self, vmid: int, name: str) -> None:
        """PVE removes the config of a failed clone itself; make sure nothing of ours is left."""
        try:
            cfg = self._guard(f"config of VM {vmid}", lambda: self._nodeapi().qemu(vmid).config.get())
        except Exception:
            return  # gone (the normal case) or unreadable
        if cfg.get("name") == _dns_name(name):
            try:
                self._destroy_vmid(vmid, self.node, name)
            except Exception as exc:
                log.warning("%s: leftover VM %d of a failed clone: %s", self.host, vmid, exc)

    def _configure(self, vm: Vm) -> None:
        spec = vm.spec
        vmid = vm.handle["vmid"]
        api = self._nodeapi().qemu(vmid)
        net = f"model={spec.nic.value},bridge={self.bridge}"
        if spec.mac:
            net += f",macaddr={spec.mac.upper()}"
        params: dict[str, Any] = {"net0": net, "cores": int(spec.vcpus), "sockets": 1,
                                  "memory": str(int(spec.memory_mib)), "cpu": self.cpu_type,
                                  "agent": "enabled=1", "ciuser": self.ci_user,
                                  "tags": ";".join(["lab", "lab-run-" + _tag(spec.run_id)]),
                                  "description": _description(spec)}
        if self.ssh_keys:
            params["sshkeys"] = quote("\n".join(self.ssh_keys), safe="")  # %20, never '+'
        static = ""
        if spec.ip:
            addr = spec.ip if "/" in spec.ip else f"{spec.ip}/{self.prefix_len}"
            try:
                ipaddress.IPv4Interface(addr)
            except ValueError:
                raise UsageError(f"{self.host}: VM {spec.name}: bad static address {spec.ip!r}") from None
            static = addr.split("/")[0]
            params["ipconfig0"] = f"ip={addr}" + (f",gw={self.gateway}" if self.gateway else "")
        else:
            params["ipconfig0"] = "ip=dhcp"
        if not self._release:
            self._release = str(self._guard("GET /version", lambda: self._api().version.get()).get("release", ""))
        if self._release and int(self._release.split(".")[0]) >= 8:
            params["ciupgrade"] = 0  # 8.x+: skip the first-boot package upgrade
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
