#!/bin/sh
# Provisions the alpine3 golden image inside the guest (Packer's shell provisioner, as root), after
# setup-alpine installed it from templates/answers/alpine-answers.j2. Package names and paths come
# from lab/osfacts.py through /tmp/lab-facts.sh; the shared steps are in provision-common.sh.
set -eu
export LC_ALL=C
# shellcheck source=/dev/null
. /tmp/lab-facts.sh
# shellcheck source-path=SCRIPTDIR source=provision-common.sh
. /tmp/lab-common.sh

lab_pkgver() {
    apk list -I "$1" 2>/dev/null | head -n 1 | cut -d' ' -f1
}

apk update >/dev/null
# shellcheck disable=SC2086 # a list of package names
apk add --no-progress $LAB_PACKAGES >/dev/null
for pkg in $LAB_PACKAGES; do
    test -n "$(lab_pkgver "$pkg")" || lab_die "package $pkg is not installed"
done

# Root: no password can match (setup-alpine -e left it empty), the lab key only.
sed -i 's/^root:[^:]*:/root:*:/' /etc/shadow
sed -i -e 's/^#*PasswordAuthentication.*/PasswordAuthentication no/' \
       -e 's/^#*PermitRootLogin.*/PermitRootLogin prohibit-password/' /etc/ssh/sshd_config
grep -q '^PasswordAuthentication no' /etc/ssh/sshd_config || echo 'PasswordAuthentication no' >> /etc/ssh/sshd_config

# Serial console: the kernel (setup-disk wrote KERNELOPTS into extlinux), the bootloader, a getty.
sed -i -e 's/^serial_port=.*/serial_port=0/' -e 's/^serial_baud=.*/serial_baud=115200/' \
       -e 's/^timeout=.*/timeout=1/' /etc/update-extlinux.conf
grep -q 'console=ttyS0' /etc/update-extlinux.conf || lab_die "the kernel command line lacks console=ttyS0"
update-extlinux >/dev/null 2>&1
sed -i 's|^#ttyS0::respawn.*|ttyS0::respawn:/sbin/getty -L 115200 ttyS0 vt100|' /etc/inittab
grep -q '^ttyS0::respawn' /etc/inittab || echo 'ttyS0::respawn:/sbin/getty -L 115200 ttyS0 vt100' >> /etc/inittab

# The first NIC is eth0 (net.ifnames=0 is on the command line too): DHCP on it, whatever its model.
grep -q '^iface eth0 inet dhcp' /etc/network/interfaces || lab_die "eth0 is not configured by DHCP"

# nginx, the site, the certificate; the services at boot; LAB-READY once sshd is up (local runs last).
mkdir -p /run/nginx
lab_nginx_site
rc-update add sshd default >/dev/null
rc-update add nginx default >/dev/null
rc-update add qemu-guest-agent default >/dev/null
rc-update add local default >/dev/null
{
    echo '#!/bin/sh'
    echo '# lab: the golden image is ready for SSH (packer/scripts/provision-alpine.sh)'
    lab_ready_line
} > /etc/local.d/lab-ready.start
chmod 755 /etc/local.d/lab-ready.start
rc-service nginx restart >/dev/null
lab_nginx_check

lab_report "Alpine Linux $(cat /etc/alpine-release)"
rm -rf /var/cache/apk/* /var/log/nginx/*
lab_clean
