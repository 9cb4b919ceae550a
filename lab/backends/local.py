"""Local QEMU backend: clones of the golden image on this machine, one network namespace per run.

Layout of a run: namespace `lab-<run>` holding bridge `br0` (<subnet>.1/24) and one tap per VM;
QEMU, ssh, iperf3 and wrk all run inside that namespace, so load never leaves it. Each VM has a
directory `<workdir>/<vm-name>/` with its overlay disk, pidfile, QMP socket, serial console log
and `lease.json` (run id, expiry, netns, tap): `lab gc` finds everything from those, even when the
results store is gone.

KVM: /dev/kvm existing does not mean KVM works (nested KVM hangs guests on some hosts). With
accel = "auto" the backend boots the image's kernel under KVM once and waits for it to reach
init; silence means TCG. The verdict is cached per host kernel and QEMU version, and recorded
with every sample.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from lab import IMAGES_DIR, images, proc, runlock
from lab.backends import register
from lab.config import backend_nic_models
from lab.errors import BackendError, LabError, TeardownError, UsageError
from lab.model import Accel, CloneKind, DiskBus, ImageRef, NicModel, Owned, Vm, VmSpec
from lab.runlock import RunLock
from lab.wait import wait_until

QEMU = "qemu-system-x86_64"
QBOOT = Path("/usr/share/qemu/qboot.rom")
READY_MARKER = b"LAB-READY"
PROBE_MARKER = re.compile(rb"Run /init as init process|Freeing unused kernel")

NIC_DEVICE = {
    NicModel.VIRTIO: "virtio-net-pci",
    NicModel.E1000: "e1000",
    NicModel.E1000E: "e1000e",
    NicModel.RTL8139: "rtl8139",
    NicModel.VMXNET3: "vmxnet3",
}


def disk_args(bus: DiskBus, path: Path) -> list[str]:
    drive = ["-drive", f"file={path},if=none,id=d0,format=qcow2,cache=writeback,discard=unmap"]
    device = {
        DiskBus.VIRTIO: ["-device", "virtio-blk-pci,drive=d0"],
        DiskBus.SCSI: ["-device", "virtio-scsi-pci,id=scsi0", "-device", "scsi-hd,drive=d0,bus=scsi0.0"],
        DiskBus.SATA: ["-device", "ahci,id=ahci0", "-device", "ide-hd,drive=d0,bus=ahci0.0"],
        DiskBus.IDE: ["-device", "ide-hd,drive=d0,bus=ide.0"],
        DiskBus.NVME: ["-device", "nvme,drive=d0,serial=lab0"],
    }[bus]
    return drive + device


def qemu_argv(spec: VmSpec, *, accel: Accel, vmdir: Path, kernel: Path, initrd: Path, cmdline: str,
              tap: str, gateway: str, prefix: int = 24) -> list[str]:
    """Pure: the QEMU command line for a VM (also used by `make bench` for the bare boot)."""
    append = f"{cmdline} lab.ip={spec.ip}/{prefix} lab.gw={gateway}".strip()
    argv = [
        QEMU, "-name", f"{spec.name},process={spec.name}",
        "-machine", f"pc,accel={accel.value}",
        "-nodefaults", "-no-user-config", "-display", "none",
        "-smp", str(spec.vcpus), "-m", str(spec.memory_mib),
        "-kernel", str(kernel), "-initrd", str(initrd), "-append", append,
        *disk_args(spec.disk_bus, vmdir / "disk.qcow2"),
        "-netdev", f"tap,id=n0,ifname={tap},script=no,downscript=no",
        "-device", f"{NIC_DEVICE[spec.nic]},netdev=n0,mac={spec.mac},romfile=",
        "-serial", f"file:{vmdir / 'console.log'}",
        "-qmp", f"unix:{vmdir / 'qmp.sock'},server=on,wait=off",
        "-pidfile", str(vmdir / "qemu.pid"),
    ]
    if QBOOT.exists():
        argv += ["-bios", str(QBOOT)]
    if accel is Accel.KVM:
        argv += ["-cpu", "host"]
    return argv


@dataclass
class LocalClient:
    """The load generator's side: the run's network namespace, at the bridge address."""

    address: str
    netns: str

    def argv(self, argv: list[str]) -> list[str]:
        return proc.netns_prefix(self.netns) + list(argv)


def netns_name(run_id: str) -> str:
    return f"lab-{run_id}"


@register
class LocalBackend:
    name = "local"
    nic_models = backend_nic_models("local")

    def __init__(self, host_name: str, settings: dict):
        self.host_name = host_name
        self.accel_setting = settings.get("accel", "auto")
        self.workdir = Path(settings.get("workdir", "/var/tmp/lab"))
        self.subnet = settings.get("subnet", "10.77.0")
        self.boot_timeout = float(settings.get("boot_timeout", 240))
        self._accel: Accel | None = None
        self._next_host = {}  # run id -> next address/tap number
        self._run_lock = None

    # -- checks and facts ---------------------------------------------------------------------
    def check(self) -> None:
        missing = [t for t in (QEMU, "qemu-img", "ip") if shutil.which(t) is None]
        if missing:
            raise UsageError(f"host {self.host_name!r}: {', '.join(missing)} not installed", hint="run `make setup`")
        if os.geteuid() != 0:
            raise UsageError(f"host {self.host_name!r}: the local backend needs root for network namespaces and taps")
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"host {self.host_name!r}: workdir {self.workdir}: {exc.strerror}") from None

    def facts(self) -> dict[str, object]:
        return {"backend": self.name, "accel": self._accel.value if self._accel else None,
                "qemu": qemu_version(), "kernel": platform.release()}

    # -- images -------------------------------------------------------------------------------
    def publish_image(self, image: ImageRef) -> str:
        """`lab images publish NAME local`: copy the built image into this host's image store,
        <workdir>/images/<name>/<sha256[:12]>/ (+ a `current` link), verified by sha256."""
        from lab import images

        return images.publish_local(image, self.workdir / "images")

    # -- accelerator ----------------------------------------------------------------------------
    def accel(self, image: ImageRef) -> Accel:
        if self._accel is None:
            if self.accel_setting == "tcg":
                self._accel = Accel.TCG
            elif self.accel_setting == "kvm":
                self._accel = Accel.KVM
            else:
                self._accel = probe_kvm(image, self.workdir)
        return self._accel

    # -- per run --------------------------------------------------------------------------------
    def open_run(self, run_id: str) -> LocalClient:
        ns = netns_name(run_id)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Held for the run's life: `lab gc` leaves alone what a live run owns.
        lock = RunLock(self.workdir / f"{ns}.lock")
        lock.acquire(what=f"the lock of run {run_id} (is another `lab run --resume` on it?)")
        self._run_lock = lock
        gw = f"{self.subnet}.1"
        try:
            proc.run(["ip", "netns", "add", ns], what="ip netns add")
            proc.run(["ip", "-n", ns, "link", "set", "lo", "up"])
            proc.run(["ip", "-n", ns, "link", "add", "br0", "type", "bridge"])
            proc.run(["ip", "-n", ns, "addr", "add", f"{gw}/24", "dev", "br0"])
            proc.run(["ip", "-n", ns, "link", "set", "br0", "up"])
        except LabError:
            self.close_run(run_id)
            raise
        self._next_host[run_id] = 0
        return LocalClient(address=gw, netns=ns)

    def close_run(self, run_id: str) -> None:
        ns = netns_name(run_id)
        try:
            remove_netns(ns)
        finally:
            if self._run_lock is not None:
                self._run_lock.release()
                self._run_lock = None

    # -- per VM ---------------------------------------------------------------------------------
    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        vmdir = self.workdir / spec.name
        ns = netns_name(spec.run_id)
        n = self._next_host.get(spec.run_id, 0)
        self._next_host[spec.run_id] = n + 1
        tap = f"tap{n % 1000:03d}"
        ip = spec.ip or f"{self.subnet}.{10 + n % 240}"
        mac = spec.mac or f"52:54:00:{(n >> 8) & 0xff:02x}:{n & 0xff:02x}:{0x10:02x}"
        from dataclasses import replace

        spec = replace(spec, ip=ip, mac=mac)
        vmdir.mkdir(parents=True, exist_ok=False)
        lease = {"run_id": spec.run_id, "vm": spec.name, "netns": ns, "tap": tap,
                 "expires_at": spec.expires_at, "created_at": time.time(), "clone": spec.clone.value}
        # The lease file is written before the disk: whatever exists, gc can find.
        (vmdir / "lease.json").write_text(json.dumps(lease))
        vm = Vm(spec=spec, backend=self.name, handle={"dir": str(vmdir), "netns": ns, "tap": tap}, address=ip)
        disk = vmdir / "disk.qcow2"
        try:
            t0 = time.monotonic()
            if spec.clone is CloneKind.LINKED:
                proc.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image.path), "-F", "qcow2", str(disk)],
                         what="qemu-img create (linked clone)")
            else:
                proc.run(["cp", "--reflink=auto", "--sparse=always", str(image.path), str(disk)],
                         timeout=600, what="full clone copy")
            vm.facts["clone_seconds"] = round(time.monotonic() - t0, 4)
            proc.run(["ip", "-n", ns, "tuntap", "add", tap, "mode", "tap"], what="tap add")
            proc.run(["ip", "-n", ns, "link", "set", tap, "master", "br0", "up"], what="tap up")
        except BaseException:
            self.destroy(vm)  # a half-made clone is removed here, not left for gc
            raise
        vm.facts["clone"] = spec.clone.value
        return vm

    def start(self, vm: Vm) -> None:
        image: ImageRef = vm.spec.image
        accel = self.accel(image)
        vmdir = Path(vm.handle["dir"])
        kernel, initrd, cmdline = boot_files(image)
        argv = qemu_argv(vm.spec, accel=accel, vmdir=vmdir, kernel=kernel, initrd=initrd, cmdline=cmdline,
                         tap=vm.handle["tap"], gateway=f"{self.subnet}.1")
        log = open(vmdir / "qemu.log", "wb")
        try:
            p = proc.spawn(argv, netns=vm.handle["netns"], stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        vm.handle["proc"] = p
        vm.handle["pid"] = p.pid
        vm.handle["started"] = time.monotonic()
        vm.facts["accel"] = accel.value
        lease = json.loads((vmdir / "lease.json").read_text())
        lease["pid"] = p.pid
        (vmdir / "lease.json").write_text(json.dumps(lease))

    def wait_booted(self, vm: Vm, timeout: float | None = None) -> float:
        """Wait for the guest's LAB-READY line on the serial console; seconds since start."""
        console = Path(vm.handle["dir"]) / "console.log"
        p: subprocess.Popen = vm.handle["proc"]

        def ready() -> bool:
            if p.poll() is not None:
                raise BackendError(f"{vm.name}: QEMU exited with status {p.returncode} during boot: "
                                   f"{_tail(Path(vm.handle['dir']) / 'qemu.log') or _tail(console)}")
            try:
                return READY_MARKER in console.read_bytes()
            except FileNotFoundError:
                return False

        wait_until(ready, timeout=timeout or self.boot_timeout, what=f"{vm.name} to boot (LAB-READY on its console)",
                   interval=0.1, max_interval=0.5, detail=lambda: f"console: {_tail(console) or 'empty'}")
        return time.monotonic() - vm.handle["started"]

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        vm.facts["boot_seconds"] = round(self.wait_booted(vm, timeout), 2)
        return vm.address

    def destroy(self, vm: Vm) -> None:
        name = vm.spec.name if vm.spec is not None else Path(vm.handle.get("dir", "?")).name
        problems = []
        p: subprocess.Popen | None = vm.handle.get("proc")
        if p is not None:
            try:
                stop_process(p)
            except LabError as exc:
                problems.append(str(exc))
        elif vm.handle.get("pid"):
            kill_pid(int(vm.handle["pid"]), name)
        ns, tap = vm.handle.get("netns"), vm.handle.get("tap")
        if ns and tap and netns_exists(ns):
            res = proc.run(["ip", "-n", ns, "link", "del", tap], check=False)
            if not res.ok and "Cannot find device" not in res.stderr:
                problems.append(f"tap {tap}: {res.stderr.strip()}")
        if ns and vm.handle.get("own_netns"):  # the bare-metal cell's namespace (lab.baremetal)
            try:
                remove_netns(ns)  # kills what still runs in it; its veth goes with it
            except TeardownError as exc:
                problems.append(str(exc))
        if vm.handle.get("cgroup"):
            try:
                remove_cgroup(Path(vm.handle["cgroup"]))
            except TeardownError as exc:
                problems.append(str(exc))
        vmdir = Path(vm.handle.get("dir", ""))
        if vmdir.name and vmdir.exists():
            try:
                shutil.rmtree(vmdir)
            except OSError as exc:
                problems.append(f"{vmdir}: {exc.strerror}")
        if problems:
            raise TeardownError(f"{name}: teardown incomplete: {'; '.join(problems)}")

    # -- garbage collection -----------------------------------------------------------------------
    def list_owned(self) -> list[Owned]:
        out: list[Owned] = []
        seen_vms = set()
        if self.workdir.is_dir():
            for d in sorted(self.workdir.glob("lab-*")):
                if not d.is_dir():
                    continue
                try:
                    lease = json.loads((d / "lease.json").read_text())
                except (OSError, ValueError):
                    lease = {"run_id": _run_of(d.name), "expires_at": 0}
                seen_vms.add(d.name)
                out.append(Owned(self.name, "vm", d.name, lease.get("run_id", ""), float(lease.get("expires_at") or 0),
                                 str(d)))
        # Only what this workdir owns: another workdir (another user's lab, a parallel test) is
        # not ours to reap. A QEMU is ours if its pidfile is here; a namespace if its lock file is.
        for pid, name in qemu_processes(self.workdir):
            if name not in seen_vms:
                out.append(Owned(self.name, "process", name, _run_of(name), 0.0, str(pid)))
        runs_here = {json.loads((d / "lease.json").read_text()).get("netns") for d in self.workdir.glob("lab-*/")
                     if (d / "lease.json").exists()} if self.workdir.is_dir() else set()
        for ns in list_netns():
            if ns.startswith("lab-") and ((self.workdir / f"{ns}.lock").exists() or ns in runs_here):
                # lab-<run>, or lab-<run>-bm01 of a bare-metal cell: both belong to <run>
                out.append(Owned(self.name, "netns", ns, re.sub(r"-bm\d+$", "", ns.removeprefix("lab-")), 0.0, ""))
        return out

    def run_is_live(self, run_id: str) -> bool:
        """True while a `lab run` process holds the run's lock."""
        return bool(runlock.held(self.workdir / f"{netns_name(run_id)}.lock"))

    def remove_owned(self, item: Owned) -> None:
        if item.kind == "vm":
            d = Path(item.detail)
            try:
                lease = json.loads((d / "lease.json").read_text())
            except (OSError, ValueError):
                lease = {}
            vm = Vm(spec=None, backend=self.name, handle={"dir": str(d), "netns": lease.get("netns"),  # type: ignore[arg-type]
                                                         "tap": lease.get("tap"), "pid": lease.get("pid"),
                                                         "own_netns": lease.get("own_netns"),
                                                         "cgroup": lease.get("cgroup")})
            for pid, name in qemu_processes(self.workdir):
                if name == item.name:
                    kill_pid(pid, item.name)
            vm.handle["pid"] = None
            self.destroy(vm)
        elif item.kind == "process":
            kill_pid(int(item.detail), item.name)
        elif item.kind == "netns":
            remove_netns(item.name)
            runlock.remove_if_dead(self.workdir / f"{item.name}.lock")


# -- helpers (module level so `lab gc`, tests and the benchmark share them) ------------------------

def boot_files(image: ImageRef) -> tuple[Path, Path, str]:
    m = image.manifest
    images.require_boot(image, "kernel", "the local backend")
    base = image.path.parent
    paths = m.get("paths", {})
    kernel = base / paths.get("kernel", f"{image.name}/vmlinuz")
    initrd = base / paths.get("initrd", f"{image.name}/initrd.img")
    cmdline = m.get("cmdline", "console=ttyS0 root=LABEL=labroot rw net.ifnames=0")
    for f in (kernel, initrd, image.path):
        if not f.exists():
            raise UsageError(f"image {image.name!r} is incomplete: {f} is missing", hint="run `make images`")
    return kernel, initrd, cmdline


def _run_of(name: str) -> str:
    parts = name.split("-")
    return parts[1] if len(parts) >= 3 and parts[0] == "lab" else ""


def _tail(path: Path, lines: int = 2) -> str:
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError:
        return ""
    tail = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(tail)[-300:]


def stop_process(p: subprocess.Popen) -> None:
    """SIGTERM, bounded wait, SIGKILL. The VM is disposable: no graceful shutdown needed."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            wait_until(lambda: p.poll() is not None, timeout=10, what=f"QEMU pid {p.pid} to exit after SIGTERM",
                       interval=0.01, max_interval=0.2)
        except LabError:
            p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                raise TeardownError(f"QEMU pid {p.pid} survived SIGKILL") from None
    else:
        p.wait()


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def qemu_processes(workdir: Path | None = None) -> list[tuple[int, str]]:
    """(pid, vm name) of every QEMU this lab started (named lab-<run>-<cell>), optionally only
    those whose pidfile lies under `workdir`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = _cmdline(int(entry.name))
        if not argv or not argv[0].endswith(QEMU):
            continue
        if "-name" in argv:
            name = argv[argv.index("-name") + 1].split(",")[0]
            if not name.startswith("lab-"):
                continue
            if workdir is not None:
                pidfile = argv[argv.index("-pidfile") + 1] if "-pidfile" in argv else ""
                if not pidfile.startswith(str(workdir).rstrip("/") + "/"):
                    continue
            out.append((int(entry.name), name))
    return out


def kill_pid(pid: int, name: str) -> None:
    """Kill a QEMU we did not start in this process (gc), after checking it is the one named."""
    argv = _cmdline(pid)
    if not argv or not any(a.startswith(name) for a in argv):
        return  # gone, or the pid was reused by something else: not ours to kill
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        try:
            wait_until(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), timeout=10,
                       what=f"pid {pid} ({name}) to exit", interval=0.01, max_interval=0.2)
            return
        except LabError:
            continue
    raise TeardownError(f"{name}: pid {pid} survived SIGKILL")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def remove_cgroup(path: Path) -> None:
    """Remove a cgroup the lab made (the bare-metal cell's), killing what still runs in it."""
    if not path.is_dir():
        return
    procs = path / "cgroup.procs"

    def pids() -> list[int]:
        try:
            return [int(x) for x in procs.read_text().split()]
        except (OSError, ValueError):
            return []

    def empty() -> bool:
        for pid in pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return not pids()

    try:
        wait_until(empty, timeout=10, what=f"the processes of cgroup {path} to exit", interval=0.02, max_interval=0.2)
        path.rmdir()
    except (LabError, OSError) as exc:
        raise TeardownError(f"cgroup {path}: {getattr(exc, 'strerror', None) or exc}") from None


def list_netns() -> list[str]:
    res = proc.run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def netns_exists(ns: str) -> bool:
    return Path(f"/run/netns/{ns}").exists()


def remove_netns(ns: str) -> None:
    if not netns_exists(ns):
        return
    res = proc.run(["ip", "netns", "pids", ns], check=False)
    for pid in (int(x) for x in res.stdout.split() if x.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    res = proc.run(["ip", "netns", "del", ns], check=False)
    if not res.ok:
        raise TeardownError(f"network namespace {ns}: {res.stderr.strip()}")


_qemu_version: str | None = None


def qemu_version() -> str:
    global _qemu_version
    if _qemu_version is None:
        try:
            out = proc.run([QEMU, "--version"], timeout=10).stdout
            _qemu_version = out.splitlines()[0].split("version", 1)[-1].strip()
        except LabError:
            _qemu_version = "unknown"
    return _qemu_version


KVM_PROBE_CACHE = Path("/var/tmp/lab/kvm-probe.json")


def probe_kvm(image: ImageRef, workdir: Path, timeout: float = 15.0, cache: Path = KVM_PROBE_CACHE) -> Accel:
    """Boot the image's kernel under KVM and wait for it to reach init. Cached per host kernel and
    QEMU version (in one place for every workdir: it is a fact of the machine)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return Accel.TCG
    key = f"{platform.release()}|{qemu_version()}"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return Accel(cached["accel"])
    except (OSError, ValueError, KeyError):
        pass
    kernel, initrd, _ = boot_files(image)
    probe_dir = workdir / f"kvm-probe-{os.getpid()}"
    probe_dir.mkdir(parents=True, exist_ok=True)
    console = probe_dir / "console.log"
    argv = [QEMU, "-name", "kvm-probe", "-machine", "pc,accel=kvm", "-cpu", "host", "-nodefaults",
            "-no-user-config", "-display", "none", "-m", "256", "-kernel", str(kernel), "-initrd", str(initrd),
            "-append", "console=ttyS0 earlyprintk=serial panic=-1", "-no-reboot", "-serial", f"file:{console}"]
    p = proc.spawn(argv)
    verdict = Accel.TCG
    try:
        wait_until(lambda: p.poll() is not None or PROBE_MARKER.search(console.read_bytes() if console.exists() else b""),
                   timeout=timeout, what="a kernel under KVM to reach init", interval=0.1, max_interval=0.5)
        if console.exists() and PROBE_MARKER.search(console.read_bytes()):
            verdict = Accel.KVM
    except LabError:
        verdict = Accel.TCG
    finally:
        stop_process(p)
        shutil.rmtree(probe_dir, ignore_errors=True)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "accel": verdict.value, "probed_at": time.time()}))
    tmp.replace(cache)
    return verdict


def lab_key() -> Path:
    key = IMAGES_DIR / "lab_key"
    if not key.exists():
        raise UsageError(f"SSH key {key} is missing", hint="run `make images`")
    os.chmod(key, 0o600)
    return key
