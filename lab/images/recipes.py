"""What goes into each golden image: the recipes (Debian from packages, the other OSes from their
installer ISOs) and the constants of the guest contract (root label, boot modes, readiness marker).

Everything here is data: the recipe digest (lab.images.digest) hashes `constants()` together with
the input files, so a change here rebuilds the image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lab import osfacts
from lab.errors import UsageError

# Bump when the build logic changes in a way the inputs below do not show.
RECIPE_VERSION = 2  # 2: partitioned disk (GPT: BIOS boot, ESP, root), GRUB for BIOS and UEFI

ROOT_LABEL = "labroot"
# How the debian12 image boots: direct kernel boot (local backend, libvirt QEMU), and from its disk
# by firmware, SeaBIOS ("bios": PVE's default) or UEFI ("uefi": OVMF, bhyve's BHYVE_UEFI.fd).
BOOT_MODES = ("kernel", "bios", "uefi")
READY_MARKER = "LAB-READY"
SSH_USER = "root"


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
    container: ContainerBase | None = None
    kind = "debootstrap"

    def constants(self) -> dict[str, Any]:
        out = {
            "recipe_version": RECIPE_VERSION,
            "name": self.name,
            "os": self.os,
            "release": self.release,
            "suite": self.suite,
            "variant": self.variant,
            "packages": list(self.packages),
            "dpkg_excludes": list(self.dpkg_excludes),
            "cmdline": self.cmdline,
            "disk_mib": self.disk_mib,
            "hostname": self.hostname,
            "root_label": ROOT_LABEL,
            "ready_marker": READY_MARKER,
            "nginx": self.nginx,
            "partitions": self.partitions(),
            "boot": list(BOOT_MODES),
        }
        if self.container is not None:
            out["container"] = self.container.constants()
        return out

    def partitions(self) -> list[dict[str, Any]]:
        """The GPT partitions, in order: name, GPT type GUID, first MiB, size in MiB."""
        esp_start = 1 + self.bios_boot_mib
        root_start = esp_start + self.esp_mib
        return [
            {
                "name": "bios",
                "type": "21686148-6449-6E6F-744E-656564454649",
                "start_mib": 1,
                "size_mib": self.bios_boot_mib,
            },
            {
                "name": "esp",
                "type": "C12A7328-F81F-11D2-BA4B-00A0C93EC3B8",
                "start_mib": esp_start,
                "size_mib": self.esp_mib,
            },
            {
                "name": "root",
                "type": "0FC63DAF-8483-4772-8E79-3D69C47D8E4D",
                "start_mib": root_start,
                "size_mib": self.disk_mib - root_start - 1,
            },  # the last MiB holds the backup GPT
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
        return {
            "name": self.name,
            "variant": self.variant,
            "packages": list(self.packages),
            "cache": list(self.cache),
            "cache_dir": self.cache_dir,
        }


CONTAINER_TARBALL = "lab-base.tar.zst"  # in the build's stage dir; Packer uploads it


DEBIAN12 = Recipe(
    name="debian12",
    os="debian",
    release="12",
    suite="bookworm",
    variant="minbase",
    packages=(
        # boot: the generic kernel (the cloud kernel has no e1000), an initrd that finds LABEL=labroot
        "linux-image-amd64",
        "initramfs-tools",
        "zstd",
        "systemd-sysv",
        "udev",
        "kmod",
        # access and the tools the workloads run (their packages: lab.osfacts.TOOLS)
        "openssh-server",
        osfacts.package("debian", "sysbench"),
        osfacts.package("debian", "iperf3"),
        "wrk",  # the http/https load generator of a client VM (client = "vm"); nginx is the guest's
        osfacts.package("debian", "nginx"),
        "openssl",
        "ca-certificates",
        osfacts.package("debian", "curl"),
        osfacts.package("debian", "git"),
        "procps",
        "iproute2",
        "ethtool",
        "iputils-ping",
        "netbase",
        # containers (issue 9 workloads): podman with netavark + iptables for its default bridge
        # network, both OCI runtimes, the timer of container start, POSIX `time -p` for timings
        osfacts.package("debian", "podman"),
        "crun",
        "runc",
        "netavark",
        "iptables",
        osfacts.package("debian", "hyperfine"),
        "time",
        # Docker beside Podman (the container build study: the same Containerfile on the same Debian):
        # its daemon is socket-activated, not started at boot; its store is seeded at the rootfs build
        osfacts.package("debian", "docker"),
        # firmware boot (Proxmox VE, bhyve UEFI, libvirt boot = "disk"): GRUB's BIOS and UEFI images,
        # installed onto the disk during provisioning; mkfs.fat for the EFI system partition
        "grub-pc-bin",
        "grub-efi-amd64-bin",
        "grub2-common",
        "dosfstools",
        # PVE's IP discovery (network-get-interfaces) on the org.qemu.guest_agent.0 channel
        "qemu-guest-agent",
    ),
    dpkg_excludes=(
        "/usr/share/man/*",
        "/usr/share/info/*",
        "/usr/share/doc/*",
        "/usr/share/locale/*",
        "/usr/share/lintian/*",
        "/usr/share/linda/*",
    ),
    # quiet: the serial console stays readable (LAB-READY); fsck.mode=skip: clones are killed, the
    # ext4 journal is replayed at mount anyway; net.ifnames=0: the first NIC is eth0 on every model.
    # apparmor=0: both container engines run unconfined, on the same footing. With AppArmor on and
    # no apparmor_parser, podman runs its containers unconfined but docker refuses its build
    # containers; installing apparmor instead would confine podman's too (every podman figure
    # measured so far would change meaning) and parse profiles at every boot (images/README.md).
    cmdline=f"console=ttyS0 root=LABEL={ROOT_LABEL} rootfstype=ext4 rw net.ifnames=0 fsck.mode=skip quiet apparmor=0",
    disk_mib=4096,
    hostname="lab-debian12",
    packer_template="debian12.pkr.hcl",
    scripts=("scripts/debian-rootfs-essential.sh", "scripts/debian-rootfs-customize.sh", "scripts/provision-debian.sh"),
    template_paths=("image", "nginx.conf.j2", "site", "answers/debian-preseed.cfg.j2"),
    nginx={
        "worker_processes": "auto",
        "worker_connections": 4096,
        "root": "/srv/www",
        "ssl_certificate": "/etc/nginx/lab.crt",
        "ssl_certificate_key": "/etc/nginx/lab.key",
    },
    # essential (no apt) + git and time for clones inside a container; the build tools a
    # Containerfile installs offline (tcc: a C compiler ~0.3 MB, where gcc would add ~150 MB).
    container=ContainerBase(
        name="localhost/lab-base:latest",
        variant="essential",
        packages=("git", "time"),
        cache=("make", "tcc", "libc6-dev"),
        cache_dir="/var/cache/lab-debs",
    ),
)


def _nginx_settings(os_name: str) -> dict[str, Any]:
    cert = osfacts.facts(os_name).nginx.cert_dir
    return {
        "worker_processes": "auto",
        "worker_connections": 4096,
        "root": "/srv/www",
        "ssl_certificate": f"{cert}/lab.crt",
        "ssl_certificate_key": f"{cert}/lab.key",
    }


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
            "recipe_version": RECIPE_VERSION,
            "kind": self.kind,
            "name": self.name,
            "os": self.os,
            "release": self.release,
            "disk_mib": self.disk_mib,
            "hostname": self.hostname,
            "answers": [list(a) for a in self.answers],
            "ready_marker": READY_MARKER,
            "packages": sorted(f.packages.values()),
            "nginx": self.nginx,
            "nginx_paths": f.nginx.__dict__,
            "serial": f.serial_device,
            "install_disk": f.install_disk,
        }


ISO_RECIPES = (
    IsoRecipe(
        name="alpine3",
        os="alpine",
        release="3.21",
        disk_mib=4096,
        packer_template="alpine3.pkr.hcl",
        answers=(("answers/alpine-answers.j2", "answers"), ("answers/alpine-install.sh.j2", "install.sh")),
    ),
    IsoRecipe(
        name="freebsd14",
        os="freebsd",
        release="14.3",
        disk_mib=8192,
        packer_template="freebsd14.pkr.hcl",
        answers=(("answers/freebsd-installerconfig.j2", "installerconfig"),),
    ),
    IsoRecipe(
        name="netbsd10",
        os="netbsd",
        release="10.1",
        disk_mib=8192,
        packer_template="netbsd10.pkr.hcl",
        answers=(("answers/netbsd-install.sh.j2", "install.sh"),),
    ),
    IsoRecipe(
        name="openbsd7",
        os="openbsd",
        release="7.8",
        disk_mib=12288,
        packer_template="openbsd7.pkr.hcl",
        answers=(("answers/openbsd-install.conf.j2", "install.conf"),),
    ),
)

AnyRecipe = Recipe | IsoRecipe
RECIPES: dict[str, AnyRecipe] = {r.name: r for r in (DEBIAN12, *ISO_RECIPES)}


def recipe(name: str) -> AnyRecipe:
    try:
        return RECIPES[name]
    except KeyError:
        known = ", ".join(sorted(RECIPES))
        raise UsageError(f"unknown image {name!r}; known images: {known}") from None
