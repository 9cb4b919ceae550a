"""The design's seams, checked on the code itself (issue 38): what a plug-in can do is declared,
never probed; each fact has one home. Pure: reads lab/'s source with ast, imports nothing heavy."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from lab import backends, osfacts
from lab.model import NicModel

LAB = Path(__file__).resolve().parents[2] / "lab"


@functools.cache
def sources() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(LAB.rglob("*.py"))]


def docstrings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings (prose, not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_no_getattr_probe_on_a_workload_or_a_guest():
    """What a workload or a guest can do is in its declared traits or the Guest protocol
    (lab.workloads.Traits, lab.guest.Machine), not found out with getattr."""
    probed = {"wl", "workload", "workloads", "guest", "machine", "g", "known"}
    found = []
    for path, tree in sources():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                target = node.args[0]
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if isinstance(target, ast.Subscript):  # known[wl], load_all()[name]
                    name = "workload"
                if name in probed:
                    found.append(f"{path.relative_to(LAB.parent)}:{node.lineno}")
    assert found == []


def test_nic_model_names_are_written_once():
    """The NIC model enum is the only list of their names: a backend's device table and an OS's
    driver table name models by the enum (what the hypervisor or driver calls it is the value)."""
    names = {m.value for m in NicModel} - {"virtio"}  # "virtio" is a disk bus too
    found = []
    for path, tree in sources():
        prose = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in prose:
                found.append(f"{path.relative_to(LAB.parent)}:{node.lineno} {node.value!r}")
    assert [f for f in found if not f.startswith("lab/model.py:")] == []
    assert len(found) == len(names)


@pytest.mark.parametrize("name", backends.names())
def test_each_backend_offers_the_nic_models_of_its_own_device_table(name):
    """Capabilities.nic_models is derived from the table each backend makes its VMs' NICs with."""
    from lab.backends.libvirt.drivers import DRIVERS
    from lab.backends.local.qemu import NIC_DEVICE
    from lab.backends.proxmox.settings import NET_MODELS
    from lab.backends.smartos.settings import NIC_MODELS
    from lab.backends.vagrant.settings import LIBVIRT_NICS

    model = backends.settings_model(name)
    examples = {
        "local": ({}, [NIC_DEVICE]),
        "libvirt": ({"uri": "qemu:///system"}, [DRIVERS["qemu"].nics]),
        "proxmox": ({"url": "https://pve.invalid:8006", "node": "pve", "token": "env:T"}, [NET_MODELS]),
        "smartos": ({"ssh": "root@gz.invalid", "brand": "kvm"}, [NIC_MODELS["kvm"]]),
        "vagrant": ({}, [LIBVIRT_NICS]),
    }
    given, tables = examples[name]
    caps = backends.capabilities(model(backend=name, **given))
    assert caps.nic_models == frozenset(tables[0])
    bhyve = backends.capabilities(backends.settings_model("libvirt")(backend="libvirt", uri="bhyve:///system"))
    assert bhyve.nic_models == frozenset(DRIVERS["bhyve"].nics) == {NicModel.VIRTIO, NicModel.E1000}


def test_os_facts_have_one_home():
    """What hypervisors call an OS, whether warm start can fix it up, and each tool's package per OS
    come from lab.osfacts, not from tables inside backends or workloads."""
    assert {n: (f.pve_ostype, f.imgadm_os) for n, f in osfacts.OSES.items() if n != "bare-metal"} == {
        "debian": ("l26", "linux"),
        "alpine": ("l26", "linux"),
        "freebsd": ("other", "bsd"),
        "netbsd": ("other", "bsd"),
        "openbsd": ("other", "bsd"),
    }
    assert [n for n, f in osfacts.OSES.items() if f.warm_fixups] == ["debian"]
    assert osfacts.package("freebsd", "git") == "git-lite" and osfacts.package("debian", "nginx") == "nginx-light"
    assert (
        osfacts.facts("debian").packages["hyperfine"] == "hyperfine"
        and "hyperfine" not in osfacts.facts("alpine").packages
    )
    assert osfacts.package("openbsd", "tool-nobody-knows") == "tool-nobody-knows"


# ---------------------------------------------------------------------------------------------
# The parts of the design (docs/architecture.md): every module of lab/ has one, and no import
# crosses a seam. The first parts and rules are ../shared/tools/layers'; the rest place the modules
# it leaves on no part.

PARTS = {
    "face": ["lab.cli", "lab.__main__"],
    "views": [
        "lab.report",
        "lab.analysis",
        "lab.results",
        "lab.compare",
        "lab.variants",  # a workload's own variants as a comparison's two sides
        "lab.reparse",
        "lab.history",
        "lab.explain",  # what a comparison's knobs do; its follow-up cells are config, asking them is run
    ],
    "run": [
        "lab.runner",
        "lab.schedule",
        "lab.gc",
        "lab.bench",
        "lab.doctor",
        "lab.lifecycle",
        "lab.reproduce",
        "lab.explain.session",
    ],
    "config": [
        "lab.config",
        "lab.overrides",
        "lab.labconfig",
        "lab.plan",
        "lab.check",
        "lab.axes",
        "lab.estimate",
        "lab.explain.followup",
    ],
    "backends": ["lab.backends"],
    "workloads": ["lab.workloads"],
    "guestside": ["lab.guest", "lab.tuning", "lab.wan", "lab.hostinfo", "lab.osfacts", "lab.isolation"],
    "images": ["lab.images"],
    "store": ["lab.store", "lab.storeschema", "lab.storetables", "lab.storeimport", "lab.storeprune"],
    "load": ["lab.hostload", "lab.clientload", "lab.flags"],
    "leaves": [
        "lab.stats",
        "lab.errors",
        "lab.model",
        "lab.proc",
        "lab.wait",
        "lab.runlock",
        "lab.secrets",
        "lab.statedir",
        "lab.clients",
        "lab.verdicts",
        "lab.changepoints",
        "lab.lease",
        "lab.names",
        "lab.paths",
        "lab.plaintext",
        "lab.redact",
        "lab.programs",
        "lab.outfiles",
    ],
}
NEVER = [
    ("backends", "config"),
    ("backends", "run"),
    ("backends", "workloads"),
    ("backends", "face"),
    ("backends", "views"),
    ("workloads", "backends"),
    ("workloads", "run"),
    ("views", "backends"),
    ("views", "run"),
    ("store", "config"),
    ("guestside", "config"),
    ("config", "run"),
    ("run", "face"),
    *[
        (low, high)
        for low in ("leaves", "load")
        for high in ("config", "store", "backends", "workloads", "run", "views", "face", "guestside", "images")
    ],
    ("leaves", "load"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(LAB.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str | None:
    best = max(
        (
            (p, prefix)
            for p, prefixes in PARTS.items()
            for prefix in prefixes
            if module == prefix or module.startswith(prefix + ".")
        ),
        key=lambda pp: len(pp[1]),
        default=(None, ""),
    )
    return best[0]


def imports_of(path: Path, tree: ast.Module) -> set[str]:
    """The lab modules `path` names in its imports (in functions and under TYPE_CHECKING too)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out |= {target, *(f"{target}.{a.name}" for a in node.names)}
    return {m for m in out if m == "lab" or m.startswith("lab.")}


def known_modules() -> dict[str, Path]:
    return {module_name(p): p for p in LAB.rglob("*.py")}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_every_module_has_a_part_and_no_import_crosses_a_seam():
    modules = known_modules()
    assert sorted(m for m in modules if m != "lab" and part_of(m) is None) == []
    crossings = []
    for path, tree in sources():
        src = part_of(module_name(path))
        for target in imports_of(path, tree):
            dst = part_of(target)
            if src and dst and src != dst and (src, dst) in NEVER:
                crossings.append(f"{path.relative_to(LAB.parent)} imports {target}: {src} -> {dst}")
    assert sorted(set(crossings)) == []


def test_the_views_import_nothing_that_imports_a_backend():
    """Reading results needs no hypervisor: what the views import, and all it imports in turn, is
    free of lab.backends, lab.plan and lab.runner (`lab show`'s command module imports the CLI's
    group, which reads lab.toml: the views proper are checked whole, the command module one level
    down)."""
    modules = known_modules()
    graph = {}
    for path, tree in sources():
        graph[module_name(path)] = {r for t in imports_of(path, tree) if (r := resolve(t, modules))}
    forbidden = ("lab.backends", "lab.plan", "lab.runner")

    def reached(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for d in graph.get(todo.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    for view in [m for m in modules if part_of(m) == "views"]:
        bad = sorted(m for m in reached(view) if m.startswith(forbidden))
        assert bad == [], view
    for direct in graph["lab.cli.views"] - {"lab.cli", "lab.cli.group"}:
        assert not [m for m in graph.get(direct, ()) | {direct} if m.startswith(forbidden)], direct


def test_the_architecture_page_names_every_module():
    """The picture stays true: each top-level module and package of lab/ is named on the docs'
    Architecture page, docs/architecture.md (lab/NAME.py, lab/NAME/, or `NAME` in the table of parts)."""
    section = (LAB.parent / "docs" / "architecture.md").read_text()
    names = sorted(
        p.stem if p.suffix == ".py" else p.name
        for p in LAB.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    )
    missing = [n for n in names if not any(f in section for f in (f"lab/{n}.py", f"lab/{n}/", f"`{n}`"))]
    assert missing == []


# ---------------------------------------------------------------------------------------------
# Small classes, and a small Backend core with optional parts


def test_no_class_in_lab_has_more_than_30_methods():
    """Split by job (the backends the way the Proxmox backend is: a seam handing the work to its
    parts); properties and class methods count too."""
    big = []
    for path, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in node.body)
                if n > 30:
                    big.append(f"{path.relative_to(LAB.parent)}:{node.name} has {n}")
    assert big == []


PART_OF_CAPABILITY = {
    "publishing": "publish",
    "warm": "snapshots",
    "bare_metal": "bare_metal",
    "load_meter": "host_load",
}


@pytest.mark.parametrize(
    "name, given",
    [
        ("local", {}),
        ("libvirt", {"uri": "qemu:///system"}),
        ("libvirt", {"uri": "bhyve+ssh://root@bsd.invalid/system", "dataset": "zroot/lab"}),
        ("proxmox", {"url": "https://pve.invalid:8006", "node": "pve", "token": "env:LAB_SEAMS_TOKEN"}),
        ("smartos", {"ssh": "root@gz.invalid"}),
        ("vagrant", {}),
    ],
)
def test_a_backend_has_the_optional_parts_its_capabilities_declare(name, given, tmp_path, monkeypatch):
    """Each optional part (publish, warm start, bare metal, host load) is an object of its own, made
    exactly where the capabilities say the host has it; nothing is contacted to make them."""
    monkeypatch.setenv("LAB_SEAMS_TOKEN", "lab@pve!t=00000000-0000-0000-0000-000000000000")
    settings = backends.settings_model(name)(backend=name, **given)
    env = backends.BackendEnv(source="lab.toml", base_dir=tmp_path, state_dir=tmp_path, ssh_key=tmp_path / "k")
    backend = backends.backend_class(name)("h", settings, env)
    caps = backends.capabilities(settings)
    for part, capability in PART_OF_CAPABILITY.items():
        assert (getattr(backend, part) is not None) == getattr(caps, capability), (name, part)
