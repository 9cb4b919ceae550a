#!/bin/sh
# mmdebstrap --customize-hook for the debian12 golden image: runs after every package is installed.
# $1 = the rootfs directory. Environment: LAB_PUBKEY (the lab's SSH public key, one line),
# LAB_MASKS (file listing units to mask), LAB_GENERATOR_MASKS (file listing systemd generators to
# mask), LAB_HOSTNAME.
set -eu
root="$1"
: "${LAB_PUBKEY:?}" "${LAB_MASKS:?}" "${LAB_GENERATOR_MASKS:?}" "${LAB_HOSTNAME:?}"

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
install -d "$root/etc/systemd/system-generators"
grep -v '^#' "$LAB_GENERATOR_MASKS" | grep . | while read -r generator; do
    test -e "$root/lib/systemd/system-generators/$generator" || { echo "no generator $generator to mask" >&2; exit 1; }
    ln -sf /dev/null "$root/etc/systemd/system-generators/$generator"
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

# The base container image into root's podman store (LAB_CONTAINER_TARBALL, the zstd tarball lab
# made first; LAB_CONTAINER_IMAGE its name): podman import run here at the host's native speed
# took ~110 s inside the TCG build VM. mmdebstrap --mode=root has /proc, /sys and /dev mounted in
# the chroot; its root must be a mount point too (containers/storage untars layers in a chroot of
# its own after making / private): a bind mount of it onto itself, in a mount namespace that ends
# with the command; the host's cgroups are bound there too (dockerd, below, needs them). What podman leaves in /run (the guest's is a tmpfs) and the backing device node
# its overlay driver makes (of the build host's disk) do not go into the image.
in_chroot() {
    # shellcheck disable=SC2016  # expanded by the inner sh
    unshare --mount --propagation private sh -c \
        'mount --rbind "$0" "$0" && mount --rbind /sys/fs/cgroup "$0/sys/fs/cgroup" && exec chroot "$0" "$@"' "$root" "$@"
}
if [ -n "${LAB_CONTAINER_TARBALL:-}" ]; then
    : "${LAB_CONTAINER_IMAGE:?}"
    zstd -dc "$LAB_CONTAINER_TARBALL" \
        | in_chroot podman import --quiet --change 'CMD ["/bin/sh"]' - "$LAB_CONTAINER_IMAGE" >/dev/null
    in_chroot podman image exists "$LAB_CONTAINER_IMAGE"
    rm -rf "$root/run/containers" "$root/run/libpod" "$root/var/lib/containers/storage/overlay/backingFsBlockDev"
    # ... and into docker's (overlay2), by a dockerd of the rootfs run here for the import alone
    # (3 s natively; ~90 s in the TCG build VM): no bridge, no iptables, its own socket and pid file;
    # no IP forwarding either (with the host's net.ipv4.ip_forward at 0 it would set it, and the
    # chroot's /proc/sys is read-only: "Enabling IP forwarding failed", the build stopped there);
    # it refuses to start without the host's cgroups (mmdebstrap's /sys has none mounted: in_chroot
    # binds them). What it leaves in /run goes; its network state goes too
    # (the guest's dockerd makes its own).
    if [ -x "$root/usr/sbin/dockerd" ]; then
        # shellcheck disable=SC2016  # expanded by the inner sh
        zstd -dc "$LAB_CONTAINER_TARBALL" | in_chroot sh -c '
            sock=unix:///run/lab-seed-docker.sock
            dockerd --host "$sock" --pidfile /run/lab-seed-dockerd.pid --bridge=none --iptables=false \
                --ip6tables=false --ip-masq=false --ip-forward=false --storage-driver=overlay2 >/run/lab-seed-dockerd.log 2>&1 &
            i=0
            until docker --host "$sock" version >/dev/null 2>&1; do
                i=$((i + 1))
                if [ $i -gt 300 ] || ! kill -0 $! 2>/dev/null; then cat /run/lab-seed-dockerd.log >&2; exit 1; fi
                sleep 0.2
            done
            docker --host "$sock" import --change "CMD [\"/bin/sh\"]" - "$0" >/dev/null
            docker --host "$sock" image inspect "$0" >/dev/null
            kill "$(cat /run/lab-seed-dockerd.pid)"
            wait || true
        ' "$LAB_CONTAINER_IMAGE"
        rm -rf "$root/run/docker" "$root/run/containerd" "$root/run/lab-seed-"* \
            "$root/var/lib/docker/network" "$root/var/lib/docker/tmp" "$root/var/lib/docker/runtimes"
    fi
fi

# nginx's per-image self-signed RSA-4096 certificate and the bulk files the site serves, natively
# (provision-debian.sh makes them only where they are missing: an installer-built disk). The
# keystream is provision-debian.sh's: deterministic bytes whatever makes them.
openssl req -x509 -newkey rsa:4096 -nodes -sha256 -days 3650 \
    -subj "/CN=$LAB_HOSTNAME" -addext "subjectAltName=DNS:$LAB_HOSTNAME" \
    -keyout "$root/etc/nginx/lab.key" -out "$root/etc/nginx/lab.crt" 2>/dev/null
chmod 600 "$root/etc/nginx/lab.key"
keystream() {
    openssl enc -aes-128-ctr -nosalt -K "$1" -iv 00000000000000000000000000000000 -in /dev/zero 2>/dev/null \
        | head -c "$2"
}
mkdir -p "$root/srv/www/bulk"
keystream 6c61622d62756c6b2d36346d00000000 67108864 > "$root/srv/www/bulk/64m.bin"
keystream 6c61622d62756c6b2d316d0000000000 1048576 > "$root/srv/www/bulk/1m.bin"
