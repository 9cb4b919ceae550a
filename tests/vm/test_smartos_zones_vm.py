"""lab run of zone cells on an emulated SmartOS host whose zones are the golden image booted by QEMU."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from smartos_emulator import SmartosEmulator, gz_network
from smartos_emulator.fixtures import (  # noqa: F401  (fixtures)
    ZONE_IMAGE,
    lab_toml,
    skip_unless_emulator_can_run,
    smartos_fixture,
    smartos_net_fixture,
    smartos_workdir_fixture,
)
from support.cli import run_lab_cli

from lab import proc

ZONE_MATRIX = """image = ["debian12"]
isolation = ["zone"]
nic = ["virtio", "e1000"]  # moot for a zone: one cell, not two
vcpus = [1]
memory_mib = [512]"""


ZONE_SUITE = """workloads = ["sysbench-cpu", "iperf3-tcp", "http"]
repetitions = 2
warmup = 0
[suite.params.sysbench-cpu]
time = 2
threads = [1, 2]
[suite.params.iperf3-tcp]
time = 2
[suite.params.http]
duration = 2
connections = [10]"""


@pytest.mark.vm
@pytest.mark.image
def test_lab_run_of_zone_cells_on_an_emulated_smartos_host(golden, tmp_path):
    skip_unless_emulator_can_run()
    workdir = Path(tempfile.mkdtemp(prefix="smz", dir="/var/tmp"))
    try:
        with gz_network() as net, SmartosEmulator(workdir, net, backing="stub", zones=True) as emu:
            emu.install_zone_image(ZONE_IMAGE, name="debian-12", kernel_version="5.10.0")
            host = emu.table(zone_images={"debian12": ZONE_IMAGE})
            toml = lab_toml(tmp_path / "lab.toml", host, matrix=ZONE_MATRIX, suite=ZONE_SUITE)
            plan = run_lab_cli("plan", "-c", str(toml), cwd=tmp_path, timeout=120)
            assert plan.returncode == 0, plan.stderr
            assert "creates: 0 VM(s) and 1 zone(s)" in plan.stdout, plan.stdout
            res = run_lab_cli("run", "-c", str(toml), cwd=tmp_path, timeout=900)
            assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
            doc = json.loads(run_lab_cli("show", "--json", "-c", str(toml), cwd=tmp_path).stdout)
            (cell,) = doc["cells"]  # nic e1000 is not a second zone cell
            facts = cell["facts"] if isinstance(cell["facts"], dict) else json.loads(cell["facts"])
            assert cell["status"] == "done", cell
            assert facts["isolation"] == "zone" and facts["brand"] == "lx"
            assert facts["zone_image"] == "debian-12@20260101" and facts["kernel_version"] == "5.10.0"
            assert facts["verified"]["cpu_cap"] == 100 and facts["verified"]["max_physical_memory"] == 512
            assert facts["verified"]["nic_driver"] == "vnic"
            assert facts["verified"]["kernel"].startswith("Linux ")
            samples = doc["samples"]
            metrics = {(s["workload"], s["metric"]) for s in samples}
            assert any(w == "sysbench-cpu" and m.startswith("events_per_s") for w, m in metrics), metrics
            assert any(w == "iperf3-tcp" and "throughput" in m for w, m in metrics), metrics
            assert any(w == "http" and m.startswith("requests_per_s") for w, m in metrics), metrics
            eps = {t: [s["value"] for s in samples if s["metric"] == f"events_per_s_{t}"] for t in ("1t", "2t")}
            assert all(len(v) == 2 and min(v) > 0 for v in eps.values()), eps
            # cpu_cap 100 held: two threads got one CPU's worth, not this machine's two cores' (~2x)
            ratio = sum(eps["2t"]) / sum(eps["1t"])
            print(f"zone cell: sysbench 2 threads / 1 thread under cpu_cap 100 = {ratio:.2f}")
            assert ratio < 1.5, eps
            # CPU busy % beside throughput, over the whole host as an lx zone's /proc/stat shows it
            assert {"cpu_busy_pct_1t", "cpu_busy_pct_c10"} <= {m for _, m in metrics}
            assert "processor set" in facts["cpu_accounting"]
            rep = run_lab_cli("reproduce", "latest", "c01", "-c", str(toml), cwd=tmp_path)
            assert rep.returncode == 2 and "SmartOS zone of the image debian-12@20260101" in rep.stderr, rep.stderr
            assert emu.vms() == {}
            left = proc.run(["ip", "netns", "list"], check=False).stdout
            assert "labz" not in left, left
            assert not list(Path("/sys/fs/cgroup").glob("*/labz*")) and not list(Path("/sys/fs/cgroup").glob("labz*"))
            assert not emu.gz.internal_errors, emu.gz.internal_errors
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
