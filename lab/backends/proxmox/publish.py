"""`lab images publish IMAGE HOST`: the golden image becomes a PVE template on `node`.

PVE >= 8.3 uploads the qcow2 as `import` content and creates the template with
`import-from=<volid>` (a token suffices); 7.2-8.2 upload it as `iso` content (`.img`) and import
from its absolute path, which PVE allows only root@pam with a password (ticket); < 7.2 has no
import-from (Packer's proxmox builder or `qm importdisk` over SSH). The upload is removed afterwards.
A template of that name the lab published from the same image (sha256) is reused; older ones the
lab published of that image are removed once nothing is cloned from them any more. A template of
that name the lab did not publish (no marker) is never touched. What the credentials must be
allowed is checked before anything is uploaded.
"""

from __future__ import annotations

import logging
import re
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from lab import images, osfacts
from lab.backends.proxmox import host
from lab.backends.proxmox.ownership import TEMPLATE_TAG, dns_name, template_description
from lab.backends.proxmox.placement import Vmids
from lab.backends.proxmox.privileges import Privileges, for_publish
from lab.backends.proxmox.session import ApiError, Session, remaining
from lab.backends.proxmox.teardown import destroy_vmid, remove_leftover
from lab.backends.proxmox.templates import Templates
from lab.backends.proxmox.vms import EXISTS_ERRORS, answer_lost, flag
from lab.errors import BackendError, LabError, UsageError
from lab.model import ImageRef

log = logging.getLogger(__name__)

TEMPLATE_MEMORY_MIB = 1024  # a clone gets the cell's size; this is only the template's own


class Publisher:
    """The host's Publishing part (lab.backends.base): `lab images publish NAME HOST`."""

    def __init__(self, session: Session, templates: Templates, vmids: Vmids, privileges: Privileges, source: str):
        self.session, self.settings, self.host = session, session.settings, session.host
        self.templates, self.vmids, self.privileges = templates, vmids, privileges
        self.node, self.source = self.settings.node, source

    def publish(self, image: ImageRef) -> str:
        """Make `image` a template on `node` and return its name. The API and nodes are checked
        first; what publishing needs (not what cells do) is checked on the way."""
        with host.before_anything():
            host.check(self.session, self.source)
        images.require_boot(image, "bios", f"a Proxmox VE template on {self.host} boots its disk by SeaBIOS")
        name = self.templates.name(image)
        if name.isdigit():
            raise UsageError(
                f"{self.host}: template = {name} is a VMID; publishing needs a template name",
                hint='set template = "lab-{image}" (the default) for this host',
            )
        sha = image.sha256 or image.digest
        same, older = self.templates.published(name, image, sha)
        if same is not None:
            log.info("%s: template %s (VM %d) already holds %s", self.host, name, same, image.name)
            return name
        release = self.session.release()
        version = self.session.version().get("release", "?")
        if release < (7, 2):
            raise UsageError(
                f"{self.host}: PVE {version} cannot import a disk through the API (import-from needs 7.2+)",
                hint="build the template on the host with Packer's proxmox builder, or `qm importdisk` over SSH",
            )
        by_path = release < (8, 3)  # no `import` content before 8.3: upload as iso, import by path
        principal = self.session.credentials.principal
        if by_path and principal != "root@pam":
            raise UsageError(
                f"{self.host}: publishing on PVE {version} imports from an absolute path, "
                f"which PVE allows only root@pam with a password, not {principal}",
                hint='set user = "root@pam" and password for this once, use Packer\'s proxmox '
                "builder, or upgrade to PVE 8.3+ (token-friendly `import` content)",
            )
        self.privileges.require(
            for_publish(self.settings) + self.privileges.sdn_needs([self.settings.bridge]), f"publishing {image.name}"
        )
        deadline = time.monotonic() + self.settings.timeouts.publish
        content, ext = ("iso", "img") if by_path else ("import", "qcow2")
        filename = f"{name}-{sha[:12]}.{ext}"
        volid = self._upload(image.path, content, filename, sha, deadline)
        try:
            source = volid
            if by_path:
                st = self.session.node(self.node).storage(self.settings.import_storage)
                source = str(self.session.get("GET volume path", st.content(quote(volid, safe="")))["path"])
            vmid = self._create_template(image, name, sha, source, deadline)
        finally:
            self._delete_volume(volid, deadline)
        for old in older:
            try:
                destroy_vmid(self.session, old, self.node, name, image=image.name)
            except LabError as exc:  # linked clones still use it: it goes when they are gone
                log.warning("%s: kept the older template %d of %s: %s", self.host, old, name, exc)
        self.templates.forget(name)
        log.info("%s: published %s as template %s (VM %d)", self.host, image.name, name, vmid)
        return name

    def _upload(self, path: Path, content: str, filename: str, sha: str, deadline: float) -> str:
        storage = self.settings.import_storage
        st = self.session.node(self.node).storage(storage)
        volid = f"{storage}:{content}/{filename}"
        try:  # the upload of a publish that died midway: replace it
            self.session.get("GET volume", st.content(quote(volid, safe="")), until=time.monotonic())
            self._delete_volume(volid, deadline)
        except ApiError:
            pass
        with tempfile.TemporaryDirectory(prefix="lab-publish-") as tmp:
            named = Path(tmp) / filename  # the multipart file name is what PVE calls the volume
            named.symlink_to(Path(path).resolve())
            with open(named, "rb") as fh:
                params: dict[str, Any] = {"content": content, "filename": fh}
                if re.fullmatch(r"[0-9a-f]{64}", sha):
                    params.update({"checksum": sha, "checksum-algorithm": "sha256"})
                upid = self.session.call(f"upload of {filename} to {storage}", lambda: st.upload.post(**params))
        self.session.wait_task(upid, timeout=remaining(deadline), what=f"upload of {filename} to {self.node}/{storage}")
        return volid

    def _create_template(self, image: ImageRef, name: str, sha: str, source: str, deadline: float) -> int:
        storage = self.settings.storage
        params: dict[str, Any] = {
            "name": dns_name(name),
            "description": template_description(image, sha),
            "tags": TEMPLATE_TAG,
            "memory": str(TEMPLATE_MEMORY_MIB),
            "cores": 1,
            "sockets": 1,
            "cpu": self.settings.cpu_type,
            "ostype": osfacts.facts(image.os).pve_ostype,
            "scsihw": "virtio-scsi-single",
            "scsi0": f"{storage}:0,import-from={source}",
            "ide2": f"{storage}:cloudinit",
            "boot": "order=scsi0",
            "serial0": "socket",
            "vga": "serial0",
            "agent": f"enabled={flag(self.settings.guest_agent)}",
            "net0": f"model=virtio,bridge={self.settings.bridge}",
        }
        qemu = self.session.node(self.node).qemu
        for _ in range(20):
            vmid = self.vmids.candidate()
            try:
                upid = self.session.call(f"create of template {name}", lambda: qemu.post(vmid=vmid, **params))
            except LabError as exc:
                if isinstance(exc, ApiError) and any(m in exc.reason for m in EXISTS_ERRORS):
                    continue  # someone else took the id meanwhile
                try:  # a lost answer: the node may still make it
                    remove_leftover(
                        self.session,
                        vmid,
                        self.node,
                        name,
                        image=image.name,
                        settle=2 * self.settings.timeouts.http if answer_lost(exc) else 0.0,
                    )
                finally:
                    self.vmids.forget(vmid)
                raise
            try:
                self.session.wait_task(upid, timeout=remaining(deadline), what=f"import of {image.name} into VM {vmid}")
                api = qemu(vmid)
                self.session.retrying(
                    f"template of VM {vmid}",
                    lambda: self.session.run_task(
                        f"conversion of VM {vmid} to a template", lambda: api.template.post(), deadline=deadline
                    ),
                    deadline=deadline,
                )
                return vmid
            except BaseException:
                try:
                    remove_leftover(self.session, vmid, self.node, name, image=image.name)  # a half-made template goes
                finally:
                    self.vmids.forget(vmid)
                raise
        raise BackendError(f"{self.host}: could not find a free VMID for template {name}")

    def _delete_volume(self, volid: str, deadline: float) -> None:
        st = self.session.node(self.node).storage(self.settings.import_storage)
        try:
            upid = self.session.call(
                f"removal of {volid}", lambda: st.content(quote(volid, safe="")).delete(), until=deadline
            )
            if upid:
                self.session.wait_task(upid, timeout=remaining(deadline), what=f"removal of {volid}")
        except LabError as exc:  # the template is made; the upload is only a leftover file
            log.warning("%s: could not remove the uploaded %s: %s", self.host, volid, exc)
