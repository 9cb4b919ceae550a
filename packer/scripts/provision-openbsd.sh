#!/bin/sh
# Provisions the openbsd7 golden image inside the guest (Packer's shell provisioner, as root), after
# autoinstall(8) ran templates/answers/openbsd-install.conf.j2. Package names and paths come from
# lab/osfacts.py through /tmp/lab-facts.sh; the shared steps are in provision-common.sh.
set -eu
export LC_ALL=C
# shellcheck source=/dev/null
. /tmp/lab-facts.sh
# shellcheck source-path=SCRIPTDIR source=provision-common.sh
. /tmp/lab-common.sh

lab_pkgver() {
    pkg_info -e "$1-*" 2>/dev/null | head -n 1 | sed -e 's/^inst://' -e 's/.*-\([0-9]\)/\1/'
}

# Sets came from the ISO: packages come from the mirror.
test -s /etc/installurl || echo https://cdn.openbsd.org/pub/OpenBSD > /etc/installurl
# shellcheck disable=SC2086 # a list of package names
pkg_add -I $LAB_PACKAGES >/dev/null
for p in $LAB_PACKAGES; do
    test -n "$(lab_pkgver "$p")" || lab_die "package $p is not installed"
done

# Root: no password can match (the installer needed a throwaway one), the lab key only.
usermod -p '*' root
grep -q '^set tty com0' /etc/boot.conf || lab_die "boot.conf has no serial console"
# The first NIC by DHCP whatever its model: vio0 on VirtIO, em0 on E1000 (lab/osfacts.py).
for nic in vio0 em0; do
    echo 'inet autoconf' > "/etc/hostname.$nic"
    chmod 640 "/etc/hostname.$nic"
done

# nginx outside its /var/www chroot (the site lives in $LAB_SITE_ROOT), the site, the certificate.
lab_nginx_site
rcctl enable nginx >/dev/null
rcctl set nginx flags -u >/dev/null
rcctl restart nginx >/dev/null
lab_nginx_check
# rc.local runs at the end of the boot, after sshd: LAB-READY.
{
    echo '# lab: the golden image is ready for SSH (packer/scripts/provision-openbsd.sh)'
    lab_ready_line
} >> /etc/rc.local

lab_report "OpenBSD $(uname -r)"
rm -rf /var/www/logs/*
lab_clean
