"""A real OpenSSH sshd in the test's network namespace, whose only login is the emulated global zone
(ForceCommand gzsh.py), or, without a `socket_path`, a plain root shell (a client machine of
client = "ssh:", tests/contract/test_clientssh.py). Root logs in with a key the test makes; the host
key is the test's too, and a known_hosts line for it is written, so the backend checks the host key
as it would on a real host.

Debian's openssh-server is installed if it is missing (services not started: a policy-rc.d
forbids it for the install). The Makefile's apt list should carry it (and the lead adds it there).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from lab import proc
from lab.errors import LabError
from lab.wait import wait_until

SSHD = Path("/usr/sbin/sshd")
GZSH = Path(__file__).with_name("gzsh.py")
POLICY_RC = Path("/usr/sbin/policy-rc.d")


def ensure_sshd() -> str:
    """sshd's path, installing openssh-server if it is missing; "" (and the reason) if it cannot be."""
    if SSHD.exists():
        return ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "openssh-server is not installed and cannot be installed here (needs root and apt-get)"
    made_policy = False
    if not POLICY_RC.exists():  # never start the host's own sshd while installing
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC.chmod(0o755)
        made_policy = True
    try:
        res = proc.run(
            [
                "apt-get",
                "install",
                "-y",
                "-qq",
                "--no-install-recommends",
                "-o",
                "DPkg::Lock::Timeout=300",
                "openssh-server",
            ],
            check=False,
            timeout=900,
            env={"DEBIAN_FRONTEND": "noninteractive"},
        )
    finally:
        if made_policy:
            POLICY_RC.unlink()
    return "" if SSHD.exists() else f"apt-get install openssh-server failed: {res.stderr.strip()[-300:]}"


class Sshd:
    def __init__(
        self,
        workdir: Path,
        *,
        netns: str | None,
        address: str,
        socket_path: Path | None = None,
        port: int = 22,
        authorized_keys: str = "",
        wrap: Callable[[list[str]], list[str]] | None = None,
    ):
        self.dir = Path(workdir) / "sshd"
        self.netns, self.address, self.port, self.socket_path = netns, address, port, socket_path
        self.authorized_keys = authorized_keys  # root's keys; "" = the test's own root_key
        # argv -> the argv that runs it: a zone's sshd joins the zone's cgroups before its namespace
        self.wrap = wrap
        self.client_key = self.dir / "root_key"
        self.known_hosts = self.dir / "known_hosts"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for key in ("host_ed25519", "root_key"):
            if not (self.dir / key).exists():
                proc.run(
                    [
                        "ssh-keygen",
                        "-q",
                        "-t",
                        "ed25519",
                        "-N",
                        "",
                        "-C",
                        f"smartos-emulator-{key}",
                        "-f",
                        str(self.dir / key),
                    ]
                )
        (self.dir / "authorized_keys").write_text(self.authorized_keys or (self.dir / "root_key.pub").read_text())
        host_pub = (self.dir / "host_ed25519.pub").read_text().split()[:2]
        target = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        self.known_hosts.write_text(f"{target} {' '.join(host_pub)}\n")
        # -S: the standard library only, faster
        force = f"ForceCommand {sys.executable} -S {GZSH} {self.socket_path}" if self.socket_path else ""
        (self.dir / "sshd_config").write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    f"ListenAddress {self.address}",
                    f"HostKey {self.dir / 'host_ed25519'}",
                    f"PidFile {self.dir / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "AllowUsers root",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PrintMotd no",
                    "PrintLastLog no",
                    "PermitUserEnvironment no",
                    "AllowTcpForwarding no",
                    "X11Forwarding no",
                    "LogLevel ERROR",
                    "MaxStartups 100",
                    "MaxSessions 100",
                    force,
                    "",
                ]
            )
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        log = open(self.dir / "sshd.log", "ab")
        try:
            argv = [str(SSHD), "-D", "-e", "-f", str(self.dir / "sshd_config")]
            self.process = (
                proc.spawn(self.wrap(proc.netns_prefix(self.netns) + argv), stdout=log, stderr=subprocess.STDOUT)
                if self.wrap
                else proc.spawn(argv, netns=self.netns, stdout=log, stderr=subprocess.STDOUT)
            )
        finally:
            log.close()

        def listening() -> bool:
            if self.process.poll() is not None:
                raise LabError(f"sshd exited ({self.process.returncode}): {(self.dir / 'sshd.log').read_text()[-500:]}")
            if self.netns is not None:  # its banner, read inside the namespace
                probe = f"exec 3<>/dev/tcp/{self.address}/{self.port} && head -c 4 <&3"
                res = proc.run(["bash", "-c", probe], netns=self.netns, check=False, timeout=10)
                return res.stdout == "SSH-"
            try:
                with socket.create_connection((self.address, self.port), timeout=1) as s:
                    return s.recv(4) == b"SSH-"
            except OSError:
                return False

        wait_until(listening, timeout=60, what=f"the emulator's sshd on {self.address}:{self.port}", interval=0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
