"""The cluster and its nodes: /version, /cluster/nextid (a string, not a reservation), /cluster/resources,
/nodes and /nodes/{node}/status. An offline node is listed `offline`; calls for it answer 595."""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

from .state import VERSIONS, VmState, bad_param, handler
from .vms import memory_mib, vm_summary

if TYPE_CHECKING:
    from .server import PveEmulator

# the kernel each release shipped with (`current-kernel` from 8.x, `kversion` always)
KERNELS = {"7.4": "5.15.108-1-pve", "8.4": "6.8.12-9-pve", "9.1": "6.17.2-1-pve"}
HOST_RESERVED = 2 * 1024**3  # memory the node itself uses


@handler("GET", "/version")
def _version(emu: PveEmulator, p, who):
    return {"version": VERSIONS[emu.version], "release": emu.version, "repoid": "0a1b2c3d"}


@handler("GET", "/cluster/nextid")
def _nextid(emu: PveEmulator, p, who):
    if "vmid" in p:
        if p["vmid"] in emu.vms:
            raise bad_param("vmid", f"VM {p['vmid']} already exists")
        vmid = p["vmid"]
    else:
        now = time.monotonic()
        vmid = next(i for i in itertools.count(100) if i not in emu.vms or now - emu.vms[i].created_at < emu.nextid_lag)
    if emu._steal > 0:  # someone else creates it right after we answered
        emu._steal -= 1
        emu.vms[vmid] = VmState(vmid, emu.node, {"name": f"someone-else-{vmid}", "memory": 512})
    return str(vmid)  # a JSON string, although the schema says integer


def _node_entry(emu: PveEmulator, n: str) -> dict:
    if n in emu.offline_nodes:
        return {"id": f"node/{n}", "type": "node", "node": n, "status": "offline"}
    return {
        "id": f"node/{n}",
        "type": "node",
        "node": n,
        "status": "online",
        "maxcpu": emu.cpu_threads,
        "cpu": 0.02,
        "maxmem": emu.node_maxmem,
        "mem": _used_memory(emu, n),
        "uptime": 86400,
        "level": "",
    }


def _used_memory(emu: PveEmulator, node: str) -> int:
    return HOST_RESERVED + sum(memory_mib(v) * 1024 * 1024 for v in emu.vms.values() if v.node == node and v.running)


@handler("GET", "/cluster/resources")
def _resources(emu: PveEmulator, p, who):
    out = []
    if p.get("type") in (None, "vm"):
        for vm in sorted(emu.vms.values(), key=lambda v: v.vmid):
            entry = vm_summary(emu, vm)
            entry.update({"id": f"qemu/{vm.vmid}", "type": "qemu", "node": vm.node, "maxcpu": entry.pop("cpus")})
            if vm.node in emu.offline_nodes:  # the cluster knows the VM, not how it is doing
                entry["status"] = "unknown"
            out.append(entry)
    if p.get("type") in (None, "node"):
        out += [_node_entry(emu, n) for n in emu.nodes]
    if p.get("type") in (None, "storage"):
        for n in emu.nodes:
            out += [
                {
                    "id": f"storage/{n}/{st.name}",
                    "type": "storage",
                    "node": n,
                    "storage": st.name,
                    "plugintype": st.type,
                    "content": ",".join(sorted(st.content)),
                    "shared": int(st.shared),
                    "status": "available",
                }
                for st in emu.storages.values()
            ]
    return out


@handler("GET", "/nodes")
def _nodes(emu: PveEmulator, p, who):
    return [_node_entry(emu, n) for n in emu.nodes]


@handler("GET", "/nodes/{node}/status")
def _node_status(emu: PveEmulator, p, who):
    """What pve-manager's Nodes.pm answers: the fields of the version's schema, and `kversion`,
    which every version still sends (the 7.4 schema declares only "object")."""
    kernel = KERNELS[emu.version]
    used = _used_memory(emu, p["node"])
    out = {
        "uptime": 86400,
        "idle": 0,
        "wait": 0.001,
        "cpu": 0.02,
        "loadavg": ["0.10", "0.08", "0.05"],
        "kversion": f"Linux {kernel} #1 SMP PREEMPT_DYNAMIC PMX {kernel.removesuffix('-pve')} (2025-01-01T00:00Z)",
        "pveversion": f"pve-manager/{VERSIONS[emu.version]}/0a1b2c3d4e5f6a7b",
        "cpuinfo": {
            "model": emu.cpu_model,
            "sockets": emu.cpu_sockets,
            "cores": emu.cpu_cores,
            "cpus": emu.cpu_threads,
            "mhz": "2994.375",
            "hvm": "1",
            "user_hz": 100,
            "flags": emu.cpu_flags,
        },
        "memory": {"total": emu.node_maxmem, "used": used, "free": emu.node_maxmem - used},
        "swap": {"total": 8 * 1024**3, "used": 0, "free": 8 * 1024**3},
        "rootfs": {"total": 100 * 1024**3, "used": 10 * 1024**3, "avail": 90 * 1024**3, "free": 90 * 1024**3},
        "ksm": {"shared": 0},
    }
    if emu.release >= (8, 0):
        out["current-kernel"] = {
            "sysname": "Linux",
            "release": kernel,
            "machine": "x86_64",
            "version": out["kversion"].split(" ", 2)[2],
        }
        out["boot-info"] = {"mode": "efi", "secureboot": 0}
    if emu.release >= (9, 0):
        out["memory"]["available"] = emu.node_maxmem - used
    return out
