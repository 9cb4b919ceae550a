"""QEMU's two control channels as the local backend uses them, over their unix sockets: QMP (the
monitor: stop, migrate, cont) and the QEMU guest agent (QGA: commands run inside the guest without
its network, which is what a restored clone has to fix before it has an identity of its own).

Both speak one JSON object a line, one request at a time; nothing here knows about VMs.
"""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.errors import BackendError, LabError
from lab.wait import wait_until

SYNC_DELIMITER = b"\xff"  # QGA puts it before its answer to guest-sync-delimited (and resets its parser on it)


class Channel:
    """A connected unix socket reading and writing JSON lines, every read bounded."""

    def __init__(self, path: Path, what: str, timeout: float, alive: Callable[[], bool] | None = None):
        self.path, self.what = Path(path), what
        self.sock = connect_unix(self.path, what, timeout, alive)
        self.reader = self.sock.makefile("rb")

    def send(self, message: dict[str, Any] | bytes) -> None:
        data = message if isinstance(message, bytes) else json.dumps(message).encode() + b"\n"
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise BackendError(f"{self.what}: cannot send: {exc.strerror or exc}") from None

    def receive(self, timeout: float) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        try:
            line = self.reader.readline()
        except TimeoutError:
            raise BackendError(f"{self.what}: no answer within {timeout:g} s") from None
        except OSError as exc:
            raise BackendError(f"{self.what}: {exc.strerror or exc}") from None
        if not line:
            raise BackendError(f"{self.what}: the other side closed the connection")
        try:
            return json.loads(line)
        except ValueError:
            raise BackendError(f"{self.what}: not JSON: {line[:120]!r}") from None

    def call(self, command: str, timeout: float, **arguments: Any) -> Any:
        """Send one command; its "return" value, skipping events. Raises BackendError on "error"."""
        self.send({"execute": command, **({"arguments": arguments} if arguments else {})})
        while True:
            answer = self.receive(timeout)
            if "return" in answer:
                return answer["return"]
            if "error" in answer:
                err = answer["error"]
                raise BackendError(f"{self.what}: {command}: {err.get('desc') or err}")

    def close(self) -> None:
        try:
            self.reader.close()
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect_unix(path: Path, what: str, timeout: float, alive: Callable[[], bool] | None = None) -> socket.socket:
    """Connect to a unix socket QEMU is about to create (bounded wait for it to listen; given
    `alive`, the wait ends as soon as it answers False: QEMU exited)."""
    last: list[str] = [""]

    def attempt() -> socket.socket | None:
        if alive is not None and not alive():
            raise BackendError(f"{what}: QEMU exited before {path} was there")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(path))
            return s
        except OSError as exc:
            s.close()
            last[0] = exc.strerror or str(exc)
            return None

    return wait_until(
        attempt, timeout=timeout, what=f"{what} at {path}", interval=0.005, max_interval=0.05, detail=lambda: last[0]
    )


class Qmp(Channel):
    """The QEMU monitor: the greeting is read and capabilities negotiated on connect."""

    def __init__(self, path: Path, what: str = "QMP", timeout: float = 10.0, alive: Callable[[], bool] | None = None):
        super().__init__(path, what, timeout, alive)
        greeting = self.receive(timeout)
        if "QMP" not in greeting:
            raise BackendError(f"{what}: unexpected greeting {greeting}")
        self.call("qmp_capabilities", timeout)

    def pass_fd(self, name: str, fd: int, timeout: float = 10.0) -> None:
        """Hand QEMU an open file as `name` (getfd with the descriptor attached): `fd:name` migrations
        then read or write that file directly (no helper process whose exit is never awaited)."""
        message = json.dumps({"execute": "getfd", "arguments": {"fdname": name}}).encode() + b"\n"
        try:
            socket.send_fds(self.sock, [message], [fd])
        except OSError as exc:
            raise BackendError(f"{self.what}: cannot pass a file: {exc.strerror or exc}") from None
        while True:
            answer = self.receive(timeout)
            if "return" in answer:
                return
            if "error" in answer:
                raise BackendError(f"{self.what}: getfd: {answer['error'].get('desc')}")

    def status(self, timeout: float = 10.0) -> str:
        """The VM's run state: "inmigrate", "paused", "running", "postmigrate", ..."""
        return self.call("query-status", timeout)["status"]


@dataclass(frozen=True)
class ExecResult:
    exitcode: int
    stdout: str
    stderr: str


class GuestAgent(Channel):
    """The guest agent (org.qemu.guest_agent.0). sync() before the first command: the agent may
    hold half a line or a stale answer from before a restore."""

    def __init__(
        self, path: Path, what: str = "guest agent", timeout: float = 10.0, alive: Callable[[], bool] | None = None
    ):
        super().__init__(path, what, timeout, alive)
        self._sync_id = 0

    def sync(self, timeout: float) -> None:
        """guest-sync-delimited: reset the agent's parser, drop anything stale, until our id comes back."""
        self._sync_id += 1
        want = self._sync_id
        self.send(SYNC_DELIMITER)
        self.send({"execute": "guest-sync-delimited", "arguments": {"id": want}})
        self.sock.settimeout(timeout)
        try:
            while True:
                byte = self.reader.read(1)
                if not byte:
                    raise BackendError(f"{self.what}: the other side closed the connection")
                if byte != SYNC_DELIMITER:
                    continue
                answer = self.receive(timeout)
                if answer.get("return") == want:
                    return
        except TimeoutError:
            raise BackendError(f"{self.what}: no answer to guest-sync within {timeout:g} s") from None

    def run(self, argv: list[str], *, input: str | None = None, timeout: float = 30.0) -> ExecResult:
        """guest-exec argv (no shell) with captured output, waited for (bounded)."""
        args: dict[str, Any] = {"path": argv[0], "arg": argv[1:], "capture-output": True}
        if input is not None:
            args["input-data"] = base64.b64encode(input.encode()).decode()
        pid = self.call("guest-exec", timeout, **args)["pid"]

        def exited() -> dict[str, Any] | None:
            st = self.call("guest-exec-status", timeout, pid=pid)
            return st if st.get("exited") else None

        try:
            st = wait_until(
                exited, timeout=timeout, what=f"{argv[0]} in the guest (guest-exec)", interval=0.005, max_interval=0.1
            )
        except LabError as exc:
            raise BackendError(f"{self.what}: {exc}") from None
        return ExecResult(int(st.get("exitcode", -1)), decode(st.get("out-data")), decode(st.get("err-data")))


def decode(data: str | None) -> str:
    return base64.b64decode(data).decode(errors="replace") if data else ""
