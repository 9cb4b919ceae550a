"""packer/plugins.pkr.hcl: the one place the templates' plugins are declared for a modern Packer
(`packer init packer/plugins.pkr.hcl`). Debian's Packer 1.6.6, which builds the images here, cannot
parse that file at all, so `make lint` only formats it; this test parses it as HCL (python-hcl2)
and holds it to what the build templates beside it use: every builder and post-processor that is a
plugin, and nothing else in the file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import hcl2
import pytest

import lab

PLUGINS = Path(lab.PACKER_DIR) / "plugins.pkr.hcl"
TEMPLATES = sorted(p for p in Path(lab.PACKER_DIR).glob("*.pkr.hcl") if p != PLUGINS)

# Packer core's own components (no plugin to declare); any other type is a plugin's.
BUILT_IN = {"file", "shell", "shell-local", "breakpoint", "null", "file-local", "manifest", "checksum"}
# A component type -> the plugin that brings it (github.com/hashicorp/<plugin>)
PLUGIN_OF = {"qemu": "qemu", "proxmox-iso": "proxmox", "proxmox-clone": "proxmox", "vagrant": "vagrant"}


def _load(path: Path) -> dict[str, Any]:
    with path.open() as f:
        return hcl2.load(f)


def _unquote(s: str) -> str:
    """python-hcl2 keeps labels and string values quoted: '"qemu"' -> 'qemu'."""
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] == '"' else s


def _keys(block: dict[str, Any]) -> set[str]:
    """A block's own keys, without python-hcl2's bookkeeping (__comments__, __is_block__)."""
    return {k for k in block if not k.startswith("__")}


def _used(template: dict[str, Any]) -> set[str]:
    """The builder and post-processor types a template uses."""
    types = {_unquote(t) for src in template.get("source", []) for t in _keys(src)}
    for build in template.get("build", []):
        for pp in build.get("post-processor", []):
            types |= {_unquote(t) for t in _keys(pp)}
        for group in build.get("post-processors", []):
            for pp in group.get("post-processor", []):
                types |= {_unquote(t) for t in _keys(pp)}
    return types


def declared() -> dict[str, dict[str, str]]:
    doc = _load(PLUGINS)
    assert _keys(doc) == {"packer"}, f"{PLUGINS.name} holds only the packer block, not {_keys(doc) - {'packer'}}"
    (packer,) = doc["packer"]
    assert _keys(packer) == {"required_plugins"}, f"the packer block holds only required_plugins: {_keys(packer)}"
    (required,) = packer["required_plugins"]
    return {name: {k: _unquote(v) for k, v in required[name].items()} for name in _keys(required)}


def test_the_plugins_file_declares_exactly_the_plugins_the_templates_use():
    used = set().union(*(_used(_load(t)) for t in TEMPLATES))
    unknown = used - BUILT_IN - set(PLUGIN_OF)
    assert not unknown, f"component types this test does not know (add them to PLUGIN_OF or BUILT_IN): {unknown}"
    needed = {PLUGIN_OF[t] for t in used if t in PLUGIN_OF}
    assert needed == {"qemu", "proxmox", "vagrant"}  # what the templates here are known to use
    assert set(declared()) == needed


@pytest.mark.parametrize("name", ["qemu", "proxmox", "vagrant"])
def test_each_plugin_names_its_source_and_a_minimum_version(name):
    plugin = declared()[name]
    assert set(plugin) == {"source", "version"}
    assert plugin["source"] == f"github.com/hashicorp/{name}"
    assert re.fullmatch(r">= \d+\.\d+\.\d+", plugin["version"]), plugin["version"]


def test_every_template_is_one_the_parser_reads_with_its_sources():
    # the other half of the check above: a template the parser read as empty would use "nothing"
    for t in TEMPLATES:
        used = _used(_load(t))
        assert "qemu" in used, f"{t.name}: no qemu source found"
        assert "proxmox-iso" in used, f"{t.name}: no proxmox-iso source found"
