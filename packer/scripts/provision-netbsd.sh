#!/bin/sh
# Provisions the netbsd10 golden image inside the guest (Packer's shell provisioner, as root), after
# templates/answers/netbsd-install.sh.j2 installed it. Package names and paths come from
# lab/osfacts.py through /tmp/lab-facts.sh; the shared steps are in provision-common.sh.
set -eu
export LC_ALL=C
# shellcheck source=/dev/null
. /tmp/lab-facts.sh
# shellcheck source-path=SCRIPTDIR source=provision-common.sh
. /tmp/lab-common.sh

lab_pkgver() {
    pkg_info -E "$1" 2>/dev/null | head -n 1 | sed 's/.*-//'
}

# pkgin from the release's binary packages, then the image's packages.
PKG_PATH="https://cdn.netbsd.org/pub/pkgsrc/packages/NetBSD/$(uname -m)/$(uname -r | cut -d_ -f1)/All"
export PKG_PATH
command -v pkgin >/dev/null 2>&1 || pkg_add pkgin
pkgin -y update >/dev/null
# shellcheck disable=SC2086 # a list of package names
pkgin -y install $LAB_PACKAGES >/dev/null
for p in $LAB_PACKAGES; do
    test -n "$(lab_pkgver "$p")" || lab_die "package $p is not installed"
done

grep -q '^consdev=com0' /boot.cfg || lab_die "boot.cfg has no serial console"
grep -q '^dhcpcd=YES' /etc/rc.conf || lab_die "dhcpcd is not enabled"

# nginx (pkgsrc installs its rc.d script as an example), the site, the certificate; LAB-READY.
cp /usr/pkg/share/examples/rc.d/nginx /etc/rc.d/nginx
chmod 555 /etc/rc.d/nginx
lab_nginx_site
# shellcheck disable=SC2016 # rc.subr's own guard, written as is
lab_rcd_ready '$_rc_subr_loaded . /etc/rc.subr' '$name' provision-netbsd.sh > /etc/rc.d/lab_ready
chmod 555 /etc/rc.d/lab_ready
printf 'nginx=YES\nlab_ready=YES\n' >> /etc/rc.conf
/etc/rc.d/nginx restart >/dev/null 2>&1 || /etc/rc.d/nginx start >/dev/null
lab_nginx_check

lab_report "NetBSD $(uname -r)"
pkgin -y clean >/dev/null
rm -rf /var/log/nginx/*
lab_clean
