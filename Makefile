# lab: two commands do all the set-up on a fresh Debian 12 machine.
#   make run    builds what is needed and runs the default lab (lab.toml) on the local QEMU backend
#   make test   runs the whole test suite (unit, emulator contracts, real-VM integration)

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
LAB := $(VENV)/bin/lab
PYTEST := $(VENV)/bin/pytest
IMAGE ?= debian12

# System packages (Debian 12). Each is there for a reason; see README.md "Dependencies".
APT_PACKAGES := qemu-system-x86 qemu-utils mmdebstrap packer e2fsprogs iproute2 \
	openssh-client openssl iperf3 wrk sysbench git curl zstd python3-venv \
	libvirt-daemon-system libvirt-dev pkg-config gcc shellcheck xmlstarlet libxml2-utils \
	nginx-light chromium \
	dnsmasq-base udhcpc fdisk ovmf genisoimage

.PHONY: setup apt venv images run test test-fast bench chaos lint clean gc doctor

setup: apt venv

# Installs only what is missing, so a second `make` does not touch apt.
apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "apt: installing $$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# flock: two `make` at once (parallel shells, helpers) must not build one venv twice.
$(VENV)/.installed: pyproject.toml
	@flock .venv.lock bash -c 'set -e; test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV); \
		$(VENV)/bin/pip install -q --upgrade pip; \
		$(VENV)/bin/pip install -q -e ".[test,libvirt]"; touch $@'

venv: apt $(VENV)/.installed

images: setup
	$(LAB) images build $(IMAGE)

run: images
	$(LAB) run

# Two passes: everything independent in parallel on 2 workers, then the measurements that other
# VMs on the same 2 cores would skew (virtio vs e1000 throughput), alone.
test: images
	$(PYTEST) -n 2 --dist loadgroup -q -rs -m 'not serial'
	$(PYTEST) -q -rs -m serial

# Unit and contract tests only: no VMs, no image.
test-fast: setup
	$(PYTEST) -q -m 'not vm and not image'

bench: images
	$(VENV)/bin/python -m lab.bench

# Fault injection (tests/chaos.py, long configuration): kills, a full results disk, PVE emulator
# and libvirt failures; prints a table and totals, exits non-zero on any leak or lost sample.
chaos: images
	$(VENV)/bin/python tests/chaos.py --config long

gc: setup
	$(LAB) gc

doctor: setup
	$(LAB) doctor

clean:
	rm -rf $(VENV) build results
