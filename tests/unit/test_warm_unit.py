"""Warm start of the local backend, its pure parts: the shape key, the command lines of a snapshot
and of its clones, the fix-up lines, the snapshot store (damage found before QEMU is asked), the
plan's refusals, the guest agent's protocol (against a scripted agent on a unix socket), and what
gc and `lab images ls` see."""

from __future__ import annotations

import base64
import json
import os
import socket
import stat
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from lab import images
from lab.backends import local
from lab.backends.local import monitor, qemu, warm
from lab.errors import BackendError, SettingError
from lab.model import Accel, CloneKind, DiskBus, ImageRef, NicModel, VmSpec

IMAGE = ImageRef(
    name="debian12",
    os="debian",
    path=Path("/images/debian12.qcow2"),
    digest="recipe",
    sha256="artifact",
    manifest={"guest_agent": True, "net": {"device": "eth0"}},
)


def spec(**kw) -> VmSpec:
    base = dict(
        name="lab-r1-c01",
        run_id="r1",
        cell_id="c01",
        image=IMAGE,
        nic=NicModel.VIRTIO,
        vcpus=2,
        memory_mib=1024,
        start="warm",
        ip="10.77.0.10",
        mac="52:54:00:00:00:10",
    )
    return VmSpec(**{**base, **kw})


def key_of(s: VmSpec, accel=Accel.TCG, qemu_version="7.2.22") -> warm.ShapeKey:
    return warm.shape_key(s, accel=accel, qemu=qemu_version)


# -- the key ----------------------------------------------------------------------------------------------


def test_key_is_the_machine_shape_not_the_cell():
    k = key_of(spec())
    assert asdict(k) == {
        "image": "debian12",
        "image_digest": "artifact",
        "image_path": "/images/debian12.qcow2",
        "nic": "virtio",
        "disk_bus": "virtio",
        "vcpus": 2,
        "memory_mib": 1024,
        "firmware": "seabios+kernel",
        "accel": "tcg",
        "backend": "local",
        "qemu": "7.2.22",
        "format": warm.WARM_FORMAT,
    }
    assert k.name == f"debian12-virtio-virtio-2c1024m-{k.digest[:12]}"
    # another cell, run, address or MAC of the same shape restores the same snapshot
    assert key_of(spec(name="lab-r2-c07", run_id="r2", cell_id="c07", ip="10.77.0.99", mac="52:54:00:00:01:10")) == k
    # every part of the key makes another snapshot
    others = [
        key_of(spec(nic=NicModel.E1000)),
        key_of(spec(disk_bus=DiskBus.NVME)),
        key_of(spec(vcpus=1)),
        key_of(spec(memory_mib=512)),
        key_of(spec(image=replace(IMAGE, sha256="rebuilt"))),
        key_of(spec(image=replace(IMAGE, path=Path("/elsewhere/debian12.qcow2")))),
        key_of(spec(), accel=Accel.KVM),
        key_of(spec(), qemu_version="8.2.0"),
    ]
    assert len({o.name for o in others} | {k.name}) == len(others) + 1
    # an image without an artifact digest is keyed by its recipe
    assert key_of(spec(image=replace(IMAGE, sha256=""))).image_digest == "recipe"


def test_unusable_here_is_another_qemu_or_an_older_recipe():
    meta = {"key": asdict(key_of(spec()))}
    assert not warm.unusable_here(meta, "7.2.22")
    assert warm.unusable_here(meta, "8.2.0")
    assert warm.unusable_here({"key": {**meta["key"], "format": warm.WARM_FORMAT - 1}}, "7.2.22")
    assert warm.unusable_here({}, "7.2.22")


# -- command lines -------------------------------------------------------------------------------------------


def argv_of(tmp_path: Path, s: VmSpec, **kw) -> list[str]:
    qboot = tmp_path / "qboot.rom"
    qboot.write_bytes(b"")  # installed: a cold VM would use it
    return qemu.qemu_argv(
        s,
        accel=Accel.TCG,
        vmdir=tmp_path / s.name,
        kernel=Path("k"),
        initrd=Path("i"),
        cmdline="console=ttyS0",
        tap="tap000",
        gateway="10.77.0.1",
        qboot=qboot,
        **kw,
    )


def shape_of(argv: list[str]) -> list[str]:
    """argv minus what is per machine (name, paths, address, MAC, RAM sharing, -incoming)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("-name", "-append", "-serial", "-qmp", "-pidfile", "-incoming"):
            skip = True
            continue
        out.append(a.split("mac=")[0].split("file=")[0].split("path=")[0].replace("share=on", "share=off"))
    return out


def test_snapshot_and_clone_argv_are_one_machine(tmp_path):
    cold = argv_of(tmp_path, spec(start="cold"))
    template = argv_of(tmp_path, spec(name="lab-r1-wabc"), ram=tmp_path / "snap" / "ram", ram_shared=True)
    clone = argv_of(tmp_path, spec(), ram=tmp_path / "snap" / "ram", incoming=True)
    assert "-bios" in cold and "vmgenid,guid=auto" not in cold and "-incoming" not in cold
    for argv in (template, clone):
        assert argv[argv.index("-machine") + 1] == "pc,accel=tcg,memory-backend=ram0"
        assert "-bios" not in argv  # SeaBIOS: qboot hangs with vmgenid
        for device in ("vmgenid,guid=auto", "virtserialport,bus=vser0.0,chardev=qga0,name=org.qemu.guest_agent.0"):
            assert device in argv
    obj = template[template.index("-object") + 1]
    assert obj == f"memory-backend-file,id=ram0,size=1024M,mem-path={tmp_path / 'snap' / 'ram'},share=on"
    assert clone[clone.index("-object") + 1].endswith("share=off")  # private: copy on write
    assert "-incoming" not in template and clone[clone.index("-incoming") + 1] == "defer"
    assert f"socket,id=qga0,path={tmp_path / 'lab-r1-c01' / 'qga.sock'},server=on,wait=off" in clone
    # the same devices in the same order (PCI slots), the same sizes: only per-machine values differ
    assert shape_of(template) == shape_of(clone)


def test_fixup_batch_gives_the_cell_its_identity():
    lines = warm.fixup_batch(ip="10.77.0.12", prefix=24, gateway="10.77.0.1", mac="52:54:00:00:02:10").splitlines()
    assert lines == [
        "link set dev eth0 address 52:54:00:00:02:10",
        "addr flush dev eth0",
        "addr add 10.77.0.12/24 dev eth0",
        "route replace default via 10.77.0.1 dev eth0",
        "neigh flush dev eth0",
    ]
    down = warm.fixup_batch(
        ip="10.77.0.12", prefix=24, gateway="10.77.0.1", mac="m", dev="ens3", link_down=True
    ).splitlines()
    assert down[:3] == ["link set dev ens3 down", "link set dev ens3 address m", "link set dev ens3 up"]
    assert down[3:] == [line.replace("eth0", "ens3") for line in lines[1:]]


def test_refusals_name_why():
    assert warm.refusal(IMAGE) is None
    assert "freebsd" in warm.refusal(replace(IMAGE, os="freebsd"))
    assert "guest agent" in warm.refusal(replace(IMAGE, manifest={"guest_agent": False}))


def test_plan_refuses_what_warm_start_cannot_make():
    settings = local.Settings(backend="local")
    local.LocalBackend.plan_check("local", settings, [spec(), spec(start="cold", clone=CloneKind.FULL)])
    with pytest.raises(SettingError, match="start = 'warm'.*linked clones") as err:
        local.LocalBackend.plan_check("local", settings, [spec(clone=CloneKind.FULL)])
    assert err.value.key == "start"
    with pytest.raises(SettingError, match="start = 'warm'.*freebsd"):
        local.LocalBackend.plan_check("local", settings, [spec(image=replace(IMAGE, os="freebsd"))])
    with pytest.raises(SettingError, match="start = 'lukewarm'"):
        local.LocalBackend.plan_check("local", settings, [spec(start="lukewarm")])
    assert local.capabilities(settings).snapshots


# -- the store -------------------------------------------------------------------------------------------------


def fake_snapshot(store: warm.WarmStore, key: warm.ShapeKey) -> Path:
    store.ensure()
    d = store.path(key)
    d.mkdir()
    (d / warm.DISK).write_bytes(b"qcow")
    with open(d / warm.RAM, "wb") as f:
        f.truncate(key.memory_mib * 1024 * 1024)  # sparse
    (d / warm.STATE).write_bytes(b"device state")
    (d / warm.META).write_text(
        json.dumps(
            {"key": asdict(key), "image_digest": key.image_digest, "state_sha256": images.file_sha256(d / warm.STATE)}
        )
    )
    return d


def test_store_finds_a_whole_snapshot_and_names_what_is_damaged(tmp_path):
    store = warm.WarmStore(tmp_path)
    key = key_of(spec(memory_mib=4))
    assert store.find(key) is None
    d = fake_snapshot(store, key)
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700  # guest memory: root only
    assert store.find(key).dir == d
    (d / warm.STATE).write_bytes(b"device statf")
    with pytest.raises(warm.WarmUnusable, match="does not match the checksum"):
        store.find(key)
    (d / warm.STATE).unlink()
    with pytest.raises(warm.WarmUnusable, match="its state file is missing"):
        store.find(key)
    (d / warm.STATE).write_bytes(b"device state")
    os.truncate(d / warm.RAM, 1024)
    with pytest.raises(warm.WarmUnusable, match="RAM file is 1024 bytes"):
        store.find(key)
    (d / warm.META).write_text("{")
    with pytest.raises(warm.WarmUnusable, match="meta.json is missing or unreadable"):
        store.find(key)
    (d / warm.META).write_text(json.dumps({"key": asdict(key_of(spec(memory_mib=8)))}))
    with pytest.raises(warm.WarmUnusable, match="another machine shape"):
        store.find(key)
    store.remove(key.name)
    assert not d.exists() and store.find(key) is None
    with pytest.raises(BackendError, match="not a warm snapshot"):
        store.remove("../lab-r1-c01")


def test_snapshots_are_listed_for_images_ls_and_gc_but_are_no_runs_leftovers(tmp_path):
    backend = local.LocalBackend("local", local.Settings(backend="local", workdir=str(tmp_path)))
    store = warm.WarmStore(tmp_path / warm.STORE)
    key = key_of(spec(memory_mib=4))
    fake_snapshot(store, key)
    (store.root / f"{key.name}.lock").touch()
    (store.root / "half-moved.tmp").mkdir()  # a build killed while moving files in: not a snapshot
    (owned,) = backend.warm.snapshots()
    assert (owned.kind, owned.name, owned.run_id, owned.detail) == ("warm", key.name, "", "artifact")
    assert backend.list_owned() == []  # gc of runs never sees them
    backend.warm.remove(owned)
    assert backend.warm.snapshots() == [] and not store.path(key).exists()


def test_two_workdirs_with_one_warm_dir_share_its_snapshots_and_not_their_own(tmp_path):
    shared = tmp_path / "shared"

    def backend(name: str, **kw) -> local.LocalBackend:
        return local.LocalBackend("local", local.Settings(backend="local", workdir=str(tmp_path / name), **kw))

    a, b = backend("a", warm_dir=str(shared)), backend("b", warm_dir=str(shared))
    key = key_of(spec(memory_mib=4))
    fake_snapshot(warm.WarmStore(shared), key)
    fake_snapshot(warm.WarmStore(tmp_path / "a" / warm.STORE), key_of(spec(memory_mib=8)))  # a's own: unused
    assert [o.name for o in a.warm.snapshots()] == [o.name for o in b.warm.snapshots()] == [key.name]
    assert [o.name for o in backend("a").warm.snapshots()] == [key_of(spec(memory_mib=8)).name]
    (owned,) = b.warm.snapshots()
    b.warm.remove(owned)  # gone for both
    assert a.warm.snapshots() == []


# -- the guest agent's protocol --------------------------------------------------------------------------------


class ScriptedAgent:
    """A unix socket answering like qemu-ga: a stale answer first (left from before a restore),
    then guest-sync-delimited, guest-exec and guest-exec-status."""

    def __init__(self, path: Path):
        self.path, self.seen = path, []
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(path))
        self.server.listen(1)
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        conn, _ = self.server.accept()
        f = conn.makefile("rwb")
        f.write(b'{"return": 41}\n')  # stale
        f.flush()
        polls = 0
        while True:
            line = f.readline()
            if not line:
                return
            line = line.lstrip(b"\xff")
            if not line.strip():
                continue
            req = json.loads(line)
            self.seen.append(req)
            if req["execute"] == "guest-sync-delimited":
                f.write(b'{"return": 99}\n\xff' + json.dumps({"return": req["arguments"]["id"]}).encode() + b"\n")
            elif req["execute"] == "guest-exec":
                f.write(b'{"return": {"pid": 7}}\n')
            elif req["execute"] == "guest-exec-status":
                polls += 1
                done = {
                    "exited": True,
                    "exitcode": 2,
                    "out-data": base64.b64encode(b"out").decode(),
                    "err-data": base64.b64encode(b"err").decode(),
                }
                f.write(json.dumps({"return": done if polls > 1 else {"exited": False}}).encode() + b"\n")
            else:
                f.write(b'{"error": {"class": "CommandNotFound", "desc": "no such command"}}\n')
            f.flush()


def test_guest_agent_syncs_past_stale_answers_and_runs_commands(tmp_path):
    path = tmp_path / "qga.sock"
    ScriptedAgent(path)
    with monitor.GuestAgent(path, timeout=5) as agent:
        agent.sync(timeout=5)
        res = agent.run(["ip", "-batch", "-"], input="link set dev eth0 up\n", timeout=5)
        assert res == monitor.ExecResult(2, "out", "err")
        with pytest.raises(BackendError, match="guest-frobnicate: no such command"):
            agent.call("guest-frobnicate", 5)


def test_guest_agent_sends_argv_and_stdin_as_qga_wants(tmp_path):
    path = tmp_path / "qga.sock"
    fake = ScriptedAgent(path)
    with monitor.GuestAgent(path, timeout=5) as agent:
        agent.sync(timeout=5)
        agent.run(["ip", "-batch", "-"], input="x\n", timeout=5)
    deadline = time.monotonic() + 5
    while len(fake.seen) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    exec_req = next(r for r in fake.seen if r["execute"] == "guest-exec")
    assert exec_req["arguments"] == {
        "path": "ip",
        "arg": ["-batch", "-"],
        "capture-output": True,
        "input-data": base64.b64encode(b"x\n").decode(),
    }


def test_a_socket_nobody_serves_is_an_error_naming_it(tmp_path):
    with pytest.raises(Exception, match="guest agent at"):
        monitor.GuestAgent(tmp_path / "none.sock", timeout=0.2)


def test_qmp_passes_the_state_file_itself(tmp_path):
    """getfd with the descriptor attached (SCM_RIGHTS): QEMU reads or writes the file directly."""
    path, got = tmp_path / "qmp.sock", {}
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)

    def serve():
        conn, _ = server.accept()
        conn.sendall(b'{"QMP": {"version": {}, "capabilities": []}}\n')
        conn.recv(4096)  # qmp_capabilities
        conn.sendall(b'{"return": {}}\n')
        msg, fds, _, _ = socket.recv_fds(conn, 4096, 1)
        got["request"], got["content"] = json.loads(msg), os.read(fds[0], 100)
        conn.sendall(b'{"event": "SOMETHING"}\n{"return": {}}\n')

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    state = tmp_path / "state"
    state.write_bytes(b"QEVM...")
    with monitor.Qmp(path, timeout=5) as qmp, open(state, "rb") as f:
        qmp.pass_fd("state", f.fileno(), timeout=5)
    t.join(5)
    assert got == {"request": {"execute": "getfd", "arguments": {"fdname": "state"}}, "content": b"QEVM..."}


class _Exiting:
    """A QEMU that quits while its monitor answers: the monitor closes before poll() sees the exit."""

    pid, returncode = 4242, None

    def __init__(self):
        self.polls = 0

    def poll(self):
        self.polls += 1
        if self.polls > 1:
            self.returncode = 1
        return self.returncode


class _ClosedQmp:
    def status(self):
        raise BackendError("QMP: the other side closed the connection")


def test_a_state_qemu_quits_on_is_damaged_even_if_the_monitor_closes_first(tmp_path):
    snap = warm.Snapshot(tmp_path / "debian12-x", {})
    r = warm.Restore(proc=_Exiting(), qmp=_ClosedQmp(), agent=None, started=time.monotonic())  # type: ignore[arg-type]
    with pytest.raises(warm.WarmUnusable, match="QEMU exited with status 1") as exc:
        warm.finish_restore(r, vmdir=tmp_path, snapshot=snap, spec=spec(), gateway="10.77.0.1", timeout=5)
    assert exc.value.damaged  # it goes: a later run builds it again


def test_a_restore_that_never_loads_is_not_called_damaged(tmp_path):
    class Alive:
        pid, returncode = 4243, None

        def poll(self):
            return None

    class SlowQmp:
        def status(self):
            return "inmigrate"

    snap = warm.Snapshot(tmp_path / "debian12-x", {})
    r = warm.Restore(proc=Alive(), qmp=SlowQmp(), agent=None, started=time.monotonic())  # type: ignore[arg-type]
    with pytest.raises(warm.WarmUnusable, match="state to load") as exc:
        warm.finish_restore(r, vmdir=tmp_path, snapshot=snap, spec=spec(), gateway="10.77.0.1", timeout=0.3)
    assert exc.value.damaged is False  # a slow machine: the snapshot stays
