"""libvirt backend: bhyve hosts (``bhyve+ssh://root@HOST/system``) and QEMU hosts
(``qemu:///system``) through one libvirt-python code path.

A VM is a per-VM disk clone plus a persistent domain rendered from ``templates/libvirt/`` (one
Jinja2 template per driver). The domain carries the lab lease in its ``<metadata>``::

    <lab:lease xmlns:lab="https://lab.invalid/lease" run="RUN" cell="CELL" expires="UNIX"
               host="HOST" ip="STATIC-IP" disk="zfs:POOL/DS/NAME | file:/PATH" console="PATH"/>

so ``list_owned()`` finds it (and its disk) for ``lab gc`` even if the results store is gone.

Settings (``[hosts.NAME]`` with ``backend = "libvirt"``; a value of None means "not set"):

``uri``            libvirt URI (required): ``bhyve+ssh://root@bsd1/system`` (add ``?keyfile=K&no_tty=1``
                   for non-interactive SSH), ``bhyve:///system`` when lab runs on the bhyve host,
                   ``qemu:///system``, ``qemu+ssh://root@kvm1/system``, or ``test:///default`` (contract
                   tests; see ``flavour``).
``ssh``            how to reach the host for shell commands (zfs, qemu-img, rm, arp): ssh arguments,
                   e.g. ``"root@bsd1"`` or ``"-p 2222 -i ~/.ssh/lab root@bsd1"``. Default: derived
                   from a ``+ssh`` URI (user, host, port, keyfile); local URIs run commands here.
``dataset``        bhyve: ZFS dataset holding the golden zvols and the clones (required on bhyve).
                   Clones are ``DATASET/VMNAME`` zvols (``volmode=dev``, user properties ``lab:run``,
                   ``lab:expires``), used as ``/dev/zvol/DATASET/VMNAME``.
``golden``         bhyve: the golden snapshot, a format string over ``dataset``, ``image`` and
                   ``digest``; default ``"{dataset}/{image}@gold"``.
``firmware``       bhyve: ``uefi`` (default; read-only ``BHYVE_UEFI.fd`` pflash, no NVRAM) or
                   ``bhyveload`` (FreeBSD guests).
``loader``         bhyve: UEFI firmware path; default ``/usr/local/share/uefi-firmware/BHYVE_UEFI.fd``.
``dir``            QEMU: directory on the host for clone disks and console logs
                   (alias ``pool_dir``; default ``/var/lib/libvirt/images/lab``).
``pool``           QEMU: a libvirt storage pool whose target path is used instead of ``dir``
                   (refreshed after clone/remove/publish).
``images_dir``     QEMU: where golden images live on the host, in the images/ layout (NAME.qcow2,
                   NAME/vmlinuz, NAME/initrd.img, NAME.json). Default: ``dir`` (the pool's path).
                   A golden found there whose manifest names another recipe digest is refused;
                   none there means, on a local host, the image is used where `lab images build`
                   left it, and on a remote host an error asking for `lab images publish`.
``disk_format``    QEMU: ``qcow2`` (default) or ``raw`` (only with full clones); bhyve: ``raw`` only.
``bridge``         host bridge the NIC joins (bhyve default ``bridge0``). With neither ``bridge``
                   nor ``network`` a QEMU NIC uses user networking (``<interface type='user'>``).
``network``        a libvirt network instead of a bridge (``<interface type='network'>``; enables
                   DHCP lease lookup).
``subnet``         give each VM a static address from this subnet when the cell has none, e.g.
                   ``"10.78.5.0/24"``: the first free host address from .10 up, skipping the gateway
                   and addresses recorded in other domains' leases (QEMU direct kernel boot passes it
                   as ``lab.ip=``; the prefix comes from the subnet).
``prefix``         prefix length of the static guest address (default 24).
``gateway``        default gateway given to guests (``lab.gw=``); default none (isolated).
``client_address`` address of the load-generator side as the guests see it (``open_run``).
``domain_type``    QEMU: ``qemu`` (TCG, default: KVM hangs nested guests on our machines) or ``kvm``.
``machine``        QEMU machine type (default ``pc``).
``bios``           QEMU: firmware ROM instead of SeaBIOS, e.g. ``/usr/share/qemu/qboot.rom`` (faster
                   direct kernel boot under TCG; cannot boot from disk).
``cpu_mode``       QEMU ``<cpu mode>`` (default none under TCG, ``host-passthrough`` with kvm).
``boot``           QEMU: ``auto`` (default: direct kernel boot when the image has a kernel),
                   ``kernel`` or ``disk``.
``cmdline``        QEMU direct kernel boot: base kernel command line (default: the image
                   manifest's, else ``console=ttyS0 root=LABEL=labroot rw net.ifnames=0``);
                   ``lab.ip=ADDR/PREFIX`` and ``lab.gw=GW`` are appended per VM.
``dac_label``      QEMU: run QEMU under this static DAC label without relabelling files, e.g.
                   ``"+0:+0"``; default: libvirt's own (libvirt-qemu, files relabelled).
``guest_agent``    QEMU: add the qemu-guest-agent channel (default false; bhyve: never).
``flavour``        test:/// URIs only: which template/capabilities to use, ``qemu`` or ``bhyve``.
``ssh_port``       guest SSH port probed by ``wait_ready`` (default 22).
``boot_timeout``   seconds ``wait_ready`` waits when the caller gives no timeout (default 300).

Capabilities are checked before anything is created: ``plan_check()`` (`lab plan`, no
connection needed) rejects a NIC model, disk bus, disk format, setting or feature the driver
cannot use with a SettingError naming the lab.toml key and value; ``check()`` adds the host's
libvirt version, ``check_image()`` that the golden image is on the host and is this recipe.

Publishing (``publish_image``, for `lab images publish OS HOST`): on bhyve a sparse zvol
``DATASET/IMAGE`` (``volmode=dev``, ``lab:digest``) filled with the raw image by ``dd`` over SSH,
and the snapshot clones are made from; on QEMU the images/ layout copied to ``images_dir``.

Addresses, in order (``address()``): the static address lab gave the guest; libvirt's DHCP
leases (``interfaceAddresses(LEASE)`` where the driver has it, bhyve >= 12.3; the libvirt
network's ``DHCPLeases()`` on any version); libvirt's ARP source (QEMU hosts); the host's
neighbour table by MAC (``arp -an`` on FreeBSD, ``ip neigh`` on Linux, over SSH for remote
hosts); the serial console last (the QEMU console log, else the console stream: bhyve's nmdm
keeps no log, so ``start()`` opens ``virDomainOpenConsole`` and reads it while the guest boots).

`lab gc`: ``open_run`` holds a lock file on the orchestrating machine for the run's life, so
``run_is_live`` tells a live run from one killed with -9 (whose domains libvirtd keeps running);
runs of other machines are retired by their lease expiry.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
import socket
import threading
import time
import uuid as uuidlib
from dataclasses import dataclass, field, replace
from hashlib import sha256
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import parse_qs, urlsplit
from xml.etree import ElementTree as ET

import lab
from lab import images, proc, runlock
from lab.backends import register
from lab.errors import (AuthError, BackendError, CommandError, LabError, SettingError, TeardownError,
                        UnreachableError, UsageError)
from lab.model import CloneKind, DiskBus, ImageRef, NicModel, Owned, Vm, VmSpec
from lab.runlock import RUN_LOCK_DIR, RunLocks
from lab.wait import wait_until

LEASE_NS = "https://lab.invalid/lease"
LEASE_KEY = "lab"
BHYVE_UEFI = "/usr/local/share/uefi-firmware/BHYVE_UEFI.fd"
DEFAULT_QEMU_DIR = "/var/lib/libvirt/images/lab"
DEFAULT_CMDLINE = "console=ttyS0 root=LABEL=labroot rw net.ifnames=0"
TEMPLATE_DIR = lab.TEMPLATES_DIR / "libvirt"
FAILED_MARK = "LAB-FAILED"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_SSH_OPTS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=10"]

KNOWN_SETTINGS = frozenset({
    "backend", "uri", "ssh", "dataset", "golden", "firmware", "loader", "dir", "pool_dir", "pool",
    "images_dir", "disk_format", "bridge", "network", "subnet", "prefix", "gateway", "client_address",
    "domain_type", "machine", "bios", "cpu_mode", "boot", "cmdline", "dac_label", "guest_agent", "flavour",
    "ssh_port", "boot_timeout",
    "source",  # the lab.toml path the runner adds to every host's settings
})


# --------------------------------------------------------------------------------------------
# Capabilities (../shared/research/bhyve.md sections 2-3)

def _v(major: int, minor: int, micro: int = 0) -> int:
    """libvirt's version number encoding (getLibVersion())."""
    return major * 1_000_000 + minor * 1_000 + micro


def _vs(version: int) -> str:
    return f"{version // 1_000_000}.{version // 1_000 % 1_000}.{version % 1_000}"


@dataclass(frozen=True)
class Caps:
    driver: str
    nics: frozenset[NicModel]
    disk_buses: frozenset[DiskBus]
    disk_formats: frozenset[str]
    features: frozenset[str]  # optional features the driver has at all
    max_vcpus: int
    # value -> minimum libvirt version on the host (checked once check() knows the version)
    since: dict[str, int] = field(default_factory=dict)


FEATURES = ("snapshots", "save-restore", "suspend", "hotplug", "guest-agent", "interface-addresses",
            "direct-kernel-boot", "memory-balloon", "migration")

CAPABILITIES: dict[str, Caps] = {
    "bhyve": Caps(
        driver="bhyve",
        nics=frozenset({NicModel.VIRTIO, NicModel.E1000}),
        disk_buses=frozenset({DiskBus.SATA, DiskBus.VIRTIO, DiskBus.NVME}),
        disk_formats=frozenset({"raw"}),
        # snapshots, save/restore, suspend, hotplug, balloon, migration: never on bhyve
        features=frozenset({"guest-agent", "interface-addresses"}),
        max_vcpus=16,
        since={"e1000": _v(3, 1), "uefi": _v(3, 2), "topology": _v(4, 5), "nvme": _v(11, 9),
               "interface-addresses": _v(12, 3), "guest-agent": _v(12, 4)},
    ),
    "qemu": Caps(
        driver="qemu",
        nics=frozenset(NicModel),
        # bus='nvme' disks are newer than the libvirt (9.0) we test against: left out on purpose
        disk_buses=frozenset({DiskBus.VIRTIO, DiskBus.SCSI, DiskBus.SATA, DiskBus.IDE}),
        disk_formats=frozenset({"qcow2", "raw"}),
        features=frozenset(FEATURES),
        max_vcpus=255,
    ),
}

# target dev per bus, as the drivers' own test data name them
_DISK_DEV = {
    "bhyve": {DiskBus.SATA: "hda", DiskBus.VIRTIO: "vda", DiskBus.NVME: "nvme0n1"},
    "qemu": {DiskBus.VIRTIO: "vda", DiskBus.SCSI: "sda", DiskBus.SATA: "sda", DiskBus.IDE: "hda",
             DiskBus.NVME: "nvme0n1"},
}


def driver_for_uri(uri: str, flavour: str | None = None) -> str:
    """'bhyve' or 'qemu' (the template and capability set) for a libvirt URI."""
    scheme = urlsplit(uri).scheme.split("+")[0].lower()
    if scheme == "test":
        flavour = flavour or "qemu"
        if flavour not in CAPABILITIES:
            raise SettingError("flavour", flavour, f"must be one of {', '.join(sorted(CAPABILITIES))}")
        return flavour
    if scheme not in CAPABILITIES:
        raise SettingError("uri", uri, f"unsupported libvirt driver {scheme!r}; "
                           f"lab drives bhyve and qemu (and test for contract tests)")
    return scheme


def nic_models_for_uri(uri: str, flavour: str | None = None) -> frozenset[NicModel]:
    """NIC models a libvirt host can emulate, from its URI alone (usable at plan time)."""
    return CAPABILITIES[driver_for_uri(uri, flavour)].nics


def mac_for(name: str) -> str:
    """A stable locally administered-style MAC in QEMU's 52:54:00 range, derived from the VM name."""
    h = sha256(name.encode()).digest()
    return "52:54:00:%02x:%02x:%02x" % (h[0], h[1], h[2])


def _libvirt():
    try:
        import libvirt  # noqa: PLC0415 - optional dependency, imported when a backend is used
    except ImportError as exc:
        raise LabError("libvirt-python is not installed (needed by the libvirt backend)",
                       hint="run `make setup` (pip install -e '.[libvirt]')") from exc
    if not getattr(libvirt, "_lab_quiet", False):
        # libvirt prints every error to stderr by default; we raise them as exceptions instead
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        libvirt._lab_quiet = True
    return libvirt


def _code(exc: Exception) -> int:
    get = getattr(exc, "get_error_code", None)
    return get() if get else -1


def _msg(exc: Exception) -> str:
    get = getattr(exc, "get_error_message", None)
    return (get() if get else None) or str(exc)


# --------------------------------------------------------------------------------------------

class ConsoleTap:
    """The guest's first serial port through libvirt's console stream (virDomainOpenConsole): on
    bhyve the nmdm slave (opened raw by libvirtd, so nothing is echoed back into the guest), on
    QEMU the pty. It is the one console reader that works on every driver and over any URI
    (bhyve+ssh included): nmdm keeps no log, so what the guest prints must be read while it prints.

    A daemon thread blocks in stream.recv() (libvirt-python releases the GIL; a blocking stream
    needs no event loop) and appends to a bounded buffer. The stream has a connection of its own:
    a recv blocked on a shared connection would hold every other call on it (seen on 9.0)."""

    LIMIT = 1 << 20  # keep the last MiB: boot logs are small, a chatty guest must not grow us

    def __init__(self, uri: str, name: str):
        libvirt = _libvirt()
        self._libvirt_error = libvirt.libvirtError
        self._buf = bytearray()
        self._lock = threading.Lock()
        self.error = ""
        self._conn = libvirt.open(uri)
        try:
            self._stream = self._conn.newStream(0)
            # bhyve accepts no flags (virCheckFlags(0) in bhyveDomainOpenConsole)
            self._conn.lookupByName(name).openConsole(None, self._stream, 0)
        except libvirt.libvirtError:
            self._conn.close()
            raise
        self._thread = threading.Thread(target=self._read, name=f"console-{name}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = self._stream.recv(4096)
            except self._libvirt_error as exc:  # domain gone, stream aborted
                self.error = _msg(exc)
                return
            if not isinstance(data, bytes) or not data:
                return  # EOF
            with self._lock:
                self._buf += data
                if len(self._buf) > self.LIMIT:
                    del self._buf[:len(self._buf) - self.LIMIT]

    def text(self) -> str:
        with self._lock:
            return self._buf.decode(errors="replace")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Abort the stream (this unblocks the reader), then drop the connection. Idempotent."""
        if self._conn is None:
            return
        if self._thread.is_alive():
            try:
                self._stream.abort()
            except self._libvirt_error:
                pass
        self._thread.join(timeout)
        try:
            self._conn.close()
        except self._libvirt_error:
            pass
        self._conn = None


@dataclass
class LibvirtClient:
    address: str

    def argv(self, argv: list[str]) -> list[str]:
        return list(argv)


@register
class LibvirtBackend:
    name = "libvirt"
    nic_models: frozenset[NicModel] = frozenset({NicModel.VIRTIO, NicModel.E1000})

    def __init__(self, host_name: str, settings: dict, *,
                 runner: Callable[..., proc.Result] | None = None):
        self.host_name = host_name
        s = {k: v for k, v in dict(settings).items() if v is not None}
        unknown = sorted(set(s) - KNOWN_SETTINGS)
        if unknown:
            raise UsageError(f"hosts.{host_name}: unknown libvirt setting(s) {', '.join(unknown)}",
                             hint=f"known: {', '.join(sorted(KNOWN_SETTINGS - {'backend'}))}")
        if not s.get("uri"):
            raise UsageError(f"hosts.{host_name}.uri is missing",
                             hint="e.g. uri = \"bhyve+ssh://root@bsd1/system\" or \"qemu:///system\"")
        self.settings = s
        self.uri: str = s["uri"]
        self.scheme = urlsplit(self.uri).scheme.split("+")[0].lower()
        self.driver = driver_for_uri(self.uri, s.get("flavour"))
        self.caps = CAPABILITIES[self.driver]
        self.nic_models = self.caps.nics
        self._run = runner or proc.run
        self._conn = None
        self.lib_version: int | None = None  # host libvirt, known after check()
        self._ssh = self._ssh_args()

        where = f"hosts.{host_name}."

        def bad(key: str, value: object, problem: str, hint: str | None = None) -> SettingError:
            return SettingError(key, value, problem, hint, where=where)

        if self.driver == "bhyve":
            self.firmware = s.get("firmware", "uefi")
            if self.firmware not in ("uefi", "bhyveload"):
                raise bad("firmware", self.firmware, "must be uefi or bhyveload")
            self.dataset = str(s.get("dataset", "")).strip("/")
            if not self.dataset:
                raise bad("dataset", None, "a bhyve host needs the ZFS dataset that holds the golden "
                          "zvols and the clones", hint='e.g. dataset = "zroot/lab"')
            self.disk_format = s.get("disk_format", "raw")
            self.bridge = s.get("bridge", "bridge0")
        else:
            self.firmware = "bios"
            self.dataset = ""
            self.disk_format = s.get("disk_format", "qcow2")
            self.bridge = s.get("bridge", "")
        if self.disk_format not in self.caps.disk_formats:
            raise bad("disk_format", self.disk_format, f"the {self.driver} driver reads only "
                      f"{', '.join(sorted(self.caps.disk_formats))} disks")
        self.domain_type = s.get("domain_type", "qemu")
        if self.driver == "qemu" and self.domain_type not in ("qemu", "kvm"):
            raise bad("domain_type", self.domain_type, "must be qemu (TCG) or kvm")
        self.boot = s.get("boot", "auto")
        if self.boot not in ("auto", "kernel", "disk"):
            raise bad("boot", self.boot, "must be auto, kernel or disk")
        if self.driver == "bhyve" and s.get("guest_agent"):
            raise bad("guest_agent", True, "bhyve has no qemu-guest-agent support lab can rely on "
                      "(libvirt >= 12.4 only, never for IP discovery)")
        self.subnet = None
        if s.get("subnet"):
            try:
                self.subnet = ipaddress.ip_network(str(s["subnet"]), strict=False)
            except ValueError:
                raise bad("subnet", s["subnet"], "not a network like 10.78.5.0/24") from None
        self.prefix = int(s.get("prefix", self.subnet.prefixlen if self.subnet else 24))
        self._dir: str | None = None
        self._run_locks = RunLocks(self._run_lock_path)
        self._golden_roots: dict[str, str | None] = {}  # image name -> host dir (None: in place)

    # ---------------------------------------------------------------- host commands

    def _ssh_args(self) -> list[str] | None:
        """ssh arguments that reach the host, or None when host commands run on this machine."""
        if self.settings.get("ssh"):
            return shlex.split(str(self.settings["ssh"]))
        parts = urlsplit(self.uri)
        if "+ssh" not in parts.scheme or not parts.hostname:
            return None
        args: list[str] = []
        if parts.port:
            args += ["-p", str(parts.port)]
        keyfile = parse_qs(parts.query).get("keyfile")
        if keyfile:
            args += ["-i", keyfile[0]]
        args.append(f"{parts.username}@{parts.hostname}" if parts.username else parts.hostname)
        return args

    @property
    def remote(self) -> bool:
        return self._ssh is not None

    def host_argv(self, argv: Sequence[str]) -> list[str]:
        """argv that runs `argv` on the libvirt host (over ssh for remote hosts)."""
        argv = [str(a) for a in argv]
        if self._ssh is None:
            return argv
        return ["ssh", *_SSH_OPTS, *self._ssh, shlex.join(argv)]

    def host_shell_argv(self, command: str) -> list[str]:
        """argv that runs a shell pipeline on the host (zfs send | zfs recv)."""
        if self._ssh is None:
            return ["sh", "-c", command]
        return ["ssh", *_SSH_OPTS, *self._ssh, command]

    def _host(self, argv: Sequence[str], *, what: str, timeout: float = 120.0, check: bool = True):
        return self._run(self.host_argv(argv), timeout=timeout, check=check, what=what)

    # ---------------------------------------------------------------- connection

    @property
    def conn(self):
        libvirt = _libvirt()
        if self._conn is not None:
            try:
                if self._conn.isAlive():
                    return self._conn
            except libvirt.libvirtError:
                pass
            self._conn = None
        try:
            self._conn = libvirt.open(self.uri)
        except libvirt.libvirtError as exc:
            msg = _msg(exc)
            if _code(exc) in (libvirt.VIR_ERR_AUTH_FAILED, getattr(libvirt, "VIR_ERR_AUTH_CANCELLED", -2)) \
                    or "authentication" in msg.lower() or "permission denied" in msg.lower():
                raise AuthError(f"libvirt refused {self._safe_uri()}: {msg}",
                                hint="check the SSH key / polkit rights for the libvirt socket") from None
            raise UnreachableError(f"cannot connect to libvirt at {self._safe_uri()}: {msg}",
                                   hint="is libvirtd running on the host (libvirtd -d / service libvirtd start)?"
                                   ) from None
        return self._conn

    def _safe_uri(self) -> str:
        return self.uri.split("?", 1)[0]

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None

    # ---------------------------------------------------------------- capabilities

    def supports(self, feature: str) -> bool:
        if feature not in self.caps.features:
            return False
        need = self.caps.since.get(feature)
        return not (need and self.lib_version is not None and self.lib_version < need)

    def require(self, feature: str) -> None:
        """UsageError unless the driver (and, once known, the host's libvirt) has `feature`."""
        if feature not in FEATURES:
            raise UsageError(f"unknown feature {feature!r}; known: {', '.join(FEATURES)}")
        if feature not in self.caps.features:
            raise SettingError("requires", feature, f"not available on libvirt/{self.driver} host "
                               f"{self.host_name!r}", hint=self._bhyve_hint(feature))
        need = self.caps.since.get(feature)
        if need and self.lib_version is not None and self.lib_version < need:
            raise SettingError("requires", feature, f"needs libvirt >= {_vs(need)} on host {self.host_name!r}, "
                               f"which runs {_vs(self.lib_version)}")

    def _bhyve_hint(self, feature: str) -> str | None:
        if self.driver != "bhyve":
            return None
        return {"snapshots": "bhyve has no domain snapshots; lab uses zfs clones instead",
                "save-restore": "bhyve cannot save/restore memory: cold boots only",
                }.get(feature, "the bhyve driver lacks it (see shared/research/bhyve.md, capability table)")

    def validate_spec(self, spec: VmSpec) -> None:
        """Plan-time check: everything this spec asks of the driver exists. Raises SettingError
        naming the lab.toml key and value (a matrix axis); creates nothing, needs no connection."""
        where = f"host {self.host_name!r} (libvirt/{self.driver})"
        if not _NAME_RE.match(spec.name):
            raise UsageError(f"VM name {spec.name!r} is not usable as a libvirt/zfs/file name")
        try:
            nic = NicModel(spec.nic)
        except ValueError:
            raise SettingError("nic", spec.nic, "unknown NIC model") from None
        if nic not in self.caps.nics:
            raise SettingError("nic", nic.value, f"not available on {where}, which emulates only "
                               f"{', '.join(sorted(m.value for m in self.caps.nics))}",
                               hint="exclude it for this host in [matrix] exclude")
        try:
            bus = DiskBus(spec.disk_bus)
        except ValueError:
            raise SettingError("disk_bus", spec.disk_bus, "unknown disk bus") from None
        if bus not in self.caps.disk_buses:
            raise SettingError("disk_bus", bus.value, f"not available on {where}, which offers "
                               f"{', '.join(sorted(b.value for b in self.caps.disk_buses))}",
                               hint="exclude it for this host in [matrix] exclude")
        for key, value in (("nic", nic.value), ("disk_bus", bus.value)):
            need = self.caps.since.get(value)
            if need and self.lib_version is not None and self.lib_version < need:
                raise SettingError(key, value, f"needs libvirt >= {_vs(need)} on {where}, "
                                   f"which runs {_vs(self.lib_version)}")
        if self.driver == "bhyve" and self.firmware == "uefi":
            need = self.caps.since["uefi"]
            if self.lib_version is not None and self.lib_version < need:
                raise SettingError("firmware", "uefi", f"needs libvirt >= {_vs(need)} on {where}",
                                   where=f"hosts.{self.host_name}.")
        if CloneKind(spec.clone) is CloneKind.LINKED and self.disk_format != "qcow2" and self.driver == "qemu":
            raise SettingError("clone", "linked", f"a linked clone needs disk_format qcow2 on {where} "
                               f"(it has {self.disk_format})", hint="use clone = full, or disk_format = qcow2")
        if not 1 <= spec.vcpus <= self.caps.max_vcpus:
            raise SettingError("vcpus", spec.vcpus, f"outside 1..{self.caps.max_vcpus} on {where}")
        if spec.memory_mib < 64:
            raise SettingError("memory_mib", spec.memory_mib, "too small (>= 64)")
        if spec.ip:
            try:
                ipaddress.ip_interface(spec.ip if "/" in spec.ip else f"{spec.ip}/{self.prefix}")
            except ValueError:
                raise UsageError(f"ip = {spec.ip!r} is not an IPv4/IPv6 address") from None
        if spec.mac and not re.match(r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$", spec.mac.lower()):
            raise UsageError(f"mac = {spec.mac!r} is not a MAC address")
        for feature in filter(None, (f.strip() for f in spec.labels.get("requires", "").split(","))):
            self.require(feature)

    @classmethod
    def plan_check(cls, host_name: str, settings: dict, specs: Sequence[VmSpec]) -> None:
        """What `lab plan` asks before anything exists: the host's settings and every cell's
        NIC model, disk bus, clone kind and size against the driver's capabilities (from the URI
        alone: no connection). Raises SettingError naming the key and value."""
        backend = cls(host_name, settings)
        for spec in specs:
            backend.validate_spec(spec)

    # ---------------------------------------------------------------- Backend protocol

    def check(self) -> None:
        libvirt = _libvirt()
        conn = self.conn
        try:
            self.lib_version = conn.getLibVersion()
            hv_type = conn.getType().lower()
        except libvirt.libvirtError as exc:
            raise UnreachableError(f"libvirt at {self._safe_uri()} does not answer: {_msg(exc)}") from None
        want = "test" if self.scheme == "test" else self.driver
        if hv_type != want:
            raise UsageError(f"uri = {self.uri!r} reaches a {hv_type!r} driver, expected {want!r}")
        for need_key in (["uefi"] if self.driver == "bhyve" and self.firmware == "uefi" else []):
            need = self.caps.since[need_key]
            if self.lib_version < need:
                raise UsageError(f"firmware 'uefi' needs libvirt >= {_vs(need)} on host {self.host_name!r}")
        if self.scheme == "test":
            return
        if self.driver == "bhyve":
            res = self._host(["zfs", "list", "-H", "-o", "name", self.dataset], what="zfs list", check=False,
                             timeout=30)
            if not res.ok:
                raise UsageError(f"hosts.{self.host_name}.dataset = {self.dataset!r}: not found on the host "
                                 f"({(res.stderr or res.stdout).strip()[:200]})")
            if self.firmware == "uefi":
                loader = self.settings.get("loader", BHYVE_UEFI)
                if not self._host(["test", "-r", loader], what="test -r", check=False, timeout=30).ok:
                    raise UsageError(f"hosts.{self.host_name}.loader = {loader!r}: not readable on the host",
                                     hint="pkg install bhyve-firmware, or firmware = \"bhyveload\"")
        else:
            self._host(["qemu-img", "--version"], what="qemu-img", timeout=30)

    def _run_lock_path(self, run_id: str) -> Path:
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", self.host_name)  # no "@": it separates the run id
        return RUN_LOCK_DIR / f"libvirt-{host}@{run_id}.lock"

    def open_run(self, run_id: str) -> LibvirtClient:
        # Held for the run's life on the orchestrating machine: `lab gc` here tells a live run
        # from one killed with -9 (whose domains keep running under libvirtd).
        self._run_locks.acquire(run_id, what=f"the lock of run {run_id} on host {self.host_name!r}")
        return LibvirtClient(address=str(self.settings.get("client_address", self.settings.get("gateway", ""))))

    def close_run(self, run_id: str) -> None:
        self._run_locks.release(run_id)

    def run_is_live(self, run_id: str) -> bool | None:
        return self._run_locks.live(run_id)

    def facts(self) -> dict[str, object]:
        f: dict[str, object] = {"backend": "libvirt", "libvirt_driver": self.driver,
                                "libvirt_uri": self._safe_uri()}
        if self.driver == "qemu":
            f["accel"] = "kvm" if self.domain_type == "kvm" else "tcg"
        try:
            conn = self.conn
            f["libvirt_version"] = _vs(conn.getLibVersion())
            f["hypervisor_version"] = _vs(conn.getVersion())
        except Exception:  # facts are informative; an unreachable host fails check(), not this
            pass  # (the host's CPU, microcode, topology: lab.hostinfo reads its capabilities)
        return f

    # ---------------------------------------------------------------- disks

    def qemu_dir(self) -> str:
        if self._dir is None:
            d = self.settings.get("dir") or self.settings.get("pool_dir")
            if self.settings.get("pool"):
                d = self._pool_path(self.settings["pool"])
            self._dir = str(d or DEFAULT_QEMU_DIR).rstrip("/")
        return self._dir

    def _pool_path(self, pool_name: str) -> str:
        libvirt = _libvirt()
        try:
            pool = self.conn.storagePoolLookupByName(pool_name)
            path = ET.fromstring(pool.XMLDesc(0)).findtext("target/path")
        except libvirt.libvirtError as exc:
            raise UsageError(f"hosts.{self.host_name}.pool = {pool_name!r}: {_msg(exc)}") from None
        if not path:
            raise UsageError(f"hosts.{self.host_name}.pool = {pool_name!r} has no target path")
        return path

    def _refresh_pool(self) -> None:
        if self.settings.get("pool"):
            try:
                self.conn.storagePoolLookupByName(self.settings["pool"]).refresh(0)
            except Exception:
                pass

    def golden_source(self, image: ImageRef) -> str:
        """bhyve: the golden snapshot clones are made from; QEMU: the golden qcow2 on the host."""
        if self.driver == "bhyve":
            fmt = self.settings.get("golden", "{dataset}/{image}@gold")
            return fmt.format(dataset=self.dataset, image=image.name, digest=image.digest)
        path = Path(image.path)
        root = self.golden_root(image)
        return f"{root}/{path.name}" if root else str(path.resolve())

    # -- golden images on the host (`lab images publish`) ---------------------------------------

    def publish_dir(self) -> str:
        """QEMU: where `publish_image` puts goldens on the host: images_dir, else the clone
        directory (the pool's target path when `pool` is set)."""
        return str(self.settings.get("images_dir") or self.qemu_dir()).rstrip("/")

    def _host_read(self, path: str) -> str | None:
        """A small file on the host (None if it is not there)."""
        if not self.remote:
            try:
                return Path(path).read_text()
            except OSError:
                return None
        res = self._host(["cat", path], what="read file", check=False, timeout=30)
        return res.stdout if res.ok else None

    def golden_root(self, image: ImageRef) -> str | None:
        """QEMU: the host directory holding `image` in the images/ layout (NAME.qcow2, NAME/vmlinuz,
        NAME/initrd.img, NAME.json), or None when the host is this machine and the image is used
        where `lab images build` left it. A published copy whose manifest names another recipe
        digest is stale and refused: a run must measure the image it records."""
        if image.name in self._golden_roots:
            return self._golden_roots[image.name]
        explicit = self.settings.get("images_dir")
        root = self.publish_dir()
        text = self._host_read(f"{root}/{image.name}.json")
        found: str | None = None
        if text is not None:
            digest = _manifest_digest(text)
            if image.digest and digest != image.digest:
                raise UsageError(f"image {image.name!r} on host {self.host_name!r} ({root}) is recipe "
                                 f"{str(digest)[:12] or 'unknown'}, this lab's is {image.digest[:12]}",
                                 hint=f"lab images publish {image.name} {self.host_name}")
            found = root
        elif explicit:
            found = root  # a directory the user fills by hand: trusted as it is
        elif self.remote:
            raise UsageError(f"image {image.name!r} is not on host {self.host_name!r} (no {root}/{image.name}.json)",
                             hint=f"lab images publish {image.name} {self.host_name}")
        self._golden_roots[image.name] = found
        return found

    def _golden_snapshot_state(self, snap: str) -> str | None:
        """bhyve: the lab:digest property of the golden snapshot ("-" when unset), None if absent."""
        res = self._host(["zfs", "list", "-H", "-t", "snapshot", "-o", "name,lab:digest", snap],
                         what="zfs list", check=False, timeout=60)
        if not res.ok:
            return None
        parts = res.stdout.strip().split("\t")
        return parts[1] if len(parts) == 2 else "-"

    def check_images(self, images: Sequence[ImageRef]) -> None:
        """runner.prepare's hook: every golden image this host's cells use is there."""
        for image in images:
            self.check_image(image)

    def check_image(self, image: ImageRef) -> None:
        """Before anything is created: the golden image is on the host and is this recipe.
        UsageError (exit 2) naming what to publish otherwise."""
        if self.scheme == "test":
            return
        if self.driver == "qemu":
            self.golden_root(image)
            return
        snap = self.golden_source(image)
        state = self._golden_snapshot_state(snap)
        if state is None:
            raise UsageError(f"golden snapshot {snap} of image {image.name!r} is not on host {self.host_name!r}",
                             hint=f"lab images publish {image.name} {self.host_name}")
        if state not in ("-", "") and image.digest and state != image.digest:
            raise UsageError(f"golden snapshot {snap} on host {self.host_name!r} is recipe {state[:12]}, "
                             f"this lab's is {image.digest[:12]}",
                             hint=f"put {{digest}} in hosts.{self.host_name}.golden, then lab images publish")

    def publish_plan(self, image: ImageRef, raw: str, size: int) -> list[tuple[list[str], str | None]]:
        """bhyve: the host commands that make `image` a golden zvol and its snapshot (pure: tests
        check them). `raw` is the image as a raw file on this machine, `size` its size in bytes.
        Each step is (argv, file fed on stdin or None)."""
        snap = self.golden_source(image)
        zvol, _, snapname = snap.partition("@")
        mib = -(-size // (1 << 20))  # a whole number of MiB: any volblocksize divides it
        props = ["-o", "volmode=dev", "-o", f"lab:image={image.name}", "-o", f"lab:digest={image.digest}"]
        return [
            (self.host_argv(["zfs", "create", "-s", "-V", f"{mib}M", *props, zvol]), None),
            # conv=sparse: zero blocks are skipped, the zvol stays thin (GNU and FreeBSD dd)
            (self.host_argv(["dd", f"of=/dev/zvol/{zvol}", "bs=1048576", "conv=sparse"]), raw),
            (self.host_argv(["zfs", "snapshot", "-o", f"lab:digest={image.digest}", f"{zvol}@{snapname}"]), None),
        ]

    def publish_image(self, image: ImageRef) -> str:
        """Put `image` on the host so clones can be made of it; returns where it went
        ("zfs:POOL/DS/NAME@gold" or "file:/DIR/NAME.qcow2"). Idempotent for the same recipe."""
        if self.scheme == "test":
            raise UsageError(f"host {self.host_name!r} is a test:/// URI: nothing to publish to")
        self.require_boot(image)
        if self.driver == "bhyve":
            return self._publish_zvol(image)
        return self._publish_files(image)

    def _publish_zvol(self, image: ImageRef) -> str:
        import tempfile  # noqa: PLC0415

        snap = self.golden_source(image)
        zvol = snap.partition("@")[0]
        state = self._golden_snapshot_state(snap)
        if state is not None:
            if state in ("-", "") or not image.digest or state == image.digest:
                return f"zfs:{snap}"  # there already (or made by hand): nothing to do
            raise UsageError(f"golden snapshot {snap} on host {self.host_name!r} is recipe {state[:12]}, "
                             f"not {image.digest[:12]}; clones may still depend on it",
                             hint=f"put {{digest}} in hosts.{self.host_name}.golden (a zvol per recipe), "
                                  "or `zfs destroy -r` the old one when no clone is left")
        info = json.loads(proc.run(["qemu-img", "info", "--output=json", str(image.path)], timeout=60,
                                   what="qemu-img info").stdout)
        with tempfile.TemporaryDirectory(prefix="lab-publish-", dir="/var/tmp") as tmp:
            raw = str(image.path)
            if info.get("format") != "raw":  # bhyve reads raw only
                raw = f"{tmp}/{image.name}.raw"
                proc.run(["qemu-img", "convert", "-q", "-O", "raw", str(image.path), raw], timeout=1800,
                         what="qemu-img convert to raw")
            steps = self.publish_plan(image, raw, int(info["virtual-size"]))
            try:
                for argv, feed in steps:
                    self._run(argv, timeout=3600, what="publish to zfs", stdin=feed)
            except BaseException:
                self._run(self.host_argv(["zfs", "destroy", "-r", zvol]), timeout=600, check=False,
                          what="zfs destroy (failed publish)")
                raise
        return f"zfs:{snap}"

    def _publish_files(self, image: ImageRef) -> str:
        """QEMU: the image in the images/ layout under publish_dir(); the manifest goes last, so
        its presence means the copy is complete."""
        root = self.publish_dir()
        src = Path(image.path)
        dst = f"{root}/{src.name}"
        manifest = f"{root}/{image.name}.json"
        text = self._host_read(manifest)
        if text is not None:
            if image.digest and _manifest_digest(text) == image.digest:
                self._golden_roots.pop(image.name, None)
                return f"file:{dst}"
            # overlays name their golden by path: replacing it under a live clone corrupts it
            busy = [o.name for o in self.list_owned() if o.kind == "vm"]
            if busy:
                raise UsageError(f"{dst} on host {self.host_name!r} is another recipe and lab domains exist "
                                 f"there ({', '.join(busy[:3])}); their overlays may use it",
                                 hint="let the runs finish (or `lab gc`), then publish again")
        files = [(src, dst)]
        for rel in ("kernel", "initrd"):
            p = (image.manifest.get("paths") or {}).get(rel) if isinstance(image.manifest.get("paths"), dict) else None
            if p:
                files.append((src.parent / p, f"{root}/{p}"))
        dirs = sorted({d.rsplit("/", 1)[0] for _, d in files})
        self._host(["mkdir", "-p", *dirs], what="mkdir")
        for local, remote in files:
            tmp = f"{remote}.part"
            if self.remote:
                self._run(self.host_argv(["dd", f"of={tmp}", "bs=1048576", "conv=sparse"]), timeout=3600,
                          what=f"copy {local.name} to the host", stdin=str(local))
            else:
                proc.run(["cp", "--sparse=always", str(local), tmp], timeout=3600, what=f"copy {local.name}")
            self._host(["mv", "-f", tmp, remote], what="mv")
        body = json.dumps(image.manifest or {"name": image.name, "recipe_digest": image.digest},
                          indent=2, sort_keys=True)
        if self.remote:
            self._run(self.host_shell_argv(f"cat > {shlex.quote(manifest)}"), input=body, timeout=60,
                      what="write manifest")
        else:
            Path(manifest).write_text(body)
        self._refresh_pool()
        self._golden_roots.pop(image.name, None)
        return f"file:{dst}"


    def disk_for(self, spec: VmSpec) -> tuple[str, str]:
        """(disk reference for the lease, path the domain uses)."""
        if self.driver == "bhyve":
            ds = f"{self.dataset}/{spec.name}"
            return f"zfs:{ds}", f"/dev/zvol/{ds}"
        ext = "qcow2" if self.disk_format == "qcow2" else "raw"
        path = f"{self.qemu_dir()}/{spec.name}.{ext}"
        return f"file:{path}", path

    def console_for(self, spec: VmSpec, vm_uuid: str) -> str:
        if self.driver == "bhyve":
            return f"/dev/nmdm{vm_uuid.replace('-', '')[:8]}B"
        return f"{self.qemu_dir()}/{spec.name}.console.log"

    def clone_argv(self, image: ImageRef, spec: VmSpec) -> list[list[str]]:
        """The host commands that create the VM's disk (pure: tests check them)."""
        src = self.golden_source(image)
        ref, path = self.disk_for(spec)
        kind = CloneKind(spec.clone)
        if self.driver == "bhyve":
            ds = ref.split(":", 1)[1]
            props = ["-o", "volmode=dev", "-o", f"lab:run={spec.run_id}",
                     "-o", f"lab:expires={int(spec.expires_at)}"]
            if kind is CloneKind.LINKED:
                return [self.host_argv(["zfs", "clone", *props, src, ds])]
            pipeline = (f"zfs send {shlex.quote(src)} | zfs recv "
                        + " ".join(shlex.quote(p) for p in props) + f" {shlex.quote(ds)}")
            return [self.host_shell_argv(pipeline)]
        cmds = [self.host_argv(["mkdir", "-p", self.qemu_dir()])]
        if kind is CloneKind.LINKED:
            cmds.append(self.host_argv(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", src, path]))
        else:
            cmds.append(self.host_argv(["qemu-img", "convert", "-q", "-O", self.disk_format, src, path]))
        return cmds

    def remove_disk_argv(self, disk_ref: str) -> list[str]:
        """The host command that removes a disk clone; refuses anything that is not ours."""
        kind, _, target = disk_ref.partition(":")
        name = target.rsplit("/", 1)[-1]
        if kind == "zfs":
            if self.driver != "bhyve" or not target.startswith(f"{self.dataset}/") or "@" in target \
                    or "/" in target[len(self.dataset) + 1:] or not _NAME_RE.match(name):
                raise TeardownError(f"refusing to destroy {target!r}: not a clone under {self.dataset!r}")
            return self.host_argv(["zfs", "destroy", target])
        if kind == "file":
            if not target.startswith(f"{self.qemu_dir()}/") or "/" in target[len(self.qemu_dir()) + 1:] \
                    or ".." in name:
                raise TeardownError(f"refusing to remove {target!r}: not in {self.qemu_dir()!r}")
            return self.host_argv(["rm", "-f", "--", target])
        raise TeardownError(f"unknown disk reference {disk_ref!r}")

    def _remove_disk(self, disk_ref: str) -> None:
        if not disk_ref:
            return
        argv = self.remove_disk_argv(disk_ref)
        if disk_ref.startswith("zfs:"):
            # bhyve may hold the zvol for a moment after destroy: retry "busy", accept "does not exist"
            def attempt() -> bool:
                res = self._run(argv, timeout=120, check=False, what="zfs destroy")
                out = (res.stderr + res.stdout).lower()
                if res.ok or "does not exist" in out:
                    return True
                if "busy" in out:
                    return False
                raise CommandError(argv, res.returncode, res.stdout, res.stderr, what="zfs destroy")
            wait_until(attempt, timeout=60, what=f"zfs destroy of {disk_ref[4:]}", interval=0.5)
        else:
            self._run(argv, timeout=60, what="rm disk")
        self._refresh_pool()

    # ---------------------------------------------------------------- domain XML

    def require_boot(self, image: ImageRef) -> None:
        """Refuse an image that cannot boot the way this host boots it (before anything is made)."""
        where = f"host {self.host_name!r}"
        paths = (image.manifest or {}).get("paths")
        has_kernel = isinstance(paths, dict) and bool(paths.get("kernel"))
        if self.driver == "bhyve":
            if self.firmware == "uefi":
                images.require_boot(image, "uefi", f"{where}: bhyve with firmware = \"uefi\"")
        elif self.boot == "kernel" or (self.boot == "auto" and has_kernel):
            images.require_boot(image, "kernel", f"{where}: QEMU direct kernel boot")
        else:
            images.require_boot(image, "bios", f"{where}: QEMU booting the disk by SeaBIOS")

    def _kernel_boot(self, image: ImageRef) -> dict[str, str] | None:
        """kernel/initrd/cmdline for direct kernel boot, from the image manifest or beside the image."""
        if self.driver != "qemu" or self.boot == "disk":
            return None
        m = image.manifest or {}
        paths = m.get("paths") if isinstance(m.get("paths"), dict) else {}  # relative to images/
        path = Path(image.path)
        base = path.parent
        kernel = paths.get("kernel")
        initrd = paths.get("initrd")
        if not kernel and (base / image.name / "vmlinuz").exists():
            kernel = str(base / image.name / "vmlinuz")
        if not initrd and (base / image.name / "initrd.img").exists():
            initrd = str(base / image.name / "initrd.img")
        if not kernel:
            if self.boot == "kernel":
                raise UsageError(f"image {image.name!r} has no kernel for direct kernel boot",
                                 hint="boot = \"disk\" or rebuild the image")
            return None
        kernel_p, initrd_p = Path(kernel), Path(initrd) if initrd else None
        if not kernel_p.is_absolute():
            kernel_p = base / kernel_p
        if initrd_p is not None and not initrd_p.is_absolute():
            initrd_p = base / initrd_p
        root = self.golden_root(image)
        if root:  # a published copy on the host: the same layout under its directory
            kernel_s = f"{root}/{kernel_p.relative_to(base)}"
            initrd_s = f"{root}/{initrd_p.relative_to(base)}" if initrd_p else ""
        else:
            kernel_s, initrd_s = str(kernel_p.resolve()), str(initrd_p.resolve()) if initrd_p else ""
        cmdline = self.settings.get("cmdline") or m.get("cmdline") or DEFAULT_CMDLINE
        return {"kernel": kernel_s, "initrd": initrd_s, "cmdline": str(cmdline)}

    def _static_ip(self, spec: VmSpec) -> str:
        if not spec.ip:
            return ""
        return spec.ip.split("/")[0]

    def domain_context(self, spec: VmSpec, *, vm_uuid: str | None = None) -> dict[str, Any]:
        vm_uuid = vm_uuid or str(uuidlib.uuid4())
        disk_ref, disk_path = self.disk_for(spec)
        bus = DiskBus(spec.disk_bus)
        cores = spec.vcpus
        ctx: dict[str, Any] = {
            "name": spec.name, "uuid": vm_uuid, "lease_ns": LEASE_NS,
            "run_id": spec.run_id, "cell_id": spec.cell_id, "expires": int(spec.expires_at),
            "host": self.host_name, "disk_ref": disk_ref, "console": self.console_for(spec, vm_uuid),
            "ip": self._static_ip(spec),
            "memory_mib": spec.memory_mib, "memory_kib": spec.memory_mib * 1024, "vcpus": spec.vcpus,
            "topology": {"sockets": 1, "cores": cores, "threads": 1},
            "disk_path": disk_path, "disk_bus": bus.value, "disk_dev": _DISK_DEV[self.driver][bus],
            "disk_format": self.disk_format,
            "nic": NicModel(spec.nic).value, "mac": (spec.mac or mac_for(spec.name)).lower(),
            "bridge": self.bridge, "network": self.settings.get("network", ""),
        }
        self.require_boot(spec.image)
        if self.driver == "bhyve":
            short = vm_uuid.replace("-", "")[:8]
            ctx.update(firmware=self.firmware, loader=self.settings.get("loader", BHYVE_UEFI),
                       nmdm_master=f"/dev/nmdm{short}A", nmdm_slave=f"/dev/nmdm{short}B")
            if spec.vcpus == 1:
                ctx["topology"] = None  # plain `-c 1`, as in the driver's base test
        else:
            kb = self._kernel_boot(spec.image)
            cmdline = ""
            if kb:
                cmdline = kb["cmdline"]
                if spec.ip:
                    addr = spec.ip if "/" in spec.ip else f"{spec.ip}/{self.prefix}"
                    cmdline += f" lab.ip={addr}"
                    if self.settings.get("gateway"):
                        cmdline += f" lab.gw={self.settings['gateway']}"
            cpu_mode = self.settings.get("cpu_mode", "host-passthrough" if self.domain_type == "kvm" else "")
            ctx.update(domain_type=self.domain_type, machine=self.settings.get("machine", "pc"),
                       bios=self.settings.get("bios", ""),
                       kernel=kb["kernel"] if kb else "", initrd=kb["initrd"] if kb else "",
                       cmdline=cmdline, cpu_mode=cpu_mode,
                       guest_agent=bool(self.settings.get("guest_agent")),
                       dac_label=self.settings.get("dac_label", ""))
        return ctx

    def render(self, ctx: dict[str, Any]) -> str:
        import jinja2  # noqa: PLC0415

        env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
                                 autoescape=True, undefined=jinja2.StrictUndefined,
                                 keep_trailing_newline=True)
        return env.get_template(f"{self.driver}.xml.j2").render(**ctx)

    def domain_xml(self, spec: VmSpec, *, vm_uuid: str | None = None) -> str:
        """The domain XML clone() defines for `spec` (pure; no connection)."""
        self.validate_spec(spec)
        return self.render(self.domain_context(spec, vm_uuid=vm_uuid))

    # ---------------------------------------------------------------- lifecycle

    def _lookup(self, name: str):
        libvirt = _libvirt()
        try:
            return self.conn.lookupByName(name)
        except libvirt.libvirtError as exc:
            if _code(exc) == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise BackendError(f"libvirt lookup of {name!r} failed: {_msg(exc)}") from None

    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        libvirt = _libvirt()
        self.validate_spec(spec)
        if self._lookup(spec.name) is not None:
            raise BackendError(f"a domain named {spec.name!r} already exists on {self.host_name!r}",
                               hint="`lab gc` removes what an earlier run left behind")
        if spec.image != image:
            spec = replace(spec, image=image)
        if not spec.ip and self.subnet is not None:
            spec = replace(spec, ip=self.allocate_ip())
        ctx = self.domain_context(spec)
        xml = self.render(ctx)
        vm = Vm(spec=spec, backend=self.name,
                handle={"uuid": ctx["uuid"], "disk": ctx["disk_ref"], "disk_path": ctx["disk_path"],
                        "console": ctx["console"], "mac": ctx["mac"], "host": self.host_name,
                        "driver": self.driver},
                facts={"libvirt_driver": self.driver, "clone": CloneKind(spec.clone).value})
        if self.driver == "qemu":
            vm.facts["accel"] = "kvm" if self.domain_type == "kvm" else "tcg"
        started = time.monotonic()
        for argv in self.clone_argv(image, spec):
            self._run(argv, timeout=1800, what="disk clone")
        vm.facts["clone_seconds"] = round(time.monotonic() - started, 3)
        try:
            if self.driver == "bhyve":
                self._preflight_bhyve(xml)  # after the clone: the driver may look at the zvol
            try:
                self.conn.defineXMLFlags(xml, libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
            except libvirt.libvirtError as exc:
                if _code(exc) not in (libvirt.VIR_ERR_NO_SUPPORT, libvirt.VIR_ERR_INVALID_ARG):
                    raise
                self.conn.defineXML(xml)
        except libvirt.libvirtError as exc:
            try:
                self._remove_disk(ctx["disk_ref"])
            except LabError as rm_exc:
                raise TeardownError(f"defining {spec.name!r} failed ({_msg(exc)}) and its disk "
                                    f"{ctx['disk_ref']} could not be removed: {rm_exc}") from None
            raise BackendError(f"libvirt refused the domain {spec.name!r}: {_msg(exc)}") from None
        except BaseException:  # preflight refusal, Ctrl-C: the disk must not outlive the attempt
            self._remove_disk(ctx["disk_ref"])
            raise
        self._refresh_pool()
        return vm

    def allocate_ip(self) -> str:
        """First free address of `subnet` from .10 up (not the gateway, not in another lease)."""
        taken = {str(self.settings.get("gateway", "")), str(self.settings.get("client_address", ""))}
        libvirt = _libvirt()
        try:
            for dom in self.conn.listAllDomains(0):
                lease = self.read_lease(dom)
                if lease and lease.get("ip"):
                    taken.add(lease["ip"])
        except libvirt.libvirtError as exc:
            raise BackendError(f"listing domains on {self.host_name!r} failed: {_msg(exc)}") from None
        for i, addr in enumerate(self.subnet.hosts()):
            if i >= 9 and str(addr) not in taken:
                return str(addr)
        raise BackendError(f"no free address left in {self.subnet} on {self.host_name!r}",
                           hint="`lab gc`, or a larger subnet")

    def _preflight_bhyve(self, xml: str) -> None:
        """On a real bhyve host the driver builds the command line without starting anything;
        unsupported XML fails here instead of at start()."""
        libvirt = _libvirt()
        if self.scheme == "test":
            return
        try:
            self.conn.domainXMLToNative("bhyve-argv", xml, 0)
        except libvirt.libvirtError as exc:
            if _code(exc) == libvirt.VIR_ERR_NO_SUPPORT:
                return
            raise BackendError(f"the bhyve driver on {self.host_name!r} rejects the domain: {_msg(exc)}") from None

    def start(self, vm: Vm) -> None:
        libvirt = _libvirt()
        dom = self._lookup(vm.name)
        if dom is None:
            raise BackendError(f"domain {vm.name!r} is not defined on {self.host_name!r}")
        try:
            dom.create()
        except libvirt.libvirtError as exc:
            raise BackendError(f"starting {vm.name!r} failed: {_msg(exc)}") from None
        vm.facts["started_at"] = time.time()
        if self.scheme != "test":  # the test driver has no consoles
            try:
                vm.handle["console_tap"] = ConsoleTap(self.uri, vm.name)
            except libvirt.libvirtError as exc:  # the console is the last resort, not a must
                vm.facts["console_stream"] = f"unavailable: {_msg(exc)}"

    # -- IP discovery -----------------------------------------------------------------------

    def address(self, vm: Vm) -> str:
        """The guest's address: static IP of the spec, else libvirt leases / interfaceAddresses,
        the host's ARP table by MAC, and the serial console last. "" when nothing knows yet."""
        for source, finder in (("static", self._addr_static), ("lease", self._addr_lease),
                               ("dhcp-leases", self._addr_network_leases), ("arp", self._addr_libvirt_arp),
                               ("host-arp", self._addr_host_arp), ("console", self._addr_console)):
            try:
                ip = finder(vm)
            except LabError:
                ip = ""
            if ip:
                vm.facts["address_source"] = source
                vm.address = ip
                return ip
        return ""

    def _mac(self, vm: Vm) -> str:
        return (vm.handle.get("mac") or vm.spec.mac or mac_for(vm.name)).lower()

    def _addr_static(self, vm: Vm) -> str:
        return self._static_ip(vm.spec)

    def _iface_addresses(self, vm: Vm, source_name: str) -> str:
        libvirt = _libvirt()
        if self.driver == "bhyve" and self.lib_version is not None \
                and self.lib_version < self.caps.since["interface-addresses"]:
            return ""
        dom = self._lookup(vm.name)
        if dom is None:
            return ""
        try:
            ifaces = dom.interfaceAddresses(getattr(libvirt, source_name), 0) or {}
        except libvirt.libvirtError:
            return ""  # NO_SUPPORT / ARGUMENT_UNSUPPORTED / no leases yet: next source
        mac = self._mac(vm)
        for info in ifaces.values():
            if (info.get("hwaddr") or "").lower() != mac:
                continue
            for a in info.get("addrs") or []:
                if a.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4 and a.get("addr"):
                    return a["addr"]
        return ""

    def _addr_lease(self, vm: Vm) -> str:
        return self._iface_addresses(vm, "VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE")

    def _addr_libvirt_arp(self, vm: Vm) -> str:
        if self.driver == "bhyve":
            return ""  # libvirt's ARP reader is Linux netlink only
        return self._iface_addresses(vm, "VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_ARP")

    def _addr_network_leases(self, vm: Vm) -> str:
        net = self.settings.get("network")
        if not net:
            return ""
        libvirt = _libvirt()
        try:
            leases = self.conn.networkLookupByName(net).DHCPLeases(self._mac(vm), 0) or []
        except libvirt.libvirtError:
            return ""
        for lease in leases:
            if lease.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4 and lease.get("ipaddr"):
                return lease["ipaddr"]
        return ""

    def arp_argv(self) -> list[str]:
        if self.driver == "bhyve":
            return self.host_argv(["arp", "-an"])
        return self.host_argv(["ip", "-4", "neigh", "show"])

    def _addr_host_arp(self, vm: Vm) -> str:
        res = self._run(self.arp_argv(), timeout=30, check=False, what="arp table")
        return parse_arp(res.stdout, self._mac(vm)) if res.ok else ""

    def console_text(self, vm: Vm) -> str:
        """What the guest wrote on its serial console so far ("" if unreadable from here): QEMU's
        console log (virtlogd writes it from the first byte), else the console stream."""
        path = vm.handle.get("console", "")
        if self.driver == "qemu" and path:
            if not self.remote:
                try:
                    return Path(path).read_text(errors="replace")
                except OSError:
                    pass
            else:
                res = self._run(self.host_argv(["cat", path]), timeout=30, check=False, what="console log")
                if res.ok:
                    return res.stdout
        tap = vm.handle.get("console_tap")
        return tap.text() if tap is not None else ""  # bhyve: nmdm keeps no log

    def _addr_console(self, vm: Vm) -> str:
        return parse_console_address(self.console_text(vm))

    # -- readiness ----------------------------------------------------------------------------

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        libvirt = _libvirt()
        if timeout is None:
            timeout = float(self.settings.get("boot_timeout", 300))
        port = int(self.settings.get("ssh_port", 22))
        # the image's own readiness line (manifest `ready_marker`); without one, probe SSH directly
        marker = str((vm.spec.image.manifest or {}).get("ready_marker") or "")
        state = {"last": "nothing yet"}

        def check() -> str | None:
            dom = self._lookup(vm.name)
            try:
                active = dom is not None and dom.isActive()
            except libvirt.libvirtError:
                active = False
            if not active:
                raise BackendError(f"{vm.name} is not running any more (while waiting for SSH)",
                                   hint=_tail(self.console_text(vm)))
            text = self.console_text(vm)
            if FAILED_MARK in text:
                raise BackendError(f"{vm.name} reported {FAILED_MARK} on its console", hint=_tail(text))
            # only a log read from the first byte proves the marker has not been printed yet
            if marker and marker not in text and self._console_readable(vm):
                state["last"] = f"no {marker} on the serial console yet"
                return None
            addr = self.address(vm)
            if not addr:
                state["last"] = "no address found (static, leases, ARP, console)"
                return None
            if ssh_banner(addr, port):
                return addr
            state["last"] = f"{addr}:{port} does not answer SSH yet"
            return None

        started = time.monotonic()
        addr = wait_until(check, timeout=timeout, what=f"{vm.name} to answer SSH", interval=0.2,
                          detail=lambda: state["last"])
        vm.facts["ready_seconds"] = round(time.monotonic() - started, 3)
        vm.address = addr
        return addr

    def _console_readable(self, vm: Vm) -> bool:
        path = vm.handle.get("console", "")
        return self.driver == "qemu" and bool(path) and not self.remote and Path(path).exists()

    # -- teardown -----------------------------------------------------------------------------

    def _undefine(self, dom) -> str:
        """Undefine with NVRAM removal where the driver knows the flag; fall back to a plain
        undefine on drivers that refuse any flag (older bhyve, the test driver)."""
        libvirt = _libvirt()
        flags = libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
        if self.driver == "qemu":
            flags |= libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
        try:
            dom.undefineFlags(flags)
            return "nvram"
        except libvirt.libvirtError as exc:
            if _code(exc) == libvirt.VIR_ERR_NO_DOMAIN:
                return "gone"
            if _code(exc) not in (libvirt.VIR_ERR_INVALID_ARG, libvirt.VIR_ERR_NO_SUPPORT,
                                  libvirt.VIR_ERR_ARGUMENT_UNSUPPORTED):
                raise
        dom.undefine()
        return "plain"

    def _remove_domain(self, name: str) -> str | None:
        """Power off and undefine; returns how it was undefined (None if there was no domain)."""
        libvirt = _libvirt()
        dom = self._lookup(name)
        if dom is None:
            return None
        try:
            if dom.isActive():
                dom.destroy()
        except libvirt.libvirtError as exc:
            if _code(exc) not in (libvirt.VIR_ERR_OPERATION_INVALID, libvirt.VIR_ERR_NO_DOMAIN):
                raise
        try:
            mode = self._undefine(dom)
        except libvirt.libvirtError as exc:
            if _code(exc) == libvirt.VIR_ERR_NO_DOMAIN:
                return "gone"
            raise
        return mode

    def destroy(self, vm: Vm) -> None:
        libvirt = _libvirt()
        problems: list[str] = []
        try:
            mode = self._remove_domain(vm.name)
            if mode:
                vm.facts["undefine"] = mode
        except (libvirt.libvirtError, LabError) as exc:
            problems.append(f"domain: {_msg(exc)}")
        if not problems and self._lookup(vm.name) is not None:
            problems.append("domain still defined after undefine")
        tap = vm.handle.pop("console_tap", None)
        if tap is not None:  # the domain is gone: its console stream has ended
            tap.close()
        if not problems:  # never pull a disk from under a domain that is still there
            try:
                self._remove_disk(vm.handle.get("disk", ""))
            except LabError as exc:
                problems.append(f"disk {vm.handle.get('disk')}: {exc}")
        self._remove_console_log(vm.handle.get("console", ""), problems)
        if problems:
            raise TeardownError(f"teardown of {vm.name} on {self.host_name!r} failed: " + "; ".join(problems),
                                hint="`lab gc` retries; see `virsh -c URI list --all`")

    def _remove_console_log(self, path: str, problems: list[str]) -> None:
        if self.driver != "qemu" or not path:
            return
        try:
            argv = self.remove_disk_argv(f"file:{path}")
            self._run(argv, timeout=60, what="rm console log")
        except LabError as exc:
            problems.append(f"console log {path}: {exc}")

    # -- gc -----------------------------------------------------------------------------------

    def read_lease(self, dom) -> dict[str, str] | None:
        libvirt = _libvirt()
        try:
            text = dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, LEASE_NS, 0)
        except libvirt.libvirtError:
            return None
        try:
            el = ET.fromstring(text)
        except ET.ParseError:
            return None
        if not el.get("run"):
            return None
        return dict(el.attrib)

    def list_owned(self) -> list[Owned]:
        libvirt = _libvirt()
        out: list[Owned] = []
        referenced: set[str] = set()
        try:
            doms = self.conn.listAllDomains(0)
        except libvirt.libvirtError as exc:
            raise BackendError(f"listing domains on {self.host_name!r} failed: {_msg(exc)}") from None
        for dom in doms:
            lease = self.read_lease(dom)
            if lease is None:
                continue
            referenced.add(lease.get("disk", ""))
            out.append(Owned(backend=self.name, kind="vm", name=dom.name(), run_id=lease["run"],
                             expires_at=float(lease.get("expires") or 0),
                             detail=json.dumps({k: lease.get(k, "") for k in ("disk", "console", "host", "cell")},
                                               sort_keys=True)))
        out += [o for o in self._orphan_disks() if o.detail not in referenced]
        return out + self._run_locks.owned(self.name)

    def _orphan_disks(self, min_age: float = 600.0) -> list[Owned]:
        """Disk clones whose domain is gone (a crash between clone and define)."""
        if self.scheme == "test":
            return []
        found: list[Owned] = []
        if self.driver == "bhyve":
            res = self._host(["zfs", "list", "-H", "-p", "-t", "volume", "-o", "name,lab:run,lab:expires",
                              "-r", self.dataset], what="zfs list", check=False, timeout=60)
            for line in res.stdout.splitlines() if res.ok else []:
                parts = line.split("\t")
                if len(parts) != 3 or parts[1] in ("-", ""):
                    continue
                exp = float(parts[2]) if parts[2].isdigit() else 0.0
                found.append(Owned(backend=self.name, kind="disk", name=parts[0].rsplit("/", 1)[-1],
                                   run_id=parts[1], expires_at=exp, detail=f"zfs:{parts[0]}"))
            return found
        if self.remote:
            return found
        d = Path(self.qemu_dir())
        now = time.time()
        for p in sorted(d.glob("lab-*.qcow2")) + sorted(d.glob("lab-*.raw")) if d.is_dir() else []:
            try:
                if now - p.stat().st_mtime < min_age:
                    continue
            except OSError:
                continue
            found.append(Owned(backend=self.name, kind="disk", name=p.stem, run_id="",
                               detail=f"file:{p}"))
        return found

    def remove_owned(self, item: Owned) -> None:
        libvirt = _libvirt()
        if item.kind == "disk":
            self._remove_disk(item.detail)
            return
        if item.kind == "lock":
            runlock.remove_if_dead(Path(item.detail))  # never the lock of a live run
            return
        if item.kind != "vm":
            raise UsageError(f"libvirt backend does not own {item.kind!r} items")
        dom = self._lookup(item.name)
        lease = self.read_lease(dom) if dom is not None else None
        if lease is None:
            try:
                lease = json.loads(item.detail or "{}")
            except ValueError:
                lease = {}
        problems: list[str] = []
        try:
            self._remove_domain(item.name)
        except (libvirt.libvirtError, LabError) as exc:
            problems.append(f"domain: {_msg(exc)}")
        if not problems:
            try:
                self._remove_disk(lease.get("disk", ""))
            except LabError as exc:
                problems.append(f"disk: {exc}")
        self._remove_console_log(lease.get("console", ""), problems)
        if problems:
            raise TeardownError(f"gc of {item.name} on {self.host_name!r} failed: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------
# pure helpers

def _tail(text: str, lines: int = 5) -> str | None:
    tail = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return ("console: " + " | ".join(tail)) if tail else None


def _manifest_digest(text: str) -> str:
    """The recipe digest an image manifest (images/NAME.json) records."""
    try:
        m = json.loads(text)
    except ValueError:
        return ""
    return str(m.get("recipe_digest") or m.get("digest") or "") if isinstance(m, dict) else ""


# FreeBSD arp(8), usr.sbin/arp/arp.c print_entry():
#   "? (IP) at MAC on IFACE [permanent | expires in N seconds | expired] [published] [TYPE]"
#   with "(incomplete)" in place of MAC while resolution is pending
_BSD_ARP = re.compile(r"^\S+ \((?P<ip>\d+\.\d+\.\d+\.\d+)\) at (?P<mac>[0-9A-Fa-f:]+|\(incomplete\))"
                      r" on (?P<dev>\S+)(?P<rest>.*)$")
# Linux `ip -4 neigh show`: "IP dev IFACE lladdr MAC [router] STATE" ("IP dev IFACE FAILED" without one)
_LINUX_NEIGH = re.compile(r"^(?P<ip>\d+\.\d+\.\d+\.\d+) dev (?P<dev>\S+)(?: lladdr (?P<mac>[0-9A-Fa-f:]+))?"
                          r"(?P<rest>.*)$")


def _norm_mac(mac: str) -> str:
    """aa:b:c.. -> 0a:0b:0c..: some BSDs print octets without their leading zero."""
    parts = mac.lower().split(":")
    return ":".join(p.zfill(2) for p in parts) if len(parts) == 6 else mac.lower()


def arp_entries(text: str) -> list[tuple[str, str, str]]:
    """(ip, mac, interface) of every resolved IPv4 entry in `arp -an` (FreeBSD) or
    `ip -4 neigh show` (Linux) output; incomplete, failed and expired entries are left out."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        m = _BSD_ARP.match(line)
        if m:
            if m["mac"] == "(incomplete)" or " expired" in m["rest"]:
                continue
            out.append((m["ip"], _norm_mac(m["mac"]), m["dev"]))
            continue
        m = _LINUX_NEIGH.match(line)
        if m and m["mac"] and not re.search(r"\b(FAILED|INCOMPLETE)\b", m["rest"]):
            out.append((m["ip"], _norm_mac(m["mac"]), m["dev"]))
    return out


def parse_arp(text: str, mac: str) -> str:
    """IPv4 address the host's neighbour table holds for `mac` ("" if none)."""
    want = _norm_mac(mac)
    hits = [ip for ip, m, _ in arp_entries(text) if m == want]
    return hits[-1] if hits else ""


def parse_console_address(text: str) -> str:
    """The guest's own report of its address on the serial console (lab-net, FreeBSD dhclient)."""
    for pattern in (r"lab-net: \S+ (\d+\.\d+\.\d+\.\d+)", r"LAB-READY[ \t]+(?:ip=)?(\d+\.\d+\.\d+\.\d+)",
                    r"bound to (\d+\.\d+\.\d+\.\d+)"):
        hits = re.findall(pattern, text)
        if hits:
            return hits[-1]
    return ""


def ssh_banner(address: str, port: int = 22, timeout: float = 2.0) -> bool:
    """True when something at address:port speaks SSH (reads the server's identification line)."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False
