"""The debian12 pipeline, all from the Debian mirror this machine already uses (no ISO, no cloud image):

1. ``mmdebstrap`` bookworm into build/debian12/rootfs; packer/scripts/debian-rootfs-essential.sh copies
   templates/image/rootfs in before the kernel is installed (initramfs-tools config, lab units),
   packer/scripts/debian-rootfs-customize.sh enables/masks units and installs the lab SSH key.
2. kernel + initrd are copied out of the rootfs (for direct kernel boot).
3. ``mkfs.ext4 -L labroot -d rootfs`` into a file of the root partition's size; ``sfdisk`` writes the
   GPT (BIOS boot, EFI system partition, root) on the disk image and ``dd`` puts the filesystem at its
   offset; ``qemu-img convert``.
4. The rendered nginx.conf and site are staged.
5. Packer's qemu builder boots it under TCG, runs packer/scripts/provision-debian.sh (GRUB for BIOS
   and UEFI, nginx, certificate, site, container checks, version report) and writes the final qcow2.

The base container image (mmdebstrap to a tarball) is made first: the rootfs's customize hook
imports it into podman's store at the host's native speed (in the TCG build VM: ~110 s).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lab
from lab import proc
from lab.errors import LabError
from lab.images.digest import file_sha256
from lab.images.hostkeys import MANIFEST_KEY, host_keys_from_report, read_host_keys
from lab.images.keys import key_fingerprint
from lab.images.manifest import artifact_paths, load, manifest_path, nginx_entry, up_to_date, write_manifest
from lab.images.recipes import (
    BOOT_MODES,
    CONTAINER_TARBALL,
    READY_MARKER,
    RECIPE_VERSION,
    ROOT_LABEL,
    SSH_USER,
    Recipe,
    recipe,
)
from lab.images.render import render_stage
from lab.images.sources import debian_mirrors
from lab.images.steps import Stages, disk_facts, fresh_workdir, packer_build, run_logged, tool_version
from lab.model import ImageRef


def build_debian(r: Recipe, name: str, work: Path, idir: Path, digest: str, say: Callable[[str], None]) -> ImageRef:
    """Run the pipeline above in `work` (build/<name>/), install the artifacts and the manifest in
    `idir`; `digest` is the recipe digest the manifest records."""
    stage = Stages(say)
    key, pubkey = fresh_workdir(work, idir)
    rootfs = work / "rootfs"
    mirrors = debian_mirrors(r.suite)

    container_env = {}
    if r.container is not None:
        stage("container: mmdebstrap the base container image")
        (work / "stage").mkdir(parents=True, exist_ok=True)
        tarball = work / "stage" / CONTAINER_TARBALL
        build_container_base(r, tarball, mirrors, work / "container.log")
        container_env = {"LAB_CONTAINER_TARBALL": str(tarball), "LAB_CONTAINER_IMAGE": r.container.name}

    stage("rootfs: mmdebstrap" + (" (and podman import of the base container)" if container_env else ""))
    argv = [
        "mmdebstrap",
        "--mode=root",
        f"--variant={r.variant}",
        "--format=directory",
        f"--include={','.join(r.packages)}",
        '--aptopt=Acquire::Retries "3"',
        *[f"--dpkgopt=path-exclude={p}" for p in r.dpkg_excludes],
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        f"--essential-hook={lab.PACKER_DIR / 'scripts/debian-rootfs-essential.sh'}",
        f"--customize-hook={lab.PACKER_DIR / 'scripts/debian-rootfs-customize.sh'}",
        r.suite,
        str(rootfs),
        *mirrors,
    ]
    env = {
        "LAB_OVERLAY": str(lab.TEMPLATES_DIR / "image" / "rootfs"),
        "LAB_MASKS": str(lab.TEMPLATES_DIR / "image" / "masked-units"),
        "LAB_GENERATOR_MASKS": str(lab.TEMPLATES_DIR / "image" / "masked-generators"),
        "LAB_PUBKEY": pubkey,
        "LAB_HOSTNAME": r.hostname,
        "DEBIAN_FRONTEND": "noninteractive",
        **container_env,
    }
    run_logged(argv, work / "mmdebstrap.log", timeout=1800, what="mmdebstrap", env=env)
    host_keys = read_host_keys(rootfs / "etc" / "ssh")  # made by openssh-server's postinst; clones keep them

    stage("kernel: copy vmlinuz and initrd out of the rootfs")
    kernels = sorted((rootfs / "boot").glob("vmlinuz-*"))
    if len(kernels) != 1:
        raise LabError(f"expected one kernel in the rootfs, found {[k.name for k in kernels]}")
    kver = kernels[0].name.removeprefix("vmlinuz-")
    initrd = rootfs / "boot" / f"initrd.img-{kver}"
    if not initrd.is_file():
        raise LabError(f"the rootfs has no initrd for kernel {kver}")
    shutil.copyfile(kernels[0], work / "vmlinuz")
    shutil.copyfile(initrd, work / "initrd.img")

    stage("filesystem: mkfs.ext4 -d")
    parts = r.partitions()
    root_part = parts[-1]
    root_raw = work / "root.raw"
    proc.run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            ROOT_LABEL,
            "-d",
            rootfs,
            "-m",
            "1",
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0",
            root_raw,
            f"{root_part['size_mib']}M",
        ],
        timeout=600,
        what="mkfs.ext4",
    )
    shutil.rmtree(rootfs)

    stage("disk: GPT (sfdisk) and the root filesystem at its offset")
    raw = work / "disk.raw"
    make_disk(raw, r.disk_mib, parts, root_raw)
    root_raw.unlink()

    stage("qcow2: qemu-img convert")
    base = work / "base.qcow2"
    proc.run(["qemu-img", "convert", "-O", "qcow2", raw, base], timeout=600, what="qemu-img convert")
    raw.unlink()

    stage("stage: render nginx.conf and the site")
    render_stage(name, work / "stage")

    stage("packer: boot under TCG and provision")
    out_dir = work / "packer-out"
    report = work / "lab-image.json"
    # The build boot: direct kernel boot with slirp's address given explicitly (the image's own
    # fallback is DHCP); GRUB gets the base command line.
    pvars = {
        "disk_in": base,
        "disk_checksum": f"sha256:{file_sha256(base)}",  # else Packer warns of a disk it cannot check
        "output_dir": out_dir,
        "kernel": work / "vmlinuz",
        "initrd": work / "initrd.img",
        "cmdline": f"{r.cmdline} lab.ip=10.0.2.15/24 lab.gw=10.0.2.2",
        "boot_cmdline": r.cmdline,
        "root_label": ROOT_LABEL,
        "ssh_key": key,
        "stage_dir": work / "stage",
        "report_out": report,
        "console_log": work / "packer-console.log",
        "disk_size": f"{r.disk_mib}M",
        # the Vagrant box the same build makes (lab.backends.vagrant.box) names its build
        "recipe_digest": digest,
        "box_dir": idir,
    }
    guest = packer_build(
        name, lab.PACKER_DIR / r.packer_template, pvars, work, cache_dir=work / "packer-cache", timeout=1800
    )
    if guest.get("running_kernel") != kver:
        raise LabError(f"the guest ran kernel {guest.get('running_kernel')!r}, expected {kver!r}")
    reported = host_keys_from_report(guest.get("ssh_host_keys"))
    if reported is not None and reported != host_keys:
        raise LabError(
            "the guest's SSH host keys changed during provisioning",
            hint="something in packer/scripts/provision-debian.sh or the image regenerates them",
        )

    stage("install: images/")
    paths = artifact_paths(name, idir)
    mpath = manifest_path(name, idir)
    mpath.unlink(missing_ok=True)  # no manifest describes half-replaced artifacts
    paths["kernel"].parent.mkdir(parents=True, exist_ok=True)
    os.replace(out_dir / "debian12.qcow2", paths["disk"])
    shutil.copyfile(work / "vmlinuz", paths["kernel"])
    shutil.copyfile(work / "initrd.img", paths["initrd"])
    base.unlink()  # 700 MB; the logs stay in build/<name>/ for the curious

    manifest = {
        "name": name,
        "os": r.os,
        "release": r.release,
        "suite": r.suite,
        "recipe_digest": digest,
        "recipe_version": RECIPE_VERSION,
        **disk_facts(paths["disk"]),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_seconds": stage.total(),
        "stage_seconds": stage.durations(),
        "kernel": kver,
        "kernels": guest.get("kernels", []),
        "debian_version": guest.get("debian_version", ""),
        "tools": guest.get("tools", {}),
        "packages": guest.get("packages", {}),
        "dpkg_packages": guest.get("dpkg_packages"),
        "root_label": ROOT_LABEL,
        "cmdline": r.cmdline,
        "boot": list(BOOT_MODES),
        "partitions": parts,
        "guest_agent": True,
        "net": {
            "device": "eth0",
            "kernel_args": "lab.ip=ADDR/PREFIX lab.gw=ADDR",
            "cidata": "NoCloud drive labelled cidata: network-config v1/v2, user-data ssh_authorized_keys",
            "fallback": "dhcp",
        },
        "ready_marker": READY_MARKER,
        "ssh_user": SSH_USER,
        "ssh_key_fingerprint": key_fingerprint(pubkey),
        MANIFEST_KEY: host_keys,
        "nginx": nginx_entry(r.nginx, guest),
        "container": (
            {
                "name": r.container.name,
                "tarball_bytes": (work / "stage" / CONTAINER_TARBALL).stat().st_size,
                **guest.get("container", {}),
            }
            if r.container is not None
            else None
        ),
        "initrd_modules": _initrd_modules(),
        "paths": {k: p.relative_to(idir).as_posix() for k, p in paths.items()},
        "mirrors": mirrors,
        "builder": {
            "mmdebstrap": tool_version(["mmdebstrap", "--version"]),
            "packer": tool_version(["packer", "version"]),
            "qemu": tool_version(["qemu-system-x86_64", "--version"]),
            "e2fsprogs": tool_version(["mkfs.ext4", "-V"]),
        },
    }
    write_manifest(mpath, manifest)
    say(f"done in {manifest['build_seconds']:.0f} s: {paths['disk']}")
    return load(name, idir)


def make_disk(raw: Path, disk_mib: int, parts: list[dict[str, Any]], root_fs: Path) -> None:
    """A raw GPT disk image of `disk_mib` MiB with `parts` (Recipe.partitions) and the filesystem
    image `root_fs` copied into the last partition. No loop device: sfdisk works on the file, dd
    writes the filesystem at its offset (sparse: holes stay holes)."""
    with open(raw, "wb") as f:
        f.truncate(disk_mib * 2**20)
    script = "label: gpt\nunit: sectors\n" + "".join(
        f"start={p['start_mib'] * 2048}, size={p['size_mib'] * 2048}, type={p['type']}, name={p['name']}\n"
        for p in parts
    )
    proc.run(["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", raw], input=script, timeout=60, what="sfdisk")
    root = parts[-1]
    if root_fs.stat().st_size != root["size_mib"] * 2**20:
        raise LabError(f"{root_fs} is {root_fs.stat().st_size} bytes, the partition {root['size_mib']} MiB")
    proc.run(
        [
            "dd",
            f"if={root_fs}",
            f"of={raw}",
            "bs=1M",
            f"seek={root['start_mib']}",
            "conv=notrunc,sparse",
            "status=none",
        ],
        timeout=600,
        what="dd root filesystem into the disk image",
    )


def _initrd_modules() -> list[str]:
    """The modules the initrd loads (templates/image/.../modules.d/lab), as the manifest records them."""
    path = lab.TEMPLATES_DIR / "image" / "rootfs" / "usr" / "share" / "initramfs-tools" / "modules.d" / "lab"
    return [w for line in path.read_text().splitlines() for w in line.split("#", 1)[0].split()]


def container_base_argv(r: Recipe, out: Path, mirrors: list[str]) -> list[str]:
    """Pure: the mmdebstrap command line that makes the recipe's base container tarball."""
    c = r.container
    if c is None:
        raise LabError(f"image {r.name!r} has no base container image in its recipe")
    cache = c.cache_dir
    # The hook runs on the host with the chroot's apt configuration: --download-only puts the .debs
    # (with their dependencies that are not installed yet) where the Containerfile expects them.
    hook = (
        f'mkdir -p "$1{cache}" && APT_CONFIG="$MMDEBSTRAP_APT_CONFIG" apt-get install --download-only '
        f'-y -q -o Dir::Cache::archives="$1{cache}/" {" ".join(c.cache)} '
        f'&& rm -rf "$1{cache}/partial" "$1{cache}/lock"'
    )
    return [
        "mmdebstrap",
        "--mode=root",
        f"--variant={c.variant}",
        "--format=tar",
        f"--include={','.join(c.packages)}",
        '--aptopt=Acquire::Retries "3"',
        *[f"--dpkgopt=path-exclude={p}" for p in r.dpkg_excludes],
        f"--customize-hook={hook}",
        r.suite,
        str(out),
        *mirrors,
    ]


def build_container_base(r: Recipe, out: Path, mirrors: list[str], log: Path) -> None:
    """The base container image as a zstd tarball (mmdebstrap compresses by the file name)."""
    run_logged(
        container_base_argv(r, out, mirrors),
        log,
        timeout=1200,
        what="mmdebstrap (container)",
        env={"DEBIAN_FRONTEND": "noninteractive"},
    )
    if not out.is_file() or out.stat().st_size == 0:
        raise LabError(f"mmdebstrap made no {out}", hint=f"see {log}")


def stage_container_base(name: str, stage: Path, log: Path) -> Path:
    """The base container tarball in `stage` for a hand-run Packer build (`lab images render`): the
    one the last local build made when that build is of the current recipe, else a new one."""
    r = recipe(name)
    if not isinstance(r, Recipe):
        raise LabError(f"image {name!r} is installed from an ISO: it has no Debian base container to stage")
    dest = stage / CONTAINER_TARBALL
    built = lab.BUILD_DIR / name / "stage" / CONTAINER_TARBALL
    ref = up_to_date(name)
    stage.mkdir(parents=True, exist_ok=True)
    if (
        ref is not None
        and built.is_file()
        and built.stat().st_size == ref.manifest.get("container", {}).get("tarball_bytes")
    ):
        shutil.copyfile(built, dest)
    else:
        if os.geteuid() != 0:
            raise LabError(
                "making the base container image needs root (mmdebstrap --mode=root)",
                hint=f"run as root, or `{lab.BUILD_IMAGE}` first and render again",
            )
        build_container_base(r, dest, debian_mirrors(r.suite), log)
    return dest
