"""lab.toml -> typed, frozen records. All defaults and all validation live here.

Every error names the file, the key and the value, on one line (ConfigError, exit status 2).
Secrets stay references ("env:NAME", "file:/path") in the records; resolve_secret() reads them
only when a backend is built, and never puts the value in an error.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lab.errors import ConfigError
from lab.images import RECIPES
from lab.model import CloneKind, DiskBus, NicModel

# Known golden images and the OS each one is: lab.images' recipes are the one list.
KNOWN_IMAGES: dict[str, str] = {name: r.os for name, r in RECIPES.items()}

SECRET_KEYS = ("token", "password")
MAX_VCPUS = 128
MIN_MEMORY_MIB, MAX_MEMORY_MIB = 256, 1024 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class LabSection(_Strict):
    name: str = "lab"
    results: str = "results"  # directory holding lab.db and raw artefacts, relative to lab.toml
    lease_minutes: int = Field(default=120, ge=1, le=7 * 24 * 60)


class LocalHost(_Strict):
    backend: Literal["local"]
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    workdir: str = "/var/tmp/lab"  # clones, pidfiles, consoles; shared by runs so `lab gc` finds them
    subnet: str = "10.77.0"  # /24 inside the run's own network namespace
    boot_timeout: float = Field(default=240.0, gt=0, le=3600)


PVE_NODE = r"^[a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?$"  # PVE's pve-node format


class ProxmoxHost(_Strict):
    backend: Literal["proxmox"]
    url: str
    node: str  # holds the template; publish puts it there
    nodes: list[str] | None = None  # where clones may run (default: [node])
    placement: Literal["pack", "spread"] = "pack"
    storage: str = "local-lvm"
    import_storage: str = "local"
    bridge: str = "vmbr0"
    template: str | int = "lab-{image}"
    token: str | None = None  # "env:NAME" or "file:/path", never the secret itself
    user: str | None = None
    password: str | None = None  # "env:NAME" or "file:/path"
    verify_tls: bool = True
    ca_file: str | None = None
    concurrency: int = Field(default=2, ge=1, le=32)
    cpu_type: str = "host"
    ci_user: str = "lab"
    ssh_keys: str | list[str] | None = None  # default: the lab key of images/
    client_address: str = ""
    client_netns: str = ""  # load generators and SSH run in this network namespace of this machine
    addresses: str = ""  # static guest addresses (cloud-init): "FIRST-LAST" or a CIDR; "" = DHCP
    gateway: str = ""
    prefix_len: int = Field(default=24, ge=8, le=30)
    guest_agent: bool = True
    node_ssh: str = ""  # ssh destination of the node for the ARP fallback, e.g. "root@pve1"
    timeouts: dict[Literal["http", "clone", "config", "start", "stop", "destroy", "ready", "agent", "publish"],
                   Annotated[float, Field(gt=0, le=86400)]] = {}
    lock_retries: int = Field(default=6, ge=0, le=100)
    retry_backoff: float = Field(default=2.0, gt=0, le=300)

    @field_validator("node")
    @classmethod
    def _node(cls, v: str) -> str:
        if not re.fullmatch(PVE_NODE, v):
            raise ValueError("is not a PVE node name (letters, digits and inner dashes)")
        return v

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v: list[str] | None) -> list[str] | None:
        for n in v or []:
            if not re.fullmatch(PVE_NODE, n):
                raise ValueError(f"{n!r} is not a PVE node name (letters, digits and inner dashes)")
        if v is not None and not v:
            raise ValueError("must list at least one node (or leave it out: the `node` alone)")
        if v is not None and len(set(v)) != len(v):
            raise ValueError("lists a node twice")
        return v

    @field_validator("addresses")
    @classmethod
    def _addresses(cls, v: str) -> str:
        if v:
            from lab.backends.proxmox import _address_pool
            from lab.errors import UsageError

            try:
                if not _address_pool(v, "addresses"):
                    raise ValueError("holds no address")
            except UsageError:
                raise ValueError('must be a range "10.0.0.100-10.0.0.150" or a CIDR "10.0.0.96/27"') from None
        return v

    @field_validator("url")
    @classmethod
    def _https(cls, v: str) -> str:
        if not v.startswith(("https://", "http://")):
            raise ValueError("must be an https:// URL such as https://pve1.example:8006")
        return v

    @field_validator("token", "password")
    @classmethod
    def _secret_ref(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("env:", "file:")):
            raise ValueError('must be a reference "env:NAME" or "file:/path", never the secret itself')
        return v


class LibvirtHost(_Strict):
    """A libvirt host: FreeBSD bhyve (bhyve+ssh://) or QEMU/KVM (qemu:///system, qemu+ssh://).
    Keys left unset (None) take the backend's per-driver default; lab.backends.libvirt documents
    each. What the driver cannot do (a NIC model, disk bus, disk format, feature) is refused at
    plan time by the backend's plan_check, with the key and value named."""

    backend: Literal["libvirt"]
    uri: str
    ssh: str | None = None  # how to reach the host for zfs/qemu-img/arp (default: from a +ssh URI)
    dataset: str | None = None  # bhyve: ZFS dataset holding golden zvols and clones (required)
    golden: str | None = None  # bhyve: golden snapshot, default "{dataset}/{image}@gold"
    firmware: Literal["uefi", "bhyveload"] | None = None  # bhyve (default uefi)
    loader: str | None = None  # bhyve UEFI firmware path
    dir: str | None = None  # QEMU: clones and console logs on the host
    pool_dir: str | None = None  # alias of dir
    pool: str | None = None  # QEMU: a libvirt storage pool whose target path holds clones and goldens
    images_dir: str | None = None  # QEMU: golden images on the host (what `lab images publish` fills)
    disk_format: Literal["qcow2", "raw"] | None = None
    bridge: str | None = None  # bhyve default bridge0; QEMU default: none (user networking)
    network: str | None = None  # a libvirt network instead of a bridge (DHCP lease lookup)
    subnet: str | None = None  # static guest addresses from this subnet, e.g. "10.78.5.0/24"
    prefix: int | None = Field(default=None, ge=8, le=32)
    gateway: str | None = None
    client_address: str = ""  # the load generator's address as guests see it
    domain_type: Literal["qemu", "kvm"] | None = None  # QEMU: qemu = TCG (default) or kvm
    machine: str | None = None
    bios: str | None = None
    cpu_mode: str | None = None
    boot: Literal["auto", "kernel", "disk"] | None = None
    cmdline: str | None = None
    dac_label: str | None = None
    guest_agent: bool | None = None
    flavour: Literal["qemu", "bhyve"] | None = None  # test:/// URIs only
    ssh_port: int | None = Field(default=None, ge=1, le=65535)
    boot_timeout: float | None = Field(default=None, gt=0, le=3600)

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if "://" not in v:
            raise ValueError("must be a libvirt URI such as bhyve+ssh://root@bsd1/system or qemu:///system")
        return v


HostConfig = Annotated[Union[LocalHost, ProxmoxHost, LibvirtHost], Field(discriminator="backend")]


class MatrixSection(_Strict):
    host: list[str] = ["local"]
    image: list[str] = ["debian12"]
    nic: list[NicModel] = [NicModel.VIRTIO]
    vcpus: list[Annotated[int, Field(ge=1, le=MAX_VCPUS)]] = [2]
    memory_mib: list[Annotated[int, Field(ge=MIN_MEMORY_MIB, le=MAX_MEMORY_MIB)]] = [1024]
    disk_bus: list[DiskBus] = [DiskBus.VIRTIO]
    clone: list[CloneKind] = [CloneKind.LINKED]
    tuning: list[str] = ["default"]
    cc: list[str] = ["default"]  # congestion control; "default": what the OS (or tuning profile) sets
    offloads: list[str] = ["default"]  # "default" (as the NIC comes) or "lro=off,tso=on,gro=off"
    wan: list[str] = ["none"]  # "none" or a [wan.NAME] profile
    exclude: list[dict[str, Any]] = []

    @field_validator("host", "image", "nic", "vcpus", "memory_mib", "disk_bus", "clone", "tuning", "cc",
                     "offloads", "wan")
    @classmethod
    def _non_empty_unique(cls, v: list) -> list:
        if not v:
            raise ValueError("must list at least one value")
        if len(set(v)) != len(v):
            raise ValueError("lists a value twice")
        return v


AXES = ("host", "image", "nic", "vcpus", "memory_mib", "disk_bus", "clone", "tuning", "cc", "offloads", "wan")
OFFLOAD_FEATURES = ("lro", "tso", "gro")


def parse_offloads(spec: str) -> dict[str, bool]:
    """Pure: "lro=off,tso=on" -> {"lro": False, "tso": True}; "default" -> {} (leave the NIC as it is).
    Raises ValueError naming what is wrong."""
    if spec == "default":
        return {}
    out: dict[str, bool] = {}
    for part in spec.split(","):
        feat, sep, state = part.strip().partition("=")
        if not sep or feat not in OFFLOAD_FEATURES or state not in ("on", "off"):
            raise ValueError(f"{part.strip()!r} is not FEATURE=on|off with FEATURE one of {', '.join(OFFLOAD_FEATURES)}")
        if feat in out:
            raise ValueError(f"sets {feat} twice")
        out[feat] = state == "on"
    return out


class WanProfile(_Strict):
    """[wan.NAME]: netem on one direction of the guest's link (lab.wan). delay_ms is the added
    round-trip time (all of it on one direction), jitter_ms its +- spread, loss_pct the share of
    packets dropped in that direction, rate_mbit a rate limit in that direction (0: none)."""

    delay_ms: float = Field(default=0.0, ge=0, le=10000)
    jitter_ms: float = Field(default=0.0, ge=0, le=10000)
    loss_pct: float = Field(default=0.0, ge=0, le=100)
    rate_mbit: float = Field(default=0.0, ge=0, le=100000)

    @property
    def is_null(self) -> bool:
        return not (self.delay_ms or self.jitter_ms or self.loss_pct or self.rate_mbit)
# Backends that can run the suite on the host itself (a bare-metal baseline cell, lab.baremetal):
# the local one, where the host is this machine.
BARE_METAL_BACKENDS = ("local",)


class SuiteSection(_Strict):
    workloads: list[str] = ["sysbench-cpu", "iperf3-tcp"]
    # Fixed n; with target_ci_pct, the minimum n before the CI is looked at.
    repetitions: int = Field(default=3, ge=1, le=1000)
    warmup: int = Field(default=1, ge=0, le=100)  # per VM boot, discarded
    # sequential: cells in matrix order; random: cells shuffled; interleaved: rounds in which
    # every cell is booted, measured for repetitions_per_boot repetitions and destroyed, in a
    # new shuffled order each round (lab.runner). The seed of every shuffle is recorded.
    order: Literal["sequential", "random", "interleaved"] = "sequential"
    seed: int | None = None
    repetitions_per_boot: int = Field(default=1, ge=1, le=1000)  # interleaved only
    # Adaptive repetition: repeat until the 95 % CI of the median of every throughput-like metric
    # is within +-target_ci_pct % of the median, or a budget is spent.
    target_ci_pct: float | None = Field(default=None, gt=0, le=100)
    max_repetitions: int = Field(default=30, ge=1, le=10000)  # adaptive budget per cell and workload
    max_seconds: float | None = Field(default=None, gt=0, le=7 * 86400)  # likewise, measured time
    bare_metal: bool = False  # add a cell that runs the suite on the (local) host itself
    noise_floor: bool = False  # run the first cell twice (an A/A twin) to measure the noise floor
    params: dict[str, dict[str, Any]] = {}


class LabConfig(_Strict):
    lab: LabSection = LabSection()
    hosts: dict[str, HostConfig] = {"local": LocalHost(backend="local")}
    matrix: MatrixSection = MatrixSection()
    wan: dict[str, WanProfile] = {}
    suite: SuiteSection = SuiteSection()
    # Where the file was read from; relative paths in it are relative to its folder.
    source: str = Field(default="lab.toml", exclude=True)

    @property
    def base_dir(self) -> Path:
        return Path(self.source).resolve().parent

    @property
    def results_dir(self) -> Path:
        p = Path(self.lab.results)
        return p if p.is_absolute() else self.base_dir / p


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # pydantic names union members by their tag, e.g. hosts.pve1.proxmox.url
            if part in ("local", "proxmox", "libvirt") and out.startswith("hosts.") and out.count(".") == 1:
                continue
            out += ("." if out else "") + str(part)
    return out


def _dig(data: Any, loc: tuple) -> Any:
    cur = data
    for part in loc:
        try:
            cur = cur[part]
        except (KeyError, IndexError, TypeError):
            return None
    return cur


def load(path: str | os.PathLike) -> LabConfig:
    """Read and validate a lab.toml. Raises ConfigError (one line, exit 2) on any problem."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(str(path), "(file)", None, "no such file",
                          hint="pass -c PATH or create lab.toml") from None
    except OSError as exc:
        raise ConfigError(str(path), "(file)", None, f"cannot read: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(str(path), "(file)", None, "is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), "(syntax)", None, f"invalid TOML: {exc}") from None
    return parse(data, str(path))


def parse(data: dict[str, Any], source: str = "lab.toml") -> LabConfig:
    # The local backend is always there unless the file defines its own "local".
    if isinstance(data.get("hosts", {}), dict) and "local" not in data.get("hosts", {}):
        data = {**data, "hosts": {"local": {"backend": "local"}, **data.get("hosts", {})}}
    try:
        cfg = LabConfig.model_validate({**data, "source": source}) if "source" not in data else None
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        # Pydantic reports the union tag inside the path for hosts.<name>; show the user's key.
        user_loc = tuple(p for i, p in enumerate(loc)
                         if not (i == 2 and loc[0] == "hosts" and p in ("local", "proxmox", "libvirt")))
        is_key = bool(user_loc) and user_loc[-1] == "[key]"  # a dict key outside its choices
        if is_key:
            user_loc = user_loc[:-1]
        value = _dig(data, user_loc) if err["type"] != "missing" else None
        msg = err["msg"].removeprefix("Value error, ")
        if is_key:
            msg = "unknown key; " + msg[:1].lower() + msg[1:]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "union_tag_invalid":
            msg = "unknown backend; expected one of: local, proxmox, libvirt"
            user_loc = user_loc + ("backend",)
            value = _dig(data, user_loc)
        elif err["type"] == "union_tag_not_found":
            msg = "missing backend; expected one of: local, proxmox, libvirt"
            user_loc = user_loc + ("backend",)
        if user_loc and user_loc[-1] in SECRET_KEYS:
            value = "<redacted>"  # a secret pasted in place of a reference is never echoed
        elif isinstance(value, (dict, list)) and err["type"] != "list_type":
            value = "{…}" if isinstance(value, dict) else "[…]"
        more = len(exc.errors()) - 1
        if more:
            msg += f" (and {more} more problem{'s' if more > 1 else ''})"
        raise ConfigError(source, _loc(user_loc) or "(top level)", value, msg) from None
    if cfg is None:
        raise ConfigError(source, "source", data["source"], "unknown key")
    _check_references(cfg, data)
    return cfg


def _check_references(cfg: LabConfig, data: dict[str, Any]) -> None:
    """Cross-field checks pydantic cannot express per field."""
    src = cfg.source
    for i, host in enumerate(cfg.matrix.host):
        if host not in cfg.hosts:
            raise ConfigError(src, f"matrix.host[{i}]", host,
                              f"no such host; defined hosts: {', '.join(sorted(cfg.hosts)) or 'none'}")
    for i, image in enumerate(cfg.matrix.image):
        if image not in KNOWN_IMAGES:
            raise ConfigError(src, f"matrix.image[{i}]", image,
                              f"unknown image; known images: {', '.join(KNOWN_IMAGES)}")
    for name, host in cfg.hosts.items():
        if isinstance(host, ProxmoxHost) and not host.token and not (host.user and host.password):
            raise ConfigError(src, f"hosts.{name}.token", None,
                              'Proxmox needs token = "env:NAME" (an API token), or user and password')
        if name not in cfg.matrix.host or host.backend not in _FIXED_NIC_MODELS:
            continue  # backends with a plan_check answer for themselves below
        supported = backend_nic_models(host.backend)
        for i, nic in enumerate(cfg.matrix.nic):
            if nic not in supported:
                raise ConfigError(src, f"matrix.nic[{i}]", nic.value,
                                  f"the {host.backend} backend of host {name!r} cannot emulate this NIC; "
                                  f"it can: {', '.join(sorted(m.value for m in supported))}")
    from lab import tuning as tuning_mod  # profiles are templates; late import keeps config light

    known_profiles = tuning_mod.profiles()
    for i, prof in enumerate(cfg.matrix.tuning):
        if prof not in known_profiles:
            raise ConfigError(src, f"matrix.tuning[{i}]", prof,
                              f"unknown tuning profile; known: {', '.join(sorted(known_profiles))}")
    _check_network_axes(cfg)
    for i, ex in enumerate(cfg.matrix.exclude):
        for key, val in ex.items():
            if key not in AXES:
                raise ConfigError(src, f"matrix.exclude[{i}].{key}", val,
                                  f"unknown axis; axes: {', '.join(AXES)}")
    from lab import plan

    if not plan.cells(cfg) and not cfg.suite.bare_metal:
        raise ConfigError(src, "matrix.exclude", cfg.matrix.exclude, "excludes every cell; nothing to run")
    _check_capabilities(cfg, plan.cells(cfg))
    _check_wan_places(cfg, plan.cells(cfg))
    suite = cfg.suite
    if suite.target_ci_pct is not None and suite.max_repetitions < suite.repetitions:
        raise ConfigError(src, "suite.max_repetitions", suite.max_repetitions,
                          f"is below suite.repetitions ({suite.repetitions}), the minimum of adaptive repetition")
    if suite.repetitions_per_boot != 1 and suite.order != "interleaved":
        raise ConfigError(src, "suite.repetitions_per_boot", suite.repetitions_per_boot,
                          'only applies with suite.order = "interleaved"')
    if suite.bare_metal:
        hosts = [h for h in cfg.matrix.host if cfg.hosts[h].backend in BARE_METAL_BACKENDS]
        if not hosts:
            raise ConfigError(src, "suite.bare_metal", True,
                              f"needs a host whose backend can run the suite on itself "
                              f"({', '.join(BARE_METAL_BACKENDS)}); matrix.host has none")
    if suite.noise_floor and not plan.cells(cfg):
        raise ConfigError(src, "suite.noise_floor", True, "needs at least one VM cell to run twice")
    from lab.workloads import load_all

    known = load_all()
    if not cfg.suite.workloads:
        raise ConfigError(src, "suite.workloads", [], f"must list at least one workload; known: {', '.join(sorted(known))}")
    for i, wl in enumerate(cfg.suite.workloads):
        if wl not in known:
            raise ConfigError(src, f"suite.workloads[{i}]", wl,
                              f"unknown workload; known: {', '.join(sorted(known))}")
    if len(set(cfg.suite.workloads)) != len(cfg.suite.workloads):
        raise ConfigError(src, "suite.workloads", cfg.suite.workloads, "lists a workload twice")
    for wl, params in cfg.suite.params.items():
        if wl not in known:
            raise ConfigError(src, f"suite.params.{wl}", params,
                              f"unknown workload; known: {', '.join(sorted(known))}")
        defaults = getattr(known[wl], "defaults", {})
        for key, val in params.items():
            if key not in defaults:
                raise ConfigError(src, f"suite.params.{wl}.{key}", val,
                                  f"unknown parameter; {wl} takes: {', '.join(sorted(defaults)) or 'none'}")
            want = type(defaults[key])
            if defaults[key] is not None and not isinstance(val, want) and not (want is float and isinstance(val, int)):
                raise ConfigError(src, f"suite.params.{wl}.{key}", val, f"must be {want.__name__}")
    _check_workload_values(cfg, src, known)


def _check_network_axes(cfg: LabConfig) -> None:
    """cc, offloads and wan values: known to the lab, and (cc) possible on at least one guest OS of
    the matrix. What one OS or NIC cannot do is found per cell (n/a at run time, with the reason)."""
    from lab import osfacts

    src, m = cfg.source, cfg.matrix
    oses = sorted({KNOWN_IMAGES[i] for i in m.image})
    for i, cc in enumerate(m.cc):
        if cc == "default":
            continue
        if not re.fullmatch(r"[a-z0-9_]+", cc):
            raise ConfigError(src, f"matrix.cc[{i}]", cc, "is not a congestion-control name")
        known = sorted({a for o in oses for a in osfacts.facts(o).cc_available})
        if cc not in known:
            raise ConfigError(src, f"matrix.cc[{i}]", cc, f"no guest OS of the matrix ({', '.join(oses)}) has it; "
                              f"known: default, {', '.join(known) or 'none'}")
    for i, spec in enumerate(m.offloads):
        try:
            parse_offloads(spec)
        except ValueError as exc:
            raise ConfigError(src, f"matrix.offloads[{i}]", spec, f"{exc} (or \"default\")") from None
    for name, prof in cfg.wan.items():
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == "none":
            raise ConfigError(src, f"wan.{name}", "{…}", "is not a usable profile name (letters, digits, _ . -; not \"none\")")
        if prof.jitter_ms > prof.delay_ms:
            raise ConfigError(src, f"wan.{name}.jitter_ms", prof.jitter_ms,
                              f"is larger than delay_ms ({prof.delay_ms:g}): netem would be asked for negative delays")
    for i, w in enumerate(m.wan):
        if w != "none" and w not in cfg.wan:
            raise ConfigError(src, f"matrix.wan[{i}]", w,
                              f"no such [wan.{w}] profile; defined: {', '.join(['none', *sorted(cfg.wan)])}")


def _check_wan_places(cfg: LabConfig, cells: list) -> None:
    """A cell with WAN emulation needs somewhere to put netem (lab.wan.place): said before anything
    is created, not found out per cell."""
    from lab import osfacts, wan

    for c in cells:
        prof = cfg.wan.get(c.wan)
        if prof is None or prof.is_null:
            continue
        where, why = wan.place(cfg.hosts[c.host].backend, osfacts.facts(KNOWN_IMAGES[c.image]))
        if not where:
            raise ConfigError(cfg.source, f"matrix.wan[{cfg.matrix.wan.index(c.wan)}]", c.wan,
                              f"cannot emulate a WAN for host {c.host!r} with image {c.image!r}: {why}")


def _check_workload_values(cfg: LabConfig, src: str, known: dict) -> None:
    """Each workload's own value checks (ranges, choices, what the guest OS allows), for every
    guest OS and vCPU count the matrix has, so a bad value stops here, before anything is made."""
    from lab import plan
    from lab.errors import UsageError
    from lab.workloads import WorkloadContext

    combos = sorted({(KNOWN_IMAGES[c.image], c.vcpus) for c in plan.cells(cfg)})
    for wl in dict.fromkeys([*cfg.suite.workloads, *cfg.suite.params]):
        check = getattr(known[wl], "params", None)
        if check is None:
            continue
        given = cfg.suite.params.get(wl, {})
        for os_name, vcpus in combos:
            ctx = WorkloadContext(guest=None, client=None, os=os_name, vcpus=vcpus,
                                  params={**getattr(known[wl], "defaults", {}), **given})
            try:
                check(ctx)
            except UsageError as exc:
                problem = exc.message.removeprefix(f"{wl}: ")
                key = problem.split(" ", 1)[0]
                if key in given:
                    raise ConfigError(src, f"suite.params.{wl}.{key}", given[key],
                                      f"{problem} (guest OS {os_name})") from None
                raise ConfigError(src, f"suite.params.{wl}", given or None, f"{problem} (guest OS {os_name})") from None


_FIXED_NIC_MODELS: dict[str, frozenset[NicModel]] = {
    "local": frozenset({NicModel.VIRTIO, NicModel.E1000, NicModel.E1000E, NicModel.RTL8139, NicModel.VMXNET3}),
    "proxmox": frozenset({NicModel.VIRTIO, NicModel.E1000, NicModel.E1000E, NicModel.RTL8139, NicModel.VMXNET3}),
}


def backend_nic_models(backend: str) -> frozenset[NicModel]:
    """NIC models a backend emulates whatever its host (checked at plan time). The libvirt backend
    is not here: what it can do depends on the host's driver (bhyve: virtio and e1000 only), so
    its plan_check answers per host."""
    return _FIXED_NIC_MODELS[backend]


def host_settings(cfg: LabConfig, name: str) -> dict[str, Any]:
    """The settings a backend is built from: the host's table (unset keys as None) plus the file."""
    settings = cfg.hosts[name].model_dump()
    settings["source"] = cfg.source
    return settings


def _check_capabilities(cfg: LabConfig, cells: list) -> None:
    """Ask each backend that can answer without touching its host (a `plan_check` classmethod)
    whether it can make every cell it is given: NIC model, disk bus, clone kind, settings. Its
    SettingError names a matrix axis or a host key; we add the file and the exact location."""
    from lab.backends import backend_class
    from lab.errors import SettingError
    from lab.model import ImageRef, VmSpec

    for name, host in cfg.hosts.items():
        check = getattr(backend_class(host.backend), "plan_check", None)
        if check is None:
            continue
        specs = [VmSpec(name=f"lab-plan-{c.id}", run_id="plan", cell_id=c.id,
                        image=ImageRef(name=c.image, os=KNOWN_IMAGES[c.image], path=Path(c.image), digest=""),
                        nic=c.nic, vcpus=c.vcpus, memory_mib=c.memory_mib, disk_bus=c.disk_bus, clone=c.clone)
                 for c in cells if c.host == name]
        try:
            check(name, host_settings(cfg, name), specs)
        except SettingError as exc:
            key = f"hosts.{name}.{exc.key}"
            if exc.key in AXES:
                values = [str(v) for v in getattr(cfg.matrix, exc.key)]
                key = f"matrix.{exc.key}[{values.index(str(exc.value))}]" if str(exc.value) in values \
                    else f"matrix.{exc.key}"
            raise ConfigError(cfg.source, key, exc.value, exc.problem, hint=exc.hint) from None


def resolve_secret(ref: str | None, source: str, key: str) -> str | None:
    """Read a secret from "env:NAME" or "file:/path". Errors name the reference, never a value."""
    if ref is None:
        return None
    kind, _, where = ref.partition(":")
    if kind == "env":
        value = os.environ.get(where)
        if not value:
            raise ConfigError(source, key, ref, f"environment variable {where} is not set")
        return value.strip()
    if kind == "file":
        try:
            value = Path(where).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(source, key, ref, f"cannot read secret file: {exc.strerror}") from None
        if not value:
            raise ConfigError(source, key, ref, "secret file is empty")
        return value
    raise ConfigError(source, key, ref, 'must be "env:NAME" or "file:/path"')
