"""Golden images: build them (Debian offline from packages; the other OSes from their installer ISOs),
describe them in a manifest (images/<name>.json), load them as ImageRef and publish them.

The debian12 pipeline, all from the Debian mirror this machine already uses (no ISO, no cloud image):

1. ``mmdebstrap`` bookworm into build/debian12/rootfs; packer/scripts/debian-rootfs-essential.sh copies
   templates/image/rootfs in before the kernel is installed (initramfs-tools config, lab units),
   packer/scripts/debian-rootfs-customize.sh enables/masks units and installs the lab SSH key.
2. kernel + initrd are copied out of the rootfs (the guest boots by direct kernel boot).
3. ``mkfs.ext4 -L labroot -d rootfs`` (a bare filesystem, no partition table) -> ``qemu-img convert``.
4. Packer's qemu builder boots it under TCG, runs packer/scripts/provision-debian.sh (nginx config,
   certificate, static site, version report) and writes the final qcow2.

The other OSes (alpine3, freebsd14, netbsd10, openbsd7) are IsoRecipes: their installer ISO boots under
Packer's qemu builder, an answer file rendered from templates/answers/ drives the unattended install
(served over Packer's HTTP server), packer/scripts/provision-<os>.sh provisions the system over SSH.
The ISO is never downloaded by lab itself: Packer fetches it (and verifies its checksum) when the
machine can reach the mirror; otherwise a copy in images/iso/ or ``--iso PATH`` is used, and without
one the build stops at once with one line (exit status 2).

A recipe digest (sha256 over every input) makes ``build`` idempotent: same digest + artifacts present
= nothing to do. The guest contract (command line, readiness marker, key) is in images/README.md.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import random
import shlex
import shutil
import struct
import sys
import time
import tomllib
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

import lab
from lab import osfacts, proc
from lab.errors import CommandError, LabError, UsageError
from lab.model import ImageRef, NicModel

Progress = Callable[[str], None] | None

# Bump when the build logic changes in a way the inputs below do not show.
RECIPE_VERSION = 2  # 2: partitioned disk (GPT: BIOS boot, ESP, root), GRUB for BIOS and UEFI

ROOT_LABEL = "labroot"
# How the debian12 image boots: direct kernel boot (local backend, libvirt QEMU), and from its disk
# by firmware, SeaBIOS ("bios": PVE's default) or UEFI ("uefi": OVMF, bhyve's BHYVE_UEFI.fd).
BOOT_MODES = ("kernel", "bios", "uefi")
READY_MARKER = "LAB-READY"
SSH_USER = "root"
KEY_NAME = "lab_key"


@dataclass(frozen=True)
class Recipe:
    """Everything that decides what goes into an image, besides the input files."""

    name: str
    os: str
    release: str
    suite: str
    variant: str
    packages: tuple[str, ...]
    dpkg_excludes: tuple[str, ...]
    cmdline: str
    disk_mib: int
    hostname: str
    packer_template: str  # relative to PACKER_DIR
    scripts: tuple[str, ...]  # relative to PACKER_DIR
    template_paths: tuple[str, ...]  # relative to TEMPLATES_DIR (files or directories)
    nginx: dict[str, Any]
    # GPT layout (MiB): partition 1 BIOS boot, 2 EFI system partition, 3 root up to 1 MiB before the end
    bios_boot_mib: int = 1
    esp_mib: int = 64
    # The proxmox-iso source installs from the netinst ISO with this preseed (packer/debian12.pkr.hcl).
    answers: tuple[tuple[str, str], ...] = (("answers/debian-preseed.cfg.j2", "preseed.cfg"),)
    # The base container image loaded into podman's store at provisioning (see ContainerBase).
    container: "ContainerBase | None" = None
    kind = "debootstrap"

    def constants(self) -> dict[str, Any]:
        out = {
            "recipe_version": RECIPE_VERSION,
            "name": self.name, "os": self.os, "release": self.release, "suite": self.suite,
            "variant": self.variant, "packages": list(self.packages),
            "dpkg_excludes": list(self.dpkg_excludes), "cmdline": self.cmdline,
            "disk_mib": self.disk_mib, "hostname": self.hostname, "root_label": ROOT_LABEL,
            "ready_marker": READY_MARKER, "nginx": self.nginx,
            "partitions": self.partitions(), "boot": list(BOOT_MODES),
        }
        if self.container is not None:
            out["container"] = self.container.constants()
        return out

    def partitions(self) -> list[dict[str, Any]]:
        """The GPT partitions, in order: name, GPT type GUID, first MiB, size in MiB."""
        esp_start = 1 + self.bios_boot_mib
        root_start = esp_start + self.esp_mib
        return [
            {"name": "bios", "type": "21686148-6449-6E6F-744E-656564454649", "start_mib": 1,
             "size_mib": self.bios_boot_mib},
            {"name": "esp", "type": "C12A7328-F81F-11D2-BA4B-00A0C93EC3B8", "start_mib": esp_start,
             "size_mib": self.esp_mib},
            {"name": "root", "type": "0FC63DAF-8483-4772-8E79-3D69C47D8E4D", "start_mib": root_start,
             "size_mib": self.disk_mib - root_start - 1},  # the last MiB holds the backup GPT
        ]


@dataclass(frozen=True)
class ContainerBase:
    """A base container image made from Debian packages at image build (no registry at run time):
    ``mmdebstrap --variant=<variant> --include=<packages>`` to a .tar.zst, with the .debs of
    `cache` (and their dependencies) downloaded, not installed, into `cache_dir` so a Containerfile
    can install packages offline (``dpkg -i``); provisioning ``podman import``s it as `name`."""

    name: str  # the image reference workloads use
    variant: str
    packages: tuple[str, ...]
    cache: tuple[str, ...]
    cache_dir: str

    def constants(self) -> dict[str, Any]:
        return {"name": self.name, "variant": self.variant, "packages": list(self.packages),
                "cache": list(self.cache), "cache_dir": self.cache_dir}


CONTAINER_TARBALL = "lab-base.tar.zst"  # in the build's stage dir; Packer uploads it


DEBIAN12 = Recipe(
    name="debian12",
    os="debian",
    release="12",
    suite="bookworm",
    variant="minbase",
    packages=(
        # boot: the generic kernel (the cloud kernel has no e1000), an initrd that finds LABEL=labroot
        "linux-image-amd64", "initramfs-tools", "zstd", "systemd-sysv", "udev", "kmod",
        # access and the tools the workloads run
        "openssh-server", "sysbench", "iperf3", "nginx-light", "openssl", "ca-certificates",
        "curl", "git", "procps", "iproute2", "ethtool", "iputils-ping", "netbase",
        # containers (issue 9 workloads): podman with netavark + iptables for its default bridge
        # network, both OCI runtimes, hyperfine for container start, POSIX `time -p` for timings
        "podman", "crun", "runc", "netavark", "iptables", "hyperfine", "time",
        # firmware boot (Proxmox VE, bhyve UEFI, libvirt boot = "disk"): GRUB's BIOS and UEFI images,
        # installed onto the disk during provisioning; mkfs.fat for the EFI system partition
        "grub-pc-bin", "grub-efi-amd64-bin", "grub2-common", "dosfstools",
        # PVE's IP discovery (network-get-interfaces) on the org.qemu.guest_agent.0 channel
        "qemu-guest-agent",
    ),
    dpkg_excludes=(
        "/usr/share/man/*", "/usr/share/info/*", "/usr/share/doc/*", "/usr/share/locale/*",
        "/usr/share/lintian/*", "/usr/share/linda/*",
    ),
    # quiet: the serial console stays readable (LAB-READY); fsck.mode=skip: clones are killed, the
    # ext4 journal is replayed at mount anyway; net.ifnames=0: the first NIC is eth0 on every model.
    cmdline=f"console=ttyS0 root=LABEL={ROOT_LABEL} rootfstype=ext4 rw net.ifnames=0 fsck.mode=skip quiet",
    disk_mib=4096,
    hostname="lab-debian12",
    packer_template="debian12.pkr.hcl",
    scripts=("scripts/debian-rootfs-essential.sh", "scripts/debian-rootfs-customize.sh",
             "scripts/provision-debian.sh"),
    template_paths=("image", "nginx.conf.j2", "site", "answers/debian-preseed.cfg.j2"),
    nginx={"worker_processes": "auto", "worker_connections": 4096, "root": "/srv/www",
           "ssl_certificate": "/etc/nginx/lab.crt", "ssl_certificate_key": "/etc/nginx/lab.key"},
    # essential (no apt) + git and time for clones inside a container; the build tools a
    # Containerfile installs offline (tcc: a C compiler ~0.3 MB, where gcc would add ~150 MB).
    container=ContainerBase(name="localhost/lab-base:latest", variant="essential", packages=("git", "time"),
                            cache=("make", "tcc", "libc6-dev"), cache_dir="/var/cache/lab-debs"),
)


def _nginx_settings(os_name: str) -> dict[str, Any]:
    cert = osfacts.facts(os_name).nginx.cert_dir
    return {"worker_processes": "auto", "worker_connections": 4096, "root": "/srv/www",
            "ssl_certificate": f"{cert}/lab.crt", "ssl_certificate_key": f"{cert}/lab.key"}


@dataclass(frozen=True)
class IsoRecipe:
    """An image installed from the OS's own installer ISO by an answer file, then provisioned.

    The ISO's URL and checksum are the Packer template's variable defaults (one place); package
    names, paths, the serial console and the installer's disk come from lab.osfacts."""

    name: str
    os: str
    release: str
    disk_mib: int
    packer_template: str  # relative to PACKER_DIR
    answers: tuple[tuple[str, str], ...]  # (template under templates/, file name served over HTTP)
    kind = "iso"

    @property
    def hostname(self) -> str:
        return f"lab-{self.name}"

    @property
    def scripts(self) -> tuple[str, ...]:
        return ("scripts/provision-common.sh", f"scripts/provision-{self.os}.sh")

    @property
    def template_paths(self) -> tuple[str, ...]:
        return ("nginx.conf.j2", "site", *(t for t, _ in self.answers))

    @property
    def nginx(self) -> dict[str, Any]:
        return _nginx_settings(self.os)

    @property
    def facts(self) -> osfacts.OsFacts:
        return osfacts.facts(self.os)

    def constants(self) -> dict[str, Any]:
        f = self.facts
        return {
            "recipe_version": RECIPE_VERSION, "kind": self.kind, "name": self.name, "os": self.os,
            "release": self.release, "disk_mib": self.disk_mib, "hostname": self.hostname,
            "answers": [list(a) for a in self.answers], "ready_marker": READY_MARKER,
            "packages": sorted(f.packages.values()), "nginx": self.nginx, "nginx_paths": f.nginx.__dict__,
            "serial": f.serial_device, "install_disk": f.install_disk,
        }


ISO_RECIPES = (
    IsoRecipe(name="alpine3", os="alpine", release="3.21", disk_mib=4096, packer_template="alpine3.pkr.hcl",
              answers=(("answers/alpine-answers.j2", "answers"), ("answers/alpine-install.sh.j2", "install.sh"))),
    IsoRecipe(name="freebsd14", os="freebsd", release="14.3", disk_mib=8192, packer_template="freebsd14.pkr.hcl",
              answers=(("answers/freebsd-installerconfig.j2", "installerconfig"),)),
    IsoRecipe(name="netbsd10", os="netbsd", release="10.1", disk_mib=8192, packer_template="netbsd10.pkr.hcl",
              answers=(("answers/netbsd-install.sh.j2", "install.sh"),)),
    IsoRecipe(name="openbsd7", os="openbsd", release="7.8", disk_mib=12288, packer_template="openbsd7.pkr.hcl",
              answers=(("answers/openbsd-install.conf.j2", "install.conf"),)),
)

AnyRecipe = Recipe | IsoRecipe
RECIPES: dict[str, AnyRecipe] = {r.name: r for r in (DEBIAN12, *ISO_RECIPES)}

DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_SECURITY_MIRROR = "http://deb.debian.org/debian-security"


# ---------------------------------------------------------------------------------------------
# names, inputs, digest


def recipe(name: str) -> AnyRecipe:
    try:
        return RECIPES[name]
    except KeyError:
        known = ", ".join(sorted(RECIPES))
        raise UsageError(f"unknown image {name!r}; known images: {known}") from None


def input_files(name: str, *, packer_dir: Path | None = None,
                templates_dir: Path | None = None) -> list[tuple[str, Path]]:
    """Every file the image is made from, as (stable label, path), sorted by label."""
    r = recipe(name)
    pdir = Path(packer_dir or lab.PACKER_DIR)
    tdir = Path(templates_dir or lab.TEMPLATES_DIR)
    out: list[tuple[str, Path]] = []
    for rel in (r.packer_template, *r.scripts):
        out.append((f"packer/{rel}", pdir / rel))
    for rel in r.template_paths:
        p = tdir / rel
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts:
                    out.append((f"templates/{f.relative_to(tdir).as_posix()}", f))
        else:
            out.append((f"templates/{rel}", p))
    return sorted(out)


def recipe_digest(name: str, *, packer_dir: Path | None = None,
                  templates_dir: Path | None = None) -> str:
    """sha256 over the recipe constants and every input file (path, executable bit, content)."""
    h = hashlib.sha256()
    h.update(json.dumps(recipe(name).constants(), sort_keys=True).encode())
    for label, path in input_files(name, packer_dir=packer_dir, templates_dir=templates_dir):
        try:
            data = path.read_bytes()
            mode = "x" if os.access(path, os.X_OK) else "-"
        except FileNotFoundError:
            raise LabError(f"image input {path} is missing", hint="is the checkout complete?") from None
        h.update(f"\0{label}\0{mode}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# manifests and loading


def _images_dir(images_dir: Path | None) -> Path:
    return Path(images_dir or lab.IMAGES_DIR)


def manifest_path(name: str, images_dir: Path | None = None) -> Path:
    return _images_dir(images_dir) / f"{name}.json"


def _not_built(name: str) -> UsageError:
    how = "make images" if name == "debian12" else f"lab images build {name}"
    return UsageError(f"image {name!r} is not built: run `{how}`")


def load(name: str, images_dir: Path | None = None) -> ImageRef:
    """The built image `name`, as its manifest describes it."""
    recipe(name)  # unknown names fail first, listing the known ones
    idir = _images_dir(images_dir)
    mpath = manifest_path(name, idir)
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise _not_built(name) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LabError(f"{mpath} is not valid JSON: {exc}", hint="rebuild it: run `make images`") from None
    try:
        disk = idir / manifest["paths"]["disk"]
        ref = ImageRef(name=manifest["name"], os=manifest["os"], path=disk,
                       digest=manifest["recipe_digest"], sha256=manifest["sha256"], manifest=manifest)
    except (KeyError, TypeError) as exc:
        raise LabError(f"{mpath} lacks {exc}", hint="rebuild it: run `make images`") from None
    if not disk.is_file():
        raise _not_built(name)
    return ref


BOOT_WAYS = {"kernel": "direct kernel boot", "bios": "BIOS firmware (SeaBIOS)", "uefi": "UEFI firmware",
             "disk": "firmware from its disk"}


def boot_modes(manifest: dict[str, Any]) -> set[str] | None:
    """How an image can boot, from its manifest: a subset of BOOT_MODES, with "disk" for the
    ISO-installed images (firmware boot of their own installer's kind). None: not recorded."""
    boot = manifest.get("boot")
    if isinstance(boot, list):
        return {str(b) for b in boot}
    if isinstance(boot, str):
        return {boot}
    if isinstance(manifest.get("paths"), dict) and "kernel" in manifest["paths"]:
        return {"kernel"}  # a debian12 built before recipe version 2: a bare filesystem, no bootloader
    return None


def require_boot(image: ImageRef, mode: str, who: str) -> None:
    """Refuse (UsageError, before anything is created) an image that cannot boot the way `who`
    boots it: `mode` is "kernel", "bios" or "uefi"."""
    modes = boot_modes(image.manifest or {})
    if modes is None or mode in modes or (mode != "kernel" and "disk" in modes):
        return
    how = ", ".join(BOOT_WAYS.get(m, m) for m in sorted(modes)) or "nothing"
    hint = (f"rebuild it: `lab images build {image.name} --force`" if recipe(image.name).kind == "debootstrap"
            else "run it on a libvirt or proxmox host")
    raise UsageError(f"image {image.name!r} cannot boot by {BOOT_WAYS[mode]} ({who}); it boots by {how}",
                     hint=hint)


def list_images(images_dir: Path | None = None) -> list[ImageRef]:
    """Every known image that is built (has a manifest and its disk)."""
    out = []
    for name in sorted(RECIPES):
        try:
            out.append(load(name, images_dir))
        except UsageError:
            continue
    return out


def artifact_paths(name: str, images_dir: Path | None = None) -> dict[str, Path]:
    idir = _images_dir(images_dir)
    paths = {"disk": idir / f"{name}.qcow2"}
    if RECIPES.get(name, DEBIAN12).kind == "debootstrap":  # direct kernel boot; ISO images boot from disk
        paths |= {"kernel": idir / name / "vmlinuz", "initrd": idir / name / "initrd.img"}
    return paths | {"ssh_key": idir / KEY_NAME, "ssh_pubkey": idir / f"{KEY_NAME}.pub"}


def up_to_date(name: str, images_dir: Path | None = None, digest: str | None = None) -> ImageRef | None:
    """The built image if its manifest has the current recipe digest, all artifacts exist, the disk
    has the recorded size and the SSH key is the one baked in; else None."""
    try:
        ref = load(name, images_dir)
    except LabError:
        return None
    m = ref.manifest
    if m.get("recipe_digest") != (digest or recipe_digest(name)):
        return None
    paths = artifact_paths(name, images_dir)
    if not all(p.is_file() for p in paths.values()):
        return None
    if paths["disk"].stat().st_size != m.get("size"):
        return None
    try:
        if key_fingerprint(paths["ssh_pubkey"].read_text()) != m.get("ssh_key_fingerprint"):
            return None
    except (ValueError, OSError):
        return None
    return ref


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def key_fingerprint(pubkey_line: str) -> str:
    """OpenSSH's SHA256 fingerprint of a public key line (as `ssh-keygen -lf` prints it)."""
    parts = pubkey_line.split()
    if len(parts) < 2:
        raise ValueError("not an OpenSSH public key line")
    blob = base64.b64decode(parts[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


# ---------------------------------------------------------------------------------------------
# building blocks


def ensure_key(images_dir: Path | None = None) -> Path:
    """images/lab_key (ed25519, no passphrase): generated once, the lab's SSH key for root."""
    idir = _images_dir(images_dir)
    key, pub = idir / KEY_NAME, idir / f"{KEY_NAME}.pub"
    if key.is_file() and pub.is_file():
        return key
    if key.is_file():  # never throw a private key away: derive its public half
        res = proc.run(["ssh-keygen", "-y", "-f", key], timeout=30, what="ssh-keygen -y")
        pub.write_text(res.stdout.strip() + " lab@golden-images\n")
        return key
    key.parent.mkdir(parents=True, exist_ok=True)
    pub.unlink(missing_ok=True)
    proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "lab@golden-images", "-f", key],
             timeout=30, what="ssh-keygen")
    key.chmod(0o600)
    return key


def debian_mirrors(suite: str, sources: Iterable[Path] | None = None) -> list[str]:
    """mmdebstrap mirror lines for `suite`, reusing the Debian mirror this machine's apt uses
    (/etc/apt/sources.list and sources.list.d, one-line and deb822 forms). LAB_DEBIAN_MIRROR
    overrides the main archive."""
    main = os.environ.get("LAB_DEBIAN_MIRROR", "")
    security = ""
    if sources is None:
        d = Path("/etc/apt/sources.list.d")
        sources = [Path("/etc/apt/sources.list"), *sorted(d.glob("*.list")), *sorted(d.glob("*.sources"))]
    for uri, suites in _apt_entries(sources):
        if f"{suite}-security" in suites and not security:
            security = uri
        elif suite in suites and not main:
            main = uri
    main = (main or DEFAULT_MIRROR).rstrip("/")
    security = (security or DEFAULT_SECURITY_MIRROR).rstrip("/")
    return [f"deb {main} {suite} main", f"deb {main} {suite}-updates main",
            f"deb {security} {suite}-security main"]


def _apt_entries(sources: Iterable[Path]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":
            for stanza in text.split("\n\n"):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if ":" in line and not line.startswith(("#", " ")):
                        k, v = line.split(":", 1)
                        fields[k.strip().lower()] = v.strip()
                if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
                    for uri in fields.get("uris", "").split():
                        out.append((uri, fields.get("suites", "").split()))
        else:
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                if not line.startswith("deb "):
                    continue
                if "[" in line and "]" in line:  # deb [signed-by=...] URI SUITE COMPONENTS
                    line = line.split("[", 1)[0] + line.split("]", 1)[1]
                words = line.split()
                if len(words) >= 3:
                    out.append((words[1], [words[2]]))
    return out


def png(width: int, height: int, seed: int) -> bytes:
    """A deterministic RGB PNG: a gradient, a few bars and mild noise (compresses like a picture)."""
    rng = random.Random(seed)
    base = [rng.randrange(40, 200) for _ in range(3)]
    bars = [(rng.randrange(width), rng.randrange(8, max(9, width // 8)), rng.randrange(height),
             [rng.randrange(256) for _ in range(3)]) for _ in range(6)]
    noise = rng.randbytes(width * height)
    rows = bytearray()
    for y in range(height):
        rows.append(0)
        for x in range(width):
            n = noise[y * width + x] & 15
            r = (base[0] + x * 90 // width + n) & 255
            g = (base[1] + y * 90 // height + n) & 255
            b = (base[2] + (x + y) * 40 // (width + height) + n) & 255
            for bx, bw, top, col in bars:
                if bx <= x < bx + bw and y >= top:
                    r, g, b = col[0] ^ n, col[1] ^ n, col[2] ^ n
                    break
            rows += bytes((r, g, b))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(rows), 9))
            + chunk(b"IEND", b""))


def _jinja(tdir: Path):
    import jinja2

    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(tdir)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


def render_stage(name: str, out: Path, templates_dir: Path | None = None) -> None:
    """Render what the provisioner uploads: out/nginx.conf and out/site/ (pages, css, images)."""
    import jinja2

    r = recipe(name)
    tdir = Path(templates_dir or lab.TEMPLATES_DIR)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nginx.conf").write_text(_jinja(tdir).get_template("nginx.conf.j2").render(
        image=name, **osfacts.facts(r.os).nginx.__dict__, **r.nginx))

    sdir = tdir / "site"
    site = out / "site"
    site_env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(sdir)), undefined=jinja2.StrictUndefined,
                                  keep_trailing_newline=True, autoescape=jinja2.select_autoescape())
    page_files = sorted((sdir / "pages").glob("*.html"))
    pages = []
    for pf in page_files:
        mod = site_env.get_template(f"pages/{pf.name}").make_module({"pages": [], "href": pf.name})
        pages.append({"href": pf.name, "title": getattr(mod, "title"), "date": getattr(mod, "date")})
    index = [p for p in pages if p["href"] == "index.html"]
    rest = sorted((p for p in pages if p["href"] != "index.html"), key=lambda p: (p["date"], p["href"]),
                  reverse=True)
    pages = index + rest  # the home page first, then the newest article first
    for pf in page_files:
        html = site_env.get_template(f"pages/{pf.name}").render(pages=pages, href=pf.name)
        (site / pf.name).parent.mkdir(parents=True, exist_ok=True)
        (site / pf.name).write_text(html)
    for f in sorted(sdir.rglob("*")):
        rel = f.relative_to(sdir)
        if f.is_dir() or rel.parts[0] == "pages" or f.name in ("layout.html.j2", "images.toml"):
            continue
        dest = site / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
    imgs = sdir / "images.toml"
    if imgs.is_file():
        for rel, (w, h, seed) in tomllib.loads(imgs.read_text()).items():
            dest = site / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(png(int(w), int(h), int(seed)))


def container_base_argv(r: Recipe, out: Path, mirrors: list[str]) -> list[str]:
    """Pure: the mmdebstrap command line that makes the recipe's base container tarball."""
    c = r.container
    if c is None:
        raise LabError(f"image {r.name!r} has no base container image in its recipe")
    cache = c.cache_dir
    # The hook runs on the host with the chroot's apt configuration: --download-only puts the .debs
    # (with their dependencies that are not installed yet) where the Containerfile expects them.
    hook = (f'mkdir -p "$1{cache}" && APT_CONFIG="$MMDEBSTRAP_APT_CONFIG" apt-get install --download-only '
            f'-y -q -o Dir::Cache::archives="$1{cache}/" {" ".join(c.cache)} '
            f'&& rm -rf "$1{cache}/partial" "$1{cache}/lock"')
    return ["mmdebstrap", "--mode=root", f"--variant={c.variant}", "--format=tar",
            f"--include={','.join(c.packages)}", "--aptopt=Acquire::Retries \"3\"",
            *[f"--dpkgopt=path-exclude={p}" for p in r.dpkg_excludes],
            f"--customize-hook={hook}", r.suite, str(out), *mirrors]


def build_container_base(r: Recipe, out: Path, mirrors: list[str], log: Path) -> None:
    """The base container image as a zstd tarball (mmdebstrap compresses by the file name)."""
    _run_logged(container_base_argv(r, out, mirrors), log, timeout=1200, what="mmdebstrap (container)",
                env={"DEBIAN_FRONTEND": "noninteractive"})
    if not out.is_file() or out.stat().st_size == 0:
        raise LabError(f"mmdebstrap made no {out}", hint=f"see {log}")


def stage_container_base(name: str, stage: Path, log: Path) -> Path:
    """The base container tarball in `stage` for a hand-run Packer build (`lab images render`): the
    one the last local build made when that build is of the current recipe, else a new one."""
    r = recipe(name)
    dest = stage / CONTAINER_TARBALL
    built = lab.PROJECT_ROOT / "build" / name / "stage" / CONTAINER_TARBALL
    ref = up_to_date(name)
    stage.mkdir(parents=True, exist_ok=True)
    if ref is not None and built.is_file() and built.stat().st_size == ref.manifest.get("container", {}).get("tarball_bytes"):
        shutil.copyfile(built, dest)
    else:
        if os.geteuid() != 0:
            raise LabError("making the base container image needs root (mmdebstrap --mode=root)",
                           hint="run as root, or `make images` first and render again")
        build_container_base(r, dest, debian_mirrors(r.suite), log)
    return dest


def _tool_version(argv: list[str]) -> str:
    try:
        res = proc.run(argv, timeout=30, check=False)
    except LabError:
        return ""
    lines = (res.stdout or res.stderr).strip().splitlines()
    return lines[0] if lines else ""


def _run_logged(argv: list[str], log: Path, *, timeout: float, what: str,
                env: dict[str, str] | None = None, cwd: Path | None = None) -> proc.Result:
    """proc.run, keeping the full output in `log` (also on failure)."""
    try:
        res = proc.run(argv, timeout=timeout, env=env, cwd=cwd, what=what)
    except CommandError as exc:
        log.write_text(f"$ {' '.join(exc.argv)}\n--- stdout\n{exc.stdout}\n--- stderr\n{exc.stderr}\n")
        exc.hint = f"full output in {log}"
        raise
    log.write_text(f"$ {' '.join(res.argv)}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}\n")
    return res


# ---------------------------------------------------------------------------------------------
# ISO-installed images: answer files, the upload stage, the installer ISO


ISO_CACHE = "iso"  # images/iso/<file name of the ISO URL>: a local copy, used instead of downloading


def packer_defaults(template: Path) -> dict[str, str]:
    """The template's variable defaults, as `packer inspect` prints them (`var.NAME: "value"`)."""
    # inspect prints values set through PKR_VAR_*: blank the secret so it cannot reach an error message.
    out = proc.run(["packer", "inspect", "-machine-readable", template], timeout=60, what="packer inspect",
                   env={"CHECKPOINT_DISABLE": "1", "PKR_VAR_proxmox_token": ""}).stdout
    found: dict[str, str] = {}
    for line in out.splitlines():
        text = line.split(",", 3)[-1].replace("%!(PACKER_COMMA)", ",").replace("\\n", "\n")
        for part in text.splitlines():
            key, sep, value = part.strip().partition(": ")
            if sep and key.startswith("var.") and value.startswith('"') and value.endswith('"'):
                found[key[4:]] = json.loads(value)
    return found


def answer_context(r: IsoRecipe | Recipe, pubkey: str) -> dict[str, Any]:
    """What the answer-file templates see. The root password is random per render and only lives
    until provisioning replaces it with `*` (no password can match): the installers insist on one."""
    import secrets

    f = osfacts.facts(r.os)
    packages = list(r.packages) + ["qemu-guest-agent"] if isinstance(r, Recipe) else sorted(f.packages.values())
    return {"image": r.name, "os": r.os, "release": r.release, "hostname": r.hostname, "pubkey": pubkey,
            "disk": f.install_disk, "nic": f.device(NicModel.VIRTIO), "serial": f.serial_device,
            "packages": packages, "root_password": secrets.token_urlsafe(18), "timezone": "UTC",
            "ready_marker": READY_MARKER, "disk_mib": r.disk_mib}


def render_answers(name: str, out: Path, pubkey: str, templates_dir: Path | None = None) -> dict[str, Path]:
    """Render the image's answer files into `out` (Packer's http_directory); return name -> path."""
    r = recipe(name)
    env = _jinja(Path(templates_dir or lab.TEMPLATES_DIR))
    ctx = answer_context(r, pubkey)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for template, served in r.answers:
        dest = out / served
        dest.write_text(env.get_template(template).render(**ctx))
        written[served] = dest
    return written


def render_upload(name: str, out: Path, templates_dir: Path | None = None) -> None:
    """What provision-<os>.sh finds in /tmp: lab-nginx.conf, lab-site/, lab-common.sh (the shared
    shell functions) and lab-facts.sh (this OS's facts from lab.osfacts, as shell variables)."""
    r = recipe(name)
    f = osfacts.facts(r.os)
    staged = out.parent / f"{out.name}.render"
    shutil.rmtree(staged, ignore_errors=True)
    render_stage(name, staged, templates_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.replace(staged / "nginx.conf", out / "lab-nginx.conf")
    shutil.rmtree(out / "lab-site", ignore_errors=True)
    os.replace(staged / "site", out / "lab-site")
    shutil.rmtree(staged)
    shutil.copyfile(lab.PACKER_DIR / "scripts" / "provision-common.sh", out / "lab-common.sh")
    env = {"LAB_IMAGE": name, "LAB_OS": r.os, "LAB_RELEASE": r.release, "LAB_HOSTNAME": r.hostname,
           "LAB_PACKAGES": " ".join(sorted(f.packages.values())), "LAB_SERIAL": f.serial_device,
           "LAB_READY_MARKER": READY_MARKER, "LAB_NGINX_CONF": f.nginx.conf, "LAB_NGINX_USER": f.nginx.user,
           "LAB_CERT_DIR": f.nginx.cert_dir, "LAB_SITE_ROOT": r.nginx["root"]}
    lines = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    (out / "lab-facts.sh").write_text("# shellcheck shell=sh disable=SC2034\n# Rendered by lab/images.py from "
                                      "lab/osfacts.py.\n" + "\n".join(lines) + "\n")


@dataclass(frozen=True)
class IsoSource:
    url: str  # what Packer's iso_url gets: the mirror URL or a local path
    checksum: str  # what iso_checksum gets
    local: bool


def _reachable(url: str, timeout: float = 10.0) -> str:
    """'' if an HTTP HEAD of `url` answers 2xx/3xx, else why not (one short phrase)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return ""
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return str(reason).strip() or type(exc).__name__


def resolve_iso(r: IsoRecipe, idir: Path, iso: str | None = None, checksum: str | None = None) -> IsoSource:
    """Where the installer ISO comes from, decided before anything is created: `iso` (a local file),
    else images/iso/<name> if present, else the mirror if it answers; otherwise one UsageError."""
    defaults = packer_defaults(lab.PACKER_DIR / r.packer_template)
    url, default_sum = defaults["iso_url"], defaults["iso_checksum"]
    cached = idir / ISO_CACHE / url.rsplit("/", 1)[-1]
    if checksum and not (checksum.startswith(("sha256:", "sha512:", "file:")) or checksum == "none"):
        raise UsageError(f"--iso-checksum {checksum!r}: expected sha256:HEX, sha512:HEX or file:PATH")
    if iso is not None:
        local = Path(iso).expanduser().resolve()
        if not local.is_file():
            raise UsageError(f"--iso {iso}: no such file")
    elif cached.is_file():
        local = cached
    else:
        why = _reachable(url)
        if why:
            raise UsageError(f"{r.name}: the installer ISO {url} cannot be downloaded ({why}) and is not "
                             f"cached as {cached}",
                             hint=f"put the ISO there, or pass --iso PATH --iso-checksum sha256:HEX")
        return IsoSource(url, checksum or default_sum, local=False)
    if checksum is None and default_sum.startswith("file:http"):
        # Packer would fetch the release's checksum file: possible only online.
        why = _reachable(default_sum[len("file:"):])
        if why:
            raise UsageError(f"{r.name}: the checksum file {default_sum[5:]} cannot be downloaded ({why}) "
                             f"to verify {local}", hint="pass --iso-checksum sha256:HEX (from that file)")
    return IsoSource(str(local), checksum or default_sum, local=True)


def _accelerator() -> str:
    return "kvm" if os.access("/dev/kvm", os.R_OK | os.W_OK) and os.environ.get("LAB_PACKER_ACCEL") != "tcg" \
        else "tcg"


def _build_iso(r: IsoRecipe, work: Path, idir: Path, digest: str, say: Callable[[str], None],
               source: IsoSource) -> ImageRef:
    stage = _Stages(say)
    key, pubkey = _fresh_workdir(work, idir)

    stage("answers: render the installer's answer files and the upload stage")
    render_answers(r.name, work / "http", pubkey)
    render_upload(r.name, work / "stage")

    stage(f"packer: install from {'the local ISO' if source.local else 'the mirror'} and provision")
    out_dir = work / "packer-out"
    report = work / "lab-image.json"
    pvars = {"iso_url": source.url, "iso_checksum": source.checksum, "http_dir": work / "http",
             "stage_dir": work / "stage", "ssh_key": key, "report_out": report, "output_dir": out_dir,
             "console_log": work / "packer-console.log", "accelerator": _accelerator(),
             "disk_size": f"{r.disk_mib}M"}
    argv = ["packer", "build", "-color=false", "-on-error=cleanup", f"-only=qemu.{r.name}",
            *[a for k, v in pvars.items() for a in ("-var", f"{k}={v}")],
            lab.PACKER_DIR / r.packer_template]
    # The ISO cache survives rebuilds (build/<name> does not): a second build downloads nothing.
    penv = {"CHECKPOINT_DISABLE": "1", "PACKER_CACHE_DIR": str(lab.PROJECT_ROOT / "build" / "packer-cache"),
            "PACKER_NO_COLOR": "1"}
    _run_logged(argv, work / "packer.log", timeout=4 * 3600, what="packer build", env=penv, cwd=work)
    try:
        guest = json.loads(report.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LabError(f"the guest's version report {report} is unusable: {exc}",
                       hint=f"see {work / 'packer.log'}") from None

    stage("install: images/")
    paths = artifact_paths(r.name, idir)
    mpath = manifest_path(r.name, idir)
    mpath.unlink(missing_ok=True)
    os.replace(out_dir / f"{r.name}.qcow2", paths["disk"])
    f = r.facts
    manifest = {
        "name": r.name, "os": r.os, "release": r.release, "recipe_digest": digest,
        "recipe_version": RECIPE_VERSION, **_disk_facts(paths["disk"]),
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": stage.total(),
        "stage_seconds": stage.durations(),
        "kernel": guest.get("running_kernel", ""), "os_version": guest.get("os_version", ""),
        "tools": guest.get("tools", {}), "packages": guest.get("packages", {}),
        "boot": "disk", "serial": f.serial_device,
        "net": {"device": {m.value: d for m, d in f.nic_device.items()}, "config": "dhcp"},
        "ready_marker": READY_MARKER, "ssh_user": SSH_USER, "ssh_key_fingerprint": key_fingerprint(pubkey),
        "nginx": {"root": r.nginx["root"], "ports": [80, 443], "certificate": r.nginx["ssl_certificate"],
                  "certificate_sha256": guest.get("nginx_cert_sha256", ""),
                  "bulk": ["/bulk/1m.bin", "/bulk/64m.bin"], "bulk_sha256": guest.get("bulk_sha256", {}),
                  "site_files": guest.get("site_files")},
        "iso": {"url": source.url, "checksum": source.checksum, "local": source.local},
        "paths": {k: p.relative_to(idir).as_posix() for k, p in paths.items()},
        "builder": {"packer": _tool_version(["packer", "version"]),
                    "qemu": _tool_version(["qemu-system-x86_64", "--version"])},
    }
    tmp = mpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, mpath)
    say(f"done in {manifest['build_seconds']:.0f} s: {paths['disk']}")
    return load(r.name, idir)


def _disk_facts(disk: Path) -> dict[str, Any]:
    info = json.loads(proc.run(["qemu-img", "info", "--output=json", disk], timeout=60,
                               what="qemu-img info").stdout)
    return {"sha256": file_sha256(disk), "size": disk.stat().st_size, "virtual_size": info["virtual-size"],
            "format": info.get("format", "qcow2")}


# ---------------------------------------------------------------------------------------------
# listing and publishing


def status(images_dir: Path | None = None, now: float | None = None) -> list[dict[str, Any]]:
    """One row per known image, built or not: state (built, outdated, not built), the current recipe
    digest, the built image's digest, age and tool versions."""
    idir = _images_dir(images_dir)
    now = time.time() if now is None else now
    rows = []
    for name in sorted(RECIPES):
        r = RECIPES[name]
        current = recipe_digest(name)
        row: dict[str, Any] = {"name": name, "os": r.os, "release": r.release, "kind": r.kind,
                               "recipe_digest": current, "state": "not built", "built_digest": "",
                               "built_at": "", "age_s": None, "tools": {}, "size": None}
        try:
            ref = load(name, idir)
        except LabError:
            rows.append(row)
            continue
        m = ref.manifest
        row.update(built_digest=ref.digest, built_at=m.get("built_at", ""), tools=m.get("tools", {}),
                   size=m.get("size"), sha256=ref.sha256)
        row["state"] = "built" if up_to_date(name, idir, current) is not None else "outdated"
        try:
            row["age_s"] = max(0.0, now - datetime.fromisoformat(m["built_at"]).timestamp())
        except (KeyError, TypeError, ValueError):
            pass
        rows.append(row)
    return rows


def publish_local(ref: ImageRef, store: Path) -> str:
    """Copy a built image (disk, boot files, manifest) into a local image store, as
    <store>/<name>/<sha256[:12]>/, verified by sha256, and point <store>/<name>/current at it.
    Publishing the same image twice copies nothing. Returns the published directory."""
    idir = ref.path.parent
    dest = store / ref.name / ref.sha256[:12]
    if not (dest / "manifest.json").is_file():
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for key, rel in ref.manifest.get("paths", {}).items():
            if key in ("ssh_key", "ssh_pubkey"):
                continue  # the key stays in images/: a store is not where secrets go
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(idir / rel, target)
        if file_sha256(tmp / ref.manifest["paths"]["disk"]) != ref.sha256:
            shutil.rmtree(tmp)
            raise LabError(f"{ref.path} does not match its manifest's sha256", hint="rebuild the image")
        (tmp / "manifest.json").write_text(json.dumps(ref.manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, dest)
    current = store / ref.name / "current"
    link_tmp = current.with_name("current.tmp")
    link_tmp.unlink(missing_ok=True)
    link_tmp.symlink_to(dest.name)
    os.replace(link_tmp, current)
    return str(dest)


# ---------------------------------------------------------------------------------------------
# build


def build(name: str = "debian12", force: bool = False, progress: Progress = None,
          images_dir: Path | None = None, iso: str | None = None, iso_checksum: str | None = None) -> ImageRef:
    """Build image `name` unless it is up to date; return it. `progress(stage)` hears each stage.
    `iso`/`iso_checksum` (ISO-installed images only) name a local copy of the installer ISO."""
    r = recipe(name)
    say = progress or (lambda _msg: None)
    idir = _images_dir(images_dir)
    digest = recipe_digest(name)
    if r.kind == "debootstrap" and (iso or iso_checksum):
        raise UsageError(f"image {name!r} is built from Debian packages, not from an ISO: drop --iso")
    if not force:
        ref = up_to_date(name, idir, digest)
        if ref is not None:
            say(f"up to date ({digest[:12]})")
            return ref
    source = resolve_iso(r, idir, iso, iso_checksum) if isinstance(r, IsoRecipe) else None
    if source is None and os.geteuid() != 0:
        raise LabError("building a golden image needs root (mmdebstrap --mode=root, chroot)",
                       hint="run `sudo make images`")
    work = lab.PROJECT_ROOT / "build" / name
    work.parent.mkdir(parents=True, exist_ok=True)
    lock = open(work.parent / f"{name}.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise LabError(f"another build of {name!r} is running (lock {lock.name})") from None
    try:
        if isinstance(r, IsoRecipe):
            return _build_iso(r, work, idir, digest, say, source)
        return _build(r, name, work, idir, digest, say)
    finally:
        lock.close()


def _build(r: Recipe, name: str, work: Path, idir: Path, digest: str, say: Callable[[str], None]) -> ImageRef:
    stage = _Stages(say)
    key, pubkey = _fresh_workdir(work, idir)
    rootfs = work / "rootfs"
    mirrors = debian_mirrors(r.suite)

    stage("rootfs: mmdebstrap")
    argv = ["mmdebstrap", "--mode=root", f"--variant={r.variant}", "--format=directory",
            f"--include={','.join(r.packages)}",
            "--aptopt=Acquire::Retries \"3\"",
            *[f"--dpkgopt=path-exclude={p}" for p in r.dpkg_excludes],
            "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            f"--essential-hook={lab.PACKER_DIR / 'scripts/debian-rootfs-essential.sh'}",
            f"--customize-hook={lab.PACKER_DIR / 'scripts/debian-rootfs-customize.sh'}",
            r.suite, str(rootfs), *mirrors]
    env = {"LAB_OVERLAY": str(lab.TEMPLATES_DIR / "image" / "rootfs"),
           "LAB_MASKS": str(lab.TEMPLATES_DIR / "image" / "masked-units"),
           "LAB_PUBKEY": pubkey, "LAB_HOSTNAME": r.hostname, "DEBIAN_FRONTEND": "noninteractive"}
    _run_logged(argv, work / "mmdebstrap.log", timeout=1800, what="mmdebstrap", env=env)

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
    proc.run(["mkfs.ext4", "-q", "-F", "-L", ROOT_LABEL, "-d", rootfs, "-m", "1",
              "-E", "lazy_itable_init=0,lazy_journal_init=0", root_raw, f"{root_part['size_mib']}M"],
             timeout=600, what="mkfs.ext4")
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
    if r.container is not None:
        stage("container: mmdebstrap the base container image")
        build_container_base(r, work / "stage" / CONTAINER_TARBALL, mirrors, work / "container.log")

    stage("packer: boot under TCG and provision")
    out_dir = work / "packer-out"
    report = work / "lab-image.json"
    # The build boot: direct kernel boot with slirp's address given explicitly (the image's own
    # fallback is DHCP); GRUB gets the base command line.
    pvars = {"disk_in": base, "output_dir": out_dir, "kernel": work / "vmlinuz",
             "initrd": work / "initrd.img", "cmdline": f"{r.cmdline} lab.ip=10.0.2.15/24 lab.gw=10.0.2.2",
             "boot_cmdline": r.cmdline, "root_label": ROOT_LABEL, "ssh_key": key,
             "stage_dir": work / "stage", "report_out": report,
             "console_log": work / "packer-console.log", "disk_size": f"{r.disk_mib}M"}
    # Only the qemu source: the template's proxmox-iso source builds on a PVE node, by hand.
    argv = ["packer", "build", "-color=false", "-on-error=cleanup", f"-only=qemu.{name}",
            *[a for k, v in pvars.items() for a in ("-var", f"{k}={v}")],
            lab.PACKER_DIR / r.packer_template]
    penv = {"CHECKPOINT_DISABLE": "1", "PACKER_CACHE_DIR": str(work / "packer-cache"),
            "PACKER_NO_COLOR": "1"}
    _run_logged(argv, work / "packer.log", timeout=1800, what="packer build", env=penv, cwd=work)
    try:
        guest = json.loads(report.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LabError(f"the guest's version report {report} is unusable: {exc}",
                       hint=f"see {work / 'packer.log'}") from None
    if guest.get("running_kernel") != kver:
        raise LabError(f"the guest ran kernel {guest.get('running_kernel')!r}, expected {kver!r}")

    stage("install: images/")
    paths = artifact_paths(name, idir)
    mpath = manifest_path(name, idir)
    mpath.unlink(missing_ok=True)  # no manifest describes half-replaced artifacts
    paths["kernel"].parent.mkdir(parents=True, exist_ok=True)
    os.replace(out_dir / "debian12.qcow2", paths["disk"])
    shutil.copyfile(work / "vmlinuz", paths["kernel"])
    shutil.copyfile(work / "initrd.img", paths["initrd"])
    base.unlink()  # 700 MB; the logs stay in build/<name>/ for the curious
    sha = file_sha256(paths["disk"])
    vsize = json.loads(proc.run(["qemu-img", "info", "--output=json", paths["disk"]],
                                timeout=60, what="qemu-img info").stdout)["virtual-size"]

    manifest = {
        "name": name,
        "os": r.os,
        "release": r.release,
        "suite": r.suite,
        "recipe_digest": digest,
        "recipe_version": RECIPE_VERSION,
        "sha256": sha,
        "size": paths["disk"].stat().st_size,
        "virtual_size": vsize,
        "format": "qcow2",
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
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
        "net": {"device": "eth0", "kernel_args": "lab.ip=ADDR/PREFIX lab.gw=ADDR",
                "cidata": "NoCloud drive labelled cidata: network-config v1/v2, user-data ssh_authorized_keys",
                "fallback": "dhcp"},
        "ready_marker": READY_MARKER,
        "ssh_user": SSH_USER,
        "ssh_key_fingerprint": key_fingerprint(pubkey),
        "nginx": {"root": r.nginx["root"], "ports": [80, 443], "certificate": r.nginx["ssl_certificate"],
                  "certificate_sha256": guest.get("nginx_cert_sha256", ""),
                  "bulk": ["/bulk/1m.bin", "/bulk/64m.bin"], "bulk_sha256": guest.get("bulk_sha256", {}),
                  "site_files": guest.get("site_files")},
        "container": ({"name": r.container.name, "tarball_bytes": (work / "stage" / CONTAINER_TARBALL).stat().st_size,
                       **guest.get("container", {})} if r.container is not None else None),
        "initrd_modules": _initrd_modules(),
        "paths": {k: p.relative_to(idir).as_posix() for k, p in paths.items()},
        "mirrors": mirrors,
        "builder": {
            "mmdebstrap": _tool_version(["mmdebstrap", "--version"]),
            "packer": _tool_version(["packer", "version"]),
            "qemu": _tool_version(["qemu-system-x86_64", "--version"]),
            "e2fsprogs": _tool_version(["mkfs.ext4", "-V"]),
        },
    }
    tmp = mpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, mpath)
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
        for p in parts)
    proc.run(["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", raw], input=script, timeout=60,
             what="sfdisk")
    root = parts[-1]
    if root_fs.stat().st_size != root["size_mib"] * 2**20:
        raise LabError(f"{root_fs} is {root_fs.stat().st_size} bytes, the partition {root['size_mib']} MiB")
    proc.run(["dd", f"if={root_fs}", f"of={raw}", "bs=1M", f"seek={root['start_mib']}", "conv=notrunc,sparse",
              "status=none"], timeout=600, what="dd root filesystem into the disk image")


def _initrd_modules() -> list[str]:
    path = lab.TEMPLATES_DIR / "image" / "rootfs" / "usr" / "share" / "initramfs-tools" / "modules.d" / "lab"
    return [w for line in path.read_text().splitlines() for w in line.split("#", 1)[0].split()]


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
        raise LabError(f"{work} still has mounts: {', '.join(left)}",
                       hint=f"unmount them (umount -R) and delete {work} by hand")
    shutil.rmtree(work)


class _Stages:
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


def _fresh_workdir(work: Path, idir: Path) -> tuple[Path, str]:
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


def _main(argv: list[str]) -> int:
    usage = "usage: python -m lab.images build [NAME] [--force] | ls"
    if not argv or argv[0] not in ("build", "ls"):
        print(usage, file=sys.stderr)
        return 2
    try:
        if argv[0] == "ls":
            for ref in list_images():
                m = ref.manifest
                print(f"{ref.name}\t{ref.digest[:12]}\t{m.get('size', 0) / 2**20:.0f} MiB\t"
                      f"{m.get('built_at', '')}\t{ref.path}")
            return 0
        names = [a for a in argv[1:] if not a.startswith("-")] or ["debian12"]
        force = "--force" in argv[1:]
        start = time.monotonic()
        for n in names:
            ref = build(n, force=force,
                        progress=lambda s: print(f"[{time.monotonic() - start:6.1f}s] {n}: {s}", flush=True))
            print(f"{ref.name}: {ref.path} sha256={ref.sha256[:16]} digest={ref.digest[:12]}")
        return 0
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
