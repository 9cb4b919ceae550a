"""What runs behind a booted lx zone of the emulator: this machine's Linux userland, fenced the way
an lx zone is fenced, so the lab's zone cells run the suite for real.

A zone on SmartOS shares the host's kernel, has an exclusive IP stack on a vnic of its nic_tag, is
capped in CPU (cpu_cap, percent of one CPU) and memory (max_physical_memory), and boots its image's
services: an sshd that trusts `root_authorized_keys` and, in the lab's zone image, nginx serving the
lab's site. Here each zone gets:
- a network namespace `labz<8 hex of its uuid>` whose eth0 is a veth on the bridge of its nic_tag,
  with the payload's static address (or one picked from the DHCP range, shown by `arp -an`);
- cgroups `labz<...>` capping CPU (cgroup v2 cpu.max, v1 cpu.cfs_quota_us) and memory (v2
  memory.max, v1 memory.limit_in_bytes), every process of the zone in them;
- an sshd of this machine's OpenSSH (its own host key, written where the global zone sees a zone's
  files: <zonepath>/root/etc/ssh/) and nginx with the golden image's configuration and site.
The zone's files are this machine's (an lx zone image is a Linux userland; here it is the one
installed): the suite's tools are the host's. Halting the zone kills everything in its cgroups and
namespace and removes them, and its root.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from lab import images, proc
from lab.backends.local import host, stop_process
from lab.backends.local.baremetal import nginx_binary, nginx_conf, site_script
from lab.errors import LabError
from lab.wait import wait_until

from .sshd import Sshd

CFS_PERIOD_US = 100_000
# cgroup v1 hierarchies a zone's caps live in; v2 has one tree
V1 = {"cpu": Path("/sys/fs/cgroup/cpu"), "memory": Path("/sys/fs/cgroup/memory")}
V2 = Path("/sys/fs/cgroup")


@dataclass
class Zone:
    uuid: str
    name: str  # of its namespace and cgroups
    address: str
    mac: str
    root: Path  # <zonepath>/root, as the global zone sees it
    sshd: Sshd
    cgroups: list[Path] = field(default_factory=list)
    nginx: subprocess.Popen | None = None


def cgroup_caps(name: str, cpu_cap: int | None, mem_mib: int) -> list[tuple[Path, dict[str, str]]]:
    """Pure but for where cgroups are mounted: each cgroup to make and the files that cap it."""
    quota = str(cpu_cap * CFS_PERIOD_US // 100) if cpu_cap else None
    if (V2 / "cgroup.controllers").exists():
        files = {"memory.max": str(mem_mib << 20)}
        if quota:
            files["cpu.max"] = f"{quota} {CFS_PERIOD_US}"
        return [(V2 / name, files)]
    cpu = {"cpu.cfs_period_us": str(CFS_PERIOD_US)} | ({"cpu.cfs_quota_us": quota} if quota else {})
    return [(V1["cpu"] / name, cpu), (V1["memory"] / name, {"memory.limit_in_bytes": str(mem_mib << 20)})]


def in_cgroups(cgroups: list[Path], argv: list[str]) -> list[str]:
    """argv run inside every one of `cgroups` (joined before anything else runs)."""
    procs = " ".join(shlex.quote(str(c / "cgroup.procs")) for c in cgroups)
    return ["sh", "-c", f'for p in {procs}; do echo $$ > "$p"; done; exec "$@"', "sh", *argv]


class ZoneBacking:
    """lx zones of the emulator (vmadm's OS brands); the site served is `site_image`'s."""

    def __init__(self, *, workdir: Path, netns: str, bridges: dict[str, str], subnet: str, site_image: str):
        self.workdir, self.netns, self.bridges, self.subnet = Path(workdir), netns, bridges, subnet
        self.site_image = site_image
        self.leases: dict[str, str] = {}  # mac -> address of a DHCP zone (what `arp -an` shows)
        self._next = 200

    def __enter__(self) -> ZoneBacking:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def start(self, vm, zonepath: Path) -> Zone:
        obj = vm.get()
        if obj["brand"] != "lx":
            raise LabError(f"the emulator backs lx zones only, not {obj['brand']}")
        nic = obj["nics"][0]
        static = next((ip for ip in nic.get("ips", []) if ip not in ("dhcp", "addrconf")), "")
        address, prefix = static.split("/") if static else (f"{self.subnet}.{self._next}", "24")
        if not static:
            self._next += 1
            self.leases[nic["mac"]] = address
        name = f"labz{vm.uuid.replace('-', '')[:8]}"
        cgroups: list[Path] = []  # filled below, before anything runs in the zone
        sshd = Sshd(
            self.workdir / name,
            netns=name,
            address=address,
            authorized_keys=obj["customer_metadata"].get("root_authorized_keys", ""),
            wrap=lambda argv: in_cgroups(cgroups, argv),
        )
        zone = Zone(vm.uuid, name, address, nic["mac"], zonepath / "root", sshd, cgroups)
        try:
            host.run_all(
                host.veth_netns_argvs(
                    name, self.netns, f"vz{vm.uuid[:8]}", address, int(prefix), bridge=self.bridges[nic["nic_tag"]]
                ),
                what=f"zone {vm.uuid}'s vnic",
            )
            gateway = (nic.get("gateways") or [""])[0]
            if gateway:
                proc.run(["ip", "-n", name, "route", "add", "default", "via", gateway], what="zone route")
            for path, files in cgroup_caps(name, obj.get("cpu_cap"), int(obj["max_physical_memory"])):
                path.mkdir(exist_ok=True)
                zone.cgroups.append(path)
                for f, value in files.items():
                    (path / f).write_text(value)
            zone.sshd.start()
            keys = zone.root / "etc" / "ssh"
            keys.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(zone.sshd.dir / "host_ed25519.pub", keys / "ssh_host_ed25519_key.pub")
            zone.nginx = self._nginx(zone)
        except BaseException:
            self.stop(zone)
            raise
        return zone

    def _nginx(self, zone: Zone) -> subprocess.Popen:
        """The zone image's nginx: the golden image's configuration and site, in the zone's directory."""
        nginx = nginx_binary()
        if nginx is None:
            raise LabError("nginx is not installed on this machine (the zone's userland)")
        zdir = self.workdir / zone.name
        stage = zdir / "stage"
        images.render_stage(self.site_image, stage)
        site, key, crt, conf = stage / "site", zdir / "lab.key", zdir / "lab.crt", zdir / "nginx.conf"
        conf.write_text(nginx_conf((stage / "nginx.conf").read_text(), root=site, key=key, crt=crt, rundir=zdir))
        proc.run(["sh", "-c", site_script(stage=stage, site=site, key=key, crt=crt)], timeout=120, what="zone site")
        with open(zdir / "nginx.log", "ab") as log:
            p = proc.spawn(
                in_cgroups(zone.cgroups, [*proc.netns_prefix(zone.name), nginx, "-c", str(conf), "-g", "daemon off;"]),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_until(
            lambda: (zdir / "nginx.pid").exists() or p.poll() is not None,
            timeout=60,
            what=f"zone {zone.uuid}'s nginx",
        )
        if p.poll() is not None:
            raise LabError(f"zone {zone.uuid}'s nginx exited: {(zdir / 'nginx.log').read_text()[-300:]}")
        return p

    def powerdown(self, zone: Zone) -> None:
        pass  # zones halt (vmadm stop): nothing is graceful about it here

    def running(self, zone: Zone) -> bool:
        return zone.sshd.process is not None and zone.sshd.process.poll() is None

    def stop(self, zone: Zone) -> None:
        """Halt: everything in the zone's cgroups and namespace is killed, then they and its root go."""
        zone.sshd.stop()
        if zone.nginx is not None:
            stop_process(zone.nginx)
        for path in zone.cgroups:
            host.remove_cgroup(path)
        host.remove_netns(zone.name)
        self.leases.pop(zone.mac, None)
        shutil.rmtree(zone.root.parent, ignore_errors=True)
        shutil.rmtree(self.workdir / zone.name, ignore_errors=True)
