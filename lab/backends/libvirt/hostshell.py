"""Commands on the libvirt host (zfs, qemu-img, dd, rm, arp, cat): over SSH for a remote host, on
this machine for a local URI. Every command goes through one `run` (lab.proc.run unless a test
records them instead), so the argv lab would send is what tests check."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

from lab import proc
from lab.errors import CommandError

SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=10"]

Run = Callable[..., proc.Result]


class HostShell:
    def __init__(self, ssh_args: Sequence[str] | None, run: Run = proc.run):
        self.ssh_args = list(ssh_args) if ssh_args is not None else None
        self.run_argv = run  # runs an argv as given (already wrapped for the host, or local)

    @property
    def remote(self) -> bool:
        return self.ssh_args is not None

    def argv(self, argv: Sequence[object]) -> list[str]:
        """The argv that runs `argv` on the host."""
        words = [str(a) for a in argv]
        if self.ssh_args is None:
            return words
        return ["ssh", *SSH_OPTIONS, *self.ssh_args, shlex.join(words)]

    def shell_argv(self, command: str) -> list[str]:
        """The argv that runs a shell pipeline on the host (zfs send | zfs recv)."""
        if self.ssh_args is None:
            return ["sh", "-c", command]
        return ["ssh", *SSH_OPTIONS, *self.ssh_args, command]

    def run(
        self, argv: Sequence[object], *, what: str, timeout: float = 120.0, check: bool = True, **kw
    ) -> proc.Result:
        return self.run_argv(self.argv(argv), timeout=timeout, check=check, what=what, **kw)

    def read(self, path: str) -> str | None:
        """A small file on the host (None if it is not there)."""
        if not self.remote:
            try:
                return proc.read_bounded(path)  # as a remote `cat` through proc.run is
            except OSError:
                return None
        res = self.run(["cat", path], what="read file", check=False, timeout=30)
        return res.stdout if res.ok else None

    def read_bytes(self, path: str, size: int) -> bytes:
        """The first `size` bytes of a file on the host (CommandError when it cannot be read)."""
        if not self.remote:
            try:
                with open(path, "rb") as f:
                    return f.read(size)
            except OSError as exc:
                raise CommandError(["read", path], 1, "", str(exc), what="read file") from None
        res = self.run(["head", "-c", size, path], what="read file", timeout=60, text=False)
        return cast(bytes, res.stdout)  # text=False: the output is bytes (Result types it for text)

    def records(self, directory: str, pattern: str) -> list[tuple[str, str]]:
        """(file name, line) for every line of the files named `pattern` directly in `directory`
        (one-line records such as the clones' lease files); [] when the directory does not exist.
        CommandError when it exists but cannot be read: a listing that did not happen is never an
        empty one."""
        d = shlex.quote(directory)
        res = self.run_argv(
            self.shell_argv(
                f"[ -e {d} ] || exit 0; exec find {d} -maxdepth 1 -type f -name {shlex.quote(pattern)} "
                "-exec awk '{ print FILENAME \"\\t\" $0 }' {} +"
            ),
            timeout=60,
            check=False,
            what=f"list {directory}",
        )
        if not res.ok:
            raise CommandError(res.argv, res.returncode, res.stdout, res.stderr, what=f"list {directory}")
        out = []
        for line in res.stdout.splitlines():
            path, tab, text = line.partition("\t")
            if tab and text.strip():
                out.append((path.rsplit("/", 1)[-1], text))
        return out

    def write(self, path: str, text: str) -> None:
        """A small file on the host."""
        if self.remote:
            self.run_argv(self.shell_argv(f"cat > {shlex.quote(path)}"), input=text, timeout=60, what="write file")
        else:
            Path(path).write_text(text)
