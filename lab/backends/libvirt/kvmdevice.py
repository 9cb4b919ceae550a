"""Whether libvirt's QEMU user can open /dev/kvm, on a machine whose libvirtd is this one's.

libvirt (9.0, Debian 12) probes each QEMU binary's capabilities once and caches them, and keeps
the cache only while "KVM usable" reads as it did at the probe. The probe finds KVM (libvirtd runs
it as root); "usable" is asked as the QEMU user (libvirt-qemu). With /dev/kvm 0600 root:root, as on
a machine without udev's rule (`KERNEL=="kvm", GROUP="kvm", MODE="0660"`), the two never agree: the
cache is stale at every look, and every domain define, start or restore probes all of QEMU again,
about 30 s each on our 2-core machines. Domains of type "qemu" (TCG, our default) are slowed the
same, though they never use KVM.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat

DEVICE = "/dev/kvm"
QEMU_USER = "libvirt-qemu"  # Debian's; the QEMU driver's `user` in qemu.conf
GROUP = "kvm"


def problem(mode: int, owner: int, group: int, user_uid: int, user_gids: set[int]) -> str | None:
    """Why a user (uid, groups) cannot read and write a device of this mode and ownership; None if it can."""
    if user_uid == 0:
        return None
    if user_uid == owner:
        bits = (mode & stat.S_IRUSR) and (mode & stat.S_IWUSR)
    elif group in user_gids:
        bits = (mode & stat.S_IRGRP) and (mode & stat.S_IWGRP)
    else:
        bits = (mode & stat.S_IROTH) and (mode & stat.S_IWOTH)
    if bits:
        return None
    return f"mode {stat.S_IMODE(mode):04o}, owner uid {owner}, group gid {group}"


def qemu_user_problem(device: str = DEVICE, user: str = QEMU_USER) -> str | None:
    """One line on why libvirt's QEMU user cannot open `device` here; None when it can, or when
    there is no such device or user (no KVM, or no libvirt)."""
    try:
        st = os.stat(device)
        pw = pwd.getpwnam(user)
    except (OSError, KeyError):
        return None
    gids = {pw.pw_gid} | {g.gr_gid for g in grp.getgrall() if user in g.gr_mem}
    why = problem(st.st_mode, st.st_uid, st.st_gid, pw.pw_uid, gids)
    if why is None:
        return None
    return (
        f"{device} is not read-write for {user} ({why}): libvirt then probes QEMU again at every "
        f"domain define and start (about 30 s each); `chgrp {GROUP} {device} && chmod 660 {device}`, "
        "as udev's rule does"
    )


def grant_group(device: str = DEVICE, group: str = GROUP) -> bool:
    """What udev's rule does: `device` root:`group` 0660. False when there is no such device or group."""
    try:
        gid = grp.getgrnam(group).gr_gid
        os.chown(device, 0, gid)
        os.chmod(device, 0o660)
    except (OSError, KeyError):
        return False
    return True
