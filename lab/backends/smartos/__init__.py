"""The SmartOS backend (its code: lab.backends.smartos.backend, loaded on first use: importing the
package for its settings loads nothing else)."""

import importlib


def __getattr__(name: str):
    return getattr(importlib.import_module("lab.backends.smartos.backend"), name)
