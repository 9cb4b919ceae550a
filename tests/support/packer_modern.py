"""A modern Packer (1.12) and the three plugins the templates use, built from source into a cache on
this machine, for `make packer-modern` and the tests marked packer_modern (`make test-packer-modern`).

Debian ships Packer 1.6.6, with its builders built in; from 1.10 Packer has none, and `packer init`
installs plugins from GitHub releases. Both are built here with the Go toolchain instead:

- Packer from its module at an exact version (`go mod download github.com/hashicorp/packer@v1.12.0`,
  then `go build` in the module's own directory; a bare @latest or `go install ...@VERSION` asks the
  proxy for the version list);
- each plugin from its module the same way, or, where the module proxy does not serve it, from a
  git clone of its repository at $LAB_PACKER_MODERN/src/packer-plugin-NAME (the tag is checked out
  with `git archive`); built with the release's version (no "-dev" suffix) and installed with
  `packer plugins install --path`, so `packer init` finds them and needs no network.

The cache ($LAB_PACKER_MODERN, default ~/.cache/lab/packer-modern): bin/packer, plugins/ (give it to
Packer as PACKER_PLUGIN_PATH), src/ (the plugins' sources), build.json (the build times).
`python tests/support/packer_modern.py` builds what is missing and prints the figures; `--force` rebuilds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab import proc  # noqa: E402
from lab.errors import LabError  # noqa: E402

PACKER = ("github.com/hashicorp/packer", "v1.12.0")
# name -> (module, tag): the latest release of each when this was written; `packer init`'s
# constraints (packer/plugins.pkr.hcl) accept them
PLUGINS = {
    "qemu": ("github.com/hashicorp/packer-plugin-qemu", "v1.1.4"),
    "proxmox": ("github.com/hashicorp/packer-plugin-proxmox", "v1.2.4"),
    "vagrant": ("github.com/hashicorp/packer-plugin-vagrant", "v1.1.7"),
}
# Builds take a few minutes each on 2 cores; the first also downloads the modules.
BUILD_TIMEOUT = 3600


def cache_dir() -> Path:
    return Path(os.environ.get("LAB_PACKER_MODERN") or Path.home() / ".cache" / "lab" / "packer-modern")


def packer_bin(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "bin" / "packer"


def plugin_path(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "plugins"


def environment(cache: Path | None = None) -> dict[str, str]:
    """What puts the modern Packer first on PATH with its plugins (for lab images build and the tests)."""
    cache = cache or cache_dir()
    return {
        "PATH": f"{packer_bin(cache).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "PACKER_PLUGIN_PATH": str(plugin_path(cache)),
        "CHECKPOINT_DISABLE": "1",
    }


def _go_env(cache: Path) -> dict[str, str]:
    # GOTOOLCHAIN=local: the installed Go builds them all; never download another toolchain
    return {"GOTOOLCHAIN": "local", "GOFLAGS": "-buildvcs=false", "CGO_ENABLED": "0", "TMPDIR": str(cache / "tmp")}


def module_dir(module: str, version: str, cache: Path) -> Path | None:
    """The module's source from the Go module proxy (in the module cache), or None if it is not served."""
    res = proc.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        timeout=1800,
        check=False,
        env=_go_env(cache),
        what="go mod download",
    )
    try:
        info = json.loads(res.stdout)
    except json.JSONDecodeError:
        return None
    return Path(info["Dir"]) if res.ok and info.get("Dir") else None


def plugin_source(name: str, cache: Path) -> tuple[Path, str]:
    """The plugin's source tree at its release tag and where it came from."""
    module, tag = PLUGINS[name]
    found = module_dir(module, tag, cache)
    if found is not None:
        return found, "module proxy"
    repo = cache / "src" / f"packer-plugin-{name}"
    tree = cache / "src" / f"packer-plugin-{name}@{tag}"
    if tree.is_dir():
        return tree, f"{repo} at {tag}"
    if not repo.is_dir():
        raise LabError(
            f"the Go module proxy does not serve {module}@{tag}, and there is no clone at {repo}",
            hint=f"git clone https://{module} {repo}",
        )
    with tempfile.TemporaryDirectory(dir=cache / "tmp") as tmp:
        archive = Path(tmp) / "src.tar"
        proc.run(["git", "-C", repo, "archive", "--format=tar", "-o", archive, tag], timeout=300, what="git archive")
        staging = Path(tmp) / "tree"
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        staging.rename(tree)
    return tree, f"{repo} at {tag}"


def installed_version(binary: Path) -> str:
    """'1.12.0' from `packer version` ('Packer v1.12.0'), '' if it does not run."""
    if not binary.is_file():
        return ""
    res = proc.run([binary, "version"], timeout=60, check=False, env={"CHECKPOINT_DISABLE": "1"})
    m = re.match(r"Packer v(\S+)", res.stdout.strip())
    return m.group(1) if res.ok and m else ""


def installed_plugins(cache: Path) -> dict[str, str]:
    """name -> version of the plugins installed under plugins/ (the layout `packer plugins install` makes)."""
    found = {}
    for binary in plugin_path(cache).glob("github.com/hashicorp/*/packer-plugin-*_v*_x*"):
        if binary.name.endswith("_SHA256SUM"):
            continue
        m = re.match(r"packer-plugin-(\w+)_v([^_]+)_x", binary.name)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def build(force: bool = False, say=print) -> dict[str, float]:
    """Build what is missing (everything with force); return the seconds each build took."""
    cache = cache_dir()
    (cache / "bin").mkdir(parents=True, exist_ok=True)
    (cache / "tmp").mkdir(exist_ok=True)
    figures_file = cache / "build.json"
    figures: dict[str, float] = json.loads(figures_file.read_text()) if figures_file.is_file() else {}
    packer = packer_bin(cache)
    want = PACKER[1].removeprefix("v")
    if force or installed_version(packer) != want:
        say(f"packer {PACKER[1]}: go mod download, go build")
        t0 = time.monotonic()
        src = module_dir(*PACKER, cache)
        if src is None:
            raise LabError(f"the Go module proxy does not serve {PACKER[0]}@{PACKER[1]}")
        fetched = time.monotonic()
        proc.run(
            ["go", "build", "-trimpath", "-ldflags=-s -w", "-o", packer, "."],
            cwd=src,
            timeout=BUILD_TIMEOUT,
            env=_go_env(cache),
            what="go build packer",
        )
        figures["packer_download_s"] = round(fetched - t0, 1)
        figures["packer_build_s"] = round(time.monotonic() - fetched, 1)
        say(f"  packer {installed_version(packer)}: {figures['packer_build_s']:.0f} s to build")
    have = installed_plugins(cache)
    for name, (module, tag) in PLUGINS.items():
        if not force and have.get(name) == tag.removeprefix("v"):
            continue
        say(f"packer-plugin-{name} {tag}: source, go build, packer plugins install")
        t0 = time.monotonic()
        src, origin = plugin_source(name, cache)
        fetched = time.monotonic()
        binary = cache / "tmp" / f"packer-plugin-{name}"
        # the release's version: a tag's version.go may still say "dev" (releases set it by -X)
        proc.run(
            ["go", "build", "-trimpath", f"-ldflags=-s -w -X {module}/version.VersionPrerelease=", "-o", binary, "."],
            cwd=src,
            timeout=BUILD_TIMEOUT,
            env=_go_env(cache),
            what=f"go build packer-plugin-{name}",
        )
        built = time.monotonic()
        for old in plugin_path(cache).glob(f"github.com/hashicorp/{name}/packer-plugin-{name}_*"):
            old.unlink()
        proc.run(
            [packer, "plugins", "install", "--path", binary, f"github.com/hashicorp/{name}"],
            timeout=300,
            env={"PACKER_PLUGIN_PATH": str(plugin_path(cache)), "CHECKPOINT_DISABLE": "1"},
            what="packer plugins install",
        )
        binary.unlink()
        figures[f"{name}_download_s"] = round(fetched - t0, 1)
        figures[f"{name}_build_s"] = round(built - fetched, 1)
        say(f"  {name} {tag} (from {origin}): {figures[f'{name}_build_s']:.0f} s to build")
    figures_file.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="rebuild Packer and every plugin")
    args = ap.parse_args()
    if not shutil.which("go"):
        raise SystemExit("packer-modern: no `go` on PATH: install Go >= 1.25 (the plugins' go.mod asks for it)")
    try:
        figures = build(args.force)
    except LabError as exc:
        raise SystemExit(f"packer-modern: {exc}" + (f" ({exc.hint})" if exc.hint else "")) from None
    cache = cache_dir()
    print(f"packer {installed_version(packer_bin(cache))} in {packer_bin(cache)}")
    print(
        f"plugins in {plugin_path(cache)}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(installed_plugins(cache).items()))
    )
    print("build seconds (last build of each): " + ", ".join(f"{k} {v}" for k, v in sorted(figures.items())))
    print(f"use it: PATH={packer_bin(cache).parent}:$PATH PACKER_PLUGIN_PATH={plugin_path(cache)} lab images build ...")


if __name__ == "__main__":
    main()
