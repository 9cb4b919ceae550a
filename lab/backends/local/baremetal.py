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
LocalBackend.destroy removes it like a VM (host.remove_machine).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab import images, proc, tuning
from lab.backends.local import host, layout
from lab.errors import LabError, TimeoutError_
from lab.guest import HostGuest
from lab.model import Client, Vm
from lab.osfacts import facts as os_facts
from lab.wait import wait_until

OS = "bare-metal"  # lab.osfacts entry of the bare-metal "guest"
ADDRESS_BASE = 250  # <subnet>.250, .251, ...: above the VMs' .10-.249
NGINX_DIRS = ("/usr/sbin", "/usr/local/sbin")


@dataclass
class BareMetal:
    """The host as a cell (lab.backends.base.BareMetalHost)."""

    vm: Vm  # what LocalBackend.destroy tears down: dir, namespace (own_netns), cgroup, nginx (proc)
    guest: HostGuest
    address: str
    facts: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """What the cell runs on, read from inside its namespace (the bare-metal `verify`)."""
        f = os_facts(OS)
        out = self.guest.run(f"echo cpus=$({f.ncpu_cmd}); echo mem=$({f.mem_kib_cmd}); uname -sr", timeout=30).stdout
        return parse_describe(out)

    def effective_tuning(self) -> dict[str, Any]:
        """Nothing is applied on the host; what is in effect in the cell's namespace is recorded."""
        f = os_facts(OS)
        return {
            "profile": "host (unchanged)",
            "applicable": True,
            "reason": "",
            "effective": tuning.read(self.guest, f, list(f.sysctl_watched)),
        }

    def start_web(self, image: str) -> str | None:
        """Serve the site of `image`'s golden image from the cell's namespace, with the image's nginx
        configuration (its paths moved into the cell's directory) and a certificate of the same kind
        (self-signed RSA-4096). Returns None, or why the http/https workloads cannot run here."""
        nginx = nginx_binary()
        if nginx is None:
            return "nginx is not installed on this host (apt-get install nginx-light)"
        vmdir = Path(self.vm.handle["dir"])
        stage = vmdir / "stage"
        try:
            images.render_stage(image, stage)
        except LabError as exc:
            return f"cannot render the site of image {image}: {exc}"
        site, key, crt, conf = stage / "site", vmdir / "lab.key", vmdir / "lab.crt", vmdir / "nginx.conf"
        conf.write_text(nginx_conf((stage / "nginx.conf").read_text(), root=site, key=key, crt=crt, rundir=vmdir))
        self.guest.run(site_script(stage=stage, site=site, key=key, crt=crt), timeout=120)
        res = self.guest.run(f"{shlex.quote(nginx)} -t -c {shlex.quote(str(conf))} 2>&1", timeout=30, check=False)
        if res.returncode != 0:
            return f"nginx refuses the lab's configuration: {res.stdout.strip().splitlines()[-1:] or ['?']}"
        # In the foreground, as our child: teardown (host.remove_machine) stops and reaps it.
        self.vm.handle["proc"] = proc.spawn(
            self.guest.argv(f"exec {shlex.quote(nginx)} -c {shlex.quote(str(conf))} -g 'daemon off;'"),
            env=self.guest.env,
        )
        # Ready means its master has bound the ports and written its pid file (or it has died).
        nginx_proc, pidfile = self.vm.handle["proc"], vmdir / "nginx.pid"
        try:
            wait_until(
                lambda: pidfile.exists() or nginx_proc.poll() is not None,
                timeout=60,
                what="the bare-metal cell's nginx to write its pid file",
            )
        except TimeoutError_ as exc:
            return f"nginx did not start: {exc}"
        if nginx_proc.poll() is not None:
            return f"nginx exited with status {nginx_proc.returncode} at start (see {vmdir / 'error.log'})"
        version = proc.run([nginx, "-v"], check=False, timeout=10)
        self.facts["nginx"] = (version.stderr or version.stdout).strip()
        return None


def create(
    *,
    workdir: Path,
    subnet: str,
    backend: str,
    run_id: str,
    cell_id: str,
    index: int,
    expires_at: float,
    bridge_ns: str,
) -> BareMetal:
    """Make the cell's lease, namespace, veth and cgroup. On failure, what was made is removed."""
    name = f"lab-{run_id}-{cell_id}"
    vmdir = workdir / name
    address = f"{subnet}.{ADDRESS_BASE + index - 1}"
    parent = host.cgroup_parent()
    cgroup = parent[0] / name if parent else None
    vmdir.mkdir(parents=True, exist_ok=False)
    layout.write_lease(
        vmdir,
        {
            "run_id": run_id,
            "vm": name,
            "netns": name,
            "own_netns": True,
            "kind": "bare-metal",
            "cgroup": str(cgroup) if cgroup else None,
            "expires_at": expires_at,
            "created_at": time.time(),
        },
    )  # before anything else: gc can find it all
    vm = Vm(
        spec=None,  # type: ignore[arg-type]  # no VmSpec: not a VM
        backend=backend,
        address=address,
        handle={"dir": str(vmdir), "netns": name, "own_netns": True, "cgroup": str(cgroup) if cgroup else None},
        control_dir=vmdir,
    )
    veth = f"v{cell_id}"  # in the run's namespace; interface names are at most 15 characters
    vm.handle.update({"veth": veth, "veth_netns": bridge_ns})
    try:
        host.run_all(host.veth_netns_argvs(name, bridge_ns, veth, address), what="the bare-metal cell's network")
        if cgroup is not None:
            cgroup.mkdir()
    except BaseException:
        host.remove_machine(vm.handle, name)
        raise
    # LAB_SCRATCH: where the cell's workloads make their scratch directories (mktemp -d), instead of
    # this machine's /var/tmp: the cell's own directory, private to root, removed with the cell
    env = {"LAB_CGROUP": str(cgroup) if cgroup else "", "LAB_T0": str(time.time_ns()), "LAB_SCRATCH": str(vmdir)}
    guest = HostGuest(address, netns=name, cgroup_procs=cgroup / "cgroup.procs" if cgroup else None, env=env, os=OS)
    bm = BareMetal(vm, guest, address)
    bm.facts["cpu_accounting"] = (
        f"{parent[1]}: the cell's own processes"
        if parent
        else "whole host (no cgroup support): includes the load generator"
    )
    return bm


def parse_describe(out: str) -> dict[str, Any]:
    """Pure: `cpus=N`, `mem=KiB` and `uname -sr` lines -> the cell's `verified` facts."""
    seen = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    lines = out.strip().splitlines()
    return {
        "vcpus": int(seen.get("cpus", "0").strip() or 0),
        "mem_kib": int(seen.get("mem", "0").strip() or 0),
        "kernel": lines[-1].strip() if lines else "",
        "nic_driver": "veth",
    }


def nginx_binary() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return next((f"{d}/nginx" for d in NGINX_DIRS if os.access(f"{d}/nginx", os.X_OK)), None)


def site_script(*, stage: Path, site: Path, key: Path, crt: Path) -> str:
    """Pure: the shell commands of the image's provisioner (packer/scripts/provision-debian.sh) that
    make the certificate and the incompressible bulk files, for a site at `site`. Every path is
    quoted: the workdir is the user's choice."""
    q = {
        k: shlex.quote(str(v))
        for k, v in {
            "stage": stage,
            "key": key,
            "crt": crt,
            "bulk": site / "bulk",
            "big": site / "bulk" / "64m.bin",
            "small": site / "bulk" / "1m.bin",
            "top": site / "1m.bin",
        }.items()
    }
    return (
        f"openssl req -x509 -newkey rsa:4096 -nodes -sha256 -days 30 -subj /CN=lab-bare-metal "
        f"-keyout {q['key']} -out {q['crt']} 2>/dev/null && chmod 600 {q['key']} && mkdir -p {q['bulk']} && "
        'ks() { openssl enc -aes-128-ctr -nosalt -K "$1" -iv 00000000000000000000000000000000 '
        '-in /dev/zero 2>/dev/null | head -c "$2"; } && '
        f"ks 6c61622d62756c6b2d36346d00000000 67108864 > {q['big']} && "
        f"ks 6c61622d62756c6b2d316d0000000000 1048576 > {q['small']} && cp {q['small']} {q['top']} && "
        f"chmod -R a+rX {q['stage']}"
    )


def nginx_conf(text: str, *, root: Path, key: Path, crt: Path, rundir: Path) -> str:
    """Pure: the golden image's nginx.conf with its host paths moved into the cell's directory.
    Each path is one quoted nginx argument, so a workdir with spaces or semicolons stays one."""
    subs = {
        # workers as root: the cell's directory may sit in a workdir only root can enter
        r"^user\s+[^;]+;": "user root;",
        r"^pid\s+[^;]+;": f"pid {nginx_quote(rundir / 'nginx.pid')};",
        r"^error_log\s+\S+": f"error_log {nginx_quote(rundir / 'error.log')}",
        r"^(\s*)root\s+[^;]+;": f"root {nginx_quote(root)};",
        r"^(\s*)ssl_certificate\s+[^;]+;": f"ssl_certificate {nginx_quote(crt)};",
        r"^(\s*)ssl_certificate_key\s+[^;]+;": f"ssl_certificate_key {nginx_quote(key)};",
    }
    for pattern, line in subs.items():
        # a function, not a template: a path's backslashes stay as they are; the indent is kept
        def keep_indent(m: re.Match[str], line: str = line) -> str:
            return (m.group(1) if m.re.groups else "") + line

        text, n = re.subn(pattern, keep_indent, text, count=1, flags=re.M)
        if n != 1:
            raise LabError(
                f"bare metal: the image's nginx.conf has no line matching {pattern!r}",
                hint="templates/nginx.conf.j2 changed; update lab.backends.local.baremetal.nginx_conf",
            )
    return text


def nginx_quote(path: Path) -> str:
    """Pure: a path as one nginx configuration argument (double-quoted, \\ and " escaped)."""
    return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'


class BareMetalCells:
    """The local host's BareMetalCells part (lab.backends.base): this machine as a cell, on the
    run's bridge."""

    def __init__(self, backend: str, workdir: Path, subnet: str):
        self.backend, self.workdir, self.subnet = backend, workdir, subnet

    def make(self, run_id: str, cell_id: str, index: int, expires_at: float, client: Client) -> BareMetal:
        return create(
            workdir=self.workdir,
            subnet=self.subnet,
            backend=self.backend,
            run_id=run_id,
            cell_id=cell_id,
            index=index,
            expires_at=expires_at,
            bridge_ns=client.netns or layout.netns_name(run_id),
        )
