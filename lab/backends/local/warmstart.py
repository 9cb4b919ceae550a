"""The local backend's warm start part (lab.backends.base.WarmSnapshots): the snapshot of a cell's
machine shape, found or built once (lab.backends.local.warm has the snapshots and their restore),
and the snapshots this host keeps, for `lab images ls --warm` and `lab gc`. Snapshots are no run's:
list_owned never shows them."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from lab import runlock
from lab.backends.local import host, layout, warm
from lab.backends.local.qemu import qemu_version
from lab.backends.local.vms import Machines
from lab.errors import LabError
from lab.model import CloneKind, ImageRef, Owned, VmSpec


class WarmStart:
    def __init__(self, machines: Machines):
        self.machines, self.settings, self.workdir = machines, machines.settings, machines.workdir
        self.root = Path(self.settings.warm_dir) if self.settings.warm_dir else self.workdir / warm.STORE
        self._failed: dict[str, str] = {}  # snapshot name -> why it is not used again by this process

    def snapshot_for(self, image: ImageRef, spec: VmSpec) -> tuple[warm.Snapshot | None, str]:
        """The spec's warm snapshot, built if it is not there yet (one build per key at a time on
        this machine: a second run waits for the first's). (None, why) when the cell boots cold."""
        why = warm.refusal(image) or (
            "warm start makes linked clones of its snapshot's disk" if spec.clone is not CloneKind.LINKED else None
        )
        if why:
            return None, why
        key = warm.shape_key(spec, accel=self.machines.accel(image), qemu=qemu_version(), backend=self.machines.backend)
        if key.name in self._failed:
            return None, self._failed[key.name]
        store = warm.WarmStore(self.root)
        try:
            store.ensure()
            with runlock.exclusive(
                store.lock_path(key),
                what=f"another run's build of warm snapshot {key.name}",
                timeout=2 * self.settings.boot_timeout + warm.SETTLE_TIMEOUT,
            ):
                try:
                    found = store.find(key)
                except warm.WarmUnusable as exc:
                    store.remove(key.name)
                    return None, f"{exc}; removed it: the next warm cell builds it again"
                if found is not None:
                    return found, ""
                snapshot = self._build(key, image, spec, store)
        except LabError as exc:
            self._failed[key.name] = f"building warm snapshot {key.name} failed: {exc}"
            return None, self._failed[key.name]
        for old in store.snapshots():  # made by another QEMU or an older recipe: nothing here restores them
            if warm.unusable_here(old.meta, qemu_version()):
                store.remove(old.name)
        return snapshot, ""

    def _build(self, key: warm.ShapeKey, image: ImageRef, spec: VmSpec, store: warm.WarmStore) -> warm.Snapshot:
        """Boot the template as a machine of the run (its directory, lease, tap: gc finds them if
        the run is killed meanwhile), save it into the store, remove the rest."""
        ns = layout.netns_name(spec.run_id)
        tap, ip, mac = self.machines.allocate(spec.run_id)
        name = f"lab-{spec.run_id}-w{key.digest[:8]}"
        builddir = self.workdir / name
        builddir.mkdir(parents=True, exist_ok=False)
        layout.write_lease(
            builddir,
            {
                "run_id": spec.run_id,
                "vm": name,
                "netns": ns,
                "tap": tap,
                "kind": "warm-build",
                "expires_at": spec.expires_at,
                "owner": spec.owner,
                "created_at": time.time(),
            },
        )
        handle = {"dir": str(builddir), "netns": ns, "tap": tap}
        try:
            self.machines.overlay(image.path, builddir / warm.DISK)
            host.run_all(host.tap_argvs(ns, tap, plugged=False), what=f"{name}'s tap")  # on no bridge: not a cell
            build = replace(spec, name=name, ip=ip, mac=mac, image=image)
            argv = self.machines.argv(build, builddir, tap, ram=builddir / warm.RAM, ram_shared=True)
            return warm.make_snapshot(
                key,
                store=store,
                builddir=builddir,
                argv=argv,
                netns=ns,
                boot_timeout=self.settings.boot_timeout,
                handle=handle,
            )
        finally:
            host.remove_machine(handle, name)

    def drop(self, name: str, why: str) -> None:
        """A snapshot QEMU could not load: removed (a later run rebuilds it), not rebuilt in this one."""
        self._failed[name] = why
        warm.WarmStore(self.root).remove(name)

    def snapshots(self) -> list[Owned]:
        """Each snapshot of its store (this workdir's, or the warm_dir it shares): name = its shape,
        detail = the digest (sha256) of the image it was made from; `lab gc` removes those whose
        image is gone."""
        return [
            Owned(self.machines.backend, "warm", s.name, "", 0.0, str(s.meta.get("image_digest", "")))
            for s in warm.WarmStore(self.root).snapshots()
        ]

    def remove(self, item: Owned) -> None:
        store = warm.WarmStore(self.root)
        with runlock.exclusive(
            store.root / f"{item.name}.lock",
            what=f"a build of warm snapshot {item.name}",
            timeout=2 * self.settings.boot_timeout + warm.SETTLE_TIMEOUT,
        ):
            store.remove(item.name)
