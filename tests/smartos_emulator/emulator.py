"""One emulated SmartOS host, put together: the test's network namespace (the host's `external`
network: a bridge, with the lab's client side on it; and an admin link, a veth pair to this
machine's namespace, where the global zone's sshd listens), the global zone, sshd, and what backs
its guests (real QEMU guests of the golden image, stubs, or nothing) and, if asked, its lx zones
(zones.ZoneBacking)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab import IMAGES_DIR, proc
from lab.backends.base import BackendEnv
from lab.backends.smartos.settings import Settings
from lab.model import Accel, ImageRef

from .backing import QemuBacking, StubBacking
from .gz import GlobalZoneEmulator
from .imgadm import Image
from .sshd import Sshd
from .zones import ZoneBacking

ALLOC_LOCK = Path("/var/tmp/lab-smartos-emulator-nets.lock")
BRIDGE = "extbr0"


@dataclass(frozen=True)
class GzNetwork:
    netns: str  # the host's networks: bridge BRIDGE (nic_tag "external") and the admin link's far end
    admin_ip: str  # the global zone's admin address (sshd), reachable from this machine's namespace
    subnet: str  # "10.97.K": the external network, .1 is the lab's client side (client_netns = netns)
    bridge: str = BRIDGE


@contextlib.contextmanager
def gz_network() -> Iterator[GzNetwork]:
    """A fresh namespace per emulated host; its admin /30 is unique on this machine (other tests and
    helpers run beside it), chosen under a lock file."""
    with open(ALLOC_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        used = proc.run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
        names = set(proc.run(["ip", "netns", "list"], check=False).stdout.split())
        free = [k for k in range(10, 250) if f"smgz{k}" not in names and f" 10.96.{k}." not in used]
        if not free:
            raise RuntimeError("no free 10.96.K.0/30 for an emulated SmartOS host")
        k = random.choice(free)
        ns, veth = f"smgz{k}", f"smgz{k}a"
        proc.run(["ip", "netns", "add", ns])
    try:
        for argv in (
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "-n", ns, "addr", "add", f"10.97.{k}.1/24", "dev", BRIDGE],
            ["ip", "-n", ns, "link", "set", BRIDGE, "up"],
            ["ip", "link", "add", veth, "type", "veth", "peer", "name", "admin0", "netns", ns],
            ["ip", "addr", "add", f"10.96.{k}.1/30", "dev", veth],
            ["ip", "link", "set", veth, "up"],
            ["ip", "-n", ns, "addr", "add", f"10.96.{k}.2/30", "dev", "admin0"],
            ["ip", "-n", ns, "link", "set", "admin0", "up"],
        ):
            proc.run(argv)
        yield GzNetwork(netns=ns, admin_ip=f"10.96.{k}.2", subnet=f"10.97.{k}")
    finally:
        pids = proc.run(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        proc.run(["ip", "netns", "del", ns], check=False)  # takes the veth pair and the bridge with it
        proc.run(["ip", "link", "del", veth], check=False)


class SmartosEmulator:
    """`with SmartosEmulator(workdir, net, backing="qemu", image=golden) as emu:` a host the backend
    reaches at emu.settings()."""

    def __init__(
        self,
        workdir: Path,
        net: GzNetwork,
        *,
        backing: str | None = "stub",
        image: ImageRef | None = None,
        accel: Accel = Accel.TCG,
        zones: bool = False,
    ):
        self.workdir, self.net = Path(workdir), net
        bridges = {"external": net.bridge}
        if backing == "qemu":
            assert image is not None, "QEMU-backed guests need the golden image"
            self.backing: Any = QemuBacking(
                image, workdir=self.workdir / "qemu", netns=net.netns, bridges=bridges, subnet=net.subnet, accel=accel
            )
        elif backing == "stub":
            self.backing = StubBacking(netns=net.netns, bridges=bridges, subnet=net.subnet)
        else:
            self.backing = None
        # zones: lx zones run this machine's userland with the golden image's site (zones.ZoneBacking)
        self.zones = (
            ZoneBacking(
                workdir=self.workdir / "zones",
                netns=net.netns,
                bridges=bridges,
                subnet=net.subnet,
                site_image="debian12",
            )
            if zones
            else None
        )
        self.gz = GlobalZoneEmulator(
            self.workdir / "gz", netns=net.netns, nic_tags=bridges, backing=self.backing, zones=self.zones
        )
        self.sshd = Sshd(self.workdir, netns=net.netns, address=net.admin_ip, socket_path=self.gz.socket_path)
        self.faults = self.gz.faults

    def __enter__(self) -> SmartosEmulator:
        self.gz.start()
        try:
            if self.backing is not None:
                self.backing.__enter__()
            self.sshd.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.sshd.stop()
        self.gz.stop()
        if self.backing is not None:
            self.backing.__exit__(None, None, None)

    # -- what a test asks -------------------------------------------------------------------------------
    def vms(self) -> dict[str, dict]:
        return {u: vm.get() for u, vm in self.gz.vmadm.vms.items()}

    def images(self) -> dict[str, dict]:
        return {u: i.manifest for u, i in self.gz.imgadm.images.items()}

    def guests(self) -> list[str]:
        return [u for u, vm in self.gz.vmadm.vms.items() if vm.guest is not None]

    def install_zone_image(
        self, uuid: str, *, name: str, kind: str = "lx-dataset", os_name: str = "linux", **tags: str
    ) -> None:
        """An imported zone image (`imgadm import`), as `imgadm list` shows it; a zone has no disk to
        clone, so its dataset is an empty file."""
        dataset = self.gz.path(f"/zones/{uuid}/final.img")
        dataset.parent.mkdir(parents=True, exist_ok=True)
        dataset.write_bytes(b"")
        manifest = {"uuid": uuid, "name": name, "version": "20260101", "type": kind, "os": os_name, "tags": tags}
        if kind == "lx-dataset":
            manifest["requirements"] = {"brand": "lx"}
        self.gz.imgadm.images[uuid] = Image(manifest, dataset)

    def table(self, **over: Any) -> dict[str, Any]:
        """The `[hosts.NAME]` keys of a smartos host on this emulator."""
        s = self.net.subnet
        table: dict[str, Any] = {
            "backend": "smartos",
            "ssh": f"root@{self.net.admin_ip}",
            "ssh_key": str(self.sshd.client_key),
            "ssh_options": [
                f"UserKnownHostsFile={self.sshd.known_hosts}",
                "GlobalKnownHostsFile=/dev/null",
                "StrictHostKeyChecking=yes",
            ],
            "nic_tag": "external",
            "addresses": f"{s}.10-{s}.49",
            "gateway": f"{s}.1",
            "client_address": f"{s}.1",
            "client_netns": self.net.netns,
            "poll_interval": 0.2,
            "timeouts": {
                "connect": 5,
                "command": 60,
                "create": 60,
                "start": 30,
                "stop": 20,
                "delete": 20,
                "ready": 30,
                "publish": 600,
            },
        }
        table.update(over)
        return table

    def settings(self, **over: Any) -> Settings:
        return Settings.model_validate(self.table(**over))

    def env(self, source: str = "lab.toml") -> BackendEnv:
        state = self.workdir / "state"
        state.mkdir(mode=0o700, exist_ok=True)
        return BackendEnv(source=source, base_dir=self.workdir, state_dir=state, ssh_key=IMAGES_DIR / "lab_key")
