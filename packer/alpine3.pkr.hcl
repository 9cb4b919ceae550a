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
  validation {
    condition     = regex_replace(var.iso_checksum, "^(none|file:.+|(md5|sha1|sha256|sha512):[0-9a-fA-F]+)$", "") == ""
    error_message = "The iso_checksum must be file:URL (a checksum file), TYPE:HEX (md5, sha1, sha256, sha512) or none."
  }
}
variable "http_dir" {
  type        = string
  default     = ""
  description = "rendered answer files served to the installer; empty: build/alpine3/http in the repository (beside packer/)"
}
variable "stage_dir" {
  type        = string
  default     = ""
  description = "rendered nginx.conf and site/; empty: build/alpine3/stage in the repository (beside packer/)"
}
# The lab clones only a Proxmox template whose description carries its marker, the image's name and
# this recipe digest (lab.backends.proxmox.ownership); `lab images render` prints it for the build.
variable "recipe_digest" {
  type        = string
  default     = ""
  description = "lab's recipe digest of this image (lab.images.recipe_digest)"
  validation {
    condition     = regex_replace(var.recipe_digest, "^[0-9a-f]*$", "") == ""
    error_message = "The recipe_digest must be lab's hex digest (lab images render prints it), or empty."
  }
}
variable "ssh_key" {
  type        = string
  default     = ""
  description = "empty: images/lab_key in the repository (beside packer/)"
}
variable "report_out" {
  type        = string
  default     = ""
  description = "empty: build/alpine3/lab-image.json in the repository (beside packer/)"
}
variable "output_dir" {
  type        = string
  default     = ""
  description = "empty: build/alpine3/packer-out in the repository (beside packer/)"
}
variable "console_log" {
  type        = string
  default     = ""
  description = "empty: build/alpine3/packer-console.log in the repository (beside packer/)"
}
variable "accelerator" {
  type    = string
  default = "kvm"
  validation {
    condition     = regex_replace(var.accelerator, "^(kvm|tcg|hvf|whpx|xen|none)$", "") == ""
    error_message = "The accelerator must be one QEMU knows: kvm or tcg (as lab doctor probes), hvf, whpx, xen or none."
  }
}
variable "disk_size" {
  type    = string
  default = "4096M"
  validation {
    condition     = regex_replace(var.disk_size, "^[0-9]+[MG]$", "") == ""
    error_message = "The disk_size must be a size in MiB or GiB, such as 4096M or 8G."
  }
}
# Proxmox VE: an API token (user@realm!tokenid + secret), never a password.
variable "proxmox_url" {
  type    = string
  default = "https://pve.example:8006/api2/json"
  validation {
    condition     = regex_replace(var.proxmox_url, "^https://[^/]+/api2/json$", "") == ""
    error_message = "The proxmox_url must be the node's API: https://HOST:8006/api2/json."
  }
}
variable "proxmox_username" {
  type        = string
  default     = "lab@pve!packer"
  description = "the API token id: user@realm!tokenid"
  validation {
    condition     = regex_replace(var.proxmox_username, "^[^@!]+@[^@!]+![^@!]+$", "") == ""
    error_message = "The proxmox_username must be an API token id: user@realm!tokenid."
  }
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
  # Paths a caller leaves empty are the repository's own (path.root is packer/), whatever the
  # working directory; lab images build passes every one of them.
  output_dir  = var.output_dir != "" ? var.output_dir : "${path.root}/../build/alpine3/packer-out"
  ssh_key     = var.ssh_key != "" ? var.ssh_key : "${path.root}/../images/lab_key"
  stage_dir   = var.stage_dir != "" ? var.stage_dir : "${path.root}/../build/alpine3/stage"
  report_out  = var.report_out != "" ? var.report_out : "${path.root}/../build/alpine3/lab-image.json"
  console_log = var.console_log != "" ? var.console_log : "${path.root}/../build/alpine3/packer-console.log"
  http_dir    = var.http_dir != "" ? var.http_dir : "${path.root}/../build/alpine3/http"
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
  output_directory = local.output_dir
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
  http_directory   = local.http_dir
  # The answer files are served to QEMU's user-mode guest (10.0.2.2 is the host's loopback):
  # nothing else on the LAN can read them.
  http_bind_address = "127.0.0.1"
  boot_wait         = "30s"
  boot_command      = local.boot_command
  qemuargs = [
    ["-serial", "file:${local.console_log}"],
    # Packer's default forwards SSH on every host interface; keep it on loopback.
    ["-netdev", "user,id=user.0,hostfwd=tcp:127.0.0.1:{{ .SSHHostPort }}-:22"],
    ["-device", "virtio-net-pci,netdev=user.0"],
  ]
  communicator         = "ssh"
  ssh_username         = "root"
  ssh_private_key_file = local.ssh_key
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
  template_description     = "lab-marker: lab/template\nlab-image: alpine3\nlab-image-digest: ${var.recipe_digest}\nlab golden image alpine3 (packer/alpine3.pkr.hcl)"
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
  http_directory       = local.http_dir
  boot_wait            = "30s"
  boot_command         = local.boot_command
  communicator         = "ssh"
  ssh_host             = var.proxmox_ssh_host
  ssh_username         = "root"
  ssh_private_key_file = local.ssh_key
  ssh_timeout          = "30m"
}

build {
  sources = ["source.qemu.alpine3", "source.proxmox-iso.alpine3"]

  provisioner "file" {
    source      = "${local.stage_dir}/"
    destination = "/tmp"
  }

  provisioner "shell" {
    script = "${path.root}/scripts/provision-alpine.sh"
  }

  provisioner "file" {
    source      = "/etc/lab-image.json"
    destination = local.report_out
    direction   = "download"
  }
}
