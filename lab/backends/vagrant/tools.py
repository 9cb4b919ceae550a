"""The two command-line tools the vagrant backend drives through lab.proc: `vagrant` (up, destroy,
boxes, the machine index) and `virsh` (what vagrant-libvirt made in libvirt: domains, volumes,
networks). Parsers are pure and tested on captured output."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from lab import proc
from lab.errors import LabError
from lab.wait import wait_until

DESC_WAIT_S = 180  # a libvirtd re-probing QEMU (tens of seconds here) or a domain lock held that long

# -- vagrant ------------------------------------------------------------------------------------------


def machine_readable(text: str) -> list[list[str]]:
    """`vagrant ... --machine-readable` lines -> [target, type, data...] (the timestamp dropped,
    Vagrant's escapes undone: a comma in data is written %!(VAGRANT_COMMA), newlines \\n)."""
    rows = []
    for line in text.splitlines():
        parts = line.split(",")
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        rows.append([p.replace("%!(VAGRANT_COMMA)", ",").replace("\\n", "\n").replace("\\r", "\r") for p in parts[1:]])
    return rows


def parse_box_list(text: str) -> list[tuple[str, str, str]]:
    """`vagrant box list --machine-readable` -> [(name, provider, version)]."""
    out: list[tuple[str, str, str]] = []
    current: dict[str, str] = {}
    for row in machine_readable(text):
        if len(row) < 3 or row[1] not in ("box-name", "box-provider", "box-version"):
            continue
        if row[1] == "box-name":
            current = {}
        current[row[1]] = row[2]
        if row[1] == "box-version" and "box-name" in current:
            out.append((current["box-name"], current.get("box-provider", ""), row[2]))
    return out


@dataclass(frozen=True)
class IndexEntry:
    """One machine in Vagrant's machine index (`vagrant global-status`)."""

    id: str
    name: str
    provider: str
    state: str
    directory: str


def parse_global_status(text: str) -> list[IndexEntry]:
    """`vagrant global-status --machine-readable`: per machine, targeted at its name, the rows
    machine-id, provider-name, machine-home, state (vagrant's global-status command)."""
    out: list[IndexEntry] = []
    cur: dict[str, str] = {}

    def flush() -> None:
        if "machine-id" in cur:
            out.append(
                IndexEntry(
                    cur["machine-id"],
                    cur.get("name", ""),
                    cur.get("provider-name", ""),
                    cur.get("state", ""),
                    cur.get("machine-home", ""),
                )
            )

    for row in machine_readable(text):
        if len(row) < 3 or row[1] not in ("machine-id", "provider-name", "machine-home", "state"):
            continue
        if row[1] == "machine-id":
            flush()
            cur = {"name": row[0]}
        cur[row[1]] = row[2]
    flush()
    return out


def parse_plugins(text: str) -> dict[str, str]:
    """`vagrant plugin list --machine-readable` -> {plugin: version} (a row "NAME,plugin-version,
    VERSION, system" for Debian's packaged plugins)."""
    return {
        row[0]: row[2].split(",")[0].strip()
        for row in machine_readable(text)
        if len(row) >= 3 and row[1] == "plugin-version" and row[0]
    }


class Vagrant:
    """`vagrant` with the lab's environment: no update checks, the libvirt provider, this host's
    libvirt URI and Vagrant home."""

    def __init__(self, *, home: str | None = None, uri: str | None = None):
        self.home, self.uri = home, uri

    def env(self) -> dict[str, str]:
        env = {"VAGRANT_CHECKPOINT_DISABLE": "1", "VAGRANT_DEFAULT_PROVIDER": "libvirt", "VAGRANT_NO_COLOR": "1"}
        if self.home:
            env["VAGRANT_HOME"] = self.home
        if self.uri:
            env["LIBVIRT_DEFAULT_URI"] = self.uri
        return env

    def run(
        self, args: list[str], *, timeout: float, what: str, cwd: str | os.PathLike | None = None, check: bool = True
    ) -> proc.Result:
        return proc.run(["vagrant", *args], timeout=timeout, what=what, cwd=cwd, env=self.env(), check=check)

    def version(self) -> str:
        out = self.run(["--version"], timeout=60, what="vagrant --version").stdout.strip()
        return out.removeprefix("Vagrant ").strip()

    def plugins(self) -> dict[str, str]:
        return parse_plugins(
            self.run(["plugin", "list", "--machine-readable"], timeout=60, what="vagrant plugin list").stdout
        )

    def boxes(self) -> list[tuple[str, str, str]]:
        return parse_box_list(
            self.run(["box", "list", "--machine-readable"], timeout=60, what="vagrant box list").stdout
        )

    def global_status(self) -> list[IndexEntry]:
        """The machine index, pruned of machines whose directory or domain is gone."""
        return parse_global_status(
            self.run(
                ["global-status", "--prune", "--machine-readable"], timeout=120, what="vagrant global-status"
            ).stdout
        )


# -- virsh --------------------------------------------------------------------------------------------


def parse_domifaddr(text: str) -> str:
    """The first IPv4 address in `virsh domifaddr` output ("" if none yet)."""
    m = re.search(r"\bipv4\s+(\d+\.\d+\.\d+\.\d+)/\d+", text)
    return m.group(1) if m else ""


def parse_vol_list(text: str) -> list[tuple[str, str]]:
    """`virsh vol-list POOL` -> [(name, path)]."""
    out = []
    for line in text.splitlines()[2:]:
        parts = line.split(None, 1)
        if len(parts) == 2:
            out.append((parts[0], parts[1].strip()))
    return out


class Virsh:
    def __init__(self, uri: str):
        self.uri = uri

    def run(
        self, args: list[str], *, what: str, check: bool = True, timeout: float = 60, input: str | None = None
    ) -> proc.Result:
        return proc.run(["virsh", "-q", "-c", self.uri, *args], timeout=timeout, what=what, check=check, input=input)

    def domains(self) -> list[str]:
        return self.run(["list", "--all", "--name"], what="virsh list").stdout.split()

    def description(self, name: str) -> str | None:
        """The domain's <description>; None when libvirt says there is no such domain. Any other
        failure (libvirtd gone, a state-change lock held by a `vagrant up` still running) is not
        "gone": it is asked again for up to DESC_WAIT_S, then raised (gc once took such a failure
        for a removed domain and reported it removed)."""
        last = [""]

        def ask() -> tuple[str | None] | None:
            res = self.run(["desc", name], what="virsh desc", check=False)
            if res.ok:
                return (res.stdout.strip(),)
            if f"failed to get domain '{name}'" in res.stderr or "Domain not found" in res.stderr:
                return (None,)
            last[0] = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"
            return None

        return wait_until(
            ask, timeout=DESC_WAIT_S, what=f"virsh desc {name}", interval=1, max_interval=5, detail=lambda: last[0]
        )[0]

    def set_description(self, name: str, text: str) -> bool:
        """Replace the domain's <description> (live and persistent; persistent only while it is shut
        off). False when there is no such domain (yet); LabError when libvirt refuses."""
        said = ""
        for flags in (["--live", "--config"], ["--config"]):
            res = self.run(["desc", name, *flags, "--new-desc", text], what="virsh desc --new-desc", check=False)
            if res.ok:
                return True
            if f"failed to get domain '{name}'" in res.stderr or "Domain not found" in res.stderr:
                return False
            said = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"
        raise LabError(f"cannot set the description of domain {name}: {said}")

    def address(self, name: str) -> str:
        """The guest's IPv4 address from the libvirt network's DHCP lease ("" if none yet)."""
        res = self.run(["domifaddr", name, "--source", "lease"], what="virsh domifaddr", check=False)
        return parse_domifaddr(res.stdout) if res.ok else ""

    def remove_domain(self, name: str) -> None:
        """Power off and undefine (idempotent: a domain that is gone is fine)."""
        if self.description(name) is None:
            return
        self.run(["destroy", name], what="virsh destroy", check=False)
        res = self.run(["undefine", name, "--nvram"], what="virsh undefine", check=False)
        if not res.ok:
            res = self.run(["undefine", name], what="virsh undefine", check=False)
        if not res.ok and self.description(name) is not None:
            raise LabError(f"cannot undefine domain {name}: {(res.stderr or res.stdout).strip()}")

    def volumes(self, pool: str) -> list[tuple[str, str]]:
        res = self.run(["vol-list", pool], what="virsh vol-list", check=False)
        return parse_vol_list("\n\n" + res.stdout) if res.ok else []  # -q drops the two header lines

    def remove_volume(self, pool: str, name: str) -> None:
        if name not in {n for n, _ in self.volumes(pool)}:
            return
        self.run(["vol-delete", name, "--pool", pool], what="virsh vol-delete")

    def networks(self) -> list[str]:
        return self.run(["net-list", "--all", "--name"], what="virsh net-list").stdout.split()

    def create_network(self, xml: str, path: Path) -> None:
        """A transient network from `xml` (written to `path` for virsh and for whoever looks)."""
        path.write_text(xml)
        self.run(["net-create", str(path)], what="virsh net-create")

    def remove_network(self, name: str) -> None:
        if name not in self.networks():
            return
        self.run(["net-destroy", name], what="virsh net-destroy", check=False)
        if name in self.networks():  # a persistent one: undefine it too
            self.run(["net-undefine", name], what="virsh net-undefine")
