"""Whether libvirt's QEMU user can open /dev/kvm (lab.backends.libvirt.kvmdevice): the rule, and the
device of a test's own (a file, not the machine's /dev/kvm)."""

from __future__ import annotations

import grp
import os
import pwd
import stat

import pytest

from lab import doctor
from lab.backends.libvirt import kvmdevice

CHR = stat.S_IFCHR


@pytest.mark.parametrize(
    "mode,owner,group,uid,gids,ok",
    [
        (0o600, 0, 0, 64055, {108}, False),  # this machine's: root's alone
        (0o660, 0, 108, 64055, {108, 64055}, True),  # udev's rule: root:kvm 0660
        (0o660, 0, 108, 64055, {64055}, False),  # a user outside the group
        (0o640, 0, 108, 64055, {108}, False),  # the group may read, not write
        (0o606, 0, 0, 64055, set(), True),  # anyone may
        (0o600, 64055, 0, 64055, set(), True),  # the user's own
        (0o000, 5, 5, 0, set(), True),  # root opens anything
    ],
)
def test_the_rule_of_owner_group_and_others(mode, owner, group, uid, gids, ok):
    why = kvmdevice.problem(CHR | mode, owner, group, uid, gids)
    assert (why is None) == ok
    if not ok:
        assert f"mode {mode:04o}" in why and f"owner uid {owner}" in why


def a_user_not_root() -> pwd.struct_passwd:
    return next(p for p in pwd.getpwall() if p.pw_uid != 0)


def test_the_devices_line_names_it_the_user_and_the_fix(tmp_path):
    dev = tmp_path / "kvm"
    dev.write_text("")
    dev.chmod(0o600)
    user = a_user_not_root()
    line = kvmdevice.qemu_user_problem(str(dev), user.pw_name)
    assert line is not None and line.startswith(f"{dev} is not read-write for {user.pw_name} (mode 0600")
    assert "chmod 660" in line
    dev.chmod(0o666)
    assert kvmdevice.qemu_user_problem(str(dev), user.pw_name) is None


def test_no_device_or_no_such_user_is_no_problem(tmp_path):
    assert kvmdevice.qemu_user_problem(str(tmp_path / "absent"), a_user_not_root().pw_name) is None
    dev = tmp_path / "kvm"
    dev.write_text("")
    dev.chmod(0o600)
    assert kvmdevice.qemu_user_problem(str(dev), "no-such-user-here") is None


def test_grant_group_is_udevs_rule(tmp_path):
    dev = tmp_path / "kvm"
    dev.write_text("")
    dev.chmod(0o600)
    group = grp.getgrgid(os.getgid()).gr_name
    assert kvmdevice.grant_group(str(dev), group)
    st = dev.stat()
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
    assert not kvmdevice.grant_group(str(tmp_path / "absent"), group)
    assert not kvmdevice.grant_group(str(dev), "no-such-group-here")


def test_doctor_warns_when_libvirt_would_reprobe(monkeypatch, tmp_path):
    monkeypatch.setattr(kvmdevice, "qemu_user_problem", lambda: "/dev/kvm is not read-write for libvirt-qemu (...)")
    checks = {c.name: c for c in doctor.run_checks(str(tmp_path / "lab.toml"))}
    assert checks["kvm for libvirt"].status == "warn" and "libvirt-qemu" in checks["kvm for libvirt"].detail
    monkeypatch.setattr(kvmdevice, "qemu_user_problem", lambda: None)
    assert "kvm for libvirt" not in {c.name for c in doctor.run_checks(str(tmp_path / "lab.toml"))}
