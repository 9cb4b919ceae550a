"""What a build uploads to the guest, rendered from templates/: nginx.conf and the static site (every
image), the installer's answer files and the provisioning stage (ISO-installed images). Written
through lab.outfiles (`lab images render NAME DIR` writes where the user said): never through a
link planted at a file's name, never over a device or a directory."""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import tomllib
from pathlib import Path
from typing import Any

import jinja2

import lab
from lab import osfacts, outfiles
from lab.images.pictures import png
from lab.images.recipes import READY_MARKER, IsoRecipe, Recipe, recipe
from lab.model import NicModel


def _jinja(tdir: Path) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(tdir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render_stage(name: str, out: Path, templates_dir: Path | None = None) -> None:
    """Render what the provisioner uploads: out/nginx.conf and out/site/ (pages, css, images)."""
    r = recipe(name)
    tdir = Path(templates_dir or lab.TEMPLATES_DIR)
    outfiles.write(
        out / "nginx.conf",
        _jinja(tdir).get_template("nginx.conf.j2").render(image=name, **osfacts.facts(r.os).nginx.__dict__, **r.nginx),
    )

    sdir = tdir / "site"
    site = out / "site"
    site_env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(sdir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=jinja2.select_autoescape(),
    )
    page_files = sorted((sdir / "pages").glob("*.html"))
    pages = []
    for pf in page_files:
        mod = site_env.get_template(f"pages/{pf.name}").make_module({"pages": [], "href": pf.name})
        exported = vars(mod)  # the page's {% set %} variables (a TemplateModule's attributes)
        pages.append({"href": pf.name, "title": exported["title"], "date": exported["date"]})
    index = [p for p in pages if p["href"] == "index.html"]
    rest = sorted((p for p in pages if p["href"] != "index.html"), key=lambda p: (p["date"], p["href"]), reverse=True)
    pages = index + rest  # the home page first, then the newest article first
    for pf in page_files:
        html = site_env.get_template(f"pages/{pf.name}").render(pages=pages, href=pf.name)
        outfiles.write(site / pf.name, html)
    for f in sorted(sdir.rglob("*")):
        rel = f.relative_to(sdir)
        if f.is_dir() or rel.parts[0] == "pages" or f.name in ("layout.html.j2", "images.toml"):
            continue
        outfiles.write(site / rel, f.read_bytes())
    imgs = sdir / "images.toml"
    if imgs.is_file():
        for picture, (w, h, seed) in tomllib.loads(imgs.read_text()).items():
            outfiles.write(site / picture, png(int(w), int(h), int(seed)))


def answer_context(r: IsoRecipe | Recipe, pubkey: str) -> dict[str, Any]:
    """What the answer-file templates see. The root password is random per render and only lives
    until provisioning replaces it with `*` (no password can match): the installers insist on one."""
    f = osfacts.facts(r.os)
    packages = list(r.packages) + ["qemu-guest-agent"] if isinstance(r, Recipe) else sorted(f.packages.values())
    return {
        "image": r.name,
        "os": r.os,
        "release": r.release,
        "hostname": r.hostname,
        "pubkey": pubkey,
        "disk": f.install_disk,
        "nic": f.device(NicModel.VIRTIO),
        "serial": f.serial_device,
        "packages": packages,
        "root_password": secrets.token_urlsafe(18),
        "timezone": "UTC",
        "ready_marker": READY_MARKER,
        "disk_mib": r.disk_mib,
    }


def render_answers(name: str, out: Path, pubkey: str, templates_dir: Path | None = None) -> dict[str, Path]:
    """Render the image's answer files into `out` (Packer's http_directory); return name -> path."""
    r = recipe(name)
    env = _jinja(Path(templates_dir or lab.TEMPLATES_DIR))
    ctx = answer_context(r, pubkey)
    written = {}
    for template, served in r.answers:
        written[served] = outfiles.write(out / served, env.get_template(template).render(**ctx))
    return written


def render_upload(name: str, out: Path, templates_dir: Path | None = None) -> None:
    """What provision-<os>.sh finds in /tmp: lab-nginx.conf, lab-site/, lab-common.sh (the shared
    shell functions) and lab-facts.sh (this OS's facts from lab.osfacts, as shell variables)."""
    r = recipe(name)
    f = osfacts.facts(r.os)
    staged = out.parent / f"{out.name}.render"
    shutil.rmtree(staged, ignore_errors=True)
    render_stage(name, staged, templates_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.replace(staged / "nginx.conf", out / "lab-nginx.conf")
    shutil.rmtree(out / "lab-site", ignore_errors=True)
    os.replace(staged / "site", out / "lab-site")
    shutil.rmtree(staged)
    outfiles.write(out / "lab-common.sh", (lab.PACKER_DIR / "scripts" / "provision-common.sh").read_bytes())
    env = {
        "LAB_IMAGE": name,
        "LAB_OS": r.os,
        "LAB_RELEASE": r.release,
        "LAB_HOSTNAME": r.hostname,
        "LAB_PACKAGES": " ".join(sorted(f.packages.values())),
        "LAB_SERIAL": f.serial_device,
        "LAB_READY_MARKER": READY_MARKER,
        "LAB_NGINX_CONF": f.nginx.conf,
        "LAB_NGINX_USER": f.nginx.user,
        "LAB_CERT_DIR": f.nginx.cert_dir,
        "LAB_SITE_ROOT": r.nginx["root"],
    }
    lines = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    outfiles.write(
        out / "lab-facts.sh",
        "# shellcheck shell=sh disable=SC2034\n# Rendered by lab/images/render.py from "
        "lab/osfacts.py.\n" + "\n".join(lines) + "\n",
    )
