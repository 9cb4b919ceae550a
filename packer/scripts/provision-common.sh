#!/bin/sh
# Shared provisioning steps for the ISO-installed golden images (alpine3, freebsd14, netbsd10,
# openbsd7), sourced by packer/scripts/provision-<os>.sh after /tmp/lab-facts.sh. Portable sh only
# (busybox ash, FreeBSD/NetBSD sh, OpenBSD ksh) and tools every base system has (openssl or
# LibreSSL, dd, find, sed). Packer uploads it as /tmp/lab-common.sh with:
#   /tmp/lab-facts.sh   this OS's facts from lab/osfacts.py (LAB_PACKAGES, LAB_SERIAL, LAB_NGINX_*, ...)
#   /tmp/lab-nginx.conf templates/nginx.conf.j2 rendered for this OS
#   /tmp/lab-site/      templates/site rendered
# The Debian image does the same in provision-debian.sh; the bulk files are byte-identical.

lab_die() {
    echo "provision: $*" >&2
    exit 1
}

# sha256 of a file, with the base system's openssl (OpenSSL or LibreSSL: both know -r).
lab_sha256() {
    openssl dgst -sha256 -r "$1" | cut -d' ' -f1
}

# Incompressible but deterministic bulk data: the AES-128-CTR keystream of KEY over SIZE_MIB MiB of
# zeros (the same bytes as provision-debian.sh's keystream; dd because OpenBSD's head has no -c).
lab_keystream() {
    dd if=/dev/zero bs=1048576 count="$2" 2>/dev/null |
        openssl enc -aes-128-ctr -nosalt -K "$1" -iv 00000000000000000000000000000000
}

# nginx: the rendered config, a per-image self-signed RSA-4096 certificate, the static site.
lab_nginx_site() {
    install -m 644 /tmp/lab-nginx.conf "$LAB_NGINX_CONF"
    mkdir -p "$LAB_CERT_DIR"
    # -addext puts the host name in subjectAltName; LibreSSL builds without it get the CN only.
    openssl req -x509 -newkey rsa:4096 -nodes -sha256 -days 3650 -subj "/CN=$LAB_HOSTNAME" \
        -addext "subjectAltName=DNS:$LAB_HOSTNAME" \
        -keyout "$LAB_CERT_DIR/lab.key" -out "$LAB_CERT_DIR/lab.crt" 2>/dev/null ||
        openssl req -x509 -newkey rsa:4096 -nodes -sha256 -days 3650 -subj "/CN=$LAB_HOSTNAME" \
            -keyout "$LAB_CERT_DIR/lab.key" -out "$LAB_CERT_DIR/lab.crt" 2>/dev/null ||
        lab_die "openssl could not make the certificate"
    chmod 600 "$LAB_CERT_DIR/lab.key"

    rm -rf "$LAB_SITE_ROOT"
    mkdir -p "$LAB_SITE_ROOT/bulk"
    cp -R /tmp/lab-site/. "$LAB_SITE_ROOT/"
    lab_keystream 6c61622d62756c6b2d36346d00000000 64 > "$LAB_SITE_ROOT/bulk/64m.bin"
    lab_keystream 6c61622d62756c6b2d316d0000000000 1 > "$LAB_SITE_ROOT/bulk/1m.bin"
    cp "$LAB_SITE_ROOT/bulk/1m.bin" "$LAB_SITE_ROOT/1m.bin"
    chown -R root "$LAB_SITE_ROOT"
    find "$LAB_SITE_ROOT" -type d -exec chmod 755 {} +
    find "$LAB_SITE_ROOT" -type f -exec chmod 644 {} +
    rm -rf /tmp/lab-site /tmp/lab-nginx.conf
    nginx -t -c "$LAB_NGINX_CONF" 2>/dev/null || { nginx -t -c "$LAB_NGINX_CONF"; lab_die "nginx rejects its config"; }
}

# After the OS script (re)started nginx: it must serve both protocols.
lab_nginx_check() {
    curl -fsS -o /dev/null http://127.0.0.1/ || lab_die "nginx does not serve http"
    curl -fsSk -o /dev/null https://127.0.0.1/ || lab_die "nginx does not serve https"
}

# The line the backends wait for on the serial console once sshd listens.
lab_ready_line() {
    printf 'printf '"'"'\\r\\n%%s\\r\\n'"'"' %s > %s\n' "$LAB_READY_MARKER" "$LAB_SERIAL"
}

# An rc.d script (FreeBSD, NetBSD) that writes LAB-READY once sshd runs. $1 = how the system's rc.d
# scripts load rc.subr, $2 = their rcvar, $3 = the provisioning script, for the comment.
lab_rcd_ready() {
    cat <<RCD
#!/bin/sh
# PROVIDE: lab_ready
# REQUIRE: sshd LOGIN
# lab: the golden image is ready for SSH ($3)
$1
name=lab_ready
rcvar=$2
start_cmd=lab_ready_start
stop_cmd=:
lab_ready_start() {
    $(lab_ready_line)
}
load_rc_config \$name
run_rc_command "\$1"
RCD
}

# First line of a command's output, without what would break a JSON string (control characters,
# quotes, backslashes).
lab_json_safe() {
    # shellcheck disable=SC1003 # the tr set is control characters, ", backslash
    tr -d '\000-\037"\\'
}
lab_first() {
    "$@" 2>&1 | head -n 1 | lab_json_safe
}

# /etc/lab-image.json: what lab/images.py puts in the manifest. $1 = the OS version line; the OS
# script defines lab_pkgver NAME (the installed package's version, or nothing).
lab_report() {
    podman_version=""
    if command -v podman >/dev/null 2>&1; then
        podman_version=$(lab_first podman --version)
    fi
    {
        printf '{\n'
        printf '  "image": "%s",\n' "$LAB_IMAGE"
        printf '  "os_version": "%s",\n' "$1"
        printf '  "running_kernel": "%s",\n' "$(uname -r)"
        printf '  "tools": {\n'
        printf '    "sysbench": "%s",\n' "$(lab_first sysbench --version)"
        printf '    "iperf3": "%s",\n' "$(lab_first iperf3 --version)"
        printf '    "nginx": "%s",\n' "$(lab_first nginx -v)"
        printf '    "openssl": "%s",\n' "$(lab_first openssl version)"
        printf '    "git": "%s",\n' "$(lab_first git --version)"
        printf '    "curl": "%s",\n' "$(lab_first curl --version)"
        printf '    "openssh": "%s",\n' "$(lab_first ssh -V)"
        printf '    "podman": "%s"\n' "$podman_version"
        printf '  },\n'
        printf '  "packages": {'
        sep=""
        for pkg in $LAB_PACKAGES; do
            printf '%s\n    "%s": "%s"' "$sep" "$pkg" "$(lab_pkgver "$pkg" | head -n 1 | lab_json_safe)"
            sep=","
        done
        printf '\n  },\n'
        printf '  "nginx_cert_sha256": "%s",\n' \
            "$(openssl x509 -in "$LAB_CERT_DIR/lab.crt" -noout -fingerprint -sha256 | cut -d= -f2)"
        printf '  "site_files": %s,\n' "$(find "$LAB_SITE_ROOT" -type f | wc -l | tr -d ' ')"
        printf '  "bulk_sha256": {"/bulk/1m.bin": "%s", "/bulk/64m.bin": "%s"}\n' \
            "$(lab_sha256 "$LAB_SITE_ROOT/bulk/1m.bin")" "$(lab_sha256 "$LAB_SITE_ROOT/bulk/64m.bin")"
        printf '}\n'
    } > /etc/lab-image.json
}

# Clones must not share what the build left behind.
lab_clean() {
    rm -rf /tmp/lab-facts.sh /tmp/lab-common.sh /root/.history /root/.sh_history /root/.ash_history
    sync
}
