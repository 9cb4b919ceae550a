"""Who calls, and what they may do: API tokens (privilege-separated or not), ticket login with CSRF,
tickets that expire, 401s delayed like pveproxy's, and the schema's permission rules evaluated
against path ACLs (403 `Permission check failed (/vms/100, VM.Clone)`)."""

from __future__ import annotations

import re
import secrets
import time
from typing import TYPE_CHECKING
from urllib.parse import unquote

from .state import ALL, Principal, PveError, handler

if TYPE_CHECKING:
    from .server import PveEmulator


def authenticate(emu: PveEmulator, method: str, info: dict, headers) -> Principal | None:
    """The caller of a request (None for the schema's `world` calls); 401 or 403 otherwise."""
    perms = info.get("permissions") or {}
    if perms.get("user") == "world":
        return None
    auth = headers.get("Authorization") or ""
    cookie = headers.get("Cookie") or ""
    if auth.startswith("PVEAPIToken="):
        m = re.fullmatch(r"PVEAPIToken=([^!=\s]+![^=\s]+)[=:](\S+)", auth)
        entry = emu._tokens.get(m.group(1)) if m else None
        if entry is None or not secrets.compare_digest(entry[0], m.group(2)):
            unauthorized(emu, "Authentication failed!")
        if not info.get("allowtoken", 1):
            raise PveError(403, "Permission check failed (API tokens are not allowed here)")
        return entry[1]
    m = re.search(r"PVEAuthCookie=([^;]+)", cookie)
    if m:
        entry = emu._tickets.get(unquote(m.group(1)))
        if entry is None or time.monotonic() - entry[2] > emu.ticket_lifetime:
            unauthorized(emu, "Authentication failed!")  # unknown or expired ticket
        if method != "GET" and headers.get("CSRFPreventionToken") != entry[0]:
            unauthorized(emu, "Permission denied - invalid csrf token")
        return entry[1]
    unauthorized(emu, "No ticket")


def unauthorized(emu: PveEmulator, message: str):
    emu._stopping.wait(emu.auth_delay)  # pveproxy: "always delay unauthorized calls"
    raise PveError(401, message)


def check_permissions(perms: dict, params: dict, who: Principal) -> None:
    """The method's `permissions.check` rule (perm/and/or) for `who`; 403 naming path and privilege."""
    if perms.get("user") in ("all", "world") or "check" not in perms:
        return
    _eval_check(perms["check"], params, who, noerr=False)


def _eval_check(check: list, params: dict, who: Principal, noerr: bool) -> bool:
    kind = check[0]
    if kind == "and":
        return all(_eval_check(c, params, who, noerr) for c in check[1:])
    if kind == "or":
        if any(_eval_check(c, params, who, True) for c in check[1:]):
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


def require(who: Principal | None, path: str, priv: str) -> None:
    """A check a handler makes itself (beyond the schema's rule), in PVE's 403 wording."""
    if who is not None and not who.has(path, priv):
        raise PveError(403, f"Permission check failed ({path}, {priv})")


@handler("POST", "/access/ticket")
def _ticket(emu: PveEmulator, p, who):
    entry = emu._users.get(p["username"])
    renew = emu._tickets.get(p["password"])  # renewal: the current ticket as the password
    if renew is not None and renew[1].userid == p["username"] and time.monotonic() - renew[2] <= emu.ticket_lifetime:
        entry = (p["password"], renew[1])
    if entry is None or not secrets.compare_digest(entry[0], p["password"]):
        emu._lock.release()  # the 401 delay is not spent holding the state lock
        try:
            unauthorized(emu, "authentication failure")
        finally:
            emu._lock.acquire()
    ticket = f"PVE:{p['username']}:{int(time.time()):08X}::{secrets.token_hex(16)}"
    csrf = f"{int(time.time()):08X}:{secrets.token_hex(12)}"
    emu._tickets[ticket] = (csrf, entry[1], time.monotonic())
    return {"ticket": ticket, "CSRFPreventionToken": csrf, "username": p["username"], "cap": {}}


# The privileges root@pam has everywhere (pve-access-control's roles, 7.4-9.x; SDN.Use from 8.0,
# VM.GuestAgent.* from 9.0, VM.Monitor until 8.x)
PRIVILEGES = (
    "Datastore.Allocate",
    "Datastore.AllocateSpace",
    "Datastore.AllocateTemplate",
    "Datastore.Audit",
    "Group.Allocate",
    "Mapping.Audit",
    "Mapping.Modify",
    "Mapping.Use",
    "Permissions.Modify",
    "Pool.Allocate",
    "Pool.Audit",
    "Realm.Allocate",
    "Realm.AllocateUser",
    "SDN.Allocate",
    "SDN.Audit",
    "SDN.Use",
    "Sys.Audit",
    "Sys.Console",
    "Sys.Incoming",
    "Sys.Modify",
    "Sys.PowerMgmt",
    "Sys.Syslog",
    "User.Modify",
    "VM.Allocate",
    "VM.Audit",
    "VM.Backup",
    "VM.Clone",
    "VM.Config.CDROM",
    "VM.Config.CPU",
    "VM.Config.Cloudinit",
    "VM.Config.Disk",
    "VM.Config.HWType",
    "VM.Config.Memory",
    "VM.Config.Network",
    "VM.Config.Options",
    "VM.Console",
    "VM.GuestAgent.Audit",
    "VM.GuestAgent.Unrestricted",
    "VM.Migrate",
    "VM.Monitor",
    "VM.PowerMgmt",
    "VM.Snapshot",
    "VM.Snapshot.Rollback",
)


@handler("GET", "/access/permissions")
def _permissions(emu: PveEmulator, p, who):
    """The caller's effective privileges: path -> {privilege: propagate (1)}, as pve-access-control
    dumps them (every ACL path; with `path`, that path alone). Another user's needs Sys.Audit on
    /access (not modelled: refused)."""
    if who is None:
        return {}
    if p.get("userid") not in (None, who.userid):
        raise PveError(403, "Permission check failed (/access, Sys.Audit)")
    if who.acl is ALL:
        paths = {"/": set(PRIVILEGES)}
    else:
        paths = {path: set(privs) for path, privs in who.acl.items()}
    if "path" in p:
        have = who.privs_at(p["path"])
        paths = {p["path"]: set(PRIVILEGES) if have is ALL else set(have)}
    return {path: {priv: 1 for priv in sorted(privs)} for path, privs in paths.items() if privs}
