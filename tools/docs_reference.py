"""The docs' reference, made from the code: every lab.toml key (the typed config models and the axes
table), every workload parameter (each workload's declared Traits) and every CLI command and option
(the click group), as Markdown pages.

An MkDocs hook (mkdocs.yml `hooks:`): before each build it adds reference/*.md to the site as
generated files, so the reference is never stale and nothing generated is in git (a `mkdocs serve`
does not rebuild itself either, as it would if this wrote into docs/). `python tools/docs_reference.py
DIR` writes the same pages into DIR, to read them as Markdown.

`undocumented()` lists every key, parameter, command or option that has no meaning to show (a Field
without a description, a Param without a meaning, a click option without help): the docs-coverage test
(tests/unit/test_docs_reference.py) fails on any.
"""

from __future__ import annotations

import enum
import inspect
import json
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class Entry:
    """One documented thing: a key of a section, a parameter of a workload, an option of a command."""

    where: str  # "[suite]", "[hosts.NAME] (proxmox)", "[suite.params.http]", "lab compare"
    name: str  # "repetitions", "--margin"
    type: str
    default: str
    meaning: str


# ---------------------------------------------------------------------------------------------
# Types and defaults as a reader of lab.toml sees them


def type_text(annotation: Any) -> str:
    """A Python annotation as lab.toml values: `integer`, `"a" or "b"`, `list of string`, ..."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is typing.Literal:
        return " or ".join(json.dumps(a.value if isinstance(a, enum.Enum) else a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" (or unset)" if type(None) in args else "")
    if origin is list:
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is dict:
        return f"table of {type_text(args[0])} to {type_text(args[1])}" if args else "table"
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return " or ".join(json.dumps(m.value) for m in annotation)
        if issubclass(annotation, BaseModel):
            return "table (keys below)"
        simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
        for kind, text in simple.items():
            if annotation is kind:
                return text
        return annotation.__name__
    return str(annotation)


def bounds(metadata: list[Any]) -> str:
    """pydantic's ge/gt/le/lt constraints as text (`1 to 64`, `> 0`)."""
    low = high = ""

    def number(v: float) -> str:
        return str(int(v)) if float(v).is_integer() else f"{v:g}"

    for m in metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">")):
            if getattr(m, attr, None) is not None:
                low = f"{sign} {number(getattr(m, attr))}"
        for attr, sign in (("le", "≤"), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                high = f"{sign} {number(getattr(m, attr))}"
    return ", ".join(p for p in (low, high) if p)


def value_text(value: Any) -> str:
    """A default as it would be written in lab.toml."""
    if value is None:
        return "unset"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        value = [v.value if isinstance(v, enum.Enum) else v for v in value]
    return json.dumps(value, ensure_ascii=False)


def field_default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    if field.default_factory is not None:
        return value_text(field.default_factory())  # type: ignore[call-arg]
    return value_text(field.default)


def model_entries(model: type[BaseModel], where: str, skip: frozenset[str] = frozenset()) -> Iterator[Entry]:
    """A model's keys; a key whose type is a model of its own is followed by that model's keys
    (`timeouts.clone`)."""
    for name, field in model.model_fields.items():
        if name in skip or field.exclude:
            continue
        kind = type_text(field.annotation)
        limits = bounds(field.metadata)
        yield Entry(
            where, name, kind + (f" ({limits})" if limits else ""), field_default(field), field.description or ""
        )
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            yield from model_entries(sub, f"{where} {name} = {{…}}")


# ---------------------------------------------------------------------------------------------
# What is documented


def config_entries() -> list[Entry]:
    """Every lab.toml key: each section's model, the axes table for [matrix], each backend's settings."""
    from lab import axes, backends
    from lab.backends.base import HostSettings
    from lab.labconfig import IsolationSection, LabSection, SuiteSection
    from lab.wan import WanProfile

    out = list(model_entries(LabSection, "[lab]"))
    for a in axes.AXES_TABLE:
        kind = f"list of {type_text(a.element)}"
        limits = (
            bounds(typing.get_args(a.element)[1].metadata) if typing.get_origin(a.element) is typing.Annotated else ""
        )
        kind += f" ({limits})" if limits else ""
        out.append(Entry("[matrix]", a.name, kind, value_text([a.default]), a.meaning))
    out.append(Entry("[matrix]", "exclude", "list of tables of axis to value", "[]", axes.EXCLUDE_MEANING))
    out += model_entries(SuiteSection, "[suite]", skip=frozenset({"params"}))
    out.append(
        Entry(
            "[suite]",
            "params",
            "table of workload name to table",
            "{}",
            "each workload's parameters, [suite.params.<workload>]: see Workload parameters",
        )
    )
    out += model_entries(IsolationSection, "[isolation]")
    out += model_entries(WanProfile, "[wan.NAME]")
    out += model_entries(HostSettings, "[hosts.NAME]")
    common = frozenset(HostSettings.model_fields)
    for name in backends.names():
        out += model_entries(backends.settings_model(name), f"[hosts.NAME] backend = {json.dumps(name)}", skip=common)
    return out


def workload_entries() -> list[Entry]:
    """Every workload's parameters, from its Traits (lab.workloads)."""
    from lab import workloads

    out: list[Entry] = []
    for name, w in sorted(workloads.load_all().items()):
        for p in w.traits.params:
            kind = type_text(p.type)
            if isinstance(p.default, list) and p.default:  # a list parameter: each value one row
                kind = f"list of {type_text(type(p.default[0]))}"
            out.append(Entry(f"[suite.params.{name}]", p.name, kind, value_text(p.default), p.meaning))
    return out


def command_entries(group: click.Group | None = None) -> list[Entry]:
    """Every command (name "", its help as meaning) and each of its options and arguments."""
    if group is None:
        from lab.cli import cli

        group = cli
    out: list[Entry] = []
    ctx = click.Context(group, info_name="lab")

    def walk(cmd: click.Command, path: str, ctx: click.Context) -> None:
        # a command's row: its usage line where an option's row has its default
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        out.append(Entry(path, "", "command", f"{path} {usage}".strip(), inspect.cleandoc(cmd.help or "")))
        for p in cmd.params:
            if getattr(p, "hidden", False):
                continue
            out.append(param_entry(path, p, ctx))
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, f"{path} {name}", click.Context(sub, info_name=name, parent=ctx))

    walk(group, "lab", ctx)
    return out


def param_entry(path: str, p: click.Parameter, ctx: click.Context) -> Entry:
    if isinstance(p, click.Option):
        names = ", ".join(p.opts + p.secondary_opts)
        kind = "flag" if p.is_flag else p.type.get_metavar(p, ctx) or p.type.name
        plain = isinstance(p.default, (str, int, float, list, tuple)) and p.default not in ((), [], "")
        default = value_text(p.default) if plain and not p.is_flag else ""
        return Entry(path, names, kind, default, (p.help or "").strip())
    # An argument: click gives it no help; its meaning is the command's usage (upper case, in its help).
    meta = p.make_metavar(ctx) if "ctx" in p.make_metavar.__code__.co_varnames else p.make_metavar()  # type: ignore[call-arg]
    return Entry(path, meta, "argument", "", "required: see the command's text" if p.required else "optional")


def undocumented(entries: list[Entry]) -> list[str]:
    """What has no meaning to show: `where name`, one per line of the coverage test's failure."""
    return [f"{e.where} {e.name}".strip() for e in entries if not e.meaning.strip()]


# ---------------------------------------------------------------------------------------------
# Pages


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(entries: list[Entry], head: tuple[str, str, str, str] = ("key", "type", "default", "meaning")) -> str:
    rows = [f"| {' | '.join(head)} |", "|---|---|---|---|"]
    for e in entries:
        default = "*required*" if e.default == "required" else f"`{cell(e.default)}`" if e.default else ""
        rows.append(f"| `{cell(e.name)}` | {cell(e.type)} | {default} | {cell(e.meaning)} |")
    return "\n".join(rows) + "\n"


def grouped(entries: list[Entry]) -> dict[str, list[Entry]]:
    out: dict[str, list[Entry]] = {}
    for e in entries:
        out.setdefault(e.where, []).append(e)
    return out


def lab_toml_page() -> str:
    parts = [
        "# lab.toml keys\n",
        "Generated from the code at build time (`tools/docs_reference.py`): each section's typed model "
        "(`lab/labconfig.py`, `lab/wan.py`), the axes table for `[matrix]` (`lab/axes.py`) and each "
        "backend's settings (`lab/backends/<name>/settings.py`). A key not listed here is refused "
        "(exit status 2, naming file, key and value). The [Configuration guide](../configuration.md) "
        "shows them in use; each workload's `[suite.params.<workload>]` keys are in "
        "[Workload parameters](workloads.md).\n",
    ]
    for where, rows in grouped(config_entries()).items():
        parts.append(f"## `{where}`\n\n{table(rows)}")
    return "\n".join(parts)


def workloads_page() -> str:
    from lab import workloads

    parts = [
        "# Workload parameters\n",
        "Generated from each workload's declared traits (`lab/workloads/`, `Traits.params`): the keys "
        "`[suite.params.<workload>]` accepts, each with its default; a value must have the default's "
        "type. [Workloads](../workloads.md) says how they measure.\n",
    ]
    by_where = grouped(workload_entries())
    for name, w in sorted(workloads.load_all().items()):
        t = w.traits
        primary = ", ".join(f"`{m}`" for m in t.primary_metrics.patterns) or "none"
        tools = ", ".join(f"`{x}`" for x in t.tools) or "none"
        parts.append(f"## {name}\n\n{t.summary}\n\nHeadline (primary) metrics: {primary}. Guest tools: {tools}.\n")
        rows = by_where.get(f"[suite.params.{name}]", [])
        parts.append(table(rows, ("parameter", "type", "default", "meaning")) if rows else "No parameters.\n")
    return "\n".join(parts)


def cli_page() -> str:
    parts = [
        "# CLI\n",
        "Generated from the click commands (`lab/cli/`); `lab COMMAND --help` prints the same. "
        "[Commands](../commands.md) shows them at work.\n",
    ]
    for path, rows in grouped(command_entries()).items():
        command, params = rows[0], rows[1:]
        parts.append(f"## `{path}`\n\n```\n{command.default}\n```\n\n{command.meaning}\n")
        if params:
            parts.append(table(params, ("option", "type", "default", "meaning")))
    return "\n".join(parts)


def index_page() -> str:
    return (
        "# Reference\n\n"
        "Made from the code each time the site is built, so it says what this version of lab accepts:\n\n"
        "- [lab.toml keys](lab-toml.md): every section and key, its type, default and meaning\n"
        "- [Workload parameters](workloads.md): every workload's `[suite.params.<workload>]` keys\n"
        "- [CLI](cli.md): every command and option\n\n"
        "`tests/unit/test_docs_reference.py` fails when any of them has no meaning written beside its code.\n"
    )


def pages() -> dict[str, str]:
    return {
        "reference/index.md": index_page(),
        "reference/lab-toml.md": lab_toml_page(),
        "reference/workloads.md": workloads_page(),
        "reference/cli.md": cli_page(),
    }


# ---------------------------------------------------------------------------------------------
# The MkDocs hook


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, text in pages().items():
        files.append(File.generated(config, path, content=text))
    return files


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/docs_reference.py DIR")
    for rel, text in pages().items():
        out = Path(sys.argv[1]) / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(out)
