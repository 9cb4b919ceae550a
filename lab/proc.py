"""The one way to start a subprocess: list argv (never a shell), bounded by a timeout, in an
environment without the secrets lab.toml references (lab.secrets.child_environment).

What a command prints is bounded too: of each of stdout and stderr at most OUTPUT_LIMIT bytes are
kept (its first and last halves, with a line saying how much was cut between), so a tool or a
guest that prints without end can neither fill the orchestrator's memory nor the results store.
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lab.errors import CommandError, LabError, TimeoutError_
from lab.secrets import child_environment

# One argv element: a string or a path (each is passed through str(), as subprocess would)
Arg = str | os.PathLike[str]

OUTPUT_LIMIT = 8 * 1024 * 1024  # bytes kept of each of a command's stdout and stderr
CUT = "\n[lab: {n} bytes of output cut here: at most {mib} MiB are kept, the first and last halves]\n"
_CHUNK = 65536


@dataclass(frozen=True)
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def netns_prefix(netns: str | None) -> list[str]:
    """argv prefix that runs a command inside a network namespace (or nothing)."""
    return ["ip", "netns", "exec", netns] if netns else []


def run(
    argv: Sequence[Arg],
    *,
    timeout: float = 60.0,
    check: bool = True,
    input: str | bytes | None = None,
    stdin: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    netns: str | None = None,
    what: str | None = None,
    text: bool = True,
) -> Result:
    """Run argv to completion. Raises CommandError on non-zero exit (if check) and
    TimeoutError_ when it outlives `timeout` (the process group is killed). `stdin` names a file
    fed to the process as it reads (disk images: too large for `input`)."""
    full = netns_prefix(netns) + [str(a) for a in argv]
    merged_env = child_environment(env)
    start = time.monotonic()
    feed = open(stdin, "rb") if stdin is not None else contextlib.nullcontext()
    given = input.encode() if isinstance(input, str) else input
    try:
        with feed as fh:
            p = _start(
                lambda: subprocess.Popen(
                    full,
                    stdin=subprocess.PIPE if given is not None else fh,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=merged_env,
                    cwd=cwd,
                    start_new_session=True,
                )
            )
            with p:
                try:
                    out, err = _communicate(p, given, start + timeout)
                except BaseException:
                    # A timeout, or the orchestrator interrupted (SIGTERM/SIGINT raise in the main thread):
                    # the whole session goes, grandchildren too (packer's QEMU, ssh's ProxyCommand).
                    _kill_session(p)
                    raise
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError_(f"{what or full[0]} did not finish within {timeout:g} s") from exc
    except FileNotFoundError as exc:
        raise LabError(
            f"{full[0]} is not installed (needed for {what or 'this step'})", hint="run `make setup` or `lab doctor`"
        ) from exc
    stdout, stderr = (out.text(), err.text()) if text else (out.bytes(), err.bytes())
    res = Result(full, p.returncode, stdout, stderr, time.monotonic() - start)  # type: ignore[arg-type]
    if check and p.returncode != 0:
        raise CommandError(full, p.returncode, out.text() if text else "", err.text() if text else "", what)
    return res


class Capture:
    """A stream's output, at most `limit` bytes of it: its first half, and its last half once more came."""

    def __init__(self, limit: int = OUTPUT_LIMIT):
        self.half = limit // 2
        self.head, self.tail = bytearray(), bytearray()
        self.cut = 0

    def add(self, data: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            over = len(self.tail) - self.half
            if over > 0:
                del self.tail[:over]
                self.cut += over

    def bytes(self) -> bytes:
        marker = CUT.format(n=self.cut, mib=2 * self.half // (1024 * 1024)).encode() if self.cut else b""
        return bytes(self.head) + marker + bytes(self.tail)

    def text(self) -> str:
        """As text (UTF-8, undecodable bytes replaced; CR LF and a lone CR read as LF, as Python's text
        mode reads a pipe)."""
        return self.bytes().decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def _communicate(p: subprocess.Popen, given: bytes | None, deadline: float) -> tuple[Capture, Capture]:
    """Popen.communicate with each output stream bounded (Capture) and a deadline on the monotonic
    clock. subprocess.TimeoutExpired when the deadline passes."""
    assert p.stdout is not None and p.stderr is not None  # run() asks for both pipes
    out, err = Capture(), Capture()
    reading = {p.stdout.fileno(): (p.stdout, out), p.stderr.fileno(): (p.stderr, err)}
    pending = memoryview(given or b"")
    with selectors.DefaultSelector() as sel:
        for fd in reading:
            sel.register(fd, selectors.EVENT_READ)
        if p.stdin is not None:
            if pending:
                sel.register(p.stdin.fileno(), selectors.EVENT_WRITE)
            else:
                p.stdin.close()
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(p.args, 0)
            for key, _events in sel.select(left):
                if key.fd not in reading:  # stdin
                    try:
                        pending = pending[os.write(key.fd, pending[: select.PIPE_BUF]) :]  # never blocks
                    except BrokenPipeError:  # the command stopped reading: what it printed still counts
                        pending = pending[:0]
                    if not pending and p.stdin is not None:
                        sel.unregister(key.fd)
                        p.stdin.close()
                    continue
                stream, capture = reading[key.fd]
                data = os.read(key.fd, _CHUNK)
                if data:
                    capture.add(data)
                else:
                    sel.unregister(key.fd)
                    stream.close()
    p.wait(timeout=max(0.0, deadline - time.monotonic()))
    return out, err


def read_bounded(path: str | os.PathLike, limit: int = OUTPUT_LIMIT) -> str:
    """A log file's text as run() keeps a command's output: its first and last `limit` / 2 bytes."""
    capture = Capture(limit)
    with open(path, "rb") as fh:
        capture.add(fh.read(capture.half))
        size = os.fstat(fh.fileno()).st_size
        if size > 2 * capture.half:
            capture.cut = size - 2 * capture.half
            fh.seek(size - capture.half)
        capture.tail += fh.read(capture.half)
    return capture.text()


def _kill_session(p: subprocess.Popen) -> None:
    """SIGKILL the process group a proc.run child leads (start_new_session: its pgid is its pid)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def spawn(
    argv: Sequence[Arg],
    *,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    netns: str | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start a long-lived process (QEMU, an iperf3 server) in its own session, so a Ctrl-C at
    the terminal reaches the orchestrator only and teardown stays in its hands."""
    full = netns_prefix(netns) + [str(a) for a in argv]
    merged_env = child_environment(env)
    try:
        return _start(
            lambda: subprocess.Popen(
                full, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True, env=merged_env
            )
        )
    except FileNotFoundError as exc:
        raise LabError(f"{full[0]} is not installed", hint="run `make setup` or `lab doctor`") from exc


def _start(popen: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    """popen() with interrupts deferred until it has returned; a child whose start was interrupted
    is stopped before the interrupt goes on up (nobody else holds it)."""
    p: subprocess.Popen | None = None
    try:
        with interrupts_deferred():
            p = popen()
    except BaseException:
        if p is not None:
            _kill_session(p)
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    f.close()
        raise
    return p


# A signal that lands while Popen is creating a child (after the fork, before Popen returns) would
# raise out of Popen with the child running and no handle on it. The CLI's handler asks
# `defer_interrupt` first: inside `interrupts_deferred` (main thread only) the interrupt is kept and
# raised as the block ends, when the caller holds the child and its clean-up runs.
class _Deferral:
    depth = 0  # interrupts_deferred blocks open (main thread)
    pending: Callable[[], None] | None = None


_deferral = _Deferral()


def defer_interrupt(deliver: Callable[[], None]) -> bool:
    """For a signal handler: True if a child is being created (deliver() is called once it has been),
    False if the handler should act now."""
    if _deferral.depth and threading.current_thread() is threading.main_thread():
        _deferral.pending = deliver
        return True
    return False


@contextlib.contextmanager
def interrupts_deferred():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferral.depth += 1
    try:
        yield
    finally:
        _deferral.depth -= 1
        if not _deferral.depth:
            deliver, _deferral.pending = _deferral.pending, None
            if deliver is not None:
                deliver()
