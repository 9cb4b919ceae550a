"""A guest that answers the lab's commands from a small model of a Linux machine: the verify line,
sysctls (read, set, congestion control), `ethtool -k/-K` and tc netem; and the fake workload's
`fake-work` command; podman and docker (lab.isolation's containers: run, exec, inspect, ps, rm). A failing stage's
commands raise (CommandError), an interrupted one raises Interrupted, as the real Guest would
surface a lost connection or a signal."""

from __future__ import annotations

import re
import shlex

from lab import proc
from lab.errors import CommandError
from lab.guest import SshLogin
from lab.lifecycle import Interrupted
from lab.osfacts import OsFacts

# What a bridge container's own namespace takes of the wan-16m profile on a Debian 12 guest (the
# fake guest answers the probe so; tests/vm/test_isolation_vm.py reads it from a real one), and what
# stays kernel-wide
WAN_16M_IN_A_NETNS = (
    {
        "net.ipv4.tcp_congestion_control": "bbr",
        "net.ipv4.tcp_moderate_rcvbuf": "1",
        "net.ipv4.tcp_rmem": "4096 4194304 16777216",
        "net.ipv4.tcp_wmem": "4096 4194304 16777216",
    },
    ["net.core.rmem_max", "net.core.wmem_max"],
)


class FakeGuest:
    tarball = True  # the golden image keeps the base image's tarball (lab.isolation.BASE_TARBALL)

    def __init__(
        self,
        *,
        address: str,
        facts: OsFacts,
        nic_driver: str,
        vcpus: int,
        memory_mib: int,
        lro: str = "on",
        cc_default: str = "cubic",
        fail: str | None = None,
        interrupt: str | None = None,
        os: str = "debian",
        podman: bool = True,
        docker: bool = False,
    ):
        self.address, self.facts, self.os = address, facts, os
        self.nic_driver, self.vcpus, self.memory_mib = nic_driver, vcpus, memory_mib
        self.fail, self.interrupt = fail, interrupt
        self.sysctl = {
            "net.ipv4.tcp_congestion_control": cc_default,
            "net.core.rmem_max": "212992",
            "net.core.wmem_max": "212992",
            "net.ipv4.tcp_rmem": "4096 131072 6291456",
            "net.ipv4.tcp_wmem": "4096 16384 4194304",
        }
        self.lro_on, self.lro_fixed = lro.endswith("on"), lro.startswith("fixed")
        self.netem: list[str] | None = None
        self.commands: list[str] = []
        self.connected = self.closed = False
        self.known_hosts = None  # a fake has no SSH host key to check
        self.podman = podman
        self.runtimes = {"podman": podman, "docker": docker}  # which container CLIs this machine has
        self.images = {"podman": True, "docker": False}  # whose store holds the base image (as built)
        self.containers: dict[str, str] = {}  # name -> id, while it exists
        self.inside: list[str] = []  # the command lines that ran inside a container
        self.within: str | None = None  # the container the command being answered runs in

    # -- what the lab calls ------------------------------------------------------------------------
    def argv(self, command: str, *, tty: bool = False) -> list[str]:
        """As lab.guest.Guest.argv: here the command line runs on this machine (a fake client VM's
        load generator is this machine's)."""
        self.commands.append(command)
        return ["sh", "-c", command]

    def ssh_login(self) -> SshLogin:
        return SshLogin(self.address, 22)  # a guest reached by SSH, as lab.guest.Guest is

    def connect(self, timeout: float = 60.0) -> None:
        self.connect_timeout = timeout
        self._stage("ssh", "ssh")
        self.connected = True

    def run(self, command: str, *, timeout: float = 120.0, check: bool = True, input: str | None = None) -> proc.Result:
        if re.match(r"(podman|docker) exec ", command):  # the command runs as it would on the machine, inside
            argv = shlex.split(command)
            name, inner = argv[-4], argv[-1]
            if name not in self.containers:
                return proc.Result(argv, 125, "", f"Error: no container with name or ID {name!r} found", 0.0)
            self.inside.append(inner)
            self.within = name
            try:
                res = self.run(inner, timeout=timeout, check=check, input=input)
            finally:
                self.within = None
            return proc.Result(argv, res.returncode, res.stdout, res.stderr, 0.0)
        self.commands.append(command)
        self._stage(_stage_of(command), command)
        container = re.search(r"podman|docker|/run/\.containerenv|^ls -d /usr|lab-base\.tar", command)
        out, rc = self._container(command) if container else (None, 0)
        if out is None:
            out = self._answer(command)
        return proc.Result(["ssh", self.address, command], rc, out, "", 0.0)

    def _container(self, command: str) -> tuple[str | None, int]:
        """(output, status) of a podman or docker command on this machine; (None, 0) when it is not one."""
        inside = self.within is not None
        if re.match(r"test -f (/run/\.containerenv|/\.dockerenv)", command):
            made_by = next(
                (c.split()[0] for c in self.commands if re.match(rf"\S+ run .*--name {self.within} ", c)), ""
            )
            mine = {"podman": "/run/.containerenv", "docker": "/.dockerenv"}.get(made_by) in command
            return ("inside\n", 0) if inside and mine else ("", 1)
        if re.match(r"test -f \S+lab-base\.tar\.zst$", command):
            return "", 0 if self.tarball else 1
        if command.startswith("ls -d /usr"):
            return "/usr\n/etc/nginx\n/srv/www\n", 0
        if command.startswith("command -v "):
            cli = command.split()[-1]
            return (f"/usr/bin/{cli}\n", 0) if self.runtimes.get(cli) else ("", 1)
        imported = re.search(r"\| (podman|docker) import ", command)
        if imported:  # from the tarball the golden image keeps
            self.images[imported.group(1)] = True
            return "", 0
        argv = shlex.split(command)
        if argv[0] not in self.runtimes:
            return None, 0
        if not self.runtimes[argv[0]]:
            return "", 127
        if argv[1:3] == ["image", "inspect"]:
            return "", 0 if self.images[argv[0]] else 1
        if argv[1:2] == ["--version"]:
            return "podman version 4.3.1\n", 0
        if argv[1:2] == ["version"]:
            return "docker 20.10.24+dfsg1\n", 0
        if argv[1] == "run":
            name = argv[argv.index("--name") + 1]
            self.containers[name] = f"{len(self.containers) + 1:064x}"
            return self.containers[name] + "\n", 0
        if argv[1] == "inspect":
            made = next((shlex.split(c) for c in self.commands if " run " in c and argv[-1] in c), [])
            network = next((a.split("=", 1)[1] for a in made if a.startswith("--network=")), "host")
            if argv[-1] not in self.containers:
                return "", 125
            return f"{self.containers[argv[-1]]} running 4242 {network}\n", 0
        if argv[1] == "rm":
            self.containers.pop(argv[-1], None)
            return argv[-1] + "\n", 0
        if argv[1] == "info":  # podman in a container made for it (lab.isolation's nested), or on the machine
            made = next((c for c in self.commands if re.match(rf"(podman|docker) run .*--name {self.within} ", c)), "")
            nested = "overlay cgroupfs\nlabnest0 10.90.0.0/24\n"
            return (nested, 0) if not inside or " --privileged " in made else ("", 125)
        if argv[1] == "ps":
            wanted = argv[argv.index("--filter") + 1].removeprefix("name=^").removesuffix("$")
            return (wanted + "\n" if wanted in self.containers else ""), 0
        return "", 0

    def close(self) -> None:
        self.closed = True

    # -- the model ---------------------------------------------------------------------------------
    def _stage(self, stage: str, command: str) -> None:
        """Fail or interrupt the stage the test asked for (workloads@N: at measured repetition N)."""
        for how, wanted in (("fail", self.fail), ("interrupt", self.interrupt)):
            if not wanted:
                continue
            name, _, rep = wanted.partition("@")
            if name != stage or (rep and f"fake-work {rep}" != command):
                continue
            if how == "interrupt":
                raise Interrupted("SIGTERM")
            raise CommandError(["ssh", self.address, command], 255, "", f"injected failure at {wanted}")

    def _answer(self, command: str) -> str:
        if command == "grep '^sshd:' /etc/passwd":
            return "sshd:x:100:65534::/run/sshd:/usr/sbin/nologin\n"
        if command == "cat /run/sshd.pid 2>/dev/null" and self.within:  # a container's sshd, once started
            return "4343\n"
        if command.startswith("unshare --net "):  # a Debian 12 guest's new namespace: tcp_* its own, not core.*mem
            paths = shlex.split(command)[6:]
            return "".join(f"{p}\n" for p in paths if p.startswith(("/proc/sys/net/ipv4/", "/proc/sys/net/ipv6/")))
        if command == "cat /proc/stat":  # an idle machine with this guest's vCPUs
            return "cpu  1000 0 500 90000 0 0 20 0 0 0\n" + "".join(
                f"cpu{i} 500 0 250 45000 0 0 10 0 0 0\n" for i in range(self.vcpus)
            )
        if command.startswith("echo nic="):
            return (
                f"nic={self.nic_driver}\ncpus={self.vcpus}\nmem={self.memory_mib * 1024 * 97 // 100}\nLinux 6.1.0-fake"
            )
        for key, value in re.findall(r"sysctl (?:-q )?-w ([\w.]+)=('[^']*'|\S+)", command):
            self.sysctl[key] = " ".join(value.strip("'").split())
        if "sysctl -n" in command:
            keys = re.findall(r"sysctl -n ([\w.]+)", command)
            return "".join(f"{k}\t{self.sysctl[k]}\n" for k in keys if k in self.sysctl)
        m = re.match(r"ethtool -K \S+ lro (on|off)", command)
        if m and not self.lro_fixed:
            self.lro_on = m.group(1) == "on"
        if command.startswith("ethtool -k"):
            fixed = " [fixed]" if self.lro_fixed else ""
            return (
                f"large-receive-offload: {'on' if self.lro_on else 'off'}{fixed}\n"
                "tcp-segmentation-offload: on\ngeneric-receive-offload: on\n"
            )
        m = re.search(r"tc qdisc replace dev \S+ root netem (.*)$", command)
        if m:
            self.netem = [a.strip("'") for a in m.group(1).split()]
        if command.startswith("tc qdisc show"):
            if self.netem is None:
                return "qdisc fq_codel 0: root refcnt 2\n"
            return "qdisc netem 8001: root refcnt 2 " + " ".join(self.netem) + "\n"
        if command.startswith("tc qdisc del"):
            self.netem = None
        return ""


def _stage_of(command: str) -> str:
    if command.startswith("echo nic="):
        return "verify"
    if command.startswith("fake-work"):
        return "workloads"
    return "tune"
