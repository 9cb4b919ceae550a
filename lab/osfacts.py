"""Per-OS facts the rest of the lab needs, in one place: the OS's family, NIC device and driver
names, how to set and read a sysctl (and which ones to record), how to read CPU time, memory and
CPU count, where nginx keeps its files, the serial console and the installer's disk, what
hypervisors call it (PVE's ostype, SmartOS imgadm's os), whether warm start can fix it up; and the
tools the workloads run (TOOLS: each tool's package on each OS, in one place).

OS differences live here (and in packer/ and templates/), never in backend x OS classes. The image
builder renders these facts into the answer files and the provisioning stage (lab.images), so the
guest scripts carry no package names or paths of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lab.errors import UsageError
from lab.model import DiskBus, NicModel


@dataclass(frozen=True)
class NginxFacts:
    """Where the OS's nginx package keeps things (templates/nginx.conf.j2 is rendered with these)."""

    user: str
    conf: str  # nginx.conf the service reads
    mime_types: str
    pid: str
    error_log: str
    cert_dir: str  # lab.crt / lab.key go here


# ---------------------------------------------------------------------------------------------
# Tools: what the workloads run in a guest (and the bare-metal host), and the package that brings
# each on every OS whose images carry it. A tool an OS has no entry for is not in its images.

ALL_OSES = ("debian", "bare-metal", "alpine", "freebsd", "netbsd", "openbsd")
# Where a daemon may live when a non-login PATH lacks sbin (Debian/Alpine, FreeBSD/OpenBSD ports, pkgsrc)
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/usr/pkg/sbin")


@dataclass(frozen=True)
class Tool:
    packages: dict[str, str]  # OS -> the package that brings the tool there
    dirs: tuple[str, ...] = ()  # where it may be when `command -v` cannot find it (a daemon in sbin)


def _on(package: str, oses: tuple[str, ...] = ALL_OSES, **named: str) -> dict[str, str]:
    """The package of a tool on each of `oses`: `package`, except where an OS names it otherwise."""
    return {os_name: named.get(os_name.replace("-", "_"), package) for os_name in oses}


TOOLS: dict[str, Tool] = {
    "sysbench": Tool(_on("sysbench")),
    "iperf3": Tool(_on("iperf3")),
    "nginx": Tool(_on("nginx", debian="nginx-light", bare_metal="nginx-light"), dirs=SBIN_DIRS),
    "git": Tool(
        _on("git", ("debian", "alpine", "freebsd", "netbsd", "openbsd"), freebsd="git-lite", netbsd="git-base")
    ),
    "curl": Tool(_on("curl")),
    "podman": Tool(_on("podman", ("debian", "alpine", "freebsd"), freebsd="podman-suite")),
    "hyperfine": Tool(_on("hyperfine", ("debian",))),  # container-start's timer
    "docker": Tool(_on("docker.io", ("debian",))),  # the other container engine (podman-build, runtime)
    "ping": Tool(_on("iputils-ping", ("debian", "bare-metal"))),  # the BSDs' and Alpine's are in their base
    "openssl": Tool(_on("openssl", ("alpine",))),  # the others' base systems have it
    "agent": Tool(_on("qemu-guest-agent", ("alpine", "freebsd"))),  # debian12's recipe lists its own
}


def package(os_name: str, tool: str) -> str:
    """The package that brings `tool` on `os_name` (the tool's own name where no table says)."""
    return TOOLS[tool].packages.get(os_name, tool) if tool in TOOLS else tool


@dataclass(frozen=True)
class OsFacts:
    name: str
    family: str  # "linux" | "freebsd" | "netbsd" | "openbsd"
    # What the OS's kernel has a driver for (see "Drivers" below): a NIC model or disk bus missing
    # from these tables cannot run on this OS, and the plan refuses such a cell.
    nic_device: dict[NicModel, str]  # first NIC's device name per model
    nic_driver: dict[NicModel, str]  # driver name as the guest reports it (nic_driver_cmd)
    disk_driver: dict[DiskBus, str]  # the driver of the disk controller of each bus the lab offers
    # What hypervisors' catalogues call the OS: a Proxmox VM's `ostype`, a SmartOS image manifest's `os`
    pve_ostype: str = "l26"
    imgadm_os: str = "linux"
    # Warm start's identity fix-ups (iproute2 lines through the QEMU guest agent,
    # lab.backends.local.warm) work on it
    warm_fixups: bool = False
    # Shell command printing one line of cumulative CPU ticks; parsed by lab.workloads.cpu.
    cpu_ticks_cmd: str = "head -n1 /proc/stat"
    ncpu_cmd: str = "nproc"
    # Prints total usable memory in KiB.
    mem_kib_cmd: str = "awk '/^MemTotal:/ {print $2}' /proc/meminfo"
    # Prints the driver bound to the first NIC.
    nic_driver_cmd: str = "basename $(readlink /sys/class/net/eth0/device/driver)"
    sysctl_set: str = "sysctl -w {key}={value}"
    sysctl_get: str = "sysctl -n {key}"
    # Keys read back and recorded on every cell, whatever the tuning profile.
    sysctl_watched: tuple[str, ...] = ()
    # templates/sysctl/<dir>/<profile>.j2 (Linux guests share one set of keys)
    sysctl_dir: str = ""
    nginx: NginxFacts = NginxFacts(
        user="www-data",
        conf="/etc/nginx/nginx.conf",
        mime_types="/etc/nginx/mime.types",
        pid="/run/nginx.pid",
        error_log="/var/log/nginx/error.log",
        cert_dir="/etc/nginx",
    )
    # Congestion control (matrix axis `cc`): what the OS ships with, what it can switch to, how to
    # switch (loading the module it needs) and the sysctl that says what is in effect.
    cc_default: str = ""  # "" = the OS has no selectable congestion control (cc axis n/a)
    cc_available: tuple[str, ...] = ()
    cc_set: str = ""  # {cc}: one of cc_available
    cc_key: str = ""
    # Offloads (matrix axis `offloads`): feature -> how to set it on {dev} ({on}: True/False), how to
    # read every feature's state back (parsed by lab.tuning.parse_offloads). A feature not listed
    # here cannot be toggled on this OS (the cell is n/a).
    offload_set: dict[str, str] = field(default_factory=dict)
    offload_get: str = ""
    # WAN emulation inside the guest (lab.wan, when the lab side cannot carry netem): tc netem.
    netem_set: str = ""  # {dev} {args}
    netem_get: str = ""
    netem_clear: str = ""
    serial_device: str = "/dev/ttyS0"  # the first serial port (COM1), where LAB-READY goes
    install_disk: str = "vda"  # the first virtio-blk disk as the installer names it
    shell: str = "/bin/sh"

    @property
    def sysctl_templates(self) -> str:
        return self.sysctl_dir or self.name

    @property
    def packages(self) -> dict[str, str]:
        """Tool -> the package that brings it here, for the tools this OS's images carry (TOOLS)."""
        return {tool: t.packages[self.name] for tool, t in TOOLS.items() if self.name in t.packages}

    def device(self, nic: NicModel) -> str:
        try:
            return self.nic_device[nic]
        except KeyError:
            raise UsageError(f"{self.name} has no driver for NIC model {nic.value!r}") from None

    def has_driver(self, what: NicModel | DiskBus) -> bool:
        """Whether this OS can drive a NIC model or a disk bus."""
        return what in (self.nic_driver if isinstance(what, NicModel) else self.disk_driver)


# ---------------------------------------------------------------------------------------------
# Drivers: which NIC models and disk buses each image's kernel drives, as the lab's hosts emulate
# them (QEMU/PVE: virtio-net-pci, e1000 = 82540EM, e1000e = 82574L, rtl8139 = an RTL8139C+ at PCI
# revision 0x20 (QEMU hw/net/rtl8139.c: `HW_REVID(1, 1, 1, 0, 1, 1, 0) // RTL-8139C+`), vmxnet3;
# disks: virtio-blk, scsi = virtio-scsi (local and libvirt templates, PVE virtio-scsi-single),
# sata = AHCI, ide = PIIX IDE, nvme). Sources:
#   debian   linux-image-amd64 6.1 (bookworm) builds all of them; the golden image's initrd carries
#            the disk ones (packer/scripts/debian-rootfs-customize.sh checks it at build); 8139too
#            leaves a C+ chip (revision >= 0x20) to 8139cp. tests/vm/test_images_boot.py boots each.
#   alpine   the virt kernel of the 3.21 virt ISO (aports main/linux-lts/virt.x86_64.config):
#            VIRTIO_NET, E1000, E1000E, VMXNET3; `# CONFIG_NET_VENDOR_REALTEK is not set`, so no
#            rtl8139. VIRTIO_BLK, SCSI_VIRTIO, SATA_AHCI, ATA_PIIX, BLK_DEV_NVME.
#   freebsd  14.x GENERIC (sys/amd64/conf/GENERIC): vtnet, em (82540 and 82574), re (8139C+:
#            sys/dev/re/if_re.c matches RT_DEVICEID_8139 with RL_HWREV_8139CPLUS, ahead of rl),
#            vmx (vmx(4), since 10.1); virtio_blk (vtbd), virtio_scsi (da), ahci and ata (ada),
#            nvme (nda, nvd before 14.0).
#   netbsd   10.x GENERIC (sys/arch/amd64/conf/GENERIC): vioif, wm (82540 and 82574), re (8139C+:
#            sys/dev/pci/if_re_pci.c returns 2 "to defeat rtk(4)"), vmx; ld at virtio, vioscsi
#            (vioscsi(4): NetBSD 7.1/8.0), ahcisata and piixide (wd), nvme with ld at nvme (nvme(4):
#            NetBSD 8.0; its first man page noted QEMU's emulated controller timing out on
#            identify, not verified here since).
#   openbsd  7.x GENERIC (sys/arch/amd64/conf/GENERIC): vio, em, re (sys/dev/pci/if_re_pci.c takes
#            an RT8139 of revision 0x20), vmx; vioblk and vioscsi (sd), ahci (sd), pciide (wd), nvme
#            (nvme(4): OpenBSD 6.0).
# The BSDs cannot be booted on the machines this project is tested on: their entries come from the
# sources above, not from a boot.

_LINUX_NIC = dict.fromkeys(NicModel, "eth0")  # net.ifnames=0: the first NIC is eth0 whatever drives it
# Linux names its Intel and VMware drivers as the models are named
_LINUX_DRV = {m: {NicModel.VIRTIO: "virtio_net", NicModel.RTL8139: "8139cp"}.get(m, m.value) for m in NicModel}
_LINUX_DISK = {
    DiskBus.VIRTIO: "virtio_blk",
    DiskBus.SCSI: "virtio_scsi",
    DiskBus.SATA: "ahci",
    DiskBus.IDE: "ata_piix",
    DiskBus.NVME: "nvme",
}
_ALPINE_NIC: dict[NicModel, str] = {m: d for m, d in _LINUX_NIC.items() if m is not NicModel.RTL8139}
_ALPINE_DRV: dict[NicModel, str] = {m: d for m, d in _LINUX_DRV.items() if m is not NicModel.RTL8139}


def _bsd_nics(virtio: str, intel: str) -> dict[str, Any]:  # OsFacts keyword arguments
    """A BSD's NIC tables: its virtio and Intel (82540 and 82574 alike) drivers; QEMU's RTL8139C+ is
    re(4) and vmxnet3 vmx(4) on all three. The first interface is the driver's name and unit 0."""
    drivers = {
        NicModel.VIRTIO: virtio,
        NicModel.E1000: intel,
        NicModel.E1000E: intel,
        NicModel.RTL8139: "re",
        NicModel.VMXNET3: "vmx",
    }
    return {"nic_driver": drivers, "nic_device": {m: f"{d}0" for m, d in drivers.items()}}


_BSD_CPU = "sysctl -n kern.cp_time"
_LINUX_WATCHED = (
    "net.ipv4.tcp_congestion_control",
    "net.core.rmem_max",
    "net.core.wmem_max",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
)

# The bare-metal cell (lab.backends.local.baremetal): the CPU time of the cell's own cgroup as a /proc/stat
# line, so the busy % counts the machine-under-test side only, not the load generator that runs on
# the same host. Microseconds: user and system from the cgroup (v2 cpu.stat, which the kernel keeps
# monotonic; v1 cpuacct.usage_user/usage_sys, tick-granular), idle = wall time since LAB_T0 x CPUs
# - busy. The wall clock is read first, the counters after. Without a cgroup: the whole host's.
BARE_METAL_TICKS = (
    "w=$(( ($(date +%s%N) - LAB_T0) / 1000 )); "
    'if [ -r "$LAB_CGROUP/cpu.stat" ]; then '
    'u=$(sed -n "s/^user_usec //p" "$LAB_CGROUP/cpu.stat"); s=$(sed -n "s/^system_usec //p" "$LAB_CGROUP/cpu.stat"); '
    'elif [ -r "$LAB_CGROUP/cpuacct.usage_user" ]; then '
    'u=$(( $(cat "$LAB_CGROUP/cpuacct.usage_user") / 1000 )); s=$(( $(cat "$LAB_CGROUP/cpuacct.usage_sys") / 1000 )); '
    "else exec head -n1 /proc/stat; fi; "
    'i=$(( w * $(nproc) - u - s )); [ "$i" -lt 0 ] && i=0; echo "cpu $u 0 $s $i 0 0 0 0"'
)

# modprobe: bbr (and any cc but the built-in cubic/reno) is a module; a failed load shows as a
# sysctl error naming the algorithm, which apply() reports.
_LINUX_CC: dict[str, Any] = dict(  # OsFacts keyword arguments, shared
    cc_default="cubic",
    cc_available=("cubic", "reno", "bbr", "htcp", "vegas", "westwood"),
    cc_set="modprobe -q tcp_{cc} 2>/dev/null; sysctl -q -w net.ipv4.tcp_congestion_control={cc}",
    cc_key="net.ipv4.tcp_congestion_control",
)
_LINUX_OFFLOADS: dict[str, Any] = dict(  # OsFacts keyword arguments, shared
    offload_set={f: f"ethtool -K {{dev}} {f} {{state}}" for f in ("lro", "tso", "gro")},
    offload_get="ethtool -k {dev}",
    netem_set="modprobe -q sch_netem 2>/dev/null; tc qdisc replace dev {dev} root netem {args}",
    netem_get="tc qdisc show dev {dev}",
    netem_clear="tc qdisc del dev {dev} root 2>/dev/null; true",
)

OSES: dict[str, OsFacts] = {
    "debian": OsFacts(
        name="debian",
        family="linux",
        warm_fixups=True,
        nic_device=_LINUX_NIC,
        nic_driver=_LINUX_DRV,
        disk_driver=_LINUX_DISK,
        sysctl_watched=_LINUX_WATCHED,
        **_LINUX_CC,
        **_LINUX_OFFLOADS,
    ),
    # Not an image: the host itself, as the bare-metal cell sees it (lab.backends.local.baremetal).
    "bare-metal": OsFacts(
        name="bare-metal",
        family="linux",
        nic_device=_LINUX_NIC,
        nic_driver=_LINUX_DRV,
        disk_driver={},  # the host's own disks: there is no bus to choose
        cpu_ticks_cmd=BARE_METAL_TICKS,
    ),
    "alpine": OsFacts(
        name="alpine",
        family="linux",
        nic_device=_ALPINE_NIC,
        nic_driver=_ALPINE_DRV,
        disk_driver=_LINUX_DISK,
        sysctl_watched=_LINUX_WATCHED,
        sysctl_dir="debian",
        **_LINUX_CC,
        **_LINUX_OFFLOADS,
        nginx=NginxFacts(
            user="nginx",
            conf="/etc/nginx/nginx.conf",
            mime_types="/etc/nginx/mime.types",
            pid="/run/nginx/nginx.pid",
            error_log="/var/log/nginx/error.log",
            cert_dir="/etc/nginx",
        ),
    ),
    "freebsd": OsFacts(
        name="freebsd",
        family="freebsd",
        pve_ostype="other",
        imgadm_os="bsd",
        **_bsd_nics(virtio="vtnet", intel="em"),
        disk_driver={
            DiskBus.VIRTIO: "virtio_blk",
            DiskBus.SCSI: "virtio_scsi",
            DiskBus.SATA: "ahci",
            DiskBus.IDE: "ata",
            DiskBus.NVME: "nvme",
        },
        cpu_ticks_cmd=_BSD_CPU,
        ncpu_cmd="sysctl -n hw.ncpu",
        mem_kib_cmd="echo $(( $(sysctl -n hw.physmem) / 1024 ))",
        nic_driver_cmd="ifconfig -l | tr ' ' '\\n' | grep -v '^lo' | head -n1 | sed 's/[0-9]*$//'",
        sysctl_set="sysctl {key}={value}",
        sysctl_watched=("kern.ipc.maxsockbuf", "net.inet.tcp.functions_default"),
        # TCP stacks: "freebsd" is the default; bbr and rack are modules (tcp_bbr, tcp_rack).
        cc_default="freebsd",
        cc_available=("freebsd", "rack", "bbr"),
        cc_set="kldload -n tcp_{cc} 2>/dev/null; sysctl -q net.inet.tcp.functions_default={cc}",
        cc_key="net.inet.tcp.functions_default",
        offload_set={"lro": "ifconfig {dev} {flag}lro", "tso": "ifconfig {dev} {flag}tso"},
        offload_get="ifconfig -m {dev}",
        nginx=NginxFacts(
            user="www",
            conf="/usr/local/etc/nginx/nginx.conf",
            mime_types="/usr/local/etc/nginx/mime.types",
            pid="/var/run/nginx.pid",
            error_log="/var/log/nginx/error.log",
            cert_dir="/usr/local/etc/nginx",
        ),
        serial_device="/dev/ttyu0",
        install_disk="vtbd0",
    ),
    "netbsd": OsFacts(
        name="netbsd",
        family="netbsd",
        pve_ostype="other",
        imgadm_os="bsd",
        **_bsd_nics(virtio="vioif", intel="wm"),
        disk_driver={
            DiskBus.VIRTIO: "ld",
            DiskBus.SCSI: "vioscsi",
            DiskBus.SATA: "ahcisata",
            DiskBus.IDE: "piixide",
            DiskBus.NVME: "nvme",
        },
        cpu_ticks_cmd=_BSD_CPU,
        ncpu_cmd="sysctl -n hw.ncpu",
        mem_kib_cmd="echo $(( $(sysctl -n hw.physmem64) / 1024 ))",
        nic_driver_cmd="ifconfig -l | tr ' ' '\\n' | grep -v '^lo' | head -n1 | sed 's/[0-9]*$//'",
        sysctl_set="sysctl -w {key}={value}",
        sysctl_watched=("kern.sbmax", "net.inet.tcp.congctl.selected"),
        cc_default="newreno",
        cc_available=("newreno", "cubic"),
        cc_set="sysctl -q -w net.inet.tcp.congctl.selected={cc}",
        cc_key="net.inet.tcp.congctl.selected",
        nginx=NginxFacts(
            user="nginx",
            conf="/usr/pkg/etc/nginx/nginx.conf",
            mime_types="/usr/pkg/etc/nginx/mime.types",
            pid="/var/run/nginx.pid",
            error_log="/var/log/nginx/error.log",
            cert_dir="/usr/pkg/etc/nginx",
        ),
        serial_device="/dev/tty00",
        install_disk="ld0",
    ),
    "openbsd": OsFacts(
        name="openbsd",
        family="openbsd",
        pve_ostype="other",
        imgadm_os="bsd",
        **_bsd_nics(virtio="vio", intel="em"),
        disk_driver={
            DiskBus.VIRTIO: "vioblk",
            DiskBus.SCSI: "vioscsi",
            DiskBus.SATA: "ahci",
            DiskBus.IDE: "pciide",
            DiskBus.NVME: "nvme",
        },
        # nginx: OpenBSD's package chroots to /var/www unless started with -u (see provision-openbsd.sh)
        nginx=NginxFacts(
            user="www",
            conf="/etc/nginx/nginx.conf",
            mime_types="/etc/nginx/mime.types",
            pid="/var/run/nginx.pid",
            error_log="/var/www/logs/error.log",
            cert_dir="/etc/nginx",
        ),
        serial_device="/dev/tty00",
        install_disk="sd0",
        cpu_ticks_cmd=_BSD_CPU,
        ncpu_cmd="sysctl -n hw.ncpuonline",
        mem_kib_cmd="echo $(( $(sysctl -n hw.physmem) / 1024 ))",
        nic_driver_cmd="ifconfig -l | tr ' ' '\\n' | grep -v '^lo' | grep -v enc | grep -v pflog | head -n1"
        " | sed 's/[0-9]*$//'",
        sysctl_set="sysctl {key}={value}",
    ),
}


def facts(os_name: str) -> OsFacts:
    try:
        return OSES[os_name]
    except KeyError:
        raise UsageError(f"unknown OS {os_name!r}; known: {', '.join(sorted(OSES))}") from None
