# alpine3 golden image: Alpine Linux 3.21 (virt flavour) from the official ISO, installed unattended
# with `setup-alpine -f` (templates/answers/alpine-answers.j2, rendered by lab/images.py into
# http_dir), then provisioned over SSH by packer/scripts/provision-alpine.sh.
#
# Two sources, one build:
#   qemu.alpine3         local artifact images/alpine3.qcow2 (local and libvirt backends):
#                        `lab images build alpine3` renders the answers and runs this source.
#   proxmox-iso.alpine3  builds the template `lab-alpine3` directly on a Proxmox VE node.
# Every path comes in as a variable; `lab images render alpine3 DIR` writes http/ and stage/ for
# a hand-run `packer build -only=proxmox-iso.alpine3`.

variable "iso_url" {
  type    = string
  default = "https://dl-cdn.alpinelinux.org/alpine/v3.21/releases/x86_64/alpine-virt-3.21.4-x86_64.iso"
}
variable "iso_checksum" {
  type        = string
  default     = "file:https://dl-cdn.alpinelinux.org/alpine/v3.21/releases/x86_64/alpine-virt-3.21.4-x86_64.iso.sha256"
  description = "file:URL of the release's checksum file, or sha256:HEX"
}
variable "http_dir" {
  type        = string
  default     = "build/alpine3/http"
  description = "rendered answer files served to the installer"
}
variable "stage_dir" {
  type        = string
  default     = "build/alpine3/stage"
  description = "rendered nginx.conf and site/"
}
variable "ssh_key" {
  type    = string
  default = "images/lab_key"
}
variable "report_out" {
  type    = string
  default = "build/alpine3/lab-image.json"
}
variable "output_dir" {
  type    = string
  default = "build/alpine3/packer-out"
}
variable "console_log" {
  type    = string
  default = "build/alpine3/packer-console.log"
}
variable "accelerator" {
  type    = string
  default = "kvm"
}
variable "disk_size" {
  type    = string
  default = "4096M"
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
  # The VNC keyboard logs in on tty1 (root has no password on the live ISO), brings up eth0 by DHCP
  # and runs the rendered install script, which runs setup-alpine -f and reboots into the disk.
  boot_command = [
    "root<enter><wait5>",
    "ifconfig eth0 up && udhcpc -q -i eth0<enter><wait10>",
    "wget -q -O /tmp/install.sh http://{{ .HTTPIP }}:{{ .HTTPPort }}/install.sh && sh /tmp/install.sh http://{{ .HTTPIP }}:{{ .HTTPPort }}<enter>",
  ]
}

source "qemu" "alpine3" {
  iso_url          = var.iso_url
  iso_checksum     = var.iso_checksum
  output_directory = var.output_dir
  vm_name          = "alpine3.qcow2"
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
  boot_wait        = "30s"
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
  shutdown_command     = "poweroff"
  shutdown_timeout     = "5m"
}

source "proxmox-iso" "alpine3" {
  proxmox_url              = var.proxmox_url
  insecure_skip_tls_verify = false
  username                 = var.proxmox_username
  token                    = var.proxmox_token
  node                     = var.proxmox_node
  iso_url                  = var.iso_url
  iso_checksum             = var.iso_checksum
  iso_storage_pool         = var.proxmox_iso_storage
  unmount_iso              = true
  vm_name                  = "lab-alpine3-build"
  template_name            = "lab-alpine3"
  template_description     = "lab golden image alpine3 (packer/alpine3.pkr.hcl)"
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
  http_directory       = var.http_dir
  boot_wait            = "30s"
  boot_command         = local.boot_command
  communicator         = "ssh"
  ssh_host             = var.proxmox_ssh_host
  ssh_username         = "root"
  ssh_private_key_file = var.ssh_key
  ssh_timeout          = "30m"
}

build {
  sources = ["source.qemu.alpine3", "source.proxmox-iso.alpine3"]

  provisioner "file" {
    source      = "${var.stage_dir}/"
    destination = "/tmp"
  }

  provisioner "shell" {
    script = "${path.root}/scripts/provision-alpine.sh"
  }

  provisioner "file" {
    source      = "/etc/lab-image.json"
    destination = var.report_out
    direction   = "download"
  }
}
