"""lab.toml -> typed, frozen records (lab.labconfig), checked (lab.check) before anything is made.

Every error names the file, the key and the value, on one line (ConfigError, exit status 2).
Secrets stay references ("env:NAME", "file:PATH") in the records, checked here (lab.secrets:
their variables are kept from every child process from then on); lab.secrets reads them only
when a backend is built, and never puts the value in an error. A host's settings are validated
with the lab.toml's folder as context ("base_dir"): a relative path in them is relative to it.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lab import backends, check, names, overrides, secrets
from lab.backends import HostSettings
from lab.errors import ConfigError
from lab.labconfig import KNOWN_IMAGES, LabConfig, LabSection, MatrixSection, SuiteSection  # noqa: F401 - the records, as lab.config names them

SECRET_KEYS = secrets.KEYS


def load(path: str | os.PathLike, sets: Sequence[str] = ()) -> LabConfig:
    """Read and validate a lab.toml, with `--set KEY=VALUE` overrides (lab.overrides) put in first.
    Raises ConfigError (one line, exit 2) on any problem."""
    return loaded(path, sets)[0]


def loaded(path: str | os.PathLike, sets: Sequence[str] = ()) -> tuple[LabConfig, str]:
    """The records of a lab.toml and the text a run stores as its lab: the file's own, or with
    overrides the lab that ran, written out as TOML (lab.overrides.effective_text)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(str(path), "(file)", None, "no such file", hint="pass -c PATH or create lab.toml") from None
    except OSError as exc:
        raise ConfigError(str(path), "(file)", None, f"cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except UnicodeDecodeError:
        raise ConfigError(str(path), "(file)", None, "is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), "(syntax)", None, f"invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(str(path), "(syntax)", None, "nests arrays or tables too deeply") from None
    given = [overrides.parse(s, str(path)) for s in sets]
    if given:
        data = overrides.apply(data, given, str(path))
        text = overrides.effective_text(data, str(path), given)
    try:
        return parse(data, str(path)), text
    except RecursionError:  # a value nested deeper than any model has levels
        raise ConfigError(str(path), "(structure)", None, "nests arrays or tables too deeply") from None
    except ConfigError as exc:
        o = overrides.owner(exc.key, given)
        if o is None:
            raise
        # the value came from the command line: say so, or the file would be searched for it
        raise ConfigError(f"{path} (--set {o.key})", exc.key, exc.value, exc.problem, exc.hint) from None


def parse(data: dict[str, Any], source: str = "lab.toml") -> LabConfig:
    """The records of a parsed TOML document, checked across sections (lab.check)."""
    cfg = records(data, source)
    check.validate(cfg)
    return cfg


def records(data: dict[str, Any], source: str = "lab.toml") -> LabConfig:
    """Each section through its model, each [hosts.NAME] through its backend's; no cross checks."""
    if "source" in data:
        raise ConfigError(source, "source", data["source"], "unknown key")
    hosts_raw = data.get("hosts", {})
    if not isinstance(hosts_raw, dict):
        raise ConfigError(source, "hosts", _shown(hosts_raw), "must be a table of [hosts.NAME] tables")
    # The local backend is always there unless the file defines its own "local".
    hosts = {"local": backends.settings_model("local")(backend="local")}
    for name, table in hosts_raw.items():
        hosts[name] = _parse_host(name, table, source)
    try:
        cfg = LabConfig.model_validate({**{k: v for k, v in data.items() if k != "hosts"}, "source": source})
    except ValidationError as exc:
        raise _config_error(exc, data, source, ()) from None
    return cfg.model_copy(update={"hosts": hosts})


def _parse_host(name: str, table: Any, source: str) -> HostSettings:
    """One [hosts.NAME] table through its backend's Settings model."""
    known = ", ".join(backends.names())
    why = names.HOST.problem(name)  # it names lanes, labels, files, VMs: one rule (lab.names)
    if why:
        raise ConfigError(source, f"hosts.{json.dumps(name)}", name, why)
    if not isinstance(table, dict):
        raise ConfigError(source, f"hosts.{name}", _shown(table), "must be a table")
    kind = table.get("backend")
    if kind is None:
        raise ConfigError(source, f"hosts.{name}.backend", None, f"missing backend; expected one of: {known}")
    if kind not in backends.REGISTRY:
        raise ConfigError(source, f"hosts.{name}.backend", kind, f"unknown backend; expected one of: {known}")
    try:
        settings = backends.settings_model(kind).model_validate(table, context={"base_dir": base_dir(source)})
    except ValidationError as exc:
        raise _config_error(exc, table, source, ("hosts", name)) from None
    for key, value, problem in settings.problems() + settings.client_problems():
        raise ConfigError(source, f"hosts.{name}.{key}", value, problem)
    caps = backends.capabilities(settings)
    if settings.slots > caps.max_slots:
        raise ConfigError(
            source,
            f"hosts.{name}.slots",
            settings.slots,
            f"the {caps.description} backend runs at most {caps.max_slots} measured VM(s) of a run at once on a host",
        )
    for key in SECRET_KEYS:
        ref = getattr(settings, key, None)
        if isinstance(ref, str):
            secrets.reference(ref, source, f"hosts.{name}.{key}")
    return settings


def base_dir(source: str) -> Path:
    """The folder of a lab.toml: what relative paths in it are relative to."""
    return Path(source).resolve().parent


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _dig(data: Any, loc: tuple) -> Any:
    cur = data
    for part in loc:
        try:
            cur = cur[part]
        except (KeyError, IndexError, TypeError):
            return None
    return cur


def _shown(value: Any) -> Any:
    return "{…}" if isinstance(value, dict) else "[…]" if isinstance(value, list) else value


def _config_error(exc: ValidationError, data: dict[str, Any], source: str, prefix: tuple) -> ConfigError:
    """pydantic's first error as one line naming file, key and value (a secret is never echoed)."""
    err = exc.errors()[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    is_key = bool(loc) and loc[-1] == "[key]"  # a dict key outside its choices
    if is_key:
        loc = loc[:-1]
    value = _dig(data, loc) if err["type"] != "missing" else None
    msg = err["msg"].removeprefix("Value error, ")
    if is_key:
        msg = "unknown key; " + msg[:1].lower() + msg[1:]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    if loc and loc[-1] in SECRET_KEYS:
        value = "<redacted>"  # a secret pasted in place of a reference is never echoed
    elif isinstance(value, (dict, list)) and err["type"] != "list_type":
        value = _shown(value)
    more = len(exc.errors()) - 1
    if more:
        msg += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ConfigError(source, _loc(prefix + loc) or "(top level)", value, msg)
