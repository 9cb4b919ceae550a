"""The Backend seam: make and remove machines, stop at an SSH address.

Every backend module registers one class in BACKENDS. The orchestrator only talks to this protocol.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lab.model import ImageRef, NicModel, Owned, Vm, VmSpec


@runtime_checkable
class Client(Protocol):
    """Where load generators (iperf3 server, wrk, ssh) run for a given backend, and the address
    by which guests reach it."""

    address: str  # as seen from the guests (iperf3 -c <address>)

    def argv(self, argv: list[str]) -> list[str]:
        """Wrap argv so it runs on the client side (e.g. inside the lab's network namespace)."""
        ...


@runtime_checkable
class Backend(Protocol):
    name: str  # registry key, e.g. "local"
    nic_models: frozenset[NicModel]  # what this backend can emulate

    def check(self) -> None:
        """Reach the host and verify credentials and prerequisites. Raises UsageError subclasses
        (unreachable, auth) before anything is created."""

    def open_run(self, run_id: str) -> Client:
        """Set up per-run infrastructure (network namespace, ...) and return the client side."""

    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        """Create the machine's disk and definition (not started)."""

    def start(self, vm: Vm) -> None:
        """Power on."""

    def wait_ready(self, vm: Vm, timeout: float) -> str:
        """Wait (bounded, event-driven) until the guest answers SSH; return its address."""

    def destroy(self, vm: Vm) -> None:
        """Stop and remove everything clone() and start() made. Idempotent. Raises TeardownError."""

    def close_run(self, run_id: str) -> None:
        """Remove per-run infrastructure. Idempotent."""

    def list_owned(self) -> list[Owned]:
        """Everything on the host that carries a lab run id (VMs, disks, taps, namespaces)."""

    def remove_owned(self, item: Owned) -> None:
        """Remove one thing list_owned() found (for `lab gc`)."""

    def facts(self) -> dict[str, object]:
        """Facts to record with every sample from this backend (accelerator, versions)."""


BACKENDS: dict[str, type] = {}


def register(cls: type) -> type:
    BACKENDS[cls.name] = cls
    return cls


def backend_class(name: str) -> type:
    """The registered class of backend `name`, importing its module on first use (proxmoxer and
    libvirt-python load only when a lab uses them)."""
    if name not in BACKENDS:
        import importlib

        importlib.import_module(f"lab.backends.{name}")
    return BACKENDS[name]
