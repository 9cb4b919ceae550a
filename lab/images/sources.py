"""Where an image's packages and installer come from: the Debian mirror this machine's apt already
uses, and the installer ISO (a local file, images/iso/, or the mirror Packer downloads from)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import lab
from lab import proc
from lab.errors import UsageError
from lab.images.recipes import IsoRecipe

DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_SECURITY_MIRROR = "http://deb.debian.org/debian-security"


def debian_mirrors(suite: str, sources: Iterable[Path] | None = None) -> list[str]:
    """mmdebstrap mirror lines for `suite`, reusing the Debian mirror this machine's apt uses
    (/etc/apt/sources.list and sources.list.d, one-line and deb822 forms). LAB_DEBIAN_MIRROR
    overrides the main archive."""
    main = os.environ.get("LAB_DEBIAN_MIRROR", "")
    security = ""
    if sources is None:
        d = Path("/etc/apt/sources.list.d")
        sources = [Path("/etc/apt/sources.list"), *sorted(d.glob("*.list")), *sorted(d.glob("*.sources"))]
    for uri, suites in _apt_entries(sources):
        if f"{suite}-security" in suites and not security:
            security = uri
        elif suite in suites and not main:
            main = uri
    main = (main or DEFAULT_MIRROR).rstrip("/")
    security = (security or DEFAULT_SECURITY_MIRROR).rstrip("/")
    return [f"deb {main} {suite} main", f"deb {main} {suite}-updates main", f"deb {security} {suite}-security main"]


def _apt_entries(sources: Iterable[Path]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":
            for stanza in text.split("\n\n"):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if ":" in line and not line.startswith(("#", " ")):
                        k, v = line.split(":", 1)
                        fields[k.strip().lower()] = v.strip()
                if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
                    for uri in fields.get("uris", "").split():
                        out.append((uri, fields.get("suites", "").split()))
        else:
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                if not line.startswith("deb "):
                    continue
                if "[" in line and "]" in line:  # deb [signed-by=...] URI SUITE COMPONENTS
                    line = line.split("[", 1)[0] + line.split("]", 1)[1]
                words = line.split()
                if len(words) >= 3:
                    out.append((words[1], [words[2]]))
    return out


ISO_CACHE = "iso"  # images/iso/<file name of the ISO URL>: a local copy, used instead of downloading


def packer_defaults(template: Path) -> dict[str, str]:
    """The template's variable defaults, as `packer inspect` prints them (`var.NAME: "value"`)."""
    # inspect prints values set through PKR_VAR_*: blank the secret so it cannot reach an error message.
    out = proc.run(
        ["packer", "inspect", "-machine-readable", template],
        timeout=60,
        what="packer inspect",
        env={"CHECKPOINT_DISABLE": "1", "PKR_VAR_proxmox_token": ""},
    ).stdout
    found: dict[str, str] = {}
    for line in out.splitlines():
        text = line.split(",", 3)[-1].replace("%!(PACKER_COMMA)", ",").replace("\\n", "\n")
        for part in text.splitlines():
            key, sep, value = part.strip().partition(": ")
            if sep and key.startswith("var.") and value.startswith('"') and value.endswith('"'):
                found[key[4:]] = json.loads(value)
    return found


@dataclass(frozen=True)
class IsoSource:
    """Where Packer gets the installer ISO, decided by resolve_iso before anything is created."""

    url: str  # what Packer's iso_url gets: the mirror URL or a local path
    checksum: str  # what iso_checksum gets
    local: bool


def _reachable(url: str, timeout: float = 10.0) -> str:
    """'' if an HTTP HEAD of `url` answers 2xx/3xx, else why not (one short phrase)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return ""
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return str(reason).strip() or type(exc).__name__


def resolve_iso(r: IsoRecipe, idir: Path, iso: str | None = None, checksum: str | None = None) -> IsoSource:
    """Where the installer ISO comes from, decided before anything is created: `iso` (a local file),
    else images/iso/<name> if present, else the mirror if it answers; otherwise one UsageError."""
    defaults = packer_defaults(lab.PACKER_DIR / r.packer_template)
    url, default_sum = defaults["iso_url"], defaults["iso_checksum"]
    cached = idir / ISO_CACHE / url.rsplit("/", 1)[-1]
    if checksum and not (checksum.startswith(("sha256:", "sha512:", "file:")) or checksum == "none"):
        raise UsageError(f"--iso-checksum {checksum!r}: expected sha256:HEX, sha512:HEX or file:PATH")
    if iso is not None:
        local = Path(iso).expanduser().resolve()
        if not local.is_file():
            raise UsageError(f"--iso {iso}: no such file")
    elif cached.is_file():
        local = cached
    else:
        why = _reachable(url)
        if why:
            raise UsageError(
                f"{r.name}: the installer ISO {url} cannot be downloaded ({why}) and is not cached as {cached}",
                hint="put the ISO there, or pass --iso PATH --iso-checksum sha256:HEX",
            )
        return IsoSource(url, checksum or default_sum, local=False)
    if checksum is None and default_sum.startswith("file:http"):
        # Packer would fetch the release's checksum file: possible only online.
        why = _reachable(default_sum[len("file:") :])
        if why:
            raise UsageError(
                f"{r.name}: the checksum file {default_sum[5:]} cannot be downloaded ({why}) to verify {local}",
                hint="pass --iso-checksum sha256:HEX (from that file)",
            )
    return IsoSource(str(local), checksum or default_sum, local=True)
