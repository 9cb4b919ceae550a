"""The vagrant backend: each cell is a Vagrant machine, `vagrant up` and `vagrant destroy` of a
Vagrantfile lab writes for it (vagrant-libvirt; the provider is a setting).

Per run (open_run): the run lock on this machine (`lab gc` tells a live run from a killed one),
the run's directory `<workdir>/<run>/` and an isolated libvirt network `labvg-<run>` (a free /24
of `subnets`, DHCP, no forwarding). The host's side of that network is the run's client address:
load generators listen there, the guests reach them on their one NIC.

Per cell: `<workdir>/<run>/<vm>/` holds `lease.json` (the lab's marker: run, cell, expiry, owner), the
Vagrantfile (templates/vagrant/Vagrantfile.j2: the box version of the image's build, NIC model,
vCPUs, memory, disk bus, the run's network, the serial console to `console.log`) and Vagrant's
own `.vagrant/`. The libvirt domain is named as the VM (`lab-<run>-<cell>`) and carries the lease
in its <description>; vagrant-libvirt's overlay volume is `<vm>.img` in `storage_pool`. `start`
is `vagrant up --no-provision` (it returns once Vagrant reached the guest over SSH); the address
is the guest's DHCP lease; `destroy` is `vagrant destroy -f`, then whatever of the domain and its
volume is left is removed through virsh and checked gone.

`lab gc`: machines found in Vagrant's machine index (`vagrant global-status`), in the work
directory and as libvirt domains carrying the lease, and `lab-<run>-*.img` volumes without a
domain; nothing without the marker is touched. The work directory (default: "vagrant" in the
lab's state directory) is held to the state directory's rules, and Vagrant runs only in a machine
directory whose lease.json the lab wrote for it (lab.backends.vagrant.machines): root never runs a
planted Vagrantfile. A dead run's network and directory go with its run lock, last.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import random
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab import images, proc, runlock, statedir
from lab.backends.base import Backend, BackendEnv, Capabilities, PlainClient
from lab.backends.neighbours import ssh_banner
from lab.backends.vagrant import box
from lab.backends.vagrant.lease import lease_text, parse_lease, read_lease, renew_file, write_lease
from lab.backends.vagrant.machines import Machines
from lab.backends.vagrant.settings import Settings, capabilities
from lab.backends.vagrant.tools import Vagrant, Virsh
from lab.backends.vagrant.vagrantfile import Machine, Network, render
from lab.errors import BackendError, IncompleteListing, LabError, TeardownError, UnreachableError, UsageError
from lab.lease import owner_or_empty
from lab.model import ImageRef, Owned, Vm, VmSpec
from lab.runlock import RunLocks
from lab.wait import wait_until

NETWORK_PREFIX = "labvg-"
_RUN = r"[a-z0-9][a-z0-9-]*"  # lab run ids (`lab run --run-id`)
# vagrant-libvirt's volume of a cell's machine: <domain>.img, the domain being lab-<run>-<cell>
_VOLUME_RE = re.compile(rf"^lab-(?P<run>{_RUN})-(?P<cell>c\d+(?:-[a-z]+)?)\.img$")


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
        # the setting, else "vagrant" in the lab's private state directory
        self.workdir = Path(settings.workdir) if settings.workdir else self.env.state_dir / "vagrant"
        self._run_locks = RunLocks(self._lock_path)
        self.publishing = box.BoxPublishing(self.vagrant)
        self._versions: dict[str, str] = {}

    @classmethod
    def capabilities(cls, settings: Settings) -> Capabilities:  # type: ignore[override]
        return capabilities(settings)

    # -- the host ------------------------------------------------------------------------------------

    @property
    def _workdir_what(self) -> str:
        return f"host {self.host_name!r}: workdir"

    def check(self) -> None:
        # checked, not made (open_run makes it): root runs Vagrantfiles found there
        statedir.check(self.workdir, self._workdir_what)
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
        return self.env.state_dir / f"vagrant-{host}@{run_id}.lock"

    def run_dir(self, run_id: str) -> Path:
        return self.workdir / run_id

    @staticmethod
    def network_name(run_id: str) -> str:
        return f"{NETWORK_PREFIX}{run_id}"

    def open_run(self, run_id: str) -> PlainClient:
        self._run_locks.acquire(run_id, what=f"the lock of run {run_id} on host {self.host_name!r}")
        try:
            statedir.ensure(self.workdir, self._workdir_what)
            rdir = statedir.ensure(self.run_dir(run_id), self._workdir_what)
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
        if rdir.is_dir() and not rdir.is_symlink() and not any(p.is_dir() for p in rdir.iterdir()):
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
            description=lease_text(spec.run_id, spec.cell_id, spec.expires_at, self.host_name, spec.owner),
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
            "owner": spec.owner,
        }
        try:
            mdir.mkdir(mode=0o700)
            write_lease(mdir, lease)  # the marker, first
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
        problems = self._machines().remove(Path(vm.handle["dir"]), vm.name)
        if problems:
            raise TeardownError(f"destroying {vm.name} on host {self.host_name!r}: " + "; ".join(problems))

    def _machines(self) -> Machines:
        """The machine directories of the work directory, with this backend's tools (as they are now:
        tests hand it fakes)."""
        return Machines(self.workdir, self.vagrant, self.virsh, self.settings)

    def renew_lease(self, vm: Vm, expires_at: float) -> None:
        renew_file(Path(vm.handle["dir"]), expires_at)
        # the domain exists once `vagrant up` defined it (with the Vagrantfile's first lease)
        spec = vm.spec
        self.virsh.set_description(
            vm.name, lease_text(spec.run_id, spec.cell_id, expires_at, self.host_name, spec.owner)
        )

    def console_text(self, vm: Vm) -> str:
        try:
            return proc.read_bounded(Path(vm.handle["dir"]) / "console.log")  # a guest may print without end
        except OSError:
            return ""

    # -- garbage collection ------------------------------------------------------------------------------

    def list_owned(self) -> list[Owned]:
        why = statedir.problem(self.workdir)
        if why:  # someone else's, or open to others: nothing found there is trusted, nor run
            raise IncompleteListing(
                f"workdir {self.workdir} {why}", [], [f"workdir {self.workdir} {why}: nothing in it was trusted"]
            )
        out: list[Owned] = []
        dirs = self._machines().found()
        domains: dict[str, dict[str, str]] = {}
        every_domain = self.virsh.domains()
        for name in every_domain:
            if name.startswith("lab-"):
                found = parse_lease(self.virsh.description(name))
                if found is not None:
                    domains[name] = found
        for name in sorted(set(dirs) | set(domains)):
            mdir = dirs.get(name)
            lease: dict[str, Any] = {**(read_lease(mdir) if mdir is not None else {}), **domains.get(name, {})}
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
                    owner=owner_or_empty(lease.get("owner")),
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
            problems = self._machines().remove(mdir, item.name)
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
