"""The Packer that builds the images, and its plugins. Debian's Packer 1.6.6 has its builders built in.
A modern Packer (1.7 and later read `packer { required_plugins }`; from 1.10 no builder is built in)
takes them from plugins: packer/plugins.pkr.hcl declares them (qemu, proxmox, vagrant) and `packer
init` installs them from their releases. The build templates declare none (1.6.6 cannot parse the
block), and a modern Packer loads every installed plugin whichever template it builds; it needs all
three even for `-only=qemu.NAME` (an uninstalled source type fails the whole template)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import lab
from lab import proc
from lab.errors import LabError, UsageError

PLUGINS_FILE = "plugins.pkr.hcl"
REQUIRED_PLUGINS_SINCE = (1, 7)  # `packer init` and the required_plugins block
PLUGINS_COMMAND_SINCE = (1, 8)  # `packer plugins installed`
ENV = {"CHECKPOINT_DISABLE": "1"}  # no call home to ask for a newer version

Version = tuple[int, int, int]


def parse_version(text: str) -> Version | None:
    """(1, 12, 0) from `packer version`'s output ('Packer v1.12.0', perhaps more lines); None if absent."""
    m = re.search(r"\bPacker v(\d+)\.(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def version() -> Version:
    """The version of the `packer` on PATH (LabError if it is not installed or says none)."""
    out = proc.run(["packer", "version"], timeout=60, env=ENV, what="packer version").stdout
    found = parse_version(out)
    if found is None:
        raise LabError(f"cannot tell Packer's version from `packer version`: {out.strip()[:80]!r}")
    return found


def required_plugins(hcl: str) -> list[str]:
    """The plugin sources a `required_plugins` block declares (github.com/hashicorp/qemu, ...), in order."""
    return re.findall(r'^\s*source\s*=\s*"([^"]+)"', hcl, flags=re.MULTILINE)


def installed_plugins(listing: str) -> set[str]:
    """The plugin sources `packer plugins installed` lists: one binary path a line, in the layout
    .../github.com/hashicorp/qemu/packer-plugin-qemu_v1.1.4_x5.0_linux_amd64."""
    found = set()
    for line in listing.splitlines():
        path = Path(line.strip())
        m = re.match(r"packer-plugin-([\w-]+?)_v", path.name)
        if m and len(path.parts) >= 4 and path.parent.name == m.group(1):
            found.add("/".join(path.parts[-4:-1]))
    return found


def init_failure(output: str) -> str:
    """Why `packer init` could not install a plugin, in a few words, from its output: 'api.github.com:
    dial tcp ...: connection refused' from '* Get "https://api.github.com/...": dial tcp ...'."""
    m = re.search(r'^\s*\* \w+ "https?://([^/"]+)[^"]*": (.+)$', output, flags=re.MULTILINE)
    if m:
        return f"{m.group(1)}: {m.group(2).strip()}"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[0] if lines else "no output"


def _dotted(v: Version) -> str:
    return ".".join(map(str, v))


def missing_plugins(v: Version) -> list[str]:
    """The plugins of plugins.pkr.hcl that Packer `v` lacks (all of them on 1.7, which cannot list
    them; none before 1.7, which has its builders built in)."""
    if v < REQUIRED_PLUGINS_SINCE:
        return []
    need = required_plugins((lab.PACKER_DIR / PLUGINS_FILE).read_text())
    if v < PLUGINS_COMMAND_SINCE:
        return need
    listing = proc.run(["packer", "plugins", "installed"], timeout=60, env=ENV, what="packer plugins installed")
    return [s for s in need if s not in installed_plugins(listing.stdout)]


def plugins_state() -> str:
    """One line for `lab doctor`: the Packer's version and its plugins."""
    v = version()
    if v < REQUIRED_PLUGINS_SINCE:
        return f"Packer {_dotted(v)}: builders built in"
    missing = missing_plugins(v)
    if not missing:
        return f"Packer {_dotted(v)}: the plugins of {PLUGINS_FILE} are installed"
    return f"Packer {_dotted(v)} lacks {', '.join(missing)}: `lab images build` runs `packer init`"


def ensure_plugins(say: Callable[[str], None]) -> Version:
    """Make sure the Packer on PATH can build the templates; return its version. A modern Packer
    missing a plugin of plugins.pkr.hcl gets `packer init`; where that cannot install it (no
    network), one UsageError says how to install it by hand. Nothing else is created."""
    v = version()
    missing = missing_plugins(v)
    if not missing:
        return v
    plugins_file = lab.PACKER_DIR / PLUGINS_FILE
    say(f"packer init {plugins_file}: Packer {_dotted(v)} needs the plugins {', '.join(missing)}")
    res = proc.run(["packer", "init", plugins_file], timeout=900, env=ENV, check=False, what="packer init")
    if res.ok:
        return v
    names = [s.rsplit("/", 1)[-1] for s in missing]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    raise UsageError(
        f"Packer {_dotted(v)} lacks the {listed} plugin{'s' if len(names) > 1 else ''} of {plugins_file} "
        f"and `packer init` could not install {'them' if len(names) > 1 else 'it'} "
        f"({init_failure(res.stderr + res.stdout)[:200]})",
        hint=f"install {'each' if len(names) > 1 else 'it'} from a plugin binary: "
        f"`packer plugins install --path BINARY {missing[0]}`"
        + (" (make packer-modern builds them from source)" if lab.IN_CHECKOUT else ""),
    )
