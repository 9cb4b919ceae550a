"""`lab doctor`: are the prerequisites of a lab here? Each check says ok, warn or fail and why."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import lab
from lab import config, proc, statedir
from lab.backends.libvirt import kvmdevice
from lab.backends.local import KVM_PROBE_FILE
from lab.errors import LabError
from lab.images import packer


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str


def _tool(name: str, version_args: list[str], needed_for: str, required: bool = True) -> Check:
    path = shutil.which(name)
    if not path:
        return Check(name, "fail" if required else "warn", f"not installed (needed for {needed_for}); {lab.SETUP}")
    try:
        res = proc.run([name, *version_args], timeout=15, check=False)
        first = (res.stdout or res.stderr).strip().splitlines()
        return Check(name, "ok", first[0][:80] if first else path)
    except LabError as exc:
        return Check(name, "warn", str(exc))


def probed_accel() -> str | None:
    """The accelerator the local backend's last real boot probe found ("kvm", "tcg"), if any."""
    try:
        return str(json.loads(statedir.read_text(statedir.default_dir() / KVM_PROBE_FILE))["accel"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where it will be made)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _packer_plugins() -> Check:
    try:
        state = packer.plugins_state()
    except LabError as exc:
        return Check("packer plugins", "warn", str(exc))
    return Check("packer plugins", "warn" if " lacks " in state else "ok", state)


def _package_files() -> Check:
    """The templates and Packer templates a run renders and builds from, shipped with the package."""
    needed = [lab.TEMPLATES_DIR / "nginx.conf.j2", lab.PACKER_DIR / "debian12.pkr.hcl"]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        return Check("files", "fail", f"{', '.join(missing)} missing: reinstall the package")
    return Check("files", "ok", f"templates {lab.TEMPLATES_DIR}, packer {lab.PACKER_DIR}")


def run_checks(config_path: str) -> list[Check]:
    checks = [
        _tool("qemu-system-x86_64", ["--version"], "the local backend"),
        _tool("qemu-img", ["--version"], "clones"),
        _tool("packer", ["version"], "building golden images"),
        _tool("mmdebstrap", ["--version"], "building the Debian image"),
        _tool("ssh", ["-V"], "talking to guests"),
        _tool("iperf3", ["--version"], "the iperf3 workloads (client side)"),
        _tool("wrk", ["--version"], "the http/https workloads (client side)", required=False),
    ]
    if shutil.which("packer"):
        checks.append(_packer_plugins())
    # KVM: present is not usable; the verdict of the last real boot probe is cached by the backend.
    kvm = os.path.exists("/dev/kvm")
    state = statedir.default_dir()
    detail = "/dev/kvm present" if kvm else "/dev/kvm absent: TCG only"
    probed = probed_accel()
    if probed:
        detail += f"; last boot probe: {probed}"
    elif not (state / KVM_PROBE_FILE).exists():
        detail += "; not probed yet (the first `lab run` boots a kernel under KVM to find out)"
    checks.append(Check("kvm", "ok" if kvm else "warn", detail))
    kvm_for_libvirt = kvmdevice.qemu_user_problem()
    if kvm_for_libvirt:  # only a libvirt host on this machine is slowed (lab.backends.libvirt.kvmdevice)
        checks.append(Check("kvm for libvirt", "warn", kvm_for_libvirt))
    # The private state directory (run locks, the KVM verdict, the default workdir): this user's alone.
    why = statedir.problem(state)
    checks.append(
        Check(
            "state",
            "fail" if why else "ok",
            f"{state} {why}: remove it (or set ${statedir.STATE_ENV})"
            if why
            else f"{state}" + ("" if state.exists() else " (made on first use, mode 0700)"),
        )
    )
    # Network namespaces need root (CAP_NET_ADMIN); try one for real.
    ns = f"lab-doctor-{os.getpid()}"
    res = proc.run(["ip", "netns", "add", ns], check=False)
    if res.ok:
        proc.run(["ip", "netns", "del", ns], check=False)
        checks.append(Check("netns", "ok", "can create network namespaces, bridges and taps"))
    else:
        checks.append(Check("netns", "fail", f"cannot create a network namespace: {res.stderr.strip()} (run as root)"))
    for where in (_existing(state), Path.cwd()):
        free = shutil.disk_usage(where).free / 2**30
        checks.append(
            Check(f"disk {where}", "ok" if free > 5 else ("warn" if free > 2 else "fail"), f"{free:.1f} GiB free")
        )
    checks.append(_package_files())
    manifests = sorted(lab.IMAGES_DIR.glob("*.json"))
    checks.append(
        Check(
            "images",
            "ok" if manifests else "warn",
            f"{', '.join(m.stem for m in manifests)} in {lab.IMAGES_DIR}"
            if manifests
            else f"none built in {lab.IMAGES_DIR}: run `{lab.BUILD_IMAGE}` (${lab.IMAGES_ENV} moves it)",
        )
    )
    if Path(config_path).exists():
        try:
            cfg = config.load(config_path)
            checks.append(Check("config", "ok", f"{config_path}: {len(cfg.hosts)} host(s)"))
        except LabError as exc:
            checks.append(Check("config", "fail", str(exc)))
    else:
        checks.append(Check("config", "warn", f"{config_path} not found"))
    return checks
