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
    }


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
