"""Issue 35, ownership and leases: a lease says whose run made a machine (lab.lease: this state
directory's tag and the run's nonce) and is renewed while the run lives (lab.runner.renewal), so
`lab gc` or the sweep of a run elsewhere never takes a live run's machine for a leftover, two stores
using one `--run-id` never take each other's, and a dead run of this machine is known dead without
waiting for its lease. The Vagrant backend's work directory is held to the state directory's rules,
and Vagrant runs only where the lab's own lease is."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import fakes.backend as fake
import pytest
from fakes.vagrant import FakeVagrant, FakeVirsh

from lab import config, gc, lease, runlock, runner, statedir
from lab.backends import default_env
from lab.backends.vagrant import backend as vb, lease as vlease, machines
from lab.backends.vagrant.settings import Settings as VagrantSettings
from lab.errors import IncompleteListing, LabError
from lab.model import ImageRef, NicModel, Owned, Vm, VmSpec
from lab.runner.renewal import Renewal
from lab.store import Store

OTHER_MACHINE = "0123456789ab"


# -- the owner --------------------------------------------------------------------------------------------


def test_the_machine_tag_is_made_once_privately_and_owners_carry_it(tmp_path):
    state = tmp_path / "state"
    assert lease.machine_tag(state) == ""  # read: nothing is made
    assert not state.exists()
    a, b = lease.new_owner(state), lease.new_owner(state)
    tag = lease.machine_tag(state)
    assert a != b and lease.machine_of(a) == lease.machine_of(b) == tag and len(tag) == 12
    assert state.stat().st_mode & 0o777 == 0o700 and (state / lease.TAG_FILE).stat().st_mode & 0o777 == 0o600
    assert lease.machine_of("nightly") == "" and lease.owner_or_empty("x; rm -rf /") == ""
    (state / lease.TAG_FILE).unlink()
    (state / lease.TAG_FILE).symlink_to(tmp_path / "elsewhere")  # planted: never followed, never the tag
    assert lease.machine_tag(state) == ""


class Locks:
    """A backend's run_is_live as a table (None: this machine cannot tell)."""

    def __init__(self, **live):
        self.live = live

    def run_is_live(self, run_id):
        return self.live.get(run_id)


@pytest.mark.parametrize(
    "owner,backend_says,store_owners,expected",
    [
        ("HERE-111111111111", None, set(), False),  # ours, its lock is gone: dead, whatever the lease
        ("HERE-111111111111", True, set(), True),
        (f"{OTHER_MACHINE}-222222222222", False, set(), None),  # another machine's: only its lease
        (f"{OTHER_MACHINE}-222222222222", None, {"x"}, None),  # the same run id in this store, not its run
        (f"{OTHER_MACHINE}-222222222222", None, {f"{OTHER_MACHINE}-222222222222"}, False),  # this store's run
        ("", None, {"x"}, False),  # a lease without an owner: as before (this store's run of that id)
        ("", True, set(), True),
    ],
)
def test_gc_asks_only_who_can_know(tmp_path, owner, backend_says, store_owners, expected):
    here = "abcdefabcdef"
    owner = owner.replace("HERE", here)
    item = Owned("b", "vm", "lab-nightly-c01", "nightly", time.time() + 3600, owner=owner)
    ours = {"nightly": store_owners} if store_owners else {}
    assert gc.liveness(Locks(nightly=backend_says), item, ours, tmp_path, here) is expected


# -- two stores, one run id, one cluster ---------------------------------------------------------------


def test_a_sweep_never_takes_another_stores_vm_of_the_same_run_id(fake_lab, tmp_path):
    """Store Y ran `nightly` and finished; store X's `nightly`, on another machine, has a VM up on
    the same host. Y's gc leaves it while its lease is fresh; a VM of Y's own run goes."""
    fake_lab.write()
    cfg = fake_lab.load()
    store = Store(cfg.results_dir)
    mine = lease.new_owner(statedir.default_dir())
    store.create_run(
        "nightly", "y", config_path="", config_text="", seed=1, lab_version="0", manifest={"owners": [mine]}
    )
    store.finish_run("nightly", "done")
    store.close()
    image = ImageRef("debian12", "debian", Path("/x"), "d")
    for name, owner in (("lab-nightly-c01", f"{OTHER_MACHINE}-aaaaaaaaaaaa"), ("lab-nightly-c02", mine)):
        spec = VmSpec(name, "nightly", name[-3:], image, NicModel.VIRTIO, 1, 512, expires_at=time.time() + 60)
        fake.LIVE[name] = Vm(dataclasses.replace(spec, owner=owner), "fake", {"name": name})
    report = gc.collect(cfg, hosts=["f"], here=OTHER_MACHINE.replace("0", "f"))
    assert "lab-nightly-c01" in fake.LIVE and "lab-nightly-c02" not in fake.LIVE, report.lines
    assert any("keep   f vm lab-nightly-c01 (lease not expired" in line for line in report.lines)
    gc.collect(cfg, hosts=["f"], now=time.time() + 120)  # its run stopped renewing it: it goes
    assert fake.LIVE == {}


# -- renewal ---------------------------------------------------------------------------------------------


def test_renewal_moves_the_lease_of_what_stands_and_stops_before_teardown(fake_lab):
    fake_lab.write()
    cfg = fake_lab.load()
    backend = cfg.open_backends(["f"])["f"]
    store = Store(cfg.results_dir)
    image = ImageRef("debian12", "debian", Path("/x"), "d")
    vm = backend.clone(image, VmSpec("lab-r-c01", "r", "c01", image, NicModel.VIRTIO, 1, 512, expires_at=1.0))
    lease_id = store.add_lease("r", "c01", "f", "fake", vm.name, 1.0)
    warned: list[str] = []
    renewal = Renewal(store, 0.05, warned.append)
    assert renewal.interval == 1.0  # a third of 3 s, at least a second
    renewal.track(backend, vm, lease_id)
    renewal.renew_all()
    assert fake.EXPIRES[vm.name] > time.time() + 2 and store.open_leases()[0]["expires_at"] > time.time() + 2
    renewal.untrack(lease_id)
    fake.JOURNAL.clear()
    renewal.renew_all()
    assert fake.JOURNAL == [] and warned == []  # untracked: never renewed again
    store.close()


def test_a_failing_renewal_is_one_warning_then_one_line_when_it_recovers(fake_lab):
    fake_lab.write(host="renew_fails = true")
    cfg = fake_lab.load()
    backend = cfg.open_backends(["f"])["f"]
    store = Store(cfg.results_dir)
    image = ImageRef("debian12", "debian", Path("/x"), "d")
    vm = backend.clone(image, VmSpec("lab-r-c01", "r", "c01", image, NicModel.VIRTIO, 1, 512, expires_at=1.0))
    warned: list[str] = []
    renewal = Renewal(store, 1, warned.append)
    renewal.track(backend, vm, store.add_lease("r", "c01", "f", "fake", vm.name, 1.0))
    for _ in range(3):
        renewal.renew_all()
    assert warned == [
        "could not renew the lease of lab-r-c01: lab-r-c01: the host refused the new lease (fake) (trying again)"
    ]
    backend.settings = backend.settings.model_copy(update={"renew_fails": False})
    renewal.renew_all()
    assert warned[1:] == ["renewed the lease of lab-r-c01 again"] and renewal.renewed == 1
    store.close()


def test_a_run_longer_than_its_lease_keeps_its_vm_while_another_machines_gc_runs(fake_lab):
    """lease_minutes = 0.05 (3 s), a run of ~6 s: a gc that cannot ask this machine's locks (another
    machine's, simulated by its tag) runs at 4.5 s, after the first lease would have expired, and
    keeps the VM; the run ends as it would have, and its VM's lease was renewed on the way."""
    fake_lab.write(suite="repetitions = 3\nwarmup = 0\n[suite.params.fake-work]\nsleep_s = 2.0\n")
    text = fake_lab.path.read_text().replace('results = "results"', 'results = "results"\nlease_minutes = 0.05')
    fake_lab.path.write_text(text)
    cfg = fake_lab.load()
    elsewhere = fake_lab.dir / "elsewhere"  # the other machine's lab: its own store, the same host
    elsewhere.mkdir()
    (elsewhere / "lab.toml").write_text(text)
    other = config.load(elsewhere / "lab.toml")
    store = Store(cfg.results_dir)
    seen: dict = {}

    def other_machine_gc():
        time.sleep(4.5)
        seen["live"] = set(fake.LIVE)
        seen["report"] = gc.collect(other, hosts=["f"], here="f" * 12)
        seen["after"] = set(fake.LIVE)

    t = threading.Thread(target=other_machine_gc)
    t.start()
    rid = runner.run_lab(cfg, store)
    t.join()
    name = f"lab-{rid}-c01"
    assert seen["live"] == {name} == seen["after"], seen["report"].lines  # kept: its lease was fresh
    assert store.run(rid).status == "done" and [c.status for c in store.cells(rid)] == ["done"]
    assert ("renew", name) in fake.JOURNAL and fake.LIVE == {}
    owners = store.run(rid).manifest["owners"]
    assert len(owners) == 1 and lease.machine_of(owners[0]) == lease.machine_tag(statedir.default_dir())
    store.close()


# -- the Vagrant backend's work directory -------------------------------------------------------------------


def vagrant(tmp_path: Path, **settings) -> vb.VagrantBackend:
    state = tmp_path / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    env = dataclasses.replace(default_env(), state_dir=state)
    b = vb.VagrantBackend("vg", VagrantSettings(backend="vagrant", **settings), env)
    b.virsh = FakeVirsh({}, [], [])
    b.vagrant = FakeVagrant()
    return b


def test_the_default_workdir_is_in_the_private_state_directory(tmp_path):
    b = vagrant(tmp_path)
    assert b.workdir == tmp_path / "state" / "vagrant"


def test_a_planted_vagrantfile_is_never_run(tmp_path):
    """Directories under the work directory that the lab did not make, with lease.json files that
    are not the lab's: gc lists none and runs `vagrant destroy` in none."""
    work = tmp_path / "work"
    b = vagrant(tmp_path, workdir=str(work))
    planted = {
        "no-marker": {"run": "r1", "cell": "c01", "expires": 1, "domain": "lab-r1-c01"},
        "other-dir": {"run": "r9", "cell": "c01", "expires": 1, "domain": "lab-r9-c01", "marker": vlease.FILE_MARKER},
    }
    for mdir, lease_ in (
        (work / "r1" / "lab-r1-c01", planted["no-marker"]),
        (work / "r1" / "lab-r1-c02", planted["other-dir"]),  # names another directory
    ):
        mdir.mkdir(parents=True)
        (mdir / vlease.LEASE_FILE).write_text(json.dumps(lease_))
        (mdir / "Vagrantfile").write_text('system("touch /tmp/pwned")\n')
    real = work / "r2" / "lab-r2-c01"
    real.mkdir(parents=True)
    vlease.write_lease(real, {"run": "r2", "cell": "c01", "expires": 1, "domain": "lab-r2-c01"})
    (work / "r3").mkdir()
    (work / "r3" / "lab-r3-c01").symlink_to(real)  # a link to the lab's own directory: not trusted
    items = b.list_owned()
    assert [(o.kind, o.name) for o in items] == [("vm", "lab-r2-c01")]
    for name in ("lab-r1-c01", "lab-r1-c02", "lab-r3-c01"):
        b.remove_owned(Owned("vagrant", "vm", name, name.split("-")[1], 1.0, json.dumps({"dir": ""})))
    assert b.vagrant.calls == []  # vagrant ran nowhere
    assert (work / "r1" / "lab-r1-c01" / "Vagrantfile").exists() and (work / "r1" / "lab-r1-c02").exists()


def test_a_workdir_others_may_write_to_is_trusted_for_nothing(tmp_path):
    work = tmp_path / "work"
    b = vagrant(tmp_path, workdir=str(work))
    mdir = work / "r1" / "lab-r1-c01"
    mdir.mkdir(parents=True)
    vlease.write_lease(mdir, {"run": "r1", "cell": "c01", "expires": 1, "domain": "lab-r1-c01"})
    (mdir / "Vagrantfile").write_text("")
    work.chmod(0o777)
    with pytest.raises(IncompleteListing, match="writable by group and others"):
        b.list_owned()
    with pytest.raises(LabError, match="writable by group and others"):
        b.check()
    b.remove_owned(Owned("vagrant", "vm", "lab-r1-c01", "r1", 1.0, json.dumps({"dir": str(mdir)})))
    assert b.vagrant.calls == [] and mdir.exists()


def test_a_define_that_lands_after_gc_removed_the_machine_goes_too(tmp_path, monkeypatch):
    """A run killed mid `vagrant up`: gc stops its vagrant, destroys the machine, and a domain define
    that was still on its way to libvirtd, landing a moment later, is removed in the same pass."""
    work = tmp_path / "work"
    b = vagrant(tmp_path, workdir=str(work))
    mdir = work / "r1" / "lab-r1-c01"
    mdir.mkdir(parents=True, mode=0o700)
    vlease.write_lease(mdir, {"run": "r1", "cell": "c01", "expires": 1, "domain": "lab-r1-c01"})
    (mdir / "Vagrantfile").write_text("")
    text = vlease.lease_text("r1", "c01", time.time() + 3600, "vg", "abcdefabcdef-111111111111")

    class Late(FakeVirsh):
        def remove_domain(self, name):
            super().remove_domain(name)
            if self.removed.count(f"domain {name}") == 1:  # the define still in flight lands again
                threading.Timer(1.0, lambda: self.domains_.__setitem__(name, text)).start()

    b.virsh = Late({"lab-r1-c01": text}, [], [])
    stopped = []
    monkeypatch.setattr(machines, "processes_in", lambda d: [] if stopped else [12345])
    monkeypatch.setattr(machines, "stop_processes_in", lambda d, timeout=30.0: stopped.append(d))
    monkeypatch.setattr(machines, "SETTLE_S", 3.0)
    (item,) = [o for o in b.list_owned() if o.kind == "vm"]
    assert item.owner == "abcdefabcdef-111111111111"
    b.remove_owned(item)
    assert stopped == [mdir] and b.virsh.removed.count("domain lab-r1-c01") == 2
    assert "lab-r1-c01" not in b.virsh.domains_ and not mdir.exists()


def test_a_dead_runs_domain_is_removed_whatever_its_lease_says(fake_lab, tmp_path):
    """The define that lands later still: the next gc finds a domain whose owner is this machine's
    run, and that run's lock is gone: dead, removed now, not when its lease expires."""
    here = lease.machine_tag(statedir.default_dir(), create=True)
    item = Owned("vagrant", "vm", "lab-r1-c01", "r1", time.time() + 3600, owner=f"{here}-111111111111")
    assert gc.liveness(Locks(), item, {}, tmp_path, here) is False
    lock = tmp_path / "vagrant-vg@r1.lock"
    held = runlock.RunLock(lock)
    held.acquire(what="test")
    try:
        backend = vagrant(tmp_path)
        backend._run_locks = runlock.RunLocks(lambda run_id: tmp_path / f"vagrant-vg@{run_id}.lock")
        assert gc.liveness(backend, item, {}, tmp_path, here) is True  # while it lives: kept
    finally:
        held.release()
    assert os.path.exists(lock) is False
