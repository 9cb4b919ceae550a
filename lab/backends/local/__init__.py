"""The local backend: QEMU on this machine.

Its modules, by job: `settings` (the typed `[hosts.NAME]` table), `qemu` (QEMU command lines and
boot files), `kvm` (the KVM probe and its cache), `host` (namespaces, taps, veths, cgroups and
processes on this machine), `layout` (names and lease files gc finds things by), `baremetal` (the
host itself as a cell), `monitor` (QMP and the guest agent), `warm` (warm start: post-boot
snapshots and their restored clones), `hostload` (this machine's CPU time and the lab's share of
it) and `backend` (LocalBackend, the Backend seam). The names below are what
the bench, the tests and the PVE emulator use.
"""

from lab.backends.local.backend import BACKEND, LocalBackend, lab_key
from lab.backends.local.baremetal import BareMetal
from lab.backends.local.host import (
    exited,
    kill_pid,
    list_netns,
    netns_exists,
    qemu_processes,
    remove_cgroup,
    remove_netns,
    stop_process,
)
from lab.backends.local.kvm import KVM_PROBE_CACHE, KVM_PROBE_FILE, probe_kvm
from lab.backends.local.layout import netns_name
from lab.backends.local.qemu import (
    NIC_DEVICE,
    QEMU,
    READY_MARKER,
    boot_files,
    disk_args,
    machine_args,
    qemu_argv,
    qemu_version,
)
from lab.backends.local.settings import Settings, capabilities

__all__ = [
    "BACKEND",
    "BareMetal",
    "KVM_PROBE_CACHE",
    "KVM_PROBE_FILE",
    "LocalBackend",
    "NIC_DEVICE",
    "QEMU",
    "READY_MARKER",
    "Settings",
    "boot_files",
    "capabilities",
    "disk_args",
    "exited",
    "kill_pid",
    "lab_key",
    "list_netns",
    "machine_args",
    "netns_exists",
    "netns_name",
    "probe_kvm",
    "qemu_argv",
    "qemu_processes",
    "qemu_version",
    "remove_cgroup",
    "remove_netns",
    "stop_process",
]
