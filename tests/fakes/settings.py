"""`[hosts.NAME] backend = "fake"`: the fake backend's typed settings (tests only)."""

from __future__ import annotations

from typing import Literal

from lab.backends.base import Capabilities, HostSettings
from lab.model import CloneKind, DiskBus, NicModel

Stage = str  # clone, boot, ssh, verify, tune, workloads, workloads@N, teardown


class Settings(HostSettings):
    backend: Literal["fake"]
    fail: dict[str, Stage] = {}  # cell id or "*" -> the stage that fails with a LabError
    interrupt: dict[str, Stage] = {}  # cell id or "*" -> the stage interrupted (SIGINT/SIGTERM)
    bare_metal: bool = True  # can run the bare-metal cell
    lro: Literal["on", "off", "fixed-on", "fixed-off"] = "on"  # the NIC's LRO as `ethtool -k` reports it
    cc_default: str = "cubic"
    unlisted: list[str] = []  # parts of the host list_owned cannot look at (IncompleteListing)
    # Foreign CPU load on the host (% of one core) while a cell measures: "c01@2" (its measured
    # repetition 2, in whichever round), "c01" (every repetition of it) or "*"
    foreign_load: dict[str, float] = {}
    # cell id or "*" -> how many of the host-quiet probes before its repetitions read busy (50 %)
    busy_probes: dict[str, int] = {}
    steal: bool = False  # the host reports CPU steal (always 0)
    load_unknown: bool = False  # the host cannot tell its load (the seam's default window)
    local_host: bool = False  # the host is this machine (quiet_host defaults to "wait")
    warm: dict[str, str] = {}  # warm snapshots it keeps: name -> the image build (sha256) each is of
    # Which machines have podman (and the lab's base image): "vm" (the guests), "bare-metal" (the host)
    podman: list[Literal["vm", "bare-metal"]] = ["vm"]
    docker: list[Literal["vm", "bare-metal"]] = []  # likewise for docker (none by default)
    # The host goes away: "open_run" (at the start of the run) or a cell id (from that cell's clone
    # on, every call raises HostUnreachable)
    lost: str = ""
    boot_s: float = 0.0  # how long each boot takes in wall time (a slow or hanging host)
    places: list[str] = []  # parts of the host a VM can be pinned to (Capabilities.places), as a cluster's nodes
    renew_fails: bool = False  # renew_lease raises (the host refuses the new lease)

    def problems(self) -> list[tuple[str, object, str]]:
        stages = {"clone", "boot", "ssh", "verify", "tune", "workloads", "teardown"}
        return [
            (key, stage, f"not a stage; stages: {', '.join(sorted(stages))}")
            for key, table in (("fail", self.fail), ("interrupt", self.interrupt))
            for stage in table.values()
            if stage.partition("@")[0] not in stages
        ]


def capabilities(settings: Settings) -> Capabilities:
    return Capabilities(
        description="fake",
        nic_models=frozenset(NicModel),
        disk_buses=frozenset(DiskBus),
        clone_kinds=frozenset(CloneKind),
        boot_modes=frozenset({"kernel", "bios", "uefi"}),
        max_vcpus=64,
        bare_metal=settings.bare_metal,
        lab_side_link=False,
        local_host=settings.local_host,
        max_slots=8,
        places=tuple(settings.places),
        snapshots=bool(settings.warm),
        host_load=not settings.load_unknown,
    )
