"""What a lab.toml may make the lab run: one rule, checked as lab.toml is read.

A lab.toml is trusted like a Makefile: whoever writes it chooses the hosts the lab reaches as
root, so it may say how to reach them, and that may run programs here. The rule is that a program
runs only through a setting whose documented purpose is to run one, where a reader of the file
sees it: **ssh's own arguments and options** (`ssh` of a libvirt host, `ssh_options` of a SmartOS
host, `node_ssh`, `client = "ssh:..."`), with everything ssh itself runs from them (a
`ProxyCommand` or `ProxyJump` through a bastion, the user's ssh_config). A setting that reads as
an address, a path or a name never names a program: a libvirt URI is an address, so its `ext`
transport (which exists to run a command) and its parameters that name programs (`command`, the
local ssh binary; `netcat`, a command line run on the remote host) are refused, and so are the
parameters that turn a check off (`no_verify`: TLS or host-key verification; `known_hosts_verify`
other than "normal"), and any parameter libvirt does not document (it passes those on to the
driver unread). A results store is never trusted at all: nothing read from one reaches a shell, a
Vagrantfile or a script unescaped (lab.reproduce, lab.names).
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

# libvirt's documented URI parameters (https://libvirt.org/uri.html) that name no program and
# weaken no check, with the values they may take (None: any value)
LIBVIRT_URI_PARAMETERS: dict[str, frozenset[str] | None] = {
    "keyfile": None,  # the ssh identity file
    "known_hosts": None,  # libssh/libssh2: the known_hosts file to check the host key with
    "sshauth": None,  # libssh/libssh2: the authentication methods, in order
    "no_tty": frozenset({"0", "1"}),  # ssh: never ask for a password
    "mode": frozenset({"auto", "direct", "legacy"}),  # per-driver daemons or libvirtd
    "proxy": frozenset({"auto", "netcat", "native"}),  # which of libvirt's own proxies the remote side runs
    "socket": None,  # the daemon's unix socket path
    "pkipath": None,  # tls: the client's certificates
    "tls_priority": None,  # tls: a GnuTLS priority string
    "known_hosts_verify": frozenset({"normal"}),  # "auto" and "ignore" accept any host key
}
# parameters refused, and why (the others are refused as not documented)
LIBVIRT_URI_REFUSED = {
    "command": "names a program for this machine to run (the ssh binary, or the ext transport's command)",
    "netcat": "names a program for the remote host to run",
    "no_verify": "turns off the host's certificate or host-key check",
    "name": "names another driver URI for the remote side than the one lab drives",
}


def libvirt_uri_problem(uri: str) -> str | None:
    """Why a libvirt URI may not be used (None: it may): an `ext` transport, a parameter that
    names a program or turns a check off, one libvirt does not document, a value outside a
    parameter's choices, or a password in its user-info."""
    parts = urlsplit(uri)
    if parts.scheme.lower().partition("+")[2] == "ext":
        return "the ext transport runs a program named in the URI: a lab.toml may not name one there"
    if parts.password is not None:
        return "a password in the URI; libvirt reads credentials from its auth.conf, and lab keeps secrets out of URIs"
    try:
        params = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        return "its query is not a list of NAME=VALUE parameters"
    for key, value in params:
        if key in LIBVIRT_URI_REFUSED:
            return f"URI parameter {key!r} {LIBVIRT_URI_REFUSED[key]}: a lab.toml may not set it"
        if key not in LIBVIRT_URI_PARAMETERS:
            known = ", ".join(sorted(LIBVIRT_URI_PARAMETERS))
            return f"URI parameter {key!r} is not one lab passes to libvirt; allowed: {known}"
        allowed = LIBVIRT_URI_PARAMETERS[key]
        if allowed is not None and value not in allowed:
            return f"URI parameter {key}={value!r} is not one of {', '.join(sorted(allowed))}"
    return None
