"""The guest's serial console: QEMU's console log (virtlogd writes it from the first byte), and
libvirt's console stream, the one reader that works on every driver and over any URI (bhyve's
nmdm keeps no log, so what the guest prints must be read while it prints)."""

from __future__ import annotations

import threading
from pathlib import Path

from lab.backends.libvirt.connection import error_message, libvirt_module
from lab.backends.libvirt.hostshell import HostShell

FAILED_MARK = "LAB-FAILED"  # what a guest prints on its console when its own setup failed


class ConsoleTap:
    """The guest's first serial port through virDomainOpenConsole: on bhyve the nmdm slave (opened
    raw by libvirtd, so nothing is echoed back into the guest), on QEMU the pty.

    A daemon thread blocks in stream.recv() (libvirt-python releases the GIL; a blocking stream
    needs no event loop) and appends to a bounded buffer. The stream has a connection of its own:
    a recv blocked on a shared connection would hold every other call on it (seen on 9.0)."""

    LIMIT = 1 << 20  # keep the last MiB: boot logs are small, a chatty guest must not grow us

    def __init__(self, uri: str, name: str):
        libvirt = libvirt_module()
        self._libvirt_error = libvirt.libvirtError
        self._buf = bytearray()
        self._lock = threading.Lock()
        self.error = ""
        self._conn = libvirt.open(uri)
        try:
            self._stream = self._conn.newStream(0)
            # bhyve accepts no flags (virCheckFlags(0) in bhyveDomainOpenConsole)
            self._conn.lookupByName(name).openConsole(None, self._stream, 0)
        except libvirt.libvirtError:
            self._conn.close()
            raise
        self._thread = threading.Thread(target=self._read, name=f"console-{name}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = self._stream.recv(4096)
            except self._libvirt_error as exc:  # domain gone, stream aborted
                self.error = error_message(exc)
                return
            if not isinstance(data, bytes) or not data:
                return  # EOF
            with self._lock:
                self._buf += data
                if len(self._buf) > self.LIMIT:
                    del self._buf[: len(self._buf) - self.LIMIT]

    def text(self) -> str:
        with self._lock:
            return self._buf.decode(errors="replace")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Abort the stream (this unblocks the reader), then drop the connection. Idempotent."""
        if self._conn is None:
            return
        if self._thread.is_alive():
            try:
                self._stream.abort()
            except self._libvirt_error:
                pass
        self._thread.join(timeout)
        try:
            self._conn.close()
        except self._libvirt_error:
            pass
        self._conn = None


def console_text(log_path: str, tap: ConsoleTap | None, shell: HostShell) -> str:
    """What the guest wrote on its serial console so far ("" if unreadable from here): the console
    log where there is one (QEMU), else the console stream."""
    if log_path:
        text = shell.read(log_path)
        if text is not None:
            return text
    return tap.text() if tap is not None else ""


def log_readable(log_path: str, shell: HostShell) -> bool:
    """Only a log read from its first byte proves a line has not been printed yet: a QEMU log on
    this machine (a remote one may not exist yet, or be unreadable)."""
    return bool(log_path) and not shell.remote and Path(log_path).exists()


def tail(text: str, lines: int = 5) -> str | None:
    """The console's last lines, as a hint beside an error."""
    last = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return ("console: " + " | ".join(last)) if last else None
