# The Packer plugins the templates here use, for a modern Packer (1.7+), where builders and
# post-processors are plugins: `packer init packer/plugins.pkr.hcl` installs them. Only this file
# declares them: Debian's Packer 1.6.6, which `lab images build` runs one template at a time, has
# them built in and does not know the `required_plugins` block.
packer {
  required_plugins {
    # every template's qemu source
    qemu = {
      source  = "github.com/hashicorp/qemu"
      version = ">= 1.1.0"
    }
    # every template's proxmox-iso source (API token auth: plugin >= 1.0; Packer 1.6.6's built-in
    # proxmox builder has no `token`, so 1.6.6 cannot build these sources)
    proxmox = {
      source  = "github.com/hashicorp/proxmox"
      version = ">= 1.1.0"
    }
    # debian12's post-processor "vagrant": the golden image as a libvirt Vagrant box
    vagrant = {
      source  = "github.com/hashicorp/vagrant"
      version = ">= 1.1.0"
    }
  }
}
