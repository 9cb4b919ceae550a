"""Isolation: where a cell's workloads run on its machine (the matrix axis `isolation`).

- "vm": on the machine itself (the guest, or the host of the bare-metal cell); nothing is made.
- "container": a container on that machine, made for the cell in its tune stage and removed at
  teardown, by the cell's `runtime` (Podman, or Docker where the machine has it: RUNTIMES). The
  workloads run unchanged: they get a Guest (ContainerGuest) whose every command enters the
  container (`podman exec` / `docker exec`).
- "zone" (a SmartOS host's lx zone): the host's backend makes the zone as the cell's machine, in
  place of a VM (VmSpec.isolation, Capabilities.machine_isolation), from the zone image its settings
  name for the cell's image; here it is the machine itself, as "vm" is.
- "jail" (FreeBSD guests and hosts): no runtime makes them here (no FreeBSD machine exists), so
  lab.check refuses them at plan time.

scp's load, the machine's sshd, is an sshd the container runs (a workload's traits: serves_ssh).
Workloads that start containers themselves (their traits: makes_containers, container_places:
podman-build, container-start, git-clone's container places) run inside a container cell, podman's
or docker's, with nested podman (run_argv's `nested`, made only when the cell's suite has one): the
container is privileged, has a store of its own, and sees the machine's podman images read-only.
Inside a docker cell, then, a build or a start is podman's (docker's own daemon is not nested).

The container is the lab's base image (localhost/lab-base: imported into root's podman and docker
stores when the golden image is built; on a machine whose docker store lacks it, from BASE_TARBALL
when a docker cell first needs it; nothing is pulled) with the machine's /usr, nginx configuration and site bound
read-only. The suite thus runs the very binaries the VM cell runs, and what differs between the
two cells is the isolation, not the build of the tools. The machine's own nginx is stopped and
the container's serves the http workloads on the same address (network "host": the machine's
stack; "bridge": the runtime's own namespace behind NAT, ports 80 and 443 published, and the
cell's tuned net.* sysctls that a namespace may set given at `run`: bridge_sysctls). The golden
image has docker beside podman (socket-activated: its daemon starts with the first docker cell's
tune stage, not at boot); a machine without it makes its docker cells n/a with the reason.

CPU busy %: a container shares its machine's kernel, so /proc/stat read inside it is the guest's:
the busy % counts everything the guest ran, the container included, as in the VM cell. The CPU
snapshot command is therefore run on the machine, not through `podman exec`: entering the
container costs ~1.5 s of CPU under TCG, which would land inside the load's window.

Docker and the bare-metal cell: docker's containers are made by its daemon, outside the cell's
network namespace and cgroup, so the bare-metal docker cell is n/a with that reason.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from lab import osfacts, proc, tuning
from lab.errors import LabError, TimeoutError_
from lab.guest import Machine, SshLogin
from lab.model import MADE_BY_HOST, Isolation, Runtime
from lab.wait import wait_until

BASE_IMAGE = "localhost/lab-base:latest"  # lab.images.DEBIAN12.container.name (a test keeps them equal)
# Where a guest may keep the base image's tarball: a runtime whose store lacks BASE_IMAGE imports it
# from there. The debian12 image keeps none: both of its stores are seeded at the rootfs build.
BASE_TARBALL = "/var/lib/lab/lab-base.tar.zst"
IMPORT_TIMEOUT_S = 900  # ~60 s under TCG for the 160 MB image
# The machine's directories the container sees (read-only), when the machine has them: the tools
# (/usr: Debian merges /bin, /sbin, /lib into it), nginx's configuration and the site it serves.
# /etc/alternatives: the links Debian's /usr/bin and /usr/sbin point through (iptables, awk) are the
# machine's too, or its binaries would miss them.
BINDS = ("/usr", "/etc/alternatives", "/etc/nginx", "/srv/www")
NGINX_DIRS = ("/var/lib/nginx", "/var/log/nginx")  # what nginx writes, in the container's own /var
WEB_PORTS = (80, 443)  # published on the machine's address with network = "bridge"
NETWORKS = ("host", "bridge")
STOP_NGINX = "systemctl stop nginx 2>/dev/null || rc-service nginx stop 2>/dev/null || true"

# Why jails are refused here (lab.check): one line.
NOT_HERE = {
    Isolation.JAIL: "no jail runtime exists here: jails need a FreeBSD guest or host (the freebsd14 image "
    "cannot be built on this machine, and no backend makes FreeBSD hosts' jails yet)",
}

# For workloads whose load is the machine's sshd (their own SSH connection from the client side:
# traits serves_ssh): inside a container cell the container runs an sshd of its own, the machine's
# binary, configuration, host keys and authorized keys (bound read-only), on SSHD_PORT (the machine's
# sshd keeps port 22 of a host-network container's stack); the client checks the machine's host keys
# under its name.
SSHD_PORT = 2222
SSHD_BINDS = ("/etc/ssh", "/root/.ssh")
# sshd daemonizes: its parent exits before the daemon writes its pid file (after binding its port),
# so the file is waited for (read too early once, under load in make test)
SSHD_START = "mkdir -p /run/sshd && /usr/sbin/sshd -t -p {port} && /usr/sbin/sshd -p {port}"
SSHD_PID = "cat /run/sshd.pid 2>/dev/null"
SSHD_PID_TIMEOUT_S = 30
# In the container: the machine's privilege-separation user ({user}: its passwd line, shell-quoted)
# added to the base image's /etc/passwd, which has none.
SSHD_ADD_USER = "grep -q '^sshd:' /etc/passwd || echo {user} >> /etc/passwd"
# Workloads that start containers of their own (Workload.own_containers): inside the cell's container
# they get nested podman (NESTED_*), made only for such cells.
# Nested podman: a privileged container (podman mounts overlays and makes network namespaces) with a
# store of its own on the machine's disk (overlay cannot sit on the container's own overlay root),
# the machine's store added read-only (the base image is there: nothing is copied or pulled), the
# machine's image policy and registries, cgroupfs (no systemd inside) and a file for events (no
# journald inside).
NESTED_DIR = "/var/tmp/lab-nested"  # on the machine: <NESTED_DIR>/<container>/{etc,store}
NESTED_ETC = "/etc/lab-nested"  # in the container
MACHINE_STORE = "/var/lib/containers/storage"
MACHINE_STORE_INSIDE = "/var/lib/lab-machine-store"
NESTED_FILES = ("/etc/containers/policy.json", "/etc/containers/registries.conf")
NESTED_CONF = {
    "storage.conf": f"""[storage]
driver = "overlay"
runroot = "/run/containers/storage"
graphroot = "{MACHINE_STORE}"
[storage.options]
additionalimagestores = ["{MACHINE_STORE_INSIDE}"]
""",
    "containers.conf": """[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
""",
}
NESTED_ENV = {"CONTAINERS_STORAGE_CONF": "storage.conf", "CONTAINERS_CONF": "containers.conf"}
# Podman's default network, redefined inside (a file named after it overrides the built-in one): the
# built-in is podman0 on 10.88.0.0/16, the outer container's own on a bridge cell (its gateway would
# be a local address inside) and the guest's interface on a host-network cell.
NESTED_NETWORK = {
    "name": "podman",
    "id": "2f259bab93aaaaa2542ba43ef33eb990d0999ee1b9924b557b7be53c0b7a1bb9",  # podman's fixed id for it
    "driver": "bridge",
    "network_interface": "labnest0",
    "created": "2026-01-01T00:00:00Z",
    "subnets": [{"subnet": "10.90.0.0/24", "gateway": "10.90.0.1"}],
    "ipv6_enabled": False,
    "internal": False,
    "dns_enabled": False,
    "ipam_options": {"driver": "host-local"},
}
NETWORKS_DIR = "/etc/containers/networks"  # writable: netavark keeps its lock there


class Unavailable(LabError):
    """The machine cannot make the cell's isolation (no runtime, no base image): the cell is n/a."""


def kind_problem(kind: Isolation) -> str:
    """Pure: why lab.check refuses an isolation kind before anything is made ("" if it can run)."""
    return NOT_HERE.get(kind, "")


def os_problem(kind: Isolation, os_name: str) -> str:
    """Pure: why a guest OS cannot hold this isolation kind ("" if it can)."""
    if kind == Isolation.CONTAINER and osfacts.facts(os_name).family != "linux":
        return f"guest OS {os_name} has no podman (containers run on Linux guests; FreeBSD's are jails)"
    if kind == Isolation.ZONE and osfacts.facts(os_name).family != "linux":
        return f"a zone of guest OS {os_name} cannot be made: the lab's zones are lx zones, which run Linux"
    return ""


def workload_problem(what: str, *, bare_metal: bool = False) -> str:
    """Pure: why a workload that starts containers of its own (`what`: why it does, from
    Workload.own_containers; "" when it does not) cannot run inside the container cells (a VM's,
    podman's or docker's, get nested podman; the bare-metal host's cannot) ("" if it can)."""
    if not what:
        return ""
    if bare_metal:
        return (
            f"{what}, and nested containers on the bare-metal host would make cgroups outside the cell's "
            "(its CPU accounting); run them in a VM's container cell"
        )
    return ""


@dataclass(frozen=True)
class RuntimeFacts:
    """What differs between the container runtimes the lab drives (their CLIs are otherwise alike)."""

    command: str  # the CLI
    marker: str  # the file the runtime puts in every container it runs, never on the machine
    remove: tuple[str, ...]  # `rm` options that stop and remove at once
    # `run` options that put both runtimes on the same footing. The golden image boots with
    # apparmor=0 (both unconfined); on a machine with AppArmor on and no apparmor_parser, podman
    # runs its containers unconfined, while docker refuses to start one unless told to do the same.
    run: tuple[str, ...]
    # the `run` options that keep the container in the caller's cgroup (the bare-metal cell's), or
    # why this runtime cannot (its daemon, not the caller, makes the container)
    host_cgroup: tuple[str, ...] | str


RUNTIMES: dict[Runtime, RuntimeFacts] = {
    Runtime.PODMAN: RuntimeFacts(
        "podman", "/run/.containerenv", ("--force", "--time", "0"), (), ("--cgroups=disabled",)
    ),
    Runtime.DOCKER: RuntimeFacts(
        "docker",
        "/.dockerenv",
        ("--force",),
        ("--security-opt", "apparmor=unconfined"),
        "docker's daemon makes its containers outside the bare-metal cell's network namespace and "
        "cgroup, so what they measured would not be the cell's (use runtime podman on the host)",
    ),
}


def run_argv(
    name: str,
    network: str,
    binds: list[str],
    labels: dict[str, str],
    *,
    host_cgroup: bool = False,
    runtime: Runtime = Runtime.PODMAN,
    sysctls: dict[str, str] | None = None,
    nested: str = "",
    sshd: bool = False,
) -> list[str]:
    """Pure: `<runtime> run` of the cell's container, idle until the workloads exec into it.
    `host_cgroup`: the container stays in the caller's cgroup (the bare-metal cell's, whose CPU
    accounting reads it) instead of getting one of its own (podman only). `sysctls`: set in the
    container's own network namespace (network "bridge" only: "host" shares the machine's).
    `nested`: the machine's directory of nested_setup: podman inside the container (either runtime's:
    the options are the same to both CLIs).
    `sshd`: the container will run an sshd of its own (a workload's traits: serves_ssh)."""
    if network not in NETWORKS:
        raise ValueError(f"network must be one of {', '.join(NETWORKS)}, got {network!r}")
    if sysctls and network != "bridge":
        raise ValueError("sysctls are the container's own only with network = 'bridge'")
    rt = RUNTIMES[runtime]
    argv = [rt.command, "run", "--detach", "--name", name, f"--network={network}", *rt.run]
    if network == "bridge":
        ports = (*WEB_PORTS, SSHD_PORT) if sshd else WEB_PORTS
        argv += [a for port in ports for a in ("--publish", f"{port}:{port}")]
    argv += [a for k, v in sorted((sysctls or {}).items()) for a in ("--sysctl", f"{k}={' '.join(v.split())}")]
    if host_cgroup:
        if isinstance(rt.host_cgroup, str):
            raise ValueError(rt.host_cgroup)
        argv += rt.host_cgroup
    argv += [a for k, v in sorted(labels.items()) for a in ("--label", f"{k}={v}")]
    argv += [a for d in (*binds, *(SSHD_BINDS if sshd else ())) for a in ("--volume", f"{d}:{d}:ro")]
    if nested:
        argv.append("--privileged")
        argv += [a for k, f in NESTED_ENV.items() for a in ("--env", f"{k}={NESTED_ETC}/{f}")]
        argv += ["--volume", f"{nested}/etc:{NESTED_ETC}:ro", "--volume", f"{nested}/store:{MACHINE_STORE}"]
        argv += ["--volume", f"{nested}/networks:{NETWORKS_DIR}"]
        argv += ["--volume", f"{MACHINE_STORE}:{MACHINE_STORE_INSIDE}:ro"]
        argv += [a for f in NESTED_FILES for a in ("--volume", f"{f}:{f}:ro")]
    return argv + [BASE_IMAGE, "sleep", "infinity"]


def nested_setup(directory: str) -> str:
    """Pure: the machine's command that makes `directory` for nested podman (run_argv's `nested`):
    an empty store, the configuration NESTED_ENV names and the default network's."""
    d = shlex.quote(directory)
    texts = {f"etc/{name}": text for name, text in NESTED_CONF.items()}
    texts["networks/podman.json"] = json.dumps(NESTED_NETWORK, indent=1) + "\n"
    files = " && ".join(f"printf %s {shlex.quote(text)} > {d}/{name}" for name, text in texts.items())
    return f"rm -rf {d} && mkdir -p {d}/etc {d}/store {d}/networks && {files}"


NESTED_INFO = (
    "podman info --format '{{.Store.GraphDriverName}} {{.Host.CgroupManager}}' && "
    "podman network inspect podman --format '{{.NetworkInterface}} {{range .Subnets}}{{.Subnet}}{{end}}'"
)


def parse_nested_info(text: str) -> dict[str, str]:
    """Pure: NESTED_INFO's lines -> driver, cgroup_manager, network ({} when they are not those)."""
    lines = [ln.split() for ln in (text or "").splitlines()]
    if len(lines) != 2 or len(lines[0]) != 2 or len(lines[1]) != 2:
        return {}
    return {"driver": lines[0][0], "cgroup_manager": lines[0][1], "network": " ".join(lines[1])}


def netns_probe(keys: list[str]) -> str:
    """Pure: the machine's command that prints which of `keys` a new network namespace may set for
    itself (net.ipv4.tcp_rmem; not net.core.rmem_max, kernel-wide: absent there before Linux 6.x's
    read-only copy, so existence is not enough)."""
    paths = " ".join(shlex.quote("/proc/sys/" + k.replace(".", "/")) for k in keys)
    return f'unshare --net sh -c \'for p in "$@"; do if test -w "$p"; then echo "$p"; fi; done\' sh {paths}'


def netns_keys(keys: list[str], probe_output: str) -> list[str]:
    """Pure: those of `keys` whose /proc/sys path the probe printed."""
    seen = set(probe_output.split())
    return [k for k in keys if "/proc/sys/" + k.replace(".", "/") in seen]


def bridge_sysctls(machine: Machine, tuned: dict[str, str], where: str) -> tuple[dict[str, str], list[str]]:
    """The tuned net.* keys a bridge container's own namespace has (set there at `run`), and
    those it does not (kernel-wide: the container sees the machine's). Other keys (vm.*, kernel.*)
    are the shared kernel's: they apply inside as they are."""
    keys = sorted(k for k in tuned if k.startswith("net."))
    if not keys:
        return {}, []
    res = machine.run(netns_probe(keys), timeout=60, check=False)
    if res.returncode != 0:
        raise LabError(f"probing the network namespace's sysctls on {where} failed: {res.stderr.strip()[-300:]}")
    own = netns_keys(keys, res.stdout)
    return {k: tuned[k] for k in own}, [k for k in keys if k not in own]


def exec_argv(name: str, command: str, *, stdin: bool = False, runtime: Runtime = Runtime.PODMAN) -> list[str]:
    """Pure: `<runtime> exec` of one shell command line in the container (-i only when input is sent)."""
    return [RUNTIMES[runtime].command, "exec", *(["--interactive"] if stdin else []), name, "sh", "-c", command]


def remove_argv(name: str, runtime: Runtime = Runtime.PODMAN) -> list[str]:
    rt = RUNTIMES[runtime]
    return [rt.command, "rm", *rt.remove, name]


INSPECT_FORMAT = "{{.Id}} {{.State.Status}} {{.State.Pid}} {{.HostConfig.NetworkMode}}"


def parse_inspect(text: str) -> dict[str, Any]:
    """Pure: INSPECT_FORMAT's line -> id, state, pid, network ({} when it is not that line)."""
    parts = (text or "").split()
    if len(parts) != 4 or not parts[2].lstrip("-").isdigit():
        return {}
    return {"id": parts[0], "state": parts[1], "pid": int(parts[2]), "network": parts[3]}


class ContainerGuest(Machine):
    """Every command line runs inside the cell's container on `machine` (a Guest or HostGuest),
    except the CPU snapshot, which reads the same kernel counters on the machine itself (see the
    module's docstring)."""

    def __init__(
        self, machine: Machine, name: str, os_name: str, runtime: Runtime = Runtime.PODMAN, *, sshd: bool = False
    ):
        self.machine, self.name, self.runtime = machine, name, runtime
        self.address, self.os = machine.address, machine.os
        self.known_hosts = machine.known_hosts  # the machine's host keys, which the container's sshd has
        # What a workload's own SSH connection (scp) logs in with: the machine's key and user, and the
        # container's sshd (else the machine's), checked against the machine's known_hosts entry.
        # None: the machine is not reached by SSH (the bare-metal cell's host), nor is its container.
        login = machine.ssh_login()
        self._login = (
            None
            if login is None
            else SshLogin(
                login.address,
                SSHD_PORT if sshd else login.port,
                login.user,
                login.key,
                host_key_alias=login.address if login.port == 22 else f"[{login.address}]:{login.port}",
            )
        )
        # lab.workloads.cpu.snapshot's exact command line for this OS
        self._snapshot = "sh -c " + shlex.quote(osfacts.facts(os_name).cpu_ticks_cmd)
        self.execs = 0  # commands that entered the container (recorded with the cell)

    def run(self, command: str, *, timeout: float = 120.0, check: bool = True, input: str | None = None) -> proc.Result:
        if command == self._snapshot:
            return self.machine.run(command, timeout=timeout, check=check, input=input)
        self.execs += 1
        return self.machine.run(
            shlex.join(exec_argv(self.name, command, stdin=input is not None, runtime=self.runtime)),
            timeout=timeout,
            check=check,
            input=input,
        )

    def ssh_login(self) -> SshLogin | None:
        return self._login

    def close(self) -> None:
        pass  # the machine's connection is closed by whoever opened it


def listed_argv(name: str, runtime: Runtime) -> list[str]:
    """Pure: the names of containers called exactly `name` (empty output: none), in both CLIs."""
    return [RUNTIMES[runtime].command, "ps", "--all", "--filter", f"name=^{name}$", "--format", "{{.Names}}"]


@dataclass
class Place:
    """Where a cell's workloads run: `guest` for them, `facts` to record with the cell (updated at
    removal), `remove()` at teardown."""

    guest: Machine
    facts: dict[str, Any] = field(default_factory=dict)
    container: ContainerGuest | None = None  # the cell's container (then also `guest`), removed at teardown
    nested_dir: str = ""  # the machine's directory of nested podman's store, removed with the container

    @property
    def name(self) -> str:
        return self.container.name if self.container is not None else ""

    def remove(self) -> None:
        if self.container is None:
            return
        machine, runtime = self.container.machine, self.container.runtime
        self.facts["execs"] = self.container.execs
        machine.run(shlex.join(remove_argv(self.name, runtime)), timeout=120, check=False)
        left = machine.run(shlex.join(listed_argv(self.name, runtime)), timeout=60, check=False)
        self.facts["removed"] = left.returncode == 0 and not left.stdout.strip()
        if self.nested_dir and self.facts["removed"]:  # its mounts went with the container's namespace
            machine.run(f"rm -rf {shlex.quote(self.nested_dir)}", timeout=300, check=False)
        if not self.facts["removed"]:
            raise LabError(f"container {self.name} is still there after `{runtime.value} rm --force`")


def enter(
    kind: Isolation,
    machine: Machine,
    *,
    name: str,
    os_name: str,
    network: str = "host",
    runtime: Runtime = Runtime.PODMAN,
    labels: dict[str, str] | None = None,
    host_cgroup: bool = False,
    serve_web: bool = True,
    where: str = "the guest",
    tuned: dict[str, str] | None = None,
    nested: bool = False,
    sshd: bool = False,
) -> Place:
    """Make the cell's isolation on `machine` and return where its workloads run. "vm": the machine
    itself. Unavailable (the cell is n/a) when the machine has no runtime or no base image; what
    was made before another failure is removed. `serve_web`: the machine's nginx gives way to the
    container's (a guest made for the cell; never the bare-metal host's own service). `tuned`:
    the sysctls the machine was tuned with; network "bridge" gives the container a namespace of
    its own, which gets the namespaced ones (facts: sysctls, sysctls_kernel_wide). `nested`: the
    cell's workloads start containers themselves, so podman runs inside (facts: nested). `sshd`: a
    workload's load is the machine's sshd, so the container runs its own (facts: sshd)."""
    if kind == Isolation.VM or kind in MADE_BY_HOST:
        return Place(machine)
    if kind != Isolation.CONTAINER:
        raise Unavailable(f"isolation {kind.value}: {kind_problem(kind) or 'not made by this lab'}")
    rt = RUNTIMES[runtime]
    if host_cgroup and isinstance(rt.host_cgroup, str):
        raise Unavailable(f"isolation container, runtime {runtime.value}: {rt.host_cgroup}")
    if nested and host_cgroup:  # lab.check refuses these plans
        raise Unavailable(f"isolation container, runtime {runtime.value}: nested containers are set up only in a VM")
    if machine.run(f"command -v {rt.command}", timeout=30, check=False).returncode != 0:
        raise Unavailable(f"isolation container: {rt.command} is not installed on {where}")
    facts: dict[str, Any] = {"kind": kind.value, "runtime": runtime.value, "image": BASE_IMAGE}
    if rt.run:
        facts["run_options"] = list(rt.run)
    facts[rt.command] = _version(machine, runtime, where)
    if machine.run(f"{rt.command} image inspect {BASE_IMAGE} >/dev/null", timeout=120, check=False).returncode != 0:
        facts["imported_s"] = _import_base(machine, runtime, where)
    have = machine.run("ls -d " + " ".join(BINDS) + " 2>/dev/null", timeout=30, check=False).stdout.split()
    binds = [d for d in BINDS if d in have]
    nested_dir = f"{NESTED_DIR}/{name}" if nested else ""
    guest = ContainerGuest(machine, name, os_name, runtime, sshd=sshd)
    place = Place(guest, facts=facts, container=guest, nested_dir=nested_dir)
    facts.update(binds=binds, network=network)
    if nested_dir:
        machine.run(nested_setup(nested_dir), timeout=60)
    web = serve_web and machine.run("test -x /usr/sbin/nginx", timeout=30, check=False).returncode == 0
    if web:  # the container's nginx takes the machine's ports (host) or their published twins (bridge)
        machine.run(STOP_NGINX, timeout=60, check=False)
    sysctls: dict[str, str] = {}
    if network == "bridge" and tuned:
        sysctls, kernel_wide = bridge_sysctls(machine, tuned, where)
        facts.update(sysctls=sysctls, sysctls_kernel_wide=kernel_wide)
    argv = run_argv(
        name,
        network,
        binds,
        labels or {},
        host_cgroup=host_cgroup,
        runtime=runtime,
        sysctls=sysctls,
        nested=nested_dir,
        sshd=sshd,
    )
    try:
        machine.run(shlex.join(argv), timeout=300)
        _inside(place, guest, web)
        if nested_dir:
            facts["nested"] = _nested_inside(guest)
        if sshd:
            facts["sshd"] = _sshd_inside(guest, machine)
        if sysctls:  # read back inside, as the tune stage reads the guest's
            seen = tuning.read(place.guest, osfacts.facts(os_name), list(sysctls))
            wrong = {k: seen.get(k) for k, v in sysctls.items() if seen.get(k) != tuning.normalise(v)}
            if wrong:
                raise LabError(f"the container's network namespace did not take {sorted(wrong)}: it has {wrong}")
    except BaseException:
        try:
            place.remove()
        except LabError:
            pass  # the first error is the one to report; the machine goes at teardown anyway
        raise
    return place


def import_argv(runtime: Runtime) -> str:
    """Pure: the shell command line that imports BASE_TARBALL as BASE_IMAGE (what provisioning
    does for podman at image build)."""
    change = shlex.quote('CMD ["/bin/sh"]')
    return f"zstd -dc {BASE_TARBALL} | {RUNTIMES[runtime].command} import --change {change} - {BASE_IMAGE} >/dev/null"


def _import_base(machine: Machine, runtime: Runtime, where: str) -> float:
    """Import the base image into the runtime's store from the tarball the golden image keeps;
    Unavailable (the cell is n/a) when there is none. Returns the seconds it took (a cell fact:
    the tune stage, never a measurement, pays it)."""
    if machine.run(f"test -f {BASE_TARBALL}", timeout=30, check=False).returncode != 0:
        raise Unavailable(
            f"isolation container: {where} has no {BASE_IMAGE} in {RUNTIMES[runtime].command}'s store "
            f"and no {BASE_TARBALL} to import it from (rebuild the golden image)"
        )
    t0 = time.monotonic()
    machine.run(import_argv(runtime), timeout=IMPORT_TIMEOUT_S)
    return round(time.monotonic() - t0, 1)


def _version(machine: Machine, runtime: Runtime, where: str) -> str:
    """The runtime's version line. Docker's is its daemon's too: the golden image starts dockerd
    on the first connection to its socket (slow under TCG), and a daemon that does not answer is
    the machine's fault, not a missing runtime."""
    if runtime == Runtime.PODMAN:
        return machine.run("podman --version", timeout=60, check=False).stdout.strip()
    res = machine.run("docker version --format 'docker {{.Server.Version}}'", timeout=300, check=False)
    if res.returncode != 0:
        raise LabError(f"docker's daemon on {where} does not answer: {(res.stderr or res.stdout).strip()[-300:]}")
    return res.stdout.strip()


def _sshd_inside(guest: ContainerGuest, machine: Machine) -> dict[str, Any]:
    """Start the container's sshd: the machine's privilege-separation user added to the container's
    /etc/passwd (the base image's has none), its configuration checked first (`sshd -t`)."""
    user = machine.run("grep '^sshd:' /etc/passwd", timeout=30, check=False).stdout.strip()
    if user:
        guest.run(SSHD_ADD_USER.format(user=shlex.quote(user)), timeout=30)
    res = guest.run(SSHD_START.format(port=SSHD_PORT), timeout=60, check=False)
    if res.returncode != 0:
        raise LabError(f"container {guest.name}: its sshd did not start: {(res.stderr or res.stdout).strip()[-300:]}")

    def pid() -> int | None:
        out = guest.run(SSHD_PID, timeout=30, check=False).stdout.strip()
        return int(out) if out.isdigit() else None

    try:
        started = wait_until(
            pid, timeout=SSHD_PID_TIMEOUT_S, what=f"container {guest.name}'s sshd pid file", interval=0.2
        )
    except TimeoutError_ as exc:
        raise LabError(f"container {guest.name}: its sshd did not start: {exc.message}") from None
    return {"port": SSHD_PORT, "pid": started, "host_keys": "the machine's"}


def _nested_inside(guest: ContainerGuest) -> dict[str, Any]:
    """Check that podman works inside the container and sees the base image; what it runs with."""
    info = parse_nested_info(guest.run(NESTED_INFO, timeout=120, check=False).stdout)
    if not info:
        raise LabError(f"container {guest.name}: podman inside it does not answer `podman info`")
    if guest.run(f"podman image exists {BASE_IMAGE}", timeout=120, check=False).returncode != 0:
        raise LabError(f"container {guest.name}: podman inside it does not see {BASE_IMAGE} in the machine's store")
    return {**info, "privileged": True, "images": f"the machine's {MACHINE_STORE}, read-only"}


def _inside(place: Place, guest: ContainerGuest, web: bool) -> None:
    """Record what the container is, check that a command sent through the wrapper runs in it, and
    start its nginx when the machine has one."""
    machine, name, rt = guest.machine, guest.name, RUNTIMES[guest.runtime]
    seen = machine.run(f"{rt.command} inspect --format {shlex.quote(INSPECT_FORMAT)} {shlex.quote(name)}", timeout=60)
    state = parse_inspect(seen.stdout)
    if not state:
        raise LabError(
            f"container {name}: `{rt.command} inspect` did not say what it is: {seen.stdout.strip()[:200]!r}"
        )
    place.facts.update(state)
    probe = place.guest.run(f"test -f {rt.marker} && echo inside", timeout=60, check=False)
    if probe.stdout.strip() != "inside":
        raise LabError(f"container {name}: a command sent into it did not run in a container")
    place.facts["inside"] = f"{rt.marker} present"
    if web:
        place.guest.run(f"mkdir -p {' '.join(NGINX_DIRS)} && /usr/sbin/nginx", timeout=60)
        place.facts["nginx"] = "in the container"
