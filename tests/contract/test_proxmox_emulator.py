"""The PVE emulator itself: schema strictness and PVE's error framing, over real HTTPS."""

from __future__ import annotations

import re
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import requests
from proxmoxer import ProxmoxAPI
from proxmoxer.core import ResourceException
from pve_emulator import Schema, validate
from pve_emulator.fixtures import TEMPLATE_VMID, TOKEN_ID, TOKEN_SECRET, pve_certs_fixture, pve_fixture  # noqa: F401

from lab import proc

ENUM = (
    "e1000, e1000-82540em, e1000-82544gc, e1000-82545em, e1000e, i82551, i82557b, i82559er, "
    "ne2k_isa, ne2k_pci, pcnet, rtl8139, virtio, vmxnet3"
)


def call(emu, method, path, *, params=None, data=None, token=True):
    headers = {"Authorization": f"PVEAPIToken={TOKEN_ID}={TOKEN_SECRET}"} if token else {}
    return requests.request(
        method,
        f"{emu.url}/api2/json{path}",
        params=params,
        data=data,
        headers=headers,
        verify=str(emu.certs.ca_file),
        timeout=10,
    )


def api(emu) -> ProxmoxAPI:
    user, name = TOKEN_ID.split("!")
    return ProxmoxAPI(
        emu.url.removeprefix("https://"),
        user=user,
        token_name=name,
        token_value=TOKEN_SECRET,
        verify_ssl=str(emu.certs.ca_file),
        timeout=10,
    )


def new_vm(emu) -> int:
    px = api(emu)
    vmid = int(px.cluster.nextid.get())
    upid = px.nodes("pve1").qemu(TEMPLATE_VMID).clone.post(newid=vmid, full=0, name="t1")
    deadline = time.monotonic() + 5
    while px.nodes("pve1").tasks(upid).status.get()["status"] != "stopped":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return vmid


@pytest.mark.parametrize("pve", ["7.4", "8.4", "9.1"], indirect=True)
def test_bad_net0_model_is_rejected_like_pve(pve):
    vmid = new_vm(pve)
    r = call(pve, "PUT", f"/nodes/pve1/qemu/{vmid}/config", data={"net0": "virtio2,bridge=vmbr0"})
    assert r.status_code == 400 and r.reason == "Parameter verification failed."
    body = r.json()
    assert body["data"] is None
    assert body["errors"] == {
        "net0": "invalid format - format error\nnet0.model: value 'virtio2' does not "
        f"have a value in the enumeration '{ENUM}'\n"
    }
    assert ("message" in body) == (pve.version == "9.1")  # only newest http-server adds "message"


def test_unknown_and_missing_parameters(pve):
    r = call(pve, "POST", f"/nodes/pve1/qemu/{TEMPLATE_VMID}/clone", data={"fullclone": "1"})
    assert r.status_code == 400
    assert r.json()["errors"] == {
        "fullclone": "property is not defined in schema and the schema does not allow additional properties",
        "newid": "property is missing and it is not optional",
    }


def test_python_true_boolean_is_rejected(pve):
    with pytest.raises(ResourceException) as err:
        api(pve).nodes("pve1").qemu(TEMPLATE_VMID).clone.post(newid=120, full=True)
    assert err.value.status_code == 400
    assert err.value.errors == {"full": "type check ('boolean') failed - got 'True'"}
    assert pve.vm_ids() == []


def test_lenient_booleans_switch(pve):
    pve.strict_booleans = False
    upid = api(pve).nodes("pve1").qemu(TEMPLATE_VMID).clone.post(newid=120, full="true")
    assert upid.startswith("UPID:pve1:") and upid.split(":")[5] == "qmclone"


@pytest.mark.parametrize("pve", ["7.4", "8.4", "9.1"], indirect=True)
def test_vmid_99_is_rejected(pve):
    r = call(pve, "GET", "/nodes/pve1/qemu/99/status/current")
    assert r.status_code == 400 and r.reason == "Parameter verification failed."
    expected = (
        "invalid format - value does not look like a valid VM ID\n"
        if pve.version == "7.4"
        else "value must have a minimum value of 100"
    )  # 8.0 raised the schema minimum
    assert r.json()["errors"] == {"vmid": expected}


def test_format_checks(pve):
    vmid = new_vm(pve)
    r = call(
        pve,
        "PUT",
        f"/nodes/pve1/qemu/{vmid}/config",
        data={
            "sshkeys": "ssh-ed25519+AAAA+lab",
            "name": "lab_vm",
            "cores": "two",
            "net1": "virtio,bridge=vmbr0,macaddr=01:00:00:00:00:01",
            "net32": "virtio",
        },
    )
    errors = r.json()["errors"]
    assert errors["sshkeys"] == "invalid format - invalid urlencoded string: ssh-ed25519+AAAA+lab\n"
    assert errors["name"] == "invalid format - value does not look like a valid DNS name\n"
    assert errors["cores"] == "type check ('integer') failed - got 'two'"
    assert "unicast MAC" in errors["net1"]
    assert errors["net32"].startswith("property is not defined in schema")


def test_error_framing_and_plain_500s(pve):
    r = call(pve, "GET", "/nodes/pve1/qemu/4242/status/current")
    assert r.status_code == 500
    assert r.reason == "Configuration file 'nodes/pve1/qemu-server/4242.conf' does not exist"
    assert r.json() == {"data": None}
    r = call(pve, "GET", "/nodes/pve1/frobnicate")
    assert r.status_code == 501 and r.reason == "Method 'GET /nodes/pve1/frobnicate' not implemented"
    r = call(pve, "GET", "/nodes/pve1/tasks/UPID:pve1:nonsense/status")
    assert r.status_code == 400 and r.json()["errors"] == {"upid": "unable to parse worker upid"}


def test_nextid_is_a_string_and_not_a_reservation(pve):
    px = api(pve)
    assert px.cluster.nextid.get() == "100" and px.cluster.nextid.get() == "100"
    with pytest.raises(ResourceException) as err:
        px.cluster.nextid.get(vmid=TEMPLATE_VMID)
    assert err.value.errors == {"vmid": f"VM {TEMPLATE_VMID} already exists"}


def test_clone_lock_and_collision(pve):
    px = api(pve)
    upid = px.nodes("pve1").qemu(TEMPLATE_VMID).clone.post(newid=150, full=0)
    with pytest.raises(ResourceException, match=r"VM is locked \(clone\)"):
        px.nodes("pve1").qemu(150).config.put(cores=2)
    with pytest.raises(ResourceException, match="unable to create VM 150: config file already exists"):
        px.nodes("pve1").qemu(TEMPLATE_VMID).clone.post(newid=150, full=0)
    assert px.nodes("pve1").qemu(150).status.current.get()["lock"] == "clone"
    with pytest.raises(ResourceException, match="parameter 'storage' not allowed for linked clones"):
        px.nodes("pve1").qemu(TEMPLATE_VMID).clone.post(newid=151, full=0, storage="local-lvm")
    deadline = time.monotonic() + 5
    while px.nodes("pve1").tasks(upid).status.get()["status"] != "stopped":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert px.nodes("pve1").tasks(upid).status.get()["exitstatus"] == "OK"
    px.nodes("pve1").qemu(150).config.put(cores=2)


def test_start_of_template_fails_in_the_task(pve):
    px = api(pve)
    upid = px.nodes("pve1").qemu(TEMPLATE_VMID).status.start.post()
    deadline = time.monotonic() + 5
    while (st := px.nodes("pve1").tasks(upid).status.get())["status"] != "stopped":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert st["exitstatus"] == "you can't start a vm if it's a template"
    assert px.nodes("pve1").tasks(upid).log.get()[-1]["t"] == "TASK ERROR: you can't start a vm if it's a template"


def test_auth_errors(pve):
    pve.auth_delay = 0.3
    t0 = time.monotonic()
    r = call(pve, "GET", "/version", token=False)
    assert r.status_code == 401 and r.reason == "No ticket" and time.monotonic() - t0 >= 0.3
    r = requests.get(
        f"{pve.url}/api2/json/version",
        verify=str(pve.certs.ca_file),
        timeout=10,
        headers={"Authorization": f"PVEAPIToken={TOKEN_ID}=wrong"},
    )
    assert r.status_code == 401 and r.reason == "Authentication failed!"
    pve.auth_delay = 0.0
    # ticket login, then a POST without the CSRF header
    pve.add_user("u@pve", "pw", acl={"/vms": {"VM.Audit", "VM.Config.Options"}})
    t = requests.post(
        f"{pve.url}/api2/json/access/ticket",
        data={"username": "u@pve", "password": "pw"},
        verify=str(pve.certs.ca_file),
        timeout=10,
    ).json()["data"]
    cookies = {"PVEAuthCookie": t["ticket"]}
    ok = requests.get(
        f"{pve.url}/api2/json/nodes/pve1/qemu/{TEMPLATE_VMID}/config",
        cookies=cookies,
        verify=str(pve.certs.ca_file),
        timeout=10,
    )
    assert ok.status_code == 200
    r = requests.put(
        f"{pve.url}/api2/json/nodes/pve1/qemu/{TEMPLATE_VMID}/config",
        cookies=cookies,
        data={"description": "x"},
        verify=str(pve.certs.ca_file),
        timeout=10,
    )
    assert r.status_code == 401 and r.reason == "Permission denied - invalid csrf token"


@pytest.mark.parametrize("pve", ["8.4", "9.1"], indirect=True)
def test_agent_privilege_per_version(pve):
    pve.add_token("lab@pve!mon", "x", acl={"/vms": {"VM.Monitor"}})
    r = requests.get(
        f"{pve.url}/api2/json/nodes/pve1/qemu/{TEMPLATE_VMID}/agent/network-get-interfaces",
        headers={"Authorization": "PVEAPIToken=lab@pve!mon=x"},
        verify=str(pve.certs.ca_file),
        timeout=10,
    )
    if pve.version == "9.1":
        assert r.status_code == 403
        assert r.reason == (
            f"Permission check failed (/vms/{TEMPLATE_VMID}, VM.GuestAgent.Audit|VM.GuestAgent.Unrestricted)"
        )
    else:
        assert r.status_code == 500 and r.reason == f"VM {TEMPLATE_VMID} is not running"


def test_schema_validate_offline():
    schema = Schema("8.4")
    m = schema.method("/nodes/{node}/qemu/{vmid}/config", "PUT")
    typed, errors = validate(
        m,
        {
            "node": "pve1",
            "vmid": "100",
            "net0": "e1000=BC:24:11:00:00:01,bridge=vmbr0",
            "memory": "current=2048",
            "agent": "enabled=yes",
        },
    )
    assert errors == {} and typed["vmid"] == 100
    _typed, errors = validate(
        Schema("7.4").method("/nodes/{node}/qemu/{vmid}/config", "PUT"),
        {"node": "pve1", "vmid": "100", "memory": "current=2048"},
    )
    assert errors == {"memory": "type check ('integer') failed - got 'current=2048'"}


def wait(node, upid, timeout=5.0) -> dict:
    deadline = time.monotonic() + timeout
    while (st := node.tasks(upid).status.get())["status"] != "stopped":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return st


def small_qcow2(tmp_path, name="alpine.qcow2") -> Path:
    path = tmp_path / name
    proc.run(["qemu-img", "create", "-q", "-f", "qcow2", path, "16M"])
    return path


def test_upload_then_create_with_import_from_then_template_then_linked_clone(pve, tmp_path):
    px = api(pve)
    node = px.nodes("pve1")
    with open(small_qcow2(tmp_path), "rb") as fh:
        upid = node.storage("local").upload.post(content="import", filename=fh)
    assert upid.split(":")[5] == "imgcopy" and wait(node, upid)["exitstatus"] == "OK"
    assert "local:import/alpine.qcow2" in pve.volume_ids()
    upid = node.qemu.post(
        vmid=9100,
        name="alpine",
        memory="512",
        cores=1,
        agent="1",
        net0="virtio,bridge=vmbr0",
        scsi0="local-lvm:0,import-from=local:import/alpine.qcow2",
        ide2="local-lvm:cloudinit",
        boot="order=scsi0",
        serial0="socket",
        vga="serial0",
    )
    with pytest.raises(ResourceException, match=r"VM is locked \(create\)"):
        node.qemu(9100).template.post()
    with pytest.raises(ResourceException, match="VM 9100 already exists on node 'pve1'"):
        node.qemu.post(vmid=9100)
    assert wait(node, upid)["exitstatus"] == "OK"
    cfg = node.qemu(9100).config.get()
    assert cfg["scsi0"] == "local-lvm:vm-9100-disk-0" and cfg["net0"].startswith("virtio=BC:24:11:")
    wait(node, node.qemu(9100).template.post())
    assert node.qemu(9100).config.get()["scsi0"] == "local-lvm:base-9100-disk-0"
    assert "local-lvm:base-9100-disk-0" in pve.volume_ids(include_templates=True)
    wait(node, node.qemu(9100).clone.post(newid=9101, full=0))
    with pytest.raises(ResourceException, match="volume is used by VM 9100"):
        node.storage("local-lvm").content(quote("local-lvm:base-9100-disk-0", safe="")).delete()
    st = wait(node, node.qemu(9100).delete(purge=1))  # a template with a linked clone: fails in the task
    assert st["exitstatus"] == "base volume 'local-lvm:base-9100-disk-0' is still in use by linked cloned"
    wait(node, node.qemu(9101).delete(purge=1))
    assert not [v for v in pve.volume_ids(include_templates=True) if "9101" in v]  # disk, cloud-init drive


@pytest.mark.parametrize("pve", ["7.4", "8.4"], indirect=True)
def test_upload_rules(pve, tmp_path):
    node = api(pve).nodes("pve1")
    disk = small_qcow2(tmp_path)
    img = tmp_path / "golden.img"
    img.write_bytes(disk.read_bytes())
    if pve.version == "7.4":  # no `import` content before 8.3
        with open(disk, "rb") as fh, pytest.raises(ResourceException) as err:
            node.storage("local").upload.post(content="import", filename=fh)
        assert err.value.errors == {"content": "value 'import' does not have a value in the enumeration 'iso, vztmpl'"}
    else:  # where it exists, the storage must allow it
        with open(disk, "rb") as fh, pytest.raises(ResourceException) as err:
            node.storage("local-lvm").upload.post(content="import", filename=fh)
        assert "storage 'local-lvm' does not support 'import' content" in str(err.value)
        with open(img, "rb") as fh, pytest.raises(ResourceException) as err:  # .img is no import type
            node.storage("local").upload.post(content="import", filename=fh)
        assert err.value.errors == {"filename": "invalid filename or wrong extension"}
    with open(disk, "rb") as fh, pytest.raises(ResourceException) as err:
        node.storage("local").upload.post(content="iso", filename=fh)
    assert err.value.errors == {"filename": "wrong file extension"}
    with pytest.raises(ResourceException, match="unable to proxy file uploads"), open(img, "rb") as fh:
        node_b = api(pve).nodes("pve2")
        node_b.storage("local").upload.post(content="iso", filename=fh)
    with open(img, "rb") as fh:  # a wrong checksum fails in the task, and nothing stays
        upid = node.storage("local").upload.post(
            content="iso", filename=fh, checksum="0" * 64, **{"checksum-algorithm": "sha256"}
        )
    assert wait(node, upid)["exitstatus"].startswith("checksum mismatch")
    assert pve.volume_ids() == []
    with open(img, "rb") as fh:
        wait(node, node.storage("local").upload.post(content="iso", filename=fh))
    path = node.storage("local").content(quote("local:iso/golden.img", safe="")).get()["path"]
    assert path == "/var/lib/vz/template/iso/golden.img"
    # an iso volume cannot be imported by its volid; by its absolute path only as root@pam
    with pytest.raises(ResourceException) as err:
        node.qemu.post(vmid=9100, scsi0="local-lvm:0,import-from=local:iso/golden.img")
    assert err.value.errors == {"scsi0": "local:iso/golden.img has wrong type 'iso' - needs to be 'images' or 'import'"}
    with pytest.raises(ResourceException) as err:
        node.qemu.post(vmid=9100, scsi0=f"local-lvm:0,import-from={path}")
    assert err.value.status_code == 403 and "Only root can pass arbitrary filesystem paths." in str(err.value)
    with pytest.raises(ResourceException) as err:
        node.qemu.post(vmid=9100, scsi0=f"local-lvm:4,import-from={path}")
    assert "'import-from' requires special syntax" in str(err.value)
    root = ProxmoxAPI(
        pve.url.removeprefix("https://"),
        user="root@pam",
        password="rootpass",
        verify_ssl=str(pve.certs.ca_file),
        timeout=10,
    ).nodes("pve1")
    wait(root, root.qemu.post(vmid=9100, scsi0=f"local-lvm:0,import-from={path}"))
    assert "local-lvm:vm-9100-disk-0" in pve.volume_ids()


def test_a_disk_moves_to_another_bus_through_config(pve):
    """qemu-server's update_vm_api on a stopped VM: a deleted disk is detached to unusedN (never
    destroyed), an existing volume can be attached under any disk key, unusedN goes once its volume
    is attached again, and a boot order must name devices that exist."""
    vmid = new_vm(pve)
    node = api(pve).nodes("pve1")
    q = node.qemu(vmid)
    disk = q.config.get()["scsi0"].split(",")[0]
    with pytest.raises(ResourceException, match="invalid bootorder: device 'virtio0' does not exist"):
        q.config.put(boot="order=virtio0")
    with pytest.raises(ResourceException, match="volume local-lvm:vm-4242-disk-0 does not exist"):
        q.config.put(virtio0="local-lvm:vm-4242-disk-0")  # a volume that is not there
    q.config.put(delete="scsi0")
    cfg = q.config.get()
    assert "scsi0" not in cfg and cfg["unused0"] == disk and "boot" not in cfg  # out of the boot order too
    assert disk in pve.volume_ids()
    q.config.put(virtio0=disk, boot="order=virtio0")
    cfg = q.config.get()
    assert cfg["virtio0"] == disk and "unused0" not in cfg and cfg["boot"] == "order=virtio0"
    with pytest.raises(ResourceException, match="invalid bootorder: device 'virtio0' does not exist"):
        q.config.put(sata0=disk, delete="virtio0", boot="order=virtio0")
    q.config.put(sata0=disk, delete="virtio0", boot="order=sata0")  # in one call, as the lab does
    cfg = q.config.get()
    assert cfg["sata0"] == disk and not [k for k in cfg if re.fullmatch(r"(virtio|unused|scsi)\d+", k)]
    # another VM's volume: only with Datastore.Allocate on its storage (check_volume_access)
    pve.add_token("lab@pve!vmonly", "vmonly-secret", acl={"/vms": {"VM.Config.Disk", "VM.Audit"}})
    vmonly = ProxmoxAPI(
        pve.url.removeprefix("https://"),
        user="lab@pve",
        token_name="vmonly",
        token_value="vmonly-secret",
        verify_ssl=str(pve.certs.ca_file),
        timeout=10,
    )
    with pytest.raises(ResourceException) as err:
        vmonly.nodes("pve1").qemu(vmid).config.put(virtio1=f"local-lvm:base-{TEMPLATE_VMID}-disk-0")
    assert err.value.status_code == 403 and "(/storage/local-lvm, Datastore.Allocate)" in str(err.value)
    wait(node, q.delete(purge=1))
    assert not [v for v in pve.volume_ids() if f"-{vmid}-" in v]


@pytest.mark.parametrize("pve", ["7.4", "8.4", "9.1"], indirect=True)
def test_node_status_answers_what_the_schema_declares(pve):
    status = api(pve).nodes("pve1").status.get()
    returns = pve.schema.method("/nodes/{node}/status", "GET")["returns"]
    for name, prop in returns.get("properties", {}).items():  # 7.4 declares only "object"
        assert name in status, name
        for sub in prop.get("properties", {}):
            if not prop["properties"][sub].get("optional"):
                assert sub in status[name], f"{name}.{sub}"
    assert status["kversion"].startswith("Linux ") and status["cpuinfo"]["model"] == pve.cpu_model
    assert ("current-kernel" in status) == (pve.version != "7.4")
    pve.offline_nodes.add("pve2")
    with pytest.raises(ResourceException) as err:
        api(pve).nodes("pve2").status.get()
    assert err.value.status_code == 595
