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
	libvirt-daemon-system libvirt-dev pkg-config gcc shellcheck libxml2-utils \
	nginx-light chromium \
	dnsmasq-base udhcpc fdisk dosfstools mtools ovmf genisoimage openssh-server vagrant vagrant-libvirt ruby \
	pipx

.PHONY: setup apt venv images run test test-fast bench chaos lint docs clean gc doctor packer-modern test-packer-modern test-studies

setup: apt venv

# Installs only what is missing, so a second `make` does not touch apt.
apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "apt: installing $$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# flock: two `make` at once (parallel shells, helpers) must not build one venv twice. The
# distribution was named `lab` before it became `vmlab`: an older venv's registration of it goes first.
$(VENV)/.installed: pyproject.toml
	@flock .venv.lock bash -c 'set -e; test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV); \
		$(VENV)/bin/pip install -q --upgrade pip; \
		$(VENV)/bin/pip uninstall -q -y lab 2>/dev/null; \
		$(VENV)/bin/pip install -q -e ".[test,libvirt,docs]"; touch $@'

venv: apt $(VENV)/.installed

images: setup
	$(LAB) images build $(IMAGE)

run: images
	$(LAB) run

# Three passes: the fast lane beside the image build (below); everything else that is independent on
# two workers (the libvirt tests sharing one libvirtd the session starts and stops), their local and
# emulated guests' vCPUs on one host thread each (tcg_threads = "single": tests/support/local.py),
# since two workers' multi-threaded TCG guests on 2 cores preempt each other mid-translation (8 VM
# tests: 842 s on one worker, 688 s on two multi-threaded, 562 s on two single-threaded); then, alone,
# without that libvirtd, the measurements that other VMs on the same 2 cores would skew (a change
# point, an explanation, a host hog), and the tests that start libvirtd themselves or
# `lab gc --force` every lab domain of qemu:///system (tests/vm/test_chaos_vm.py).
# (pyproject's addopts select the fast lane; the -m and -n given here replace them; --durations
# prints the slowest tests, so a CI log says where the time went; --update-durations writes what each
# test that ran took to tests/durations.json, which orders the next run longest first:
# tests/support/durations.py, docs/testing.md)
#
# The image build leaves about 40 % of the 2 cores idle (mmdebstrap waits on the network and disk,
# packer's guest on its provisioning's I/O), so the fast lane (no VM, no image, no root) runs beside
# it, after the static checks (make lint, about 1 min). Alone, the fast lane mostly waits (231 s of
# CPU in 237 s on two workers; four: 172 s), but beside the build the three together use both cores:
# on four workers it took 252 s and slowed the build from 233 to 306 s (fresh clone, 2026-12-03),
# so it stays on two here. The build's output is printed once it ends.
FAST := not vm and not image and not root and not serial and not packer_modern and not browser and not study
#
# The three passes' labs share one store of warm snapshots ($$LAB_TESTS_WARM_DIR, the hosts'
# warm_dir: tests/support/local.py), so each machine shape is booted and saved once, not per test;
# removed when make test ends, passed or failed.
test: setup
	@set -e; log=$$(mktemp); warm=$$(mktemp -d /var/tmp/lab-warm-XXXXXX); export LAB_TESTS_WARM_DIR=$$warm; \
	trap 'rm -rf "$$log" "$$warm"' EXIT; \
	$(MAKE) --no-print-directory images >"$$log" 2>&1 & build=$$!; \
	fast=0; { $(MAKE) --no-print-directory lint && \
		$(PYTEST) -n 2 --dist loadgroup -q -rsR --update-durations -m '$(FAST)'; } || fast=$$?; \
	image=0; wait $$build || image=$$?; cat "$$log"; \
	if [ $$image != 0 ]; then echo "make images failed (exit $$image)"; exit $$image; fi; \
	if [ $$fast != 0 ]; then exit $$fast; fi; \
	$(PYTEST) -n 2 --dist loadgroup --no-loadscope-reorder -q -rsR --durations=25 --update-durations \
		-m '(vm or image or root or browser) and not serial and not packer_modern'; \
	$(PYTEST) -n 0 -q -rsR --durations=10 --update-durations -m serial

# Static checks; no VM, no image, no root: about 9 s with cold caches, 3 s warm, on 2 cores.
# Versions: ruff, mypy (and python-hcl2 for the plugins test) are pinned in pyproject's `test`
# extra; shellcheck, packer (Debian's 1.6.6) and xmllint come from apt.
#   ruff          lint (rules in pyproject [tool.ruff]) and format --check, over lab/, tests/ and tools/
#   mypy          lab/ and tools/, default settings (pyproject [tool.mypy])
#   shellcheck    every tracked file with a sh/bash shebang (symbolic links left out: lab/templates and
#                 lab/packer are the top-level directories), and the shell answer files as rendered
#   packer        fmt -check on every template; validate -syntax-only on each build template
#                 (plugins.pkr.hcl holds only `packer { required_plugins }`: Packer 1.6.6 cannot
#                 parse that block; tests/unit/test_packer_plugins.py checks it instead)
#   xmllint       the libvirt domain templates as rendered, against libvirt's RNG schema if installed
#   mkdocs        the docs site built with --strict (a broken link or anchor, a page outside the nav,
#                 fails), its reference generated from the code first (tools/docs_reference.py)
DOMAIN_RNG := /usr/share/libvirt/schemas/domain.rng
# (not --quiet: mkdocs 1.6 then stops counting warnings, and --strict passes a broken link;
# NO_MKDOCS_2_WARNING: Material's banner about its successor, printed on every build)
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs

lint: venv
	$(VENV)/bin/ruff check lab tests tools
	$(VENV)/bin/ruff format --check lab tests tools
	$(VENV)/bin/mypy
	git ls-files -s | awk '$$1 != "120000" { print $$4 }' | grep -v '\.j2$$' | xargs awk 'FNR == 1 && /^#!.*[\/ ](ba|da)?sh( |$$)/ { print FILENAME } { nextfile }' \
		| xargs shellcheck
	@set -e; export CHECKPOINT_DISABLE=1; cd packer; for t in *.pkr.hcl; do \
		packer fmt -check -diff "$$t"; \
		if [ "$$t" != plugins.pkr.hcl ]; then packer validate -syntax-only "$$t" >/dev/null; fi; \
	done; echo "packer: $$(ls *.pkr.hcl | wc -l) templates formatted, build templates valid"
	@set -e; out=$$(mktemp -d); trap 'rm -rf "$$out"' EXIT; \
	$(VENV)/bin/python tests/lint/render_templates.py "$$out" >/dev/null; \
	if [ -f $(DOMAIN_RNG) ]; then xmllint --noout --relaxng $(DOMAIN_RNG) "$$out"/domain-*.xml; \
	else xmllint --noout "$$out"/domain-*.xml; echo "xmllint: no $(DOMAIN_RNG): well-formedness only"; fi; \
	shellcheck "$$out"/answers/*/install.sh; \
	shellcheck -s sh -e SC2034 "$$out"/answers/freebsd14/installerconfig  # bsdinstall reads the preamble's variables
	@set -eo pipefail; out=$$(mktemp -d); trap 'rm -rf "$$out"' EXIT; \
	$(MKDOCS) build --strict --site-dir "$$out" 2>&1 | { grep -v '^INFO' || true; }; echo "mkdocs: site built (strict)"

# The docs site into site/ (open site/index.html), its reference generated from the code;
# `.venv/bin/mkdocs serve` serves it while you edit.
docs: venv
	$(MKDOCS) build --strict

# The fast lane (pyproject's addopts): no VMs, no image, no root; `pytest` alone runs the same.
test-fast: setup
	$(PYTEST) -q

# Figures, not pass/fail: the local backend (cold, warm, bare QEMU), then a lab cell on a vagrant
# host beside a plain `vagrant up` + `vagrant destroy` of the same box (issue 19's 0.33x goal; it
# starts libvirtd when nothing serves qemu:///system and stops it after, or says in one line why it
# is skipped), then the scale of lanes: 50 fake hosts × 1,000 cells (wall vs Σ cell time / lanes, CPU, memory),
# then the cells `lab explain` needs against the full factorial for 4 to 8 knobs (simulated, 15 s of CPU).
bench: images
	$(VENV)/bin/python -m lab.bench
	$(VENV)/bin/python -m lab.backends.vagrant.bench
	$(VENV)/bin/python tests/support/scalebench.py
	$(VENV)/bin/python -m lab.explain.bench

# Packer 1.12 and its qemu, proxmox and vagrant plugins, built from source with Go (>= 1.25 on PATH)
# into $(PACKER_MODERN) (tests/support/packer_modern.py says how). Not in make test: 15.6 min on the 2
# shared cores (Packer 551 s, the qemu, proxmox and vagrant plugins 82, 153 and 147 s; measured beside other
# engineers' work, load 13-18), after a first download of their modules (about 3 GiB of Go module cache).
PACKER_MODERN ?= $(HOME)/.cache/lab/packer-modern
packer-modern: venv
	LAB_PACKER_MODERN=$(PACKER_MODERN) $(VENV)/bin/python tests/support/packer_modern.py

# What make test cannot run (Packer 1.12, its plugins): every template validated by it, and the
# debian12 image built by it into a directory of the test's own: 4.6 min here, 264 s of it the build.
test-packer-modern: packer-modern
	LAB_PACKER_MODERN=$(PACKER_MODERN) $(PYTEST) -n 0 -q -rs --durations=0 -m packer_modern

# The studies' labs (examples/study-*.toml) run small, as docs/studies.md tells a user to try them,
# alone (make test runs them too, in its VM pass).
test-studies: images
	$(PYTEST) -n 2 --dist loadgroup -q -rs --durations=0 -m study

# Fault injection (tests/support/chaos.py, long configuration): kills, a full results disk, PVE
# emulator and libvirt failures; prints a table and totals, exits non-zero on any leak or lost sample.
chaos: images
	$(VENV)/bin/python tests/support/chaos.py --config long

gc: setup
	$(LAB) gc

doctor: setup
	$(LAB) doctor

clean:
	rm -rf $(VENV) build results
