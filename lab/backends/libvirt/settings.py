"""`[hosts.NAME] backend = "libvirt"`: FreeBSD bhyve (bhyve+ssh://) or QEMU/KVM (qemu:///system,
qemu+ssh://) through libvirt.

`Settings` is the one place the keys and their defaults live. A key whose default depends on the
driver (bhyve or qemu: disk_format, bridge, prefix, cpu_mode, client_address, ...) is None here;
`resolve` fills it in, once, into a `Host`: the record the rest of the package reads. A setting
the host's driver cannot use (no dataset on bhyve, a guest agent on bhyve, a disk format the
driver cannot read) is a SettingError from `resolve`, naming `hosts.NAME.key` and the value;
`lab plan` meets it through the backend's plan_check, before anything exists.

Keys (the user's documentation; `lab.toml` examples in the README):

``uri``            libvirt URI (required): ``bhyve+ssh://root@bsd1/system`` (add ``?keyfile=K&no_tty=1``
                   for non-interactive SSH), ``bhyve:///system`` when lab runs on the bhyve host,
                   ``qemu:///system``, ``qemu+ssh://root@kvm1/system``, or ``test:///default`` (contract
                   tests; see ``flavour``). No ``ext`` transport, no parameter that names a program or
                   turns a check off (lab.programs: the one rule of what a lab.toml may run).
``ssh``            how to reach the host for shell commands (zfs, qemu-img, rm, arp): ssh arguments,
                   e.g. ``"root@bsd1"`` or ``"-p 2222 -i ~/.ssh/lab root@bsd1"``. Default: derived
                   from a ``+ssh`` (or ``+libssh``, ``+libssh2``) URI (user, host, port, keyfile);
                   local URIs run commands here. Required with a remote URI over another transport
                   (``qemu+tcp://``, ``qemu+tls://``, ``qemu://HOST/``, ``bhyve+tcp://``): without it
                   the host's commands would run on this machine.
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
                   as ``lab.ip=``).
``prefix``         prefix length of the static guest address (default: the subnet's, else 24).
``gateway``        default gateway given to guests (``lab.gw=``); default none (isolated).
``client_address`` address of the load-generator side as the guests see it (default: ``gateway``).
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
``flavour``        test:/// URIs only: which template and capabilities to use, ``qemu`` (default)
                   or ``bhyve``.
``ssh_port``       guest SSH port probed by ``wait_ready`` (default 22).
``boot_timeout``   seconds ``wait_ready`` waits when the caller gives no timeout (default 300).
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from typing import Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import AliasChoices, Field, field_validator

from lab import programs
from lab.backends import fields
from lab.backends.base import Capabilities, HostSettings
from lab.backends.libvirt.drivers import (
    DRIVERS,
    SSH_TRANSPORTS,
    Driver,
    DriverCaps,
    driver_of,
    remote_without_ssh,
    uri_scheme,
    uri_transport,
)
from lab.errors import SettingError
from lab.model import CloneKind

BHYVE_UEFI = "/usr/local/share/uefi-firmware/BHYVE_UEFI.fd"
# Keys only one driver uses: given on a host of the other driver they would be ignored
DRIVER_KEYS = {
    "bhyve": frozenset({"dataset", "golden", "firmware", "loader"}),
    "qemu": frozenset(
        {"dir", "pool", "images_dir", "domain_type", "machine", "bios", "cpu_mode", "boot", "cmdline", "dac_label"}
    ),
}
DEFAULT_QEMU_DIR = "/var/lib/libvirt/images/lab"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Settings(HostSettings):
    backend: Literal["libvirt"]
    uri: str = Field(
        description="the libvirt URI: bhyve+ssh://root@bsd1/system, qemu:///system, qemu+ssh://...; it picks the driver"
    )
    ssh: str | None = Field(
        default=None,
        description=(
            'where the host\'s own commands (zfs, qemu-img, arp) run, e.g. "-p 2222 root@bsd1" (default: from a +ssh '
            "URI; a local URI runs them here)"
        ),
    )
    dataset: str | None = Field(
        default=None, description="bhyve hosts: the ZFS dataset golden zvols and their clones live in (required there)"
    )
    golden: str = Field(
        default="{dataset}/{image}@gold",
        description=(
            'bhyve hosts: the golden snapshot clones are made from, e.g. "{dataset}/{image}-{digest}@gold" for a zvol '
            "per recipe"
        ),
    )
    firmware: Literal["uefi", "bhyveload"] = Field(
        default="uefi", description="bhyve hosts: uefi (BHYVE_UEFI.fd, read-only) or bhyveload (FreeBSD guests)"
    )
    loader: str = Field(default=BHYVE_UEFI, description="bhyve hosts: the UEFI firmware file on the host (absolute)")
    dir: str = Field(
        default=DEFAULT_QEMU_DIR,
        validation_alias=AliasChoices("dir", "pool_dir"),
        description="QEMU hosts: clones and console logs (absolute; `pool_dir` is the same key)",
    )
    pool: str = Field(default="", description="QEMU hosts: a storage pool whose target path replaces dir")
    images_dir: str = Field(
        default="",
        description=(
            'QEMU hosts: where `lab images publish` puts the image, its kernel, initrd and manifest ("": dir, or the '
            "pool's path)"
        ),
    )
    disk_format: Literal["qcow2", "raw"] | None = Field(
        default=None, description="the clones' disk format (default per driver: bhyve raw, QEMU qcow2)"
    )
    bridge: str | None = Field(
        default=None,
        description="the bridge the guest's NIC joins (default per driver: bhyve bridge0, QEMU none: user networking)",
    )
    network: str = Field(default="", description="a libvirt network the NIC joins instead of a bridge")
    subnet: str | None = Field(
        default=None,
        description="static guest addresses from this subnet (QEMU direct kernel boot: lab.ip=); unset: DHCP",
    )
    prefix: int | None = Field(
        default=None, ge=8, le=32, description="prefix length of the static addresses (default: the subnet's, else 24)"
    )
    gateway: str = Field(default="", description='the static addresses\' gateway ("": none)')
    client_address: str | None = Field(
        default=None, description="where iperf3/wrk listen, as the guests see this machine (default: gateway)"
    )
    domain_type: Literal["qemu", "kvm"] = Field(default="qemu", description="QEMU hosts: qemu (TCG) or kvm")
    machine: str = Field(default="pc", description="QEMU hosts: the QEMU machine type")
    bios: str = Field(
        default="",
        description=(
            "QEMU hosts: a firmware ROM instead of SeaBIOS, e.g. /usr/share/qemu/qboot.rom (absolute; cannot boot from "
            "disk)"
        ),
    )
    cpu_mode: str | None = Field(
        default=None,
        description=(
            "QEMU hosts: the domain's CPU mode (default per domain_type: host-passthrough with kvm, none with qemu)"
        ),
    )
    boot: Literal["auto", "kernel", "disk"] = Field(
        default="auto",
        description=(
            "QEMU hosts: kernel: direct kernel boot; disk: the disk's bootloader; auto: kernel where the image has one"
        ),
    )
    cmdline: str = Field(
        default="",
        description='QEMU hosts: the kernel command line of a direct kernel boot ("": the image manifest\'s)',
    )
    dac_label: str = Field(
        default="", description='QEMU hosts: the domain\'s DAC security label, e.g. "+0:+0" ("": libvirt\'s default)'
    )
    guest_agent: bool = Field(default=False, description="QEMU hosts: add the qemu-guest-agent channel (bhyve: never)")
    flavour: Literal["qemu", "bhyve"] | None = Field(
        default=None, description="test:/// URIs only (contract tests): which driver the test driver stands for"
    )
    ssh_port: int = Field(default=22, ge=1, le=65535, description="the guests' SSH port")
    boot_timeout: float = Field(default=300.0, gt=0, le=3600, description="seconds a VM may take to boot and answer")

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if "://" not in v:
            raise ValueError("must be a libvirt URI such as bhyve+ssh://root@bsd1/system or qemu:///system")
        driver_of(v)  # ValueError naming the driver lab does not drive
        why = programs.libvirt_uri_problem(v)  # what a lab.toml may make the lab run (lab.programs)
        if why:
            raise ValueError(why)
        return v

    def problems(self) -> list[tuple[str, object, str]]:
        together = self.together()
        if together:
            return together[:1]
        if remote_without_ssh(self.uri) and not self.ssh:
            return [
                (
                    "uri",
                    self.uri,
                    f"a remote host over {uri_transport(self.uri)}, not SSH: the host's commands "
                    f'(zfs, qemu-img, rm, arp) would run on this machine; set ssh = "user@host" '
                    "too, or use a +ssh URI",
                )
            ]
        return []

    def together(self) -> list[tuple[str, object, str]]:
        """Keys each valid alone that this host cannot use together, or at all on its driver: said,
        never silently ignored."""
        out: list[tuple[str, object, str]] = []
        given = self.model_fields_set
        if self.bridge and self.network:
            out.append(
                ("network", self.network, f"and bridge ({self.bridge!r}) both name the NIC's network: one or the other")
            )
        if self.pool and "dir" in given:
            out.append(("pool", self.pool, f"and dir ({self.dir!r}) both name where clones go: one or the other"))
        if self.flavour is not None and uri_scheme(self.uri) != "test":
            out.append(("flavour", self.flavour, "is used only with test:/// URIs (the URI's driver decides)"))
        driver = driver_of(self.uri, self.flavour)
        other = {"bhyve": "qemu", "qemu": "bhyve"}[driver]
        for key in sorted(given & DRIVER_KEYS[other]):
            out.append((key, getattr(self, key), f"is a setting of {other} hosts; this URI's driver is {driver}"))
        return out

    @field_validator("uri")
    @classmethod
    def _uri_destination(cls, v: str) -> str:
        # the user and host of a +ssh URI become ssh's destination (the host's commands, libvirt's own
        # ssh): one that starts with "-" would be read as an option
        parts = urlsplit(v)
        for what, word in (("user", parts.username), ("host", parts.hostname)):
            if word and (word.startswith("-") or not fields.SSH_DESTINATION.fullmatch(word)):
                raise ValueError(f"its {what} {word!r} is not a {what} name ssh can be given (not first a -)")
        return v

    @field_validator("ssh")
    @classmethod
    def _ssh(cls, v: str | None) -> str | None:
        # ssh's own arguments (options are the point: -p, -i, -J), ending with the destination
        if v is None:
            return v
        try:
            words = shlex.split(v)
        except ValueError as exc:
            raise ValueError(f"cannot be split into ssh arguments: {exc}") from None
        if not words or not fields.SSH_DESTINATION.fullmatch(words[-1]):
            raise ValueError('must end with the destination, e.g. "-p 2222 root@bsd1"')
        return v

    @field_validator("dir", "images_dir", "loader", "bios")
    @classmethod
    def _host_path(cls, v: str) -> str:
        # a path on the host, taken as it is: relative, it would be relative to whatever directory
        # the host's shell starts in
        if v and not v.startswith("/"):
            raise ValueError("must be an absolute path on the host (it is the host's, not this machine's)")
        if re.search(r"[\x00-\x1f\x7f]", v):
            raise ValueError("holds a control character")
        return v

    @field_validator("dataset", "golden")
    @classmethod
    def _dataset(cls, v: str | None) -> str | None:
        # a ZFS name on the host's command lines (zfs clone, zfs send): never an option, one word
        if v and (v.startswith("-") or re.search(r"[\s\x00-\x1f\x7f,]", v)):
            raise ValueError("must be a ZFS dataset name (no spaces or commas, not first a -)")
        return v

    @field_validator("subnet")
    @classmethod
    def _subnet(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                ipaddress.ip_network(v, strict=False)
            except ValueError:
                raise ValueError("not a network like 10.78.5.0/24") from None
        return v


class Host(Settings):
    """A libvirt host's settings with every per-driver default filled in (`resolve`)."""

    name: str  # the host's name in lab.toml
    driver: Driver  # the template and the capability table
    test_uri: bool  # test:/// (contract tests): no host commands, no consoles, no preflight
    ssh_args: tuple[str, ...] | None  # ssh arguments that reach the host; None: commands run here
    dataset: str  # "" on QEMU
    disk_format: Literal["qcow2", "raw"]
    bridge: str  # "" = user networking (QEMU)
    subnet: Network | None  # type: ignore[assignment]  # resolved: the parsed network, where Settings has the text
    prefix: int
    client_address: str
    cpu_mode: str

    @property
    def where(self) -> str:
        """How SettingErrors name this host's keys: "hosts.NAME."."""
        return f"hosts.{self.name}."

    @property
    def caps(self) -> DriverCaps:
        return DRIVERS[self.driver]


def resolve(host_name: str, settings: Settings) -> Host:
    """The per-driver defaults, once; SettingError for a setting the driver cannot use."""
    driver = driver_of(settings.uri, settings.flavour)
    where = f"hosts.{host_name}."
    for key, value, problem in settings.problems():
        raise SettingError(key, value, problem, where=where)
    if driver == "bhyve":
        if not (settings.dataset or "").strip("/"):
            raise SettingError(
                "dataset",
                settings.dataset,
                "a bhyve host needs the ZFS dataset that holds the golden zvols and the clones",
                hint='e.g. dataset = "zroot/lab"',
                where=where,
            )
        if settings.guest_agent:
            raise SettingError(
                "guest_agent",
                True,
                "bhyve has no qemu-guest-agent support lab can rely on (libvirt >= 12.4 only, never for IP discovery)",
                where=where,
            )
    disk_format = settings.disk_format or ("raw" if driver == "bhyve" else "qcow2")
    formats = DRIVERS[driver].disk_formats
    if disk_format not in formats:
        raise SettingError(
            "disk_format",
            disk_format,
            f"the {driver} driver reads only {', '.join(sorted(formats))} disks",
            where=where,
        )
    subnet = ipaddress.ip_network(settings.subnet, strict=False) if settings.subnet else None
    fields = settings.model_dump(
        exclude={"dataset", "disk_format", "bridge", "subnet", "prefix", "client_address", "cpu_mode"}
    )
    return Host(
        **fields,
        name=host_name,
        driver=driver,
        test_uri=uri_scheme(settings.uri) == "test",
        ssh_args=_ssh_args(settings),
        dataset=(settings.dataset or "").strip("/") if driver == "bhyve" else "",
        disk_format=disk_format,
        bridge=settings.bridge if settings.bridge is not None else ("bridge0" if driver == "bhyve" else ""),
        subnet=subnet,
        prefix=settings.prefix or (subnet.prefixlen if subnet else 24),
        client_address=settings.client_address if settings.client_address is not None else settings.gateway,
        cpu_mode=settings.cpu_mode
        if settings.cpu_mode is not None
        else ("host-passthrough" if settings.domain_type == "kvm" else ""),
    )


def _ssh_args(settings: Settings) -> tuple[str, ...] | None:
    """ssh arguments that reach the host: the `ssh` key, else a +ssh URI's user, host, port and
    keyfile; None for a local URI (host commands run on this machine)."""
    if settings.ssh:
        return tuple(shlex.split(settings.ssh))
    parts = urlsplit(settings.uri)
    if uri_transport(settings.uri) not in SSH_TRANSPORTS or not parts.hostname:
        return None
    args: list[str] = []
    if parts.port:
        args += ["-p", str(parts.port)]
    keyfile = parse_qs(parts.query).get("keyfile")
    if keyfile:
        args += ["-i", keyfile[0]]
    args.append(f"{parts.username}@{parts.hostname}" if parts.username else parts.hostname)
    return tuple(args)


def capabilities(settings: Settings) -> Capabilities:
    """What the host's driver (from its URI alone) can make."""
    caps = DRIVERS[driver_of(settings.uri, settings.flavour)]
    snapshots = "save-restore" in caps.features
    return Capabilities(
        description=f"libvirt/{caps.driver}",
        nic_models=frozenset(caps.nics),
        disk_buses=caps.disk_buses,
        clone_kinds=frozenset(CloneKind),
        boot_modes=caps.boot_modes,
        max_vcpus=caps.max_vcpus,
        snapshots=snapshots,
        host_load=True,  # /proc/stat or kern.cp_time over the backend's link (hostload.LoadMeter)
        missing={}
        if snapshots
        else {
            "snapshots": "libvirt's bhyve driver has no save/restore (bhyve's own snapshots need a kernel built "
            "with BHYVE_SNAPSHOT, which libvirt does not drive): cold boots only"
        },
    )
