# debian12 golden image. Two sources, one build:
#   qemu.debian12         step 2 of 2 of `lab images build debian12` (step 1 is mmdebstrap + sfdisk +
#                         mkfs.ext4 + qemu-img in lab/images.py): boot the partitioned qcow2 by direct
#                         kernel boot under TCG, provision it over SSH (GRUB for BIOS and UEFI
#                         included), download the version report, shut down.
#   proxmox-iso.debian12  builds the template `lab-debian12` directly on a Proxmox VE node from the
#                         Debian 12 netinst ISO with the preseed rendered from
#                         templates/answers/debian-preseed.cfg.j2 (`lab images render debian12 DIR`).
# Both run packer/scripts/provision-debian.sh. Every path comes in as a variable.

variable "disk_in" {
  type        = string
  default     = ""
  description = "the qcow2 made from the mmdebstrap rootfs (copied, never modified)"
}
variable "output_dir" {
  type    = string
  default = "build/debian12/packer-out"
}
variable "kernel" {
  type    = string
  default = ""
}
variable "initrd" {
  type    = string
  default = ""
}
variable "cmdline" {
  type        = string
  default     = ""
  description = "kernel command line for the build boot (lab/images.py adds slirp's lab.ip=10.0.2.15/24)"
}
variable "boot_cmdline" {
  type        = string
  default     = ""
  description = "kernel command line for GRUB (firmware boot); empty: no bootloader is installed (proxmox-iso)"
}
variable "root_label" {
  type    = string
  default = "labroot"
}
variable "ssh_key" {
  type        = string
  default     = "images/lab_key"
  description = "images/lab_key"
}
variable "stage_dir" {
  type        = string
  default     = "build/debian12/stage"
  description = "build dir holding nginx.conf (rendered) and site/ (rendered + generated)"
}
variable "report_out" {
  type        = string
  default     = "build/debian12/lab-image.json"
  description = "where the guest's /etc/lab-image.json is downloaded to"
}
variable "console_log" {
  type    = string
  default = "build/debian12/packer-console.log"
}
variable "disk_size" {
  type    = string
  default = "4096M"
}
# proxmox-iso only: the netinst ISO, the preseed directory, the PVE node. An API token, never a password.
variable "iso_url" {
  type    = string
  default = "https://cdimage.debian.org/cdimage/archive/12.12.0/amd64/iso-cd/debian-12.12.0-amd64-netinst.iso"
}
variable "iso_checksum" {
  type        = string
  default     = "file:https://cdimage.debian.org/cdimage/archive/12.12.0/amd64/iso-cd/SHA256SUMS"
  description = "file:URL of the release's checksum file, or sha256:HEX"
}
variable "http_dir" {
  type        = string
  default     = "build/debian12/http"
  description = "the rendered preseed.cfg"
}
variable "proxmox_url" {
  type    = string
  default = "https://pve.example:8006/api2/json"
}
variable "proxmox_username" {
  type        = string
  default     = "lab@pve!packer"
  description = "the API token id: user@realm!tokenid"
}
variable "proxmox_token" {
  type        = string
  default     = ""
  sensitive   = true
  description = "the token secret; set PKR_VAR_proxmox_token in the environment"
}
variable "proxmox_node" {
  type    = string
  default = "pve"
}
variable "proxmox_storage" {
  type    = string
  default = "local-lvm"
}
variable "proxmox_storage_type" {
  type    = string
  default = "lvm-thin"
}
variable "proxmox_iso_storage" {
  type    = string
  default = "local"
}
variable "proxmox_bridge" {
  type    = string
  default = "vmbr0"
}
variable "proxmox_ssh_host" {
  type        = string
  default     = ""
  description = "the build VM's address; empty: ask the guest agent (the preseed installs it)"
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
  net_device       = "virtio-net"
  accelerator      = "tcg"
  cpus             = 2
  memory           = 1024
  headless         = true
  boot_wait        = "1ms"
  output_directory = var.output_dir
  vm_name          = "debian12.qcow2"

  # Blocks freed during provisioning (podman import's temporary copy of the base image, dpkg's
  # leftovers) are discarded by the final fstrim instead of staying allocated in the qcow2.
  disk_discard       = "unmap"
  disk_detect_zeroes = "unmap"

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

source "proxmox-iso" "debian12" {
  proxmox_url              = var.proxmox_url
  insecure_skip_tls_verify = false
  username                 = var.proxmox_username
  token                    = var.proxmox_token
  node                     = var.proxmox_node
  iso_url                  = var.iso_url
  iso_checksum             = var.iso_checksum
  iso_storage_pool         = var.proxmox_iso_storage
  unmount_iso              = true
  vm_name                  = "lab-debian12-build"
  template_name            = "lab-debian12"
  template_description     = "lab golden image debian12 (packer/debian12.pkr.hcl, netinst + preseed)"
  os                       = "l26"
  cores                    = 2
  memory                   = 1024
  qemu_agent               = true
  scsi_controller          = "virtio-scsi-single"
  network_adapters {
    model  = "virtio"
    bridge = var.proxmox_bridge
  }
  disks {
    type              = "virtio"
    disk_size         = var.disk_size
    storage_pool      = var.proxmox_storage
    storage_pool_type = var.proxmox_storage_type
    format            = "raw"
  }
  http_directory = var.http_dir
  boot_wait      = "10s"
  # isolinux: the "auto" label with the preseed URL; net.ifnames=0 makes the NIC eth0 in the
  # installer and (through the preseed's add-kernel-opts) in the installed system.
  boot_command = [
    "<esc><wait>",
    "auto url=http://{{ .HTTPIP }}:{{ .HTTPPort }}/preseed.cfg priority=critical net.ifnames=0 console=ttyS0,115200n8 console=tty0<enter>",
  ]
  communicator         = "ssh"
  ssh_host             = var.proxmox_ssh_host
  ssh_username         = "root"
  ssh_private_key_file = var.ssh_key
  ssh_timeout          = "45m"
}

build {
  sources = ["source.qemu.debian12", "source.proxmox-iso.debian12"]

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
    script           = "${path.root}/scripts/provision-debian.sh"
    environment_vars = ["LAB_BOOT_CMDLINE=${var.boot_cmdline}", "LAB_ROOT_LABEL=${var.root_label}"]
  }

  provisioner "file" {
    source      = "/etc/lab-image.json"
    destination = var.report_out
    direction   = "download"
  }
}
