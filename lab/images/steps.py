"""What both build pipelines share: a clean work directory, timed stages, logged commands, the Packer
build and what the manifest records about the disk and the builder's tools."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lab import proc
from lab.errors import CommandError, LabError
from lab.images.digest import file_sha256
from lab.images.keys import ensure_key


def tool_version(argv: list[str]) -> str:
    """The first line a tool prints about its version, for the manifest ("" if it does not run)."""
    try:
        res = proc.run(argv, timeout=30, check=False)
    except LabError:
        return ""
    lines = (res.stdout or res.stderr).strip().splitlines()
    return lines[0] if lines else ""


def run_logged(
    argv: Sequence[proc.Arg],
    log: Path,
    *,
    timeout: float,
    what: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> proc.Result:
    """proc.run, keeping the full output in `log` (also on failure)."""
    try:
        res = proc.run(argv, timeout=timeout, env=env, cwd=cwd, what=what)
    except CommandError as exc:
        log.write_text(f"$ {' '.join(exc.argv)}\n--- stdout\n{exc.stdout}\n--- stderr\n{exc.stderr}\n")
        exc.hint = f"full output in {log}"
        raise
    log.write_text(f"$ {' '.join(res.argv)}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}\n")
    return res


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    points = [line.split()[1].replace("\\040", " ") for line in lines if len(line.split()) > 1]
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)


def _clean_workdir(work: Path) -> None:
    """Remove a previous build's directory. A killed mmdebstrap can leave /proc, /sys or /dev
    mounted in its rootfs: unmount those first, never delete through a bind mount."""
    if not work.exists():
        return
    for point in _mounts_under(work):
        proc.run(["umount", "-R", point], timeout=60, check=False, what="umount")
    left = _mounts_under(work)
    if left:
        raise LabError(
            f"{work} still has mounts: {', '.join(left)}", hint=f"unmount them (umount -R) and delete {work} by hand"
        )
    shutil.rmtree(work)


class Stages:
    """A build's stages: each announced to `say` as it starts, timed for the manifest."""

    def __init__(self, say: Callable[[str], None]):
        self.t0 = time.monotonic()
        self.starts: dict[str, float] = {}
        self.say = say

    def __call__(self, label: str) -> None:
        self.starts[label] = time.monotonic()
        self.say(label)

    def total(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def durations(self) -> dict[str, float]:
        return _stage_durations(self.starts, time.monotonic())


def fresh_workdir(work: Path, idir: Path) -> tuple[Path, str]:
    """An empty build/<name>/ and the lab key (private key path, public key line)."""
    _clean_workdir(work)
    work.mkdir(parents=True)
    key = ensure_key(idir)
    return key, key.with_suffix(".pub").read_text().strip()


def _stage_durations(starts: dict[str, float], end: float) -> dict[str, float]:
    items = list(starts.items())
    out = {}
    for i, (label, t) in enumerate(items):
        nxt = items[i + 1][1] if i + 1 < len(items) else end
        out[label.split(":", 1)[0]] = round(nxt - t, 1)
    return out


def packer_build(
    name: str, template: Path, pvars: dict[str, Any], work: Path, *, cache_dir: Path, timeout: float
) -> dict[str, Any]:
    """`packer build` of the template's qemu source only (a template's proxmox-iso source builds on
    a PVE node, by hand), logged to work/packer.log; returns the guest's version report, the JSON
    file provisioning downloads to pvars["report_out"]."""
    argv: list[proc.Arg] = [
        "packer",
        "build",
        "-color=false",
        "-on-error=cleanup",
        f"-only=qemu.{name}",
        *[a for k, v in pvars.items() for a in ("-var", f"{k}={v}")],
        template,
    ]
    env = {"CHECKPOINT_DISABLE": "1", "PACKER_CACHE_DIR": str(cache_dir), "PACKER_NO_COLOR": "1"}
    run_logged(argv, work / "packer.log", timeout=timeout, what="packer build", env=env, cwd=work)
    report = Path(pvars["report_out"])
    try:
        return json.loads(report.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LabError(
            f"the guest's version report {report} is unusable: {exc}", hint=f"see {work / 'packer.log'}"
        ) from None


def disk_facts(disk: Path) -> dict[str, Any]:
    """The manifest's record of the built disk: sha256, size, virtual size, format."""
    info = json.loads(proc.run(["qemu-img", "info", "--output=json", disk], timeout=60, what="qemu-img info").stdout)
    return {
        "sha256": file_sha256(disk),
        "size": disk.stat().st_size,
        "virtual_size": info["virtual-size"],
        "format": info.get("format", "qcow2"),
    }
