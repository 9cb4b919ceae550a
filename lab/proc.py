"""The one way to start a subprocess: list argv (never a shell), bounded by a timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from lab.errors import CommandError, LabError, TimeoutError_


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
    argv: Sequence[str],
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
    merged_env = None
    if env is not None:
        merged_env = dict(os.environ)
        merged_env.update(env)
    start = time.monotonic()
    feed = open(stdin, "rb") if stdin is not None else contextlib.nullcontext()
    try:
        with feed as fh, subprocess.Popen(
                full, stdin=subprocess.PIPE if input is not None else fh, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=merged_env, cwd=cwd, text=text, errors="replace" if text else None,
                start_new_session=True) as p:
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
        raise LabError(f"{full[0]} is not installed (needed for {what or 'this step'})",
                       hint="run `make setup` or `lab doctor`") from exc
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
    argv: Sequence[str],
    *,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    netns: str | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start a long-lived process (QEMU, an iperf3 server) in its own session, so a Ctrl-C at
    the terminal reaches the orchestrator only and teardown stays in its hands."""
    full = netns_prefix(netns) + [str(a) for a in argv]
    merged_env = None
    if env is not None:
        merged_env = dict(os.environ)
        merged_env.update(env)
    try:
        return subprocess.Popen(full, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=merged_env)
    except FileNotFoundError as exc:
        raise LabError(f"{full[0]} is not installed", hint="run `make setup` or `lab doctor`") from exc
