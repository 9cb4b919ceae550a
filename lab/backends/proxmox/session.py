"""One conversation with a PVE cluster's API (proxmoxer over HTTPS): who we are (token or ticket),
TLS (the system's CAs, the cluster's CA in ca_file, or the node certificate's pinned fingerprint:
lab.backends.proxmox.tls), the guard that turns every transport and HTTP error into one lab error without a secret,
waiting for a task by its UPID, and waiting where PVE asks us to.

Two kinds of call: `call` sends once (a POST that creates something is never repeated blindly: its
caller looks for what it may have made), `get` and `call(..., until=)` are idempotent and are
retried on a lost connection, a 5xx or a lock timeout with bounded exponential backoff and jitter,
until the operation's deadline.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from lab.backends.proxmox import tls
from lab.backends.proxmox.settings import Settings
from lab.errors import AuthError, BackendError, HostUnreachable, LabError, UsageError
from lab.secrets import resolve_secret
from lab.wait import wait_until

log = logging.getLogger(__name__)

# PVE's words for "someone else holds it; try again": a VM's config lock, a file lock's timeout,
# the cluster filesystem's lock (pmxcfs) under concurrent allocations
LOCK_ERRORS = ("can't lock file", "VM is locked", "got timeout", "got lock request timeout", "cfs-lock")
GONE_ERRORS = ("does not exist",)
# 5xx that say "not now" rather than "no": a proxy or node that cannot be reached (595: pveproxy
# could not reach the node), a gateway or a service in trouble
TRANSIENT_STATUS = frozenset({502, 503, 504, 595, 596, 599})
BACKOFF_MAX = 30.0
LOGIN_RETRY = 5.0  # seconds a login is retried on a lost connection


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


def failure_text(exc: ApiError | TaskFailed) -> str:
    """What PVE said: a failed task's exit status, or an HTTP error's reason phrase."""
    return exc.exitstatus if isinstance(exc, TaskFailed) else exc.reason


def is_lock_error(exc: BaseException) -> bool:
    return isinstance(exc, (ApiError, TaskFailed)) and any(m in failure_text(exc) for m in LOCK_ERRORS)


def is_gone(exc: BaseException) -> bool:
    return isinstance(exc, (ApiError, TaskFailed)) and any(m in failure_text(exc) for m in GONE_ERRORS)


def is_transient(exc: BaseException) -> bool:
    """Worth another try of an idempotent call: the connection was lost or timed out, a node or
    proxy could not be reached, or a lock was held by someone else."""
    if isinstance(exc, HostUnreachable):
        return True
    if isinstance(exc, ApiError):
        return exc.status in TRANSIENT_STATUS or (exc.status >= 500 and exc.status != 501 and is_lock_error(exc))
    return is_lock_error(exc)


def remaining(deadline: float) -> float:
    """Seconds left until a monotonic deadline (at least 1: a call always gets a chance)."""
    return max(1.0, deadline - time.monotonic())


@dataclass(frozen=True)
class Credentials:
    """Who the lab is on the cluster. The secret is left out of repr(); messages name `principal`."""

    principal: str  # user@realm, or user@realm!tokenid
    user: str
    token_name: str | None
    secret: str = field(repr=False)

    @classmethod
    def resolve(cls, host: str, settings: Settings, source: str) -> Credentials:
        """The references of `settings` read now (lab.secrets); errors never show a value."""
        for _key, _value, problem in settings.problems():
            raise UsageError(f"{host}: {problem}")
        if settings.token:
            token = resolve_secret(settings.token, source, f"hosts.{host}.token") or ""
            m = re.fullmatch(r"([^!\s]+@[^!\s]+)!([^=\s]+)=(\S+)", token)
            if not m:
                raise UsageError(f"{host}: token must look like user@realm!tokenid=SECRET (value not shown)")
            return cls(f"{m.group(1)}!{m.group(2)}", m.group(1), m.group(2), m.group(3))
        password = resolve_secret(settings.password, source, f"hosts.{host}.password") or ""
        return cls(str(settings.user), str(settings.user), None, password)

    @property
    def kind(self) -> str:
        return "token" if self.token_name else "user"

    def login(self) -> dict[str, str]:
        """proxmoxer's keyword arguments."""
        if self.token_name:
            return {"user": self.user, "token_name": self.token_name, "token_value": self.secret}
        return {"user": self.user, "password": self.secret}


class Session:
    """The API of one host, one proxmoxer client per thread (a requests session is not thread-safe)."""

    def __init__(self, host: str, settings: Settings, credentials: Credentials):
        self.host, self.settings, self.credentials = host, settings, credentials
        self.url = settings.url
        self._host_port = urlsplit(settings.url).netloc
        self._verify: bool | str = (settings.ca_file or True) if settings.verify_tls else False
        self._local = threading.local()
        self._version: dict[str, str] | None = None

    def __repr__(self) -> str:
        return f"Session(host={self.host!r}, url={self.url!r}, auth={self.credentials.principal!r})"

    # -- calls ------------------------------------------------------------------------------------
    def api(self):
        api = getattr(self._local, "api", None)
        if api is None:
            from proxmoxer import ProxmoxAPI  # proxmoxer loads only when a Proxmox host is used
            from proxmoxer.core import AuthenticationError

            def connect():
                if self.settings.fingerprint:
                    c = self.credentials
                    return tls.pinned_api(
                        self._host_port,
                        self.settings.fingerprint,
                        timeout=self.settings.timeouts.http,
                        user=c.user,
                        token_name=c.token_name,
                        secret=c.secret,
                    )
                return ProxmoxAPI(
                    self._host_port,
                    backend="https",
                    verify_ssl=self._verify,
                    timeout=self.settings.timeouts.http,
                    **self.credentials.login(),
                )

            try:  # a ticket login creates nothing but a ticket: safe to repeat
                api = self.call("login", connect, until=time.monotonic() + LOGIN_RETRY)
            except AuthenticationError as exc:  # the ticket login was refused
                code = re.search(r"code: (\d+)", str(exc))
                raise AuthError(
                    f"{self.host}: authentication failed ({code.group(1) if code else '?'}) "
                    f"for user {self.credentials.principal}",
                    hint="check user and password",
                ) from None
            self._local.api = api
        return api

    def node(self, name: str):
        return self.api().nodes(name)

    def qemu(self, node: str, vmid: int):
        return self.api().nodes(node).qemu(vmid)

    def call(self, what: str, fn: Callable[[], Any], *, until: float | None = None) -> Any:
        """Run one API call; transport and HTTP errors become lab errors naming `what` (no secrets).
        With `until` (a monotonic deadline) the call is idempotent: a lost connection, a 5xx or a
        lock timeout is retried after a backoff until then. Without, it is sent once."""
        pauses = self.backoffs(until) if until is not None else iter(())
        attempt = 0
        while True:
            try:
                return self._call_once(what, fn)
            except LabError as exc:
                delay = next(pauses, None) if is_transient(exc) else None
                if delay is None:
                    raise
                attempt += 1
                log.info("%s: %s: %s; retry %d in %.2f s", self.host, what, exc, attempt, delay)
                time.sleep(delay)  # a backoff between attempts, not a polling loop

    def get(self, what: str, resource, *, until: float | None = None, **params) -> Any:
        """GET `resource`, retried on transient failures until `until` (default: timeouts.retry)."""
        until = until if until is not None else time.monotonic() + self.settings.timeouts.retry
        return self.call(what, lambda: resource.get(**params), until=until)

    def _call_once(self, what: str, fn: Callable[[], Any], *, relogin: bool = True) -> Any:
        import requests
        from proxmoxer.core import AuthenticationError, ResourceException

        try:
            return fn()
        except ResourceException as exc:
            reason = str(exc.content or "")
            if exc.errors is not None:  # proxmoxer appends " - {errors}" to the reason phrase
                reason = reason.removesuffix(f" - {exc.errors}")
            reason = reason.strip()
            who = self.credentials.principal
            if exc.status_code == 401 and relogin and not self.credentials.token_name:
                # the ticket expired (PVE: 2 h; proxmoxer renews only by its own clock): log in
                # again, in place, so every resource object of this session gets the new ticket
                log.info("%s: ticket refused (%s); logging in again", self.host, reason)
                try:
                    self.api()._backend.auth._get_new_tokens(password=self.credentials.secret)
                except AuthenticationError:
                    raise AuthError(
                        f"{self.host}: authentication failed (401) for user {who}", hint="check the user and password"
                    ) from None
                return self._call_once(what, fn, relogin=False)
            if exc.status_code == 401:
                raise AuthError(
                    f"{self.host}: authentication failed (401) for {self.credentials.kind} {who}",
                    hint="check the token/password and that it is not expired",
                ) from None
            if exc.status_code == 403:
                raise AuthError(
                    f"{self.host}: {who} lacks a privilege: {reason} ({what})",
                    hint="grant the privilege on that path to the token (privsep tokens need their own ACLs)",
                ) from None
            detail = reason
            if exc.errors:
                detail += " " + "; ".join(f"{k}: {str(v).strip()}" for k, v in dict(exc.errors).items())
            raise ApiError(f"{self.host}: {what} failed: {exc.status_code} {detail}", exc.status_code, reason) from None
        except requests.exceptions.SSLError as exc:  # the CA, the pin (or the URL's host name) is wrong: exit 2
            raise self._tls_error(exc) from None
        except requests.exceptions.Timeout as exc:
            raise HostUnreachable(
                f"{self.host}: {what}: no answer from {self.url} within "
                f"{self.settings.timeouts.http:g} s: {_short(exc)}",
                hint="raise timeouts.http for this host",
            ) from None
        except requests.exceptions.ConnectionError as exc:
            raise HostUnreachable(f"{self.host}: {what}: cannot reach {self.url}: {_short(exc)}") from None
        except requests.exceptions.RequestException as exc:  # e.g. cut off mid-answer
            raise HostUnreachable(
                f"{self.host}: {what}: the answer from {self.url} was cut off: {type(exc).__name__}"
            ) from None

    def _tls_error(self, exc: Exception) -> AuthError:
        """A TLS failure as one line: the fingerprint seen when a pin did not match, else why the
        certificate was not trusted. Each hint says how to trust the right certificate."""
        seen = tls.seen_in(exc)
        if seen is not None:
            return AuthError(
                f"{self.host}: the TLS certificate of {self.url} has fingerprint {seen}, not the "
                f"pinned {self.settings.fingerprint}",
                hint="if the node's certificate was renewed, compare the new fingerprint with the one "
                "PVE shows (Node > System > Certificates) before pinning it",
            )
        return AuthError(
            f"{self.host}: TLS verification failed for {self.url}: {_short(exc)}",
            hint="set ca_file to this cluster's CA (/etc/pve/pve-root-ca.pem on a node), or pin "
            'the node\'s certificate with fingerprint = "sha256:…" as PVE shows it',
        )

    def version(self, *, until: float | None = None) -> dict[str, str]:
        """GET /version, once: {"release": "8.4", "version": "8.4.1", ...}."""
        if self._version is None:
            got = self.get("GET /version", self.api().version, until=until)
            self._version = {k: str(v) for k, v in got.items()}
        return self._version

    def release(self) -> tuple[int, ...]:
        """(8, 4) of PVE 8.4; () when the answer has no release."""
        text = self.version().get("release", "")
        return tuple(int(x) for x in text.split(".")) if re.fullmatch(r"\d+(\.\d+)*", text) else ()

    # -- tasks ------------------------------------------------------------------------------------
    def wait_task(self, upid: str, *, timeout: float, what: str) -> dict:
        """Wait for a worker task on the UPID's own node; TaskFailed carries its exit status and log tail.
        A lost connection while polling is retried until the wait's own end."""
        node = upid_node(upid) or self.settings.node
        task = self.node(node).tasks(upid)
        deadline = time.monotonic() + timeout

        def done():
            st = self.get(f"task status of {what}", task.status, until=deadline)
            return st if st.get("status") == "stopped" else None

        status = wait_until(
            done,
            timeout=timeout,
            what=f"{self.host}: {what} (task {upid})",
            interval=self.settings.poll_interval,
            max_interval=self.settings.poll_max,
        )
        exitstatus = str(status.get("exitstatus", ""))
        if exitstatus == "OK" or re.fullmatch(r"WARNINGS: \d+", exitstatus):
            return status
        tail: list[str] = []
        try:
            lines = self.get(
                "task log", task.log, until=time.monotonic() + self.settings.timeouts.http, start=0, limit=500
            )
            tail = [str(x.get("t", "")) for x in lines][-10:]
        except LabError:
            pass
        raise TaskFailed(f"{self.host}: {what} failed: {exitstatus}", exitstatus, tail)

    def run_task(self, what: str, post: Callable[[], str], *, deadline: float, idempotent: bool = False) -> dict:
        """POST something that answers with a UPID, and wait for that task until `deadline`."""
        upid = self.call(what, post, until=deadline if idempotent else None)
        return self.wait_task(upid, timeout=remaining(deadline), what=what)

    # -- retries ------------------------------------------------------------------------------------
    def backoffs(self, deadline: float, limit: int | None = None) -> Iterator[float]:
        """The pauses between attempts: from retry_backoff, doubled up to BACKOFF_MAX, each with
        jitter (between half and all of it, so that clients refused together do not come back
        together), never past `deadline`; at most `limit` of them."""
        delay = self.settings.retry_backoff
        n = 0
        while limit is None or n < limit:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            yield min(left, delay * random.uniform(0.5, 1.0))
            n += 1
            delay = min(delay * 2, BACKOFF_MAX)

    def retrying(self, what: str, fn: Callable[[], Any], *, deadline: float, limit: int | None = None) -> Any:
        """fn (several calls that are safe to repeat), again after a backoff while it fails with
        something transient (a lock held by someone else, a lost connection), until `deadline`
        and at most `limit` times."""
        pauses = self.backoffs(deadline, limit)
        attempt = 0
        while True:
            try:
                return fn()
            except LabError as exc:
                delay = next(pauses, None) if is_transient(exc) else None
                if delay is None:
                    raise
                attempt += 1
                text = failure_text(exc) if isinstance(exc, (ApiError, TaskFailed)) else str(exc)
                log.info("%s: %s: %s; retry %d in %.2f s", self.host, what, text, attempt, delay)
                time.sleep(delay)  # a backoff between attempts, not a polling loop


def upid_node(upid: str) -> str:
    """The node a task runs on, from its UPID (UPID:node:pid:pstart:start:type:id:user:)."""
    return upid.split(":")[1] if upid.count(":") >= 8 else ""


def _short(exc: Exception) -> str:
    """The useful part of a requests error (its text holds the whole URL and object reprs)."""
    text = str(exc)
    m = re.search(r"\[SSL[^\]]*\][^')\"]*", text)
    if m:
        return m.group(0).strip()
    m = re.search(
        r"(Connection refused|Name or service not known|timed out|No route to host|Connection reset"
        r"|Remote end closed connection without response)",
        text,
    )
    return m.group(1) if m else type(exc).__name__
