"""End to end on the real libvirt QEMU driver (qemu:///system, TCG): the backend's own code path
clones the golden image (qcow2 overlay), defines and boots a domain, waits for LAB-READY and SSH,
runs `uname -a`, destroys, and nothing is left (domain, overlay, console log).

Networking: a dedicated bridge `labvbr<random>` holding 10.78.<n>.1/24 in the host netns
(libvirt's QEMU domains live there), with no uplink, no NAT and no gateway given to the guest;
it is deleted afterwards. libvirtd (and virtlogd) are started if they are not running, and
stopped again at the end if this module started them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import time
from pathlib import Path

import pytest

import lab
from lab import proc
from lab.wait import wait_until

libvirt = pytest.importorskip("libvirt")

from lab.backends.libvirt import LibvirtBackend  # noqa: E402
from lab.guest import Guest  # noqa: E402
from lab.model import DiskBus, NicModel, VmSpec  # noqa: E402

IMAGES = Path(lab.PROJECT_ROOT) / "images"
URI = "qemu:///system"

# one xdist worker runs them all: the libvirtd fixture may start and stop the daemon
pytestmark = [pytest.mark.vm, pytest.mark.image, pytest.mark.timeout(900),
              pytest.mark.xdist_group("libvirt-qemu-system")]


def _virsh_ok() -> bool:
    if not Path("/run/libvirt/libvirt-sock").exists():
        return False
    return proc.run(["virsh", "-c", URI, "version"], timeout=30, check=False).ok


@pytest.fixture(scope="module")
def libvirtd():
    """A running libvirtd + virtlogd for qemu:///system; stops only what it started.

    No systemd in this container, so the daemons run in the foreground as our children
    (proc.spawn): teardown terminates and reaps them, leaving no zombie behind."""
    if os.geteuid() != 0:
        pytest.skip("qemu:///system end-to-end test needs root")
    for tool in ("libvirtd", "virtlogd", "virsh", "qemu-img", "qemu-system-x86_64"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            pytest.skip(f"{tool} is not installed (make setup)")
    started = []
    try:
        if not _virsh_ok():
            if not Path("/run/libvirt/virtlogd-sock").exists():
                started.append(proc.spawn(["virtlogd"]))
                wait_until(lambda: Path("/run/libvirt/virtlogd-sock").exists(), timeout=30,
                           what="virtlogd socket")
            started.insert(0, proc.spawn(["libvirtd"]))

            def up() -> bool:
                if started[0].poll() is not None:
                    raise RuntimeError(f"libvirtd exited with status {started[0].returncode}")
                return _virsh_ok()
            wait_until(up, timeout=60, what="libvirtd to answer on qemu:///system", interval=0.2)
        yield
    finally:
        for daemon in started:  # libvirtd first, then virtlogd
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except Exception:
                daemon.kill()
                daemon.wait(timeout=10)


@pytest.fixture
def lab_bridge():
    """An isolated bridge 10.78.<n>.1/24: no uplink, no NAT, deleted afterwards."""
    used = proc.run(["ip", "-4", "-o", "addr", "show"], timeout=10).stdout
    for _ in range(50):
        n = 100 + secrets.randbelow(100)
        if f" 10.78.{n}." not in used:
            break
    else:
        pytest.skip("no free 10.78.x.0/24 subnet")
    name = f"labvbr{secrets.token_hex(3)}"
    proc.run(["ip", "link", "add", "name", name, "type", "bridge"], timeout=10)
    try:
        proc.run(["ip", "addr", "add", f"10.78.{n}.1/24", "dev", name], timeout=10)
        proc.run(["ip", "link", "set", name, "up"], timeout=10)
        yield name, n
    finally:
        proc.run(["ip", "link", "del", name], timeout=10, check=False)


@pytest.mark.parametrize("nic,bus", [(NicModel.VIRTIO, DiskBus.VIRTIO), (NicModel.E1000, DiskBus.SATA)],
                         ids=["virtio-virtio", "e1000-sata"])
def test_qemu_system_lifecycle(golden, libvirtd, lab_bridge, tmp_path, nic, bus):
    """`golden` (conftest) skips with the reason when images/debian12.json is not built yet."""
    image = golden
    bridge, n = lab_bridge
    run_id = f"e2e{secrets.token_hex(3)}"
    disk_dir = tmp_path / "disks"
    backend = LibvirtBackend("e2e", {
        "uri": URI, "dir": str(disk_dir), "bridge": bridge,
        # QEMU as root without relabelling: libvirt would otherwise chown the shared golden image
        "dac_label": "+0:+0",
        "bios": "/usr/share/qemu/qboot.rom",
    })
    backend.check()
    assert backend.facts()["accel"] == "tcg"
    spec = VmSpec(name=f"lab-{run_id}-c1", run_id=run_id, cell_id="c1", image=image, nic=nic,
                  vcpus=2, memory_mib=768, disk_bus=bus, ip=f"10.78.{n}.10",
                  expires_at=time.time() + 3600)
    timings: dict[str, float] = {}
    vm = None
    t0 = time.monotonic()
    try:
        vm = backend.clone(image, spec)
        timings["clone_define"] = time.monotonic() - t0
        overlay = Path(vm.handle["disk_path"])
        assert overlay.exists()
        info = json.loads(proc.run(["qemu-img", "info", "--output=json", str(overlay)], timeout=30).stdout)
        assert info["format"] == "qcow2"
        assert Path(info["backing-filename"]).resolve() == Path(image.path).resolve()

        dom = backend.conn.lookupByName(spec.name)
        assert dom.XMLDesc(0).startswith("<domain type='qemu'")
        owned = [o for o in backend.list_owned() if o.run_id == run_id]
        assert [o.name for o in owned] == [spec.name]

        t = time.monotonic()
        backend.start(vm)
        timings["start"] = time.monotonic() - t
        t = time.monotonic()
        addr = backend.wait_ready(vm, timeout=480)
        timings["ready"] = time.monotonic() - t
        assert addr == spec.ip
        assert "LAB-READY" in backend.console_text(vm)

        t = time.monotonic()
        with Guest(addr, key=IMAGES / "lab_key", user="root") as guest:
            guest.connect(timeout=90)
            out = guest.run("uname -a").stdout
            driver = guest.run("basename $(readlink /sys/class/net/eth0/device/driver)").stdout.strip()
        timings["ssh_uname"] = time.monotonic() - t
        assert out.startswith("Linux ")
        assert driver == {"virtio": "virtio_net", "e1000": "e1000"}[nic.value]
        print(f"\nguest: {out.strip()}")
    finally:
        t = time.monotonic()
        if vm is not None:
            backend.destroy(vm)
        else:  # clone failed half way: remove whatever carries our run id
            for item in backend.list_owned():
                if item.run_id == run_id:
                    backend.remove_owned(item)
        timings["destroy"] = time.monotonic() - t
        timings["total"] = time.monotonic() - t0
        print("timings: " + json.dumps({k: round(v, 2) for k, v in timings.items()}))

    # nothing left: domain, overlay, console log, lease
    assert backend._lookup(spec.name) is None
    assert not any(o.run_id == run_id for o in backend.list_owned())
    assert not list(disk_dir.glob("*")), list(disk_dir.glob("*"))
    assert vm.facts.get("undefine") == "nvram"  # QEMU accepts VIR_DOMAIN_UNDEFINE_NVRAM
    names = proc.run(["virsh", "-c", URI, "list", "--all", "--name"], timeout=30).stdout.split()
    assert spec.name not in names
    backend.close()
