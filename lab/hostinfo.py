"""Host fingerprints: what a result depends on besides the cell (CPU, microcode, kernel,
hypervisor versions, mitigations). Stored once per distinct fingerprint, linked to each run."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any


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
    }


def snapshot(host: str, backend) -> dict[str, Any]:
    facts: dict[str, Any] = {"host": host, "backend": backend.name}
    if backend.name == "local":
        facts.update(local_facts())
    try:
        facts.update({f"backend_{k}": v for k, v in backend.facts().items() if v is not None})
    except Exception as exc:  # facts are informative; a failure to gather them is recorded, not fatal
        facts["backend_facts_error"] = str(exc)
    return facts


def fingerprint(facts: dict[str, Any]) -> str:
    stable = {k: v for k, v in facts.items() if k not in ("backend_accel",)}
    return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]
