"""The fake backend: makes "VMs" that are records, boots them at once, and hands out FakeGuests.
Everything it made and removed goes into JOURNAL; LIVE holds what is not destroyed yet, which is
what `list_owned` (and so `lab gc`) finds."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fakes.guest import FakeGuest
from fakes.settings import Settings, capabilities
from lab import osfacts
from lab.backends.base import Backend, BackendEnv, Capabilities, PlainClient
from lab.errors import HostUnreachable, IncompleteListing, LabError, TeardownError, UnreachableError
from lab.hostload import HostLoad, LoadWindow
from lab.lifecycle import Interrupted
from lab.model import Client, ImageRef, Owned, Vm, VmSpec

JOURNAL: list[tuple[str, str]] = []  # (event, name): open_run, clone, start, destroy, close_run, ...
LIVE: dict[str, Vm] = {}  # name -> what is still made
GUESTS: dict[str, FakeGuest] = {}  # name -> its last guest
PLACED: dict[str, str] = {}  # name -> the place its spec pinned it to (Capabilities.places)
EXPIRES: dict[str, float] = {}  # name -> its lease's expiry, as renew_lease last moved it


def reset() -> None:
    JOURNAL.clear()
    LIVE.clear()
    GUESTS.clear()
    PLACED.clear()
    EXPIRES.clear()


@dataclass
class FakeBareMetal:
    """The host as a cell (lab.backends.base.BareMetalHost)."""

    vm: Vm
    guest: FakeGuest
    address: str
    facts: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"vcpus": 2, "mem_kib": 4 * 1024 * 1024, "kernel": "Linux 6.1.0-fake", "nic_driver": "veth"}

    def effective_tuning(self) -> dict[str, Any]:
        return {"profile": "host (unchanged)", "applicable": True, "reason": "", "effective": dict(self.guest.sysctl)}

    def start_web(self, image: str) -> str | None:
        return "nginx is not installed on this host (fake)"


class FakeLoadWindow:
    """The host's load over the fake guest's commands: a window in which the guest ran `fake-work N`
    (N >= 0) saw the foreign load the settings inject for that cell and repetition; a window in
    which it ran nothing is a quiet probe, busy for the cell's first `busy_probes`."""

    def __init__(self, backend: FakeBackend, vms: Sequence[Vm]):
        self.backend = backend
        self.cell = vms[0].handle["cell_id"] if vms else ""
        self.guest = GUESTS.get(vms[0].handle["name"]) if vms else None
        self.mark = len(self.guest.commands) if self.guest else 0
        self.started = time.monotonic()

    def stop(self) -> HostLoad:
        s: Settings = self.backend.settings  # type: ignore[assignment]
        ran = self.guest.commands[self.mark :] if self.guest else []
        reps = [int(c.split()[1]) for c in ran if c.startswith("fake-work ") and int(c.split()[1]) >= 0]
        if reps:
            pct = max(
                s.foreign_load.get(f"{self.cell}@{r}", s.foreign_load.get(self.cell, s.foreign_load.get("*", 0.0)))
                for r in reps
            )
        else:
            seen = self.backend.probes[self.cell] = self.backend.probes.get(self.cell, 0) + 1
            pct = 50.0 if seen <= s.busy_probes.get(self.cell, s.busy_probes.get("*", 0)) else 0.0
        JOURNAL.append(("host_load", f"{self.cell}:{pct:g}"))
        return HostLoad(
            seconds=max(time.monotonic() - self.started, 1e-3),
            foreign_pct=pct,
            lab_pct=60.0,
            steal_pct=0.0 if s.steal else None,
            cpus=2,
        )


class FakeBackend(Backend):
    name = "fake"
    settings_model = Settings

    def __init__(self, host_name: str, settings: Settings, env: BackendEnv | None = None):
        super().__init__(host_name, settings, env)
        self.next_address = 10
        self.probes: dict[str, int] = {}  # cell id -> quiet probes made so far
        self.gone = False  # settings.lost reached: the host answers nothing any more
        caps = capabilities(settings)  # the parts, as a real backend makes them: where its capabilities say
        self.bare_metal = FakeBareMetalCells(self) if caps.bare_metal else None
        self.load_meter = FakeLoadMeter(self) if caps.host_load else None
        self.warm = FakeWarm(settings) if caps.snapshots else None

    @classmethod
    def capabilities(cls, settings: Settings) -> Capabilities:  # type: ignore[override]
        return capabilities(settings)

    def _injected(self, cell_id: str, stage: str) -> None:
        """Raise what the settings inject for this cell at this stage of the backend's own work."""
        s: Settings = self.settings  # type: ignore[assignment]
        if (s.interrupt.get(cell_id) or s.interrupt.get("*")) == stage:
            raise Interrupted("SIGINT")
        if (s.fail.get(cell_id) or s.fail.get("*")) == stage:
            exc = TeardownError if stage == "teardown" else LabError
            raise exc(f"{cell_id}: injected failure at {stage}")

    def check(self) -> None:
        if self.host_name.startswith("unreachable"):
            raise UnreachableError(f"host {self.host_name!r}: cannot reach it (fake)")

    def facts(self) -> dict[str, Any]:
        return {"backend": self.name, "accel": "fake"}

    def host_facts(self) -> dict[str, Any]:
        return {"cpu_model": "Fake CPU", "kernel": "6.1.0-fake"}

    def open_run(self, run_id: str) -> Client:
        JOURNAL.append(("open_run", run_id))
        if self.settings.lost == "open_run":  # type: ignore[attr-defined]
            raise HostUnreachable(f"host {self.host_name!r}: connection refused (fake)")
        return PlainClient(address="10.99.0.1")

    def close_run(self, run_id: str) -> None:
        JOURNAL.append(("close_run", run_id))

    def run_is_live(self, run_id: str) -> bool | None:
        return any(run_id == ev[1] for ev in JOURNAL if ev[0] == "open_run") and not any(
            run_id == ev[1] for ev in JOURNAL if ev[0] == "close_run"
        )

    def clone(self, image: ImageRef, spec: VmSpec) -> Vm:
        self.gone = self.gone or spec.cell_id == self.settings.lost  # type: ignore[attr-defined]
        if self.gone:
            raise HostUnreachable(f"host {self.host_name!r}: no answer (fake)")
        self._injected(spec.cell_id, "clone")
        vm = Vm(
            spec=spec, backend=self.name, handle={"name": spec.name, "cell_id": spec.cell_id}, facts={"accel": "fake"}
        )
        LIVE[spec.name] = vm
        JOURNAL.append(("clone", spec.name))
        if spec.place:
            PLACED[spec.name] = spec.place
        return vm

    def start(self, vm: Vm) -> None:
        JOURNAL.append(("start", vm.name))
        if self.settings.boot_s:  # type: ignore[attr-defined]
            time.sleep(self.settings.boot_s)  # type: ignore[attr-defined]
        self._injected(vm.spec.cell_id, "boot")

    def wait_ready(self, vm: Vm, timeout: float | None = None) -> str:
        self.next_address += 1
        vm.address = f"10.99.0.{self.next_address}"
        return vm.address

    def guest(self, vm: Vm, client: Client) -> FakeGuest:
        s: Settings = self.settings  # type: ignore[assignment]
        facts = osfacts.facts(vm.spec.image.os)
        g = FakeGuest(
            address=vm.address,
            facts=facts,
            nic_driver=facts.nic_driver.get(vm.spec.nic, "none"),
            vcpus=vm.spec.vcpus,
            memory_mib=vm.spec.memory_mib,
            lro=s.lro,
            cc_default=s.cc_default,
            fail=s.fail.get(vm.spec.cell_id) or s.fail.get("*"),
            interrupt=s.interrupt.get(vm.spec.cell_id) or s.interrupt.get("*"),
            os=vm.spec.image.os,
            podman="vm" in s.podman,
            docker="vm" in s.docker,
        )
        GUESTS[vm.name] = g
        return g

    def destroy(self, vm: Vm) -> None:
        name = vm.handle["name"]  # the bare-metal cell's Vm has no spec
        JOURNAL.append(("destroy", name))
        self._injected(vm.handle["cell_id"], "teardown")
        LIVE.pop(name, None)

    def console_text(self, vm: Vm) -> str:
        return "".join(f"console line {i}\n" for i in range(1, 30)) + f"{vm.handle['name']}: FAKE-CONSOLE-END\n"

    def renew_lease(self, vm: Vm, expires_at: float) -> None:
        name = vm.handle["name"]
        if name not in LIVE:
            raise LabError(f"{name} is gone: its lease cannot be renewed (fake)")
        if self.settings.renew_fails:  # type: ignore[attr-defined]
            raise LabError(f"{name}: the host refused the new lease (fake)")
        EXPIRES[name] = expires_at
        JOURNAL.append(("renew", name))

    def list_owned(self) -> list[Owned]:
        found = [
            Owned(
                self.name,
                "vm",
                name,
                vm.spec.run_id if vm.spec else name.split("-")[1],
                EXPIRES.get(name, vm.spec.expires_at if vm.spec else 0.0),
                owner=vm.spec.owner if vm.spec else "",
            )
            for name, vm in sorted(LIVE.items())
        ]
        if self.settings.unlisted:  # type: ignore[attr-defined]
            raise IncompleteListing("part of the host could not be listed", found, self.settings.unlisted)  # type: ignore[attr-defined]
        return found

    def remove_owned(self, item: Owned) -> None:
        JOURNAL.append(("remove_owned", item.name))
        LIVE.pop(item.name, None)

    def check_images(self, images: Sequence[ImageRef]) -> None:
        JOURNAL.append(("check_images", ",".join(i.name for i in images)))


class FakeBareMetalCells:
    """The fake host's BareMetalCells part."""

    def __init__(self, backend: FakeBackend):
        self.backend = backend

    def make(self, run_id: str, cell_id: str, index: int, expires_at: float, client: Client) -> FakeBareMetal:
        self.backend._injected(cell_id, "clone")
        name = f"lab-{run_id}-{cell_id}"
        vm = Vm(
            spec=None,
            backend=self.backend.name,
            handle={"name": name, "cell_id": cell_id},  # type: ignore[arg-type]
            address=f"10.99.0.{200 + index}",
        )
        LIVE[name] = vm
        JOURNAL.append(("bare_metal", name))
        s: Settings = self.backend.settings  # type: ignore[assignment]
        guest = FakeGuest(
            address=vm.address,
            facts=osfacts.facts("bare-metal"),
            nic_driver="veth",
            vcpus=2,
            memory_mib=4096,
            os="bare-metal",
            fail=s.fail.get(cell_id) or s.fail.get("*"),
            interrupt=s.interrupt.get(cell_id) or s.interrupt.get("*"),
            podman="bare-metal" in s.podman,
            docker="bare-metal" in s.docker,
        )
        GUESTS[name] = guest
        return FakeBareMetal(vm, guest, vm.address, {"cpu_accounting": "fake"})


class FakeLoadMeter:
    def __init__(self, backend: FakeBackend):
        self.backend = backend

    def window(self, vms: Sequence[Vm]) -> LoadWindow:
        return FakeLoadWindow(self.backend, vms)


class FakeWarm:
    def __init__(self, settings: Settings):
        self.settings = settings

    def snapshots(self) -> list[Owned]:
        return [Owned("fake", "warm", name, "", detail=build) for name, build in self.settings.warm.items()]

    def remove(self, item: Owned) -> None:
        JOURNAL.append(("remove_warm", item.name))


BACKEND = FakeBackend
