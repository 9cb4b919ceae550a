"""Issue 35, settings: what a lab.toml says is read one way on every backend. Paths of this machine
expand `~` and are relative to lab.toml's folder (lab.paths); a file the lab reads is a regular file
(a FIFO, device or directory in its place is one line, never opened or read); keys valid alone but
impossible together, and values that would reach ssh as options or QEMU and PVE option strings as
more options, are refused as lab.toml is read; what is counted before it is listed (address pools,
the matrix) is counted first; `verify_tls = false` is said at plan and at run. The static examples
are in the bad-input corpus (tests/data/bad-config); these need a FIFO, $HOME or a process."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
from support.cli import lab_cli

from lab import check, config, paths, plan
from lab.backends import proxmox, smartos
from lab.backends.local.qemu import opt, qemu_argv
from lab.backends.proxmox.settings import MAX_POOL, address_pool, in_pool, pool_size
from lab.errors import ConfigError
from lab.model import Accel, ImageRef, NicModel, VmSpec
from lab.workloads import container_start, podman_build

PVE = "[hosts.pve1]\nbackend = 'proxmox'\nurl = 'https://pve1:8006'\nnode = 'pve1'\ntoken = 'env:T'\n"


def load(tmp_path: Path, text: str, timeout: float = 10.0):
    """config.load of `text`, in a thread: a read that hangs (a FIFO) fails the test instead."""
    path = tmp_path / "lab.toml"
    path.write_text(text)
    box: dict = {}

    def go():
        try:
            box["cfg"] = config.load(path)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box["exc"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"reading lab.toml hung on {text!r}"
    if "exc" in box:
        raise box["exc"]
    return box["cfg"]


# -- special files --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "table",
    [
        PVE + "ca_file = '{fifo}'\n",
        "[hosts.local]\nbackend = 'local'\nclient = 'ssh:lab@gen'\nclient_identity = '{fifo}'\n",
        "[hosts.local]\nbackend = 'local'\nclient = 'ssh:lab@gen'\nclient_known_hosts = '{fifo}'\n",
        "[hosts.gz1]\nbackend = 'smartos'\nssh = 'root@gz1'\nssh_key = '{fifo}'\n",
    ],
    ids=["ca_file", "client_identity", "client_known_hosts", "ssh_key"],
)
def test_a_fifo_where_a_file_is_meant_is_one_line_and_never_read(tmp_path, table):
    fifo = tmp_path / "planted"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as err:
        load(tmp_path, table.format(fifo=fifo))
    text = str(err.value)
    key = re.search(r"^(\w+) = ", table.splitlines()[-1]).group(1)
    assert "\n" not in text and f".{key} = '{fifo}'" in text and "is a FIFO (named pipe)" in text, text


def test_the_files_of_a_lab_are_read_by_one_rule(tmp_path, monkeypatch):
    """`~` is the user's home, a relative path is relative to lab.toml's folder, for every key."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "gz").write_text("key\n")
    (home / "work").mkdir()
    monkeypatch.setenv("HOME", str(home))
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "keys").mkdir()
    (sub / "keys" / "gz").write_text("key\n")
    cfg = load(
        sub,
        "[lab]\nresults = '~/results'\n"
        "[hosts.local]\nbackend = 'local'\nworkdir = '~/work'\n"
        "[hosts.gz1]\nbackend = 'smartos'\nssh = 'root@gz1'\nssh_key = '~/.ssh/gz'\n"
        "[hosts.gz2]\nbackend = 'smartos'\nssh = 'root@gz2'\nssh_key = 'keys/gz'\n"
        "[hosts.vg]\nbackend = 'vagrant'\nworkdir = '~/work'\nvagrant_home = '~/vagrant.d'\n",
    )
    assert cfg.results_dir == home / "results"
    assert cfg.hosts["local"].workdir == str(home / "work")
    assert cfg.hosts["gz1"].ssh_key == str(home / ".ssh" / "gz")
    assert cfg.hosts["gz2"].ssh_key == str(sub / "keys" / "gz")  # lab.toml's folder, not the cwd
    assert cfg.hosts["vg"].workdir == str(home / "work") and cfg.hosts["vg"].vagrant_home == str(home / "vagrant.d")
    cfg = load(sub, "[lab]\nresults = 'r'\n")
    assert cfg.results_dir == sub / "r"


def test_read_regular_reads_files_and_refuses_the_rest(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x" * 100)
    assert paths.read_regular(f, limit=10) == b"x" * 10
    os.mkfifo(tmp_path / "fifo")
    for path, why in ((tmp_path, "is a directory"), (Path("/dev/zero"), "is a character device")):
        with pytest.raises(OSError, match=why):
            paths.read_regular(path)
    with pytest.raises(OSError, match="FIFO"):
        paths.read_regular(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(f)  # a link to a regular file is that file
    assert paths.read_regular(tmp_path / "link") == b"x" * 100


# -- keys valid alone, impossible together -------------------------------------------------------------


def test_a_quiet_wait_longer_than_its_timeout_is_refused_where_the_host_waits_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("LAB_QUIET_HOST", raising=False)  # the product's default: the local host waits
    text = "[suite]\nquiet_seconds = 60\nquiet_timeout_s = 30\n"
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    assert "suite.quiet_timeout_s = 30.0" in str(err.value) and "host 'local' waits for quiet" in str(err.value)
    monkeypatch.setenv("LAB_QUIET_HOST", "record")  # nothing waits: the two keys do not meet
    load(tmp_path, text)
    monkeypatch.setenv("LAB_QUIET_HOST", "wait")  # a remote host waits too when told so
    with pytest.raises(ConfigError, match="quiet_timeout_s"):
        load(tmp_path, PVE + "[matrix]\nhost = ['pve1']\n" + text)


# -- counted before listed -------------------------------------------------------------------------------


def test_address_pools_are_counted_not_listed():
    assert pool_size("10.0.0.100-10.0.0.149") == 50 == len(address_pool("10.0.0.100-10.0.0.149"))
    assert pool_size("10.0.0.96/27") == 30 == len(address_pool("10.0.0.96/27"))
    assert pool_size("10.0.0.7/32") == 1 and pool_size("0.0.0.0-255.255.255.255") == 2**32
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"more than {MAX_POOL}"):
        address_pool("0.0.0.0/1")
    assert time.monotonic() - t0 < 1.0  # refused before 2**31 addresses were made
    assert in_pool("10.0.0.96/27", "10.0.0.97") and not in_pool("10.0.0.96/27", "10.0.0.96")
    assert in_pool("10.0.0.100-10.0.0.149", "10.0.0.149") and not in_pool("10.0.0.100-10.0.0.149", "10.0.0.150")
    assert not in_pool("10.0.0.96/27", "not an address")


def test_a_huge_matrix_is_counted_before_it_is_expanded(tmp_path, monkeypatch):
    expanded = []
    monkeypatch.setattr(plan, "cells", lambda cfg: expanded.append(cfg) or [])
    values = ", ".join(str(256 + i) for i in range(1000))
    with pytest.raises(ConfigError) as err:
        load(tmp_path, f"[matrix]\nvcpus = [{', '.join(map(str, range(1, 129)))}]\nmemory_mib = [{values}]\n")
    assert expanded == []  # refused on the count
    assert "has 128,000 combinations (128 x 1000)" in str(err.value)
    monkeypatch.undo()
    cfg = load(tmp_path, "[matrix]\nvcpus = [1, 2]\nnic = ['virtio', 'e1000']\n")
    assert plan.combinations(cfg.matrix) == 4 == len(plan.cells(cfg))


# -- TLS not verified: said ------------------------------------------------------------------------------


def test_verify_tls_false_is_said_in_one_line_at_plan_and_run(tmp_path):
    (tmp_path / "lab.toml").write_text(PVE + "verify_tls = false\n[matrix]\nhost = ['pve1']\n")
    plan_ = lab_cli("plan", cwd=tmp_path)
    assert plan_.returncode == 0, plan_.stderr
    warning = [ln for ln in plan_.stderr.splitlines() if "verify_tls" in ln]
    assert warning == [
        "lab: warning: lab.toml: hosts.pve1.verify_tls = False: the node's TLS certificate is not checked: anyone "
        "on the path to it can pose as the node and read the credentials; set ca_file or fingerprint instead"
    ]
    run = lab_cli("run", cwd=tmp_path, env={"T": None})  # then refused for its unset token: nothing made
    assert run.returncode == 2 and run.stderr.splitlines()[0] == warning[0], run.stderr
    (tmp_path / "lab.toml").write_text(PVE + "[matrix]\nhost = ['pve1']\n")
    assert "warning" not in lab_cli("plan", cwd=tmp_path).stderr
    assert check.setting_warnings(config.load(tmp_path / "lab.toml")) == []


# -- values inside other syntaxes ------------------------------------------------------------------------


def qemu_options(text: str) -> list[str]:
    """QEMU's reading of an option list: split at single commas, ",," is one comma."""
    return [part.replace("\0", ",") for part in text.replace(",,", "\0").split(",")]


def test_a_workdir_with_commas_adds_no_qemu_option(tmp_path):
    vmdir = tmp_path / "a,format=raw,file=x" / "lab-r-c01"
    spec = VmSpec("lab-r-c01", "r", "c01", ImageRef("debian12", "debian", Path("/i"), "d"), NicModel.VIRTIO, 1, 512)
    argv = qemu_argv(
        spec,
        accel=Accel.TCG,
        vmdir=vmdir,
        kernel=Path("/k"),
        initrd=Path("/i"),
        cmdline="",
        tap="tap000",
        gateway="10.0.0.1",
        ram=vmdir / "ram",
    )
    drive = qemu_options(argv[argv.index("-drive") + 1])
    assert drive[0] == f"file={vmdir / 'disk.qcow2'}" and [o.split("=")[0] for o in drive[1:]] == [
        "if",
        "id",
        "format",
        "cache",
        "discard",
    ]
    qmp = qemu_options(argv[argv.index("-qmp") + 1])
    assert qmp == [f"unix:{vmdir / 'qmp.sock'}", "server=on", "wait=off"]
    ram = qemu_options(argv[argv.index("-object") + 1])
    assert f"mem-path={vmdir / 'ram'}" in ram and len(ram) == 5
    assert opt("a,b,,c") == "a,,b,,,,c"


def test_qemu_itself_reads_a_doubled_comma_as_a_comma(tmp_path):
    """The real QEMU (no guest: -machine none) makes its QMP socket at a path with a comma."""
    d = tmp_path / "a,server=off"
    d.mkdir()
    p = subprocess.run(
        ["qemu-system-x86_64", "-machine", "none", "-nodefaults", "-display", "none", "-daemonize"]
        + ["-qmp", f"unix:{opt(d / 'qmp.sock')},server=on,wait=off", "-pidfile", str(d / "pid")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    try:
        assert p.returncode == 0, p.stderr
        assert (d / "qmp.sock").is_socket()
    finally:
        if (d / "pid").exists():
            os.kill(int((d / "pid").read_text()), 15)


@pytest.mark.parametrize(
    "key,value",
    [("bridge", "vmbr0,firewall=1"), ("cpu_type", "host,hidden=1"), ("storage", "lvm,x=1"), ("node_ssh", "-F/x")],
)
def test_proxmox_values_stay_one_value(key, value):
    with pytest.raises(ValueError):
        proxmox.Settings(backend="proxmox", url="https://p:8006", node="p", token="env:T", **{key: value})


def test_smartos_ssh_stays_a_destination():
    for bad in ("-oProxyCommand=x", "root@-x", "root@gz1 -v", ""):
        with pytest.raises(ValueError):
            smartos.Settings(backend="smartos", ssh=bad)
    assert smartos.Settings(backend="smartos", ssh="root@[fe80::1]").ssh == "root@[fe80::1]"


# -- scratch files in a fresh private directory ------------------------------------------------------------


def test_container_start_writes_into_a_fresh_private_directory(tmp_path):
    """The load with a stub hyperfine, in a real shell: its JSON goes into a mktemp directory under
    $LAB_SCRATCH (the bare-metal cell's own), removed after; a link planted at the old fixed
    name is not followed."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "hyperfine").write_text(
        '#!/bin/sh\nwhile [ "$1" != "--export-json" ]; do shift; done\n'
        'echo "{\\"results\\": []}" > "$2"; echo "$2" > "$LAB_SCRATCH/seen"\n'
    )
    (bin_ / "hyperfine").chmod(0o755)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    planted = Path("/var/tmp/lab-hyperfine.json")
    load = container_start.hyperfine_load(["true"], 1, 0)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "LAB_SCRATCH": str(scratch)}
    res = subprocess.run(["sh", "-c", load], capture_output=True, text=True, env=env, timeout=30)
    assert res.returncode == 0 and res.stdout.strip() == '{"results": []}', res
    used = Path((scratch / "seen").read_text().strip())
    assert used.parent.parent == scratch and used.parent.name.startswith("lab-hyperfine.")
    assert not used.parent.exists()  # removed after
    assert victim.read_text() == "untouched" and (not planted.exists() or not planted.is_symlink())


def test_podman_build_context_is_a_fresh_private_directory(tmp_path, monkeypatch):
    """prepare() with a real shell: each cell's build context is a new mktemp directory (mode 0700)
    under $LAB_SCRATCH, and the builds run in it; a directory planted at the old fixed name is unused."""
    from test_workloads_unit import LocalGuest, ctx

    class Here(LocalGuest):
        def put_text(self, text: str, remote: str, timeout: float = 60.0) -> None:
            Path(remote).write_text(text)

    monkeypatch.setenv("LAB_SCRATCH", str(tmp_path))
    monkeypatch.setattr(podman_build.containers, "prepare_places", lambda *a: None)
    monkeypatch.setattr(podman_build, "probe_engines", lambda c, engines: {"podman": True})
    monkeypatch.setattr(podman_build.gitrepo, "ensure", lambda shape: "repo")
    made = []
    for _ in range(2):
        c = ctx({"engines": ["podman"]}, guest=Here())
        podman_build.PODMAN_BUILD.prepare(c)
        context = Path(c.facts["context_dir"])
        assert context.parent == tmp_path and context.name.startswith("lab-build.")
        assert context.stat().st_mode & 0o777 == 0o700 and (context / "Containerfile").is_file()
        loads = dict(podman_build.PODMAN_BUILD.commands(c))
        assert all(load.startswith(f"(cd {context} && ") for load in loads.values())
        made.append(context)
    assert made[0] != made[1]
