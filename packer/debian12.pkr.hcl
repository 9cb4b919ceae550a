# debian12 golden image. Two sources, one build:
#   qemu.debian12         step 2 of 2 of `lab images build debian12` (step 1 is mmdebstrap + sfdisk +
#                         mkfs.ext4 + qemu-img in lab/images.py): boot the partitioned qcow2 by direct
#                         kernel boot under TCG, provision it over SSH (GRUB for BIOS and UEFI
#                         included), download the version report, shut down.
#   proxmox-iso.debian12  builds the template `lab-debian12` directly on a Proxmox VE node from the
#                         Debian 12 netinst ISO with the preseed rendered from
#                         templates/answers/debian-preseed.cfg.j2 (`lab images render debian12 DIR`).
# Both run packer/scripts/provision-debian.sh. Every path comes in as a variable.
# The qemu source's disk also becomes a libvirt Vagrant box (post-processors at the end: `vagrant`,
# declared for modern Packer in packer/plugins.pkr.hcl; built into Debian's 1.6.6).

variable "disk_in" {
  type        = string
  default     = ""
  description = "the qcow2 made from the mmdebstrap rootfs (copied, never modified)"
}
variable "disk_checksum" {
  type        = string
  default     = "none"
  description = "sha256:HEX of disk_in: Packer checks it is the disk lab made (lab images build passes it)"
  validation {
    condition     = regex_replace(var.disk_checksum, "^(none|sha256:[0-9a-f]{64})$", "") == ""
    error_message = "The disk_checksum must be sha256:HEX (64 hex digits) or none."
  }
}
variable "output_dir" {
  type        = string
  default     = ""
  description = "empty: build/debian12/packer-out in the repository (beside packer/)"
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
  default     = ""
  description = "empty: images/lab_key in the repository (beside packer/)"
}
variable "stage_dir" {
  type        = string
  default     = ""
  description = "build dir holding nginx.conf (rendered) and site/ (rendered + generated); empty: build/debian12/stage in the repository (beside packer/)"
}
variable "report_out" {
  type        = string
  default     = ""
  description = "where the guest's /etc/lab-image.json is downloaded to; empty: build/debian12/lab-image.json in the repository (beside packer/)"
}
variable "console_log" {
  type        = string
  default     = ""
  description = "empty: build/debian12/packer-console.log in the repository (beside packer/)"
}
variable "disk_size" {
  type    = string
  default = "4096M"
  validation {
    condition     = regex_replace(var.disk_size, "^[0-9]+[MG]$", "") == ""
    error_message = "The disk_size must be a size in MiB or GiB, such as 4096M or 8G."
  }
}
# The Vagrant box (qemu source only): it carries the image's name, recipe digest and the golden
# disk's sha256 (lab-box.json, and the box's Vagrantfile). `lab images build` passes the digest.
variable "image_name" {
  type    = string
  default = "debian12"
}
variable "recipe_digest" {
  type        = string
  default     = ""
  description = "lab's recipe digest of this image (lab.images.recipe_digest)"
  validation {
    condition     = regex_replace(var.recipe_digest, "^[0-9a-f]*$", "") == ""
    error_message = "The recipe_digest must be lab's hex digest (lab images render prints it), or empty."
  }
}
variable "box_dir" {
  type        = string
  default     = ""
  description = "where the box and its lab-box.json go; empty: images/ beside packer/"
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
  validation {
    condition     = regex_replace(var.iso_checksum, "^(none|file:.+|(md5|sha1|sha256|sha512):[0-9a-fA-F]+)$", "") == ""
    error_message = "The iso_checksum must be file:URL (a checksum file), TYPE:HEX (md5, sha1, sha256, sha512) or none."
  }
}
variable "http_dir" {
  type        = string
  default     = ""
  description = "the rendered preseed.cfg; empty: build/debian12/http in the repository (beside packer/)"
}
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
  description = "the build VM's address; empty: ask the guest agent (the preseed installs it)"
}

locals {
  # Paths a caller leaves empty are the repository's own (path.root is packer/), whatever the
  # working directory; lab images build passes every one of them.
  output_dir  = var.output_dir != "" ? var.output_dir : "${path.root}/../build/debian12/packer-out"
  ssh_key     = var.ssh_key != "" ? var.ssh_key : "${path.root}/../images/lab_key"
  stage_dir   = var.stage_dir != "" ? var.stage_dir : "${path.root}/../build/debian12/stage"
  report_out  = var.report_out != "" ? var.report_out : "${path.root}/../build/debian12/lab-image.json"
  console_log = var.console_log != "" ? var.console_log : "${path.root}/../build/debian12/packer-console.log"
  http_dir    = var.http_dir != "" ? var.http_dir : "${path.root}/../build/debian12/http"
  box_dir     = var.box_dir != "" ? var.box_dir : "${path.root}/../images"
}

source "qemu" "debian12" {
  iso_url          = var.disk_in
  iso_checksum     = var.disk_checksum
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
  output_directory = local.output_dir
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
    ["-serial", "file:${local.console_log}"],
    # Packer's default forwards SSH on every host interface; keep it on loopback.
    ["-netdev", "user,id=user.0,hostfwd=tcp:127.0.0.1:{{ .SSHHostPort }}-:22"],
    ["-device", "virtio-net-pci,netdev=user.0"],
  ]
  communicator         = "ssh"
  ssh_username         = "root"
  ssh_private_key_file = local.ssh_key
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
  template_description     = "lab-marker: lab/template\nlab-image: debian12\nlab-image-digest: ${var.recipe_digest}\nlab golden image debian12 (packer/debian12.pkr.hcl, netinst + preseed)"
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
  http_directory = local.http_dir
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
  ssh_private_key_file = local.ssh_key
  ssh_timeout          = "45m"
}

build {
  sources = ["source.qemu.debian12", "source.proxmox-iso.debian12"]

  provisioner "file" {
    source      = "${local.stage_dir}/nginx.conf"
    destination = "/tmp/lab-nginx.conf"
  }

  provisioner "file" {
    source      = "${local.stage_dir}/site"
    destination = "/tmp/lab-site"
  }

  # The base container image (mmdebstrap, zstd tarball): to /run (tmpfs), so the blocks it
  # occupies never reach the disk image; provisioning imports it into podman's store. The qemu
  # source's rootfs has it in the store already (imported when lab built the rootfs).
  provisioner "file" {
    only        = ["proxmox-iso.debian12"]
    source      = "${local.stage_dir}/lab-base.tar.zst"
    destination = "/run/lab-base.tar.zst"
  }

  provisioner "shell" {
    script           = "${path.root}/scripts/provision-debian.sh"
    environment_vars = ["LAB_BOOT_CMDLINE=${var.boot_cmdline}", "LAB_ROOT_LABEL=${var.root_label}"]
  }

  provisioner "file" {
    source      = "/etc/lab-image.json"
    destination = local.report_out
    direction   = "download"
  }

  # The golden disk as a libvirt Vagrant box: box.img is a byte copy of the qcow2 above (its sha256
  # is the manifest's), packed with the Vagrantfile and lab-box.json written first. The qcow2 stays
  # (keep_input_artifact): lab installs it into images/ after Packer.
  post-processors {
    post-processor "shell-local" {
      name = "box-info"
      only = ["qemu.debian12"]
      environment_vars = [
        "DISK=${local.output_dir}/debian12.qcow2",
        "OUT=${local.box_dir}",
        "NAME=${var.image_name}",
        "DIGEST=${var.recipe_digest}",
        "SSH_KEY=${local.ssh_key}",
      ]
      inline = [<<-EOS
        set -eu
        mkdir -p "$OUT"
        sha=$(sha256sum "$DISK" | cut -d' ' -f1)
        printf '{"name": "%s", "recipe_digest": "%s", "sha256": "%s", "format": "qcow2", "provider": "libvirt"}\n' \
          "$NAME" "$DIGEST" "$sha" > "$OUT/$NAME.box.json"
        cat > "$OUT/$NAME.Vagrantfile" <<RUBY
        # lab golden image $NAME (packer/debian12.pkr.hcl): recipe digest $DIGEST, disk sha256 $sha
        LAB_BOX = { "name" => "$NAME", "recipe_digest" => "$DIGEST", "sha256" => "$sha" }
        Vagrant.configure("2") do |config|
          # root by the lab's key only (images/README.md, "SSH"); nothing to sync into the guest
          config.ssh.username = "root"
          config.ssh.insert_key = false
          config.ssh.private_key_path = ENV.fetch("LAB_SSH_KEY", "$SSH_KEY")
          config.ssh.shell = "sh"
          config.ssh.sudo_command = "%c"  # root already, and no sudo in the image
          config.vm.synced_folder ".", "/vagrant", disabled: true
          config.vm.provider :libvirt do |libvirt|
            libvirt.title = "lab $NAME recipe $DIGEST sha256 $sha"
            libvirt.graphics_type = "none"
            libvirt.video_type = "none"
          end
        end
        RUBY
        EOS
      ]
    }
    post-processor "vagrant" {
      name                           = "box"
      only                           = ["qemu.debian12"]
      keep_input_artifact            = true
      output                         = "${local.box_dir}/${var.image_name}.box"
      compression_level              = 1
      vagrantfile_template           = "${local.box_dir}/${var.image_name}.Vagrantfile"
      vagrantfile_template_generated = true
      include                        = ["${local.box_dir}/${var.image_name}.box.json"]
    }
  }
}
