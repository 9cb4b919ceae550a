#!/bin/sh
# mmdebstrap --essential-hook for the debian12 golden image: runs after the essential packages,
# before the kernel and the rest are installed. $1 = the rootfs directory.
# Copies templates/image/rootfs (LAB_OVERLAY) in, so initramfs-tools sees MODULES=list and the
# module list when the kernel's postinst builds the initrd, and the lab units are in place.
set -eu
root="$1"
: "${LAB_OVERLAY:?LAB_OVERLAY must name templates/image/rootfs}"
cp -a "$LAB_OVERLAY/." "$root/"
