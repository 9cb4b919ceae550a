"""`[hosts.NAME] backend = "local"`: QEMU on this machine."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import Field, field_validator

from lab.backends import fields
from lab.backends.base import Capabilities, HostSettings
from lab.backends.local.qemu import DISK_DEVICES, NIC_DEVICE
from lab.model import CloneKind

# Machines of one run up at once ([hosts.local] slots): each is a QEMU with its own tap, address and
# MAC in the run's namespace; a handful is all a workstation's cores make sense for.
MAX_SLOTS = 8


class Settings(HostSettings):
    backend: Literal["local"]
    accel: Literal["auto", "kvm", "tcg"] = Field(
        default="auto",
        description="auto: boot a kernel under KVM once and fall back to TCG if it is silent; kvm or tcg force one",
    )
    # MTTCG (a host thread per vCPU) is QEMU's default and the fastest for one VM; but VMs started at
    # once on few cores then preempt each other's vCPU threads mid-translation (make test's two workers
    # on 2 cores: 688 s for 8 VM tests against 562 s single-threaded; docs/testing.md)
    tcg_threads: Literal["multi", "single"] = Field(
        default="multi",
        description=(
            "under TCG: multi runs each vCPU on a host thread of its own; single runs all of a VM's vCPUs on one, "
            "which shares few cores better between VMs running at once"
        ),
    )
    # clones, pidfiles, consoles, leases; shared by runs so `lab gc` finds them. Default: "local" in
    # the lab's private state directory (lab.statedir, BackendEnv.state_dir). Root acts on what
    # is found there, so it must be this user's alone (checked before a run: lab.statedir.check)
    workdir: str | None = Field(
        default=None,
        description=(
            'clones, pidfiles, consoles, leases, shared by runs so `lab gc` finds them (default: "local" in the state '
            "directory); must be this user's alone"
        ),
    )
    # several workdirs (labs, CI jobs) may share one store: a shape is then booted and saved once for
    # them all; root restores what is found there, so the same ownership rule as the workdir's holds
    warm_dir: str | None = Field(
        default=None,
        description=(
            'warm start\'s snapshots (default: "warm" in the workdir); several workdirs may share one, so each '
            "machine shape is booted and saved once for all; must be this user's alone"
        ),
    )
    subnet: str = Field(
        default="10.77.0",
        description="first three octets of the run's /24 inside its own network namespace (bridge .1, VMs .10-.249)",
    )
    boot_timeout: float = Field(default=240.0, gt=0, le=3600, description="seconds a VM may take to boot and answer")

    @field_validator("workdir", "warm_dir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        # `~` expanded, absolute (lab.paths): the same rule as every state directory of the lab's
        return None if v is None else fields.state_dir(v)

    @field_validator("subnet")
    @classmethod
    def _subnet(cls, v: str) -> str:
        # three octets: the run's bridge is <subnet>.1, its VMs .10-.249, bare-metal cells .250-
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", v) or any(int(o) > 255 for o in v.split(".")):
            raise ValueError('must be the first three octets of a /24, such as "10.77.0"')
        v = ".".join(str(int(o)) for o in v.split("."))  # 010 is 10, not octal
        net = ipaddress.IPv4Network(f"{v}.0/24")
        if v.startswith("0.") or net.is_loopback or net.is_multicast or net.is_reserved or net.is_link_local:
            raise ValueError("is not a usable unicast range (0/8, loopback, link-local, multicast or reserved)")
        return v


def capabilities(settings: Settings) -> Capabilities:
    return Capabilities(
        description="local QEMU",
        max_slots=MAX_SLOTS,
        nic_models=frozenset(NIC_DEVICE),
        disk_buses=frozenset(DISK_DEVICES),
        clone_kinds=frozenset(CloneKind),
        boot_modes=frozenset({"kernel"}),
        max_vcpus=128,
        snapshots=True,  # warm start: lab.backends.local.warm
        bare_metal=True,
        host_load=True,  # this machine's CPU counters (lab.backends.local.hostload)
        lab_side_link=True,
        # the host is this machine: a run waits for it to be quiet before each measured repetition
        # ([suite] quiet_host defaults to "wait"; lab.backends.local.hostload measures it)
        local_host=True,
    )
