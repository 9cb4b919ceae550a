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
    "host_lanes",
    "lanes_at_once",
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


def host_lanes(host: str, settings: HostSettings) -> list[tuple[str, str]]:
    """The lanes a host has in a run (lab.runner.lanes), as (name, place): `slots` of each of its
    places (Capabilities.places: a Proxmox cluster's nodes), or of the host itself. Named "host",
    "host/2", ...; with places "host@place", "host@place/2", ..."""
    out: list[tuple[str, str]] = []
    for place in capabilities(settings).places or ("",):
        base = f"{host}@{place}" if place else host
        out += [(base if k == 0 else f"{base}/{k + 1}", place) for k in range(settings.slots)]
    return out


def lanes_at_once(host: str, settings: HostSettings, cells: int) -> int:
    """How many of a host's lanes a run of `cells` of its cells uses: each lane gets one at least."""
    return max(1, min(len(host_lanes(host, settings)), cells))


def backend_class(name: str) -> type[Backend]:
    """The Backend subclass of backend `name` (its package's `backend.BACKEND`)."""
    return importlib.import_module(f"{REGISTRY[name]}.backend").BACKEND


def open_backends(hosts: dict[str, HostSettings], env: BackendEnv) -> dict[str, Backend]:
    """A backend object per host (nothing is contacted yet: `check()` does that)."""
    return {name: backend_class(settings.backend)(name, settings, env) for name, settings in sorted(hosts.items())}
