"""The vagrant backend: cells as Vagrant machines (vagrant-libvirt), golden images as Vagrant boxes.

settings    `[hosts.NAME] backend = "vagrant"` and what such a host can make
backend     VagrantBackend: a Vagrantfile per cell, `vagrant up`/`destroy`, leases, `lab gc`
box         the box a golden image's Packer build makes, and `vagrant box add` (publish)
vagrantfile templates/vagrant/Vagrantfile.j2 for one machine (also what `lab reproduce` writes)
tools       `vagrant` and `virsh` through lab.proc, and their output parsers
"""
