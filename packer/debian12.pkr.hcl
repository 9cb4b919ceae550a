# debian12 golden image, step 2 of 2 (step 1 is mmdebstrap + mkfs.ext4 + qemu-img in lab/images.py):
# boot the bare qcow2 by direct kernel boot under TCG, provision it over SSH, download the
# version report, shut down. Driven by `lab images build debian12`; every path comes in as a variable.

variable "disk_in" {
  type        = string
  description = "the qcow2 made from the mmdebstrap rootfs (copied, never modified)"
}
variable "output_dir" {
  type = string
}
variable "kernel" {
  type = string
}
variable "initrd" {
  type = string
}
variable "cmdline" {
  type        = string
  description = "base kernel command line (no lab.ip: the guest falls back to slirp's 10.0.2.15)"
}
variable "ssh_key" {
  type        = string
  description = "images/lab_key"
}
variable "stage_dir" {
  type        = string
  description = "build dir holding nginx.conf (rendered) and site/ (rendered + generated)"
}
variable "report_out" {
  type        = string
  description = "where the guest's /etc/lab-image.json is downloaded to"
}
variable "console_log" {
  type = string
}
variable "disk_size" {
  type    = string
  default = "4096M"
}

source "qemu" "debian12" {
  iso_url          = var.disk_in
  iso_checksum     = "none"
  disk_image       = true
  use_backing_file = false
  skip_resize_disk = true
  disk_size        = var.disk_size
  format           = "qcow2"
  disk_interface   = "virtio"
  # Blocks freed during provisioning (podman import's temporary copy of the base image, dpkg's
  # leftovers) are discarded by the final fstrim instead of staying allocated in the qcow2.
  disk_discard       = "unmap"
  disk_detect_zeroes = "unmap"
  net_device       = "virtio-net"
  accelerator      = "tcg"
  cpus             = 2
  memory           = 1024
  headless         = true
  boot_wait        = "1ms"
  output_directory = var.output_dir
  vm_name          = "debian12.qcow2"
  qemuargs = [
    ["-machine", "pc,accel=tcg"],
    ["-bios", "/usr/share/qemu/qboot.rom"],
    ["-kernel", var.kernel],
    ["-initrd", var.initrd],
    ["-append", var.cmdline],
    ["-serial", "file:${var.console_log}"],
    # Packer's default forwards SSH on every host interface; keep it on loopback.
    ["-netdev", "user,id=user.0,hostfwd=tcp:127.0.0.1:{{ .SSHHostPort }}-:22"],
    ["-device", "virtio-net-pci,netdev=user.0"],
  ]
  communicator         = "ssh"
  ssh_username         = "root"
  ssh_private_key_file = var.ssh_key
  ssh_timeout          = "5m"
  host_port_min        = 2222
  host_port_max        = 2299
  shutdown_command     = "systemctl poweroff"
  shutdown_timeout     = "2m"
}

build {
  sources = ["source.qemu.debian12"]

  provisioner "file" {
    source      = "${var.stage_dir}/nginx.conf"
    destination = "/tmp/lab-nginx.conf"
  }

  provisioner "file" {
    source      = "${var.stage_dir}/site"
    destination = "/tmp/lab-site"
  }

  # The base container image (mmdebstrap, zstd tarball): to /run (tmpfs), so the blocks it
  # occupies never reach the disk image; provisioning imports it into podman's store.
  provisioner "file" {
    source      = "${var.stage_dir}/lab-base.tar.zst"
    destination = "/run/lab-base.tar.zst"
  }

  provisioner "shell" {
    script = "${path.root}/scripts/provision-debian.sh"
  }

  provisioner "file" {
    source      = "/etc/lab-image.json"
    destination = var.report_out
    direction   = "download"
  }
}
