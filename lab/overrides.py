"""`--set KEY=VALUE`: one lab.toml key changed for one command, without editing the file.

KEY and VALUE are TOML, read by TOML's own parser (`suite.repetitions=2`, `matrix.nic=["virtio"]`,
`suite.params.http.duration=3`, `'hosts."kvm 1".slots'=2`), so a string is quoted (`="warm"`) and
a key means what it would in the file. The value replaces the file's (a list is not merged), and
the result goes through the same validation as the file. A run stores the lab it ran (the file
with its overrides, written out as TOML), so `lab reproduce` and the report see what was measured.
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tomli_w

from lab import secrets
from lab.errors import ConfigError


@dataclass(frozen=True)
class Override:
    text: str  # as given, KEY=VALUE
    path: tuple[str, ...]  # the key's parts
    value: Any

    @property
    def key(self) -> str:
        return ".".join(self.path)

    @property
    def shown(self) -> Any:
        """The value as an error may print it: never a secret's."""
        return REDACTED if is_secret(self.key) else self.value


REDACTED = "<redacted>"


def is_secret(key: str) -> bool:
    """A key that holds a secret's reference (or, pasted by mistake, the secret itself)."""
    return any(name in key for name in secrets.KEYS)


def parse(text: str, source: str) -> Override:
    """Pure: one `KEY=VALUE` -> an Override. A ConfigError names --set, the key and what is wrong;
    the value of a secret's key is never echoed, and neither is an argument without `=` (it may be one)."""
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not key:
        raise ConfigError(source, "--set", None, "expected KEY=VALUE (TOML), e.g. suite.repetitions=2")
    if "\n" in key:
        raise ConfigError(source, "--set", None, "one line: a key and its value, no line breaks")
    shown = REDACTED if is_secret(key) else value
    if "\n" in value or "\r" in value:
        raise ConfigError(source, f"--set {key}", shown, "one line: a key and its value, no line breaks")
    try:
        path = _leaf_path(tomllib.loads(f"{key} = 0"))
    except (tomllib.TOMLDecodeError, ValueError):
        raise ConfigError(source, "--set", key, "not a TOML key (dotted bare or quoted keys)") from None
    try:
        doc = tomllib.loads(f"v = {value}")
    except tomllib.TOMLDecodeError:
        hint = 'the value is TOML: quote a string ("warm"), write a list as ["a", "b"]'
        raise ConfigError(source, f"--set {key}", shown, hint) from None
    if set(doc) != {"v"}:
        raise ConfigError(source, f"--set {key}", shown, "one value only")
    return Override(text, path, doc["v"])


def _leaf_path(doc: dict[str, Any]) -> tuple[str, ...]:
    """The one key path of a document made of `KEY = 0`."""
    path: list[str] = []
    node: Any = doc
    while isinstance(node, dict):
        if len(node) != 1:
            raise ValueError("more than one key")
        ((name, node),) = node.items()
        path.append(name)
    return tuple(path)


def apply(data: dict[str, Any], overrides: Sequence[Override], source: str) -> dict[str, Any]:
    """Pure: a copy of a parsed lab.toml with each override's value put at its key (tables made as needed)."""
    out = copy.deepcopy(data)
    for o in overrides:
        node = out
        for depth, part in enumerate(o.path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(o.path[: depth + 1])
                raise ConfigError(source, f"--set {o.key}", o.shown, f"{where} is not a table in the file")
            node = child
        node[o.path[-1]] = o.value
    return out


def owner(key: str, overrides: Sequence[Override]) -> Override | None:
    """The override an error's key is about: the key itself, something inside it, or a table the
    override made or changed (`--set lab.name.x=1` makes lab.name a table), if any."""
    for o in reversed(overrides):  # the last one given wins, as in apply
        if key == o.key or key.startswith((o.key + ".", o.key + "[")) or o.key.startswith(key + "."):
            return o
    return None


def effective_text(data: dict[str, Any], source: str, overrides: Sequence[Override]) -> str:
    """What a run stores as its lab.toml when overrides were given: the lab it ran, as TOML."""
    given = ", ".join(o.key for o in overrides)
    head = (
        f"# {' '.join(source.splitlines())}, with {given} set on the command line (--set)\n"
        "# (written out by lab: the file's own comments are in the file)\n"
    )
    return head + tomli_w.dumps(data)
