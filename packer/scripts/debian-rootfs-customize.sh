#!/bin/sh
# mmdebstrap --customize-hook for the debian12 golden image: runs after every package is installed.
# $1 = the rootfs directory. Environment: LAB_PUBKEY (the lab's SSH public key, one line),
# LAB_MASKS (file listing units to mask), LAB_HOSTNAME.
set -eu
root="$1"
: "${LAB_PUBKEY:?}" "${LAB_MASKS:?}" "${LAB_HOSTNAME:?}"

echo "$LAB_HOSTNAME" > "$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' \
    "$LAB_HOSTNAME" > "$root/etc/hosts"

# Root: no usable password ("*", not the "!" of a locked account, which sshd refuses even for
# keys when UsePAM is off), the lab key only.
chroot "$root" usermod -p '*' root
install -d -m 700 "$root/root/.ssh"
printf '%s\n' "$LAB_PUBKEY" > "$root/root/.ssh/authorized_keys"
chmod 600 "$root/root/.ssh/authorized_keys"

# A fixed machine-id: no first-boot logic (presets) in clones. All clones share it; the lab
# networks are static, so nothing keys on it.
chroot "$root" systemd-machine-id-setup >/dev/null 2>&1 || true
test -s "$root/etc/machine-id"

# sshd as a service started at boot (Debian's ssh.socket is Accept=no: no gain), the lab units on.
chroot "$root" systemctl disable ssh.socket >/dev/null 2>&1 || true
chroot "$root" systemctl enable ssh.service lab-net.service lab-ready.service nginx.service >/dev/null 2>&1
grep -v '^#' "$LAB_MASKS" | grep . | while read -r unit; do
    ln -sf /dev/null "$root/etc/systemd/system/$unit"
done

rm -f "$root/etc/resolv.conf"
printf '# lab guests have no DNS server; workloads use addresses.\n' > "$root/etc/resolv.conf"

# The initrd must carry every module the lab's disk buses and NICs need.
for initrd in "$root"/boot/initrd.img-*; do
    listing=$(chroot "$root" lsinitramfs "/boot/$(basename "$initrd")")
    for m in virtio_pci virtio_blk virtio_scsi virtio_net e1000 e1000e ahci sd_mod nvme ext4; do
        echo "$listing" | grep -q "/$m\.ko" || { echo "$(basename "$initrd") lacks $m.ko" >&2; exit 1; }
    done
done
# Nothing cached that clones do not need.
rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"* "$root/var/log/"*.log
