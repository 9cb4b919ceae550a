"""lab.backends.proxmox against the PVE emulator: publishing images, multi-node placement, and the
pitfall checklist's faults (flocks, expired tickets, slow calls, HA, ARP-only guests)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from pathlib import Path

import pytest
from proxmoxer import ProxmoxAPI
from proxmoxer.core import ResourceException
from pve_emulator import make_ca
from pve_emulator.fixtures import (  # noqa: F401  (fixtures)
    TEMPLATE_VMID,
    TOKEN_ID,
    TOKEN_SECRET,
    backend_settings,
    lab_template_description,
    pve_certs_fixture,
    pve_env_fixture,
    pve_fixture,
)

from lab import proc
from lab.backends import default_env
from lab.backends.proxmox import ProxmoxBackend
from lab.errors import AuthError, BackendError, HostUnreachable, TeardownError, UsageError
from lab.model import ImageRef, NicModel, VmSpec
from lab.wait import wait_until


def spec(name="lab-r1-c1", *, ip="", mac="", run_id="r1", memory=1024) -> VmSpec:
    image = ImageRef(name="debian12", os="debian", path=Path("debian12"), digest="d1")
    return VmSpec(
        name=name,
        run_id=run_id,
        cell_id="c1",
        image=image,
        nic=NicModel.VIRTIO,
        vcpus=1,
        memory_mib=memory,
        ip=ip,
        mac=mac,
        expires_at=1_900_000_000.0,
    )


def image(tmp_path, name="debian12", size="16M") -> ImageRef:
    path = tmp_path / f"{name}-{size}.qcow2"
    proc.run(["qemu-img", "create", "-q", "-f", "qcow2", path, size])
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return ImageRef(name=name, os="debian", path=path, digest="recipe-" + sha[:8], sha256=sha)


def px(emu, **auth) -> ProxmoxAPI:
    if not auth:
        user, name = TOKEN_ID.split("!")
        auth = {"user": user, "token_name": name, "token_value": TOKEN_SECRET}
    return ProxmoxAPI(emu.url.removeprefix("https://"), verify_ssl=str(emu.certs.ca_file), timeout=10, **auth)


def no_leftovers(emu) -> None:
    assert emu.vm_ids() == [], emu.vm_ids()
    assert [v for v in emu.volume_ids() if not v.startswith(("local:iso/", "local:import/"))] == []
    assert not [v for v in emu.volume_ids() if v.startswith(("local:iso/", "local:import/"))], "upload left"
    assert not emu.active_tasks()


# --- publishing --------------------------------------------------------------------------------


@pytest.mark.parametrize("pve", ["8.4", "9.1"], indirect=True)
def test_publish_with_import_content_then_clone(pve, tmp_path, pve_env):
    img = image(tmp_path)
    b = ProxmoxBackend("pve1", backend_settings(pve, template=None), pve_env)
    assert b.publishing.publish(img) == "lab-debian12"
    uploads = [p for m, path, p in pve.requests if path.endswith("/upload")]
    assert [u["content"] for u in uploads] == ["import"] and uploads[0]["checksum"] == img.sha256
    create = [p for m, path, p in pve.requests if m == "POST" and path == "/nodes/pve1/qemu"][0]
    assert create["scsi0"] == f"local-lvm:0,import-from=local:import/lab-debian12-{img.sha256[:12]}.qcow2"
    assert create["ide2"] == "local-lvm:cloudinit" and create["agent"] == "enabled=1"
    tmpl = [v for v in pve.vm_ids(include_templates=True) if v != TEMPLATE_VMID]
    assert len(tmpl) == 1
    cfg = pve.vm(tmpl[0]).config
    assert cfg["template"] == 1 and cfg["name"] == "lab-debian12" and "import-from" not in cfg["scsi0"]
    assert f"lab-image-sha256: {img.sha256}" in cfg["description"]
    assert not [v for v in pve.volume_ids() if v.startswith("local:import/")]  # the upload is removed
    # the template serves clones; publishing the same image again changes nothing
    vm = b.clone(img, spec())
    assert vm.handle["node"] == "pve1" and vm.facts["template"] == tmpl[0]
    clone_cfg = pve.vm(vm.handle["vmid"]).config  # the template's disk, re-attached on the cell's bus
    assert clone_cfg["virtio0"].startswith(f"local-lvm:base-{tmpl[0]}-disk-0/") and "scsi0" not in clone_cfg
    before = len(pve.requests)
    assert b.publishing.publish(img) == "lab-debian12"
    assert not [p for m, path, p in pve.requests[before:] if m != "GET"]
    b.destroy(vm)
    # a new build of the image replaces the template (the old one has no clones left)
    new = image(tmp_path, size="20M")
    b2 = ProxmoxBackend("pve1", backend_settings(pve, template=None), pve_env)
    b2.publishing.publish(new)
    now = [v for v in pve.vm_ids(include_templates=True) if v != TEMPLATE_VMID]
    assert len(now) == 1 and now[0] != tmpl[0]
    assert f"lab-image-sha256: {new.sha256}" in pve.vm(now[0]).config["description"]
    assert b2.clone(new, spec()).facts["template"] == now[0]


def test_publish_failing_import_leaves_nothing(pve, tmp_path, pve_env):
    img = image(tmp_path)
    leftover = tmp_path / f"lab-debian12-{img.sha256[:12]}.qcow2"  # an earlier publish died after its upload
    leftover.symlink_to(img.path)
    node = px(pve).nodes("pve1")
    with open(leftover, "rb") as fh:
        upid = node.storage("local").upload.post(content="import", filename=fh)
    wait_until(lambda: node.tasks(upid).status.get()["status"] == "stopped", timeout=5, what="the upload")
    assert pve.volume_ids() == [f"local:import/{leftover.name}"]
    pve.fail_next("qmcreate", "import failed: qemu-img: Could not open '/dev/pve/vm-100-disk-0'")
    b = ProxmoxBackend("pve1", backend_settings(pve, template=None), pve_env)
    with pytest.raises(BackendError, match="import of debian12 into VM 100 failed: import failed: qemu-img"):
        b.publishing.publish(img)
    assert pve.vm_ids(include_templates=True) == [TEMPLATE_VMID]
    assert pve.volume_ids() == []  # neither the upload nor a half-imported disk


def test_publish_without_the_upload_privilege_names_it(pve, tmp_path, pve_env):
    pve.add_token(
        "lab@pve!noup",
        "noup-secret",
        acl={"/vms": {"VM.Audit", "VM.Allocate"}, "/storage": {"Datastore.AllocateSpace"}},
    )
    b = ProxmoxBackend("pve1", backend_settings(pve, template=None, token="lab@pve!noup=noup-secret"), pve_env)
    with pytest.raises(AuthError) as err:
        b.publishing.publish(image(tmp_path))
    assert "Permission check failed (/storage/local, Datastore.AllocateTemplate)" in str(err.value)
    assert "noup-secret" not in str(err.value) and err.value.exit_code == 2
    assert pve.volume_ids() == []


@pytest.mark.parametrize("pve", ["7.4"], indirect=True)
def test_publish_on_74_needs_root_then_imports_by_path(pve, tmp_path, pve_env):
    img = image(tmp_path)
    with pytest.raises(UsageError) as err:
        ProxmoxBackend("pve1", backend_settings(pve, template=None), pve_env).publishing.publish(img)
    assert "imports from an absolute path, which PVE allows only root@pam with a password, not lab@pve!lab" in str(
        err.value
    )
    assert pve.volume_ids() == []
    root = ProxmoxBackend(
        "pve1", backend_settings(pve, template=None, token=None, user="root@pam", password="rootpass"), pve_env
    )
    assert root.publishing.publish(img) == "lab-debian12"
    uploads = [p for m, path, p in pve.requests if path.endswith("/upload")]
    assert [u["content"] for u in uploads] == ["iso"]
    create = [p for m, path, p in pve.requests if m == "POST" and path == "/nodes/pve1/qemu"][0]
    assert create["scsi0"] == (f"local-lvm:0,import-from=/var/lib/vz/template/iso/lab-debian12-{img.sha256[:12]}.img")
    assert pve.volume_ids() == []  # the iso upload went after the import


# --- several nodes -----------------------------------------------------------------------------


def test_nodes_need_shared_storage_or_their_own_template(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve, nodes=["pve1", "pve2"]), pve_env)
    b.check()
    with pytest.raises(UsageError) as err:
        b.check_images([spec().image])
    assert "node pve2 has no template '9000' of its own" in str(err.value) or "is on local storage 'local-lvm'" in str(
        err.value
    )
    bad = ProxmoxBackend(
        "pve1",
        backend_settings(pve, nodes=["pve1", "pve7"]),
        dataclasses.replace(default_env(), source="/etc/lab.toml"),
    )
    with pytest.raises(UsageError) as err:
        bad.check()
    assert str(err.value) == (
        f"/etc/lab.toml: hosts.pve1.nodes[1] = 'pve7': no such node in the cluster at {pve.url}; its nodes: pve1, pve2"
    )
    assert pve.vm_ids() == []


def test_spread_places_clones_on_both_nodes_through_shared_storage(pve, pve_env):
    pve.add_storage("ceph", "rbd", {"images"}, shared=True)
    pve.add_template(9001, "lab-debian12", storage="ceph", description=lab_template_description())
    b = ProxmoxBackend(
        "pve1", backend_settings(pve, template=None, nodes=["pve1", "pve2"], placement="spread"), pve_env
    )
    b.check()
    img = spec().image
    b.check_images([img])
    vms = [b.clone(img, spec(name=f"lab-r1-c{i}")) for i in range(3)]
    assert [vm.handle["node"] for vm in vms] == ["pve1", "pve2", "pve1"]
    assert [pve.vm(vm.handle["vmid"]).node for vm in vms] == ["pve1", "pve2", "pve1"]
    clones = [p for m, path, p in pve.requests if path.endswith("/clone")]
    assert [c.get("target") for c in clones] == [None, "pve2", None]
    for vm in vms:
        b.start(vm)
        assert b.wait_ready(vm, timeout=10).startswith("10.99.")
    starts = [t for t in pve.tasks.values() if t.type == "qmstart"]
    assert sorted(t.node for t in starts) == ["pve1", "pve1", "pve2"]  # polled on the UPID's node
    assert sorted(o.detail for o in b.list_owned()) == sorted(f"{vm.handle['node']}/{vm.handle['vmid']}" for vm in vms)
    for vm in vms:
        b.destroy(vm)
    no_leftovers(pve)


def test_spread_makes_each_node_a_lane_and_a_pinned_vm_goes_to_its_node(pve, pve_env):
    pve.add_storage("ceph", "rbd", {"images"}, shared=True)
    pve.add_template(9001, "lab-debian12", storage="ceph", description=lab_template_description())
    settings = backend_settings(pve, template=None, nodes=["pve1", "pve2"], placement="spread")
    assert ProxmoxBackend.capabilities(settings).places == ("pve1", "pve2")  # a lane per node (lab.runner.lanes)
    pack = backend_settings(pve, template=None, nodes=["pve1", "pve2"])
    assert ProxmoxBackend.capabilities(pack).places == ()  # pack: one lane, its VMs share a node
    b = ProxmoxBackend("pve1", settings, pve_env)
    b.check_images([spec().image])
    pinned = [b.clone(spec().image, dataclasses.replace(spec(name=f"lab-r1-c{i}"), place="pve2")) for i in range(2)]
    assert [vm.handle["node"] for vm in pinned] == ["pve2", "pve2"]  # spread alone would take pve1 second
    assert [pve.vm(vm.handle["vmid"]).node for vm in pinned] == ["pve2", "pve2"]
    pve.offline_nodes.add("pve2")
    with pytest.raises(BackendError) as exc:
        b.clone(spec().image, dataclasses.replace(spec(name="lab-r1-c9"), place="pve2"))
    assert str(exc.value) == "pve1: node pve2 (its lane's) is not online with 1024 MiB free for lab-r1-c9"
    with pytest.raises(BackendError, match="asks for node pve7, not one of `nodes`"):
        b.clone(spec().image, dataclasses.replace(spec(name="lab-r1-c8"), place="pve7"))
    pve.offline_nodes.clear()
    for vm in pinned:
        b.destroy(vm)
    no_leftovers(pve)


def test_a_node_with_its_own_template_clones_locally_and_pack_skips_an_offline_node(pve, pve_env):
    pve.add_template(9002, "lab-debian12", node="pve2", description=lab_template_description())
    pve.add_template(9003, "lab-debian12", node="pve1", description=lab_template_description())
    b = ProxmoxBackend("pve1", backend_settings(pve, template=None, nodes=["pve1", "pve2"]), pve_env)
    b.check_images([spec().image])  # each node has its own template: no shared storage needed
    pve.offline_nodes.add("pve1")
    vm = b.clone(spec().image, spec())
    assert vm.handle["node"] == "pve2" and vm.facts["template"] == 9002
    assert "target" not in [p for m, path, p in pve.requests if path.endswith("/clone")][-1]
    b.destroy(vm)
    pve.offline_nodes.add("pve2")
    with pytest.raises(BackendError, match="no node of pve1, pve2 is online with 1024 MiB free"):
        b.clone(spec().image, spec())
    pve.offline_nodes.clear()
    pve.node_maxmem = 3 * 1024**3  # 2 GiB used by the host itself: a 2 GiB VM does not fit
    with pytest.raises(BackendError, match="with 2048 MiB free"):
        b.clone(spec().image, spec(memory=2048))
    no_leftovers(pve)


# --- pitfalls ----------------------------------------------------------------------------------


def test_a_held_flock_fails_the_start_task_and_start_is_retried(pve, pve_env):
    pve.flock_timeout = 0.1
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(spec().image, spec(ip="10.0.0.5"))
    pve.hold_flock(vm.handle["vmid"], 0.5)  # e.g. a backup job's `qm` holds it
    b.start(vm)
    failed = [t.exitstatus for t in pve.tasks.values() if t.type == "qmstart" and t.exitstatus != "OK"]
    assert failed and set(failed) == {
        f"can't lock file '/var/lock/qemu-server/lock-{vm.handle['vmid']}.conf' - got timeout"
    }
    assert pve.vm(vm.handle["vmid"]).running
    pve.hold_flock(vm.handle["vmid"], 0.4)  # a sync config call waits for it, then fails the same way
    with pytest.raises(ResourceException, match="can't lock file"):
        px(pve).nodes("pve1").qemu(vm.handle["vmid"]).config.put(description="x")
    b.destroy(vm)
    no_leftovers(pve)


def test_an_expired_ticket_is_renewed_once(pve, caplog, pve_env):
    caplog.set_level(logging.DEBUG)
    pve.add_user(
        "lab@pve",
        "pa55word",
        acl={
            "/vms": {
                "VM.Audit",
                "VM.Clone",
                "VM.Allocate",
                "VM.PowerMgmt",
                "VM.Config.Network",
                "VM.Config.CPU",
                "VM.Config.Memory",
                "VM.Config.Cloudinit",
                "VM.Config.Options",
                "VM.Config.Disk",
                "VM.Monitor",
            },
            "/storage": {"Datastore.AllocateSpace"},
            "/nodes": {"Sys.Audit"},
            "/sdn": {"SDN.Use"},
        },
    )
    b = ProxmoxBackend("pve1", backend_settings(pve, token=None, user="lab@pve", password="pa55word"), pve_env)
    b.check()
    pve.expire_tickets()
    vm = b.clone(spec().image, spec())
    logins = [p for m, path, p in pve.requests if path == "/access/ticket"]
    assert len(logins) == 2
    pve.expire_tickets()
    pve.add_user("lab@pve", "changed", acl={})  # and now the password is wrong: a clear error
    with pytest.raises(TeardownError, match=r"authentication failed \(401\) for user lab@pve"):
        b.destroy(vm)
    assert "pa55word" not in caplog.text
    pve.add_user("lab@pve", "pa55word", acl={"/vms": {"VM.Audit", "VM.Allocate", "VM.PowerMgmt"}})
    b.destroy(vm)
    no_leftovers(pve)


def test_a_clone_call_that_times_out_is_adopted_once_its_task_ends(pve, pve_env):
    """The node carries out a clone whose HTTP call we gave up on: the VM is found under its VMID by
    the cell's marker, awaited until its clone task ends, and used; the clone is not sent twice."""
    pve.latency["POST /nodes/{node}/qemu/{vmid}/clone"] = 1.0
    b = ProxmoxBackend("pve1", backend_settings(pve, timeouts={"http": 0.5, "destroy": 10, "clone": 10}), pve_env)
    vm = b.clone(spec().image, spec())
    assert [t.type for t in pve.tasks.values()] == ["qmclone"]
    assert pve.vm(vm.handle["vmid"]).config["tags"] == "lab;lab-run-r1"  # configured after the adoption
    b.destroy(vm)
    no_leftovers(pve)


def test_a_clone_whose_outcome_stays_unknown_leaves_nothing(pve, pve_env):
    """The clone's answer is lost and its task fails later (PVE removes the VM): the clone is tried
    again under a new VMID, and after the deadline nothing is left."""
    pve.latency["POST /nodes/{node}/qemu/{vmid}/clone"] = 1.0
    pve.fail_next("qmclone", "clone failed: out of space", count=10)
    b = ProxmoxBackend(
        "pve1", backend_settings(pve, timeouts={"http": 0.5, "destroy": 10, "clone": 4}, lock_retries=1), pve_env
    )
    with pytest.raises(HostUnreachable, match=r"clone of template 9000: no answer from .* within 0.5 s") as err:
        b.clone(spec().image, spec())
    assert err.value.exit_code == 1
    no_leftovers(pve)
    assert {t.type for t in pve.tasks.values()} == {"qmclone"}


def test_ha_managed_vm_is_destroyed_with_purge(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(spec().image, spec())
    pve.set_ha(vm.handle["vmid"])
    with pytest.raises(ResourceException, match="used in HA resources and purge parameter not set"):
        px(pve).nodes("pve1").qemu(vm.handle["vmid"]).delete()
    b.destroy(vm)  # sends purge=1
    no_leftovers(pve)


def test_requests_ca_bundle_does_not_override_ca_file(pve, tmp_path, monkeypatch, pve_env):
    _key, other = make_ca(tmp_path, "other-ca")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(other))
    ProxmoxBackend("pve1", backend_settings(pve), pve_env).check()  # verified against ca_file, per request


def test_vm_name_is_made_a_dns_name(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve), pve_env)
    vm = b.clone(spec().image, spec(name="lab_r1__c1"))
    assert pve.vm(vm.handle["vmid"]).config["name"] == "lab-r1-c1"
    b.destroy(vm)


def test_address_pool_hands_out_and_takes_back(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve, addresses="10.0.0.50-10.0.0.51", gateway="10.0.0.1"), pve_env)
    one, two = b.clone(spec().image, spec(name="lab-r1-c1")), b.clone(spec().image, spec(name="lab-r1-c2"))
    assert [pve.vm(v.handle["vmid"]).config["ipconfig0"] for v in (one, two)] == [
        "ip=10.0.0.50/24,gw=10.0.0.1",
        "ip=10.0.0.51/24,gw=10.0.0.1",
    ]
    with pytest.raises(BackendError, match="every address of `addresses` is in use"):
        b.clone(spec().image, spec(name="lab-r1-c3"))
    assert len(pve.vm_ids()) == 2  # the third clone was removed again
    b.destroy(one)
    three = b.clone(spec().image, spec(name="lab-r1-c3"))
    assert pve.vm(three.handle["vmid"]).config["ipconfig0"].startswith("ip=10.0.0.50/")
    for v in (two, three):
        b.destroy(v)
    no_leftovers(pve)


def test_two_runs_with_one_address_pool_never_share_an_address(pve, pve_env):
    """Two `lab run`s (two backend objects: no shared memory) cloning at once from one pool: each
    sees the other's addresses in the cluster's ipconfig0, and the address lock on this machine
    keeps them from choosing at the same moment."""
    settings = backend_settings(pve, addresses="10.0.0.50-10.0.0.52", gateway="10.0.0.1")
    runs = [ProxmoxBackend("pve1", settings, pve_env), ProxmoxBackend("pve1", settings, pve_env)]
    vms, errors = [], []

    def clone(b, name):
        try:
            vms.append(b.clone(spec().image, spec(name=name, run_id=name.split("-")[1])))
        except BackendError as exc:
            errors.append(str(exc))

    threads = [
        threading.Thread(target=clone, args=(b, f"lab-{r}-c{i}")) for i in (1, 2) for r, b in zip(("ra", "rb"), runs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    addresses = sorted(pve.vm(v.handle["vmid"]).config["ipconfig0"] for v in vms)
    assert addresses == [f"ip=10.0.0.{n}/24,gw=10.0.0.1" for n in (50, 51, 52)], (addresses, errors)
    assert len(errors) == 1 and "every address of `addresses` is in use (3, 3 by lab VMs on the cluster)" in errors[0]
    for v in vms:
        runs[0].destroy(v)
    no_leftovers(pve)


@pytest.fixture
def netns():
    name = f"pvetest-arp-{threading.get_native_id()}"
    proc.run(["ip", "netns", "add", name])
    try:
        proc.run(["ip", "-n", name, "link", "add", "br0", "type", "bridge"])
        proc.run(["ip", "-n", name, "addr", "add", "10.99.0.1/16", "dev", "br0"])
        proc.run(["ip", "-n", name, "link", "set", "br0", "up"])
        yield name
    finally:
        proc.run(["ip", "netns", "del", name], check=False)


def test_guest_without_agent_and_without_static_address_is_found_by_arp(pve, netns, pve_env):
    """A BSD guest without qemu-ga on DHCP: only the neighbour table knows its address."""
    b = ProxmoxBackend("pve1", backend_settings(pve, guest_agent=False, client_netns=netns), pve_env)
    vm = b.clone(spec().image, spec())
    assert pve.vm(vm.handle["vmid"]).config["agent"] == "enabled=0"
    b.start(vm)
    with pytest.raises(Exception, match=r"no neighbour entry for MAC"):
        b.wait_ready(vm, timeout=0.5)
    dhcp = pve.vm(vm.handle["vmid"]).dhcp_ip
    proc.run(["ip", "-n", netns, "neigh", "add", dhcp, "lladdr", vm.handle["mac"], "dev", "br0", "nud", "permanent"])
    assert b.wait_ready(vm, timeout=5) == dhcp and vm.facts["address_source"] == "arp"
    assert not [p for m, path, p in pve.requests if "agent" in path]  # never asked a switched-off agent
    assert b.open_run("r1").argv(["iperf3", "-s"]) == ["ip", "netns", "exec", netns, "iperf3", "-s"]
    b.close_run("r1")  # its run lock, a file held open
    b.destroy(vm)
    no_leftovers(pve)
