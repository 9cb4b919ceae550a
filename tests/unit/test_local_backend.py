"""The local QEMU backend.

Pure: its command lines (QEMU, the KVM probe, namespaces, taps, veths), names and leases, the KVM
probe's cache, gc over a workdir, the host-load parsers on captured /proc text. With real VMs:
clone, boot, verify inside the guest, destroy, nothing left; `lab run` killed with SIGKILL mid-boot
leaves things that `lab gc` removes, and SIGTERM mid-run tears everything down by itself; a CPU hog
outside the lab reads as foreign load while the lab's own QEMU does not. (Warm start:
test_warm_unit.py, test_warm_start.py.)
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from support.local import make_spec

from lab.backends import local
from lab.backends.base import Link
from lab.backends.local import baremetal, host, hostload, kvm, layout, qemu
from lab.errors import UsageError
from lab.hostload import lab_pids, parse_pid_stat, parse_proc_stat
from lab.model import Accel, DiskBus, ImageRef, NicModel, Vm

IMAGE = ImageRef(name="debian12", os="debian", path=Path("/images/debian12.qcow2"), digest="d")


def backend_in(workdir: Path, **settings) -> local.LocalBackend:
    return local.LocalBackend("local", local.Settings(backend="local", workdir=str(workdir), **settings))


# -- pure: command lines ---------------------------------------------------------------------------


def test_qemu_argv_carries_cell_choices(tmp_path):
    spec = make_spec(
        IMAGE,
        "abcd0001",
        NicModel.E1000,
        vcpus=3,
        memory=768,
        ip="10.77.0.10",
        mac="52:54:00:00:00:10",
        disk_bus=DiskBus.NVME,
    )
    argv = local.qemu_argv(
        spec,
        accel=Accel.TCG,
        vmdir=tmp_path,
        kernel=Path("k"),
        initrd=Path("i"),
        cmdline="console=ttyS0",
        tap="tap000",
        gateway="10.77.0.1",
        qboot=tmp_path / "none",
    )
    joined = " ".join(argv)
    assert argv[0] == local.QEMU
    assert "-smp 3" in joined and "-m 768" in joined and "accel=tcg" in joined
    assert "e1000,netdev=n0,mac=52:54:00:00:00:10" in joined
    assert "tap,id=n0,ifname=tap000,script=no,downscript=no" in joined
    assert argv[argv.index("-append") + 1] == "console=ttyS0 lab.ip=10.77.0.10/24 lab.gw=10.77.0.1"
    assert argv[argv.index("-name") + 1].startswith("lab-abcd0001-c01")
    assert argv[argv.index("-pidfile") + 1] == str(tmp_path / "qemu.pid")
    assert argv[argv.index("-serial") + 1] == f"file:{tmp_path / 'console.log'}"
    assert "nvme,drive=d0,serial=lab0" in joined
    assert "-cpu" not in argv and "-bios" not in argv
    # the workdir's QEMU is found again by its name and pidfile (gc), and only in its own workdir
    assert host.qemu_name(argv, tmp_path) == "lab-abcd0001-c01"
    assert host.qemu_name(argv, tmp_path / "other") is None


def test_qemu_argv_under_kvm_with_qboot(tmp_path):
    qboot = tmp_path / "qboot.rom"
    qboot.write_bytes(b"")
    spec = make_spec(IMAGE, "abcd0001", NicModel.VIRTIO, ip="10.77.0.11", mac="52:54:00:00:00:11")
    argv = local.qemu_argv(
        spec,
        accel=Accel.KVM,
        vmdir=tmp_path,
        kernel=Path("k"),
        initrd=Path("i"),
        cmdline="",
        tap="tap001",
        gateway="10.77.0.1",
        qboot=qboot,
    )
    assert argv[argv.index("-machine") + 1] == "pc,accel=kvm"
    assert argv[argv.index("-cpu") + 1] == "host" and argv[argv.index("-bios") + 1] == str(qboot)
    assert argv[argv.index("-append") + 1] == "lab.ip=10.77.0.11/24 lab.gw=10.77.0.1"
    assert "virtio-net-pci,netdev=n0,mac=52:54:00:00:00:11,romfile=" in argv


def test_tcg_threads_single_names_the_accelerator_with_accel_alone(tmp_path):
    # QEMU refuses `-machine accel=` beside `-accel`: single-threaded TCG is said with -accel only
    assert local.machine_args(Accel.TCG) == ["-machine", "pc,accel=tcg"]
    assert local.machine_args(Accel.TCG, "single") == ["-machine", "pc", "-accel", "tcg,thread=single"]
    assert local.machine_args(Accel.KVM, "single") == ["-machine", "pc,accel=kvm"]  # a TCG setting only
    assert local.machine_args(Accel.TCG, "single", ",memory-backend=ram0")[:2] == ["-machine", "pc,memory-backend=ram0"]
    spec = make_spec(IMAGE, "abcd0001", NicModel.VIRTIO, ip="10.77.0.11", mac="52:54:00:00:00:11")
    common = dict(vmdir=tmp_path, kernel=Path("k"), initrd=Path("i"), cmdline="", tap="t", gateway="10.77.0.1")
    argv = local.qemu_argv(spec, accel=Accel.TCG, tcg_threads="single", **common)
    assert argv[argv.index("-accel") + 1] == "tcg,thread=single" and "pc" == argv[argv.index("-machine") + 1]
    assert not any("accel=" in a for a in argv)
    assert "-accel" not in local.qemu_argv(spec, accel=Accel.TCG, **common)  # QEMU's default: multi


def test_tcg_threads_setting_is_multi_or_single():
    assert local.Settings(backend="local").tcg_threads == "multi"
    assert local.Settings(backend="local", tcg_threads="single").tcg_threads == "single"
    with pytest.raises(ValueError, match="tcg_threads"):
        local.Settings(backend="local", tcg_threads="two")


@pytest.mark.parametrize("bus", list(DiskBus))
def test_disk_args_put_drive_d0_on_every_bus(bus, tmp_path):
    argv = local.disk_args(bus, tmp_path / "disk.qcow2")
    assert argv[:2] == [
        "-drive",
        f"file={tmp_path / 'disk.qcow2'},if=none,id=d0,format=qcow2,cache=writeback,discard=unmap",
    ]
    devices = argv[3::2]
    assert argv[2::2] == ["-device"] * len(devices) and any("drive=d0" in d for d in devices)


def test_every_nic_model_and_disk_bus_the_host_offers_has_a_qemu_device():
    caps = local.capabilities(local.Settings(backend="local"))
    assert caps.nic_models <= set(local.NIC_DEVICE) and caps.disk_buses <= set(qemu.DISK_DEVICES)
    assert caps.bare_metal and caps.lab_side_link


def test_kvm_probe_argv_and_its_cache(tmp_path):
    argv = kvm.probe_argv(Path("k"), Path("i"), tmp_path / "console.log")
    assert argv[:3] == [local.QEMU, "-name", "kvm-probe"] and "pc,accel=kvm" in argv and "-no-reboot" in argv
    assert argv[argv.index("-serial") + 1] == f"file:{tmp_path / 'console.log'}"
    cache = tmp_path / "kvm-probe.json"
    assert kvm.cached(cache, "k1") is None  # none yet
    cache.write_text(json.dumps({"key": "k1", "accel": "kvm"}))
    assert kvm.cached(cache, "k1") is Accel.KVM
    assert kvm.cached(cache, "k2") is None  # another kernel or QEMU: probe again
    cache.write_text("{not json")
    assert kvm.cached(cache, "k1") is None


def test_accel_setting_other_than_auto_is_not_probed(tmp_path):
    assert backend_in(tmp_path, accel="tcg").accel(IMAGE) is Accel.TCG
    assert backend_in(tmp_path, accel="kvm").accel(IMAGE) is Accel.KVM


def test_namespace_tap_and_veth_command_lines():
    assert host.bridge_netns_argvs("lab-r1", "10.9.0.1") == [
        ["ip", "netns", "add", "lab-r1"],
        ["ip", "-n", "lab-r1", "link", "set", "lo", "up"],
        ["ip", "-n", "lab-r1", "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", "lab-r1", "addr", "add", "10.9.0.1/24", "dev", "br0"],
        ["ip", "-n", "lab-r1", "link", "set", "br0", "up"],
    ]
    assert host.tap_argvs("lab-r1", "tap007") == [
        ["ip", "-n", "lab-r1", "tuntap", "add", "tap007", "mode", "tap"],
        ["ip", "-n", "lab-r1", "link", "set", "tap007", "master", "br0", "up"],
    ]
    veth = host.veth_netns_argvs("lab-r1-bm01", "lab-r1", "vbm01", "10.9.0.250")
    assert [
        "ip",
        "-n",
        "lab-r1",
        "link",
        "add",
        "vbm01",
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        "lab-r1-bm01",
    ] in veth
    assert ["ip", "-n", "lab-r1", "link", "set", "vbm01", "master", "br0", "up"] in veth
    assert veth[-2:] == [
        ["ip", "-n", "lab-r1-bm01", "addr", "add", "10.9.0.250/24", "dev", "eth0"],
        ["ip", "-n", "lab-r1-bm01", "link", "set", "eth0", "up"],
    ]


# -- pure: names, leases, gc over a workdir ----------------------------------------------------------


def test_names_and_leases(tmp_path):
    assert layout.netns_name("r1") == "lab-r1" and layout.run_lock_path(tmp_path, "r1") == tmp_path / "lab-r1.lock"
    assert layout.run_of("lab-r1-c01") == "r1" and layout.run_of("lab-r1") == "" and layout.run_of("x-r1-c1") == ""
    assert layout.run_of_netns("lab-r1") == "r1" and layout.run_of_netns("lab-r1-bm01") == "r1"
    assert layout.read_lease(tmp_path) == {}
    layout.write_lease(tmp_path, {"run_id": "r1", "tap": "tap000"})
    layout.update_lease(tmp_path, pid=42)
    assert layout.read_lease(tmp_path) == {"run_id": "r1", "tap": "tap000", "pid": 42}
    (tmp_path / layout.LEASE).write_text('{"run_id": "r')  # a crash mid-write
    assert layout.read_lease(tmp_path) == {}


def test_gc_finds_and_removes_what_a_workdir_holds(tmp_path):
    backend = backend_in(tmp_path)
    (tmp_path / "lab-r1-c01").mkdir()
    layout.write_lease(
        tmp_path / "lab-r1-c01", {"run_id": "r1", "vm": "lab-r1-c01", "expires_at": 5.0, "netns": "lab-r1"}
    )
    (tmp_path / "lab-r2-c01").mkdir()
    (tmp_path / "lab-r2-c01" / layout.LEASE).write_text("{")  # not the lab's lease (it writes them whole): left alone
    (tmp_path / "lab-r3-c01").mkdir()  # made, then killed before its lease: nothing else exists
    (tmp_path / "images").mkdir()  # not the lab's: no lab- prefix
    owned = {(o.kind, o.name): o for o in backend.list_owned()}
    assert {k for k in owned if k[0] == "vm"} == {("vm", "lab-r1-c01"), ("vm", "lab-r3-c01")}
    assert (owned["vm", "lab-r1-c01"].run_id, owned["vm", "lab-r1-c01"].expires_at) == ("r1", 5.0)
    assert owned["vm", "lab-r3-c01"].run_id == "r3"
    for item in owned.values():
        if item.kind == "vm":
            backend.remove_owned(item)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "lab-r2-c01"]
    assert backend.run_is_live("r1") is False


def test_backend_reads_its_typed_settings(tmp_path):
    backend = backend_in(tmp_path / "w", subnet="10.9.8", boot_timeout=5)
    assert backend.workdir == tmp_path / "w" and backend.machines.gateway == "10.9.8.1"
    assert backend.settings.boot_timeout == 5 and backend.facts()["backend"] == "local"
    vm = Vm(
        spec=make_spec(IMAGE, "r1", NicModel.VIRTIO),
        backend="local",
        handle={"dir": str(tmp_path), "netns": "lab-r1", "tap": "tap003"},
    )
    assert backend.lab_link(vm) == Link(dev="tap003", netns="lab-r1")
    assert backend.console_text(vm) == ""
    (tmp_path / "console.log").write_text("booting\nLAB-READY\n")
    assert "LAB-READY" in backend.console_text(vm)
    with pytest.raises(UsageError, match="incomplete"):
        local.boot_files(
            ImageRef(name="x", os="debian", path=tmp_path / "x.qcow2", digest="d", manifest={"boot": ["kernel"]})
        )


# -- pure: host load (issue 24) ------------------------------------------------------------------------------

PROC_STAT = """cpu  1263809 469 277449 233275 4495 0 22097 3374 0 0
cpu0 626536 233 136773 125258 1524 0 10107 1694 0 0
cpu1 637273 235 140675 108017 2971 0 11990 1680 0 0
intr 27775218 0 0 0 0
ctxt 64476989
"""
PID_STAT = (
    "10641 (cat) R 10637 10637 12835 0 -1 4194304 100 0 0 0 11 7 5 3 20 0 1 0 905237 3133440 399 "
    "18446744073709551615 94580834041856 94580834061737 140726023163216 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n"
)


def test_host_load_parsers_on_captured_proc_text():
    # busy = user + nice + system + irq + softirq; iowait is idle; steal on its own; guest is in user
    stat = parse_proc_stat(PROC_STAT, ticks_per_s=1)  # lab.hostload's, in ticks
    assert (stat.busy_s, stat.steal_s, stat.cpus) == (1263809 + 469 + 277449 + 0 + 22097, 3374, 2)
    # a kernel without the steal column
    stat = parse_proc_stat("cpu  10 0 5 100 1 0 2\ncpu0 10 0 5 100 1 0 2\n", ticks_per_s=1)
    assert (stat.busy_s, stat.steal_s, stat.cpus) == (17, None, 1)
    assert parse_pid_stat(PID_STAT) == (10637, 11 + 7 + 5 + 3)
    # a command name with spaces and parentheses
    odd = PID_STAT.replace("(cat)", "(a) b (c) S 9)")
    assert parse_pid_stat(odd) == (10637, 26)


def test_lab_processes_are_the_tree_and_the_members_with_their_children():
    parents = {1: 0, 100: 1, 101: 100, 102: 101, 200: 1, 201: 200, 300: 1, 301: 300}
    assert lab_pids(parents, [100], []) == {100, 101, 102}
    # 300: a daemonised ssh master in the run's namespace (reparented to init), with its child
    assert lab_pids(parents, [100], [300]) == {100, 101, 102, 300, 301}
    assert lab_pids(parents, [999], [998]) == set()  # gone meanwhile


def test_cpu_times_sums_the_lab_and_its_cgroup_from_a_proc_tree(tmp_path):
    proc_dir = tmp_path / "proc"
    (proc_dir).mkdir()
    (proc_dir / "stat").write_text(PROC_STAT)
    for pid, ppid, ticks in ((1, 0, 1000), (50, 1, 300), (51, 50, 100), (60, 1, 200), (70, 1, 7)):
        (proc_dir / str(pid)).mkdir()
        (proc_dir / str(pid) / "stat").write_text(f"{pid} (p {pid}) S {ppid} 0 0 0 -1 0 0 0 0 0 {ticks} 0 0 0 20\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "cgroup.procs").write_text("60\n")
    vm = Vm(spec=None, backend="local", handle={"cgroup": str(cgroup)})  # type: ignore[arg-type]
    t = hostload.cpu_times([vm], root=50, proc_dir=proc_dir)
    tick = hostload.TICK
    assert t["busy_s"] == pytest.approx(1563824 / tick) and t["steal_s"] == pytest.approx(3374 / tick)
    assert t["cpus"] == 2 and t["lab_s"] == pytest.approx((300 + 100 + 200) / tick)  # not 1 (init) nor 70


def test_host_load_is_a_counter_window_over_cpu_times(tmp_path):
    """The seam's window (lab.hostload) over this machine's /proc: known, with the lab's share."""
    backend = local.LocalBackend("local", local.Settings(backend="local", workdir=str(tmp_path)))
    window = backend.load_meter.window([])
    sum(range(200_000))  # this process is the lab's: a little CPU for it to count
    load = window.stop()
    assert load.known and load.unknown == "" and load.cpus == os.cpu_count() and load.seconds > 0


# -- pure: the bare-metal cell's shell and nginx lines ---------------------------------------------------


def test_bare_metal_site_script_quotes_every_path():
    odd = Path("/var/tmp/my lab;rm -rf ~/lab-r1-bm01")
    script = baremetal.site_script(
        stage=odd / "stage", site=odd / "stage" / "site", key=odd / "lab.key", crt=odd / "lab.crt"
    )
    words = shlex.split(script)
    for path in (
        odd / "lab.key",
        odd / "lab.crt",
        odd / "stage" / "site" / "bulk",
        odd / "stage" / "site" / "bulk" / "64m.bin",
        odd / "stage" / "site" / "1m.bin",
        odd / "stage",
    ):
        assert str(path) in words, path
    assert "rm" not in words and subprocess.run(["sh", "-n", "-c", script]).returncode == 0


def test_bare_metal_nginx_conf_moves_paths_into_the_cell(tmp_path):
    text = (
        "user www-data;\nworker_processes auto;\npid /run/nginx.pid;\nerror_log /var/log/nginx/error.log warn;\n"
        "http {\n    server {\n        ssl_certificate /etc/lab/lab.crt;\n"
        "        ssl_certificate_key /etc/lab/lab.key;\n        root /srv/www;\n    }\n}\n"
    )
    d = Path("/var/tmp/a b")
    out = baremetal.nginx_conf(text, root=d / "site", key=d / "k", crt=d / "c", rundir=d)
    assert "user root;" in out and 'pid "/var/tmp/a b/nginx.pid";' in out
    assert 'error_log "/var/tmp/a b/error.log" warn;' in out
    assert '        ssl_certificate "/var/tmp/a b/c";' in out and '        ssl_certificate_key "/var/tmp/a b/k";' in out
    assert '        root "/var/tmp/a b/site";' in out
    with pytest.raises(Exception, match="no line matching"):
        baremetal.nginx_conf("user x;\n", root=d, key=d, crt=d, rundir=d)
    assert baremetal.parse_describe("cpus=4\nmem=8000000\nLinux 6.1.0\n") == {
        "vcpus": 4,
        "mem_kib": 8000000,
        "kernel": "Linux 6.1.0",
        "nic_driver": "veth",
    }


# -- real VMs ------------------------------------------------------------------------------------------------
