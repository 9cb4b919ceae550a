"""The backend registry: name -> package. Each package's `settings` module is light (pydantic only)
and is what lab.config reads; its `backend` module (proxmoxer, libvirt-python) loads only when a
lab uses that backend. A new backend is a package beside these and one line here."""

from __future__ import annotations

import importlib

from lab.backends.base import (
    Backend,
    BackendEnv,
    Capabilities,
    Client,
    HostSettings,
    Link,
    NotSupported,
    PlainClient,
    default_env,
)

REGISTRY: dict[str, str] = {
    "local": "lab.backends.local",
    "libvirt": "lab.backends.libvirt",
    "proxmox": "lab.backends.proxmox",
    "smartos": "lab.backends.smartos",
    "vagrant": "lab.backends.vagrant",
}

__all__ = [
    "REGISTRY",
    "Backend",
    "BackendEnv",
    "Capabilities",
    "Client",
    "HostSettings",
    "Link",
    "NotSupported",
    "PlainClient",
    "backend_class",
    "capabilities",
    "default_env",
    "open_backends",
    "names",
    "register",
    "settings_model",
]


def names() -> list[str]:
    return list(REGISTRY)


def register(name: str, package: str) -> None:
    """Add a backend package (tests register their fake backend this way)."""
    REGISTRY[name] = package


def settings_model(name: str) -> type[HostSettings]:
    """The typed settings of backend `name` (its package's `settings.Settings`)."""
    return importlib.import_module(f"{REGISTRY[name]}.settings").Settings


def capabilities(settings: HostSettings) -> Capabilities:
    """What a host with these settings can make (its package's `settings.capabilities`), from the
    settings alone: no host is contacted, nothing heavy is imported."""
    return importlib.import_module(f"{REGISTRY[settings.backend]}.settings").capabilities(settings)


def backend_class(name: str) -> type[Backend]:
    """The Backend subclass of backend `name` (its package's `backend.BACKEND`)."""
    return importlib.import_module(f"{REGISTRY[name]}.backend").BACKEND


def open_backends(hosts: dict[str, HostSettings], env: BackendEnv) -> dict[str, Backend]:
    """A backend object per host (nothing is contacted yet: `check()` does that)."""
    return {name: backend_class(settings.backend)(name, settings, env) for name, settings in sorted(hosts.items())}
