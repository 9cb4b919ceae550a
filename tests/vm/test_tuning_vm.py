"""Tuning and network axes on real VMs (the golden Debian image under QEMU), cheaply: one guest
(restored) checks the knobs one by one, one `lab run` checks that the runner records them.

- in one guest: wan-16m's values in effect, bbr in effect (its module loaded), offload toggles
  read back as set, lro=on refused as [fixed] on virtio-net (n/a), and 50 ms of netem: the TCP
  round trip seen from the client grows by ~50 ms and single-stream iperf3 throughput drops;
- `lab run`: a cell with wan-16m + bbr + tso=off + 50 ms netem records what was in effect and
  `lab show` prints it; a cell asking lro=off (already off [fixed]) is found to be a duplicate of
  it after read-back; cc=cubic on top of the default is a duplicate known at plan time (no VM).
"""

from __future__ import annotations

import time

import pytest
from support.cli import run_lab_cli
from support.local import leftovers, local_run, write_lab

from lab import osfacts, proc, tuning, wan
from lab.backends import local
from lab.guest import Guest
from lab.model import CloneKind, NicModel, VmSpec
from lab.store import Store
from lab.wan import WanProfile
from lab.workloads import WorkloadContext
from lab.workloads.iperf3 import Iperf3Tcp

pytestmark = [pytest.mark.vm, pytest.mark.image]

# TCP connect() returns after SYN -> SYN-ACK: one round trip, measured from the client's namespace
# (the least of 9: a busy 2-core host only ever adds to it).
RTT_PY = (
    "import socket,sys,time\n"
    "out=[]\n"
    "for _ in range(9):\n"
    "    s=socket.socket(); t=time.perf_counter(); s.connect((sys.argv[1],22));"
    " out.append(time.perf_counter()-t); s.close()\n"
    "print(min(out)*1000)\n"
)


def tcp_rtt_ms(netns: str, address: str) -> float:
    return float(proc.run(["python3", "-c", RTT_PY, address], netns=netns, timeout=60).stdout)


def iperf3_mbit(guest, client, address: str) -> float:
    wl = Iperf3Tcp()
    ctx = WorkloadContext(
        guest=guest,
        client=client,
        os="debian",
        vcpus=2,
        guest_address=address,
        params={**wl.defaults, "time": 5, "directions": ["tx"]},
    )
    samples = wl.parse(wl.run(ctx, 0))
    return next(s.value for s in samples if s.metric == "throughput_mbit_s_tx")


@pytest.mark.serial
@pytest.mark.timeout(900)
def test_knobs_read_back_in_one_guest(golden, workdir):
    facts = osfacts.facts("debian")
    # warm: a restore of the shared snapshot of this shape (the VM pass made it), not a boot in
    # the serial pass; the knobs start from the guest as it booted either way
    with local_run(workdir, shared_warm=True) as made:
        backend, run_id, client = made["backend"], made["run_id"], made["client"]
        spec = VmSpec(
            name=f"lab-{run_id}-c01",
            run_id=run_id,
            cell_id="c01",
            image=golden,
            nic=NicModel.VIRTIO,
            vcpus=2,
            memory_mib=1024,
            clone=CloneKind.LINKED,
            expires_at=time.time() + 900,
            start="warm",
        )
        vm = made["vm"] = backend.clone(golden, spec)
        backend.start(vm)
        address = backend.wait_ready(vm)
        assert vm.facts["start"] == "warm", vm.facts["start"]
        with Guest(address, key=local.lab_key(), netns=client.netns) as guest:
            guest.connect(timeout=90)
            # 0 ms first: the baseline RTT and throughput of this link. A 256 KiB send buffer for
            # both: one stream then carries at most ~256 KiB per round trip (~40 Mbit/s at 50 ms),
            # so the delay shows even when a busy TCG host is what limits the 0 ms figure.
            guest.run("sysctl -q -w net.ipv4.tcp_wmem='4096 16384 262144'")
            rtt0 = tcp_rtt_ms(client.netns, address)
            mbit0 = iperf3_mbit(guest, client, address)

            # 50 ms of netem where the lab puts it on this machine, read back, then removed
            # (first, with the guest as it booted: the same settings as the 0 ms baseline)
            where, _why = wan.place(True, "local QEMU", facts)  # the local backend reaches the tap
            em = (
                wan.Emulation(WanProfile(delay_ms=50), where, dev=vm.handle["tap"], netns=vm.handle["netns"])
                if where == "lab"
                else wan.Emulation(WanProfile(delay_ms=50), where, guest=guest, facts=facts, dev="eth0")
            )
            state = em.apply()
            assert state["netem"] == {"delay_ms": 50.0, "jitter_ms": 0.0, "loss_pct": 0.0, "rate_mbit": 0.0}
            rtt50 = tcp_rtt_ms(client.netns, address)
            mbit50 = iperf3_mbit(guest, client, address)
            em.remove()
            assert wan.netem_in_effect(wan.parse_tc_qdisc(em.show())) is None
            print(
                f"\nnetem at {where}: TCP connect RTT {rtt0:.2f} ms -> {rtt50:.2f} ms; "
                f"iperf3 1 stream tx {mbit0:.0f} -> {mbit50:.0f} Mbit/s"
            )
            assert 45 <= rtt50 - rtt0 <= 70
            assert mbit50 < 0.6 * mbit0

            # bbr: not there until its module is loaded; the knob loads it
            assert "bbr" not in guest.run("sysctl -n net.ipv4.tcp_available_congestion_control").stdout
            cc = tuning.apply_cc(guest, facts, "bbr")
            assert cc.applicable and cc.effective == "bbr"
            assert guest.run("sysctl -n net.ipv4.tcp_congestion_control").stdout.strip() == "bbr"

            # wan-16m: every value in effect as the guest reports it
            applied = tuning.apply(guest, facts, "wan-16m")
            assert applied.applicable, applied.reason
            assert applied.effective["net.core.rmem_max"] == "16777216"
            assert applied.effective["net.ipv4.tcp_rmem"] == "4096 4194304 16777216"
            assert guest.run("sysctl -n net.ipv4.tcp_wmem").stdout.split() == ["4096", "4194304", "16777216"]
            assert guest.run("sysctl -n net.ipv4.tcp_moderate_rcvbuf").stdout.strip() == "1"

            # offloads: tso and gro off read back off; lro on is [fixed] off on virtio-net -> n/a
            off = tuning.apply_offloads(guest, facts, "eth0", {"tso": False, "gro": False})
            assert off.applicable, off.reason
            assert off.effective["tso"] == "off" and off.effective["gro"] == "off"
            assert off.effective["lro"] == "off [fixed]"
            assert "tcp-segmentation-offload: off" in guest.run("ethtool -k eth0").stdout
            back = tuning.apply_offloads(guest, facts, "eth0", {"tso": True, "gro": True})
            assert back.effective["tso"] == "on" and back.effective["gro"] == "on"
            lro = tuning.apply_offloads(guest, facts, "eth0", {"lro": True})
            assert not lro.applicable and "[fixed]" in lro.reason
    assert leftovers(workdir, run_id) == []


@pytest.mark.timeout(1500)
def test_lab_run_records_knobs_and_duplicates(golden, tmp_path, workdir):
    lab = write_lab(
        tmp_path,
        workdir,
        extra="""
        [wan.rtt50]
        delay_ms = 50
        """,
        matrix="""
        tuning = ["wan-16m"]
        cc = ["default", "bbr"]
        offloads = ["tso=off", "tso=off,lro=off"]
        wan = ["rtt50"]
        exclude = [{ cc = "bbr", offloads = "tso=off,lro=off" }]
        start = ["warm"]  # c01 and c02 restores of one snapshot: one boot, not two
        """,
        suite="""
        workloads = ["sysbench-cpu"]
        repetitions = 1
        warmup = 0
        [suite.params.sysbench-cpu]
        time = 2
        """,
    )
    planned = run_lab_cli("plan", "-c", str(lab), cwd=tmp_path, timeout=120)
    assert planned.returncode == 0, planned.stderr
    # wan-16m sets bbr itself: cc=bbr is the same configuration, known before booting
    assert "c03 is the same effective configuration as c01" in planned.stdout
    res = run_lab_cli("run", "-c", str(lab), cwd=tmp_path, timeout=1400)
    assert res.returncode == 0, res.stdout + res.stderr
    store = Store(tmp_path / "results")
    run = store.runs()[0]
    cells = {c.cell_id: c for c in store.cells(run.id)}
    c1 = cells["c01"]
    assert c1.status == "done", c1.error
    t = c1.facts["tuning"]
    assert t["effective"]["net.core.wmem_max"] == "16777216"
    assert t["cc"]["effective"] == "bbr"
    assert t["offloads"]["effective"]["tso"] == "off" and t["offloads"]["effective"]["lro"] == "off [fixed]"
    assert t["wan"]["netem"]["delay_ms"] == 50.0 and t["wan"]["where"] in ("lab", "guest")
    # lro=off is already what virtio-net has: the guest reads back as c01's did
    assert cells["c02"].status == "duplicate" and cells["c02"].facts["duplicate_of"] == "c01"
    assert cells["c02"].facts["duplicate_found"] == "read-back"
    assert c1.facts["start"] == cells["c02"].facts["start"] == "warm"  # the knobs read back on restored guests
    assert cells["c03"].status == "duplicate" and cells["c03"].facts["duplicate_found"] == "plan"
    assert not [s for s in store.samples(run.id) if s.cell_id != "c01"]
    shown = run_lab_cli("show", "-c", str(lab), cwd=tmp_path, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "c01 in effect: cc bbr; offloads gro=on lro=off [fixed] tso=off; netem" in shown.stdout, shown.stdout
    assert "delay_ms=50" in shown.stdout and "net.core.rmem_max=16777216" in shown.stdout
    assert "duplicate of c01" in shown.stdout
    assert leftovers(workdir) == []
