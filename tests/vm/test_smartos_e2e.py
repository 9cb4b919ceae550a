"""`lab images publish` and `lab run` (the CLI) against the emulated SmartOS global zone, over real SSH,
its bhyve- and KVM-brand VMs real QEMU guests of the golden image.

The emulated host's networks are a namespace this test makes (its `external` nic_tag is a bridge
there; the lab's client side, iperf3 server and SSH to the guest, runs in the same namespace through
`client_netns`; the global zone's sshd listens on an admin veth reachable from here). Publishing
streams the image into a proto VM's zvol and makes an imgadm image of it; `lab run` clones it with
`vmadm create`, boots it by firmware, the guest takes its static address from SmartOS's NoCloud disk
(bhyve) or its DHCP (KVM), runs the workloads, and `vmadm delete` leaves nothing: no VM, no guest,
no tap, no zvol, no DHCP entry.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from smartos_emulator import SmartosEmulator, gz_network
from smartos_emulator.fixtures import skip_unless_emulator_can_run, toml_value
from support.cli import run_lab_cli

from lab import proc
from lab.backends.local import qemu_processes


@pytest.mark.vm
@pytest.mark.image
@pytest.mark.parametrize(
    "brand,nic,disk,driver", [("bhyve", "virtio", "virtio", "virtio_net"), ("kvm", "e1000", "ide", "e1000")]
)
def test_lab_run_on_an_emulated_smartos_host_end_to_end(golden, brand, nic, disk, driver, tmp_path):
    skip_unless_emulator_can_run()
    workdir = Path(tempfile.mkdtemp(prefix="sme", dir="/var/tmp"))
    try:
        with gz_network() as net, SmartosEmulator(workdir, net, backing="qemu", image=golden) as emu:
            host = emu.table(brand=brand, timeouts={"ready": 600, "publish": 1800, "delete": 120})
            toml = tmp_path / "lab.toml"
            toml.write_text(
                "\n".join(
                    [
                        "[lab]",
                        f'results = "{tmp_path / "results"}"',
                        "[hosts.sm]",
                        *(f"{k} = {toml_value(v)}" for k, v in host.items()),
                        "[matrix]",
                        'host = ["sm"]',
                        'image = ["debian12"]',
                        f'nic = ["{nic}"]',
                        f'disk_bus = ["{disk}"]',
                        "vcpus = [1]",
                        "memory_mib = [1024]",
                        "[suite]",
                        'workloads = ["sysbench-cpu", "iperf3-tcp"]',
                        "repetitions = 1",
                        "warmup = 0",
                        "[suite.params.sysbench-cpu]",
                        "time = 1",
                        "[suite.params.iperf3-tcp]",
                        "time = 2",
                        "",
                    ]
                )
            )
            t0 = time.monotonic()
            res = run_lab_cli("images", "publish", "debian12", "sm", "-c", str(toml), cwd=tmp_path, timeout=1800)
            publish_s = time.monotonic() - t0
            assert res.returncode == 0, res.stdout + res.stderr
            (manifest,) = emu.images().values()
            assert manifest["tags"]["lab:sha256"] == golden.sha256 and manifest["requirements"]["brand"] == brand
            # the disk's data went through dd, not its zeros (about a quarter of the golden image's 4 GiB)
            assert 0 < emu.gz.dd_bytes < golden.manifest["virtual_size"] // 2, emu.gz.dd_bytes
            t0 = time.monotonic()
            res = run_lab_cli("run", "-c", str(toml), cwd=tmp_path, timeout=1800)
            run_s = time.monotonic() - t0
            print(
                f"{brand}: publish {publish_s:.1f} s ({emu.gz.dd_bytes >> 20} MiB of the "
                f"{golden.manifest['virtual_size'] >> 20} MiB disk through dd), "
                f"lab run {run_s:.1f} s"
            )
            assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
            doc = json.loads(run_lab_cli("show", "--json", "-c", str(toml), cwd=tmp_path).stdout)
            (cell,) = doc["cells"]
            facts = cell["facts"] if isinstance(cell["facts"], dict) else json.loads(cell["facts"])
            assert cell["status"] == "done", cell
            assert facts["brand"] == brand and facts["address_source"] == "static"
            assert facts["verified"]["nic_driver"] == driver and facts["verified"]["vcpus"] == 1
            print(f"{brand}: boot to sshd {facts['boot_seconds']} s")
            metrics = {(s["workload"], s["metric"]) for s in doc["samples"]}
            assert any(w == "sysbench-cpu" and m.startswith("events_per_s") for w, m in metrics), metrics
            assert any(w == "iperf3-tcp" and "throughput" in m for w, m in metrics)
            creates = [c for c in emu.gz.commands if c.startswith("vmadm create")]
            assert len(creates) == 2  # publish's proto VM and the cell's VM
            # nothing left: VMs, guests, taps, zvols, DHCP entries; the published image stays
            assert emu.vms() == {} and emu.guests() == []
            assert list(emu.images()) == [manifest["uuid"]]
            assert not any(emu.gz.root.joinpath("dev/zvol/rdsk/zones").iterdir())
            assert emu.backing.dhcp.hosts == {}
            assert "vnic" not in proc.run(["ip", "-n", net.netns, "-o", "link", "show"]).stdout
            assert not emu.gz.internal_errors, emu.gz.internal_errors
        assert qemu_processes(workdir) == []
    finally:
        for pid, _name in qemu_processes(workdir):  # only if an assertion failed midway
            os.kill(pid, 9)
        shutil.rmtree(workdir, ignore_errors=True)
