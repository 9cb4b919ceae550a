"""The Guest seam: where a cell's commands run. `Machine` is what the stages and the workloads
use; three kinds implement it:

- Guest: a VM (or a client machine) over OpenSSH, with one multiplexed connection per guest;
- HostGuest: this machine, for the bare-metal cell (in the cell's namespace and cgroup);
- lab.isolation.ContainerGuest: a container on either of those, every command entering it.

OpenSSH (not a Python SSH library) because ControlMaster makes each command cost ~0.1 s instead
of a 1.5 s handshake under TCG, and ProxyJump/ssh_config work exactly as they do for the user.
Every command goes through lab.proc.run, so what a guest prints is bounded as a tool's output is
(its first and last halves of lab.proc.OUTPUT_LIMIT per stream).
"""

from __future__ import annotations

import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lab import proc
from lab.errors import CommandError, LabError, TimeoutError_
from lab.wait import wait_until


@dataclass(frozen=True)
class SshLogin:
    """How a connection of a workload's own (scp's) logs in to a machine's sshd."""

    address: str
    port: int
    user: str = "root"
    key: Path | None = None  # None: ssh's own choice (agent, ~/.ssh/id_*)
    # the name the sshd's host keys are under in the known_hosts file, when it is not the one the file
    # names (a container's sshd: the machine's keys, on another port); None: the address's
    host_key_alias: str | None = None


class Machine(Protocol):
    """The Guest seam: a machine the cell's commands run on, whatever reaches it."""

    address: str  # where the client side reaches it
    os: str  # its lab.osfacts key
    known_hosts: Path | None  # its sshd's host keys as a known_hosts file (None: not checked, or no SSH)

    def run(self, command: str, *, timeout: float = 120.0, check: bool = True, input: str | None = None) -> proc.Result:
        """Run a shell command line on the machine; CommandError on a non-zero status if `check`."""
        ...

    def ssh_login(self) -> SshLogin | None:
        """How a workload's own SSH connection reaches this machine's sshd; None: it is not reached by SSH."""
        ...

    def close(self) -> None: ...

    def put_text(self, text: str, remote: str, timeout: float = 60.0) -> None:
        self.run(f"cat > {shlex.quote(remote)}", input=text, timeout=timeout)

    def get_text(self, remote: str, timeout: float = 60.0) -> str:
        return self.run(f"cat {shlex.quote(remote)}", timeout=timeout).stdout


class Guest(Machine):
    """A machine over OpenSSH (a cell's VM, a client VM or machine)."""

    def __init__(
        self,
        address: str,
        *,
        key: Path | None,  # None: ssh's own choice (agent, ~/.ssh/id_*): a machine of the user's
        user: str = "root",
        port: int = 22,
        netns: str | None = None,
        jump: str | None = None,
        control_dir: Path | None = None,
        os: str = "debian",
        known_hosts: str | None = None,
        known_hosts_file: Path | None = None,  # the user's own file (a client machine), checked as strictly
    ):
        self.address, self.user, self.port = address, user, port
        self.key = Path(key) if key is not None else None
        self.netns, self.jump, self.os = netns, jump, os
        self._tmp = None
        if control_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="lab-ssh-")
            control_dir = Path(self._tmp.name)
        self.control_path = Path(control_dir) / f"{address}-{port}.sock"
        # The guest's host keys (lab.images.known_hosts): OpenSSH refuses any other machine that
        # answers at this address. None: not checked.
        self.known_hosts: Path | None = known_hosts_file
        if known_hosts is not None:
            self.known_hosts = Path(control_dir) / f"{address}-{port}.known_hosts"
            self.known_hosts.write_text(known_hosts)

    def _ssh_options(self) -> list[str]:
        opts = [
            *(["-i", str(self.key), "-o", "IdentitiesOnly=yes"] if self.key is not None else []),
            "-p",
            str(self.port),
            "-o",
            "BatchMode=yes",
            *(
                ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self.known_hosts}"]
                if self.known_hosts
                else ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
            ),
            "-o",
            "LogLevel=ERROR",
            "-o",
            "ConnectTimeout=5",
            "-o",
            "ServerAliveInterval=5",
            "-o",
            "ServerAliveCountMax=6",
            "-o",
            f"ControlPath={self.control_path}",
        ]
        if self.jump:
            opts += ["-J", self.jump]
        return opts

    @property
    def target(self) -> str:
        return f"{self.user}@{self.address}"

    def connect(self, timeout: float = 60.0) -> None:
        """Open the master connection, retrying until sshd accepts it (bounded)."""

        def attempt() -> bool:
            try:
                res = proc.run(
                    [
                        "ssh",
                        *self._ssh_options(),
                        "-o",
                        "ControlMaster=yes",
                        "-o",
                        "ControlPersist=600",
                        "-f",
                        "-N",
                        self.target,
                    ],
                    timeout=15,
                    check=False,
                    netns=self.netns,
                    what="ssh master",
                )
            except TimeoutError_ as exc:  # a guest still busy booting on busy cores: try again
                self._last_error = str(exc)
                return False
            self._last_error = res.stderr.strip()
            return res.ok

        self._last_error = ""
        wait_until(
            attempt,
            timeout=timeout,
            what=f"SSH login to {self.target}",
            interval=0.3,
            detail=lambda: self._last_error or "no answer",
        )

    def argv(self, command: str, *, tty: bool = False) -> list[str]:
        """The argv of this machine that runs `command` on the guest (for a process the caller
        spawns itself). `tty`: with a terminal, so that the command gets SIGHUP, and stops, when
        the local ssh does."""
        return proc.netns_prefix(self.netns) + [
            "ssh",
            *self._ssh_options(),
            *(["-tt"] if tty else []),
            self.target,
            command,
        ]

    def run(self, command: str, *, timeout: float = 120.0, check: bool = True, input: str | None = None) -> proc.Result:
        """Run a shell command line on the guest."""
        res = proc.run(
            ["ssh", *self._ssh_options(), self.target, command],
            timeout=timeout,
            check=False,
            input=input,
            netns=self.netns,
            what=f"guest command on {self.address}",
        )
        return _checked(res, ["ssh", self.target, command], command, self.address, check)

    def put(self, local: Path, remote: str, timeout: float = 120.0) -> None:
        self.run(f"cat > {shlex.quote(remote)}", input=Path(local).read_text(), timeout=timeout)

    def ssh_login(self) -> SshLogin:
        return SshLogin(self.address, self.port, self.user, self.key)

    def close(self) -> None:
        if self.control_path.exists():
            try:
                proc.run(
                    ["ssh", *self._ssh_options(), "-O", "exit", self.target], timeout=10, check=False, netns=self.netns
                )
            except LabError:
                pass
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Guest:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HostGuest(Machine):
    """Runs command lines on this machine, for the bare-metal cell (lab.backends.local.baremetal).

    Commands run in the cell's network namespace through `nsenter --net` (not `ip netns exec`,
    which remounts /sys and so hides the cgroup file system) and, when `cgroup_procs` is given,
    inside that cgroup, so the cell's CPU use can be told apart from the load generator's, which
    runs on the same machine. `env` reaches every command (the CPU snapshot reads it)."""

    def __init__(
        self,
        address: str,
        *,
        netns: str,
        cgroup_procs: Path | None = None,
        env: dict[str, str] | None = None,
        os: str = "bare-metal",
    ):
        self.address, self.netns, self.cgroup_procs, self.os = address, netns, cgroup_procs, os
        self.env = dict(env or {})
        self.known_hosts: Path | None = None  # no SSH: nothing to check

    def argv(self, command: str) -> list[str]:
        inner = ["nsenter", f"--net=/run/netns/{self.netns}", "sh", "-c", command]
        if self.cgroup_procs is None:
            return inner
        # Join the cgroup first, then enter the namespace: every process of the command inherits both.
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup_procs), *inner]

    def run(self, command: str, *, timeout: float = 120.0, check: bool = True, input: str | None = None) -> proc.Result:
        res = proc.run(
            self.argv(command),
            timeout=timeout,
            check=False,
            input=input,
            env=self.env,
            what=f"host command in {self.netns}",
        )
        return _checked(res, ["sh", "-c", command], command, f"{self.address} (bare metal)", check)

    def ssh_login(self) -> None:
        return None  # this machine: its commands run here directly, no sshd is its load

    def close(self) -> None:
        pass


def _checked(res: proc.Result, argv: list[str], command: str, where: str, check: bool) -> proc.Result:
    if check and res.returncode != 0:
        raise CommandError(argv, res.returncode, res.stdout, res.stderr, what=f"`{_short(command)}` on {where}")
    return res


def _short(command: str, width: int = 60) -> str:
    command = " ".join(command.split())
    return command if len(command) <= width else command[: width - 1] + "…"
