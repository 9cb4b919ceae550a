"""The template a cell clones: exactly the one the lab published for the cell's image.

A template is the image's when it has the `template` setting's name (or VMID), carries the lab's
template marker, and its description records the image's name and recipe digest (and its sha256,
when both sides know one). A hand-made VM template of the same name is never cloned. Several
matching: the newest published (then the highest VMID), and `describe` says which. The template of
the node a VM goes to is preferred; else the one on `node` (cloned across with `target=`, which PVE
allows only from shared storage). No match: a UsageError (exit 2) naming the `lab images publish`
line to run. What was chosen goes into the cell's facts (`Template.facts`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass

from lab.backends.proxmox.ownership import is_lab_template, parse_description
from lab.backends.proxmox.session import ApiError, Session, is_gone
from lab.errors import AuthError, UsageError
from lab.model import ImageRef

log = logging.getLogger(__name__)

DISK_KEY = re.compile(r"(scsi|virtio|sata|ide)\d+")


@dataclass(frozen=True)
class Template:
    """A VM template on the cluster with its config (description parsed into `meta`)."""

    vmid: int
    node: str
    name: str
    config: dict
    pool: str = ""  # the resource pool it is in (its privileges may come from there)

    @property
    def description(self) -> str:
        return str(self.config.get("description") or "")

    @property
    def meta(self) -> dict[str, str]:
        return parse_description(self.description)

    @property
    def published_at(self) -> float:
        try:
            return float(self.meta.get("lab-published") or 0)
        except ValueError:
            return 0.0

    def matches(self, image: ImageRef) -> bool:
        """Published by the lab from this image's recipe (and build, when both record a sha256)."""
        meta = self.meta
        if not is_lab_template(self.description, image.name) or meta.get("lab-image-digest") != image.digest:
            return False
        sha = meta.get("lab-image-sha256", "")
        return not (image.sha256 and sha and sha != image.sha256)

    def facts(self) -> dict[str, object]:
        meta = self.meta
        return {
            "template": self.vmid,
            "template_node": self.node,
            "template_name": self.name,
            "template_digest": meta.get("lab-image-digest", ""),
            "template_sha256": meta.get("lab-image-sha256", ""),
            "template_published": int(self.published_at),
        }

    def summary(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(self.published_at)) if self.published_at else "?"
        return (
            f"template {self.vmid} on {self.node} ({self.name}, digest {self.meta.get('lab-image-digest', '?')}, "
            f"published {when} UTC)"
        )


class Templates:
    def __init__(self, session: Session):
        self.session = session
        self.settings = session.settings
        self.host = session.host
        self._named: dict[tuple[str, str], list[Template]] = {}  # (name or vmid, node) -> its templates
        self._lock = threading.Lock()

    def name(self, image: ImageRef | None) -> str:
        """The `template` setting for `image`: a VMID (digits) or a name."""
        want = str(self.settings.template)
        if "{image}" in want:
            if image is None:
                raise UsageError(
                    f"{self.host}: no template configured", hint="set template = <vmid or name> for this host"
                )
            want = want.replace("{image}", image.name)
        return want

    # -- finding ----------------------------------------------------------------------------------
    def named(self, want: str, node: str, *, fresh: bool = False) -> list[Template]:
        """The templates called `want` (a name, or a VMID on `node` of the settings) on `node`."""
        with self._lock:
            hit = None if fresh else self._named.get((want, node))
        if hit is not None:
            return hit
        if want.isdigit():
            found = [self._read(int(want), self.settings.node)] if node == self.settings.node else []
        else:
            res = self.session.get("GET /cluster/resources", self.session.api().cluster.resources, type="vm")
            found = []
            for r in res:
                if r.get("template") and r.get("name") == want and r.get("node") == node:
                    try:
                        found.append(self._read(int(r["vmid"]), node, str(r.get("pool") or "")))
                    except AuthError as exc:  # someone's template the lab may not read: not the lab's
                        log.info("%s: template %s not readable: %s", self.host, r["vmid"], exc)
        with self._lock:
            self._named[(want, node)] = found
        return found

    def _read(self, vmid: int, node: str, pool: str = "") -> Template:
        try:
            cfg = self.session.get(f"GET config of template {vmid}", self.session.qemu(node, vmid).config)
        except ApiError as exc:
            if exc.status == 500 and (is_gone(exc) or "hostname lookup" in exc.reason):
                raise UsageError(
                    f"{self.host}: template {vmid} not found on node {node}: {exc.reason}",
                    hint="check node and template for this host",
                ) from None
            raise
        return Template(vmid, node, str(cfg.get("name") or ""), cfg, pool)

    def choose(self, image: ImageRef, node: str) -> Template:
        """The template a VM of `image` on `node` clones: the newest matching one on that node, else
        on `node` of the settings."""
        want = self.name(image)
        seen: list[Template] = []
        for where in dict.fromkeys([node, self.settings.node]):
            named = self.named(want, where)
            seen += named
            hits = [t for t in named if t.matches(image)]
            if hits:
                return max(hits, key=lambda t: (t.published_at, t.vmid))
        others = "; ".join(_why_not(t, image) for t in seen)
        raise UsageError(
            f"{self.host}: no template published by the lab for {image.name} (recipe digest {image.digest}) "
            f"named {want!r} on node {self.settings.node}"
            + (f" ({others})" if others else "")
            + f": run `lab images publish {image.name} {self.host}`",
            hint=f"lab images publish {image.name} {self.host}",
        )

    def matching(self, image: ImageRef, node: str) -> list[Template]:
        """Every template `choose` could have taken for `node`, the chosen one first."""
        chosen = self.choose(image, node)
        rest = [t for t in self.named(self.name(image), chosen.node) if t.matches(image) and t.vmid != chosen.vmid]
        return [chosen, *sorted(rest, key=lambda t: (t.published_at, t.vmid), reverse=True)]

    def forget(self, name: str) -> None:
        """A template of that name was (re)published: look it up again."""
        with self._lock:
            for key in [k for k in self._named if k[0] == name]:
                del self._named[key]

    # -- before anything is created ---------------------------------------------------------------
    def check(self, image: ImageRef) -> None:
        """Every node a VM may go to can clone `image`'s template."""
        for n in self.settings.clone_nodes:
            t = self.choose(image, n)
            if not t.config.get("template"):
                raise UsageError(
                    f"{self.host}: VM {t.vmid} on node {t.node} is not a template",
                    hint="convert the golden VM to a template (linked clones need one)",
                )
            if t.node != n and not self._on_shared_storage(t.config, t.node):
                storage = boot_disk(t.config)[1].split(":", 1)[0]
                raise UsageError(
                    f"{self.host}: node {n} has no template {t.name!r} of its own, and template "
                    f"{t.vmid} on {t.node} is on local storage {storage!r}: PVE cannot clone it to {n}",
                    hint="publish the image on that node too, or keep the template on shared storage",
                )

    def describe(self, image: ImageRef) -> list[str]:
        """One line per node a VM of `image` may go to: the template it clones, and what else of
        that name was passed over and why."""
        lines = []
        nodes = self.settings.clone_nodes
        for n in nodes:
            hits = self.matching(image, n)
            where = f" on {n}" if len(nodes) > 1 else ""
            line = f"{self.host}: {image.name}{where} clones {hits[0].summary()}"
            if len(hits) > 1:
                line += f", the newest of {len(hits)} matching (also {', '.join(str(t.vmid) for t in hits[1:])})"
            passed = [t for t in self.named(self.name(image), hits[0].node) if not t.matches(image)]
            if passed:
                line += "; passed over: " + "; ".join(_why_not(t, image) for t in passed)
            lines.append(line)
        return lines

    def _on_shared_storage(self, cfg: dict, node: str) -> bool:
        storage = boot_disk(cfg)[1].split(":", 1)[0]
        stores = self.session.get(f"GET storage of node {node}", self.session.node(node).storage)
        return any(st.get("storage") == storage and st.get("shared") for st in stores)

    # -- publishing ---------------------------------------------------------------------------------
    def published(self, name: str, image: ImageRef, sha: str) -> tuple[int | None, list[int]]:
        """(the template of this name on `node` the lab published from this very image, the other
        templates of this name there that the lab published for this image: older builds). A
        template the lab did not publish is in neither list: it is never replaced."""
        same, older = None, []
        for t in self.named(name, self.settings.node, fresh=True):
            if not is_lab_template(t.description, image.name):
                log.info("%s: template %d named %s was not published by the lab: left alone", self.host, t.vmid, name)
                continue
            meta = t.meta
            if meta.get("lab-image-sha256") == sha and meta.get("lab-image-digest") == image.digest:
                same = t.vmid
            else:
                older.append(t.vmid)
        return same, older


def _why_not(t: Template, image: ImageRef) -> str:
    meta = t.meta
    if not is_lab_template(t.description):
        return f"{t.vmid} on {t.node} was not published by the lab"
    if meta.get("lab-image") != image.name:
        return f"{t.vmid} on {t.node} holds image {meta.get('lab-image')}"
    if meta.get("lab-image-digest") != image.digest:
        return f"{t.vmid} on {t.node} holds digest {meta.get('lab-image-digest') or '?'}"
    if t.matches(image):
        return f"{t.vmid} on {t.node} matches"
    return f"{t.vmid} on {t.node} holds another build (sha256 {meta.get('lab-image-sha256', '?')[:12]})"


def boot_disk(cfg: dict) -> tuple[str, str]:
    """(config key, value) of the disk a VM boots from: the first disk of `boot: order=`, else
    `bootdisk`, else the first disk. ("", "") when it has none."""

    def is_disk(key: str) -> bool:
        return bool(DISK_KEY.fullmatch(key)) and ":" in str(cfg.get(key, "")) and "media=cdrom" not in str(cfg[key])

    boot = str(cfg.get("boot") or "")
    order = boot.removeprefix("order=").split(";") if boot.startswith("order=") else []
    keys = [*order, str(cfg.get("bootdisk") or ""), *sorted(cfg)]
    key = next((k for k in keys if is_disk(k)), "")
    return key, str(cfg.get(key, "")) if key else ""
