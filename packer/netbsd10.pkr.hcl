# netbsd10 golden image: NetBSD 10.1 from the official amd64 ISO. sysinst is menu-driven, so
# boot_command leaves it for its shell and runs a scripted install from the ISO's sets
# (templates/answers/netbsd-install.sh.j2, rendered by lab/images.py into http_dir); then
# packer/scripts/provision-netbsd.sh provisions the system over SSH.
#
# Two sources, one build:
#   qemu.netbsd10         local artifact images/netbsd10.qcow2 (local and libvirt backends):
#                         `lab images build netbsd10` renders the answers and runs this source.
#   proxmox-iso.netbsd10  builds the template `lab-netbsd10` directly on a Proxmox VE node.
# Every path comes in as a variable; `lab images render netbsd10 DIR` writes http/ and stage/ for
# a hand-run `packer build -only=proxmox-iso.netbsd10`.

variable "iso_url" {
  type    = string
  default = "https://cdn.netbsd.org/pub/NetBSD/NetBSD-10.1/images/NetBSD-10.1-amd64.iso"
}
variable "iso_checksum" {
  type        = string
  default     = "file:https://cdn.netbsd.org/pub/NetBSD/NetBSD-10.1/images/SHA512"
  description = "file:URL of the release's checksum file, or sha256:HEX"
}
variable "http_dir" {
  type        = string
  default     = "build/netbsd10/http"
  description = "rendered answer files served to the installer"
}
variable "stage_dir" {
  type        = string
  default     = "build/netbsd10/stage"
  description = "rendered nginx.conf and site/"
}
variable "ssh_key" {
  type    = string
  default = "images/lab_key"
}
variable "report_out" {
  type    = string
  default = "build/netbsd10/lab-image.json"
}
variable "output_dir" {
  type    = string
  default = "build/netbsd10/packer-out"
}
variable "console_log" {
  type    = string
  default = "build/netbsd10/packer-console.log"
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
  # The ISO's boot menu starts sysinst: pick English (a), leave sysinst (x) for its shell, DHCP on
  # every interface, fetch the rendered install script and run it: a scripted install from the
  # ISO's own sets (GPT, FFSv2, bootloader on com0), then reboot into the disk.
  boot_command = [
    "a<enter><wait5>",
    "x<enter><wait5>",
    "dhcpcd -w<enter><wait20>",
    "ftp -o /tmp/install.sh http://{{ .HTTPIP }}:{{ .HTTPPort }}/install.sh && sh /tmp/install.sh<enter>",
  ]
}

source "qemu" "netbsd10" {
  iso_url          = var.iso_url
  iso_checksum     = var.iso_checksum
  output_directory = var.output_dir
  vm_name          = "netbsd10.qcow2"
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
  boot_wait        = "60s"
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

source "proxmox-iso" "netbsd10" {
  proxmox_url              = var.proxmox_url
  insecure_skip_tls_verify = false
  username                 = var.proxmox_username
  token                    = var.proxmox_token
  node                     = var.proxmox_node
  iso_url                  = var.iso_url
  iso_checksum             = var.iso_checksum
  iso_storage_pool         = var.proxmox_iso_storage
  unmount_iso              = true
  vm_name                  = "lab-netbsd10-build"
  template_name            = "lab-netbsd10"
  template_description     = "lab golden image netbsd10 (packer/netbsd10.pkr.hcl)"
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
  boot_wait            = "60s"
  boot_command         = local.boot_command
  communicator         = "ssh"
  ssh_host             = var.proxmox_ssh_host
  ssh_username         = "root"
  ssh_private_key_file = var.ssh_key
  ssh_timeout          = "30m"
}

build {
  sources = ["source.qemu.netbsd10", "source.proxmox-iso.netbsd10"]

  provisioner "file" {
    source      = "${var.stage_dir}/"
    destination = "/tmp"
  }

  provisioner "shell" {
    script = "${path.root}/scripts/provision-netbsd.sh"
  }

  provisioner "file" {
    source      = "/etc/lab-image.json"
    destination = var.report_out
    direction   = "download"
  }
}
