"""The bare-metal cell: the suite run on the host itself, the baseline VMs are measured against.

Only the local backend has one (its host is this machine). Beside the run's VMs it gets:
- `<workdir>/lab-<run>-bm01/` with `lease.json` (so `lab gc` finds everything below after a crash),
  and the files of its nginx (config, certificate, site) when the host has nginx;
- a network namespace `lab-<run>-bm01` whose `eth0` is one end of a veth pair plugged into the
  run's bridge: network loads take the path a VM's tap takes, minus the virtual NIC;
- a cgroup `lab-<run>-bm01` every command of the cell runs in, so its guest CPU busy % counts the
  machine-under-test side only and not the load generator, which runs on the same host
  (lab.osfacts.BARE_METAL_TICKS reads it; without cgroup support it falls back to the whole host,
  and the cell's facts say so).
Nothing is tuned: the cell measures the host as it is, and records what is in effect.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab import images, proc, tuning
from lab.errors import LabError
from lab.guest import HostGuest
from lab.model import Vm
from lab.osfacts import facts as os_facts

OS = "bare-metal"  # lab.osfacts entry of the bare-metal "guest"
ADDRESS_BASE = 250  # <subnet>.250, .251, ...: above the VMs' .10-.249
NGINX_DIRS = ("/usr/sbin", "/usr/local/sbin")


@dataclass
class BareMetal:
    vm: Vm  # what LocalBackend.destroy tears down: dir, namespace (own_netns), cgroup
    guest: HostGuest
    address: str
    facts: dict[str, Any] = field(default_factory=dict)


def cgroup_parent() -> tuple[Path, str] | None:
    """Where a CPU-accounting cgroup can be made: cgroup v2, else v1's cpuacct hierarchy."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return Path("/sys/fs/cgroup"), "cgroup v2"
    if Path("/sys/fs/cgroup/cpuacct/cpuacct.usage").exists():
        return Path("/sys/fs/cgroup/cpuacct"), "cgroup v1 cpuacct"
    return None


def create(backend, run_id: str, cell, expires_at: float, *, bridge_ns: str) -> BareMetal:
    """Make the cell's namespace, veth, cgroup and lease. On failure, what was made is removed."""
    name = f"lab-{run_id}-{cell.id}"
    vmdir = Path(backend.workdir) / name
    address = f"{backend.subnet}.{ADDRESS_BASE + cell.index - 1}"
    parent = cgroup_parent()
    cgroup = parent[0] / name if parent else None
    vmdir.mkdir(parents=True, exist_ok=False)
    lease = {"run_id": run_id, "vm": name, "netns": name, "own_netns": True, "kind": "bare-metal",
             "cgroup": str(cgroup) if cgroup else None, "expires_at": expires_at, "created_at": time.time()}
    (vmdir / "lease.json").write_text(json.dumps(lease))  # before anything else: gc can find it all
    vm = Vm(spec=None, backend=backend.name, address=address,  # type: ignore[arg-type]
            handle={"dir": str(vmdir), "netns": name, "own_netns": True,
                    "cgroup": str(cgroup) if cgroup else None})
    veth = f"v{cell.id}"  # in the run's namespace; interface names are at most 15 characters
    try:
        proc.run(["ip", "netns", "add", name], what="ip netns add (bare metal)")
        proc.run(["ip", "-n", name, "link", "set", "lo", "up"])
        proc.run(["ip", "-n", bridge_ns, "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                  "netns", name], what="veth for the bare-metal cell")
        proc.run(["ip", "-n", bridge_ns, "link", "set", veth, "master", "br0", "up"])
        proc.run(["ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0"])
        proc.run(["ip", "-n", name, "link", "set", "eth0", "up"])
        if cgroup is not None:
            cgroup.mkdir()
    except BaseException:
        backend.destroy(vm)
        raise
    env = {"LAB_CGROUP": str(cgroup) if cgroup else "", "LAB_T0": str(time.time_ns())}
    guest = HostGuest(address, netns=name, cgroup_procs=cgroup / "cgroup.procs" if cgroup else None, env=env, os=OS)
    bm = BareMetal(vm, guest, address)
    bm.facts["cpu_accounting"] = (f"{parent[1]}: the cell's own processes" if parent
                                  else "whole host (no cgroup support): includes the load generator")
    return bm


def describe(bm: BareMetal) -> dict[str, Any]:
    """What the cell ran on, read from inside its namespace (the bare-metal `verify`)."""
    f = os_facts(OS)
    out = bm.guest.run(f"echo cpus=$({f.ncpu_cmd}); echo mem=$({f.mem_kib_cmd}); uname -sr", timeout=30).stdout
    seen = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    lines = out.strip().splitlines()
    return {"vcpus": int(seen.get("cpus", "0").strip() or 0), "mem_kib": int(seen.get("mem", "0").strip() or 0),
            "kernel": lines[-1].strip() if lines else "", "nic_driver": "veth"}


def effective_tuning(bm: BareMetal) -> dict[str, Any]:
    """Nothing is applied on the host; what is in effect in the cell's namespace is recorded."""
    f = os_facts(OS)
    return {"profile": "host (unchanged)", "applicable": True, "reason": "",
            "effective": tuning.read(bm.guest, f, list(f.sysctl_watched))}


def nginx_binary() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return next((f"{d}/nginx" for d in NGINX_DIRS if os.access(f"{d}/nginx", os.X_OK)), None)


def start_nginx(bm: BareMetal, image: str) -> str | None:
    """Serve the site of `image`'s golden image from the cell's namespace, with the image's nginx
    configuration (its paths moved into the cell's directory) and a certificate of the same kind
    (self-signed RSA-4096). Returns None, or why the http/https workloads cannot run here."""
    nginx = nginx_binary()
    if nginx is None:
        return "nginx is not installed on this host (apt-get install nginx-light)"
    vmdir = Path(bm.vm.handle["dir"])
    stage = vmdir / "stage"
    try:
        images.render_stage(image, stage)
    except LabError as exc:
        return f"cannot render the site of image {image}: {exc}"
    site, key, crt = stage / "site", vmdir / "lab.key", vmdir / "lab.crt"
    conf = nginx_conf((stage / "nginx.conf").read_text(), root=site, key=key, crt=crt, rundir=vmdir)
    (vmdir / "nginx.conf").write_text(conf)
    # The same commands as the image's provisioner (packer/scripts/provision-debian.sh): the
    # certificate and the incompressible bulk files.
    script = (
        f"openssl req -x509 -newkey rsa:4096 -nodes -sha256 -days 30 -subj /CN=lab-bare-metal "
        f"-keyout {key} -out {crt} 2>/dev/null && chmod 600 {key} && mkdir -p {site}/bulk && "
        "ks() { openssl enc -aes-128-ctr -nosalt -K \"$1\" -iv 00000000000000000000000000000000 "
        "-in /dev/zero 2>/dev/null | head -c \"$2\"; } && "
        f"ks 6c61622d62756c6b2d36346d00000000 67108864 > {site}/bulk/64m.bin && "
        f"ks 6c61622d62756c6b2d316d0000000000 1048576 > {site}/bulk/1m.bin && cp {site}/bulk/1m.bin {site}/1m.bin && "
        f"chmod -R a+rX {stage}"
    )
    bm.guest.run(script, timeout=120)
    res = bm.guest.run(f"{nginx} -t -c {vmdir / 'nginx.conf'} 2>&1", timeout=30, check=False)
    if res.returncode != 0:
        return f"nginx refuses the lab's configuration: {res.stdout.strip().splitlines()[-1:] or ['?']}"
    # In the foreground, as our child: teardown (LocalBackend.destroy) stops and reaps it.
    bm.vm.handle["proc"] = proc.spawn(bm.guest.argv(f"exec {nginx} -c {vmdir / 'nginx.conf'} -g 'daemon off;'"),
                                      env=bm.guest.env)
    version = proc.run([nginx, "-v"], check=False, timeout=10)
    bm.facts["nginx"] = (version.stderr or version.stdout).strip()
    return None


def nginx_conf(text: str, *, root: Path, key: Path, crt: Path, rundir: Path) -> str:
    """Pure: the golden image's nginx.conf with its host paths moved into the cell's directory."""
    subs = {
        # workers as root: the cell's directory may sit in a workdir only root can enter
        r"^user\s+[^;]+;": "user root;",
        r"^pid\s+[^;]+;": f"pid {rundir / 'nginx.pid'};",
        r"^error_log\s+\S+": f"error_log {rundir / 'error.log'}",
        r"^(\s*)root\s+[^;]+;": rf"\g<1>root {root};",
        r"^(\s*)ssl_certificate\s+[^;]+;": rf"\g<1>ssl_certificate {crt};",
        r"^(\s*)ssl_certificate_key\s+[^;]+;": rf"\g<1>ssl_certificate_key {key};",
    }
    for pattern, repl in subs.items():
        text, n = re.subn(pattern, repl, text, count=1, flags=re.M)
        if n != 1:
            raise LabError(f"bare metal: the image's nginx.conf has no line matching {pattern!r}",
                           hint="templates/nginx.conf.j2 changed; update lab.baremetal.nginx_conf")
    return text
