"""The vagrant backend for real: Vagrant 2.3.4 and vagrant-libvirt 0.11.2 (Debian's packages) on the
libvirtd the libvirt tests use (qemu:///system, TCG), booting the golden image's own box.

1. the box the image build made (packer/debian12.pkr.hcl's post-processors) is this build, byte for
   byte, and `lab images publish`'s hook adds it to Vagrant versioned by digest;
2. `lab run` with a `backend = "vagrant"` host: a generated Vagrantfile, `vagrant up`, verify,
   sysbench-cpu and iperf3-tcp (against the run's own isolated network), `vagrant destroy`; then
   nothing is left: no machine in `vagrant global-status`, no domain, no volume, no network;
3. `lab reproduce` of that cell: `vagrant up` of the Vagrantfile boots the same machine, its tune
   provisioner runs, and it passes the same in-guest verification as the cell did;
4. `lab run` killed with SIGKILL while `vagrant up` boots its machine: `lab gc` keeps it while the run
   lives, then finds it (machine index, domain <description>, volume) and removes everything.

Everything lives in this module's own Vagrant home, work directory and libvirt storage pool (all
removed at the end); the runs' networks are isolated (no forwarding), so load stays on them.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import secrets
import shutil
import signal
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from support.cli import LAB, run_lab_cli
from support.libvirt_daemons import URI as URI

import lab
from lab import osfacts, proc, reproduce
from lab.backends.vagrant import box
from lab.backends.vagrant.backend import NETWORK_PREFIX, VagrantBackend, free_subnet, host_networks, network_xml
from lab.backends.vagrant.settings import Settings
from lab.backends.vagrant.tools import Vagrant, Virsh
from lab.backends.vagrant.vagrantfile import Network
from lab.guest import Guest
from lab.model import DiskBus, NicModel, VmSpec
from lab.runlock import RUN_LOCK_DIR
from lab.runner import verify
from lab.store import Store
from lab.wait import wait_until

pytestmark = [
    pytest.mark.vm,
    pytest.mark.image,
    pytest.mark.root,
    pytest.mark.timeout(1800),
    pytest.mark.xdist_group("vagrant"),  # vagrant-libvirt's management network and box store are global
]


def need(tool: str) -> None:
    if shutil.which(tool) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is not installed (make setup installs vagrant and vagrant-libvirt for the tests)")
        pytest.skip(f"{tool} is not installed (apt-get install vagrant vagrant-libvirt)")


@pytest.fixture(scope="module")
def vg(libvirtd, golden):
    """This module's Vagrant home, work directory and storage pool, with the golden image's box
    published into that Vagrant. Yields the host settings and a few handles."""
    need("vagrant")
    try:
        built = box.built_box(golden)
    except lab.errors.UsageError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the golden image has no box of its own build: {exc}")
        pytest.skip(f"{exc} ({exc.hint})")
    root = Path(tempfile.mkdtemp(prefix="lvg", dir="/var/tmp"))
    root.chmod(0o755)  # libvirt's QEMU (libvirt-qemu) reaches the pool's volumes through it
    (root / "pool").mkdir(mode=0o755)
    pool = f"labvgpool{secrets.token_hex(3)}"
    virsh = Virsh(URI)
    virsh.run(["pool-create-as", pool, "dir", "--target", str(root / "pool")], what="virsh pool-create-as")
    settings = Settings(
        backend="vagrant",
        uri=URI,
        workdir=str(root / "work"),
        vagrant_home=str(root / "home"),
        storage_pool=pool,
        boot_timeout=900,
    )
    try:
        yield {
            "root": root,
            "settings": settings,
            "pool": pool,
            "virsh": virsh,
            "box": built,
            "vagrant": Vagrant(home=settings.vagrant_home, uri=URI),
        }
    finally:
        for name, _ in virsh.volumes(pool):
            virsh.run(["vol-delete", name, "--pool", pool], what="virsh vol-delete", check=False)
        virsh.run(["pool-destroy", pool], what="virsh pool-destroy", check=False)
        shutil.rmtree(root, ignore_errors=True)


def leftovers(vg: dict, run_id: str) -> list[str]:
    """What a run left: machines in Vagrant's index, domains, volumes, networks, files, locks."""
    virsh, settings = vg["virsh"], vg["settings"]
    out = [f"vagrant machine {e.name} ({e.directory})" for e in vg["vagrant"].global_status()]
    out += [f"domain {d}" for d in virsh.domains() if run_id in d]
    base = box.base_volume(vg["box"].name, vg["box"].version)  # the published box's disk stays, as a golden does
    out += [f"volume {v}" for v, _ in virsh.volumes(vg["pool"]) if v != base]
    out += [f"network {n}" for n in virsh.networks() if n == f"{NETWORK_PREFIX}{run_id}"]
    work = Path(settings.workdir)
    out += [f"file {p}" for p in work.rglob("*")] if work.is_dir() else []
    out += [f"lock {p.name}" for p in RUN_LOCK_DIR.glob(f"vagrant-*@{run_id}.lock")]
    return out


def write_lab(tmp_path: Path, vg: dict, workloads: str) -> Path:
    s = vg["settings"]
    text = textwrap.dedent(f"""
        [lab]
        name = "vagrant"
        results = "{tmp_path / "results"}"

        [hosts.local]  # `lab gc` sweeps the local backend too: only this test's directory
        backend = "local"
        workdir = "{tmp_path / "local"}"

        [hosts.vg]
        backend = "vagrant"
        uri = "{s.uri}"
        workdir = "{s.workdir}"
        vagrant_home = "{s.vagrant_home}"
        storage_pool = "{s.storage_pool}"
        boot_timeout = {s.boot_timeout}

        [matrix]
        host = ["vg"]
        image = ["debian12"]
        nic = ["e1000"]
        vcpus = [2]
        memory_mib = [1024]
        disk_bus = ["sata"]
        tuning = ["wan-16m"]

        [suite]
        workloads = {workloads}
        repetitions = 1
        warmup = 0

        [suite.params.sysbench-cpu]
        time = 1

        [suite.params.iperf3-tcp]
        time = 2
        """)
    path = tmp_path / "lab.toml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------------
# 1. the box


def read_box(path: Path) -> dict[str, bytes | str]:
    """A .box (a gzipped tar) read by GNU tar in one pass: each member's bytes, box.img's sha256
    instead. (Python's tarfile reads the time fields Packer's Go writer puts in the ustar prefix as
    part of the names.)"""
    each = 'printf "%s " "$TAR_FILENAME"; if [ "$TAR_FILENAME" = box.img ]; then sha256sum; else base64 -w0; echo; fi'
    listing = proc.run(["tar", "-xzf", str(path), f"--to-command={each}"], timeout=600).stdout
    out: dict[str, bytes | str] = {}
    for line in listing.splitlines():
        name, _, rest = line.partition(" ")
        out[name] = rest.split()[0] if name == "box.img" else base64.b64decode(rest)
    return out


def test_box_is_the_build_and_publish_adds_it_versioned_by_digest(vg, golden):
    built = vg["box"]
    assert (built.digest, built.sha256) == (golden.digest, golden.sha256)
    members = read_box(built.path)  # one pass over the gzip stream (each `tar -x` is another: 8 s here)
    assert sorted(members) == ["Vagrantfile", "box.img", "debian12.box.json", "metadata.json"]
    meta = json.loads(members["metadata.json"])
    assert meta == {"provider": "libvirt", "format": "qcow2", "virtual_size": 4}
    vfile = members["Vagrantfile"].decode()
    assert f'"recipe_digest" => "{golden.digest}"' in vfile and f'"sha256" => "{golden.sha256}"' in vfile
    assert 'config.ssh.username = "root"' in vfile
    assert members["box.img"] == golden.sha256  # box.img is the golden disk byte for byte

    backend = VagrantBackend("vg", vg["settings"])
    backend.check()
    with pytest.raises(lab.errors.UsageError, match="no box lab/debian12"):
        backend.check_images([golden])
    t0 = time.monotonic()
    where = backend.publishing.publish(golden)
    added_s = time.monotonic() - t0
    assert where == f"lab/debian12 {box.box_version(golden.digest, golden.sha256)}"
    assert ("lab/debian12", "libvirt", box.box_version(golden.digest, golden.sha256)) in vg["vagrant"].boxes()
    t0 = time.monotonic()
    assert backend.publishing.publish(golden) == where  # the same build again: nothing to add
    again_s = time.monotonic() - t0
    backend.check_images([golden])
    (line,) = backend.describe_images([golden])
    assert line == (
        f"debian12: box lab/debian12 {built.version} (recipe {golden.digest[:12]}), its disk uploaded "
        f"to pool {vg['pool']} by the first vagrant up"
    )
    print(f"\nvagrant box add: {added_s:.1f} s; again: {again_s:.1f} s")


# ---------------------------------------------------------------------------------------------------
# 2. lab run with a vagrant host, then 3. its cell reproduced


@pytest.fixture(scope="module")
def vagrant_run(vg, tmp_path_factory):
    """`lab run` of one cell on the vagrant host (the box published first)."""
    VagrantBackend("vg", vg["settings"]).publishing.publish(lab.images.load("debian12"))
    tmp_path = tmp_path_factory.mktemp("vagrant-run")
    cfg = write_lab(tmp_path, vg, '["sysbench-cpu", "iperf3-tcp"]')
    run_id = f"vg{secrets.token_hex(3)}"
    t0 = time.monotonic()
    res = run_lab_cli("run", "-c", str(cfg), "--run-id", run_id, timeout=1500)
    seconds = time.monotonic() - t0
    print(f"\nlab run on the vagrant host: {seconds:.1f} s\n{res.stderr[-3000:]}")
    return {"cfg": cfg, "run_id": run_id, "res": res, "seconds": seconds, "tmp": tmp_path}


def test_lab_run_on_a_vagrant_host_completes_and_leaves_nothing(vg, vagrant_run):
    res, run_id, cfg = vagrant_run["res"], vagrant_run["run_id"], vagrant_run["cfg"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    shown = run_lab_cli("show", run_id, "-c", str(cfg), "--json", timeout=60)
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    (cell,) = doc["cells"]
    assert cell["status"] == "done", cell
    facts = cell["facts"]
    assert facts["accel"] == "tcg" and facts["box"] == "lab/debian12" and facts["start"] == "cold"
    assert facts["box_version"] == box.box_version(vg["box"].digest, vg["box"].sha256)
    assert facts["verified"]["nic_driver"] == "e1000" and facts["verified"]["vcpus"] == 2
    assert facts["tuning"]["effective"]["net.core.rmem_max"] == "16777216"
    metrics = {(s["workload"], s["metric"]) for s in doc["samples"]}
    assert ("sysbench-cpu", "events_per_s_1t") in metrics and ("iperf3-tcp", "throughput_mbit_s_tx") in metrics
    print(
        f"vagrant up: {facts.get('vagrant_up_s')} s; samples: "
        + json.dumps(
            {f"{s['workload']}/{s['metric']}": round(s["value"], 1) for s in doc["samples"] if "cpu" not in s["metric"]}
        )
    )
    assert leftovers(vg, run_id) == []
    # the box's disk was uploaded to the pool once, by the first vagrant up, and stays for the next
    (line,) = VagrantBackend("vg", vg["settings"]).describe_images([lab.images.load("debian12")])
    assert line.endswith(f"its disk in pool {vg['pool']}"), line


def test_reproduced_cell_boots_and_passes_the_same_verification(vg, vagrant_run):
    run_id, tmp = vagrant_run["run_id"], vagrant_run["tmp"]
    assert vagrant_run["res"].returncode == 0
    store = Store(tmp / "results")
    virsh, vagrant = vg["virsh"], vg["vagrant"]
    # an isolated network for the reproduction (a user's Vagrant would use vagrant-libvirt's NAT one)
    net_name = f"{NETWORK_PREFIX}repro{secrets.token_hex(2)}"
    subnet = free_subnet("10.79.0.0/16", host_networks(), random.Random())
    virsh.create_network(network_xml(net_name, subnet), tmp / "repro-net.xml")
    out = tmp / "repro"
    try:
        r = reproduce.reproduce(
            store,
            run_id,
            "c01",
            out,
            ssh_key=lab.IMAGES_DIR / "lab_key",
            uri=URI,
            network=Network(net_name, str(subnet)),
            storage_pool=vg["pool"],
        )
        t0 = time.monotonic()
        up = vagrant.run(["up"], cwd=out, timeout=1200, what="vagrant up", check=False)
        up_s = time.monotonic() - t0
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-2000:]
        assert "net.core.rmem_max = 16777216" in up.stdout  # tune.sh ran and read back
        address = wait_until(lambda: virsh.address(r.machine.name), timeout=60, what="the reproduction's lease")
        cell = next(c for c in store.cells(run_id) if c.cell_id == "c01")
        spec = VmSpec(
            r.machine.name,
            run_id,
            "c01",
            lab.images.load("debian12"),
            NicModel(cell.axes["nic"]),
            int(cell.axes["vcpus"]),
            int(cell.axes["memory_mib"]),
            DiskBus(cell.axes["disk_bus"]),
        )
        with Guest(address, key=lab.IMAGES_DIR / "lab_key", control_dir=out, os="debian") as guest:
            guest.connect(timeout=120)
            seen = verify(guest, osfacts.facts("debian"), spec)  # the runner's own check
            assert seen["nic_driver"] == cell.facts["verified"]["nic_driver"] == "e1000"
            assert seen["vcpus"] == cell.facts["verified"]["vcpus"] == 2
            assert guest.run("sysctl -n net.core.rmem_max", timeout=30).stdout.strip() == "16777216"
        work = vagrant.run(
            ["provision", "--provision-with", "workloads"], cwd=out, timeout=600, what="vagrant provision", check=False
        )
        assert work.returncode == 0, work.stdout[-2000:] + work.stderr[-2000:]
        assert "events per second" in work.stdout  # sysbench ran in the guest
        print(f"\nreproduction: vagrant up {up_s:.1f} s")
    finally:
        down = vagrant.run(["destroy", "-f"], cwd=out, timeout=600, what="vagrant destroy", check=False)
        virsh.remove_network(net_name)
        store.close()
    assert down.returncode == 0, down.stderr
    assert r.machine.name not in virsh.domains()
    assert f"{r.machine.name}.img" not in {v for v, _ in virsh.volumes(vg["pool"])}
    assert not [e for e in vagrant.global_status() if e.directory == str(out)]


# ---------------------------------------------------------------------------------------------------
# 4. a killed run's machine, found and removed by `lab gc`


def test_gc_removes_a_killed_runs_machine(vg, tmp_path):
    VagrantBackend("vg", vg["settings"]).publishing.publish(lab.images.load("debian12"))
    cfg = write_lab(tmp_path, vg, '["sysbench-cpu"]')
    run_id = f"kill{secrets.token_hex(3)}"
    name = f"lab-{run_id}-c01"
    virsh = vg["virsh"]
    log = open(tmp_path / "run.log", "wb")
    p = proc.spawn([*LAB, "run", "-c", str(cfg), "--run-id", run_id], stdout=log, stderr=log)
    log.close()
    try:

        def domain_defined() -> bool:
            if p.poll() is not None:
                raise AssertionError(f"lab run exited early: {(tmp_path / 'run.log').read_text()[-2000:]}")
            return name in virsh.domains()

        wait_until(domain_defined, timeout=600, what=f"{name} to be defined by vagrant up")
        gc = run_lab_cli("gc", "-c", str(cfg), timeout=300)
        assert gc.returncode == 0, gc.stderr
        assert re.search(rf"keep\s+vg vm {name} \(run {run_id} is live\)", gc.stdout), gc.stdout
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)

    # lab is gone; its `vagrant up` (own session) and the domain are not
    assert name in virsh.domains()
    assert leftovers(vg, run_id)
    gc = run_lab_cli("gc", "-c", str(cfg), "--dry-run", timeout=300)
    assert f"would remove vg vm {name}" in gc.stdout, gc.stdout
    gc = run_lab_cli("gc", "-c", str(cfg), timeout=900)
    print(f"\n{gc.stdout}")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert f"removed vg vm {name}" in gc.stdout
    assert leftovers(vg, run_id) == []
