"""The vagrant backend: each cell is a Vagrant machine, `vagrant up` and `vagrant destroy` of a
Vagrantfile lab writes for it (vagrant-libvirt; the provider is a setting).

Per run (open_run): the run lock on this machine (`lab gc` tells a live run from a killed one),
the run's directory `<workdir>/<run>/` and an isolated libvirt network `labvg-<run>` (a free /24
of `subnets`, DHCP, no forwarding). The host's side of that network is the run's client address:
load generators listen there, the guests reach them on their one NIC.

Per cell: `<workdir>/<run>/<vm>/` holds `lease.json` (the lab's marker: run, cell, expiry), the
Vagrantfile (templates/vagrant/Vagrantfile.j2: the box version of the image's build, NIC model,
vCPUs, memory, disk bus, the run's network, the serial console to `console.log`) and Vagrant's
own `.vagrant/`. The libvirt domain is named as the VM (`lab-<run>-<cell>`) and carries the lease
in its <description>; vagrant-libvirt's overlay volume is `<vm>.img` in `storage_pool`. `start`
is `vagrant up --no-provision` (it returns once Vagrant reached the guest over SSH); the address
is the guest's DHCP lease; `destroy` is `vagrant destroy -f`, then whatever of the domain and its
volume is left is removed through virsh and checked gone.

`lab gc`: machines found in Vagrant's machine index (`vagrant global-status`), in the work
directory and as libvirt domains carrying the lease, and `lab-<run>-*.img` volumes without a
domain; nothing without the marker is touched. A dead run's network and directory go with its
run lock, last.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab import images, proc, runlock
from lab.backends.base import Backend, BackendEnv, Capabilities, PlainClient
from lab.backends.neighbours import ssh_banner
from lab.backends.vagrant import box
from lab.backends.vagrant.settings import Settings, capabilities
from lab.backends.vagrant.tools import Vagrant, Virsh
from lab.backends.vagrant.vagrantfile import Machine, Network, render
from lab.errors import BackendError, LabError, TeardownError, UnreachableError, UsageError
from lab.model import ImageRef, Owned, Vm, VmSpec
from lab.runlock import RUN_LOCK_DIR, RunLocks
from lab.wait import wait_until

LEASE_FILE = "lease.json"
NETWORK_PREFIX = "labvg-"
# the domain's <description>: written raw into the domain XML by vagrant-libvirt, so plain words
MARKER = "lab-lease"
_RUN = r"[a-z0-9][a-z0-9-]*"  # lab run ids (`lab run --run-id`)
_LEASE_RE = re.compile(
    rf"^{MARKER} run=(?P<run>{_RUN}) cell=(?P<cell>\S+) expires=(?P<expires>\d+) host=(?P<host>\S+)$"
)
# vagrant-libvirt's volume of a cell's machine: <domain>.img, the domain being lab-<run>-<cell>
_VOLUME_RE = re.compile(rf"^lab-(?P<run>{_RUN})-(?P<cell>c\d+(?:-[a-z]+)?)\.img$")


def lease_text(run_id: str, cell_id: str, expires_at: float, host: str) -> str:
    return f"{MARKER} run={run_id} cell={cell_id} expires={int(expires_at)} host={host}"


def parse_lease(text: str | None) -> dict[str, str] | None:
    """The lease a domain's <description> carries; None when it carries none (not the lab's)."""
    m = _LEASE_RE.match((text or "").strip())
    return m.groupdict() if m else None


def network_xml(name: str, net: ipaddress.IPv4Network) -> str:
    """An isolated libvirt network (no <forward>): DHCP for the guests, the host at .1."""
    hosts = list(net.hosts())
    bridge = "labvg" + hashlib.sha256(name.encode()).hexdigest()[:8]  # at most 15 characters, whatever the run id
    return (
        f"<network><name>{name}</name><bridge name='{bridge}' stp='off' delay='0'/>"
        f"<ip address='{hosts[0]}' netmask='{net.netmask}'><dhcp>"
        f"<range start='{hosts[9]}' end='{hosts[-1]}'/></dhcp></ip></network>"
    )


def free_subnet(pool: str, used: Sequence[ipaddress.IPv4Network], rng: random.Random) -> ipaddress.IPv4Network:
    """A /24 of `pool` overlapping none of `used`, from a random start (two runs starting at once
    rarely try the same one; net-create refuses the loser, which tries again)."""
    subnets = list(ipaddress.IPv4Network(pool).subnets(new_prefix=24))
    start = rng.randrange(len(subnets))
    for net in subnets[start:] + subnets[:start]:
        if not any(net.overlaps(u) for u in used):
            return net
    raise UsageError(f"no free /24 left in subnets = {pool!r} (every one is in use on this machine)")


def processes_in(directory: Path) -> list[int]:
    """`vagrant` processes working in `directory` (the ones lab started there)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")[:2]
                if Path(os.readlink(entry / "cwd")) == directory and any(a.endswith(b"vagrant") for a in argv):
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile, or a kernel thread
                continue
    return pids


def stop_processes_in(directory: Path, timeout: float = 30.0) -> None:
    """End a `vagrant up` still running for a machine whose run died (killed with -9: lab's child
    outlives it in its own session), so `vagrant destroy` gets the machine's lock. SIGTERM to each
    one's process group, SIGKILL to what is left after `timeout`."""
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        pids = processes_in(directory)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), sig)
        with contextlib.suppress(LabError):
            wait_until(lambda: not processes_in(directory), timeout=wait_s, what=f"vagrant in {directory} to end")
    if processes_in(directory):
        raise TeardownError(f"processes in {directory} do not end: {processes_in(directory)}")


def host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network on this machine's interfaces (active libvirt networks included)."""
    out = proc.run(["ip", "-4", "-o", "addr", "show"], timeout=10, what="ip addr").stdout
    return [ipaddress.IPv4Interface(m).network for m in re.findall(r"\binet (\d+\.\d+\.\d+\.\d+/\d+)", out)]


class VagrantBackend(Backend):
    name = "vagrant"
    settings_model = Settings
    settings: Settings

    def __init__(self, host_name: str, settings: Settings, env: BackendEnv | None = None):
        super().__init__(host_name, settings, env)
        self.vagrant = Vagrant(home=settings.vagrant_home, uri=settings.uri)
        self.virsh = Virsh(settings.uri)
        self.workdir = Path(settings.workdir)
        self._run_locks = RunLocks(self._lock_path)
        self.publishing = box.BoxPublishing(self.vagrant)
        self._versions: dict[str, str] = {}

    @classmethod
    def capabilities(cls, settings: Settings) -> Capabilities:  # type: ignore[override]
        return capabilities(settings)

    # -- the host ------------------------------------------------------------------------------------

    def check(self) -> None:
        try:
            plugins = self.vagrant.plugins()
        except LabError as exc:
            raise UsageError(
                f"host {self.host_name!r}: vagrant does not run: {exc}", hint="apt-get install vagrant vagrant-libvirt"
            ) from None
        if "vagrant-libvirt" not in plugins:
            raise UsageError(
                f"host {self.host_name!r}: Vagrant has no vagrant-libvirt plugin",
                hint="apt-get install vagrant-libvirt",
            )
        res = self.virsh.run(["version"], what="virsh version", check=False, timeout=30)
        if not res.ok:
            raise UnreachableError(
                f"host {self.host_name!r}: libvirt at {self.settings.uri} does not answer: "
                f"{(res.stderr or res.stdout).strip().splitlines()[-1:] or ['no output']}",
                hint="start libvirtd",
            )

    def check_images(self, images_: Sequence[ImageRef]) -> None:
        installed = set(self.vagrant.boxes())
        for image in images_:
            images.require_boot(image, "bios", f"host {self.host_name!r} (Vagrant boxes boot by SeaBIOS)")
            b = box.built_box(image)
            if (b.name, box.PROVIDER, b.version) not in installed:
                raise UsageError(
                    f"host {self.host_name!r}: Vagrant has no box {b.name} {b.version} (this build of {image.name})",
                    hint=f"lab images publish {image.name} {self.host_name}",
                )

    def describe_images(self, images_: Sequence[ImageRef]) -> list[str]:
        volumes = {name for name, _ in self.virsh.volumes(self.settings.storage_pool)}
        lines = []
        for image in images_:
            b = box.built_box(image)
            uploaded = box.base_volume(b.name, b.version) in volumes
            lines.append(
                f"{image.name}: box {b.name} {b.version} (recipe {b.digest[:12]}), its disk "
                + (
                    f"in pool {self.settings.storage_pool}"
                    if uploaded
                    else f"uploaded to pool {self.settings.storage_pool} by the first vagrant up"
                )
            )
        return lines

    def _tool_versions(self) -> dict[str, str]:
        if not self._versions:
            self._versions = {
                "vagrant": self.vagrant.version(),
                "vagrant_libvirt": self.vagrant.plugins().get("vagrant-libvirt", ""),
            }
        return self._versions

    def facts(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "provider": self.settings.provider,
            "libvirt_uri": self.settings.uri,
            "accel": "kvm" if self.settings.driver == "kvm" else "tcg",
            **self._tool_versions(),
        }

    def host_facts(self) -> dict[str, Any]:
        res = self.virsh.run(["version"], what="virsh version", check=False, timeout=30)
        return {**self.facts(), "libvirt": res.stdout.strip() if res.ok else ""}

    # -- per run ---------------------------------------------------------------------------------------

    def _lock_path(self, run_id: str) -> Path:
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", self.host_name)  # no "@": it separates the run id
        return RUN_LOCK_DIR / f"vagrant-{host}@{run_id}.lock"

    def run_dir(self, run_id: str) -> Path:
        return self.workdir / run_id

    @staticmethod
    def network_name(run_id: str) -> str:
        return f"{NETWORK_PREFIX}{run_id}"

    def open_run(self, run_id: str) -> PlainClient:
        self._run_locks.acquire(run_id, what=f"the lock of run {run_id} on host {self.host_name!r}")
        try:
            rdir = self.run_dir(run_id)
            rdir.mkdir(parents=True, exist_ok=True)
            net = self._make_network(run_id, rdir)
        except BaseException:
            self._remove_run(run_id)
            self._run_locks.release(run_id)
            raise
        return PlainClient(address=str(next(net.hosts())))

    def _make_network(self, run_id: str, rdir: Path) -> ipaddress.IPv4Network:
        name = self.network_name(run_id)
        rng = random.Random()
        for _ in range(5):
            net = free_subnet(self.settings.subnets, host_networks(), rng)
            try:
                self.virsh.create_network(network_xml(name, net), rdir / "network.xml")
                return net
            except LabError as exc:  # a run starting at the same moment took it
                last = exc
        raise BackendError(f"host {self.host_name!r}: cannot create the run's network {name}: {last}")

    def run_network(self, run_id: str) -> Network:
        """The run's network as open_run made it (read back from libvirt's own XML)."""
        name = self.network_name(run_id)
        xml = self.virsh.run(["net-dumpxml", name], what="virsh net-dumpxml").stdout
        m = re.search(r"<ip address='([\d.]+)' netmask='([\d.]+)'", xml)
        if not m:
            raise BackendError(f"network {name} has no IPv4 address")
        return Network(name, str(ipaddress.IPv4Interface(f"{m.group(1)}/{m.group(2)}").network))

    def close_run(self, run_id: str) -> None:
        try:
            self._remove_run(run_id)
        finally:
            self._run_locks.release(run_id)

    def _remove_run(self, run_id: str) -> None:
        """The run's network, and its directory once no machine is left in it."""
        self.virsh.remove_network(self.network_name(run_id))
        rdir = self.run_dir(run_id)
        if rdir.is_dir() and not any(p.is_dir() for p in rdir.iterdir()):
            shutil.rmtree(rdir)

    def run_is_live(self, run_id: str) -> bool | None:
        return self._run_locks.live(run_id)

    # -- per VM ----------------------------------------------------------------------------------------

    def machine(self, image: ImageRef, spec: VmSpec, mdir: Path) -> Machine:
        b = box.built_box(image)
        return Machine(
            name=spec.name,
            image=image.name,
            box=b.name,
            box_version=b.version,
            cpus=spec.vcpus,
            memory_mib=spec.memory_mib,
            nic=spec.nic,
            disk_bus=spec.disk_bus,
            ssh_key=self.env.ssh_key,
            purpose=f"cell {spec.cell_id} of lab run {spec.run_id} on host {self.host_name} (vagrant backend)",
            driver=self.settings.driver,
            uri=self.settings.uri,
            title=f"lab {spec.name}",
            description=lease_text(spec.run_id, spec.cell_id, spec.expires_at, self.host_name),
            boot_timeout=int(self.settings.boot_timeout),
            storage_pool=self.settings.storage_pool,
            network=self.run_network(spec.run_id),
            console_log=mdir / "console.log",
        )

    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        mdir = self.run_dir(spec.run_id) / spec.name
        lease = {
            "run": spec.run_id,
            "cell": spec.cell_id,
            "expires": spec.expires_at,
            "host": self.host_name,
            "domain": spec.name,
            "pool": self.settings.storage_pool,
        }
        try:
            mdir.mkdir(parents=True)
            (mdir / LEASE_FILE).write_text(json.dumps(lease, sort_keys=True) + "\n")  # the marker, first
            machine = self.machine(image, spec, mdir)
            (mdir / "Vagrantfile").write_text(render(machine))
        except BaseException:
            shutil.rmtree(mdir, ignore_errors=True)
            raise
        return Vm(
            spec=spec,
            backend=self.name,
            handle={"dir": str(mdir), "domain": spec.name},
            facts={
                "accel": self.facts()["accel"],
                "box": machine.box,
                "box_version": machine.box_version,
                "vagrant": self._tool_versions()["vagrant"],
                # no memory snapshots (capabilities: snapshots=False): every machine boots
                "start": "cold" if spec.start == "cold" else "cold: Vagrant boots every machine cold",
            },
            control_dir=mdir,
        )

    def start(self, vm: Vm) -> None:
        mdir = Path(vm.handle["dir"])
        t0 = time.monotonic()
        res = self.vagrant.run(
            ["up", "--no-provision"], cwd=mdir, timeout=self.settings.boot_timeout + 120, what="vagrant up", check=False
        )
        (mdir / "vagrant-up.log").write_text(res.stdout + res.stderr)
        vm.facts["vagrant_up_s"] = round(time.monotonic() - t0, 1)
        if not res.ok:
            tail = [ln for ln in (res.stderr or res.stdout).strip().splitlines() if ln.strip()][-3:]
            raise BackendError(
                f"vagrant up of {vm.name} failed (exit {res.returncode}): {' | '.join(tail)}",
                hint=f"see {mdir / 'vagrant-up.log'} and {mdir / 'console.log'}",
            )

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        """`vagrant up` has already waited for SSH: this finds the address and checks sshd answers."""
        limit = timeout or self.settings.boot_timeout
        address = wait_until(
            lambda: self.virsh.address(vm.name),
            timeout=limit,
            what=f"a DHCP lease of {vm.name} on {self.network_name(vm.spec.run_id)}",
        )
        wait_until(lambda: ssh_banner(address), timeout=limit, what=f"sshd of {vm.name} at {address}")
        vm.address = address
        return address

    def destroy(self, vm: Vm) -> None:
        mdir = Path(vm.handle["dir"])
        problems = self._remove_machine(mdir, vm.name)
        if problems:
            raise TeardownError(f"destroying {vm.name} on host {self.host_name!r}: " + "; ".join(problems))

    def _remove_machine(self, mdir: Path, domain: str) -> list[str]:
        """`vagrant destroy`, then the domain and its volume by hand if anything is left, then the
        machine's directory. Returns what could not be removed."""
        problems: list[str] = []
        said = ""
        stop_processes_in(mdir)
        if (mdir / "Vagrantfile").is_file():
            res = self.vagrant.run(
                ["destroy", "-f"], cwd=mdir, timeout=self.settings.destroy_timeout, what="vagrant destroy", check=False
            )
            if not res.ok:
                said = ((res.stderr or res.stdout).strip().splitlines() or [f"exit {res.returncode}"])[-1]
        try:
            if parse_lease(self.virsh.description(domain)) is not None:  # never a domain without the marker
                self.virsh.remove_domain(domain)
            self.virsh.remove_volume(self.settings.storage_pool, f"{domain}.img")
        except LabError as exc:
            problems.append(str(exc))
        if self.virsh.description(domain) is not None:
            problems.append(f"domain {domain} is still defined" + (f" (vagrant destroy: {said})" if said else ""))
        if f"{domain}.img" in {n for n, _ in self.virsh.volumes(self.settings.storage_pool)}:
            problems.append(f"volume {domain}.img is still in pool {self.settings.storage_pool}")
        if not problems:
            shutil.rmtree(mdir, ignore_errors=True)
        return problems

    def console_text(self, vm: Vm) -> str:
        try:
            return (Path(vm.handle["dir"]) / "console.log").read_text(errors="replace")
        except OSError:
            return ""

    # -- garbage collection ------------------------------------------------------------------------------

    def _machine_dirs(self) -> dict[str, Path]:
        """Machine directories carrying the lab's lease file: those Vagrant's machine index lists
        under the work directory (the index is pruned of the dead on the way), and those a run
        killed before `vagrant up` registered the machine left."""
        found: dict[str, Path] = {}
        for lease in self.workdir.glob(f"*/*/{LEASE_FILE}"):
            found[lease.parent.name] = lease.parent
        for entry in self.vagrant.global_status():
            home = Path(entry.directory)
            if home.parent.parent == self.workdir and (home / LEASE_FILE).is_file():
                found[home.name] = home
        return found

    def list_owned(self) -> list[Owned]:
        out: list[Owned] = []
        dirs = self._machine_dirs()
        domains: dict[str, dict[str, str]] = {}
        every_domain = self.virsh.domains()
        for name in every_domain:
            if name.startswith("lab-"):
                found = parse_lease(self.virsh.description(name))
                if found is not None:
                    domains[name] = found
        for name in sorted(set(dirs) | set(domains)):
            lease: dict[str, Any] = dict(domains.get(name, {}))
            mdir = dirs.get(name)
            if mdir is not None:
                try:
                    lease = {**json.loads((mdir / LEASE_FILE).read_text()), **lease}
                except (OSError, ValueError):
                    pass
            if not lease.get("run"):
                continue
            out.append(
                Owned(
                    backend=self.name,
                    kind="vm",
                    name=name,
                    run_id=str(lease["run"]),
                    expires_at=float(lease.get("expires") or 0),
                    detail=json.dumps({"dir": str(mdir or "")}, sort_keys=True),
                )
            )
        for vol, path in self.virsh.volumes(self.settings.storage_pool):
            m = _VOLUME_RE.match(vol)
            # a volume of the run naming scheme whose domain is gone (any domain, marked or not, keeps it)
            if m and vol.removesuffix(".img") not in every_domain and vol.removesuffix(".img") not in dirs:
                out.append(Owned(backend=self.name, kind="disk", name=vol, run_id=m["run"], detail=path))
        locked = {o.run_id for o in self._run_locks.owned(self.name)}
        for net in self.virsh.networks():
            run_id = net.removeprefix(NETWORK_PREFIX)
            if net.startswith(NETWORK_PREFIX) and run_id not in locked:  # with a lock, it goes with the lock
                out.append(Owned(backend=self.name, kind="network", name=net, run_id=run_id))
        return out + self._run_locks.owned(self.name)

    def remove_owned(self, item: Owned) -> None:
        if item.kind == "vm":
            mdir = Path(json.loads(item.detail or "{}").get("dir") or self.run_dir(item.run_id) / item.name)
            problems = self._remove_machine(mdir, item.name)
            if problems:
                raise TeardownError(f"gc of {item.name} on {self.host_name!r} failed: " + "; ".join(problems))
            if not runlock.held(self._lock_path(item.run_id)):  # a dead run's last machine: its network too
                self._remove_run(item.run_id)
        elif item.kind == "disk":
            self.virsh.remove_volume(self.settings.storage_pool, item.name)
        elif item.kind == "network":
            self._remove_run(item.run_id)
        elif item.kind == "lock":
            path = Path(item.detail)
            if runlock.held(path):  # a live run (gc --force): its network is in use
                return
            self._remove_run(item.run_id)
            runlock.remove_if_dead(path)
        else:
            raise UsageError(f"vagrant backend does not own {item.kind!r} items")


BACKEND = VagrantBackend
