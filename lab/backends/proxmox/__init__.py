"""The Proxmox VE backend (its code: lab.backends.proxmox.backend, loaded on first use: importing the
package for its settings does not load proxmoxer)."""

import importlib
import importlib.util


def __getattr__(name: str):
    # `from lab.backends.proxmox import tls` asks the package for a submodule not loaded yet: load
    # that module, not the backend (which imports the asker: a cycle)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    return getattr(importlib.import_module("lab.backends.proxmox.backend"), name)
