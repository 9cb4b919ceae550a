"""`make bench`: clone, start-to-SSH-ready and teardown times of the local backend, next to a bare
QEMU boot of the same image with the same flags measured in the same run. Prints figures; it is
not a pass/fail test.

The bare boot is what a person would do by hand: start QEMU, then `ssh true` in a loop every 0.2 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from lab import images, proc
from lab.backends import local
from lab.guest import Guest
from lab.model import CloneKind, NicModel, VmSpec


def _ssh_ready_loop(ip: str, netns: str, key: Path, timeout: float = 300) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        res = proc.run(["ssh", "-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                        "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=2",
                        f"root@{ip}", "true"], netns=netns, check=False, timeout=30)
        if res.ok:
            return
        time.sleep(0.2)
    raise RuntimeError(f"bare boot: no SSH on {ip} after {timeout} s")


def bench(nics: list[NicModel], repetitions: int) -> list[dict]:
    image = images.load("debian12")
    key = local.lab_key()
    workdir = Path(tempfile.mkdtemp(prefix="lb", dir="/var/tmp"))
    backend = local.LocalBackend("local", {"workdir": str(workdir)})
    backend.check()
    run_id = os.urandom(4).hex()
    client = backend.open_run(run_id)
    rows = []
    try:
        for rep in range(repetitions):
            for nic in nics:
                spec = VmSpec(name=f"lab-{run_id}-b{rep}{nic.value[:2]}", run_id=run_id, cell_id="bench", image=image,
                              nic=nic, vcpus=2, memory_mib=1024, clone=CloneKind.LINKED,
                              expires_at=time.time() + 600)

                def lab_boot() -> tuple[float, float, float, str]:
                    # lab: clone -> start -> ready (console event + SSH master) -> destroy
                    t0 = time.monotonic()
                    vm = backend.clone(image, spec)
                    clone_s = time.monotonic() - t0
                    t1 = time.monotonic()
                    backend.start(vm)
                    backend.wait_ready(vm)
                    with Guest(vm.address, key=key, netns=client.netns, control_dir=Path(vm.handle["dir"])) as g:
                        g.connect(timeout=120)
                        ready_s = time.monotonic() - t1
                        t2 = time.monotonic()
                    backend.destroy(vm)
                    return clone_s, ready_s, time.monotonic() - t2, vm.facts.get("accel")

                def bare_boot() -> float:
                    # bare: the same argv, started by hand, polled by hand
                    bare_dir = workdir / f"bare-{rep}-{nic.value}"
                    bare_dir.mkdir()
                    proc.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image.path), "-F", "qcow2",
                              str(bare_dir / "disk.qcow2")])
                    tap = "tapbare"
                    proc.run(["ip", "-n", client.netns, "tuntap", "add", tap, "mode", "tap"])
                    proc.run(["ip", "-n", client.netns, "link", "set", tap, "master", "br0", "up"])
                    kernel, initrd, cmdline = local.boot_files(image)
                    bspec = replace(spec, name=f"bare-{run_id}", ip=f"{backend.subnet}.250", mac="52:54:00:ff:ff:fa")
                    argv = local.qemu_argv(bspec, accel=backend.accel(image), vmdir=bare_dir, kernel=kernel,
                                           initrd=initrd, cmdline=cmdline, tap=tap, gateway=client.address)
                    t3 = time.monotonic()
                    p = subprocess.Popen(proc.netns_prefix(client.netns) + argv, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
                    try:
                        _ssh_ready_loop(bspec.ip, client.netns, key)
                        return time.monotonic() - t3
                    finally:
                        local.stop_process(p)
                        proc.run(["ip", "-n", client.netns, "link", "del", tap], check=False)
                        shutil.rmtree(bare_dir, ignore_errors=True)

                # Alternate which goes first: the second boot finds the image in the page cache.
                if rep % 2:
                    bare_s = bare_boot()
                    clone_s, ready_s, teardown_s, accel = lab_boot()
                else:
                    clone_s, ready_s, teardown_s, accel = lab_boot()
                    bare_s = bare_boot()
                rows.append({"nic": nic.value, "rep": rep, "clone_s": clone_s, "ready_s": ready_s,
                             "bare_ready_s": bare_s, "teardown_s": teardown_s, "accel": accel})
                print(f"  {nic.value:7} rep {rep}: clone {clone_s:.3f} s, lab ready {ready_s:.1f} s, "
                      f"bare ready {bare_s:.1f} s, teardown {teardown_s:.3f} s", flush=True)
    finally:
        backend.close_run(run_id)
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--nic", action="append", choices=[n.value for n in NicModel])
    args = ap.parse_args()
    nics = [NicModel(n) for n in (args.nic or ["virtio", "e1000"])]
    print(f"lab bench: {args.repetitions} repetitions × {', '.join(n.value for n in nics)} (2 vCPUs, 1 GiB)")
    rows = bench(nics, args.repetitions)
    print(f"\n{'nic':8}{'clone s':>10}{'lab ready s':>13}{'bare ready s':>14}{'ratio':>8}{'teardown s':>12}  accel")
    for nic in nics:
        r = [x for x in rows if x["nic"] == nic.value]
        med = {k: statistics.median(x[k] for x in r) for k in ("clone_s", "ready_s", "bare_ready_s", "teardown_s")}
        print(f"{nic.value:8}{med['clone_s']:>10.3f}{med['ready_s']:>13.1f}{med['bare_ready_s']:>14.1f}"
              f"{med['ready_s'] / med['bare_ready_s']:>8.2f}{med['teardown_s']:>12.3f}  {r[0]['accel']}")
    print("targets: clone < 0.1 s, lab ready within 1.1x of bare, teardown < 1 s (medians)")


if __name__ == "__main__":
    main()
