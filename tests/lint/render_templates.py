"""`make lint`'s renderer: the Jinja2 templates that hold another language, rendered by the code
that renders them for real, with representative values, so the lint can check what comes out.

    python tests/lint/render_templates.py OUT

writes OUT/domain-*.xml (templates/libvirt/*.xml.j2: xmllint, and libvirt's RNG schema where it is
installed) and OUT/answers/<image>/* (templates/answers/*.j2: shellcheck for the shell ones).
Not a test module (no test_ prefix): the lint runs it; the fast lane's own XML tests go further
(every NIC x bus x firmware, the bhyve driver's shapes)."""

from __future__ import annotations

import sys
from pathlib import Path

from lab.backends.libvirt.backend import LibvirtBackend
from lab.backends.libvirt.settings import Settings
from lab.images.recipes import RECIPES, IsoRecipe
from lab.images.render import render_answers
from lab.model import DiskBus, ImageRef, NicModel, VmSpec

UUID = "6f1c16e8-01c4-4429-87cd-e652e3edee5c"
PUBKEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILintLintLintLintLintLintLintLintLintLintLint lab-lint"


def _spec(image: ImageRef, nic: NicModel, bus: DiskBus, **kw) -> VmSpec:
    return VmSpec(
        name="lab-lint-c01",
        run_id="lint",
        cell_id="c01",
        image=image,
        nic=nic,
        vcpus=2,
        memory_mib=1024,
        disk_bus=bus,
        expires_at=1_900_000_000.0,
        **kw,
    )


def domains(out: Path) -> list[Path]:
    """One domain per driver template: bhyve (UEFI, virtio, SATA) and QEMU (direct kernel boot)."""
    written = []
    bsd = ImageRef(name="freebsd14", os="freebsd", path=Path("/nonexistent/freebsd14.raw"), digest="d1")
    bhyve = LibvirtBackend(
        "bsd1",
        Settings(
            backend="libvirt",
            uri="bhyve+ssh://root@bsd1/system",
            dataset="zroot/lab",
            firmware="uefi",
            bridge="bridge0",
        ),
    )
    boot = out / "debian12"  # the kernel and initrd the QEMU domain boots directly
    boot.mkdir(parents=True, exist_ok=True)
    for f in ("vmlinuz", "initrd.img"):
        (boot / f).write_bytes(b"")
    deb = ImageRef(
        name="debian12",
        os="debian",
        path=out / "debian12.qcow2",
        digest="d",
        manifest={
            "cmdline": "console=ttyS0 root=LABEL=labroot rw quiet",
            "boot": ["kernel", "bios", "uefi"],
            "paths": {"kernel": "debian12/vmlinuz", "initrd": "debian12/initrd.img"},
        },
    )
    qemu = LibvirtBackend(
        "local",
        Settings(
            backend="libvirt",
            uri="qemu:///system",
            dir="/var/tmp/labdisks",
            bridge="labvbr0",
            gateway="10.78.5.1",
            bios="/usr/share/qemu/qboot.rom",
        ),
    )
    for name, backend, spec in (
        ("bhyve", bhyve, _spec(bsd, NicModel.VIRTIO, DiskBus.SATA)),
        ("qemu", qemu, _spec(deb, NicModel.E1000, DiskBus.VIRTIO, ip="10.78.5.10")),
    ):
        path = out / f"domain-{name}.xml"
        path.write_text(backend.domain_xml(spec, vm_uuid=UUID))
        written.append(path)
    return written


def answers(out: Path) -> list[Path]:
    """Every ISO-installed image's answer files, as `lab images render` writes them."""
    written = []
    for name, r in sorted(RECIPES.items()):
        if isinstance(r, IsoRecipe):
            written += render_answers(name, out / "answers" / name, PUBKEY).values()
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: render_templates.py OUT", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for path in [*domains(out), *answers(out)]:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
