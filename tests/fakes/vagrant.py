"""The vagrant backend's outside world for tests without Vagrant or libvirt: virsh's domains, volumes and
networks, and the vagrant commands run (tests/unit/test_vagrant_unit.py, tests/contract/test_trust_leases.py)."""

from __future__ import annotations

from lab import proc


class FakeVirsh:
    def __init__(self, domains: dict[str, str], volumes: list[str], networks: list[str]):
        self.domains_, self.volumes_, self.networks_ = dict(domains), list(volumes), list(networks)
        self.removed: list[str] = []

    def domains(self):
        return list(self.domains_)

    def description(self, name):
        return self.domains_.get(name)

    def volumes(self, pool):
        return [(v, f"/pool/{v}") for v in self.volumes_]

    def networks(self):
        return list(self.networks_)

    def remove_domain(self, name):
        self.removed.append(f"domain {name}")
        self.domains_.pop(name, None)

    def remove_volume(self, pool, name):
        if name in self.volumes_:
            self.removed.append(f"volume {name}")
            self.volumes_.remove(name)

    def remove_network(self, name):
        if name in self.networks_:
            self.removed.append(f"network {name}")
            self.networks_.remove(name)


class FakeVagrant:
    def __init__(self):
        self.calls: list[tuple[list[str], str]] = []

    def global_status(self):
        return []

    def run(self, args, *, timeout, what, cwd=None, check=True):
        self.calls.append((list(args), str(cwd)))
        return proc.Result(["vagrant", *args], 0, "", "", 0.0)
