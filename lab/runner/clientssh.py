"""client = "ssh:USER@MACHINE": a host's load generators on a machine of the user's, over SSH.

A machine beside the hosts (in the same rack, on the hosts' network) measures their guests
without the path from this machine in the figures, and without a VM made for the run. The lab
logs in with OpenSSH (lab.guest: one multiplexed connection, BatchMode), with `client_identity`
or ssh's own keys, and checks the machine's host key against `client_known_hosts` strictly: an
unknown or changed key is refused, never accepted. iperf3, wrk and curl run there (VmClient), the
client load under each sample is its /proc/stat (so it must be a Linux machine), and hosts that
name the same machine take turns on it (lab.clients.turn_key).

`check` logs in once per machine before anything is made: a machine that cannot be reached is a
one-line error naming `hosts.NAME.client` (exit 2).
"""

from __future__ import annotations

import threading

from lab import clients, paths, statedir
from lab.backends import Backend
from lab.errors import ConfigError, LabError, UnreachableError
from lab.guest import Guest
from lab.runner.clientvm import VmClient

LOGIN_TIMEOUT_S = 30.0


def guest_for(placement: str, settings, netns: str | None) -> Guest:
    """An SSH connection (not yet open) to the machine `placement` names."""
    target = clients.ssh_target(placement)
    if target is None:
        raise ValueError(f"not an ssh client placement: {placement!r}")
    user, machine = target
    identity = statedir.expand_user(settings.client_identity) if settings.client_identity else None
    return Guest(
        machine,
        key=identity,
        user=user,
        port=settings.client_port,
        netns=netns,
        known_hosts_file=statedir.expand_user(settings.client_known_hosts),
    )


def check(source: str, host: str, backend: Backend) -> None:
    """Log in to `host`'s client machine once and read its CPU counters. Raises UnreachableError
    or ConfigError naming hosts.HOST.client (nothing is made yet)."""
    settings = backend.settings
    where = f"{source}: hosts.{host}.client = {settings.client!r}"
    try:
        known = statedir.expand_user(settings.client_known_hosts)
    except ValueError as exc:  # the default ~/.ssh/known_hosts of a user with no home
        raise ConfigError(source, f"hosts.{host}.client_known_hosts", settings.client_known_hosts, str(exc)) from None
    why = paths.not_regular(known)
    if why:
        raise ConfigError(
            source,
            f"hosts.{host}.client_known_hosts",
            settings.client_known_hosts,
            f"{'no such file' if not known.exists() else why}: the client machine's host key is checked against it",
            hint=f"ssh -p {settings.client_port} {settings.client.removeprefix(clients.SSH_PREFIX)} once and "
            "check the key it shows, or name the file with client_known_hosts",
        )
    guest = guest_for(settings.client, settings, backend.outside_netns())
    try:
        res = guest.run("head -n 1 /proc/stat", timeout=LOGIN_TIMEOUT_S, check=False)
    except LabError as exc:  # ssh itself did not answer in time
        raise UnreachableError(f"{where}: cannot log in over SSH: {exc}") from None
    finally:
        guest.close()
    said = (res.stderr.strip().splitlines() or ["no answer"])[-1]
    if res.returncode == 255:  # ssh's own failure: unreachable, refused key, unknown host key
        raise UnreachableError(
            f"{where}: cannot log in over SSH: {said}",
            hint="check `ssh -p PORT USER@MACHINE` from here, client_identity and client_known_hosts",
        )
    if not res.stdout.startswith("cpu "):
        raise ConfigError(
            source,
            f"hosts.{host}.client",
            settings.client,
            "the client machine has no Linux /proc/stat (its load is read there): "
            f"{said if res.returncode else res.stdout.strip()[:80]!r}",
        )


class SshClients:
    """The run's client machines, by host: logged in to in a host's set-up (`open`, from any lane's
    thread), logged out of at the run's end (`close_all`). Nothing is made on them but processes
    of the lab's workloads, which stop with their SSH sessions."""

    def __init__(self) -> None:
        self.open_guests: dict[str, Guest] = {}
        self._lock = threading.Lock()

    def open(self, host: str, backend: Backend) -> VmClient:
        settings = backend.settings
        guest = guest_for(settings.client, settings, backend.outside_netns())
        with self._lock:
            self.open_guests[host] = guest
        guest.connect(timeout=LOGIN_TIMEOUT_S)
        address = settings.client_machine_address or guest.address
        return VmClient(address, guest, guest.target)

    def close_all(self) -> None:
        with self._lock:
            guests, self.open_guests = list(self.open_guests.values()), {}
        for guest in guests:
            guest.close()
