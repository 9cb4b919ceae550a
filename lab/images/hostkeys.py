"""The golden image's SSH host keys: read from the image at build, recorded in its manifest
(`ssh_host_keys`), and handed to whoever logs in as known_hosts lines, so that a guest is checked
against the keys its image was built with instead of trusting whatever answers at its address.

Every clone of an image has the image's host keys: they are made once, when openssh-server is
installed into the image (Debian: its postinst in mmdebstrap; the ISO-installed OSes: sshd's first
start during provisioning), and nothing in the image makes new ones at boot (no cloud-init, no
first-boot unit; the lab's own cidata reader adds authorized keys only).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from lab.errors import LabError
from lab.images.keys import key_fingerprint
from lab.images.recipes import recipe
from lab.model import ImageRef

MANIFEST_KEY = "ssh_host_keys"


def parse_public_key(line: str) -> dict[str, str]:
    """One OpenSSH public key line ("type base64 [comment]") -> {type, key, fingerprint}."""
    parts = line.split()
    if len(parts) < 2 or not parts[0].startswith(("ssh-", "ecdsa-", "sk-")):
        raise ValueError(f"not an OpenSSH public key line: {line[:60]!r}")
    return {"type": parts[0], "key": parts[1], "fingerprint": key_fingerprint(line)}


def read_host_keys(etc_ssh: Path) -> list[dict[str, str]]:
    """The host keys in an image's /etc/ssh (ssh_host_*_key.pub), by type. LabError if there are none:
    an image whose sshd has no key to offer cannot be logged into."""
    keys = sorted(
        (parse_public_key(p.read_text()) for p in etc_ssh.glob("ssh_host_*_key.pub")), key=lambda k: k["type"]
    )
    if not keys:
        raise LabError(
            f"the image has no SSH host key in {etc_ssh}",
            hint="openssh-server makes them when it is installed; is it in the recipe?",
        )
    return keys


def host_keys_from_report(lines: object) -> list[dict[str, str]] | None:
    """The host keys a guest's version report lists (public key lines), or None when the report
    has none (provisioning scripts older than the field)."""
    if not isinstance(lines, list) or not lines:
        return None
    return sorted((parse_public_key(str(line)) for line in lines), key=lambda k: k["type"])


def host_keys(image: ImageRef) -> list[dict[str, str]]:
    """The host keys recorded in the image's manifest. An image built before they were recorded
    is refused with one line: its clones cannot be checked, rebuild it."""
    keys = (image.manifest or {}).get(MANIFEST_KEY)
    if not isinstance(keys, list) or not keys:
        how = (
            f"lab images build {image.name} --force"
            if recipe(image.name).kind == "debootstrap"
            else f"lab images build {image.name} --force (with provisioning that reports the host keys)"
        )
        raise LabError(
            f"image {image.name!r} was built before the lab recorded its SSH host keys: "
            "its guests' identity cannot be checked",
            hint=f"rebuild it: `{how}`",
        )
    return keys


def known_hosts(image: ImageRef, hosts: Iterable[str], port: int = 22) -> str:
    """known_hosts lines that let OpenSSH check a clone of `image` at each of `hosts` (addresses,
    or a HostKeyAlias) with StrictHostKeyChecking=yes. A port other than 22 is written as
    OpenSSH writes it ("[address]:port"); with HostKeyAlias, OpenSSH looks up the alias alone."""
    keys = host_keys(image)
    hosts = list(hosts)
    if not hosts or any(not h or any(c.isspace() or c in ",#[]" for c in h) for h in hosts):
        raise LabError(f"known_hosts for image {image.name!r}: no usable host name in {hosts!r}")
    pattern = ",".join(h if port == 22 else f"[{h}]:{port}" for h in hosts)
    return "".join(f"{pattern} {k['type']} {k['key']}\n" for k in keys)
