"""`lab reproduce RUN CELL`: the machine a stored cell measured, as a Vagrantfile anyone can
`vagrant up` on a Vagrant host with vagrant-libvirt, to look at it by hand.

A results store is never trusted (it travels between people; lab.programs): every value of it
these files carry is first checked to be what lab would have written (`check_stored`: names by
lab.names, axes by their enums and ranges, profiles by the lab's own lists; one line naming the
store, the cell, the key and the value, exit 2, nothing written), then written escaped: Ruby
strings (ruby_string), shell words (shlex), comments folded to one line without control
characters (lab.plaintext). The workload commands in workloads.sh are the one exception by
nature, shell command lines the store recorded: each is one quoted argument of `sh -c`, shown
before it runs, and runs only in the reproduction's guest, only when asked for by name.

Written into one directory:
- `Vagrantfile` (templates/vagrant/Vagrantfile.j2, the vagrant backend's own template): the box
  version of the exact image build the cell ran (`lab images publish IMAGE HOST` adds it), the
  cell's NIC model, vCPUs, memory and disk bus, the accelerator it ran under;
- `tune.sh`, run by `vagrant up`: the cell's tuning profile, congestion control, offloads and WAN
  emulation, applied with the guest OS's own commands from lab.osfacts (as lab's tune stage does),
  then read back; the values lab read back in the cell are in its comments;
- `workloads.sh`, run only when asked (`vagrant provision --provision-with workloads`): the commands
  each workload ran in the cell, as the results store keeps them with their raw output.
"""

from __future__ import annotations

import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab import images, isolation, names, osfacts, outfiles, plaintext, tuning
from lab.backends.vagrant import box
from lab.backends.vagrant.vagrantfile import Machine, Network, Provisioner, render
from lab.errors import UsageError
from lab.model import DiskBus, NicModel, Runtime
from lab.store import CellRow, Store
from lab.wan import WanProfile, netem_args

# Load generators lab runs on its own side of the link (wrk, curl, scp): in a reproduction they
# are the user's to run from the Vagrant host, so workloads.sh lists them without running them.
CLIENT_SIDE = ("wrk", "curl", "scp", "ssh")
FILES = ("Vagrantfile", "tune.sh", "workloads.sh")  # what `reproduce` writes into its directory


@dataclass(frozen=True)
class Reproduction:
    dir: Path
    vagrantfile: Path
    machine: Machine


def find_cell(store: Store, run_ref: str, cell_id: str) -> tuple[str, CellRow]:
    run = store.run(run_ref)
    cells = store.cells(run.id)
    for cell in cells:
        if cell.cell_id == cell_id:
            if cell.axes.get("kind") == "bare-metal":
                raise UsageError(
                    f"cell {cell_id} of run {run.id} ran on the host itself: there is no machine to reproduce"
                )
            if cell.axes.get("isolation") == "zone":  # a Vagrant VM of the golden image would not be it
                raise UsageError(
                    f"cell {cell_id} of run {run.id} ran in a SmartOS zone of the image "
                    f"{cell.facts.get('zone_image') or '?'}, not a VM of the lab's image: there is no VM to reproduce"
                )
            return run.id, cell
    raise UsageError(f"run {run.id} has no cell {cell_id!r}; its cells: {', '.join(c.cell_id for c in cells)}")


def image_build(store: Store, run_id: str, cell: CellRow) -> tuple[str, str, str]:
    """(image name, recipe digest, disk sha256) the cell ran: its facts, else the run's manifest."""
    name = str(cell.axes.get("image", ""))
    seen = store.run(run_id).manifest.get("images", {}).get(name, {})
    digest = cell.facts.get("image_digest") or seen.get("digest", "")
    sha = cell.facts.get("image_sha256") or seen.get("sha256", "")
    if not (name and digest and sha):
        raise UsageError(f"cell {cell.cell_id} of run {run_id} does not record its image build (name, digest, sha256)")
    return name, digest, sha


def check_stored(store: Store, run_id: str, cell: CellRow) -> None:
    """Refuse (UsageError naming the store, run, cell, key and value) any value the reproduction
    uses that lab would not have stored."""
    axes = cell.axes

    def refuse(key: str, value: object, why: str) -> UsageError:
        return UsageError(f"{store.path}: run {run_id} cell {cell.cell_id}: {key} = {value!r}: {why} (not trusted)")

    for key, value, kind in (("run", run_id, names.STORED_RUN_ID), ("cell", cell.cell_id, names.CELL_ID)):
        if kind.problem(value):
            raise refuse(key, value, str(kind.problem(value)))
    for key, enum, default in (("nic", NicModel, None), ("disk_bus", DiskBus, "virtio")):
        choice = axes.get(key, default)
        if choice not in {e.value for e in enum}:
            raise refuse(f"axes.{key}", choice, f"not one of {', '.join(e.value for e in enum)}")
    for key, top in (("vcpus", 1024), ("memory_mib", 16 * 1024 * 1024)):
        number = axes.get(key)
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= top:
            raise refuse(f"axes.{key}", number, f"not a whole number from 1 to {top}")
    if axes.get("image") not in images.RECIPES:
        raise refuse("axes.image", axes.get("image"), f"not an image lab builds ({', '.join(sorted(images.RECIPES))})")
    if str(axes.get("tuning", "default")) not in tuning.profiles():
        raise refuse("axes.tuning", axes.get("tuning"), "not a tuning profile of this lab")
    cc = axes.get("cc", "default")
    if cc != "default" and names.CC.problem(cc):
        raise refuse("axes.cc", cc, str(names.CC.problem(cc)))
    try:
        tuning.parse_offloads(str(axes.get("offloads", "default")))
    except ValueError as exc:
        raise refuse("axes.offloads", axes.get("offloads"), str(exc)) from None
    wan = axes.get("wan", "none")
    if wan != "none" and names.PROFILE.problem(wan):
        raise refuse("axes.wan", wan, str(names.PROFILE.problem(wan)))
    box = cell.facts.get("isolation") or {}
    if box and (box.get("runtime") or Runtime.PODMAN) not in {r.value for r in Runtime}:
        raise refuse("facts.isolation.runtime", box.get("runtime"), f"not one of {', '.join(r.value for r in Runtime)}")
    for key in ("image_digest", "image_sha256"):
        digest = cell.facts.get(key)
        if digest is not None and names.DIGEST.problem(digest):
            raise refuse(f"facts.{key}", digest, str(names.DIGEST.problem(digest)))


def stored_wan(store: Store, run_id: str, cell: CellRow) -> WanProfile | None:
    """The cell's [wan.NAME] profile, from the lab.toml text the run stored (None: no WAN emulation)."""
    name = str(cell.axes.get("wan", "none"))
    if name == "none":
        return None
    try:
        table = tomllib.loads(store.config_text(run_id) or "").get("wan", {}).get(name)
        return WanProfile(**table) if isinstance(table, dict) else None
    except (tomllib.TOMLDecodeError, ValueError, TypeError) as exc:  # pydantic's errors are ValueErrors
        reason = plaintext.one_line(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise UsageError(f"{store.path}: run {run_id}: its lab.toml's [wan.{name}] is not usable: {reason}") from None


def tune_script(os_name: str, cell: CellRow, wan: WanProfile | None) -> str:
    """The cell's tune stage as a shell script of the guest OS's own commands (lab.osfacts), each
    knob as lab applies it; the values lab read back in the cell are listed in comments."""
    facts = osfacts.facts(os_name)
    axes, recorded = cell.axes, cell.facts.get("tuning", {})
    profile, cc = str(axes.get("tuning", "default")), str(axes.get("cc", "default"))
    offloads = tuning.parse_offloads(str(axes.get("offloads", "default")))
    dev = facts.device(NicModel(axes["nic"]))
    lines = [
        "#!/bin/sh",
        f"# The tune stage of cell {cell.cell_id} ({_c(cell.label)}) on {os_name}, as lab applies it.",
        "set -u",
    ]
    wanted = tuning.render(os_name, profile)
    if wanted is None:
        lines.append(
            f"echo {shlex.quote(f'tuning profile {profile} has no template for {os_name}: the cell was n/a')} >&2"
        )
        wanted = {}
    lines.append(f"# tuning profile: {profile}")
    lines += [facts.sysctl_set.format(key=k, value=shlex.quote(v)) for k, v in wanted.items()]
    if cc != "default" and facts.cc_set:
        lines += [f"# congestion control: {cc}", facts.cc_set.format(cc=cc)]
    if offloads:
        lines.append(f"# offloads on {dev}: {_c(axes.get('offloads'))}")
        lines += [
            facts.offload_set[f].format(dev=dev, state="on" if on else "off", flag="" if on else "-")
            for f, on in offloads.items()
            if f in facts.offload_set
        ]
    if wan is not None and not wan.is_null and facts.netem_set:
        lines += [
            f"# WAN emulation {_c(axes.get('wan'))} on the guest's NIC (towards the client)",
            facts.netem_set.format(dev=dev, args=shlex.join(netem_args(wan))),
        ]
    lines.append("# read back (what lab recorded in the cell is below each line)")
    keys = list(dict.fromkeys([*facts.sysctl_watched, *wanted, *([facts.cc_key] if facts.cc_key else [])]))
    effective = recorded.get("effective", {})
    for key in keys:
        lines.append(f"printf '%s = %s\\n' {shlex.quote(key)} \"$({facts.sysctl_get.format(key=key)} 2>/dev/null)\"")
        if key in effective:
            lines.append(f"#   lab read: {key} = {_c(effective[key])}")
    if facts.offload_get:
        lines.append(facts.offload_get.format(dev=dev) + " 2>/dev/null || true")
        if recorded.get("offloads", {}).get("effective"):
            lines.append(f"#   lab read: {_c(recorded['offloads']['effective'])}")
    return "\n".join(lines + container_lines(cell)) + "\n"


def container_name(cell: CellRow) -> str | None:
    """The container a cell's workloads ran in (lab.isolation), named for the reproduction; None: none."""
    return f"lab-{cell.cell_id}" if (cell.facts.get("isolation") or {}).get("kind") == "container" else None


def container_runtime(cell: CellRow) -> Runtime:
    """The runtime that made the cell's container (runs before runtimes were recorded: podman)."""
    return Runtime((cell.facts.get("isolation") or {}).get("runtime") or Runtime.PODMAN)


def container_lines(cell: CellRow) -> list[str]:
    """The end of the tune stage of a container cell: its container, made as lab made it."""
    name, box = container_name(cell), cell.facts.get("isolation") or {}
    if name is None:
        return []
    rt = container_runtime(cell)
    lines = [f"# isolation: the workloads ran in a {rt.value} container (lab/isolation.py); workloads.sh enters it"]
    if box.get("nginx"):
        lines.append(isolation.STOP_NGINX)
    nested = f"{isolation.NESTED_DIR}/{name}" if box.get("nested") else ""
    if nested:  # its workloads started containers inside it
        lines.append(isolation.nested_setup(nested))
    argv = isolation.run_argv(
        name,
        str(box.get("network", "host")),
        list(box.get("binds", [])),
        {},
        runtime=rt,
        sysctls=box.get("sysctls") or None,
        nested=nested,
        sshd=bool(box.get("sshd")),
    )
    lines.append(shlex.join(argv))
    if box.get("sshd"):  # scp's load: the container's own sshd, with the guest's privilege-separation user
        add_user = isolation.SSHD_ADD_USER.format(user='"$0"')  # $0: the guest's line, read as the script runs
        lines.append(shlex.join(isolation.exec_argv(name, add_user, runtime=rt)) + " \"$(grep '^sshd:' /etc/passwd)\"")
        start = isolation.SSHD_START.format(port=isolation.SSHD_PORT)
        lines.append(shlex.join(isolation.exec_argv(name, start, runtime=rt)))
    if box.get("nginx"):
        start = f"mkdir -p {' '.join(isolation.NGINX_DIRS)} && /usr/sbin/nginx"
        lines.append(shlex.join(isolation.exec_argv(name, start, runtime=rt)))
    return lines


def workloads_script(store: Store, run_id: str, cell: CellRow) -> str:
    """The commands of each workload's first measured repetition in the cell, in the order they ran."""
    lines = [
        "#!/bin/sh",
        f"# The workload commands cell {cell.cell_id} of run {run_id} ran (results store, each",
        "# workload's first measured repetition). Lines marked 'lab side' ran on lab's side of the link",
        "# (load generators): run them from the Vagrant host against this guest.",
        "set -x",
    ]
    seen: set[str] = set()
    inside, rt = container_name(cell), container_runtime(cell)
    for _raw_id, cell_id, rep, raw in store.raw_outputs(run_id):
        if cell_id != cell.cell_id or rep < 0 or raw.workload in seen:
            continue
        seen.add(raw.workload)
        lines.append(f"\n# {_c(raw.workload)} (repetition {rep})")
        for command in (c.strip() for c in raw.command.split(" ; ") if c.strip()):
            if Path(_first_word(command)).name in CLIENT_SIDE:
                lines.append(f"# lab side: {_c(command)}")
            else:  # the store's command line is one quoted argument: it cannot change the script around it
                lines.append(
                    shlex.join(isolation.exec_argv(inside, command, runtime=rt) if inside else ["sh", "-c", command])
                )
    if not seen:
        lines.append(f"# no workload ran in this cell (status {_c(cell.status)}: {_c(cell.error or 'no error')})")
    return "\n".join(lines) + "\n"


def _first_word(command: str) -> str:
    try:
        return (shlex.split(command) or [""])[0]
    except ValueError:  # unbalanced quotes: no program lab knows
        return ""


def _c(value: object) -> str:
    """A value from the results store as the rest of a comment line (lab.plaintext.one_line)."""
    return plaintext.one_line(value)


def reproduce(
    store: Store,
    run_ref: str,
    cell_id: str,
    out_dir: Path | None = None,
    *,
    ssh_key: Path,
    uri: str | None = None,
    network: Network | None = None,
    storage_pool: str | None = None,
    force: bool = False,
) -> Reproduction:
    """Write the Vagrantfile and its scripts for a stored cell into `out_dir` (default
    ./reproduce-RUN-CELL; created). A file of those names already there is refused, before
    anything is written, unless `force` (lab.outfiles: a link, a device or a directory is refused
    even then). `uri`, `network` and `storage_pool` pin the libvirt side; unset, the Vagrantfile
    takes vagrant-libvirt's defaults, as any user's does."""
    run_id, cell = find_cell(store, run_ref, cell_id)
    check_stored(store, run_id, cell)
    out_dir = Path(out_dir) if out_dir is not None else Path.cwd() / f"reproduce-{run_id}-{cell.cell_id}"
    name, digest, sha = image_build(store, run_id, cell)
    for key, value in (("digest", digest), ("sha256", sha)):  # from the cell's facts or the run's manifest
        if names.DIGEST.problem(value):
            raise UsageError(f"{store.path}: run {run_id}: image {key} {value!r}: {names.DIGEST.problem(value)}")
    os_name = images.recipe(name).os
    axes = cell.axes
    wan = stored_wan(store, run_id, cell)
    outfiles.check_dir(out_dir)
    for file in FILES:  # all of them before any is written: a refusal leaves the directory as it was
        outfiles.check(out_dir / file, replace=force)
    scripts = {"tune.sh": tune_script(os_name, cell, wan), "workloads.sh": workloads_script(store, run_id, cell)}
    accel = str(cell.facts.get("accel") or "tcg")
    machine = Machine(
        # not lab-...: a reproduction is the user's machine, never something of a run for `lab gc`
        name=f"repro-{run_id}-{cell.cell_id}".replace("#", "-"),
        image=name,
        box=box.box_name(name),
        box_version=box.box_version(digest, sha),
        cpus=int(axes["vcpus"]),
        memory_mib=int(axes["memory_mib"]),
        nic=NicModel(axes["nic"]),
        disk_bus=DiskBus(axes.get("disk_bus", "virtio")),
        ssh_key=Path(ssh_key),
        purpose=f"cell {cell.cell_id} ({cell.label}) of lab run {run_id}, reproduced by `lab reproduce`",
        driver="kvm" if accel == "kvm" else "qemu",
        uri=uri,
        title=f"lab reproduction of {run_id}/{cell.cell_id}",
        description=f"lab reproduce {run_id} {cell.cell_id}",
        console_log=(out_dir / "console.log").resolve(),
        network=network,
        storage_pool=storage_pool,
        provisioners=(
            Provisioner(
                "tune", "tune.sh", "once", "the cell's tuning, congestion control, offloads (lab's tune stage)"
            ),
            Provisioner(
                "workloads",
                "workloads.sh",
                "never",
                "the cell's workload commands: vagrant provision --provision-with workloads",
            ),
        ),
        notes=_notes(cell, accel),
    )
    for file, text in {**scripts, "Vagrantfile": render(machine)}.items():
        outfiles.write(out_dir / file, text, replace=force)
    return Reproduction(out_dir, out_dir / "Vagrantfile", machine)


def _notes(cell: CellRow, accel: str) -> tuple[str, ...]:
    axes: dict[str, Any] = cell.axes
    shown = ", ".join(f"{k}={v}" for k, v in axes.items())
    return (
        f"cell axes: {shown}",
        f"the cell ran under {accel}; measured status {cell.status}",
        "vagrant up  # boots it and runs tune.sh;  vagrant ssh;  vagrant destroy -f",
    )
