"""Per-OS facts the rest of the lab needs, in one place: NIC device and driver names, how to set
and read a sysctl (and which ones to record), how to read CPU time, memory and CPU count, package
names, where nginx keeps its files, the serial console and the installer's disk.

OS differences live here (and in packer/ and templates/), never in backend x OS classes. The image
builder renders these facts into the answer files and the provisioning stage (lab.images), so the
guest scripts carry no package names or paths of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lab.errors import UsageError
from lab.model import NicModel


@dataclass(frozen=True)
class NginxFacts:
    """Where the OS's nginx package keeps things (templates/nginx.conf.j2 is rendered with these)."""

    user: str
    conf: str  # nginx.conf the service reads
    mime_types: str
    pid: str
    error_log: str
    cert_dir: str  # lab.crt / lab.key go here


@dataclass(frozen=True)
class OsFacts:
    name: str
    family: str  # "linux" | "freebsd" | "netbsd" | "openbsd"
    nic_device: dict[NicModel, str]  # first NIC's device name per model
    nic_driver: dict[NicModel, str]  # driver name as the guest reports it
    packages: dict[str, str] = field(default_factory=dict)  # logical name -> package name
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
    nginx: NginxFacts = NginxFacts(user="www-data", conf="/etc/nginx/nginx.conf",
                                   mime_types="/etc/nginx/mime.types", pid="/run/nginx.pid",
                                   error_log="/var/log/nginx/error.log", cert_dir="/etc/nginx")
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

    def device(self, nic: NicModel) -> str:
        try:
            return self.nic_device[nic]
        except KeyError:
            raise UsageError(f"{self.name} has no driver for NIC model {nic.value!r}") from None


_LINUX_NIC = {NicModel.VIRTIO: "eth0", NicModel.E1000: "eth0", NicModel.E1000E: "eth0",
              NicModel.RTL8139: "eth0", NicModel.VMXNET3: "eth0"}
_LINUX_DRV = {NicModel.VIRTIO: "virtio_net", NicModel.E1000: "e1000", NicModel.E1000E: "e1000e",
              NicModel.RTL8139: "8139cp", NicModel.VMXNET3: "vmxnet3"}

_BSD_CPU = "sysctl -n kern.cp_time"
_LINUX_WATCHED = ("net.ipv4.tcp_congestion_control", "net.core.rmem_max", "net.core.wmem_max",
                  "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")

# The bare-metal cell (lab.baremetal): the CPU time of the cell's own cgroup as a /proc/stat
# line, so the busy % counts the machine-under-test side only, not the load generator that runs on
# the same host. Microseconds: user and system from the cgroup (v2 cpu.stat, which the kernel keeps
# monotonic; v1 cpuacct.usage_user/usage_sys, tick-granular), idle = wall time since LAB_T0 x CPUs
# - busy. The wall clock is read first, the counters after. Without a cgroup: the whole host's.
BARE_METAL_TICKS = (
    'w=$(( ($(date +%s%N) - LAB_T0) / 1000 )); '
    'if [ -r "$LAB_CGROUP/cpu.stat" ]; then '
    'u=$(sed -n "s/^user_usec //p" "$LAB_CGROUP/cpu.stat"); s=$(sed -n "s/^system_usec //p" "$LAB_CGROUP/cpu.stat"); '
    'elif [ -r "$LAB_CGROUP/cpuacct.usage_user" ]; then '
    'u=$(( $(cat "$LAB_CGROUP/cpuacct.usage_user") / 1000 )); s=$(( $(cat "$LAB_CGROUP/cpuacct.usage_sys") / 1000 )); '
    'else exec head -n1 /proc/stat; fi; '
    'i=$(( w * $(nproc) - u - s )); [ "$i" -lt 0 ] && i=0; echo "cpu $u 0 $s $i 0 0 0 0"'
)

# modprobe: bbr (and any cc but the built-in cubic/reno) is a module; a failed load shows as a
# sysctl error naming the algorithm, which apply() reports.
_LINUX_CC = dict(cc_default="cubic", cc_available=("cubic", "reno", "bbr", "htcp", "vegas", "westwood"),
                 cc_set="modprobe -q tcp_{cc} 2>/dev/null; sysctl -q -w net.ipv4.tcp_congestion_control={cc}",
                 cc_key="net.ipv4.tcp_congestion_control")
_LINUX_OFFLOADS = dict(
    offload_set={f: f"ethtool -K {{dev}} {f} {{state}}" for f in ("lro", "tso", "gro")},
    offload_get="ethtool -k {dev}",
    netem_set="modprobe -q sch_netem 2>/dev/null; tc qdisc replace dev {dev} root netem {args}",
    netem_get="tc qdisc show dev {dev}",
    netem_clear="tc qdisc del dev {dev} root 2>/dev/null; true",
)

OSES: dict[str, OsFacts] = {
    "debian": OsFacts(
        name="debian", family="linux", nic_device=_LINUX_NIC, nic_driver=_LINUX_DRV,
        packages={"sysbench": "sysbench", "iperf3": "iperf3", "nginx": "nginx-light", "git": "git",
                  "curl": "curl", "podman": "podman"},
        sysctl_watched=_LINUX_WATCHED, **_LINUX_CC, **_LINUX_OFFLOADS,
    ),
    # Not an image: the host itself, as the bare-metal cell sees it (lab.baremetal).
    "bare-metal": OsFacts(
        name="bare-metal", family="linux", nic_device=_LINUX_NIC, nic_driver=_LINUX_DRV,
        packages={"sysbench": "sysbench", "iperf3": "iperf3", "nginx": "nginx-light", "curl": "curl"},
        cpu_ticks_cmd=BARE_METAL_TICKS,
    ),
    "alpine": OsFacts(
        name="alpine", family="linux", nic_device=_LINUX_NIC, nic_driver=_LINUX_DRV,
        packages={"sysbench": "sysbench", "iperf3": "iperf3", "nginx": "nginx", "git": "git",
                  "curl": "curl", "podman": "podman", "openssl": "openssl",
                  "agent": "qemu-guest-agent"},
        sysctl_watched=_LINUX_WATCHED, sysctl_dir="debian", **_LINUX_CC, **_LINUX_OFFLOADS,
        nginx=NginxFacts(user="nginx", conf="/etc/nginx/nginx.conf", mime_types="/etc/nginx/mime.types",
                         pid="/run/nginx/nginx.pid", error_log="/var/log/nginx/error.log",
                         cert_dir="/etc/nginx"),
    ),
    "freebsd": OsFacts(
        name="freebsd", family="freebsd",
        nic_device={NicModel.VIRTIO: "vtnet0", NicModel.E1000: "em0", NicModel.E1000E: "em0"},
        nic_driver={NicModel.VIRTIO: "vtnet", NicModel.E1000: "em", NicModel.E1000E: "em"},
        packages={"sysbench": "sysbench", "iperf3": "iperf3", "nginx": "nginx", "git": "git-lite",
                  "curl": "curl", "podman": "podman-suite", "agent": "qemu-guest-agent"},
        cpu_ticks_cmd=_BSD_CPU, ncpu_cmd="sysctl -n hw.ncpu", mem_kib_cmd="echo $(( $(sysctl -n hw.physmem) / 1024 ))",
        nic_driver_cmd="ifconfig -l | tr ' ' '\\n' | grep -v '^lo' | head -n1 | sed 's/[0-9]*$//'",
        sysctl_set="sysctl {key}={value}",
        sysctl_watched=("kern.ipc.maxsockbuf", "net.inet.tcp.functions_default"),
        # TCP stacks: "freebsd" is the default; bbr and rack are modules (tcp_bbr, tcp_rack).
        cc_default="freebsd", cc_available=("freebsd", "rack", "bbr"),
        cc_set="kldload -n tcp_{cc} 2>/dev/null; sysctl -q net.inet.tcp.functions_default={cc}",
        cc_key="net.inet.tcp.functions_default",
        offload_set={"lro": "ifconfig {dev} {flag}lro", "tso": "ifconfig {dev} {flag}tso"},
        offload_get="ifconfig -m {dev}",
        nginx=NginxFacts(user="www", conf="/usr/local/etc/nginx/nginx.conf",
                         mime_types="/usr/local/etc/nginx/mime.types", pid="/var/run/nginx.pid",
                         error_log="/var/log/nginx/error.log", cert_dir="/usr/local/etc/nginx"),
        serial_device="/dev/ttyu0", install_disk="vtbd0",
    ),
    "netbsd": OsFacts(
        name="netbsd", family="netbsd",
        nic_device={NicModel.VIRTIO: "vioif0", NicModel.E1000: "wm0", NicModel.E1000E: "wm0"},
        nic_driver={NicModel.VIRTIO: "vioif", NicModel.E1000: "wm", NicModel.E1000E: "wm"},
        packages={"sysbench": "sysbench", "iperf3": "iperf3", "nginx": "nginx", "git": "git-base",
                  "curl": "curl"},
        cpu_ticks_cmd=_BSD_CPU, ncpu_cmd="sysctl -n hw.ncpu", mem_kib_cmd="echo $(( $(sysctl -n hw.physmem64) / 1024 ))",
        nic_driver_cmd="ifconfig -l | tr ' ' '\\n' | grep -v '^lo' | head -n1 | sed 's/[0-9]*$//'",
        sysctl_set="sysctl -w {key}={value}",
        sysctl_watched=("kern.sbmax", "net.inet.tcp.congctl.selected"),
        cc_default="newreno", cc_available=("newreno", "cubic"),
        cc_set="sysctl -q -w net.inet.tcp.congctl.selected={cc}", cc_key="net.inet.tcp.congctl.selected",
        nginx=NginxFacts(user="nginx", conf="/usr/pkg/etc/nginx/nginx.conf",
                         mime_types="/usr/pkg/etc/nginx/mime.types", pid="/var/run/nginx.pid",
                         error_log="/var/log/nginx/error.log", cert_dir="/usr/pkg/etc/nginx"),
        serial_device="/dev/tty00", install_disk="ld0",
    ),
    "openbsd": OsFacts(
        name="openbsd", family="openbsd",
        nic_device={NicModel.VIRTIO: "vio0", NicModel.E1000: "em0", NicModel.E1000E: "em0"},
        nic_driver={NicModel.VIRTIO: "vio", NicModel.E1000: "em", NicModel.E1000E: "em"},
        packages={"sysbench": "sysbench", "iperf3": "iperf3", "nginx": "nginx", "git": "git",
                  "curl": "curl"},
        # nginx: OpenBSD's package chroots to /var/www unless started with -u (see provision-openbsd.sh)
        nginx=NginxFacts(user="www", conf="/etc/nginx/nginx.conf", mime_types="/etc/nginx/mime.types",
                         pid="/var/run/nginx.pid", error_log="/var/www/logs/error.log", cert_dir="/etc/nginx"),
        serial_device="/dev/tty00", install_disk="sd0",
        cpu_ticks_cmd=_BSD_CPU, ncpu_cmd="sysctl -n hw.ncpuonline", mem_kib_cmd="echo $(( $(sysctl -n hw.physmem) / 1024 ))",
        nic_driver_cmd="ifconfig -l | tr ' ' '\\n' | grep -v '^lo' | grep -v enc | grep -v pflog | head -n1 | sed 's/[0-9]*$//'",
        sysctl_set="sysctl {key}={value}",
    ),
}


def facts(os_name: str) -> OsFacts:
    try:
        return OSES[os_name]
    except KeyError:
        raise UsageError(f"unknown OS {os_name!r}; known: {', '.join(sorted(OSES))}") from None
