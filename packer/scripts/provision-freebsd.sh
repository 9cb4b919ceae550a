#!/bin/sh
# Provisions the freebsd14 golden image inside the guest (Packer's shell provisioner, as root), after
# bsdinstall ran templates/answers/freebsd-installerconfig.j2. Package names and paths come from
# lab/osfacts.py through /tmp/lab-facts.sh; the shared steps are in provision-common.sh.
set -eu
export LC_ALL=C
# shellcheck source=/dev/null
. /tmp/lab-facts.sh
# shellcheck source-path=SCRIPTDIR source=provision-common.sh
. /tmp/lab-common.sh

lab_pkgver() {
    pkg query '%v' "$1" 2>/dev/null
}

export ASSUME_ALWAYS_YES=yes
pkg bootstrap -f >/dev/null
# shellcheck disable=SC2086 # a list of package names
pkg install -y $LAB_PACKAGES >/dev/null
for p in $LAB_PACKAGES; do
    test -n "$(lab_pkgver "$p")" || lab_die "package $p is not installed"
done

# The checks the installer's setup script made: serial console, DHCP on the first NIC, root by key.
grep -q '^console="comconsole' /boot/loader.conf || lab_die "loader.conf has no serial console"
test "$(sysrc -n ifconfig_DEFAULT)" = DHCP || lab_die "the first NIC is not configured by DHCP"
grep -q '^PermitRootLogin prohibit-password' /etc/ssh/sshd_config || lab_die "sshd refuses root keys"

# nginx, the site, the certificate; services at boot; LAB-READY once sshd is up.
lab_nginx_site
sysrc nginx_enable=YES qemu_guest_agent_enable=YES >/dev/null
lab_rcd_ready '. /etc/rc.subr' lab_ready_enable provision-freebsd.sh > /usr/local/etc/rc.d/lab_ready
chmod 555 /usr/local/etc/rc.d/lab_ready
sysrc lab_ready_enable=YES >/dev/null
service nginx restart >/dev/null
lab_nginx_check

lab_report "$(freebsd-version -u)"
pkg clean -ay >/dev/null
rm -rf /var/log/nginx/*
lab_clean
