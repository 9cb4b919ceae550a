"""Guest tuning profiles: templates/sysctl/<os>/<profile>.j2 rendered, applied, read back.

"default" changes nothing. What is recorded is what the guest reports *after* applying, not what
was asked for; a profile with no template for the guest's OS is not applicable (the cell is n/a).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

import jinja2

from lab import TEMPLATES_DIR, osfacts
from lab.errors import LabError
from lab.osfacts import OsFacts

DEFAULT = "default"



@dataclass(frozen=True)
class Applied:
    profile: str
    applicable: bool
    wanted: dict[str, str] = field(default_factory=dict)
    effective: dict[str, str] = field(default_factory=dict)
    reason: str = ""


def profiles() -> set[str]:
    names = {DEFAULT}
    root = TEMPLATES_DIR / "sysctl"
    if root.is_dir():
        names |= {p.stem for p in root.glob("*/*.j2")}
    return names


def render(os_name: str, profile: str) -> dict[str, str] | None:
    """Pure: the key -> value pairs a profile asks for on an OS, or None if it has no template."""
    if profile == DEFAULT:
        return {}
    path = TEMPLATES_DIR / "sysctl" / osfacts.facts(os_name).sysctl_templates / f"{profile}.j2"
    if not path.is_file():
        return None
    text = jinja2.Template(path.read_text(), undefined=jinja2.StrictUndefined).render()
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise LabError(f"{path}: line {line!r} is not key = value")
        out[key.strip()] = " ".join(value.split())
    return out


def normalise(value: str) -> str:
    return " ".join(value.split())


def apply(guest, facts: OsFacts, profile: str) -> Applied:
    wanted = render(facts.name, profile)
    if wanted is None:
        return Applied(profile, False, reason=f"profile {profile!r} has no template for {facts.name}")
    for key, value in wanted.items():
        guest.run(facts.sysctl_set.format(key=key, value=shlex.quote(value)), timeout=30)
    keys = list(dict.fromkeys([*facts.sysctl_watched, *wanted]))
    effective = read(guest, facts, keys)
    mismatched = [k for k, v in wanted.items() if normalise(effective.get(k, "")) != normalise(v)]
    if mismatched:
        k = mismatched[0]
        return Applied(profile, False, wanted, effective,
                       reason=f"{k} asked {wanted[k]!r}, guest has {effective.get(k)!r}")
    return Applied(profile, True, wanted, effective)


def read(guest, facts: OsFacts, keys: list[str]) -> dict[str, str]:
    if not keys:
        return {}
    # One round trip: print "key<TAB>value" per key; unknown keys print nothing.
    script = "; ".join(
        f"v=$({facts.sysctl_get.format(key=k)} 2>/dev/null) && printf '%s\\t%s\\n' {shlex.quote(k)} \"$v\""
        for k in keys)
    out = guest.run(script + "; true", timeout=30).stdout
    result = {}
    for line in out.splitlines():
        k, _, v = line.partition("\t")
        if k:
            result[k] = normalise(v)
    return result
