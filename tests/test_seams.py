"""The design's seams, checked on the code itself (issue 38): what a plug-in can do is declared,
never probed; each fact has one home. Pure: reads lab/'s source with ast, imports nothing heavy."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from lab import backends, osfacts
from lab.model import NicModel

LAB = Path(__file__).resolve().parent.parent / "lab"


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
