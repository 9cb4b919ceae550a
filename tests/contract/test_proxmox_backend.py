"""lab.backends.proxmox against the PVE emulator (proxmoxer over real HTTPS, schema-validated)."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from pathlib import Path

import pytest
from proxmoxer import ProxmoxAPI
from pve_emulator import make_ca
from pve_emulator.cluster import KERNELS
from pve_emulator.fixtures import (  # noqa: F401  (fixtures)
    FULL_ACL,
    TEMPLATE_VMID,
    TOKEN_ID,
    TOKEN_SECRET,
    VM_PRIVS,
    backend_settings,
    in_threads,
    pve_certs_fixture,
    pve_env_fixture,
    pve_fixture,
)

from lab.backends import backend_class
from lab.backends.proxmox import ProxmoxBackend
from lab.backends.proxmox.ownership import parse_description
from lab.errors import (
    AuthError,
    BackendError,
    HostUnreachable,
    SettingError,
    TeardownError,
    TimeoutError_,
    UnreachableError,
    UsageError,
)
from lab.model import CloneKind, DiskBus, ImageRef, NicModel, VmSpec

IMAGE = ImageRef(name="debian12", os="debian", path=Path("debian12"), digest="d1")


def spec(
    name="lab-r1-c1",
    *,
    ip="10.0.0.5",
    mac="BC:24:11:12:34:56",
    nic=NicModel.E1000,
    clone=CloneKind.LINKED,
    run_id="r1",
    disk_bus=DiskBus.VIRTIO,
    image=IMAGE,
) -> VmSpec:
    return VmSpec(
        name=name,
        run_id=run_id,
        cell_id="c1",
        image=image,
        nic=nic,
        vcpus=2,
        memory_mib=1024,
        clone=clone,
        ip=ip,
        mac=mac,
        disk_bus=disk_bus,
        expires_at=1_900_000_000.0,
    )


def test_registered():
    assert backend_class("proxmox") is ProxmoxBackend


@pytest.mark.parametrize("pve", ["7.4", "8.4", "9.1"], indirect=True)
def test_full_lifecycle(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    b.check()
    facts = b.facts()
    assert facts["pve_release"] == pve.version and facts["node"] == "pve1" and facts["cpu_type"] == "host"
    client = b.open_run("r1")
    assert client.address == "" and client.argv(["iperf3", "-s"]) == ["iperf3", "-s"]

    vm = b.clone(IMAGE, spec())
    vmid = vm.handle["vmid"]
    assert vmid >= 100 and vmid != TEMPLATE_VMID
    cfg = pve.vm(vmid).config
    assert cfg["net0"] == "e1000=BC:24:11:12:34:56,bridge=vmbr0"
    assert cfg["cores"] == 2 and cfg["sockets"] == 1 and cfg["cpu"] == "host"
    assert cfg["memory"] == (1024 if pve.version == "7.4" else "1024")  # int on 7.x, string on 8.1+
    assert cfg["ipconfig0"] == "ip=10.0.0.5/24,gw=10.0.0.1"
    assert cfg["sshkeys"].startswith("ssh-ed25519%20AAAA") and "+" not in cfg["sshkeys"]
    assert "%2B" in cfg["sshkeys"] and "%2F" in cfg["sshkeys"] and "%3D" in cfg["sshkeys"]
    assert cfg["tags"] == "lab;lab-run-r1" and "lab-run-id: r1" in cfg["description"]
    assert cfg["name"] == "lab-r1-c1" and "lock" not in cfg
    assert ("ciupgrade" in cfg) == (pve.version != "7.4")
    clone_calls = [p for m, path, p in pve.requests if path.endswith("/clone")]
    assert clone_calls[-1]["full"] == "0" and clone_calls[-1]["newid"] == str(vmid)

    b.start(vm)
    assert b.wait_ready(vm, timeout=10) == "10.0.0.5"
    assert vm.address == "10.0.0.5" and vm.facts["address_source"] == "agent"

    owned = b.list_owned()
    assert [(o.kind, o.name, o.run_id, o.expires_at, o.detail) for o in owned if o.kind == "vm"] == [
        ("vm", "lab-r1-c1", "r1", 1_900_000_000.0, f"pve1/{vmid}")
    ]
    # and the run's lock on this machine, which a run killed with -9 leaves for `lab gc`
    assert [(o.kind, o.name, o.run_id) for o in owned if o.kind != "vm"] == [("lock", "proxmox-pve1@r1.lock", "r1")]
    b.remove_owned(owned[-1])  # gc never removes the lock of a live run
    assert b.run_is_live("r1") is True

    b.destroy(vm)
    assert pve.vm_ids() == [] and pve.vm_ids(include_templates=True) == [TEMPLATE_VMID]
    b.destroy(vm)  # idempotent: already gone is fine
    deletes = [p for m, path, p in pve.requests if m == "DELETE"]
    assert deletes and all(p["purge"] == "1" and p["destroy-unreferenced-disks"] == "1" for p in deletes)
    assert not pve.active_tasks()
    b.close_run("r1")


def test_dhcp_address_is_matched_by_mac(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec(ip="", mac="", nic=NicModel.VIRTIO))
    cfg = pve.vm(vm.handle["vmid"]).config
    assert cfg["ipconfig0"] == "ip=dhcp" and cfg["net0"].startswith("virtio=")
    b.start(vm)
    addr = b.wait_ready(vm, timeout=10)
    assert addr.startswith("10.99.")  # not lo, not docker0, not link-local
    b.destroy(vm)
    assert pve.vm_ids() == []


def test_full_clone_sends_storage(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec(clone=CloneKind.FULL))
    call = [p for m, path, p in pve.requests if path.endswith("/clone")][-1]
    assert call["full"] == "1" and call["storage"] == "local-lvm"
    b.destroy(vm)
    assert pve.vm_ids() == []


def test_template_by_name(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve, template="debian12"), pve_env)
    b.check()
    b.check_images([IMAGE])
    vm = b.clone(IMAGE, spec())
    b.destroy(vm)
    nope = ProxmoxBackend("pve1", backend_settings(pve, template="nope"), pve_env)
    nope.check()  # the template is the image's: checked with the images
    with pytest.raises(UsageError, match="no template published by the lab for debian12 .* named 'nope'") as err:
        nope.check_images([IMAGE])
    assert err.value.exit_code == 2 and "run `lab images publish debian12 pve1`" in str(err.value)


def test_clone_task_failing_midway_leaves_nothing(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    pve.fail_next("qmclone", "clone failed: lvcreate 'pve/vm-100-disk-0' error: out of space")
    with pytest.raises(BackendError) as err:
        b.clone(IMAGE, spec())
    assert "out of space" in str(err.value) and "clone of template 9000" in str(err.value)
    assert pve.vm_ids() == []
    assert sum(1 for t in pve.tasks.values() if t.type == "qmclone") == 1  # not retried


def test_lock_on_template_is_retried(pve, pve_env):
    pve.hold_lock(TEMPLATE_VMID, "clone", 1.0)
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec())
    refused = [p for m, path, p in pve.requests if path.endswith("/clone")]
    assert len(refused) >= 2  # first attempt(s) got "VM is locked (clone)"
    b.destroy(vm)
    assert pve.vm_ids() == []


def test_storage_lock_contention_is_retried(pve, pve_env):
    """Another client's full clone holds the storage lock: our clone task fails with PVE's
    `can't lock file` error, is retried with backoff, and succeeds."""
    pve.storage_slots, pve.storage_lock_timeout, pve.full_clone_seconds = 1, 0.05, 1.2
    user, name = TOKEN_ID.split("!")
    other = ProxmoxAPI(
        pve.url.removeprefix("https://"),
        user=user,
        token_name=name,
        token_value=TOKEN_SECRET,
        verify_ssl=str(pve.certs.ca_file),
        timeout=10,
    )
    other.nodes("pve1").qemu(TEMPLATE_VMID).clone.post(newid=500, full=1, name="someone-else")
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec())
    failed = [t.exitstatus for t in pve.tasks.values() if t.type == "qmclone" and t.exitstatus not in (None, "OK")]
    assert failed and all(
        f == "clone failed: can't lock file '/var/lock/pve-manager/pve-storage-local-lvm' - got timeout" for f in failed
    )
    b.destroy(vm)
    assert pve.vm_ids() == [500]


@pytest.mark.parametrize("concurrency", [1, 2])
def test_clone_concurrency_is_bounded(pve, concurrency, pve_env):
    pve.storage_slots = 4
    b = ProxmoxBackend("pve1", backend_settings(pve, concurrency=concurrency), pve_env)
    vms, errors = in_threads(lambda i: b.clone(IMAGE, spec(name=f"lab-r1-c{i}", mac="", ip=f"10.0.0.{10 + i}")), 3)
    assert not errors and len({vm.handle["vmid"] for vm in vms}) == 3
    spans = [(t.start, t.end) for t in pve.tasks.values() if t.type == "qmclone"]
    overlap = max(sum(1 for s2, e2 in spans if s2 <= s < e2) for s, _e in spans)
    assert overlap <= concurrency
    for vm in vms:
        b.destroy(vm)
    assert pve.vm_ids() == []


def test_config_waits_for_clone_lock(pve, pve_env):
    """A clone's target is locked until the task ends; configuring must come after the wait."""
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec())
    puts = [(m, path) for m, path, p in pve.requests if m == "PUT"]
    assert len(puts) == 1  # no "VM is locked (clone)" round trip: the task was awaited
    b.destroy(vm)


def test_agent_never_answers_falls_back_to_static_ip(pve, pve_env):
    pve.agent_delay = None
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec(ip="10.0.0.7"))
    b.start(vm)
    assert b.wait_ready(vm, timeout=5) == "10.0.0.7"
    assert vm.facts["address_source"] == "static"
    b.destroy(vm)
    assert pve.vm_ids() == []


def test_agent_never_answers_without_static_ip_times_out_clearly(pve, pve_env):
    pve.agent_delay = None
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec(ip=""))
    b.start(vm)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError_) as err:
        b.wait_ready(vm, timeout=1.0)
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert "guest agent" in msg and "QEMU guest agent is not running" in msg and str(vm.handle["vmid"]) in msg
    b.destroy(vm)
    assert pve.vm_ids() == []


def test_agent_late_is_awaited(pve, pve_env):
    pve.agent_delay = 0.5
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec(ip=""))
    b.start(vm)
    assert b.wait_ready(vm, timeout=10).startswith("10.99.")
    b.destroy(vm)


def test_bad_token_is_one_line_auth_error_without_secret(pve, caplog, pve_env):
    caplog.set_level(logging.DEBUG)
    wrong = "0000dead-beef-4000-8000-000000000000"
    b = ProxmoxBackend("pve1", backend_settings(pve, token=f"lab@pve!lab={wrong}"), pve_env)
    with pytest.raises(AuthError) as err:
        b.check()
    msg = str(err.value)
    assert msg == "pve1: authentication failed (401) for token lab@pve!lab"
    assert err.value.exit_code == 2 and "\n" not in msg
    for text in (msg, repr(err.value), err.value.hint or "", repr(b), caplog.text):
        assert wrong not in text and TOKEN_SECRET not in text


def test_missing_privilege_names_it(pve, pve_env):
    pve.add_token("lab@pve!noclone", "s3cr3t-noclone", privsep=True, acl={**FULL_ACL, "/vms": VM_PRIVS - {"VM.Clone"}})
    b = ProxmoxBackend("pve1", backend_settings(pve, token="lab@pve!noclone=s3cr3t-noclone"), pve_env)
    with pytest.raises(AuthError) as err:  # before anything is created
        b.check()
    assert "lab@pve!noclone lacks a privilege: Permission check failed (/vms/9000, VM.Clone)" in str(err.value)
    assert "s3cr3t" not in str(err.value) and err.value.exit_code == 2
    assert not [r for r in pve.requests if r[0] != "GET"]
    with pytest.raises(AuthError) as err:  # and PVE would have refused it too
        b.clone(IMAGE, spec())
    assert "Permission check failed (/vms/9000, VM.Clone)" in str(err.value)
    assert pve.vm_ids() == []


def test_fresh_privsep_token_fails_check(pve, pve_env):
    pve.add_token("lab@pve!fresh", "fresh-secret", privsep=True)  # no ACLs at all
    b = ProxmoxBackend("pve1", backend_settings(pve, token="lab@pve!fresh=fresh-secret"), pve_env)
    with pytest.raises(AuthError, match=r"Permission check failed \(/vms/9000, VM.Audit\)"):
        b.check()


@pytest.mark.filterwarnings("ignore:Unverified HTTPS request")
def test_wrong_ca_is_an_auth_error(pve, tmp_path, pve_env):
    """A CA that does not verify the cluster is a setting to fix (exit 2), at check and at snapshot."""
    _key, other_ca = make_ca(tmp_path, "other-ca")
    b = ProxmoxBackend("pve1", backend_settings(pve, ca_file=str(other_ca)), pve_env)
    for look in (b.check, b.host_facts):
        with pytest.raises(AuthError) as err:
            look()
        assert pve.url in str(err.value) and "TLS" in str(err.value) and err.value.exit_code == 2
        assert "ca_file" in err.value.hint and "verify_tls" not in err.value.hint  # never "turn it off"
    ProxmoxBackend("pve1", backend_settings(pve, ca_file=None, verify_tls=False), pve_env).check()


def _settings(**table):
    from lab.backends.proxmox.settings import Settings

    return Settings.model_validate({"backend": "proxmox", **table})


def test_unreachable_names_url(monkeypatch, pve_env):
    monkeypatch.setenv("LAB_TEST_TOKEN", "a@pam!b=c")
    b = ProxmoxBackend(
        "pve1",
        _settings(
            url="https://127.0.0.1:9",
            node="pve1",
            token="env:LAB_TEST_TOKEN",
            template=9000,
            timeouts={"http": 2, "retry": 1},
        ),
        pve_env,
    )
    with pytest.raises(UnreachableError, match=r"https://127.0.0.1:9") as err:
        b.check()  # before a run: nothing was created, exit 2
    assert err.value.exit_code == 2
    with pytest.raises(HostUnreachable, match=r"https://127.0.0.1:9") as err:
        b.host_facts()  # `lab snapshot`: a look that did not happen, exit 1
    assert err.value.exit_code == 1 and not isinstance(err.value, UnreachableError)


def test_password_login_uses_ticket_and_csrf(pve, pve_env):
    pve.add_user("lab@pve", "pa55word", acl=FULL_ACL_FOR_USER)
    b = ProxmoxBackend("pve1", backend_settings(pve, token=None, user="lab@pve", password="pa55word"), pve_env)
    b.check()
    vm = b.clone(IMAGE, spec())
    b.destroy(vm)
    assert pve.vm_ids() == []
    bad = ProxmoxBackend("pve1", backend_settings(pve, token=None, user="lab@pve", password="wrong-pw"), pve_env)
    with pytest.raises(AuthError) as err:
        bad.check()
    assert str(err.value) == "pve1: authentication failed (401) for user lab@pve"


def test_vmid_stolen_between_nextid_and_clone(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    pve.steal_next_vmid()
    vm = b.clone(IMAGE, spec())
    stolen = [v for v in pve.vm_ids() if v != vm.handle["vmid"]]
    assert len(stolen) == 1 and vm.handle["vmid"] != stolen[0]
    assert [o.detail for o in b.list_owned()] == [f"pve1/{vm.handle['vmid']}"]  # not someone else's
    b.destroy(vm)
    assert pve.vm_ids() == stolen


def test_two_orchestrators_racing_get_different_vmids(pve, pve_env):
    pve.nextid_lag = 5.0  # both see the same "next free" id
    backends = [ProxmoxBackend("pve1", backend_settings(pve), pve_env) for _ in range(2)]
    barrier = threading.Barrier(2)
    vms, errors = [], []

    def one(i):
        try:
            barrier.wait(5)
            vms.append(backends[i].clone(IMAGE, spec(name=f"lab-r1-c{i}", mac="", ip="")))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    ids = sorted(vm.handle["vmid"] for vm in vms)
    assert len(set(ids)) == 2
    clone_posts = [p["newid"] for m, path, p in pve.requests if path.endswith("/clone")]
    assert len(clone_posts) == 3 and clone_posts.count(str(ids[0])) == 2  # one collision, one retry
    for i, vm in enumerate(vms):
        backends[i].destroy(vm)
    assert pve.vm_ids() == []


def test_wrong_node_or_template_is_a_usage_error(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve, node="pve2"), pve_env)
    b.check()
    with pytest.raises(
        UsageError,
        match=r"template 9000 not found on node pve2: .*nodes/pve2/qemu-server/"
        r"9000.conf' does not exist",
    ):
        b.check_images([IMAGE])
    with pytest.raises(UsageError) as err:
        ProxmoxBackend("pve1", backend_settings(pve, node="pve9"), pve_env).check()
    assert (
        str(err.value)
        == (f"lab.toml: hosts.pve1.node = 'pve9': no such node in the cluster at {pve.url}; its nodes: pve1, pve2")
        and err.value.exit_code == 2
    )
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec())
    with pytest.raises(
        UsageError,
        match=f"no template published by the lab for debian12 .*{vm.handle['vmid']} on "
        "pve1 was not published by the lab",
    ):
        ProxmoxBackend("pve1", backend_settings(pve, template=vm.handle["vmid"]), pve_env).check_images([IMAGE])
    b.destroy(vm)


def test_remove_owned_after_crash(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec(run_id="crashed run"))
    b.start(vm)
    fresh = ProxmoxBackend("pve1", backend_settings(pve), pve_env)  # a later `lab gc`
    owned = fresh.list_owned()
    assert [o.run_id for o in owned] == ["crashed run"]
    assert pve.vm(vm.handle["vmid"]).config["tags"] == "lab;lab-run-crashed-run"
    fresh.remove_owned(owned[0])  # running: stopped first, then destroyed
    assert pve.vm_ids() == [] and fresh.list_owned() == []


def test_settings_and_repr_hide_secrets(monkeypatch, pve_env):
    monkeypatch.setenv("LAB_TEST_TOKEN", "u@pve!t=topsecret")
    b = ProxmoxBackend("pve1", _settings(url="https://pve:8006", node="pve1", token="env:LAB_TEST_TOKEN"), pve_env)
    assert b.session.credentials.principal == "u@pve!t"  # what messages name
    for shown in (repr(b), str(b), repr(b.session), repr(b.session.credentials), repr(b.settings)):
        assert "topsecret" not in shown
    monkeypatch.setenv("LAB_TEST_TOKEN", "garbage-topsecret")
    with pytest.raises(Exception) as err:
        ProxmoxBackend("pve1", _settings(url="https://pve:8006", node="pve1", token="env:LAB_TEST_TOKEN"), pve_env)
    assert "topsecret" not in str(err.value)


FULL_ACL_FOR_USER = {"/vms": VM_PRIVS, "/storage": {"Datastore.AllocateSpace"}, "/sdn": {"SDN.Use"}}


def test_secret_references_are_resolved(pve, monkeypatch, tmp_path, pve_env):
    monkeypatch.setenv("LAB_TEST_PVE_TOKEN", f"lab@pve!lab={TOKEN_SECRET}")
    b = ProxmoxBackend("pve1", backend_settings(pve, token="env:LAB_TEST_PVE_TOKEN", prefix_len=16), pve_env)
    b.check()
    assert b.settings.prefix_len == 16 and TOKEN_SECRET not in repr(b)
    secret_file = tmp_path / "pw"
    secret_file.write_text("pa55word\n")
    pve.add_user("lab@pve", "pa55word", acl=FULL_ACL_FOR_USER)
    ProxmoxBackend(
        "pve1", backend_settings(pve, token=None, user="lab@pve", password=f"file:{secret_file}"), pve_env
    ).check()


def test_failed_configure_leaves_nothing(pve, pve_env):
    # lab.toml refuses such a CPU type (lab.backends.fields); a host that refuses a value is made so
    b = ProxmoxBackend("pve1", backend_settings(pve).model_copy(update={"cpu_type": "not a cpu!"}), pve_env)
    with pytest.raises(BackendError, match=r"config of VM \d+ failed: 400 Parameter verification failed. cpu: "):
        b.clone(IMAGE, spec())
    assert pve.vm_ids() == []


def test_start_task_failure_is_surfaced(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec())
    pve.fail_next("qmstart", "start failed: QEMU exited with code 1")
    with pytest.raises(BackendError, match="start of VM .* failed: start failed: QEMU exited with code 1"):
        b.start(vm)
    b.destroy(vm)
    assert pve.vm_ids() == []


def test_destroy_retries_a_passing_lock(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec())
    b.start(vm)
    pve.hold_lock(vm.handle["vmid"], "backup", 0.8)
    b.destroy(vm)  # stop fails in the task with "VM is locked (backup)", then succeeds
    assert pve.vm_ids() == []
    assert any(t.exitstatus == "VM is locked (backup)" for t in pve.tasks.values())


def test_destroy_that_cannot_finish_is_a_teardown_error(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve, timeouts={"destroy": 1.0, "stop": 1.0}), pve_env)
    vm = b.clone(IMAGE, spec())
    pve.hold_lock(vm.handle["vmid"], "backup", 30)
    with pytest.raises(TeardownError, match=r"could not destroy VM \d+ \(lab-r1-c1\).*VM is locked \(backup\)"):
        b.destroy(vm)
    pve.hold_lock(vm.handle["vmid"], "backup", 0)
    b.destroy(vm)
    assert pve.vm_ids() == []


def test_gc_finds_a_clone_that_was_never_configured(pve, pve_env):
    """A crash between clone and configure leaves a VM without tags; its description is enough."""
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    user, name = TOKEN_ID.split("!")
    px = ProxmoxAPI(
        pve.url.removeprefix("https://"),
        user=user,
        token_name=name,
        token_value=TOKEN_SECRET,
        verify_ssl=str(pve.certs.ca_file),
        timeout=10,
    )
    px.nodes("pve1").qemu(TEMPLATE_VMID).clone.post(newid=300, full=0, name="lab-other-vm")  # not ours
    px.nodes("pve1").qemu(TEMPLATE_VMID).clone.post(  # the lab's lines without its marker: not ours either
        newid=302, full=0, name="lab-r8-c1", description="lab-vm: lab-r8-c1\nlab-run-id: r8\nlab-expires: 5"
    )
    px.nodes("pve1").qemu(TEMPLATE_VMID).clone.post(
        newid=301,
        full=0,
        name="lab-r9-c1",
        description="lab-marker: lab/vm\nlab-vm: lab-r9-c1\nlab-run-id: r9\nlab-expires: 5",
    )
    assert [(o.name, o.run_id, o.expires_at) for o in b.list_owned()] == [("lab-r9-c1", "r9", 5.0)]


@pytest.mark.parametrize("clone", [CloneKind.LINKED, CloneKind.FULL])
@pytest.mark.parametrize("bus", [DiskBus.VIRTIO, DiskBus.SCSI, DiskBus.SATA, DiskBus.IDE])
def test_the_clones_disk_is_on_the_cells_bus(pve, pve_env, bus, clone):
    """The template's disk (scsi0) is re-attached on the cell's bus by the clone's one config call:
    the same volume, nothing copied, nothing left unused, and it boots from it."""
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(IMAGE, spec(disk_bus=bus, clone=clone))
    vmid = vm.handle["vmid"]
    cfg = pve.vm(vmid).config
    key = {DiskBus.VIRTIO: "virtio0", DiskBus.SCSI: "scsi0", DiskBus.SATA: "sata0", DiskBus.IDE: "ide0"}[bus]
    disks = {k: v for k, v in cfg.items() if re.fullmatch(r"(scsi|virtio|sata|ide)\d+", k) and "media=cdrom" not in v}
    volume = (
        f"local-lvm:vm-{vmid}-disk-0"
        if clone == CloneKind.FULL
        else f"local-lvm:base-{TEMPLATE_VMID}-disk-0/vm-{vmid}-disk-0"
    )
    assert list(disks) == [key] and disks[key].split(",")[0] == volume
    assert cfg["boot"] == f"order={key}" and not [k for k in cfg if k.startswith("unused")]
    assert cfg["ide2"] == f"local-lvm:vm-{vmid}-cloudinit,media=cdrom"  # the cloud-init drive stays
    assert vm.facts["disk_bus"] == bus.value
    put = [p for m, path, p in pve.requests if m == "PUT" and path.endswith(f"/{vmid}/config")][-1]
    assert ("delete" in put) == (bus != DiskBus.SCSI)  # moved only when it is elsewhere
    assert sorted(v for v in pve.volume_ids() if f"-{vmid}-" in v) == sorted([volume, f"local-lvm:vm-{vmid}-cloudinit"])
    b.start(vm)
    assert b.wait_ready(vm, timeout=10) == "10.0.0.5"
    b.destroy(vm)
    assert pve.vm_ids() == [] and [v for v in pve.volume_ids() if f"-{vmid}-" in v] == []


def _plan_settings(**over):
    return _settings(**{"url": "https://pve1.example:8006", "node": "pve1", "token": "env:LAB_TEST_UNSET", **over})


def test_plan_check_needs_no_host_and_names_the_key():
    """`lab plan` asks the class, with settings alone: no token is read, no host is contacted."""
    debian, alpine = IMAGE, ImageRef(name="alpine3", os="alpine", path=Path("alpine3"), digest="a1")
    ProxmoxBackend.plan_check(
        "pve1",
        _plan_settings(),
        [
            spec(disk_bus=b, image=i)
            for b in (DiskBus.VIRTIO, DiskBus.SCSI, DiskBus.SATA, DiskBus.IDE)
            for i in (debian, alpine)
        ],
    )
    with pytest.raises(SettingError) as err:
        ProxmoxBackend.plan_check("pve1", _plan_settings(), [spec(disk_bus=DiskBus.NVME)])
    assert (err.value.key, err.value.value) == ("disk_bus", "nvme")
    assert "offers ide, sata, scsi, virtio" in err.value.problem
    with pytest.raises(SettingError) as err:  # one VMID for two images: both would clone the same disk
        ProxmoxBackend.plan_check("pve1", _plan_settings(template=9000), [spec(), spec(image=alpine)])
    assert (err.value.key, err.value.value) == ("template", 9000)
    assert "alpine3, debian12" in err.value.problem and "{image}" in err.value.hint
    ProxmoxBackend.plan_check("pve1", _plan_settings(template=9000), [spec(), spec(nic=NicModel.VIRTIO)])


@pytest.mark.parametrize("pve", ["7.4", "8.4", "9.1"], indirect=True)
def test_host_facts_come_from_the_node_status(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    facts = b.host_facts()
    assert facts["cpu_model"] == pve.cpu_model and facts["virt_flags"] == ["vmx"]
    assert (facts["cores"], facts["physical_cores"], facts["sockets"]) == (4, 2, 1)
    assert facts["mem_kib"] == pve.node_maxmem // 1024
    assert facts["kernel"] == KERNELS[pve.version]  # from current-kernel (8.x+) or kversion (7.x)
    assert facts["os"].startswith("pve-manager/")
    assert facts.get("boot_mode") == (None if pve.version == "7.4" else "efi")
    assert "node_facts" not in facts
    pve.offline_nodes.add("pve2")
    facts = ProxmoxBackend("pve1", backend_settings(pve, nodes=["pve1", "pve2"]), pve_env).host_facts()
    assert facts["cpu_model"] == pve.cpu_model
    assert facts["node_facts"] == {"pve2": {"error": "node pve2 cannot be reached: HTTP 595 No route to host"}}


def test_a_live_vms_lease_is_renewed_in_its_description(pve, pve_env):
    """Issue 35: the description names the run's owner, and the run rewrites its lab-expires while
    the VM stands; gc reads both back."""
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    owner = "abcdefabcdef-0123456789ab"
    vm = b.clone(IMAGE, dataclasses.replace(spec(), owner=owner))
    try:
        b.renew_lease(vm, 1_950_000_000.7)
        meta = parse_description(pve.vms[vm.handle["vmid"]].config["description"])
        assert meta["lab-expires"] == "1950000000" and meta["lab-owner"] == owner and meta["lab-run-id"] == "r1"
        (owned,) = [o for o in b.list_owned() if o.kind == "vm"]
        assert (owned.expires_at, owned.owner) == (1_950_000_000.0, owner)
    finally:
        b.destroy(vm)
