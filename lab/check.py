"""One validation pass over a parsed lab (lab.labconfig records) and one expansion of its matrix,
before anything is created: references between sections, what each host can make, what each
guest OS can do, what each workload accepts. Each problem is a one-line ConfigError naming the
file, the key and the value (exit status 2).

What one cell cannot do that only a booted guest can tell (an offload the NIC reports [fixed], a
cc the running kernel lacks) is found at run time and makes that cell n/a; everything that can be
known from lab.toml, the backends' capabilities, lab.osfacts and the image recipes is found here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lab import backends, images, isolation, names, osfacts, plan, tuning, wan, workloads
from lab.axes import AXES, BY_NAME, KNOBS
from lab.errors import ConfigError, HostUnreachable, SettingError, UnreachableError, UsageError
from lab.labconfig import KNOWN_IMAGES, LabConfig
from lab.model import ImageRef, Isolation, Runtime
from lab.workloads import WorkloadContext


def validate(cfg: LabConfig) -> None:
    """Every check, in the order a user fixes them: what the names refer to, then what the
    hosts, guests and workloads can do with the cells."""
    check_references(cfg)
    check_network_values(cfg)
    check_excludes(cfg)
    check_storable(cfg)
    cfg.suite.quiet_mode(False)  # $LAB_QUIET_HOST, when set, is a value it can use (UsageError)
    check_matrix_size(cfg)
    cells = plan.cells(cfg)  # the one expansion of the matrix
    if not cells and not cfg.suite.bare_metal:
        raise ConfigError(cfg.source, "matrix.exclude", cfg.matrix.exclude, "excludes every cell; nothing to run")
    check_isolation_kinds(cfg, cells)
    check_hosts(cfg, cells)
    check_guests(cfg, cells)
    check_boot(cfg, cells)
    check_wan_places(cfg, cells)
    check_suite(cfg, cells)
    check_workloads(cfg)
    check_workload_values(cfg, cells)
    check_isolation(cfg, cells)


def _index(cfg: LabConfig, axis: str, value: Any) -> str:
    """The key of one value of a matrix axis: matrix.nic[1]."""
    values = [str(v) for v in getattr(cfg.matrix, axis)]
    return f"matrix.{axis}[{values.index(str(value))}]" if str(value) in values else f"matrix.{axis}"


def check_references(cfg: LabConfig) -> None:
    src = cfg.source
    for i, host in enumerate(cfg.matrix.host):
        if host not in cfg.hosts:
            raise ConfigError(
                src, f"matrix.host[{i}]", host, f"no such host; defined hosts: {', '.join(sorted(cfg.hosts)) or 'none'}"
            )
    for i, image in enumerate(cfg.matrix.image):
        if image not in KNOWN_IMAGES:
            raise ConfigError(
                src, f"matrix.image[{i}]", image, f"unknown image; known images: {', '.join(KNOWN_IMAGES)}"
            )
    known_profiles = tuning.profiles()
    for i, prof in enumerate(cfg.matrix.tuning):
        if prof not in known_profiles:
            raise ConfigError(
                src, f"matrix.tuning[{i}]", prof, f"unknown tuning profile; known: {', '.join(sorted(known_profiles))}"
            )


def check_network_values(cfg: LabConfig) -> None:
    """cc, offloads and wan values: known to the lab, and (cc) possible on at least one guest OS of
    the matrix. What one OS or NIC cannot do is found per cell (n/a at run time, with the reason)."""
    src, m = cfg.source, cfg.matrix
    oses = sorted({KNOWN_IMAGES[i] for i in m.image})
    for i, cc in enumerate(m.cc):
        if cc == "default":
            continue
        if names.CC.problem(cc):
            raise ConfigError(src, f"matrix.cc[{i}]", cc, str(names.CC.problem(cc)))
        known = sorted({a for o in oses for a in osfacts.facts(o).cc_available})
        if cc not in known:
            raise ConfigError(
                src,
                f"matrix.cc[{i}]",
                cc,
                f"no guest OS of the matrix ({', '.join(oses)}) has it; known: default, {', '.join(known) or 'none'}",
            )
    for i, spec in enumerate(m.offloads):
        try:
            tuning.parse_offloads(spec)
        except ValueError as exc:
            raise ConfigError(src, f"matrix.offloads[{i}]", spec, f'{exc} (or "default")') from None
    for name, prof in cfg.wan.items():
        if names.PROFILE.problem(name) or name == "none":
            raise ConfigError(
                src,
                f"wan.{json.dumps(name)}",
                name,
                f'{names.PROFILE.problem(name) or "is not a usable profile name"} (not "none")',
            )
        if prof.jitter_ms > prof.delay_ms:
            raise ConfigError(
                src,
                f"wan.{name}.jitter_ms",
                prof.jitter_ms,
                f"is larger than delay_ms ({prof.delay_ms:g}): netem would be asked for negative delays",
            )
    for i, w in enumerate(m.wan):
        if w != "none" and w not in cfg.wan:
            raise ConfigError(
                src,
                f"matrix.wan[{i}]",
                w,
                f"no such [wan.{w}] profile; defined: {', '.join(['none', *sorted(cfg.wan)])}",
            )


def check_excludes(cfg: LabConfig) -> None:
    """Each exclude entry names axes of the matrix and values they have: one that names a value the
    matrix lacks (a typo, a value since removed) would silently exclude nothing."""
    for i, ex in enumerate(cfg.matrix.exclude):
        if not ex:
            raise ConfigError(cfg.source, f"matrix.exclude[{i}]", ex, "names no axis: it excludes nothing")
        for key, val in ex.items():
            if key not in AXES:
                raise ConfigError(
                    cfg.source, f"matrix.exclude[{i}].{key}", val, f"unknown axis; axes: {', '.join(AXES)}"
                )
            values = [str(BY_NAME[key].plain(v)) for v in getattr(cfg.matrix, key)]
            if isinstance(val, (dict, list)) or isinstance(val, bool) or str(val) not in values:
                raise ConfigError(
                    cfg.source,
                    f"matrix.exclude[{i}].{key}",
                    val if not isinstance(val, (dict, list)) else "{…}" if isinstance(val, dict) else "[…]",
                    f"is not a value of matrix.{key}, which has: {', '.join(values)}; the entry would exclude nothing",
                )


def check_matrix_size(cfg: LabConfig) -> None:
    """Every combination of the axes is made before any check of the cells: counted first, so a
    matrix of millions is one line, not minutes and gigabytes."""
    size = plan.combinations(cfg.matrix)
    if size > plan.MAX_COMBINATIONS:
        sizes = " x ".join(str(len(getattr(cfg.matrix, a))) for a in AXES if len(getattr(cfg.matrix, a)) > 1)
        raise ConfigError(
            cfg.source,
            "matrix",
            "{…}",
            f"has {size:,} combinations ({sizes}), before excludes; at most {plan.MAX_COMBINATIONS:,} are expanded",
            hint="fewer values per axis, or several labs",
        )


SQLITE_INT = (-(2**63), 2**63 - 1)


def check_storable(cfg: LabConfig) -> None:
    """Values the results store keeps as SQLite integers fit in one (64-bit), or the run would
    fail when it records them, after its checks."""
    seed = cfg.suite.seed
    if seed is not None and not SQLITE_INT[0] <= seed <= SQLITE_INT[1]:
        raise ConfigError(
            cfg.source,
            "suite.seed",
            seed,
            f"does not fit the results store's 64-bit integers ({SQLITE_INT[0]} to {SQLITE_INT[1]})",
        )


def setting_warnings(cfg: LabConfig) -> list[str]:
    """One line per setting of the matrix's hosts that works but gives up a check (verify_tls =
    false), naming file, key and value: `lab plan` and `lab run` say them."""
    return [
        f"{cfg.source}: hosts.{host}.{key} = {value!r}: {why}"
        for host in dict.fromkeys(cfg.matrix.host)
        for key, value, why in cfg.hosts[host].warnings()
    ]


def capacity_warnings(cfg: LabConfig, facts: dict[str, dict[str, Any]]) -> list[str]:
    """Pure: one line per host whose cells ask for more vCPUs or memory than the host has, from
    its facts ("cores": logical CPUs, "mem_kib"). Such cells still run, overcommitted: slowly, and
    their numbers say more about the host's contention than about the cell."""
    out = []
    cells = plan.cells(cfg)
    for host, f in sorted(facts.items()):
        mine = [c for c in cells if c.host == host]
        if not mine:
            continue
        vcpus, memory = max(c.vcpus for c in mine), max(c.memory_mib for c in mine)
        cores, mem_kib = f.get("cores"), f.get("mem_kib")
        over = []
        if isinstance(cores, int) and cores > 0 and vcpus > cores:
            over.append(f"{vcpus} vCPUs (the host has {cores} CPUs)")
        if isinstance(mem_kib, int) and mem_kib > 0 and memory * 1024 > mem_kib:
            over.append(f"{memory} MiB of memory (the host has {mem_kib // 1024} MiB)")
        if over:
            out.append(
                f"host {host!r}: cells ask for {' and '.join(over)}: they run overcommitted, slowly and "
                "with noisy numbers; lower matrix.vcpus / matrix.memory_mib or exclude those cells"
            )
    return out


def check_hosts(cfg: LabConfig, cells: list[plan.Cell]) -> None:
    """Ask each host's backend, without touching the host, whether it can make every cell it is
    given: NIC model, disk bus, clone kind, size, settings. Its SettingError names a matrix axis or
    a host key; the file and the exact location are added here."""
    for name, host in cfg.hosts.items():
        specs = [plan.vm_spec(c, _plan_image(c.image), run_id="plan") for c in cells if c.host == name]
        try:
            backends.backend_class(host.backend).plan_check(name, host, specs)
        except SettingError as exc:
            raise located(cfg, name, exc) from None


def located(cfg: LabConfig, host: str, exc: SettingError) -> ConfigError:
    """A backend's SettingError (a matrix axis or a key of [hosts.HOST]) as the lab.toml key it is."""
    key = _index(cfg, exc.key, exc.value) if exc.key in AXES else f"hosts.{host}.{exc.key}"
    return ConfigError(cfg.source, key, exc.value, exc.problem, hint=exc.hint)


ADDRESS_KEYS = ("url", "uri", "ssh")  # how each backend's settings say where the host is


@contextmanager
def reaching(cfg: LabConfig, host: str) -> Iterator[None]:
    """A host that cannot be reached while nothing is created yet (`lab run`'s checks, `lab
    snapshot`) is bad input: UnreachableError (exit 2), naming the file, the host's address key
    and its value, then what the backend said."""
    try:
        yield
    except HostUnreachable as exc:
        settings = cfg.hosts[host]
        key = next((k for k in ADDRESS_KEYS if getattr(settings, k, None)), None)
        where = f"hosts.{host}.{key} = {getattr(settings, key)!r}" if key else f"hosts.{host}"
        raise UnreachableError(f"{cfg.source}: {where}: {exc}", exc.hint) from None


def _plan_image(name: str) -> ImageRef:
    """An image as plan_check sees it: its name and OS (nothing is read from disk)."""
    return ImageRef(name=name, os=KNOWN_IMAGES[name], path=Path(name), digest="")


def check_guests(cfg: LabConfig, cells: list[plan.Cell]) -> None:
    """What each cell's guest OS can drive: a NIC model it has no driver for would boot and fail at
    verify (lab.osfacts nic_driver)."""
    for c in cells:
        facts = osfacts.facts(KNOWN_IMAGES[c.image])
        if c.nic not in facts.nic_driver:
            offered = ", ".join(n.value for n in facts.nic_driver)
            raise ConfigError(
                cfg.source,
                _index(cfg, "nic", c.nic),
                c.nic.value,
                f"guest OS {facts.name} (image {c.image!r}) has no driver for it; it drives {offered}",
                hint=f'exclude it for this image in [matrix] exclude: {{ image = "{c.image}", nic = "{c.nic.value}" }}',
            )


def image_boot_modes(name: str) -> set[str]:
    """How an image can boot: from its manifest when it is built, else from its recipe's kind
    (the golden debian12 by direct kernel boot and by firmware; ISO-installed images by firmware
    from their disk)."""
    try:
        modes = images.boot_modes(images.load(name).manifest)
    except UsageError:  # not built yet: the recipe says what a build will give
        modes = None
    if modes is None:
        modes = set(images.BOOT_MODES) if images.recipe(name).kind == "debootstrap" else {"disk"}
    return modes


def _boots(host_modes: frozenset[str], image_modes: set[str]) -> bool:
    """An image whose manifest says "disk" boots by the firmware of its installer's kind."""
    return any(m in image_modes or (m != "kernel" and "disk" in image_modes) for m in host_modes)


def check_boot(cfg: LabConfig, cells: list[plan.Cell]) -> None:
    """Each host's ways of booting (Capabilities.boot_modes) against the ways each of its images
    can boot."""
    seen: set[tuple[str, str]] = set()
    for c in cells:
        if (c.host, c.image) in seen:
            continue
        seen.add((c.host, c.image))
        caps = backends.capabilities(cfg.hosts[c.host])
        modes = image_boot_modes(c.image)
        if not _boots(caps.boot_modes, modes):
            raise ConfigError(
                cfg.source,
                _index(cfg, "image", c.image),
                c.image,
                f"cannot boot on host {c.host!r} ({caps.description}), which boots by "
                f"{', '.join(images.BOOT_WAYS.get(m, m) for m in sorted(caps.boot_modes))}; "
                f"the image boots by {', '.join(images.BOOT_WAYS.get(m, m) for m in sorted(modes))}",
                hint="exclude it for this host in [matrix] exclude",
            )


def check_wan_places(cfg: LabConfig, cells: list[plan.Cell]) -> None:
    """A cell with WAN emulation needs somewhere to put netem (lab.wan.place): said before anything
    is created, not found out per cell."""
    for c in cells:
        prof = cfg.wan.get(c.wan)
        if prof is None or prof.is_null:
            continue
        caps = backends.capabilities(cfg.hosts[c.host])
        where, why = wan.place(caps.lab_side_link, caps.description, osfacts.facts(KNOWN_IMAGES[c.image]))
        if not where:
            raise ConfigError(
                cfg.source,
                _index(cfg, "wan", c.wan),
                c.wan,
                f"cannot emulate a WAN for host {c.host!r} with image {c.image!r}: {why}",
            )


def check_suite(cfg: LabConfig, cells: list[plan.Cell]) -> None:
    src, suite = cfg.source, cfg.suite
    if suite.target_ci_pct is not None and suite.max_repetitions < suite.repetitions:
        raise ConfigError(
            src,
            "suite.max_repetitions",
            suite.max_repetitions,
            f"is below suite.repetitions ({suite.repetitions}), the minimum of adaptive repetition",
        )
    if suite.remeasure_flagged and suite.target_ci_pct is not None:
        raise ConfigError(
            src,
            "suite.remeasure_flagged",
            suite.remeasure_flagged,
            "applies to a fixed n only: with suite.target_ci_pct the repetitions go on until the unflagged "
            "ones suffice, up to suite.max_repetitions",
        )
    if suite.target_ci_pct is None:  # the adaptive budget means nothing to a fixed n: said, not ignored
        for key in ("max_repetitions", "max_seconds"):
            if key in suite.model_fields_set:
                raise ConfigError(
                    src,
                    f"suite.{key}",
                    getattr(suite, key),
                    "is a budget of adaptive repetition only (with suite.target_ci_pct); a fixed n measures "
                    "suite.repetitions",
                )
    if suite.repetitions_per_boot != 1 and suite.order != "interleaved":
        raise ConfigError(
            src,
            "suite.repetitions_per_boot",
            suite.repetitions_per_boot,
            'only applies with suite.order = "interleaved"',
        )
    if suite.bare_metal and not any(backends.capabilities(cfg.hosts[h]).bare_metal for h in cfg.matrix.host):
        raise ConfigError(
            src,
            "suite.bare_metal",
            True,
            "needs a host whose backend can run the suite on the host itself (the local backend); matrix.host has none",
        )
    if suite.noise_floor and not cells:
        raise ConfigError(src, "suite.noise_floor", True, "needs at least one VM cell to run twice")
    # unset, quiet_host is "wait" on a host that is this machine ($LAB_QUIET_HOST aside): the same rule
    waiting = [h for h in cfg.matrix.host if suite.quiet_mode(backends.capabilities(cfg.hosts[h]).local_host) == "wait"]
    if waiting and suite.quiet_timeout_s < suite.quiet_seconds:
        how = 'suite.quiet_host = "wait"' if suite.quiet_host else f"host {waiting[0]!r} waits for quiet by default"
        raise ConfigError(
            src,
            "suite.quiet_timeout_s",
            suite.quiet_timeout_s,
            f"is shorter than suite.quiet_seconds ({suite.quiet_seconds:g}) and {how}: "
            "the host could never be found quiet",
        )


def check_workloads(cfg: LabConfig) -> None:
    src, known = cfg.source, workloads.names()
    if not cfg.suite.workloads:
        raise ConfigError(
            src, "suite.workloads", [], f"must list at least one workload; known: {', '.join(sorted(known))}"
        )
    for i, wl in enumerate(cfg.suite.workloads):
        if wl not in known:
            raise ConfigError(src, f"suite.workloads[{i}]", wl, f"unknown workload; known: {', '.join(sorted(known))}")
    if len(set(cfg.suite.workloads)) != len(cfg.suite.workloads):
        raise ConfigError(src, "suite.workloads", cfg.suite.workloads, "lists a workload twice")
    for host in cfg.matrix.host:  # a client VM has none of this machine's files
        if cfg.hosts[host].client != "local":
            for wl in cfg.suite.workloads:
                if workloads.get(wl).traits.client_files:
                    raise ConfigError(
                        src,
                        f"hosts.{host}.client",
                        cfg.hosts[host].client,
                        f"workload {wl} serves or sends files of this machine from the client side: "
                        f'it runs only with client = "local"; leave it out of suite.workloads, or use "local"',
                    )
    for wl, params in cfg.suite.params.items():
        if wl not in known:
            raise ConfigError(src, f"suite.params.{wl}", params, f"unknown workload; known: {', '.join(sorted(known))}")
        declared = {p.name: p for p in workloads.get(wl).traits.params}
        for key, val in params.items():
            if key not in declared:
                raise ConfigError(
                    src,
                    f"suite.params.{wl}.{key}",
                    val,
                    f"unknown parameter; {wl} takes: {', '.join(sorted(declared)) or 'none'}",
                )
            want = declared[key].type
            if not isinstance(val, want) and not (want is float and isinstance(val, int)):
                raise ConfigError(src, f"suite.params.{wl}.{key}", val, f"must be {want.__name__}")


def check_workload_values(cfg: LabConfig, cells: list[plan.Cell]) -> None:
    """Each workload's own value checks (ranges, choices, what the guest OS allows), for every
    guest OS and vCPU count the matrix has, so a bad value stops here, before anything is made."""
    src = cfg.source
    combos = sorted({(KNOWN_IMAGES[c.image], c.vcpus) for c in cells})
    for wl in dict.fromkeys([*cfg.suite.workloads, *cfg.suite.params]):
        given, workload = cfg.suite.params.get(wl, {}), workloads.get(wl)
        for os_name, vcpus in combos:
            ctx = WorkloadContext(
                guest=None,  # type: ignore[arg-type]  # checking values only: no guest exists yet
                client=None,  # type: ignore[arg-type]
                os=os_name,
                vcpus=vcpus,
                params={**workload.defaults, **given},
            )
            try:
                workload.params(ctx)
            except UsageError as exc:
                problem = exc.message.removeprefix(f"{wl}: ")
                key = problem.split(" ", 1)[0]
                if key in given:
                    raise ConfigError(
                        src, f"suite.params.{wl}.{key}", given[key], f"{problem} (guest OS {os_name})"
                    ) from None
                raise ConfigError(src, f"suite.params.{wl}", given or None, f"{problem} (guest OS {os_name})") from None


def check_isolation_kinds(cfg: LabConfig, cells: list[plan.Cell]) -> None:
    """Isolation kinds this lab can make (lab.isolation), on the guest OSes they are given (before
    the hosts are asked whether they make them)."""
    src, m = cfg.source, cfg.matrix
    for i, kind in enumerate(m.isolation):
        why = isolation.kind_problem(kind)
        if why:
            raise ConfigError(src, f"matrix.isolation[{i}]", kind.value, why)
    if Isolation.CONTAINER not in m.isolation:
        for i, rt in enumerate(m.runtime):
            if rt != Runtime.PODMAN:
                raise ConfigError(
                    src,
                    f"matrix.runtime[{i}]",
                    rt.value,
                    'only container cells have a runtime, and matrix.isolation has no "container"',
                )
    for c in (c for c in cells if c.isolation != Isolation.VM):
        why = isolation.os_problem(c.isolation, KNOWN_IMAGES[c.image])
        if why:
            raise ConfigError(
                src,
                _index(cfg, "isolation", c.isolation),
                c.isolation.value,
                f"{why} (image {c.image!r})",
                hint=f'exclude it for this image in [matrix] exclude: {{ image = "{c.image}", '
                f'isolation = "{c.isolation.value}" }}',
            )


def own_containers(cfg: LabConfig, name: str) -> str:
    """Why workload `name`, with this lab's parameters, starts containers of its own ("" if not)."""
    workload = workloads.get(name)
    return workload.own_containers({**workload.defaults, **cfg.suite.params.get(name, {})})


def check_isolation(cfg: LabConfig, cells: list[plan.Cell]) -> None:
    """Workloads that can run inside the cells' zones and containers (the bare-metal host's too)."""
    src = cfg.source
    check_zones(cfg, [c for c in cells if c.isolation == Isolation.ZONE])
    boxed = [c for c in cells if c.isolation == Isolation.CONTAINER]
    if not boxed and not (cfg.suite.bare_metal and Isolation.CONTAINER in cfg.matrix.isolation):
        return
    bare = any(  # the bare-metal host's podman container cell (its docker one is n/a anyway)
        u.kind == plan.BARE_METAL and u.isolation == Isolation.CONTAINER and u.runtime == Runtime.PODMAN
        for u in plan.units(cfg)
    )
    for i, wl in enumerate(cfg.suite.workloads):
        why = isolation.workload_problem(own_containers(cfg, wl), bare_metal=bare)
        if why:
            raise ConfigError(src, f"suite.workloads[{i}]", wl, f"cannot run inside a container cell: {why}")


def check_zones(cfg: LabConfig, zones: list[plan.Cell]) -> None:
    """A zone shares its host's kernel: it has no tunables of its own (the tune stage's knobs would
    be the host's), and an lx zone runs no containers of its own."""
    src = cfg.source
    for c in zones:
        for name in KNOBS:
            value = getattr(c, name)
            if value != BY_NAME[name].default:
                raise ConfigError(
                    src,
                    _index(cfg, name, value),
                    value,
                    "a zone cell cannot be tuned: a zone shares its host's kernel, so its tunables are the host's",
                    hint=f'exclude it for zones in [matrix] exclude: {{ isolation = "zone", {name} = "{value}" }}',
                )
    if zones:
        for i, wl in enumerate(cfg.suite.workloads):
            if own_containers(cfg, wl):
                raise ConfigError(
                    src,
                    f"suite.workloads[{i}]",
                    wl,
                    "cannot run in a zone cell: it starts containers, and an lx zone runs none",
                    hint='drop it from the suite or "zone" from matrix.isolation (git-clone: network = ["guest"])',
                )
