"""WAN emulation per cell ([wan.NAME] profiles, matrix axis `wan`): tc netem on one direction of
the guest's link, read back with `tc qdisc show`, removed after the cell.

Where the qdisc goes:
- "lab": the local backend, on the VM's tap inside the run's namespace (egress = towards the
  guest), when this machine's kernel has netem (sch_netem); the guest is untouched.
- "guest": the guest's own NIC (egress = towards the client), for backends whose link the lab
  cannot reach (Proxmox, libvirt) and for a local host whose kernel lacks netem; needs a guest
  with tc and sch_netem (Linux). Recorded with the cell, so a comparison can tell.
All of delay_ms sits on that one direction, so delay_ms is the added round-trip time (ping shows
RTT ≈ base + delay_ms); loss and rate apply to that direction only. netem's queue limit is raised
so that the queue of a delayed fast stream is not an extra source of loss.
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from lab import proc
from lab.errors import LabError
from lab.osfacts import OsFacts


class WanProfile(BaseModel):
    """[wan.NAME]: netem on one direction of the guest's link (lab.wan). delay_ms is the added
    round-trip time (all of it on one direction), jitter_ms its +- spread, loss_pct the share of
    packets dropped in that direction, rate_mbit a rate limit in that direction (0: none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    delay_ms: float = Field(default=0.0, ge=0, le=10000, description="added one-way delay on the guest's link, ms")
    jitter_ms: float = Field(default=0.0, ge=0, le=10000, description="variation of that delay, ms")
    loss_pct: float = Field(default=0.0, ge=0, le=100, description="% of packets dropped in that direction")
    rate_mbit: float = Field(default=0.0, ge=0, le=100000, description="rate limit in that direction, Mbit/s (0: none)")

    @property
    def is_null(self) -> bool:
        return not (self.delay_ms or self.jitter_ms or self.loss_pct or self.rate_mbit)


NETEM_LIMIT = 100000  # packets; the default 1000 drops a delayed stream beyond ~1000/delay pkt/s


def netem_args(p: WanProfile) -> list[str]:
    """Pure: tc netem arguments for a profile."""
    args = ["limit", str(NETEM_LIMIT)]
    if p.delay_ms or p.jitter_ms:
        args += ["delay", f"{p.delay_ms:g}ms"] + ([f"{p.jitter_ms:g}ms"] if p.jitter_ms else [])
    if p.loss_pct:
        args += ["loss", f"{p.loss_pct:g}%"]
    if p.rate_mbit:
        args += ["rate", f"{p.rate_mbit:g}mbit"]
    return args


@dataclass(frozen=True)
class Qdisc:
    kind: str
    handle: str
    parent: str  # "root" or the parent's handle
    options: str  # the rest of the line, as tc prints it


def parse_tc_qdisc(text: str) -> list[Qdisc]:
    """Pure: `tc qdisc show dev DEV` -> one Qdisc per line."""
    out = []
    for line in text.splitlines():
        m = re.match(r"qdisc (\S+) (\S+) (root|parent \S+)\s*(.*)$", line.strip())
        if m:
            out.append(Qdisc(m.group(1), m.group(2), m.group(3).removeprefix("parent "), " ".join(m.group(4).split())))
    return out


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}
_RATE = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, "tbit": 1e6}


def netem_in_effect(qdiscs: list[Qdisc]) -> dict[str, float] | None:
    """Pure: the root netem's delay/jitter (ms), loss (%) and rate (Mbit/s), or None if the root
    qdisc is not netem."""
    root = next((q for q in qdiscs if q.parent == "root"), None)
    if root is None or root.kind != "netem":
        return None
    o = root.options
    out = {"delay_ms": 0.0, "jitter_ms": 0.0, "loss_pct": 0.0, "rate_mbit": 0.0}
    m = re.search(r"delay ([0-9.]+)(us|ms|s)(?:\s+([0-9.]+)(us|ms|s))?", o)
    if m:
        out["delay_ms"] = round(float(m.group(1)) * _UNITS[m.group(2)], 3)
        if m.group(3):
            out["jitter_ms"] = round(float(m.group(3)) * _UNITS[m.group(4)], 3)
    m = re.search(r"loss (?:random )?([0-9.]+)%", o)
    if m:
        out["loss_pct"] = float(m.group(1))
    m = re.search(r"rate ([0-9.]+)([KMGT]?bit)", o, re.IGNORECASE)
    if m:
        out["rate_mbit"] = round(float(m.group(1)) * _RATE[m.group(2).lower()], 6)
    return out


@functools.cache
def host_has_netem() -> bool:
    """Can this machine's kernel run netem? Tried on the loopback of a throwaway namespace
    (`unshare -n`): nothing is left behind."""
    try:
        res = proc.run(
            ["unshare", "-n", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            timeout=15,
            check=False,
            what="netem probe",
        )
    except Exception:  # noqa: BLE001 - no unshare/tc: no netem here
        return False
    return res.ok


def place(lab_side_link: bool, host_kind: str, facts: OsFacts) -> tuple[str, str]:
    """Where a cell's netem goes: ("lab"|"guest"|"", why). "" = nowhere: the cell cannot emulate a WAN.
    `lab_side_link`: the host's backend lets the lab reach the VM's link (its capabilities);
    `host_kind`: how to name the host's kind in the reason."""
    if lab_side_link and host_has_netem():
        return "lab", "on the VM's link on the lab side (its tap)"
    why = (
        "this machine's kernel has no netem (sch_netem)"
        if lab_side_link
        else f"the lab cannot reach the link of a {host_kind} host"
    )
    if facts.netem_set:
        return "guest", f"on the guest's NIC: {why}"
    return "", f"{why}, and {facts.name} has no tc netem"


class Emulation:
    """One cell's netem: apply, read back what is in effect, remove."""

    def __init__(
        self,
        profile: WanProfile,
        where: str,
        *,
        guest=None,
        facts: OsFacts | None = None,
        dev: str = "",
        netns: str | None = None,
    ):
        self.profile, self.where, self.guest, self.facts, self.dev, self.netns = (
            profile,
            where,
            guest,
            facts,
            dev,
            netns,
        )

    def _guest_os(self) -> OsFacts:
        """The guest's facts: netem on the guest's NIC is run with its commands."""
        if self.facts is None:
            raise LabError("netem on the guest's NIC needs the guest's OS facts (none were given)")
        return self.facts

    def _lab(self, *args: str, check: bool = True) -> proc.Result:
        return proc.run(["tc", "qdisc", *args], netns=self.netns, timeout=30, check=check, what="tc qdisc")

    def show(self) -> str:
        if self.where == "lab":
            return self._lab("show", "dev", self.dev).stdout
        return self.guest.run(self._guest_os().netem_get.format(dev=self.dev), timeout=30).stdout

    def apply(self) -> dict[str, object]:
        args = netem_args(self.profile)
        if self.where == "lab":
            self._lab("replace", "dev", self.dev, "root", "netem", *args)
        else:
            self.guest.run(
                self._guest_os().netem_set.format(dev=self.dev, args=" ".join(shlex.quote(a) for a in args)), timeout=60
            )
        text = self.show()
        return {
            "where": self.where,
            "dev": self.dev,
            "qdisc": text.strip(),
            "netem": netem_in_effect(parse_tc_qdisc(text)),
        }

    def remove(self) -> None:
        if self.where == "lab":
            self._lab("del", "dev", self.dev, "root", check=False)
        elif self.guest is not None:
            self.guest.run(self._guest_os().netem_clear.format(dev=self.dev), timeout=30, check=False)
