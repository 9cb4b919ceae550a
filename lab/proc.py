"""The one way to start a subprocess: list argv (never a shell), bounded by a timeout, in an
environment without the secrets lab.toml references (lab.secrets.child_environment)."""

from __future__ import annotations

import contextlib
import os
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
    try:
        with feed as fh:
            p = _start(
                lambda: subprocess.Popen(
                    full,
                    stdin=subprocess.PIPE if input is not None else fh,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=merged_env,
                    cwd=cwd,
                    text=text,
                    errors="replace" if text else None,
                    start_new_session=True,
                )
            )
            with p:
                try:
                    stdout, stderr = p.communicate(input, timeout=timeout)
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
    res = Result(full, p.returncode, stdout, stderr, time.monotonic() - start)
    if check and p.returncode != 0:
        raise CommandError(full, p.returncode, stdout if text else "", stderr if text else "", what)
    return res


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
