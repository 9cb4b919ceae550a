"""The SmartOS global zone over SSH: one command at a time (`vmadm`, `imgadm`, `sysinfo`, ...), its
failures told apart. ssh's own exit status 255 means ssh failed, not the command: at connect (the
host cannot be reached, or refuses the login: a one-line UnreachableError/AuthError) or midway
(the connection dropped: ConnectionLost, and the caller decides whether the command ran).
Connections are shared (ControlMaster) for a while: under TCG-busy hosts a handshake costs a second."""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

from lab import proc
from lab.backends.smartos.settings import Settings
from lab.errors import AuthError, BackendError, UnreachableError

CONNECT_FAILURES = (
    "Connection refused",
    "Connection timed out",
    "No route to host",
    "Could not resolve hostname",
    "Network is unreachable",
    "Name or service not known",
    "Connection closed by",
    "kex_exchange_identification",
    "Connection reset by",
    "connect to host",
)
AUTH_FAILURES = (
    "Permission denied",
    "Host key verification failed",
    "HOST IDENTIFICATION HAS CHANGED",
    "No matching host key",
    "no matching host key",
)


class CommandFailed(BackendError):
    """A command in the global zone exited non-zero; `stderr` is what it said."""

    def __init__(self, message: str, returncode: int, stderr: str):
        super().__init__(message)
        self.returncode, self.stderr = returncode, stderr


class ConnectionLost(BackendError):
    """The SSH connection dropped while a command ran: it may or may not have taken effect."""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip() and not ln.startswith("Warning: Permanently")]
    return lines[-1][:300] if lines else "no output"


def _control_dir() -> Path | None:
    """A private directory for this process's ControlMaster sockets, short enough for a unix socket
    path (108 bytes): a new temporary one (mode 0700), so that a check that reaches nothing (`lab
    plan --check`) leaves nothing behind, and nobody else's directory is ever trusted."""
    try:
        base = Path(tempfile.mkdtemp(prefix="lab-gz-"))
    except OSError:
        return None
    if len(str(base)) + 52 > 104:
        base.rmdir()
        return None  # no private short directory: one connection per command
    return base


class GlobalZone:
    def __init__(self, host_name: str, settings: Settings):
        self.host_name = host_name
        self.settings = settings
        self.target = settings.ssh
        self._control: Path | None = None  # made at the first command (_control_dir), gone at close
        self._control_made = False
        # %C names user, host and port only: another key or option set must not reuse this connection
        self._mux_tag = hashlib.sha256(repr((settings.ssh_key, settings.ssh_options)).encode()).hexdigest()[:8]

    @property
    def control(self) -> Path | None:
        if not self._control_made:
            self._control_made = True
            self._control = _control_dir()
            if self._control is not None:  # a process that never closes this still removes it at exit
                weakref.finalize(self, shutil.rmtree, self._control, True)
        return self._control

    def ssh_argv(self, remote: list[str], *, stdin: bool = False) -> list[str]:
        s = self.settings
        argv = [
            "ssh",
            "-T",
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={max(1, int(s.timeout('connect')))}",
            "-o",
            "ServerAliveInterval=10",
            "-o",
            "ServerAliveCountMax=3",
            "-o",
            "LogLevel=ERROR",
            "-p",
            str(s.ssh_port),
        ]
        if s.ssh_key:
            argv += ["-i", s.ssh_key, "-o", "IdentitiesOnly=yes"]
        for opt in s.ssh_options:
            argv += ["-o", opt]
        if self.control is not None:
            argv += [
                "-o",
                "ControlMaster=auto",
                "-o",
                f"ControlPath={self.control}/{self._mux_tag}-%C",
                "-o",
                "ControlPersist=20",
            ]
        if not stdin:
            argv.append("-n")  # never hand the lab's own stdin (a terminal) to the remote command
        return argv + [self.target, shlex.join(remote)]

    def run(
        self,
        remote: list[str],
        *,
        input: str | None = None,
        stdin_path: Path | None = None,
        timeout: float | None = None,
        what: str | None = None,
        check: bool = True,
    ) -> proc.Result:
        """Run one command in the global zone. Raises UnreachableError/AuthError when ssh cannot get
        in, ConnectionLost when the connection dropped midway, CommandFailed on a non-zero exit."""
        what = what or shlex.join(remote[:3])
        feeds = input is not None or stdin_path is not None
        res = proc.run(
            self.ssh_argv(remote, stdin=feeds),
            input=input,
            stdin=stdin_path,
            check=False,
            timeout=timeout or self.settings.timeout("command"),
            what=f"ssh {self.target} {what}",
        )
        if res.returncode == 255:
            raise self._ssh_failure(res.stderr, what)
        if check and not res.ok:
            raise CommandFailed(
                f"host {self.host_name!r}: `{what}` failed (exit {res.returncode}): "
                f"{_last_line(res.stderr or res.stdout)}",
                res.returncode,
                res.stderr,
            )
        return res

    def read(self, remote: list[str], *, what: str | None = None, timeout: float | None = None) -> proc.Result:
        """A command that changes nothing: one dropped connection is retried."""
        try:
            return self.run(remote, what=what, timeout=timeout)
        except ConnectionLost:
            return self.run(remote, what=what, timeout=timeout)

    def json(self, remote: list[str], *, what: str | None = None, timeout: float | None = None) -> Any:
        """A reading command's JSON output."""
        res = self.read(remote, what=what, timeout=timeout)
        try:
            return json.loads(res.stdout)
        except ValueError:
            raise BackendError(
                f"host {self.host_name!r}: `{what or shlex.join(remote[:3])}` did not print JSON: "
                f"{_last_line(res.stdout)}"
            ) from None

    def _ssh_failure(self, stderr: str, what: str) -> Exception:
        line = _last_line(stderr)
        where = f"host {self.host_name!r}: the global zone {self.target}"
        if any(m in stderr for m in AUTH_FAILURES):
            return AuthError(
                f"{where} refused the SSH login: {line}",
                hint="check ssh_key and the host key in known_hosts (ssh_options) for this host",
            )
        if any(m in stderr for m in CONNECT_FAILURES) and "closed by remote host" not in stderr:
            return UnreachableError(
                f"{where} cannot be reached over SSH (port {self.settings.ssh_port}): {line}",
                hint="check `ssh` and `ssh_port` of this host, and that sshd runs in its global zone",
            )
        return ConnectionLost(f"{where}: the SSH connection dropped during `{what}`: {line}")

    def close(self) -> None:
        """End the shared connection (it would otherwise linger for ControlPersist seconds)."""
        if self._control is None:
            return
        argv = self.ssh_argv(["true"])
        argv[-2:] = ["-O", "exit", self.target]
        proc.run(argv, check=False, timeout=10)
        shutil.rmtree(self._control, ignore_errors=True)
        self._control, self._control_made = None, False
