"""The `lab` command group and what its commands share: options, where the results are, signals."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

import click

from lab import __version__, config, proc, redact
from lab.cli.printing import err, line
from lab.errors import Interrupted, LabError, UsageError
from lab.labconfig import LabConfig
from lab.store import Store

config_option = click.option(
    "-c",
    "--config",
    "config_path",
    default="lab.toml",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="the lab description",
)
set_option = click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="change one lab.toml key for this command, in TOML: --set suite.repetitions=2 "
    "--set 'matrix.nic=[\"virtio\"]' (repeatable; validated as the file is; a run stores the lab it ran)",
)
results_option = click.option(
    "--results",
    "results_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="results directory (default: [lab] results in lab.toml)",
)


class LabGroup(click.Group):
    """The `lab` group, with the lab's exit statuses: 0 success; 1 a run or operation failed, or an
    unexpected error (one line here, its traceback in a log file); 2 bad input, nothing created;
    130 interrupted. Every error is one line on stderr. (Here rather than around `main` so that
    click's CliRunner exercises it too.)"""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        lenient_output()
        warnings_as_lines()
        # From the first moment: a SIGTERM while lab.toml is read or hosts are checked ends in one
        # line and exit 130 like one mid-run, never silently.
        previous = install_signal_handlers()
        try:
            super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            # One line like every other error (click's own shows usage and a hint over three).
            ctx = getattr(exc, "ctx", None)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            err.print(f"lab: error: {exc.format_message()}{where}")
            sys.exit(2)
        except click.exceptions.Abort:
            err.print("lab: aborted")
            sys.exit(130)
        except Interrupted as exc:
            err.print(f"lab: interrupted ({exc}); every VM created was destroyed")
            sys.exit(130)
        except LabError as exc:
            # One line: what is wrong (file, key, value) and, if known, what to do.
            hint = f" (hint: {exc.hint})" if exc.hint else ""
            err.print(f"lab: error: {exc}{hint}")
            sys.exit(exc.exit_code)
        except OSError as exc:  # a file the lab could not write or read: the line names it and why
            sys.exit(unexpected(exc, f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else None))
        except Exception as exc:  # noqa: BLE001 - the last guard: a bug is one line and a log, not a traceback
            sys.exit(unexpected(exc))
        finally:
            restore_signal_handlers(previous)


def lenient_output() -> None:
    """A terminal or pipe whose encoding lacks a character of the tables (×, –, µ) shows "?" in its
    place rather than the command failing at its first table."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors="replace")


class WarningLines(logging.Handler):
    """The library's warnings (its `lab.*` loggers, level WARNING and up) as one stderr line each."""

    def emit(self, record: logging.LogRecord) -> None:
        first = (redact.passwords(record.getMessage()).strip().splitlines() or [""])[0]
        err.print(line("lab: warning: ", first))


def warnings_as_lines() -> None:
    logger = logging.getLogger("lab")
    if not any(isinstance(h, WarningLines) for h in logger.handlers):
        handler = WarningLines(logging.WARNING)
        logger.addHandler(handler)


def unexpected(exc: Exception, what: str | None = None) -> int:
    """An error the lab has no words for (a bug): one line naming it (`what`, or its type and first
    line) and where its traceback went."""
    if what is None:
        what = f"{type(exc).__name__}: {str(exc).splitlines()[0]}" if str(exc).strip() else type(exc).__name__
    what = redact.passwords(what)
    try:
        with tempfile.NamedTemporaryFile("w", prefix="lab-error-", suffix=".log", delete=False) as log:
            log.write(redact.passwords("".join(traceback.format_exception(exc))))
        details = f"details in {log.name}"
    except OSError as log_exc:
        details = f"no log could be written ({log_exc.strerror})"
    err.print(f"lab: error: {what}; {details}")
    return 1


@click.group(cls=LabGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lab")
def cli():
    """lab: clean VMs from golden images, one knob at a time, measured and compared."""


def load_or_default(config_path: str) -> LabConfig:
    """The lab of `config_path`, or the default lab when there is no such file (gc, snapshot, publish)."""
    return config.load(config_path) if Path(config_path).exists() else config.parse({}, config_path)


def results_dir(config_path: str, given: str | None) -> Path:
    if given:
        return Path(given)
    if Path(config_path).exists():
        return config.load(config_path).results_dir
    return Path("results")


def closing(store: Store) -> Store:
    """`store`, closed when the command ends (its WAL files go with the last connection)."""
    click.get_current_context().call_on_close(store.close)
    return store


def read_store(config_path: str, given: str | None) -> Store:
    """The store of an existing results directory, opened for reading only: a reading command
    (ls, show, compare, report, history) writes nothing to it, not even a migration (lab.store
    reads an older store through an upgraded copy in memory)."""
    where = results_dir(config_path, given)
    if not (where / Store.FILENAME).exists():
        raise UsageError(f"no runs in {where} (no {Store.FILENAME}); `lab run` makes one")
    return closing(Store(where, readonly=True))


def open_store(config_path: str, given: str | None) -> Store:
    """The store of an existing results directory (reading commands never create one; one this
    process cannot write to is opened read-only, lab.store)."""
    where = results_dir(config_path, given)
    if not (where / Store.FILENAME).exists():
        raise UsageError(f"no runs in {where} (no {Store.FILENAME}); `lab run` makes one")
    return closing(Store(where))


@contextlib.contextmanager
def results_umask(cfg: LabConfig) -> Iterator[None]:
    """New results directories and files made in the block get [lab] results_mode (private by
    default): the process's umask, for the block only (VM disks made elsewhere keep theirs)."""
    previous = os.umask(cfg.lab.umask)
    try:
        yield
    finally:
        os.umask(previous)


def new_store(cfg: LabConfig, where: Path | None = None) -> Store:
    """The results store a command writes to, made with [lab] results_mode if it is new."""
    with results_umask(cfg):
        return closing(Store(where or cfg.results_dir))


def require_host(cfg: LabConfig, config_path: str, host: str) -> None:
    if host not in cfg.hosts:
        raise UsageError(f"{config_path}: no host {host!r}; defined hosts: {', '.join(sorted(cfg.hosts))}")


def install_signal_handlers() -> dict:
    """SIGTERM and Ctrl-C raise Interrupted: every `finally` on the way tears down what it made.
    Returns the handlers they replace (restore_signal_handlers); {} where signals cannot be
    handled (a thread other than the main one)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        # The first signal starts an orderly teardown; more signals must not cut it short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if proc.defer_interrupt(lambda: interrupt(signum)):
            return  # a child is being started: raised as soon as its caller can stop it
        interrupt(signum)

    def interrupt(signum):
        raise Interrupted(signal.Signals(signum).name)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def restore_signal_handlers(previous: dict) -> None:
    for sig, old in previous.items():
        signal.signal(sig, old)
