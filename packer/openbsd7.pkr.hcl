# openbsd7 golden image: OpenBSD 7.8 from the official install78.iso, installed by autoinstall(8)
# with templates/answers/openbsd-install.conf.j2 (rendered by lab/images.py into http_dir), then
# provisioned over SSH by packer/scripts/provision-openbsd.sh.
#
# Two sources, one build:
#   qemu.openbsd7         local artifact images/openbsd7.qcow2 (local and libvirt backends):
#                         `lab images build openbsd7` renders the answers and runs this source.
#   proxmox-iso.openbsd7  builds the template `lab-openbsd7` directly on a Proxmox VE node.
# Every path comes in as a variable; `lab images render openbsd7 DIR` writes http/ and stage/ for
# a hand-run `packer build -only=proxmox-iso.openbsd7`.

variable "iso_url" {
  type    = string
  default = "https://cdn.openbsd.org/pub/OpenBSD/7.8/amd64/install78.iso"
}
variable "iso_checksum" {
  type        = string
  default     = "file:https://cdn.openbsd.org/pub/OpenBSD/7.8/amd64/SHA256"
  description = "file:URL of the release's checksum file, or sha256:HEX"
}
variable "http_dir" {
  type        = string
  default     = "build/openbsd7/http"
  description = "rendered answer files served to the installer"
}
variable "stage_dir" {
  type        = string
  default     = "build/openbsd7/stage"
  description = "rendered nginx.conf and site/"
}
variable "ssh_key" {
  type    = string
  default = "images/lab_key"
}
variable "report_out" {
  type    = string
  default = "build/openbsd7/lab-image.json"
}
variable "output_dir" {
  type    = string
  default = "build/openbsd7/packer-out"
}
variable "console_log" {
  type    = string
  default = "build/openbsd7/packer-console.log"
}
variable "accelerator" {
  type    = string
  default = "kvm"
}
variable "disk_size" {
  type    = string
  default = "12288M"
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
  # At "(I)nstall, (U)pgrade, (A)utoinstall or (S)hell?" choose autoinstall; it configures the first
  # NIC by DHCP and asks for the response file, which Packer's HTTP server serves.
  boot_command = [
    "a<enter><wait10>",
    "http://{{ .HTTPIP }}:{{ .HTTPPort }}/install.conf<enter>",
  ]
}

source "qemu" "openbsd7" {
  iso_url          = var.iso_url
  iso_checksum     = var.iso_checksum
  output_directory = var.output_dir
  vm_name          = "openbsd7.qcow2"
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
  boot_wait        = "45s"
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

source "proxmox-iso" "openbsd7" {
  proxmox_url              = var.proxmox_url
  insecure_skip_tls_verify = false
  username                 = var.proxmox_username
  token                    = var.proxmox_token
  node                     = var.proxmox_node
  iso_url                  = var.iso_url
  iso_checksum             = var.iso_checksum
  iso_storage_pool         = var.proxmox_iso_storage
  unmount_iso              = true
  vm_name                  = "lab-openbsd7-build"
  template_name            = "lab-openbsd7"
  template_description     = "lab golden image openbsd7 (packer/openbsd7.pkr.hcl)"
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
  boot_wait            = "45s"
  boot_command         = local.boot_command
  communicator         = "ssh"
  ssh_host             = var.proxmox_ssh_host
  ssh_username         = "root"
  ssh_private_key_file = var.ssh_key
  ssh_timeout          = "30m"
}

build {
  sources = ["source.qemu.openbsd7", "source.proxmox-iso.openbsd7"]

  provisioner "file" {
    source      = "${var.stage_dir}/"
    destination = "/tmp"
  }

  provisioner "shell" {
    script = "${path.root}/scripts/provision-openbsd.sh"
  }

  provisioner "file" {
    source      = "/etc/lab-image.json"
    destination = var.report_out
    direction   = "download"
  }
}
