"""Third octets for the tests' own bridges (10.78.<n>.0/24, 10.79.<n>.0/24): the libvirt tests run
on both xdist workers, so each worker picks from a range of its own, and two workers never pick
the same free subnet at the same moment. Outside xdist (one process, or tests/support/chaos.py) all of it."""

from __future__ import annotations

import os
import secrets

from lab import proc


def octets() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        start = 100 + 50 * (int(worker[2:]) % 2)
        return range(start, start + 50)
    return range(100, 200)


def free(prefix: str, *, tries: int = 50) -> int | None:
    """A random third octet of this worker's range that no address of this machine has as
    `<prefix>.<n>.`, or None."""
    used = proc.run(["ip", "-4", "-o", "addr", "show"], timeout=10).stdout
    choices = octets()
    for _ in range(tries):
        n = choices[secrets.randbelow(len(choices))]
        if f" {prefix}.{n}." not in used:
            return n
    return None
