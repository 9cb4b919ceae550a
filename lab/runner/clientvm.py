"""client = "vm": a host's load generators in a VM of their own, made for the run on that host.

Measured through this machine, a remote host's network figures are of the path from here to the
host as much as of the guest's NIC, and every lane's network measurements take turns on this one
machine. With `[hosts.NAME] client = "vm"` the host's set-up for the run clones one more VM there
(`lab-<run>-clientN`, N the host's place in matrix.host) from the golden image of its first cell,
with `client_vcpus` and `client_memory_mib` and a virtio NIC, on the network its cells get. Like a
cell's VM it has a lease in the store and the lab's marker, so `lab gc` removes it after a crash.
The host's network workloads run their load generators and servers in it over SSH (VmClient), the
client load under their samples is its own /proc/stat (lab.clientload), it is the client of that
host alone (its lock: lab.clients.turn_key), and it is destroyed when the run ends, after the cells.
"""

from __future__ import annotations

import shlex
import threading
from dataclasses import dataclass

from lab.backends import Backend
from lab.errors import LabError
from lab.guest import Guest
from lab.lifecycle import LeaseKeeper, lease_expiry, shielded
from lab.model import Client, ImageRef, NicModel, Vm, VmSpec
from lab.store import Store


@dataclass
class VmClient:
    """lab.model.Client on another machine (a client VM, or a machine of the user's with
    client = "ssh:"): every command over SSH to it (lab.guest)."""

    address: str  # the client machine's, as the cells see it
    guest: Guest  # the client VM's, or the client machine's
    name: str
    netns: str | None = None  # nothing of this machine: the commands go through `guest`

    def argv(self, argv: list[str]) -> list[str]:
        return self.guest.argv(shlex.join(argv))

    def server_argv(self, argv: list[str]) -> list[str]:
        return self.guest.argv(shlex.join(argv), tty=True)  # SIGHUP stops it with the local ssh

    def proc_stat(self) -> str:
        return self.guest.run("cat /proc/stat", timeout=30).stdout


@dataclass
class Made:
    backend: Backend
    lease_id: int
    vm: Vm | None = None
    guest: Guest | None = None


class ClientVms:
    """The run's client VMs, by host: made in a host's set-up (`open`, from any lane's thread),
    destroyed at the run's end (`close_all`), whatever happened in between."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        lease_minutes: float,
        hosts: list[str],
        *,
        owner: str = "",
        leases: LeaseKeeper | None = None,
    ):
        self.store, self.run_id, self.lease_minutes = store, run_id, lease_minutes
        self.owner, self.leases = owner, leases  # whose it is (lab.lease); who renews its lease
        self.index = {h: i for i, h in enumerate(hosts, start=1)}
        self.made: dict[str, Made] = {}
        self.failures: list[str] = []  # destroys that failed (their leases stay for `lab gc`)
        self._lock = threading.Lock()

    def spec(self, host: str, image: ImageRef, vcpus: int, memory_mib: int, expires_at: float) -> VmSpec:
        cell_id = f"client{self.index[host]}"
        name = f"lab-{self.run_id}-{cell_id}"
        return VmSpec(
            name=name,
            run_id=self.run_id,
            cell_id=cell_id,
            image=image,
            nic=NicModel.VIRTIO,
            vcpus=vcpus,
            memory_mib=memory_mib,
            expires_at=expires_at,
            owner=self.owner,
            labels={"run": self.run_id, "cell": cell_id},
        )

    def open(self, host: str, backend: Backend, base: Client, image: ImageRef) -> VmClient:
        """Clone, boot and log in to `host`'s client VM; on any failure what was made is destroyed."""
        settings = backend.settings
        expires = lease_expiry(self.lease_minutes)
        spec = self.spec(host, image, settings.client_vcpus, settings.client_memory_mib, expires)
        made = Made(backend, self.store.add_lease(self.run_id, spec.cell_id, host, backend.name, spec.name, expires))
        with self._lock:
            self.made[host] = made
        try:
            made.vm = backend.clone(image, spec)
            if self.leases is not None:
                self.leases.track(backend, made.vm, made.lease_id)
            backend.start(made.vm)
            address = backend.wait_ready(made.vm)
            made.guest = backend.guest(made.vm, base)
            made.guest.connect(timeout=settings.ssh_timeout)
        except BaseException:
            with shielded():
                self.failures += self.close(host)
            raise
        return VmClient(address, made.guest, spec.name)

    def close(self, host: str) -> list[str]:
        """Destroy `host`'s client VM, if one was made; what could not be done, in words."""
        with self._lock:
            made = self.made.pop(host, None)
        if made is None:
            return []
        if made.guest is not None:
            made.guest.close()
        if self.leases is not None:
            self.leases.untrack(made.lease_id)
        if made.vm is not None:
            try:
                made.backend.destroy(made.vm)
            except LabError as exc:
                return [f"{host}: client VM {made.vm.name}: {exc}"]  # its lease stays for `lab gc`
        self.store.release_lease(made.lease_id)
        return []

    def close_all(self) -> list[str]:
        """Destroy every client VM left; every destroy that failed in the run, in words."""
        with self._lock:
            hosts = list(self.made)
        for host in hosts:
            self.failures += self.close(host)
        return self.failures
