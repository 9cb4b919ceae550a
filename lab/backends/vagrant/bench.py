"""Vagrant's figures for `make bench` (issue 19's goal: a lab cell's whole cycle at most 0.33 x a
plain `vagrant up` + `vagrant destroy` of the same box), in one sitting, the order alternating:

- a lab cell on a host of any backend, through the Backend seam: clone -> start -> ready -> SSH
  (time to ready), destroy (time to destroy), and the whole cycle;
- a plain `vagrant up` and `vagrant destroy -f` of the golden image's box: the same machine shape in
  a Vagrantfile as a person writes it (box, version, CPUs, memory, NIC, the run's network), timed
  from outside.

`python -m lab.backends.vagrant.bench` prints medians with min-max; `rows()` and `summary()` are for
lab.bench to call. Nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lab import images
from lab.backends import Backend, backend_class
from lab.backends.libvirt import daemons
from lab.backends.local.settings import Settings as LocalSettings
from lab.backends.vagrant import box
from lab.backends.vagrant.backend import VagrantBackend
from lab.backends.vagrant.settings import Settings as VagrantSettings
from lab.backends.vagrant.tools import Virsh
from lab.backends.vagrant.vagrantfile import Machine, render
from lab.errors import LabError, UsageError
from lab.model import Client, ImageRef, NicModel, VmSpec


def lab_cycle(backend: Backend, client: Client, image: ImageRef, spec: VmSpec) -> dict[str, float]:
    """One lab cell's machine: clone, start, ready, SSH, destroy, timed."""
    t0 = time.monotonic()
    vm = backend.clone(image, spec)
    try:
        backend.start(vm)
        backend.wait_ready(vm)
        guest = backend.guest(vm, client)
        guest.connect(timeout=300)
        guest.close()
    except BaseException:
        backend.destroy(vm)
        raise
    ready = time.monotonic() - t0
    t1 = time.monotonic()
    backend.destroy(vm)
    end = time.monotonic()
    return {"ready_s": ready, "destroy_s": end - t1, "cycle_s": end - t0}


def plain_vagrant_cycle(backend: VagrantBackend, image: ImageRef, spec: VmSpec, workdir: Path) -> dict[str, float]:
    """`vagrant up` and `vagrant destroy -f` of the box in a plain Vagrantfile, timed from outside."""
    b = box.built_box(image)
    vdir = workdir / spec.name
    vdir.mkdir(parents=True)
    plain = Machine(
        name=spec.name,
        image=image.name,
        box=b.name,
        box_version=b.version,
        cpus=spec.vcpus,
        memory_mib=spec.memory_mib,
        nic=spec.nic,
        disk_bus=spec.disk_bus,
        ssh_key=backend.env.ssh_key,
        purpose="plain vagrant up of the box (lab bench)",
        driver=backend.settings.driver,
        uri=backend.settings.uri,
        storage_pool=backend.settings.storage_pool,
        network=backend.run_network(spec.run_id),
    )
    (vdir / "Vagrantfile").write_text(render(plain))
    try:
        t0 = time.monotonic()
        backend.vagrant.run(["up"], cwd=vdir, timeout=backend.settings.boot_timeout + 120, what="vagrant up")
        t1 = time.monotonic()
    finally:
        t2 = time.monotonic()
        backend.vagrant.run(
            ["destroy", "-f"], cwd=vdir, timeout=backend.settings.destroy_timeout, what="vagrant destroy"
        )
        end = time.monotonic()
        shutil.rmtree(vdir, ignore_errors=True)
    return {"ready_s": t1 - t0, "destroy_s": end - t2, "cycle_s": end - t0}


def rows(
    backends: dict[str, Backend],
    repetitions: int,
    *,
    nic: NicModel = NicModel.VIRTIO,
    vcpus: int = 2,
    memory_mib: int = 1024,
    say: Callable[[str], None] = print,
) -> list[dict]:
    """`repetitions` rounds; in each, every host's lab cell and, for each vagrant host, the plain
    Vagrant cycle, in an order that rotates each round (the first boot warms the page cache)."""
    image = images.load("debian12")
    run_id = f"bench{int(time.time()) % 100000:05d}"
    clients = {name: b.open_run(run_id) for name, b in backends.items()}
    scratch = Path(tempfile.mkdtemp(prefix="lvb", dir="/var/tmp"))
    out: list[dict] = []
    try:
        jobs = [(name, "lab") for name in backends]
        jobs += [(name, "plain vagrant") for name, b in backends.items() if isinstance(b, VagrantBackend)]
        for rep in range(repetitions):
            shift = rep % len(jobs)
            for n, (host, kind) in enumerate(jobs[shift:] + jobs[:shift]):
                b = backends[host]
                spec = VmSpec(
                    f"lab-{run_id}-c{rep * 10 + n + 1:02d}",
                    run_id,
                    f"c{rep * 10 + n + 1:02d}",
                    image,
                    nic,
                    vcpus,
                    memory_mib,
                    expires_at=time.time() + 3600,
                )
                if kind == "lab":
                    t = lab_cycle(b, clients[host], image, spec)
                else:
                    assert isinstance(b, VagrantBackend)
                    t = plain_vagrant_cycle(b, image, spec, scratch)
                row = {"host": host, "backend": b.name, "kind": kind, "rep": rep, **t}
                out.append(row)
                say(
                    f"  rep {rep} {host:8} {kind:13} ready {t['ready_s']:6.1f} s  destroy {t['destroy_s']:5.1f} s  "
                    f"cycle {t['cycle_s']:6.1f} s"
                )
    finally:
        for b in backends.values():
            b.close_run(run_id)
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def summary(rows_: list[dict]) -> list[str]:
    """Medians (min-max) per host and kind, and each lab cell's cycle against plain Vagrant's."""

    def fig(values: list[float]) -> str:
        return f"{statistics.median(values):6.1f} ({min(values):.1f}-{max(values):.1f})"

    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows_:
        groups.setdefault((r["host"], r["kind"]), []).append(r)
    lines = [f"{'host':10}{'what':15}{'ready s':>20}{'destroy s':>20}{'cycle s':>20}  n"]
    for (host, kind), rs in groups.items():
        lines.append(
            f"{host:10}{kind:15}"
            + "".join(f"{fig([r[k] for r in rs]):>20}" for k in ("ready_s", "destroy_s", "cycle_s"))
            + f"  {len(rs)}"
        )
    plain = [r["cycle_s"] for r in rows_ if r["kind"] == "plain vagrant"]
    if plain:
        base = statistics.median(plain)
        for (host, kind), rs in groups.items():
            if kind == "lab":
                ratio = statistics.median(r["cycle_s"] for r in rs) / base
                lines.append(
                    f"lab cell on {host}: whole cycle = {ratio:.2f} x plain vagrant up + destroy "
                    f"(goal <= 0.33: {'met' if ratio <= 0.33 else 'not met'})"
                )
    return lines


def _libvirt() -> list[subprocess.Popen]:
    """The libvirtd the bench's Vagrant needs: when qemu:///system does not answer and this is root,
    start it (and virtlogd) as the tests do; the daemons started, for the caller to stop. A UsageError
    says why the part cannot run."""
    if daemons.libvirtd_answers():
        return []
    if os.geteuid() != 0:
        raise UsageError(f"libvirtd does not answer on {daemons.URI}, and only root may start it here")
    if not shutil.which("libvirtd"):
        raise UsageError("libvirtd is not installed (apt-get install libvirt-daemon-system)")
    print(f"libvirtd does not answer on {daemons.URI}: starting it (and virtlogd) for the bench, stopped after")
    return daemons.ensure_running()


@contextlib.contextmanager
def _vagrant_host(args: argparse.Namespace) -> Iterator[VagrantSettings]:
    """The bench's Vagrant host: the home, storage pool and workdir given, or scratch ones (a
    transient libvirt pool: a fresh libvirtd has none, not even "default"), removed after."""
    root = Path(tempfile.mkdtemp(prefix="lvh", dir="/var/tmp"))
    root.chmod(0o755)  # libvirt's QEMU (libvirt-qemu) reaches the pool's volumes through it
    virsh = Virsh(daemons.URI)
    pool = args.storage_pool or f"labbench{secrets.token_hex(3)}"
    try:
        if not args.storage_pool:
            (root / "pool").mkdir(mode=0o755)
            virsh.run(["pool-create-as", pool, "dir", "--target", str(root / "pool")], what="virsh pool-create-as")
        yield VagrantSettings(
            backend="vagrant",
            uri=daemons.URI,
            vagrant_home=args.vagrant_home or str(root / "home"),
            storage_pool=pool,
            workdir=args.workdir or str(root / "work"),
        )
    finally:
        if not args.storage_pool:
            for name, _ in virsh.volumes(pool):
                virsh.run(["vol-delete", name, "--pool", pool], what="virsh vol-delete", check=False)
            virsh.run(["pool-destroy", pool], what="virsh pool-destroy", check=False)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--local-workdir", default=None, help="the local backend's workdir (default: a scratch one)")
    ap.add_argument("--vagrant-home", default=None, help="default: a scratch one (the box is added there)")
    ap.add_argument("--storage-pool", default=None, help="default: a transient pool of the bench's own")
    ap.add_argument("--workdir", default=None, help="the vagrant backend's workdir (default: a scratch one)")
    ap.add_argument("--nic", default=NicModel.VIRTIO.value, choices=[n.value for n in NicModel])
    args = ap.parse_args()
    try:
        started = _libvirt()
    except LabError as exc:  # a part of `make bench` that cannot run here says why, in one line
        print(f"vagrant bench: skipped: {exc}")
        return
    try:
        with _vagrant_host(args) as settings:
            _bench(args, settings)
    except LabError as exc:
        raise SystemExit(f"bench failed: {exc}") from None
    finally:
        daemons.stop(started)


def _bench(args: argparse.Namespace, vagrant_settings: VagrantSettings) -> None:
    local_dir = Path(args.local_workdir or tempfile.mkdtemp(prefix="lbl", dir="/var/tmp"))
    hosts = {
        "local": backend_class("local")("local", LocalSettings(backend="local", workdir=str(local_dir))),
        "vagrant": VagrantBackend("vagrant", vagrant_settings),
    }
    try:
        for b in hosts.values():
            b.check()
        image = images.load("debian12")
    except LabError as exc:
        print(f"vagrant bench: skipped: {exc}" + (f" ({exc.hint})" if exc.hint else ""))
        return
    try:
        publishing = hosts["vagrant"].publishing
        assert publishing is not None  # the vagrant backend publishes boxes
        print(f"vagrant box: {publishing.publish(image)}")
        print("\n".join(summary(rows(hosts, args.repetitions, nic=NicModel(args.nic)))))
    finally:
        if not args.local_workdir:
            shutil.rmtree(local_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
