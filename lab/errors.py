"""Exceptions. The library raises these; only lab.cli turns them into a message and an exit code."""

from __future__ import annotations

from lab import redact


class LabError(Exception):
    """An error a user can act on. `str(err)` is one line; `hint` says what to do next."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        message = redact.passwords(message)  # a URL's password never reaches a line, a log or the store
        super().__init__(message)
        self.message = message
        self.hint = redact.passwords(hint) if hint else hint

    def __str__(self) -> str:
        return self.message


class UsageError(LabError):
    """Bad input: configuration, arguments, unknown names. Nothing was created. Exit status 2."""

    exit_code = 2


class ConfigError(UsageError):
    """lab.toml is wrong. The message names the file, the key and the value."""

    def __init__(self, path: str, key: str, value: object, problem: str, hint: str | None = None):
        self.path, self.key, self.value, self.problem = str(path), key, value, problem
        shown = repr(value) if value is not None else "(missing)"
        super().__init__(f"{path}: {key} = {shown}: {problem}", hint)


class SettingError(UsageError):
    """A backend cannot do what lab.toml asks: a NIC model, disk bus, setting or feature it lacks.
    `key` is the lab.toml key (a matrix axis such as "disk_bus", or a host setting such as
    "guest_agent"), so lab.config can name file, key and value; `problem` is the reason alone."""

    def __init__(self, key: str, value: object, problem: str, hint: str | None = None, *, where: str = ""):
        self.key, self.value, self.problem = key, value, problem
        shown = repr(value) if value is not None else "(missing)"
        super().__init__(f"{where}{key} = {shown}: {problem}", hint)


class BackendError(LabError):
    """A hypervisor refused or failed an operation."""


class HostUnreachable(LabError):
    """A host or its API could not be reached, or stopped answering (connection refused or lost, no
    answer in time, a cluster node offline). Exit status 1: a look that did not happen (`lab
    snapshot`, `lab gc`, a call mid-run). Before anything is created, `lab run`'s checks raise the
    UnreachableError below instead (exit 2); `except HostUnreachable` catches both."""


class UnreachableError(UsageError, HostUnreachable):
    """A host, API or guest could not be reached at all (before anything was created). Exit 2."""


class AuthError(UsageError):
    """Credentials were refused or lack a privilege. Never includes the secret."""


class CommandError(LabError):
    """A subprocess exited non-zero (or a guest command failed)."""

    def __init__(self, argv: list[str], returncode: int, stdout: str, stderr: str, what: str | None = None):
        self.argv, self.returncode, self.stdout, self.stderr = argv, returncode, stdout, stderr
        tail = (stderr or stdout).strip().splitlines()[-3:]
        name = what or argv[0]
        detail = " | ".join(tail) if tail else "no output"
        super().__init__(f"{name} exited with status {returncode}: {detail}")


class TimeoutError_(LabError):
    """A bounded wait ran out. The message says what was awaited and for how long."""


class VerificationError(LabError):
    """A guest does not match what the cell asked for; the cell is not measured."""


class TeardownError(LabError):
    """Something created could not be removed. Always loud."""


class IncompleteListing(LabError):
    """A host could list only part of what it holds (a node offline, a connection lost): `found`
    is what it did list, `unchecked` names each part it could not look at and why (not the host: gc
    adds its name). `lab gc` reports
    those parts as "not checked" and exits 1: a look that did not happen is never a success."""

    def __init__(self, message: str, found: list, unchecked: list[str], hint: str | None = None):
        super().__init__(message, hint)
        self.found, self.unchecked = list(found), list(unchecked)


class Interrupted(BaseException):
    """Raised from the SIGTERM/SIGINT handler so every `finally` runs (BaseException: no
    `except Exception` on the way may swallow it)."""
