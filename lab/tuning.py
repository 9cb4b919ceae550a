"""Guest tuning profiles: templates/sysctl/<os>/<profile>.j2 rendered, applied, read back.

"default" changes nothing. What is recorded is what the guest reports *after* applying, not what
was asked for; a profile with no template for the guest's OS is not applicable (the cell is n/a).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

import jinja2

from lab import TEMPLATES_DIR, osfacts
from lab.errors import LabError
from lab.guest import Machine
from lab.osfacts import OsFacts

DEFAULT = "default"
OFFLOAD_FEATURES = ("lro", "tso", "gro")


def parse_offloads(spec: str) -> dict[str, bool]:
    """Pure: the `offloads` axis's value, "lro=off,tso=on" -> {"lro": False, "tso": True};
    "default" -> {} (leave the NIC as it is). Raises ValueError naming what is wrong."""
    if spec == "default":
        return {}
    out: dict[str, bool] = {}
    for part in spec.split(","):
        feat, sep, state = part.strip().partition("=")
        if not sep or feat not in OFFLOAD_FEATURES or state not in ("on", "off"):
            raise ValueError(
                f"{part.strip()!r} is not FEATURE=on|off with FEATURE one of {', '.join(OFFLOAD_FEATURES)}"
            )
        if feat in out:
            raise ValueError(f"sets {feat} twice")
        out[feat] = state == "on"
    return out


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


def apply(guest: Machine, facts: OsFacts, profile: str) -> Applied:
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
        return Applied(
            profile, False, wanted, effective, reason=f"{k} asked {wanted[k]!r}, guest has {effective.get(k)!r}"
        )
    return Applied(profile, True, wanted, effective)


def read(guest: Machine, facts: OsFacts, keys: list[str]) -> dict[str, str]:
    if not keys:
        return {}
    # One round trip: print "key<TAB>value" per key; unknown keys print nothing.
    script = "; ".join(
        f"v=$({facts.sysctl_get.format(key=k)} 2>/dev/null) && printf '%s\\t%s\\n' {shlex.quote(k)} \"$v\""
        for k in keys
    )
    out = guest.run(script + "; true", timeout=30).stdout
    result = {}
    for line in out.splitlines():
        k, _, v = line.partition("\t")
        if k:
            result[k] = normalise(v)
    return result


# --- congestion control and offloads (matrix axes `cc`, `offloads`) ------------------------------


@dataclass(frozen=True)
class Knob:
    """One knob applied to a guest and read back: what was asked, what is in effect, and why it
    cannot apply (applicable False: the cell is n/a, not failed)."""

    name: str
    asked: object
    effective: object = None
    applicable: bool = True
    reason: str = ""


def apply_cc(guest: Machine, facts: OsFacts, cc: str) -> Knob:
    """Switch the congestion control (loading its module) and read back what is in effect.
    "default" changes nothing but still reads what is in effect (the tuning profile may have set it)."""
    if not facts.cc_key:
        if cc == "default":
            return Knob("cc", cc, None)
        return Knob("cc", cc, None, False, f"{facts.name} has no selectable congestion control")
    if cc != "default":
        if cc not in facts.cc_available:
            return Knob(
                "cc",
                cc,
                None,
                False,
                f"{facts.name} has no congestion control {cc!r} (it has {', '.join(facts.cc_available)})",
            )
        res = guest.run(facts.cc_set.format(cc=cc), timeout=60, check=False)
        if res.returncode != 0:
            now = read(guest, facts, [facts.cc_key]).get(facts.cc_key)
            return Knob(
                "cc",
                cc,
                now,
                False,
                f"cannot select {cc!r} on this guest: "
                f"{(res.stderr or res.stdout).strip().splitlines()[-1:] or ['no output']}"[:300],
            )
    effective = read(guest, facts, [facts.cc_key]).get(facts.cc_key)
    if cc != "default" and effective != cc:
        return Knob("cc", cc, effective, False, f"asked {cc!r}, the guest has {effective!r}")
    return Knob("cc", cc, effective)


# ethtool's long names for the features the offloads axis sets
ETHTOOL_NAMES = {"lro": "large-receive-offload", "tso": "tcp-segmentation-offload", "gro": "generic-receive-offload"}
# FreeBSD ifconfig option flags per feature (TSO: the IPv4 flag decides; `ifconfig -tso` clears both)
IFCONFIG_FLAGS = {"lro": "LRO", "tso": "TSO4"}


def parse_ethtool_k(text: str) -> dict[str, tuple[bool, bool]]:
    """Pure: `ethtool -k DEV` -> {feature: (on, fixed)} for every line "name: on|off [fixed]"."""
    out: dict[str, tuple[bool, bool]] = {}
    for line in text.splitlines():
        name, sep, rest = line.strip().partition(":")
        words = rest.split()
        if sep and words and words[0] in ("on", "off"):
            out[name] = (words[0] == "on", "[fixed]" in words)
    return out


def _flag_list(text: str, key: str) -> set[str]:
    m = re.search(rf"^\s*{key}=[0-9a-fA-F]+<([^>]*)>", text, re.MULTILINE)
    return set(m.group(1).split(",")) if m else set()


def parse_ifconfig_offloads(text: str) -> dict[str, tuple[bool, bool]]:
    """Pure: FreeBSD `ifconfig -m DEV` -> {feature: (on, fixed)}: on = in options=<...>, fixed = not
    in capabilities=<...> (the driver cannot toggle it)."""
    options, caps = _flag_list(text, "options"), _flag_list(text, "capabilities")
    return {
        feat: (flag in options, flag not in caps)
        for feat, flag in IFCONFIG_FLAGS.items()
        if flag in options or flag in caps
    }


def read_offloads(guest: Machine, facts: OsFacts, dev: str) -> dict[str, tuple[bool, bool]]:
    """{lro|tso|gro: (on, fixed)} for the features the NIC reports."""
    if not facts.offload_get:
        return {}
    text = guest.run(facts.offload_get.format(dev=dev), timeout=30, check=False).stdout
    if facts.family == "linux":
        states = parse_ethtool_k(text)
        return {short: states[long] for short, long in ETHTOOL_NAMES.items() if long in states}
    return parse_ifconfig_offloads(text)


def apply_offloads(guest: Machine, facts: OsFacts, dev: str, wanted: dict[str, bool]) -> Knob:
    """Set each feature, then read every one back. A feature the OS cannot set, the NIC does not
    report, or reports as [fixed] in another state, makes the knob not applicable."""

    def show(states):
        return {f: ("on" if on else "off") + (" [fixed]" if fixed else "") for f, (on, fixed) in states.items()}

    before = read_offloads(guest, facts, dev)
    for feat, on in wanted.items():
        if feat not in facts.offload_set:
            return Knob("offloads", wanted, show(before), False, f"{facts.name} cannot set {feat} on {dev}")
        if feat not in before:
            return Knob("offloads", wanted, show(before), False, f"{dev} does not report {feat}")
        if before[feat][1] and before[feat][0] != on:
            return Knob(
                "offloads",
                wanted,
                show(before),
                False,
                f"{feat} is {'on' if before[feat][0] else 'off'} [fixed] on {dev}: the NIC cannot change it",
            )
    for feat, on in wanted.items():
        guest.run(
            facts.offload_set[feat].format(dev=dev, state="on" if on else "off", flag="" if on else "-"),
            timeout=30,
            check=False,
        )
    after = read_offloads(guest, facts, dev) if wanted else before
    for feat, on in wanted.items():
        if after.get(feat, (None,))[0] != on:
            return Knob(
                "offloads",
                wanted,
                show(after),
                False,
                f"asked {feat} {'on' if on else 'off'}, {dev} reports {show(after).get(feat, 'nothing')}",
            )
    return Knob("offloads", wanted, show(after))
