#!/bin/sh
# Provisions the debian12 golden image inside the guest (run by Packer's shell provisioner as root).
# Inputs uploaded by Packer: /tmp/lab-nginx.conf (rendered templates/nginx.conf.j2) and /tmp/lab-site
# (templates/site, rendered). Output: /etc/lab-image.json, the tool versions the manifest records.
set -eu
export LC_ALL=C
up() { echo "provision: $1 at $(cut -d' ' -f1 /proc/uptime) s of uptime"; }  # stage times in packer.log
up "start"

# nginx must have been built with TLS: the https workload depends on it.
nginx -V 2>&1 | grep -q -- '--with-http_ssl_module' || { echo "nginx lacks http_ssl_module" >&2; exit 1; }

# --- nginx: config, a per-image self-signed RSA-4096 certificate, the static site ---------------
install -m 644 /tmp/lab-nginx.conf /etc/nginx/nginx.conf
rm -f /etc/nginx/sites-enabled/default
# The certificate and the bulk files: the qemu source's rootfs has them already (made at the host's
# native speed by packer/scripts/debian-rootfs-customize.sh: RSA-4096 key generation alone took
# most of a minute in the TCG build VM); an installer-built disk (proxmox-iso) makes them here.
if ! [ -s /etc/nginx/lab.key ] || ! [ -s /etc/nginx/lab.crt ]; then
    openssl req -x509 -newkey rsa:4096 -nodes -sha256 -days 3650 \
        -subj "/CN=$(hostname)" -addext "subjectAltName=DNS:$(hostname)" \
        -keyout /etc/nginx/lab.key -out /etc/nginx/lab.crt 2>/dev/null
fi
chmod 600 /etc/nginx/lab.key

# The site, replaced; its bulk/ kept when the rootfs build made it.
mkdir -p /srv/www/bulk
find /srv/www -mindepth 1 -maxdepth 1 ! -name bulk -exec rm -rf {} +
cp -r /tmp/lab-site/. /srv/www/
# Bulk files: pseudo-random (incompressible) but deterministic: AES-128-CTR keystream of zeros
# (the same function, and so the same bytes, as the customize hook's).
keystream() {
    openssl enc -aes-128-ctr -nosalt -K "$1" -iv 00000000000000000000000000000000 -in /dev/zero 2>/dev/null \
        | head -c "$2"
}
[ -s /srv/www/bulk/64m.bin ] || keystream 6c61622d62756c6b2d36346d00000000 67108864 > /srv/www/bulk/64m.bin
[ -s /srv/www/bulk/1m.bin ] || keystream 6c61622d62756c6b2d316d0000000000 1048576 > /srv/www/bulk/1m.bin
cp /srv/www/bulk/1m.bin /srv/www/1m.bin
chown -R root:root /srv/www
find /srv/www -type d -exec chmod 755 {} +
find /srv/www -type f -exec chmod 644 {} +
rm -rf /tmp/lab-site /tmp/lab-nginx.conf

nginx -t 2>/dev/null || { nginx -t; exit 1; }
systemctl enable nginx.service >/dev/null 2>&1
systemctl restart nginx.service
curl -fsS -o /dev/null http://127.0.0.1/ || { echo "nginx does not serve http" >&2; exit 1; }
curl -fsSk -o /dev/null https://127.0.0.1/ || { echo "nginx does not serve https" >&2; exit 1; }

# --- containers: the base image into root's podman store, then one start per runtime/network ---
# The qemu source's rootfs already has it (imported at the rootfs build, natively: lab/images/debian.py);
# an installer-built disk (proxmox-iso) imports /run/lab-base.tar.zst, the mmdebstrap tarball lab
# made (ContainerBase in the recipe). The name must match the recipe's ContainerBase.name
# (tests/unit/test_apps_unit.py checks it).
base_image=localhost/lab-base:latest
if podman image exists "$base_image"; then
    up "podman import: in the store since the rootfs build"
else
    up "podman import"
    zstd -dc /run/lab-base.tar.zst | podman import --quiet --change 'CMD ["/bin/sh"]' - "$base_image" >/dev/null
fi
# Docker: its daemon (and containerd) start on the first use of its socket, not at every boot;
# its store has the base image since the rootfs build (an installer-built disk imports it here).
if command -v docker >/dev/null; then
    systemctl disable docker.service containerd.service >/dev/null 2>&1
    systemctl enable docker.socket >/dev/null 2>&1
    if ! docker image inspect "$base_image" >/dev/null 2>&1; then
        up "docker import"
        zstd -dc /run/lab-base.tar.zst | docker import --change 'CMD ["/bin/sh"]' - "$base_image" >/dev/null
    fi
fi
rm -f /run/lab-base.tar.zst
up "container checks"
podman run --rm --network=none "$base_image" sh -c 'git --version && ls /var/cache/lab-debs/*.deb' >/dev/null
podman run --rm --runtime=runc --network=host "$base_image" true
podman run --rm "$base_image" true  # the default bridge network: netavark + iptables work
if command -v docker >/dev/null; then  # AppArmor settled (apparmor=0): docker starts its containers
    docker run --rm --network=none "$base_image" true
    systemctl stop docker.service docker.socket containerd.service
fi
up "containers done"

# --- bootloader: GRUB for BIOS (SeaBIOS, PVE's default) and UEFI (OVMF, bhyve) -------------------
# The local backend boots by direct kernel boot; everything else boots the disk by firmware.
# LAB_BOOT_CMDLINE (from lab/images.py via Packer) is the kernel command line GRUB passes; empty on
# the proxmox-iso source, whose installer set up its own bootloader. The disk (lab/images.py):
# GPT, partition 1 BIOS boot (GRUB's core.img), 2 the EFI system partition, 3 root (LABEL=labroot).
if [ -n "${LAB_BOOT_CMDLINE:-}" ]; then
    up "bootloader"
    rootdev=$(findmnt -n -o SOURCE /)
    disk=/dev/$(lsblk -n -d -o PKNAME "$rootdev")
    esp=$(lsblk -n -p -l -o NAME,PARTLABEL "$disk" | awk '$2 == "esp" { print $1 }')
    if ! [ -b "$disk" ] || ! [ -b "$esp" ]; then echo "bootloader: no disk/ESP ($disk, $esp)" >&2; exit 1; fi
    mkfs.fat -F 32 -n LAB-ESP "$esp" >/dev/null
    mkdir -p /boot/efi
    mount "$esp" /boot/efi
    grub-install --target=i386-pc --boot-directory=/boot "$disk"
    # --removable: EFI/BOOT/BOOTX64.EFI, found by any firmware without NVRAM boot entries
    # (clones, bhyve's read-only BHYVE_UEFI.fd, PVE without an efidisk).
    grub-install --target=x86_64-efi --efi-directory=/boot/efi --boot-directory=/boot --removable --no-nvram
    test -s /boot/efi/EFI/BOOT/BOOTX64.EFI
    umount /boot/efi
    rmdir /boot/efi
    kver=$(uname -r)
    # A fixed config, not grub-mkconfig (os-prober, /etc/default/grub): one entry, serial + screen.
    cat > /boot/grub/grub.cfg <<GRUBCFG
# lab golden image: written by packer/scripts/provision-debian.sh
serial --unit=0 --speed=115200 --word=8 --parity=no --stop=1
terminal_input serial console
terminal_output serial console
set timeout=1
insmod part_gpt
insmod ext2
search --no-floppy --label --set=root $LAB_ROOT_LABEL
menuentry 'Debian 12 lab ($kver)' {
    linux /boot/vmlinuz-$kver console=tty0 $LAB_BOOT_CMDLINE
    initrd /boot/initrd.img-$kver
}
GRUBCFG
    test -s "/boot/vmlinuz-$kver" && test -s "/boot/initrd.img-$kver"
fi

# --- the version report --------------------------------------------------------------------------
pkgver() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo ""; }
# shellcheck disable=SC1003  # not a quote escape: tr itself reads \r and \\ (CR and backslash)
first() { "$@" 2>&1 | head -n 1 | tr -d '\r"\\' ; }
# shellcheck disable=SC2012  # the names are kernel versions: no blanks or newlines to mangle
kernels=$(ls /lib/modules | tr '\n' ' ' | sed 's/ $//')
kernels_json=$(for k in $kernels; do printf '"%s",' "$k"; done | sed 's/,$//')
{
    printf '{\n'
    printf '  "kernels": [%s],\n' "$kernels_json"
    printf '  "running_kernel": "%s",\n' "$(uname -r)"
    printf '  "debian_version": "%s",\n' "$(cat /etc/debian_version)"
    printf '  "tools": {\n'
    printf '    "sysbench": "%s",\n' "$(first sysbench --version)"
    printf '    "iperf3": "%s",\n' "$(first iperf3 --version)"
    printf '    "nginx": "%s",\n' "$(first nginx -v)"
    printf '    "openssl": "%s",\n' "$(first openssl version)"
    printf '    "git": "%s",\n' "$(first git --version)"
    printf '    "curl": "%s",\n' "$(first curl --version)"
    printf '    "podman": "%s",\n' "$(first podman --version)"
    printf '    "crun": "%s",\n' "$(first crun --version)"
    printf '    "runc": "%s",\n' "$(first runc --version)"
    printf '    "conmon": "%s",\n' "$(first conmon --version)"
    printf '    "netavark": "%s",\n' "$(first /usr/lib/podman/netavark --version)"
    printf '    "hyperfine": "%s",\n' "$(first hyperfine --version)"
    printf '    "docker": "%s",\n' "$(first docker --version)"
    printf '    "containerd": "%s",\n' "$(first containerd --version)"
    printf '    "openssh": "%s",\n' "$(first ssh -V)"
    printf '    "grub": "%s",\n' "$(first grub-install --version)"
    printf '    "qemu-ga": "%s"\n' "$(first qemu-ga --version)"
    printf '  },\n'
    printf '  "packages": {\n'
    printf '    "linux-image-amd64": "%s",\n' "$(pkgver linux-image-amd64)"
    printf '    "sysbench": "%s",\n' "$(pkgver sysbench)"
    printf '    "iperf3": "%s",\n' "$(pkgver iperf3)"
    printf '    "nginx": "%s",\n' "$(pkgver nginx)"
    printf '    "openssl": "%s",\n' "$(pkgver openssl)"
    printf '    "git": "%s",\n' "$(pkgver git)"
    printf '    "curl": "%s",\n' "$(pkgver curl)"
    printf '    "openssh-server": "%s",\n' "$(pkgver openssh-server)"
    printf '    "podman": "%s",\n' "$(pkgver podman)"
    printf '    "crun": "%s",\n' "$(pkgver crun)"
    printf '    "runc": "%s",\n' "$(pkgver runc)"
    printf '    "hyperfine": "%s",\n' "$(pkgver hyperfine)"
    printf '    "docker.io": "%s",\n' "$(pkgver docker.io)"
    printf '    "qemu-guest-agent": "%s",\n' "$(pkgver qemu-guest-agent)"
    printf '    "grub-efi-amd64-bin": "%s",\n' "$(pkgver grub-efi-amd64-bin)"
    printf '    "systemd": "%s"\n' "$(pkgver systemd)"
    printf '  },\n'
    printf '  "nginx_cert_sha256": "%s",\n' "$(openssl x509 -in /etc/nginx/lab.crt -noout -fingerprint -sha256 | cut -d= -f2)"
    printf '  "site_files": %s,\n' "$(find /srv/www -type f | wc -l)"
    printf '  "bulk_sha256": {"/bulk/1m.bin": "%s", "/bulk/64m.bin": "%s"},\n' \
        "$(sha256sum /srv/www/bulk/1m.bin | cut -d' ' -f1)" "$(sha256sum /srv/www/bulk/64m.bin | cut -d' ' -f1)"
    printf '  "container": {"image_id": "%s", "image_bytes": %s, "store_bytes": %s},\n' \
        "$(podman image inspect --format '{{.Id}}' "$base_image")" \
        "$(podman image inspect --format '{{.Size}}' "$base_image")" \
        "$(du -sb /var/lib/containers/storage | cut -f1)"
    printf '  "dpkg_packages": %s\n' "$(dpkg-query -W -f='${db:Status-Abbrev}\n' | grep -c '^ii')"
    printf '}\n'
} > /etc/lab-image.json

# --- leave a clean image -------------------------------------------------------------------------
rm -rf /var/log/nginx/* /tmp/* /root/.bash_history
sync
fstrim -v / >/dev/null 2>&1 || true
