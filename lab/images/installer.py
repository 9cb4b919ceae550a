"""The ISO-installed images (alpine3, freebsd14, netbsd10, openbsd7): the installer ISO boots under
Packer's qemu builder, an answer file rendered from templates/answers/ drives the unattended install
(served over Packer's HTTP server), packer/scripts/provision-<os>.sh provisions the system over SSH."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import lab
from lab.images.hostkeys import MANIFEST_KEY, host_keys_from_report
from lab.images.keys import key_fingerprint
from lab.images.manifest import artifact_paths, load, manifest_path, nginx_entry, write_manifest
from lab.images.recipes import READY_MARKER, RECIPE_VERSION, SSH_USER, IsoRecipe
from lab.images.render import render_answers, render_upload
from lab.images.sources import IsoSource
from lab.images.steps import Stages, disk_facts, fresh_workdir, packer_build, tool_version
from lab.model import ImageRef


def _accelerator() -> str:
    """KVM when /dev/kvm is usable and LAB_PACKER_ACCEL is not "tcg", else TCG."""
    return "kvm" if os.access("/dev/kvm", os.R_OK | os.W_OK) and os.environ.get("LAB_PACKER_ACCEL") != "tcg" else "tcg"


def build_iso(
    r: IsoRecipe, work: Path, idir: Path, digest: str, say: Callable[[str], None], source: IsoSource
) -> ImageRef:
    """Install `r` from `source` in `work` (build/<name>/), provision it, install the disk and the
    manifest in `idir`; `digest` is the recipe digest the manifest records."""
    stage = Stages(say)
    key, pubkey = fresh_workdir(work, idir)

    stage("answers: render the installer's answer files and the upload stage")
    render_answers(r.name, work / "http", pubkey)
    render_upload(r.name, work / "stage")

    stage(f"packer: install from {'the local ISO' if source.local else 'the mirror'} and provision")
    out_dir = work / "packer-out"
    report = work / "lab-image.json"
    pvars = {
        "iso_url": source.url,
        "iso_checksum": source.checksum,
        "http_dir": work / "http",
        "stage_dir": work / "stage",
        "ssh_key": key,
        "report_out": report,
        "output_dir": out_dir,
        "console_log": work / "packer-console.log",
        "accelerator": _accelerator(),
        "disk_size": f"{r.disk_mib}M",
    }
    # The ISO cache survives rebuilds (build/<name> does not): a second build downloads nothing.
    guest = packer_build(
        r.name,
        lab.PACKER_DIR / r.packer_template,
        pvars,
        work,
        cache_dir=lab.BUILD_DIR / "packer-cache",
        timeout=4 * 3600,
    )

    stage("install: images/")
    paths = artifact_paths(r.name, idir)
    mpath = manifest_path(r.name, idir)
    mpath.unlink(missing_ok=True)
    os.replace(out_dir / f"{r.name}.qcow2", paths["disk"])
    f = r.facts
    manifest = {
        "name": r.name,
        "os": r.os,
        "release": r.release,
        "recipe_digest": digest,
        "recipe_version": RECIPE_VERSION,
        **disk_facts(paths["disk"]),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_seconds": stage.total(),
        "stage_seconds": stage.durations(),
        "kernel": guest.get("running_kernel", ""),
        "os_version": guest.get("os_version", ""),
        "tools": guest.get("tools", {}),
        "packages": guest.get("packages", {}),
        "boot": "disk",
        "serial": f.serial_device,
        "net": {"device": {m.value: d for m, d in f.nic_device.items()}, "config": "dhcp"},
        "ready_marker": READY_MARKER,
        "ssh_user": SSH_USER,
        "ssh_key_fingerprint": key_fingerprint(pubkey),
        # made by sshd's first start during provisioning, listed by its report (absent from reports of
        # provisioning scripts older than the field: then lab.images.known_hosts asks for a rebuild)
        **({MANIFEST_KEY: keys} if (keys := host_keys_from_report(guest.get("ssh_host_keys"))) else {}),
        "nginx": nginx_entry(r.nginx, guest),
        "iso": {"url": source.url, "checksum": source.checksum, "local": source.local},
        "paths": {k: p.relative_to(idir).as_posix() for k, p in paths.items()},
        "builder": {
            "packer": tool_version(["packer", "version"]),
            "qemu": tool_version(["qemu-system-x86_64", "--version"]),
        },
    }
    write_manifest(mpath, manifest)
    say(f"done in {manifest['build_seconds']:.0f} s: {paths['disk']}")
    return load(r.name, idir)
