"""Containers in the guest, per OS: podman on Linux, jails on FreeBSD. Part of the workload toolkit
(no workload registers here), shared by git-clone, podman-build, container-start and bulk-http: pure
command generation, and the two steps that run in the guest, `prepare_places` and `lro_setting`.

Where a load runs ("network" in the workloads' params):

  guest    on the guest itself, no container
  default  in a container on the engine's default network: podman's bridge with NAT (netavark);
           on FreeBSD a vnet jail behind pf NAT on an epair, the shape of podman's FreeBSD network
  host     in a container sharing the guest's network stack: `podman run --network=host`;
           on FreeBSD a jail with ip4=inherit
  none     podman `--network=none` (container-start only)

FreeBSD: jails live under JAIL_ROOT, a FreeBSD userland with git, nginx and the lab's files that the
FreeBSD golden image must provide (images/README.md); `jail_setup_script` makes the two jails
(idempotent), `lro_script` turns LRO on/off on the guest's uplink (the study: LRO left on while
routing to a jail made git clone crawl at 32 kbit/s).
"""

from __future__ import annotations

import re
import shlex

from lab import osfacts
from lab.errors import LabError, UsageError
from lab.workloads import WorkloadContext
from lab.workloads.toolkit import choices, first_line, require_guest_tool

BASE_IMAGE = "localhost/lab-base:latest"  # lab.images.DEBIAN12.container.name (a test keeps them equal)
CACHE_DIR = "/var/cache/lab-debs"  # the .debs a Containerfile installs offline (Debian base image)
JAIL_ROOT = "/lab/jail"
JAILS = {"default": "labvnet", "host": "labhost"}
JAIL_NET = "10.88.0"  # the vnet jail's epair: guest side .1, jail .2
JAIL_HTTP_PORT = 8080  # pf rdr from the guest's uplink to nginx in the vnet jail
TIMER = "/usr/bin/time -p"  # POSIX format on every OS ("real 1.23"); Debian: package `time`
PLACES = ("guest", "default", "host")
LRO = ("as-is", "on", "off")


def family(os_name: str) -> str:
    return osfacts.facts(os_name).family


def engine(os_name: str) -> str:
    """What runs a container on this OS: "podman" (Linux) or "jail" (FreeBSD)."""
    fam = family(os_name)
    if fam == "linux":
        return "podman"
    if fam == "freebsd":
        return "jail"
    raise UsageError(f"containers on {os_name} are not supported (Linux: podman; FreeBSD: jails)")


def podman_run(
    network: str = "default",
    *,
    runtime: str | None = None,
    transient: bool = False,
    image: str = BASE_IMAGE,
    options: tuple[str, ...] = (),
) -> list[str]:
    """`podman run --rm ...` up to the image; "default" passes no --network (what a user gets)."""
    argv = ["podman"]
    if transient:
        argv.append("--transient-store")
    argv += ["run", "--rm"]
    if runtime:
        argv.append(f"--runtime={runtime}")
    if network != "default":
        argv.append(f"--network={network}")
    return argv + list(options) + [image]


def place_prefix(os_name: str, place: str) -> str:
    """Command prefix that runs a following `sh -c '...'` in `place` ("" for the guest itself)."""
    if place == "guest":
        return ""
    if place not in ("default", "host"):
        raise UsageError(f"unknown place {place!r}; known: {', '.join(PLACES)}")
    if engine(os_name) == "podman":
        return shlex.join(podman_run(place)) + " "
    return f"jexec {JAILS[place]} "


def uplink_command(os_name: str) -> str:
    """Prints the guest's uplink interface (the one with the default route)."""
    if family(os_name) == "linux":
        return "ip route show default | awk '{for (i = 1; i < NF; i++) if ($i == \"dev\") print $(i + 1)}' | head -n1"
    return "route -n get default | awk '/interface:/ {print $2}'"


def jail_setup_script(
    place: str, *, root: str = JAIL_ROOT, net: str = JAIL_NET, http_port: int = JAIL_HTTP_PORT
) -> str:
    """FreeBSD: create the jail for `place` unless it exists. "default": a vnet jail on an epair,
    `net`.2 inside, `net`.1 on the guest side, forwarded and NATed by pf out of the uplink, with
    `http_port` on the uplink redirected to port 80 in the jail. "host": ip4=inherit."""
    name = JAILS[place]
    head = (
        f"jls -j {name} >/dev/null 2>&1 && exit 0; test -x {root}/usr/local/bin/git || "
        f"{{ echo 'no jail userland with git at {root}' >&2; exit 3; }}; "
    )
    if place == "host":
        return head + (
            f"jail -c name={name} path={root} host.hostname={name} ip4=inherit ip6=inherit "
            "allow.raw_sockets mount.devfs persist"
        )
    rules = (
        f"nat on $up inet from {net}.0/24 to any -> ($up)\\n"
        f"rdr on $up inet proto tcp from any to ($up) port {http_port} -> {net}.2 port 80\\n"
    )
    return head + (
        "kldload -n pf if_epair; "
        f"up=$({uplink_command('freebsd')}); "
        "a=$(ifconfig epair create) && b=${a%a}b && "
        f"ifconfig $a inet {net}.1/24 up && "
        f"jail -c name={name} path={root} host.hostname={name} vnet vnet.interface=$b "
        "allow.raw_sockets mount.devfs persist && "
        f"jexec {name} ifconfig $b inet {net}.2/24 up && jexec {name} ifconfig lo0 inet 127.0.0.1/8 up && "
        f"jexec {name} route -q add default {net}.1 && "
        "sysctl -q net.inet.ip.forwarding=1 && "
        f'printf "{rules}" | pfctl -q -f - && {{ pfctl -q -e 2>/dev/null || true; }}'
    )


def lro_script(os_name: str, setting: str) -> str:
    """Turn LRO on the uplink on/off ("as-is": leave it) and print `lro=<on|off|unknown>` read back."""
    if setting not in LRO:
        raise UsageError(f"lro must be one of {', '.join(LRO)}, got {setting!r}")
    fam = family(os_name)
    up = f"up=$({uplink_command(os_name)}); "
    if fam == "linux":
        change = "" if setting == "as-is" else f"ethtool -K $up lro {setting} 2>/dev/null; "
        read = "s=$(ethtool -k $up 2>/dev/null | awk '/^large-receive-offload:/ {print $2}'); echo lro=${s:-unknown}"
    elif fam in ("freebsd", "netbsd", "openbsd"):
        flag = {"on": "lro", "off": "-lro"}.get(setting)
        change = f"ifconfig $up {flag}; " if flag else ""
        read = "if ifconfig $up | grep -q '[<,]LRO[,>]'; then echo lro=on; else echo lro=off; fi"
    else:
        raise UsageError(f"lro: no way to set it on {os_name}")
    return up + change + read


def parse_lro(text: str) -> str:
    m = re.search(r"^lro=(on|off|unknown)\s*$", text or "", re.MULTILINE)
    return m.group(1) if m else "unknown"


def parse_time_p(text: str, what: str) -> float:
    """Seconds from POSIX `time -p` output ("real 1.23"; the last one if there are several)."""
    found = re.findall(r"^real\s+([0-9]+(?:[.,][0-9]+)?)\s*$", text or "", re.MULTILINE)
    if not found:
        raise LabError(
            f"{what}: no 'real <seconds>' line from `time -p`; first line of output: "
            f"{next((ln for ln in (text or '').splitlines() if ln.strip()), '(no output)')!r}",
            hint="the raw output is stored; fix the parser and run `lab reparse`",
        )
    return float(found[-1].replace(",", "."))


def check_places(workload: str, places, os_name: str | None = None, allowed: tuple[str, ...] = PLACES) -> list[str]:
    items = choices(workload, "network", places, allowed)
    if os_name is not None and any(p != "guest" for p in items):
        engine(os_name)
    return items


# ---------------------------------------------------------------------------------------------
# In the guest: making the places ready, LRO for the length of a load


def prepare_places(ctx: WorkloadContext, workload: str, places: list[str]) -> None:
    """What the places need in the guest: `time`, and podman with the base image (Linux) or the
    jails (FreeBSD, made here unless they exist)."""
    res = ctx.guest.run(f"test -x {TIMER.split()[0]}", timeout=30, check=False)
    if res.returncode != 0:
        raise LabError(
            f"{workload}: {TIMER.split()[0]} is not in the guest ({ctx.os})",
            hint="add the `time` package to the golden image",
        )
    if all(p == "guest" for p in places):
        return
    if engine(ctx.os) == "podman":
        require_guest_tool(ctx, "podman", workload)
        res = ctx.guest.run(f"podman image exists {BASE_IMAGE}", timeout=120, check=False)
        if res.returncode != 0:
            raise LabError(
                f"{workload}: the guest has no {BASE_IMAGE} in podman's store",
                hint="rebuild the golden image (`make images`): provisioning imports it",
            )
        return
    for place in places:
        if place != "guest":
            res = ctx.guest.run("sh -c " + shlex.quote(jail_setup_script(place)), timeout=120, check=False)
            if res.returncode != 0:
                raise LabError(
                    f"{workload}: could not make the {place!r} jail: {first_line(res.stderr or res.stdout)}",
                    hint=f"the FreeBSD image must provide a userland with git at {JAIL_ROOT}",
                )


class lro_setting:
    """Set LRO on the guest's uplink for the block and put the previous state back after."""

    def __init__(self, ctx: WorkloadContext, setting: str):
        self.ctx, self.setting = ctx, setting
        self.state = {"before": "unknown", "effective": "unknown"}

    def _apply(self, setting: str) -> str:
        res = self.ctx.guest.run("sh -c " + shlex.quote(lro_script(self.ctx.os, setting)), timeout=60, check=False)
        return parse_lro(res.stdout)

    def __enter__(self) -> dict[str, str]:
        self.state["before"] = self._apply("as-is")
        if self.setting == "as-is":
            self.state["effective"] = self.state["before"]
        else:
            self.state["effective"] = self._apply(self.setting)
            if self.state["effective"] != self.setting:
                raise LabError(
                    f"lro: asked for {self.setting}, the uplink reports {self.state['effective']}",
                    hint="the NIC or its driver cannot change LRO; drop that lro setting",
                )
        return self.state

    def __exit__(self, *exc) -> None:
        if (
            self.setting != "as-is"
            and self.state["before"] in ("on", "off")
            and self.state["before"] != self.state["effective"]
        ):
            self._apply(self.state["before"])
