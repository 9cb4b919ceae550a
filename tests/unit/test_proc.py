"""lab.proc.run: the one way the lab runs a command to completion. Its children run in a session
of their own (a Ctrl-C at the terminal reaches the orchestrator only), so when run() gives up on
one (a timeout) or the orchestrator is interrupted, run() must stop the whole session: found when
`lab images build` got SIGTERM and left packer and its QEMU running."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lab import proc
from lab.errors import TimeoutError_
from lab.wait import wait_until


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")  # reaped by nobody yet
    except (OSError, IndexError):
        return True


def test_a_timeout_stops_the_grandchildren_too(tmp_path):
    pidfile = tmp_path / "pid"
    with pytest.raises(TimeoutError_, match="did not finish within 1 s"):
        proc.run(["sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"], timeout=1, what="sh")
    pid = int(pidfile.read_text())
    wait_until(lambda: gone(pid), timeout=10, what="the grandchild to be gone")


def test_an_interrupted_orchestrator_stops_the_command_it_was_running(tmp_path):
    """As `lab images build` does: SIGTERM raises in the main thread while run() waits."""
    pidfile = tmp_path / "pid"
    script = textwrap.dedent(f"""
        import signal
        from lab import proc

        class Interrupted(BaseException):
            pass

        def handler(signum, frame):
            raise Interrupted()
        signal.signal(signal.SIGTERM, handler)
        try:
            # the pid is written a second late: the SIGTERM must find run() waiting, not still in
            # Popen's constructor (a child may write before its parent's fork returns on a busy machine)
            proc.run(["sh", "-c", "sleep 300 & sleep 1; echo $! > {pidfile}; wait"], timeout=600)
        except Interrupted:
            print("interrupted")
        """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=30, what="the command to start")
        pid = int(pidfile.read_text())
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert out.strip() == "interrupted"
    wait_until(lambda: gone(pid), timeout=10, what="the grandchild to be gone")


@pytest.mark.parametrize("start", ["run", "spawn"])
def test_an_interrupt_while_a_child_starts_stops_that_child(monkeypatch, start):
    """SIGTERM landing after the fork, before Popen has returned: the interrupt is raised once the
    child is held, and the child is stopped (it used to run on, with nobody holding it)."""
    import os

    from lab.cli.group import install_signal_handlers, restore_signal_handlers
    from lab.lifecycle import Interrupted

    real, started = subprocess.Popen, []

    def popen_then_signal(*args, **kwargs):
        p = real(*args, **kwargs)
        started.append(p)
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(10_000))  # Python runs the handler at a bytecode boundary: here, inside the creation
        return p

    previous = install_signal_handlers()
    monkeypatch.setattr(proc.subprocess, "Popen", popen_then_signal)
    try:
        with pytest.raises(Interrupted):
            proc.run(["sleep", "30"]) if start == "run" else proc.spawn(["sleep", "30"])
    finally:
        monkeypatch.undo()
        restore_signal_handlers(previous)
    assert len(started) == 1
    assert started[0].poll() is not None, "the child whose start was interrupted is still running"


def test_a_command_that_prints_without_end_keeps_its_head_and_tail_only():
    """Issue 35: output is bounded (lab.proc.OUTPUT_LIMIT of each stream), not read whole into
    memory and the store; what is cut is said in the output itself."""
    limit = proc.OUTPUT_LIMIT
    script = f"printf START; head -c {3 * limit} /dev/zero | tr '\\0' x; printf END; printf E1 >&2"
    res = proc.run(["sh", "-c", script], timeout=120)
    assert len(res.stdout.encode()) < limit + 200
    assert res.stdout.startswith("STARTxxx") and res.stdout.endswith("xxxEND")
    cut = 3 * limit + len("STARTEND") - limit
    assert f"[lab: {cut} bytes of output cut here: at most {limit // 2**20} MiB are kept" in res.stdout
    assert res.stderr == "E1"
    small = proc.run(["sh", "-c", "printf 'a\\r\\nb\\rc'; printf é >&2"], timeout=10)
    assert (small.stdout, small.stderr) == ("a\nb\nc", "é")  # as text mode read it before
    fed = proc.run(["wc", "-c"], input="y" * 5_000_000, timeout=30)  # input larger than a pipe, fed as read
    assert fed.stdout.strip() == "5000000"
    assert proc.run(["head", "-c", "3"], input=b"z" * 1_000_000, text=False, timeout=30).stdout == b"zzz"


def test_a_log_file_is_read_as_a_commands_output_is(tmp_path):
    log = tmp_path / "server.log"
    log.write_bytes(b"ready\n" + b"." * (2 * proc.OUTPUT_LIMIT) + b"\nlast line\n")
    text = proc.read_bounded(log)
    assert text.startswith("ready\n") and text.endswith("\nlast line\n") and "bytes of output cut here" in text
    assert len(text) < proc.OUTPUT_LIMIT + 200
    log.write_text("short\r\n")
    assert proc.read_bounded(log) == "short\n"
