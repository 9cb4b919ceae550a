"""TLS to a PVE API pinned to the node certificate's fingerprint (`fingerprint = "sha256:AB:CD:…"`
in [hosts.NAME], as PVE's GUI shows it under Node → System → Certificates).

A pin replaces the CA check: a node's own certificate is signed by its cluster's private CA and
often names no address the lab connects to, so the certificate must simply be the pinned one,
byte for byte (its SHA-256). urllib3 checks that on every connection it opens (assert_fingerprint),
whatever `verify` the caller passes, and a mismatch is an SSLError naming the fingerprint it saw.
Every request goes through a pinned requests session: the API calls, and the ticket login, which
proxmoxer would otherwise send through a session of its own.

Light on purpose: requests and proxmoxer load only when a pinned host is used.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

FINGERPRINT = re.compile(r"(?:sha256:)?((?:[0-9A-Fa-f]{2}:){31}[0-9A-Fa-f]{2}|[0-9A-Fa-f]{64})")


def normalise(text: str) -> str | None:
    """Pure: a SHA-256 fingerprint as PVE shows it ("sha256:AB:CD:…"), from that form, without
    the "sha256:" prefix, in lower case or without colons; None if it is not one."""
    m = FINGERPRINT.fullmatch(text.strip())
    if m is None:
        return None
    digits = m.group(1).replace(":", "").upper()
    return "sha256:" + ":".join(digits[i : i + 2] for i in range(0, 64, 2))


def of_certificate(der: bytes) -> str:
    """Pure: the fingerprint of a DER certificate."""
    return normalise(hashlib.sha256(der).hexdigest()) or ""


def seen_in(error: BaseException) -> str | None:
    """The fingerprint urllib3 saw, from its mismatch error ('Fingerprints did not match.
    Expected "…", got "…"'), as PVE shows it; None for another TLS error."""
    m = re.search(r'[Ff]ingerprints did not match.*got "?([0-9a-fA-F]{64})', str(error))
    return normalise(m.group(1)) if m else None


def _hex(fingerprint: str) -> str:
    return fingerprint.removeprefix("sha256:").replace(":", "").lower()


def pinned_adapter(fingerprint: str):
    """A requests transport adapter that accepts exactly the certificate of `fingerprint`."""
    from requests.adapters import HTTPAdapter

    pin = _hex(fingerprint)

    class PinnedAdapter(HTTPAdapter):
        def build_connection_pool_key_attributes(self, request, verify, cert=None):
            host_params, pool_kwargs = super().build_connection_pool_key_attributes(request, False, cert)
            pool_kwargs.update(cert_reqs="CERT_NONE", assert_fingerprint=pin)  # the pin, not a CA
            return host_params, pool_kwargs

        def cert_verify(self, conn, url, verify, cert):
            super().cert_verify(conn, url, False, cert)
            conn.assert_fingerprint = pin

    return PinnedAdapter()


def pinned_session(fingerprint: str):
    """A requests session whose every https request is pinned to `fingerprint`."""
    import requests

    session = requests.Session()
    session.mount("https://", pinned_adapter(fingerprint))
    return session


def pinned_api(host_port: str, fingerprint: str, *, timeout: float, user: str, token_name: str | None, secret: str):
    """A proxmoxer client whose requests, the ticket login and its renewals included, all go
    through sessions pinned to `fingerprint`. Raises proxmoxer's AuthenticationError when the
    login is refused, and requests' errors (SSLError on a mismatch) as proxmoxer would."""
    from proxmoxer import ProxmoxAPI
    from proxmoxer.backends.https import ProxmoxHTTPAuth
    from proxmoxer.core import AuthenticationError

    class PinnedTicketAuth(ProxmoxHTTPAuth):
        """proxmoxer's ticket login (and renewal), sent through the pinned session."""

        def __init__(self, session, **kwargs):
            self._pinned = session
            super().__init__(**kwargs)

        def _get_new_tokens(self, password=None, otp=None, otptype=None):
            password = self.pve_auth_ticket if password is None else password  # a renewal: the ticket itself
            url = self.base_url + "/access/ticket"
            response = self._pinned.post(
                url, timeout=self.timeout, data={"username": self.username, "password": password}
            )
            if response.status_code != 200:
                raise AuthenticationError(
                    f"Couldn't authenticate user: {self.username} to {url} code: {response.status_code}"
                )
            data = response.json()["data"]
            if data.get("NeedTFA") is not None:
                raise AuthenticationError(
                    f"Couldn't authenticate user: {self.username}: two-factor login "
                    "is not supported (use an API token) code: 401"
                )
            self.birth_time = time.monotonic()
            self.pve_auth_ticket, self.csrf_prevention_token = data["ticket"], data["CSRFPreventionToken"]

    # verify_ssl=False: the pinned adapter checks the certificate (and ignores `verify`); a token
    # client makes no request while it is built, so none leaves unpinned
    api = ProxmoxAPI(
        host_port,
        backend="https",
        verify_ssl=False,
        timeout=timeout,
        user=user,
        token_name=token_name or "login",
        token_value=secret if token_name else "-",
    )
    session: Any = api._store["session"]
    session.mount("https://", pinned_adapter(fingerprint))
    if token_name is None:  # a ticket: logged in now, through a pinned session
        auth = PinnedTicketAuth(
            pinned_session(fingerprint),
            username=user,
            password=secret,
            base_url=api._backend.get_base_url(),
            verify_ssl=False,
            timeout=timeout,
        )
        api._backend.auth = session.auth = auth
    return api
