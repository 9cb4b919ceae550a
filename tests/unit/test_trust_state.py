"""Issue 16: local state another local user could plant. The lab's state directory and workdirs
are this user's alone (mode 0700; refused when someone else owns them or may write to them),
their files are never opened through a symbolic link, and `lab gc` acts only on what the lab
wrote: lock files holding a pid, leases carrying the lab's marker and naming only what the lab
would have made (its run's namespace, its tap, its own cgroup)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from lab import config, runlock, statedir
from lab.backends import default_env, local
from lab.backends.local import kvm, layout
from lab.errors import IncompleteListing, LabError, UsageError
from lab.model import Accel
from lab.runlock import RunLock, RunLocks

NOBODY = 65534


def test_default_state_dir_follows_the_user(monkeypatch, tmp_path):
    monkeypatch.setenv(statedir.STATE_ENV, str(tmp_path / "s"))
    assert statedir.default_dir() == tmp_path / "s"
    monkeypatch.delenv(statedir.STATE_ENV)
    if os.geteuid() == 0:
        assert statedir.default_dir() == Path("/var/lib/lab")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert statedir.default_dir() == tmp_path / "xdg" / "lab"


def test_ensure_makes_a_private_directory_and_check_makes_nothing(tmp_path):
    target = tmp_path / "a" / "state"
    statedir.check(target)  # can be made: nothing is
    assert not (tmp_path / "a").exists()
    assert statedir.ensure(target) == target
    assert target.stat().st_mode & 0o777 == 0o700
    statedir.ensure(target)  # again: fine
    statedir.check(target)


@pytest.mark.parametrize("mode,why", [(0o770, "writable by its group"), (0o777, "writable by group and others")])
def test_a_directory_others_may_write_to_is_refused(tmp_path, mode, why):
    d = tmp_path / "state"
    d.mkdir()
    d.chmod(mode)
    for call in (statedir.check, statedir.ensure):
        with pytest.raises(UsageError, match=why) as err:
            call(d)
        assert "\n" not in str(err.value) and err.value.exit_code == 2


def test_a_symlink_or_a_file_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "state").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsageError, match="is a symbolic link"):
        statedir.ensure(tmp_path / "state")
    (tmp_path / "f").write_text("")
    with pytest.raises(UsageError, match="is not a directory"):
        statedir.check(tmp_path / "f")


def test_a_directory_in_a_parent_anyone_may_write_without_sticky_bit_is_refused(tmp_path):
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    (open_parent / "state").mkdir(mode=0o700)
    with pytest.raises(UsageError, match="anyone may write to"):
        statedir.check(open_parent / "state")
    open_parent.chmod(0o1777)  # like /tmp and /var/tmp: others cannot rename what is ours
    statedir.check(open_parent / "state")


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a directory of another user needs root")
def test_a_directory_owned_by_another_user_is_refused_in_one_line(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(UsageError) as err:
        statedir.ensure(d)
    assert "is owned by" in str(err.value) and "not by this user" in str(err.value)
    assert "refusing it" in str(err.value) and "\n" not in str(err.value)


def test_private_files_are_written_whole_and_never_through_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "f.json").symlink_to(victim)
    with pytest.raises(OSError):
        statedir.read_text(tmp_path / "f.json")
    statedir.write_text(tmp_path / "f.json", "new")  # replaces the link, does not write through it
    assert victim.read_text() == "precious"
    assert not (tmp_path / "f.json").is_symlink() and (tmp_path / "f.json").read_text() == "new"
    assert (tmp_path / "f.json").stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


# -- run locks ------------------------------------------------------------------------------------


def test_a_run_lock_is_never_taken_through_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    lock = tmp_path / "run-x.lock"
    lock.symlink_to(victim)
    with pytest.raises(LabError, match="is a symbolic link: refusing it"):
        RunLock(lock).acquire("test", timeout=1)
    assert victim.read_text() == "precious"
    assert runlock.held(lock) is None and runlock.remove_if_dead(lock) is False and lock.is_symlink()


def test_gc_lists_and_removes_only_lock_files_the_lab_wrote(tmp_path):
    locks = RunLocks(lambda run_id: tmp_path / "locks" / f"remote-h@{run_id}.lock")
    statedir.ensure(tmp_path / "locks")
    locks.path_of("dead").write_text("4242")  # a run killed with -9
    locks.path_of("foreign").write_text("someone else's file\n")  # planted under a lab-like name
    assert [o.run_id for o in locks.owned("remote")] == ["dead"]
    assert runlock.remove_if_dead(locks.path_of("foreign")) is False
    assert locks.path_of("foreign").read_text() == "someone else's file\n"
    assert runlock.remove_if_dead(locks.path_of("dead")) is True


def test_remote_run_locks_live_in_a_private_state_directory(tmp_path):
    locks = RunLocks(lambda run_id: tmp_path / "state" / f"remote-h@{run_id}.lock")
    locks.acquire("r1", "test")
    try:
        assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
        assert locks.live("r1") is True
    finally:
        locks.release("r1")
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    open_locks = RunLocks(lambda run_id: tmp_path / "open" / f"remote-h@{run_id}.lock")
    with pytest.raises(UsageError, match="writable by group and others"):
        open_locks.acquire("r1", "test")


def test_the_lab_config_hands_backends_the_state_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(statedir.STATE_ENV, str(tmp_path / "state"))
    cfg = config.parse({})
    assert cfg.backend_env().state_dir == tmp_path / "state"
    backend = cfg.open_backends(["local"])["local"]
    assert backend.workdir == tmp_path / "state" / "local"  # the default workdir is private state too


# -- the local backend's workdir, leases and KVM cache -------------------------------------------


def backend_in(workdir: Path, **over) -> local.LocalBackend:
    env = default_env()
    env = type(env)(source=env.source, base_dir=env.base_dir, state_dir=workdir.parent / "state", ssh_key=env.ssh_key)
    return local.LocalBackend("local", local.Settings(backend="local", workdir=str(workdir), **over), env)


def lease(vmdir: Path, **over) -> None:
    vmdir.mkdir(exist_ok=True)
    name = vmdir.name
    layout.write_lease(
        vmdir,
        {
            "run_id": layout.run_of(name),
            "vm": name,
            "netns": f"lab-{layout.run_of(name)}",
            "tap": "tap000",
            "expires_at": 1.0,
            **over,
        },
    )


def test_leases_carry_the_marker_and_unmarked_ones_read_empty(tmp_path):
    lease(tmp_path / "lab-r1-c01")
    raw = json.loads((tmp_path / "lab-r1-c01" / layout.LEASE).read_text())
    assert raw["marker"] == layout.MARKER
    assert layout.read_lease(tmp_path / "lab-r1-c01")["run_id"] == "r1"
    (tmp_path / "lab-r2-c01").mkdir()
    (tmp_path / "lab-r2-c01" / layout.LEASE).write_text(json.dumps({"run_id": "r2", "vm": "lab-r2-c01"}))
    assert layout.read_lease(tmp_path / "lab-r2-c01") == {}
    (tmp_path / "lab-r3-c01").mkdir()
    (tmp_path / "lab-r3-c01" / layout.LEASE).symlink_to(tmp_path / "lab-r1-c01" / layout.LEASE)
    assert layout.read_lease(tmp_path / "lab-r3-c01") == {}


def test_a_lease_names_only_what_the_lab_would_have_made(tmp_path):
    cg = Path("/sys/fs/cgroup")
    d = tmp_path / "lab-r1-bm01"
    base = {
        "run_id": "r1",
        "vm": "lab-r1-bm01",
        "netns": "lab-r1-bm01",
        "own_netns": True,
        "cgroup": str(cg / "lab-r1-bm01"),
    }
    assert layout.trusted_handle(d, base, cg) == {
        "dir": str(d),
        "netns": "lab-r1-bm01",
        "own_netns": True,
        "cgroup": str(cg / "lab-r1-bm01"),
    }
    # a planted cgroup path (root would kill every process in it) or namespace is dropped
    assert "cgroup" not in layout.trusted_handle(d, {**base, "cgroup": "/sys/fs/cgroup/system.slice"}, cg)
    assert "cgroup" not in layout.trusted_handle(d, {**base, "cgroup": str(cg / "lab-r1-bm01/../system.slice")}, cg)
    assert "cgroup" not in layout.trusted_handle(d, base, None)
    assert "netns" not in layout.trusted_handle(d, {**base, "netns": "someone-elses"}, cg)
    vm = tmp_path / "lab-r1-c01"
    plain = {"run_id": "r1", "vm": "lab-r1-c01", "netns": "lab-r1", "tap": "tap003"}
    assert layout.trusted_handle(vm, plain, cg) == {
        "dir": str(vm),
        "netns": "lab-r1",
        "own_netns": False,
        "tap": "tap003",
    }
    assert "tap" not in layout.trusted_handle(vm, {**plain, "tap": "eth0"}, cg)
    assert "netns" not in layout.trusted_handle(vm, {**plain, "netns": "lab-r2"}, cg)  # another run's
    # a lease copied from another machine's directory is not this one's
    assert layout.trusted_handle(vm, {**plain, "vm": "lab-r1-c02"}, cg) is None
    assert layout.trusted_handle(vm, {**plain, "run_id": "r2"}, cg) is None
    assert layout.trusted_handle(vm, {}, cg) is None


def test_gc_leaves_planted_directories_leases_and_lock_files_alone(tmp_path):
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    backend = backend_in(work)
    lease(work / "lab-ours-c01")
    planted = {
        "lab-r9-c01": lambda d: (d / layout.LEASE).write_text(
            json.dumps({"run_id": "r9", "vm": "lab-r9-c01", "cgroup": "/sys/fs/cgroup/system.slice"})
        ),
        "lab-r8-c01": lambda d: (d / "disk.qcow2").write_text("not a lease at all"),
        "lab-r7-c01": lambda d: (d / layout.LEASE).symlink_to(work / "lab-ours-c01" / layout.LEASE),
    }
    for name, plant in planted.items():
        (work / name).mkdir()
        plant(work / name)
    (work / "lab-r6-c01").symlink_to(work / "lab-ours-c01")
    (work / "lab-r5.lock").write_text("not a pid")
    owned = backend.list_owned()
    assert [(o.kind, o.name) for o in owned] == [("vm", "lab-ours-c01")]
    for item in owned:
        backend.remove_owned(item)
    assert sorted(p.name for p in work.iterdir()) == [
        "lab-r5.lock",
        "lab-r6-c01",
        "lab-r7-c01",
        "lab-r8-c01",
        "lab-r9-c01",
    ]
    assert (work / "lab-r5.lock").read_text() == "not a pid"


def test_gc_trusts_nothing_in_a_workdir_others_may_write_to(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    lease(work / "lab-r1-c01")
    work.chmod(0o777)
    with pytest.raises(IncompleteListing) as err:
        backend_in(work).list_owned()
    assert err.value.found == [] and "nothing in it was trusted" in err.value.unchecked[0]
    assert (work / "lab-r1-c01" / layout.LEASE).exists()


def test_check_makes_no_workdir_and_refuses_one_others_may_write_to(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(statedir.os, "geteuid", lambda: os.stat(tmp_path).st_uid)
    backend = backend_in(tmp_path / "new" / "work", accel="tcg")
    backend.check()
    assert not (tmp_path / "new").exists()  # checked, not made: exit 2 means nothing was created
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o775)
    with pytest.raises(
        UsageError, match=r"host 'local': workdir .*shared is writable by its group \(mode 0775\): refusing it"
    ):
        backend_in(tmp_path / "shared", accel="tcg").check()
    # a warm_dir shared by workdirs: root restores guest memory found there, so the same rule
    with pytest.raises(
        UsageError, match=r"host 'local': warm_dir .*shared is writable by its group \(mode 0775\): refusing it"
    ):
        backend_in(tmp_path / "new" / "work", accel="tcg", warm_dir=str(tmp_path / "shared")).check()


def test_the_kvm_verdict_is_read_and_written_without_following_links(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text(json.dumps({"key": "k", "accel": "kvm"}))
    cache = tmp_path / "state" / kvm.KVM_PROBE_FILE
    statedir.ensure(cache.parent)
    cache.symlink_to(victim)
    assert kvm.cached(cache, "k") is None  # a planted verdict is not believed
    statedir.write_text(cache, json.dumps({"key": "k", "accel": "tcg"}))
    assert kvm.cached(cache, "k") is Accel.TCG and json.loads(victim.read_text())["accel"] == "kvm"


@pytest.mark.parametrize(
    "key,value,problem",
    [
        ("workdir", "relative/dir", "absolute path"),
        ("workdir", "/", "directory of its own"),
        ("workdir", "/var/tmp/../etc", "directory of its own"),
        ("workdir", "/var/tmp/a\nb", "control character"),
        ("warm_dir", "relative/dir", "absolute path"),
        ("warm_dir", "/", "directory of its own"),
        ("subnet", "10.77.0.0", "first three octets"),
        ("subnet", "10.300.0", "first three octets"),
        ("subnet", "127.0.0", "usable unicast"),
        ("subnet", "0.1.2", "usable unicast"),
    ],
)
def test_local_workdir_and_subnet_are_checked_as_lab_toml_is_read(key, value, problem):
    from lab.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        config.parse({"hosts": {"local": {"backend": "local", key: value}}}, "x.toml")
    assert f"hosts.local.{key}" in str(err.value) and problem in str(err.value)


def test_subnet_octets_are_normalised():
    assert local.Settings(backend="local", subnet="010.77.000").subnet == "10.77.0"
