"""Where a host's load generators run (`[hosts.NAME] client`), as words the runner, the estimate,
the plan and lab.toml's checks share. Pure: no I/O.

- "local": this machine. Every host with it takes its network turns here.
- "vm": a client VM the run makes on the host (lab.runner.clientvm), that host's alone.
- "ssh:USER@MACHINE": a machine of the user's, over SSH (lab.runner.clientssh). Hosts naming the
  same MACHINE share it, so they take turns on it.
"""

from __future__ import annotations

LOCAL = "local"
VM = "vm"
SSH_PREFIX = "ssh:"


def ssh_target(placement: str) -> tuple[str, str] | None:
    """(user, machine) of "ssh:USER@MACHINE"; None for any other placement or a malformed one."""
    if not placement.startswith(SSH_PREFIX):
        return None
    user, at, machine = placement.removeprefix(SSH_PREFIX).partition("@")
    if not (at and user and machine) or user.startswith("-") or machine.startswith("-"):
        return None  # "-..." would be read by ssh as an option
    if any(ch.isspace() or ch in "@/'\"\\" for ch in user + machine):
        return None
    return user, machine


def valid(placement: str) -> bool:
    return placement in (LOCAL, VM) or ssh_target(placement) is not None


def turn_key(host: str, placement: str) -> str:
    """The lock a network measurement of `host` holds (RunContext.client_locks): one per machine
    that runs load generators, so no two measurements go through one client at once."""
    target = ssh_target(placement)
    if target is not None:
        return f"{SSH_PREFIX}{target[1].lower()}"
    return LOCAL if placement == LOCAL else f"{placement}:{host}"


def describe(host: str, placement: str, *, vcpus: int = 0, memory_mib: int = 0, port: int = 22) -> str:
    """Where `host`'s load generators run, in words for `lab plan` ("" for this machine)."""
    if placement == VM:
        return (
            f"host {host}: its load generators run in a client VM the run makes there ({vcpus} vCPUs, "
            f"{memory_mib} MiB, virtio, from its first cell's image), destroyed with the run"
        )
    target = ssh_target(placement)
    if target is not None:
        user, machine = target
        return f"host {host}: its load generators run on {user}@{machine} (port {port}) over SSH"
    return ""
