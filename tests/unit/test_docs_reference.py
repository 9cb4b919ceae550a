"""The docs' reference covers the code (issue 37): every lab.toml key, workload parameter, CLI command
and option has a meaning written beside its code (tools/docs_reference.py makes the reference
from them at build time), and the generated pages name each one. The checker itself is tested on
models, commands and workloads with one meaning missing: removing a description fails the test."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from typing import ClassVar, Literal

import click
from pydantic import BaseModel, Field, create_model

from lab import axes, workloads
from lab.labconfig import LabSection
from lab.model import RawOutput, Sample

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "tools" / "docs_reference.py")
assert _spec and _spec.loader
ref = importlib.util.module_from_spec(_spec)
sys.modules["docs_reference"] = ref  # dataclasses look their module up while the class is made
_spec.loader.exec_module(ref)


def all_entries() -> list:
    return ref.config_entries() + ref.workload_entries() + ref.command_entries()


def test_every_key_parameter_command_and_option_has_a_meaning():
    entries = all_entries()
    assert not ref.undocumented(entries), "undocumented:\n" + "\n".join(ref.undocumented(entries))
    # what the reference stands on is there at all: the sections, every backend, every workload
    wheres = {e.where for e in entries}
    for where in ("[lab]", "[matrix]", "[suite]", "[isolation]", "[wan.NAME]", "[hosts.NAME]", "lab", "lab run"):
        assert where in wheres
    for backend in ("local", "libvirt", "proxmox", "smartos", "vagrant"):
        assert f'[hosts.NAME] backend = "{backend}"' in wheres
    for name in workloads.names():
        assert any(e.where == f"[suite.params.{name}]" for e in entries) or not workloads.get(name).traits.params


def sections(page: str) -> dict[str, str]:
    """A generated page's `## heading` -> its text."""
    parts = re.split(r"^## (.+)$", page, flags=re.M)
    return {parts[i].strip("`"): parts[i + 1] for i in range(1, len(parts), 2)}


def test_the_pages_name_every_entry_under_its_section():
    pages = ref.pages()
    toml = sections(pages["reference/lab-toml.md"])
    for e in ref.config_entries():
        assert f"| `{e.name}` |" in toml[e.where], (e.where, e.name)
    params = sections(pages["reference/workloads.md"])
    for e in ref.workload_entries():
        assert f"| `{e.name}` |" in params[e.where.removeprefix("[suite.params.").removesuffix("]")], e
    cli = sections(pages["reference/cli.md"])
    for e in ref.command_entries():
        assert e.where in cli and (not e.name or f"| `{ref.cell(e.name)}` |" in cli[e.where]), e
    # a key's type and default are shown as lab.toml reads them
    assert "| `repetitions` | integer (≥ 1, ≤ 1000) | `3` |" in toml["[suite]"]
    assert '| `nic` | list of "virtio" or "e1000"' in toml["[matrix]"]
    assert "| `clone` | number (> 0, ≤ 86400) | `600.0` |" in toml['[hosts.NAME] backend = "proxmox" timeouts = {…}']


def test_a_model_key_without_description_is_reported():
    class Section(BaseModel):
        told: int = Field(default=1, description="a key with its meaning")
        untold: int = 2

    assert ref.undocumented(list(ref.model_entries(Section, "[t]"))) == ["[t] untold"]
    # a real section with one description removed, as a careless edit would leave it
    stripped = create_model("Stripped", __base__=LabSection, results_mode=(str, "0700"))
    assert ref.undocumented(list(ref.model_entries(stripped, "[lab]"))) == ["[lab] results_mode"]


def test_an_axis_without_meaning_is_reported(monkeypatch):
    table = tuple(dataclasses.replace(a, meaning="") if a.name == "wan" else a for a in axes.AXES_TABLE)
    monkeypatch.setattr(axes, "AXES_TABLE", table)
    assert ref.undocumented(ref.config_entries()) == ["[matrix] wan"]


def test_a_command_or_option_without_help_is_reported():
    @click.group()
    def top():
        """The group."""

    @top.command("go")
    @click.option("--fast", is_flag=True, help="quickly")
    @click.option("--slow", is_flag=True)
    @click.argument("thing")
    def go(fast, slow, thing):
        """Go somewhere."""

    @top.command("mute")
    def mute():
        pass

    assert ref.undocumented(ref.command_entries(top)) == ["lab go --slow", "lab mute"]


def test_a_workload_parameter_without_meaning_is_reported():
    class Quiet(workloads.Workload):
        name: ClassVar[str] = "docs-quiet"
        traits: ClassVar[workloads.Traits] = workloads.Traits(
            summary="a workload of the test's",
            params=(workloads.Param("time", 5, "seconds"), workloads.Param("mode", "a", "")),
            primary_metrics=workloads.PrimaryMetrics(("x",)),
        )

        def params(self, ctx):
            return dict(self.defaults)

        def prepare(self, ctx):
            pass

        def run(self, ctx, repetition):
            return RawOutput(stdout="", stderr="", params={})

        def parse(self, raw: RawOutput) -> list[Sample]:
            return []

    workloads.register(Quiet())
    try:
        assert ref.undocumented(ref.workload_entries()) == ["[suite.params.docs-quiet] mode"]
    finally:
        workloads.unregister("docs-quiet")


def test_type_text_reads_as_lab_toml():

    assert ref.type_text(Literal["a", "b"]) == '"a" or "b"'
    assert ref.type_text(int | None) == "integer (or unset)"
    assert ref.type_text(list[str]) == "list of string"
    assert ref.type_text(dict[str, float]) == "table of string to number"
