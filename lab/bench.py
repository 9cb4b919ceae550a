"""`make bench`: how long the local backend takes to give a cell a ready machine, cold and warm,
next to a bare QEMU boot of the same image with the same flags, all measured in the same sitting
with the order rotating every repetition (the first of a round finds colder caches). Prints
figures; it is not a pass/fail test.

- lab cold: clone (linked overlay) + boot to LAB-READY + SSH login ready;
- lab warm: clone (overlay on the snapshot's disk) + restore + fix-ups (clock, MAC, address) +
  SSH login ready; the snapshot is made once before the timed rounds (its build time is shown);
- bare: start QEMU by hand, then `ssh true` in a loop every 0.2 s, as a person would.
Then destroy, and the whole cycle. The host's load average is printed before and after: the
machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from lab import images, proc
from lab.backends import local
from lab.backends.base import Client
from lab.backends.local import host
from lab.errors import LabError
from lab.model import CloneKind, ImageRef, NicModel, VmSpec
from lab.wait import wait_until

KINDS = ("cold", "warm", "bare")


def _ssh_ready_loop(ip: str, netns: str, key: Path, timeout: float = 300) -> None:
    """`ssh true` every 0.2 s until it logs in, as a person would."""
    argv = [
        "ssh",
        "-i",
        str(key),
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        "-o",
        "ConnectTimeout=2",
        f"root@{ip}",
        "true",
    ]
    wait_until(
        lambda: proc.run(argv, netns=netns, check=False, timeout=30).ok,
        timeout=timeout,
        what=f"the bare boot's SSH on {ip}",
        interval=0.2,
        max_interval=0.2,
    )


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


class Bench:
    def __init__(self, backend: local.LocalBackend, client: Client, run_id: str, image: ImageRef, key: Path):
        self.backend, self.client, self.run_id, self.image, self.key = backend, client, run_id, image, key
        self.n = 0

    def spec(self, nic: NicModel, start: str) -> VmSpec:
        self.n += 1
        return VmSpec(
            name=f"lab-{self.run_id}-b{self.n:03d}",
            run_id=self.run_id,
            cell_id=f"b{self.n:03d}",
            image=self.image,
            nic=nic,
            vcpus=2,
            memory_mib=1024,
            clone=CloneKind.LINKED,
            start=start,
            expires_at=time.time() + 600,
        )

    def lab(self, nic: NicModel, start: str) -> dict:
        """clone -> start -> ready (console event or restore + fix-ups, then the SSH master) -> destroy."""
        spec = self.spec(nic, start)
        t0 = time.monotonic()
        vm = self.backend.clone(self.image, spec)
        clone_s = time.monotonic() - t0
        try:
            self.backend.start(vm)
            self.backend.wait_ready(vm)
            with self.backend.guest(vm, self.client) as g:
                g.connect(timeout=120)
                ready_s = time.monotonic() - t0
        except LabError as exc:  # with how it started: a warm cell may have fallen back to cold
            raise LabError(f"{spec.name}: {exc} [start: {vm.facts.get('start')}]") from None
        finally:
            t1 = time.monotonic()
            self.backend.destroy(vm)
        destroy_s = time.monotonic() - t1
        return {
            "clone_s": clone_s,
            "ready_s": ready_s,
            "destroy_s": destroy_s,
            "cycle_s": time.monotonic() - t0,
            "start": vm.facts.get("start"),
            "accel": vm.facts.get("accel"),
            "facts": vm.facts,
        }

    def bare(self, nic: NicModel, workdir: Path) -> dict:
        """The same argv as a cold cell, started and polled by hand."""
        spec = self.spec(nic, "cold")
        netns = self.client.netns
        if netns is None:
            raise LabError("the bare boot needs the client's network namespace (it has none)")
        bare_dir = workdir / f"bare-{spec.cell_id}"
        bare_dir.mkdir()
        tap = "tapbare"
        t0 = time.monotonic()
        proc.run(
            [
                "qemu-img",
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                str(self.image.path),
                "-F",
                "qcow2",
                str(bare_dir / "disk.qcow2"),
            ]
        )
        host.run_all(host.tap_argvs(netns, tap), what="the bare boot's tap")
        kernel, initrd, cmdline = local.boot_files(self.image)
        bspec = replace(
            spec, name=f"bare-{self.run_id}", ip=f"{self.backend.settings.subnet}.250", mac="52:54:00:ff:ff:fa"
        )
        argv = local.qemu_argv(
            bspec,
            accel=self.backend.accel(self.image),
            vmdir=bare_dir,
            kernel=kernel,
            initrd=initrd,
            cmdline=cmdline,
            tap=tap,
            gateway=self.client.address,
            tcg_threads=self.backend.settings.tcg_threads,
        )
        p = proc.spawn(argv, netns=netns)
        try:
            _ssh_ready_loop(bspec.ip, netns, self.key)
            ready_s = time.monotonic() - t0
        finally:
            t1 = time.monotonic()
            local.stop_process(p)
            host.remove_tap(netns, tap)
            shutil.rmtree(bare_dir, ignore_errors=True)
        destroy_s = time.monotonic() - t1
        return {
            "clone_s": 0.0,
            "ready_s": ready_s,
            "destroy_s": destroy_s,
            "cycle_s": time.monotonic() - t0,
            "start": "bare",
            "accel": None,
            "facts": {},
        }


def rotation(rep: int) -> list[str]:
    """Pure: the order of the three kinds in repetition `rep` (each comes first once every three)."""
    k = rep % len(KINDS)
    return list(KINDS[k:] + KINDS[:k])


def bench(nics: list[NicModel], repetitions: int, say: Callable[[str], None] = print) -> tuple[list[dict], dict]:
    image = images.load("debian12")
    key = local.lab_key()
    workdir = Path(tempfile.mkdtemp(prefix="lb", dir="/var/tmp"))
    backend = local.LocalBackend("local", local.Settings(backend="local", workdir=str(workdir)))
    backend.check()
    run_id = os.urandom(4).hex()
    client = backend.open_run(run_id)
    b = Bench(backend, client, run_id, image, key)
    rows, builds = [], {}
    try:
        for nic in nics:  # the snapshots first, outside the timed rounds
            made = b.lab(nic, "warm")
            builds[nic.value] = made["facts"].get("warm_seconds")
            say(f"  warm snapshot of {nic.value}: made in {builds[nic.value]:.1f} s ({made['start']})")
        for rep in range(repetitions):
            for nic in nics:
                for kind in rotation(rep):
                    try:
                        r = b.bare(nic, workdir) if kind == "bare" else b.lab(nic, kind)
                    except LabError as exc:  # one failed boot is reported; the sitting goes on
                        say(f"  {nic.value:7} rep {rep} {kind:4}: failed: {exc}")
                        continue
                    if kind == "warm" and r["start"] != "warm":
                        say(f"  warning: a warm cell started {r['start']}")
                    rows.append({"nic": nic.value, "rep": rep, "kind": kind, **r})
                    say(
                        f"  {nic.value:7} rep {rep} {kind:4}: ready {r['ready_s']:5.2f} s (clone {r['clone_s']:.3f}), "
                        f"destroy {r['destroy_s']:.3f} s, cycle {r['cycle_s']:5.2f} s"
                    )
    finally:
        backend.close_run(run_id)
        shutil.rmtree(workdir, ignore_errors=True)
    return rows, builds


def spread(values: list[float]) -> str:
    """Pure: "median (min-max)"."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(rows: list[dict], nics: list[str]) -> list[str]:
    """Pure: per NIC and kind, medians with min-max of ready, destroy and cycle; the warm/cold and
    cold/bare ratios of the median time to ready."""
    out = [f"{'nic':8}{'start':6}{'ready s':>20}{'destroy s':>20}{'cycle s':>20}"]
    for nic in nics:
        med = {}
        for kind in KINDS:
            r = [x for x in rows if x["nic"] == nic and x["kind"] == kind]
            if not r:
                continue
            med[kind] = statistics.median(x["ready_s"] for x in r)
            out.append(
                f"{nic:8}{kind:6}{spread([x['ready_s'] for x in r]):>20}"
                f"{spread([x['destroy_s'] for x in r]):>20}{spread([x['cycle_s'] for x in r]):>20}"
            )
        if "warm" in med and "cold" in med:
            out.append(
                f"{nic:8}warm/cold time to ready: {med['warm'] / med['cold']:.2f}"
                + (f"; cold/bare: {med['cold'] / med['bare']:.2f}" if "bare" in med else "")
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--nic", action="append", choices=[n.value for n in NicModel])
    args = ap.parse_args()
    nics = [NicModel(n) for n in (args.nic or [NicModel.VIRTIO, NicModel.E1000])]
    print(
        f"lab bench: {args.repetitions} repetitions × {', '.join(n.value for n in nics)} × cold, warm, bare "
        f"(2 vCPUs, 1 GiB); load average before: {load_average()}; {os.cpu_count()} CPUs",
        flush=True,
    )
    rows, _ = bench(nics, args.repetitions, say=lambda line: print(line, flush=True))
    print(f"\nload average after: {load_average()}; accel {rows[0]['accel'] if rows else '?'}")
    print("\n".join(table(rows, [n.value for n in nics])))
    print("targets: warm time to ready <= 0.2x cold (aim 0.1x); cold within 1.1x of bare; destroy < 1 s (medians)")


if __name__ == "__main__":
    main()
