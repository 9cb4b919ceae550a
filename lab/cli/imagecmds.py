"""`lab images ...`: build, list, render the answer files, publish; `lab reproduce`: a stored cell's
machine as a Vagrantfile."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import click

from lab import PACKER_DIR, backends, images, outfiles
from lab.cli import shapes
from lab.cli.group import (
    cli,
    config_option,
    install_signal_handlers,
    load_or_default,
    read_store,
    require_host,
    restore_signal_handlers,
    results_option,
)
from lab.cli.printing import age, duration, err, out, say, styled, table


@cli.group("images")
def images_cmd():
    """Golden images: build, list, render the answer files, publish."""


@images_cmd.command("build")
@click.argument("name", default="debian12")
@click.option("--force", is_flag=True, help="rebuild even if the recipe is unchanged")
@click.option(
    "--iso",
    "iso",
    default=None,
    metavar="PATH",
    help="ISO-installed images: a local copy of the installer ISO (default: images/iso/<file>, else the mirror)",
)
@click.option(
    "--iso-checksum",
    "iso_checksum",
    default=None,
    metavar="SUM",
    help="sha256:HEX, sha512:HEX or file:PATH for --iso (default: the release's checksum file)",
)
def images_build(name, force, iso, iso_checksum):
    """Build a golden image (Debian from packages; the others from their installer ISO)."""
    started = time.monotonic()
    previous = install_signal_handlers()  # SIGTERM/Ctrl-C: the build's commands (packer and its QEMU) are stopped
    try:
        ref = images.build(
            name,
            force=force,
            iso=iso,
            iso_checksum=iso_checksum,
            progress=lambda stage: err.print(f"[{duration(time.monotonic() - started)}] {name}: {stage}"),
        )
    finally:
        restore_signal_handlers(previous)
    say(f"{ref.name}: {ref.path} (recipe {ref.digest[:12]}, sha256 {ref.sha256[:12]})")


def short_version(line: str) -> str:
    """The version in a tool's `--version` line: 'nginx version: nginx/1.22.1' -> '1.22.1'."""
    m = re.search(r"\d+(?:\.\d+)+[\w.+~-]*", line)
    return m.group(0) if m else line


@images_cmd.command("ls")
@click.option("--json", "as_json", is_flag=True, help="the images as JSON (shape lab.images/1)")
@click.option("--warm", is_flag=True, help='list the warm snapshots (start = "warm") each host of lab.toml keeps')
@config_option
def images_ls(as_json, warm, config_path):
    """Every image the lab knows, built or not: state, recipe digest, age, tool versions."""
    if warm:
        _warm_ls(config_path, as_json)
        return
    rows = images.status()
    if as_json:
        shapes.emit("images", {"images": [dict(sorted(r.items())) for r in rows]})
        return
    t = table(("image", "os", "state", "recipe", "built from", "age", "size", "tools"), title_justify="center")
    for r in rows:
        tools = ", ".join(f"{k} {short_version(v)}" for k, v in sorted(r["tools"].items()) if v)
        size = f"{r['size'] / 2**20:.0f} MiB" if r["size"] else "–"
        style = {"built": "green", "outdated": "yellow"}.get(r["state"], "dim")
        t.add_row(
            r["name"],
            f"{r['os']} {r['release']}",
            styled(r["state"], style),
            r["recipe_digest"][:12],
            r["built_digest"][:12] or "–",
            age(r["age_s"]),
            size,
            tools or "–",
        )
    out.print(t)


def _warm_ls(config_path: str, as_json: bool) -> None:
    """The warm snapshots of every host whose backend keeps them; which image build each is of."""
    cfg = load_or_default(config_path)
    builds = {
        v: f"{ref.name} ({ref.sha256[:12]})" for ref in images.list_images() for v in (ref.digest, ref.sha256) if v
    }
    found: list[dict[str, Any]] = []
    keeping = sorted(h for h, s in cfg.hosts.items() if backends.capabilities(s).snapshots)
    for host, backend in sorted(cfg.open_backends(set(keeping)).items()):
        for snap in backend.warm.snapshots() if backend.warm else []:
            found.append(
                {
                    "host": host,
                    "name": snap.name,
                    "image": builds.get(snap.detail, ""),
                    "image_build": snap.detail,
                    "current": snap.detail in builds,
                }
            )
    if as_json:
        shapes.emit("images.warm", {"hosts": keeping, "warm": found})
        return
    if not found:
        say(f"no warm snapshots on {', '.join(keeping) or 'any host (none keeps them)'}")
        return
    t = table(("host", "snapshot", "of image", "state"))
    for f in found:
        t.add_row(
            f["host"],
            f["name"],
            f["image"] or f["image_build"][:12],
            styled("current", "green") if f["current"] else styled("stale: `lab gc` removes it", "yellow"),
        )
    out.print(t)


@images_cmd.command("render")
@click.argument("name")
@click.argument("directory", type=click.Path(file_okay=False))
def images_render(name, directory):
    """Write NAME's answer files (DIRECTORY/http) and upload stage (DIRECTORY/stage), e.g. for a
    hand-run `packer build -only=proxmox-iso.NAME`."""
    where = outfiles.check_dir(directory)  # not a link, not a file (lab.outfiles writes each file in it)
    r = images.recipe(name)
    key = images.ensure_key()
    images.render_answers(name, where / "http", key.with_suffix(".pub").read_text().strip())
    if r.kind == "iso":
        images.render_upload(name, where / "stage")
    else:
        images.render_stage(name, where / "stage")
        if getattr(r, "container", None) is not None:  # provisioning imports it into podman's store
            images.stage_container_base(name, where / "stage", where / "container.log")
    say(f"{name}: answers in {where / 'http'}, upload stage in {where / 'stage'}")
    # a modern Packer installs the builders first (plugins.pkr.hcl: qemu, proxmox, vagrant)
    say(f"packer init {PACKER_DIR / 'plugins.pkr.hcl'}", soft_wrap=True)
    say(
        f"PKR_VAR_proxmox_token=... packer build -only=proxmox-iso.{name} -var http_dir={where / 'http'} "
        f"-var stage_dir={where / 'stage'} -var ssh_key={key} -var recipe_digest={images.recipe_digest(name)} "
        "-var proxmox_url=... -var proxmox_node=... "
        f"{PACKER_DIR / r.packer_template}",
        soft_wrap=True,
    )


@images_cmd.command("publish")
@click.argument("name")
@click.argument("host")
@config_option
def images_publish(name, host, config_path):
    """Publish a built image to HOST: a Proxmox template, a bhyve host's ZFS dataset, the local store, or
    (HOST "vagrant", or any vagrant host) a box in Vagrant, versioned by the image's digest."""
    cfg = load_or_default(config_path)
    if host == "vagrant" and host not in cfg.hosts:
        # `lab images publish NAME vagrant`: this machine's own Vagrant, with the backend's defaults
        cfg = cfg.model_copy(
            update={"hosts": {**cfg.hosts, host: backends.settings_model("vagrant")(backend="vagrant")}}
        )
    require_host(cfg, config_path, host)
    ref = images.load(name)
    backend = cfg.open_backends({host})[host]
    if backend.publishing is None:
        raise backend.lacks("cannot publish images")
    where = backend.publishing.publish(ref)
    say(f"{name} ({ref.sha256[:12]}) published on {host}: {where}", soft_wrap=True)


@cli.command("reproduce")
@click.argument("run_ref", metavar="RUN")
@click.argument("cell_id", metavar="CELL")
@click.option(
    "--out",
    "out_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="directory to write (default ./reproduce-RUN-CELL)",
)
@click.option("--force", is_flag=True, help="replace a Vagrantfile, tune.sh or workloads.sh already in it")
@config_option
@results_option
def reproduce_cmd(run_ref, cell_id, out_dir, force, config_path, results_dir):
    """Write a stored cell's machine as a Vagrantfile (same box version, NIC model, vCPUs, memory, disk
    bus; its tuning as tune.sh, its workload commands as workloads.sh) to `vagrant up` by hand."""
    from lab import reproduce  # Vagrant's templates load only for this command

    store = read_store(config_path, results_dir)
    made = reproduce.reproduce(
        store,
        run_ref,
        cell_id,
        Path(out_dir) if out_dir else None,
        ssh_key=backends.default_env(config_path).ssh_key,
        force=force,
    )
    say(f"wrote {made.vagrantfile}", soft_wrap=True)
    say(
        f"box {made.machine.box} {made.machine.box_version}: `lab images publish {made.machine.image} vagrant` "
        "adds it; then `vagrant up` in that directory",
        soft_wrap=True,
    )
