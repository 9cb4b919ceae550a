# freebsd14 golden image: FreeBSD 14.3-RELEASE from the official disc1 ISO, installed unattended by
# `bsdinstall script` with templates/answers/freebsd-installerconfig.j2 (rendered by lab/images.py
# into http_dir), then provisioned over SSH by packer/scripts/provision-freebsd.sh.
#
# Two sources, one build:
#   qemu.freebsd14         local artifact images/freebsd14.qcow2 (local and libvirt backends):
#                          `lab images build freebsd14` renders the answers and runs this source.
#   proxmox-iso.freebsd14  builds the template `lab-freebsd14` directly on a Proxmox VE node.
# Every path comes in as a variable; `lab images render freebsd14 DIR` writes http/ and stage/ for
# a hand-run `packer build -only=proxmox-iso.freebsd14`.

variable "iso_url" {
  type    = string
  default = "https://download.freebsd.org/releases/amd64/amd64/ISO-IMAGES/14.3/FreeBSD-14.3-RELEASE-amd64-disc1.iso"
}
variable "iso_checksum" {
  type        = string
  default     = "file:https://download.freebsd.org/releases/amd64/amd64/ISO-IMAGES/14.3/CHECKSUM.SHA256-FreeBSD-14.3-RELEASE-amd64"
  description = "file:URL of the release's checksum file, or sha256:HEX"
}
variable "http_dir" {
  type        = string
  default     = "build/freebsd14/http"
  description = "rendered answer files served to the installer"
}
variable "stage_dir" {
  type        = string
  default     = "build/freebsd14/stage"
  description = "rendered nginx.conf and site/"
}
variable "ssh_key" {
  type    = string
  default = "images/lab_key"
}
variable "report_out" {
  type    = string
  default = "build/freebsd14/lab-image.json"
}
variable "output_dir" {
  type    = string
  default = "build/freebsd14/packer-out"
}
variable "console_log" {
  type    = string
  default = "build/freebsd14/packer-console.log"
}
variable "accelerator" {
  type    = string
  default = "kvm"
}
variable "disk_size" {
  type    = string
  default = "8192M"
}
# Proxmox VE: an API token (user@realm!tokenid + secret), never a password.
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
  description = "the build VM's address (a DHCP reservation); empty: ask the guest agent"
}

locals {
  # Escape the loader menu, boot single-user, make /tmp writable, DHCP on vtnet0 (virtio on both
  # sources), fetch the rendered installerconfig and let bsdinstall run it; it reboots into the disk.
  boot_command = [
    "<esc><wait>",
    "boot -s<enter>",
    "<wait30>",
    "/bin/sh<enter><wait>",
    "mdmfs -s 100m md1 /tmp<enter><wait>",
    "mdmfs -s 100m md2 /mnt<enter><wait>",
    "dhclient -p /tmp/dhclient.vtnet0.pid -l /tmp/dhclient.lease.vtnet0 vtnet0<enter><wait10>",
    "fetch -o /tmp/installerconfig http://{{ .HTTPIP }}:{{ .HTTPPort }}/installerconfig && bsdinstall script /tmp/installerconfig<enter>",
  ]
}

source "qemu" "freebsd14" {
  iso_url          = var.iso_url
  iso_checksum     = var.iso_checksum
  output_directory = var.output_dir
  vm_name          = "freebsd14.qcow2"
  format           = "qcow2"
  disk_size        = var.disk_size
  disk_interface   = "virtio"
  disk_discard     = "unmap"
  net_device       = "virtio-net"
  accelerator      = var.accelerator
  cpus             = 2
  memory           = 1024
  headless         = true
  vnc_bind_address = "127.0.0.1"
  http_directory   = var.http_dir
  boot_wait        = "10s"
  boot_command     = local.boot_command
  qemuargs = [
    ["-serial", "file:${var.console_log}"],
    # Packer's default forwards SSH on every host interface; keep it on loopback.
    ["-netdev", "user,id=user.0,hostfwd=tcp:127.0.0.1:{{ .SSHHostPort }}-:22"],
    ["-device", "virtio-net-pci,netdev=user.0"],
  ]
  communicator         = "ssh"
  ssh_username         = "root"
  ssh_private_key_file = var.ssh_key
  ssh_timeout          = "30m"
  host_port_min        = 2222
  host_port_max        = 2299
  shutdown_command     = "shutdown -p now"
  shutdown_timeout     = "5m"
}

source "proxmox-iso" "freebsd14" {
  proxmox_url              = var.proxmox_url
  insecure_skip_tls_verify = false
  username                 = var.proxmox_username
  token                    = var.proxmox_token
  node                     = var.proxmox_node
  iso_url                  = var.iso_url
  iso_checksum             = var.iso_checksum
  iso_storage_pool         = var.proxmox_iso_storage
  unmount_iso              = true
  vm_name                  = "lab-freebsd14-build"
  template_name            = "lab-freebsd14"
  template_description     = "lab golden image freebsd14 (packer/freebsd14.pkr.hcl)"
  os                       = "other"
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
  http_directory       = var.http_dir
  boot_wait            = "10s"
  boot_command         = local.boot_command
  communicator         = "ssh"
  ssh_host             = var.proxmox_ssh_host
  ssh_username         = "root"
  ssh_private_key_file = var.ssh_key
  ssh_timeout          = "30m"
}

build {
  sources = ["source.qemu.freebsd14", "source.proxmox-iso.freebsd14"]

  provisioner "file" {
    source      = "${var.stage_dir}/"
    destination = "/tmp"
  }

  provisioner "shell" {
    script = "${path.root}/scripts/provision-freebsd.sh"
  }

  provisioner "file" {
    source      = "/etc/lab-image.json"
    destination = var.report_out
    direction   = "download"
  }
}
