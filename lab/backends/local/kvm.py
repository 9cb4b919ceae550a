"""Is KVM usable here? /dev/kvm existing does not say: nested KVM hangs guests on some hosts.

The probe boots the image's kernel under KVM once and waits for it to reach init; silence means
TCG. The verdict is a fact of the machine, cached in one place for every workdir (KVM_PROBE_FILE
in the lab's private state directory, lab.statedir: root reads it) and keyed by the host kernel and
QEMU version (`lab doctor` shows the last one).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import time
from pathlib import Path

from lab import proc, statedir
from lab.backends.local.host import stop_process
from lab.backends.local.qemu import QEMU, boot_files, qemu_version
from lab.errors import LabError
from lab.model import Accel, ImageRef
from lab.wait import wait_until

KVM_PROBE_FILE = "kvm-probe.json"
KVM_PROBE_CACHE = statedir.default_dir() / KVM_PROBE_FILE  # the default state directory's, at import
PROBE_MARKER = re.compile(rb"Run /init as init process|Freeing unused kernel")


def probe_argv(kernel: Path, initrd: Path, console: Path) -> list[str]:
    """Pure: a kernel under KVM with the least around it, printing to `console`, off at a panic."""
    return [
        QEMU,
        "-name",
        "kvm-probe",
        "-machine",
        "pc,accel=kvm",
        "-cpu",
        "host",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-m",
        "256",
        "-kernel",
        str(kernel),
        "-initrd",
        str(initrd),
        "-append",
        "console=ttyS0 earlyprintk=serial panic=-1",
        "-no-reboot",
        "-serial",
        f"file:{console}",
    ]


def probe_key() -> str:
    """What the verdict depends on: the host kernel and the QEMU version."""
    return f"{platform.release()}|{qemu_version()}"


def cached(cache: Path, key: str) -> Accel | None:
    """The cached verdict for `key`, if there is one."""
    try:
        entry = json.loads(statedir.read_text(cache))  # a symbolic link planted there is not followed
        return Accel(entry["accel"]) if entry.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def probe_kvm(image: ImageRef, workdir: Path, timeout: float = 15.0, cache: Path = KVM_PROBE_CACHE) -> Accel:
    """KVM if a kernel under KVM reaches init within `timeout`, else TCG; cached per machine."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return Accel.TCG
    key = probe_key()
    known = cached(cache, key)
    if known is not None:
        return known
    kernel, initrd, _ = boot_files(image)
    probe_dir = workdir / f"kvm-probe-{os.getpid()}"
    probe_dir.mkdir(parents=True, exist_ok=True)
    console = probe_dir / "console.log"

    def reached_init() -> bool:
        return console.exists() and PROBE_MARKER.search(console.read_bytes()) is not None

    p = proc.spawn(probe_argv(kernel, initrd, console))
    verdict = Accel.TCG
    try:
        wait_until(
            lambda: p.poll() is not None or reached_init(),
            timeout=timeout,
            what="a kernel under KVM to reach init",
            interval=0.1,
            max_interval=0.5,
        )
        if reached_init():
            verdict = Accel.KVM
    except LabError:
        verdict = Accel.TCG
    finally:
        stop_process(p)
        shutil.rmtree(probe_dir, ignore_errors=True)
    record(cache, key, verdict)
    return verdict


def record(cache: Path, key: str, verdict: Accel) -> None:
    """Write `verdict` for `key` to `cache` (a parallel run reads the old verdict or the new one)."""
    statedir.ensure(cache.parent)
    statedir.write_text(cache, json.dumps({"key": key, "accel": verdict.value, "probed_at": time.time()}))
