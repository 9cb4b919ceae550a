"""QEMU as the local backend runs it: the command line of a VM (pure), its boot files, its version.

`make bench` builds its bare boot from the same `qemu_argv`, and the PVE emulator its guests from
`NIC_DEVICE` and `disk_args`, so a measured difference is never a difference in flags.
"""

from __future__ import annotations

from pathlib import Path

from lab import images, proc
from lab.errors import LabError, UsageError
from lab.model import Accel, DiskBus, ImageRef, NicModel, VmSpec, named_as_lab

QEMU = "qemu-system-x86_64"
QBOOT = Path("/usr/share/qemu/qboot.rom")  # a fast firmware for direct kernel boot, where installed
READY_MARKER = b"LAB-READY"  # the golden image prints it on the serial console once sshd listens
DEFAULT_CMDLINE = "console=ttyS0 root=LABEL=labroot rw net.ifnames=0"

# The NIC models the local backend offers (Capabilities.nic_models): QEMU's -device per model, which
# names all but virtio-net as the lab does.
NIC_DEVICE = {NicModel.VIRTIO: "virtio-net-pci", **named_as_lab(*(m for m in NicModel if m is not NicModel.VIRTIO))}

DISK_DEVICES = {
    DiskBus.VIRTIO: ["-device", "virtio-blk-pci,drive=d0"],
    DiskBus.SCSI: ["-device", "virtio-scsi-pci,id=scsi0", "-device", "scsi-hd,drive=d0,bus=scsi0.0"],
    DiskBus.SATA: ["-device", "ahci,id=ahci0", "-device", "ide-hd,drive=d0,bus=ahci0.0"],
    DiskBus.IDE: ["-device", "ide-hd,drive=d0,bus=ide.0"],
    DiskBus.NVME: ["-device", "nvme,drive=d0,serial=lab0"],
}


# A warm shape's extra devices: the VM generation ID and the guest agent's port (its chardev qga0
# is per VM). The same list, in the same order, in the snapshot and in every clone of it.
WARM_DEVICES = [
    "-device",
    "vmgenid,guid=auto",
    "-device",
    "virtio-serial-pci,id=vser0",
    "-device",
    "virtserialport,bus=vser0.0,chardev=qga0,name=org.qemu.guest_agent.0",
]


def opt(value: object) -> str:
    """Pure: a value inside a QEMU option list (-drive, -object, -chardev, -qmp unix:): QEMU splits
    those at commas and reads ",," as one comma, so a comma in a path (a workdir, $LAB_STATE_DIR)
    is doubled here, the one place, and can never add an option of its own."""
    return str(value).replace(",", ",,")


def disk_args(bus: DiskBus, path: Path) -> list[str]:
    """Pure: the drive and its controller on `bus`."""
    drive = ["-drive", f"file={opt(path)},if=none,id=d0,format=qcow2,cache=writeback,discard=unmap"]
    return drive + DISK_DEVICES[bus]


def machine_args(accel: Accel, tcg_threads: str = "multi", options: str = "") -> list[str]:
    """Pure: -machine (pc with `options`) and its accelerator. Under TCG, `tcg_threads` "single"
    runs all of a VM's vCPUs on one host thread instead of one each ([hosts.NAME] tcg_threads).
    QEMU refuses `-machine accel=` beside `-accel`, so that mode names the accelerator with -accel."""
    if accel is Accel.TCG and tcg_threads == "single":
        return ["-machine", f"pc{options}", "-accel", "tcg,thread=single"]
    return ["-machine", f"pc,accel={accel.value}{options}"]


def qemu_argv(
    spec: VmSpec,
    *,
    accel: Accel,
    vmdir: Path,
    kernel: Path,
    initrd: Path,
    cmdline: str,
    tap: str,
    gateway: str,
    prefix: int = 24,
    qboot: Path = QBOOT,
    ram: Path | None = None,
    ram_shared: bool = False,
    incoming: bool = False,
    tcg_threads: str = "multi",
) -> list[str]:
    """Pure but for whether `qboot` exists: the QEMU command line for a VM (also `make bench`'s bare boot).

    With `ram` the machine is a warm shape (lab.backends.local.warm): its RAM lives in that file
    (written through when `ram_shared`: the snapshot being made; mapped private otherwise: a clone,
    copy on write), it has a guest agent channel (`qga.sock`) and a VM generation ID (a restored
    guest reseeds its RNG from it), and boots SeaBIOS: qboot hangs with vmgenid. `incoming` waits
    for a migration stream (`-incoming defer`) instead of booting."""
    append = f"{cmdline} lab.ip={spec.ip}/{prefix} lab.gw={gateway}".strip()
    argv = [
        QEMU,
        "-name",
        f"{spec.name},process={spec.name}",
        *machine_args(accel, tcg_threads, ",memory-backend=ram0" if ram else ""),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-smp",
        str(spec.vcpus),
        "-m",
        str(spec.memory_mib),
        "-kernel",
        str(kernel),
        "-initrd",
        str(initrd),
        "-append",
        append,
        *disk_args(spec.disk_bus, vmdir / "disk.qcow2"),
        "-netdev",
        f"tap,id=n0,ifname={tap},script=no,downscript=no",
        "-device",
        f"{NIC_DEVICE[spec.nic]},netdev=n0,mac={spec.mac},romfile=",
        "-serial",
        f"file:{vmdir / 'console.log'}",  # "file:" takes the rest as the path, commas and all
        "-qmp",
        f"unix:{opt(vmdir / 'qmp.sock')},server=on,wait=off",
        "-pidfile",
        str(vmdir / "qemu.pid"),
    ]
    if ram is not None:
        argv += [
            "-object",
            f"memory-backend-file,id=ram0,size={spec.memory_mib}M,mem-path={opt(ram)},"
            f"share={'on' if ram_shared else 'off'}",
            *WARM_DEVICES,
            "-chardev",
            f"socket,id=qga0,path={opt(vmdir / 'qga.sock')},server=on,wait=off",
        ]
        if incoming:
            argv += ["-incoming", "defer"]
    elif qboot.exists():
        argv += ["-bios", str(qboot)]
    if accel is Accel.KVM:
        argv += ["-cpu", "host"]
    return argv


def boot_files(image: ImageRef) -> tuple[Path, Path, str]:
    """The kernel, initrd and command line the image's manifest names for a direct kernel boot.
    Raises UsageError for an image that cannot boot that way or is incomplete."""
    images.require_boot(image, "kernel", "the local backend")
    base = image.path.parent
    paths = image.manifest.get("paths", {})
    kernel = base / paths.get("kernel", f"{image.name}/vmlinuz")
    initrd = base / paths.get("initrd", f"{image.name}/initrd.img")
    cmdline = image.manifest.get("cmdline", DEFAULT_CMDLINE)
    for f in (kernel, initrd, image.path):
        if not f.exists():
            raise UsageError(f"image {image.name!r} is incomplete: {f} is missing", hint="run `make images`")
    return kernel, initrd, cmdline


_qemu_version: str | None = None


def qemu_version() -> str:
    """QEMU's version (asked once per process): recorded with every sample, and the KVM probe's cache key."""
    global _qemu_version
    if _qemu_version is None:
        try:
            out = proc.run([QEMU, "--version"], timeout=10).stdout
            _qemu_version = out.splitlines()[0].split("version", 1)[-1].strip()
        except LabError:
            _qemu_version = "unknown"
    return _qemu_version
