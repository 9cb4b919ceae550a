"""Host fingerprints: what a result depends on besides the cell (CPU, microcode, cores, governor,
mitigations, kernel, hypervisor and tool versions, NIC drivers, bridge MTUs). Stored once per
distinct fingerprint, linked to each run on that host; `lab snapshot HOST` stores one too, and
`lab compare` shows the facts that differ between the two sides next to the results.

Facts that change by themselves (clock speed, load, free memory) are left out: a fingerprint
changes when the host does. The local host is read from /proc and /sys; a libvirt host from its
capabilities (host CPU model, microcode, topology) and versions; a Proxmox host from the
versions its API reports (lab.backends.proxmox facts)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from lab import proc
from lab.errors import AuthError, HostUnreachable, LabError
from lab.model import Client


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def cpuinfo_field(text: str, name: str) -> str:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def local_facts() -> dict[str, Any]:
    """Facts of the machine this process runs on (pure reads of /proc and /sys)."""
    cpuinfo = _read("/proc/cpuinfo")
    vuln_dir = Path("/sys/devices/system/cpu/vulnerabilities")
    mitigations = {p.name: _read(str(p)) for p in sorted(vuln_dir.glob("*"))} if vuln_dir.is_dir() else {}
    meminfo = _read("/proc/meminfo")
    flags = cpuinfo_field(cpuinfo, "flags").split()
    return {
        "cpu_model": cpuinfo_field(cpuinfo, "model name"),
        "microcode": cpuinfo_field(cpuinfo, "microcode"),
        "cores": os.cpu_count(),
        "mem_kib": int(cpuinfo_field(meminfo, "MemTotal").split()[0]) if "MemTotal" in meminfo else None,
        "governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor") or "n/a",
        "mitigations": mitigations,
        "kernel": platform.release(),
        "os": _read("/etc/debian_version") and f"Debian {_read('/etc/debian_version')}" or platform.platform(),
        "virt_flags": sorted(set(flags) & {"vmx", "svm", "hypervisor"}),
        "kvm_device": os.path.exists("/dev/kvm"),
        "cores_per_socket": _int(cpuinfo_field(cpuinfo, "cpu cores")),
        "sockets": len({v for v in _cpuinfo_all(cpuinfo, "physical id")}) or None,
        "smt": _read("/sys/devices/system/cpu/smt/control") or "n/a",
        "nics": nic_drivers(Path("/sys/class/net")),
        "bridges": bridge_mtus(Path("/sys/class/net")),
        "tools": host_tools(),
        # what of the host the lab (and every QEMU it starts) may use: a CPU quota on its cgroup (a
        # systemd slice's CPUQuota=, a container's --cpus) or an affinity (taskset) caps every guest
        "cpu_quota": cpu_quota(Path("/proc/self")),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        **({"machine_id": machine} if (machine := machine_id()) else {}),
    }


def machine_id() -> str:
    """Which machine this is, so that the `local` hosts of two orchestrators whose stores are merged
    (lab import) stay two hosts: a hash of /etc/machine-id (the id itself is not to be published,
    machine-id(5)), "" where there is none."""
    text = _read("/etc/machine-id") or _read("/var/lib/dbus/machine-id")
    return hashlib.sha256(f"lab:{text}".encode()).hexdigest()[:16] if text else ""


# -- the cgroup's CPU quota -------------------------------------------------------------------------


def cgroup_paths(text: str) -> dict[str, str]:
    """Pure: /proc/<pid>/cgroup -> controller -> the process's cgroup in that hierarchy ("" is the
    cgroup v2 hierarchy)."""
    out = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def cgroup_mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """Pure: /proc/<pid>/mountinfo -> controller ("" for cgroup2) -> (mount point, the cgroup that
    is its root)."""
    out: dict[str, tuple[str, str]] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if len(fields) < 5 or len(kind) < 3:
            continue
        root, point = (f.replace("\\040", " ") for f in fields[3:5])
        if kind[0] == "cgroup2":
            out.setdefault("", (point, root))
        elif kind[0] == "cgroup":
            for option in kind[2].split(","):
                out.setdefault(option, (point, root))
    return out


def quota_cpus(quota: str, period: str) -> float | None:
    """Pure: a cgroup's quota over its period as CPUs (cgroup v1 cpu.cfs_quota_us, "-1" for none, and
    cpu.cfs_period_us; v2 the two fields of cpu.max, "max" for none); None: no limit."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _quota_in(cgroup: Path, v2: bool) -> float | None:
    if v2:
        fields = _read(str(cgroup / "cpu.max")).split()
        return quota_cpus(*fields) if len(fields) == 2 else None
    return quota_cpus(_read(str(cgroup / "cpu.cfs_quota_us")), _read(str(cgroup / "cpu.cfs_period_us")))


def cpu_quota(proc_self: Path) -> str:
    """The tightest CPU quota between the cgroup this process runs in and its hierarchy's root (v1's
    cpu controller, v2's cpu.max), as "0.5 CPUs", or "none"."""
    paths = cgroup_paths(_read(str(proc_self / "cgroup")))
    mounts = cgroup_mounts(_read(str(proc_self / "mountinfo")))
    limits = []
    for controller in ("cpu", ""):
        if controller not in paths or controller not in mounts:
            continue
        point, root = mounts[controller]
        top = Path(point)
        here = top / os.path.relpath(paths[controller], root) if paths[controller].startswith(root) else top
        for cgroup in (here, *here.parents):
            limits.append(_quota_in(cgroup, v2=controller == ""))
            if cgroup == top:
                break
    found = [x for x in limits if x is not None]
    return f"{min(found):g} CPUs" if found else "none"


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _cpuinfo_all(text: str, name: str) -> list[str]:
    return [v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if k.strip() == name]


def nic_drivers(sys_class_net: Path) -> dict[str, str]:
    """Interfaces backed by a device -> "driver, MTU n" (virtual ones, lo, taps, have no device)."""
    out = {}
    for dev in sorted(sys_class_net.glob("*")):
        driver = dev / "device" / "driver"
        if driver.exists():
            out[dev.name] = f"{os.path.basename(os.readlink(driver))}, MTU {_read(str(dev / 'mtu')) or '?'}"
    return out


def bridge_mtus(sys_class_net: Path) -> dict[str, str]:
    """Bridges on the host -> their MTU (the lab's own bridge lives in each run's namespace; its MTU
    is in the run's manifest)."""
    return {dev.name: _read(str(dev / "mtu")) for dev in sorted(sys_class_net.glob("*")) if (dev / "bridge").is_dir()}


# Host-side tools whose version shapes results: the hypervisor and the load generators.
HOST_TOOLS = {
    "qemu": ["qemu-system-x86_64", "--version"],
    "iperf3": ["iperf3", "--version"],
    "wrk": ["wrk", "-v"],
    "sysbench": ["sysbench", "--version"],
    "nginx": ["nginx", "-v"],
    "libvirt": ["libvirtd", "--version"],
}


def host_tools() -> dict[str, str]:
    out = {}
    for name, argv in HOST_TOOLS.items():
        try:
            res = proc.run(argv, timeout=10, check=False)
        except LabError:
            continue  # not installed
        text = (res.stdout + res.stderr).strip()
        out[name] = text.splitlines()[0].strip() if text else "?"
    return out


def libvirt_host_facts(capabilities_xml: str) -> dict[str, Any]:
    """Pure: the host part of a libvirt capabilities document -> CPU model, vendor, microcode,
    topology (what the hypervisor host is, whatever the driver: QEMU/KVM or bhyve)."""
    cpu = ET.fromstring(capabilities_xml).find("host/cpu")
    if cpu is None:
        return {}
    out: dict[str, Any] = {}
    for tag in ("arch", "model", "vendor"):
        el = cpu.find(tag)
        text = (el.text or "").strip() if el is not None else ""
        if text:
            out[f"cpu_{tag}" if tag != "model" else "cpu_model"] = text
    mc = cpu.find("microcode")
    version = mc.get("version") if mc is not None else None
    if version:
        out["microcode"] = hex(int(version))
    topo = cpu.find("topology")
    if topo is not None:
        out["topology"] = {k: int(v) for k, v in topo.attrib.items() if v.isdigit()}
    return out


def snapshot(host: str, backend) -> dict[str, Any]:  # a lab.backends.Backend (which imports this module)
    """A host's fingerprint: what the host is (its backend's host_facts) and the backend's facts."""
    facts: dict[str, Any] = {"host": host, "backend": backend.name}
    try:
        facts.update(backend.host_facts())
    except (AuthError, HostUnreachable):
        raise  # a look that did not happen is not a fingerprint: nothing is stored
    except Exception as exc:  # other facts are informative; a failure to gather them is recorded, not fatal
        facts["host_facts_error"] = str(exc)
    try:
        facts.update({f"backend_{k}": v for k, v in backend.facts().items() if v is not None})
    except (AuthError, HostUnreachable):
        raise
    except Exception as exc:
        facts["backend_facts_error"] = str(exc)
    return facts


def run_bridge_mtu(client: Client) -> str | None:
    """The MTU of the bridge of a local run's namespace (None for other backends)."""
    if not client.netns:
        return None
    res = proc.run(["ip", "-n", client.netns, "-o", "link", "show", "br0"], check=False, timeout=10)
    parts = res.stdout.split()
    return parts[parts.index("mtu") + 1] if "mtu" in parts else None


def fingerprint(facts: dict[str, Any]) -> str:
    stable = {k: v for k, v in facts.items() if k not in ("backend_accel",)}
    return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]


def differences(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """Pure: (fact, value in a, value in b) for every fact that differs, nested facts dotted
    (mitigations.spectre_v2). A side that is None is "missing"."""
    fa, fb = flatten(a or {}), flatten(b or {})
    out = []
    for k in list(fa) + [k for k in fb if k not in fa]:
        va = fa.get(k, "missing" if a is None else "–")
        vb = fb.get(k, "missing" if b is None else "–")
        if va != vb:
            out.append((k, va, vb))
    return out


def flatten(facts: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested facts as dotted keys with printable values."""
    out: dict[str, str] = {}
    for k, v in facts.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = ", ".join(str(x) for x in v)
        elif v is None:
            out[key] = "–"
        else:
            out[key] = str(v)
    return out
