"""lab.backends.proxmox on a shared cluster (issues 23 and 16): it clones exactly the template the lab
published for the image, touches nothing it did not make (foreign VMs and templates survive listing,
removal and publishing), and checks what its credentials may do before anything is created."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from pve_emulator.fixtures import (  # noqa: F401  (fixtures)
    FULL_ACL,
    TEMPLATE_VMID,
    TEST_IMAGE as IMAGE,
    VM_PRIVS,
    fast_backend as backend,
    lab_template_description,
    pve_certs_fixture,
    pve_env_fixture,
    pve_fixture,
)

from lab import proc
from lab.backends.proxmox.ownership import mac_for
from lab.errors import AuthError, UsageError
from lab.model import ImageRef, NicModel, VmSpec


def spec(name="lab-r1-c1", *, cell="c1", run_id="r1", image=IMAGE, mac="") -> VmSpec:
    return VmSpec(
        name=name,
        run_id=run_id,
        cell_id=cell,
        image=image,
        nic=NicModel.VIRTIO,
        vcpus=1,
        memory_mib=512,
        ip="10.0.0.5",
        mac=mac,
        expires_at=1_900_000_000.0,
    )


def plant_foreign(pve) -> dict[int, dict]:
    """What a person or another tool left on a shared cluster: a hand-made template named like the
    lab's (newer VMID), a copy of the lab's template lines without its marker, and VMs tagged `lab`
    with lab-like names and no, or half, or empty-run-id descriptions. Returns their configs."""
    pve.add_template(9100, "lab-debian12")  # hand-made, same name, higher VMID
    pve.add_template(
        9101, "lab-debian12", description="lab-image: debian12\nlab-image-digest: d1\nlab-image-sha256: d1"
    )  # the lines, not the marker
    pve.add_template(
        9102,
        "lab-debian12",
        description="lab-marker: lab/template\nlab-image: debian12\nlab-image-digest: old-recipe\nlab-published: 1",
    )
    vms = {
        200: ("lab-r1-c1", "lab", None),
        201: ("lab-r1-c1x", "lab;lab-run-r1", "lab-run-id: r1"),
        202: ("lab-r2-c1", "lab", "lab-marker: lab/vm\nlab-vm: lab-r2-c1\nlab-run-id: \nlab-expires: 1"),
        203: ("labr1c1", None, "created by someone else"),
    }
    for vmid, (name, tags, description) in vms.items():
        pve.add_template(vmid, name, description=description, tags=tags)
        with pve._lock:
            pve.vms[vmid].config.pop("template")  # an ordinary VM
    return {v: pve.vm(v).config for v in [*vms, 9100, 9101, 9102]}


def untouched(pve, before: dict[int, dict]) -> None:
    assert {v: pve.vm(v).config for v in before if v in pve.vm_ids(include_templates=True)} == before
    assert set(before) <= set(pve.vm_ids(include_templates=True))
    assert not [
        p
        for m, path, p in pve.requests
        for v in before
        if m in ("POST", "PUT", "DELETE") and re.search(rf"/qemu/{v}(/|$)", path)
    ]


# --- the right template ---------------------------------------------------------------------------


def test_the_published_template_is_cloned_never_a_hand_made_one_of_the_same_name(pve, pve_env):
    pve.add_template(9000 + 50, "lab-debian12", description=lab_template_description(published=1_700_000_000))
    foreign = plant_foreign(pve)
    b = backend(pve, pve_env, template=None)
    b.check()
    b.check_images([IMAGE])
    (line,) = b.describe_images([IMAGE])
    assert line.startswith("pve1: debian12 clones template 9050 on pve1 (lab-debian12, digest d1, published ")
    assert "9100 on pve1 was not published by the lab" in line and "9102 on pve1 holds digest old-recipe" in line
    vm = b.clone(IMAGE, spec())
    assert vm.facts["template"] == 9050 and vm.facts["template_digest"] == "d1"
    assert [p for m, path, p in pve.requests if path.endswith("/clone")] and all(
        path == "/nodes/pve1/qemu/9050/clone" for m, path, p in pve.requests if path.endswith("/clone")
    )
    b.destroy(vm)
    untouched(pve, foreign)


def test_two_matching_templates_the_newest_published_and_the_plan_says_which(pve, pve_env):
    pve.add_template(9060, "lab-debian12", description=lab_template_description(published=1_700_000_500))
    pve.add_template(9070, "lab-debian12", description=lab_template_description(published=1_700_000_000))
    b = backend(pve, pve_env, template=None)
    (line,) = b.describe_images([IMAGE])
    assert "clones template 9060 on pve1" in line and "the newest of 2 matching (also 9070)" in line
    vm = b.clone(IMAGE, spec())
    assert vm.facts["template"] == 9060
    b.destroy(vm)


def test_another_build_of_the_image_is_not_cloned(pve, pve_env):
    built = ImageRef(name="debian12", os="debian", path=Path("debian12"), digest="d1", sha256="ab" * 32)
    pve.add_template(9080, "lab-debian12", description=lab_template_description(sha256="cd" * 32))
    b = backend(pve, pve_env, template=None)
    with pytest.raises(UsageError) as err:
        b.check_images([built])
    assert "9080 on pve1 holds another build (sha256 cdcdcdcdcdcd)" in str(err.value)
    assert str(err.value).endswith("run `lab images publish debian12 pve1`") and err.value.exit_code == 2
    assert not [r for r in pve.requests if r[0] != "GET"]


def test_no_published_template_is_exit_2_with_the_publish_line(pve, pve_env):
    foreign = plant_foreign(pve)
    b = backend(pve, pve_env, template=None)
    with pytest.raises(UsageError) as err:
        b.check_images([IMAGE])
    msg = str(err.value)
    assert msg.startswith(
        "pve1: no template published by the lab for debian12 (recipe digest d1) named 'lab-debian12' on node pve1 ("
    )
    assert msg.endswith(": run `lab images publish debian12 pve1`") and "\n" not in msg
    with pytest.raises(UsageError):  # a clone without the checks refuses too
        b.clone(IMAGE, spec())
    assert pve.vm_ids() == sorted(v for v in foreign if v < 9000)
    untouched(pve, foreign)


def test_a_template_described_before_the_marker_line_still_counts(pve, pve_env):
    legacy = "lab-image: debian12\nlab-image-digest: d1\nlab-image-sha256: d1\npublished by `lab images publish`"
    pve.add_template(9090, "lab-debian12", description=legacy)
    b = backend(pve, pve_env, template=None)
    vm = b.clone(IMAGE, spec())
    assert vm.facts["template"] == 9090
    b.destroy(vm)


# --- never touch what the lab did not make --------------------------------------------------------


def test_foreign_vms_survive_listing_removal_and_a_killed_run(pve, pve_env):
    foreign = plant_foreign(pve)
    b = backend(pve, pve_env)
    b.open_run("r1")
    vm = b.clone(IMAGE, spec())  # the lab's own, of run r1 (like the foreign 201 claims to be)
    b.start(vm)
    gc = backend(pve, pve_env)
    owned = gc.list_owned()
    assert [(o.kind, o.detail) for o in owned if o.kind == "vm"] == [("vm", f"pve1/{vm.handle['vmid']}")]
    b.close_run("r1")
    for item in owned:  # gc --force removes everything listed: only the lab's
        gc.remove_owned(item)
    assert pve.vm_ids() == sorted(v for v in foreign if v < 9000)
    untouched(pve, foreign)


def test_a_vmid_taken_by_someone_else_after_teardown_is_left_alone(pve, pve_env):
    b = backend(pve, pve_env)
    vm = b.clone(IMAGE, spec())
    vmid = vm.handle["vmid"]
    b.destroy(vm)
    pve.add_template(vmid, "someone-elses", description=None)  # the freed id, reused at once
    with pve._lock:
        pve.vms[vmid].config.pop("template")
    b.destroy(vm)  # idempotent: the VMID is not the lab's VM any more
    assert pve.vm_ids() == [vmid] and pve.vm(vmid).config["name"] == "someone-elses"


def test_publish_replaces_only_the_labs_own_templates(pve, pve_env, tmp_path):
    path = tmp_path / "debian12.qcow2"
    proc.run(["qemu-img", "create", "-q", "-f", "qcow2", path, "16M"])
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    first = ImageRef(
        name="debian12", os="debian", path=path, digest="d1", sha256=sha, manifest={"boot": ["kernel", "bios"]}
    )
    foreign = plant_foreign(pve)
    b = backend(pve, pve_env, template=None)
    b.publishing.publish(first)
    ours = [v for v in pve.vm_ids(include_templates=True) if v not in foreign and v != TEMPLATE_VMID]
    assert len(ours) == 1
    proc.run(["qemu-img", "create", "-q", "-f", "qcow2", path, "20M"])  # a new build
    second = ImageRef(
        name="debian12",
        os="debian",
        path=path,
        digest="d2",
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        manifest={"boot": ["kernel", "bios"]},
    )
    backend(pve, pve_env, template=None).publishing.publish(second)
    now = [v for v in pve.vm_ids(include_templates=True) if v not in foreign and v != TEMPLATE_VMID]
    assert len(now) == 1 and now != ours  # the lab's older one replaced ...
    del foreign[9102]  # ... and so is its older marked one of old-recipe (the lab published it)
    untouched(pve, foreign)  # ... nothing else


# --- what the credentials may do ------------------------------------------------------------------

NEEDS = [
    ("/vms", "VM.Allocate"),
    ("/vms", "VM.Clone"),
    ("/vms", "VM.Audit"),
    ("/vms", "VM.PowerMgmt"),
    ("/vms", "VM.Config.Network"),
    ("/vms", "VM.Config.CPU"),
    ("/vms", "VM.Config.Memory"),
    ("/vms", "VM.Config.Cloudinit"),
    ("/vms", "VM.Config.Options"),
    ("/vms", "VM.Config.Disk"),
    ("/vms", "VM.Monitor"),
    ("/storage", "Datastore.AllocateSpace"),
    ("/sdn/zones", "SDN.Use"),
]


@pytest.mark.parametrize("where,privilege", NEEDS, ids=[p for _w, p in NEEDS])
def test_a_missing_privilege_is_named_before_anything_is_created(pve, pve_env, where, privilege):
    acl = {path: set(privs) - ({privilege} if path == where else set()) for path, privs in FULL_ACL.items()}
    pve.add_token("lab@pve!less", "less-secret", acl=acl)
    b = backend(pve, pve_env, token="lab@pve!less=less-secret")
    with pytest.raises(AuthError) as err:
        b.check()
        b.check_images([IMAGE])
    msg = str(err.value)
    assert "lab@pve!less lacks a privilege: Permission check failed (" in msg and privilege in msg
    assert "nothing was created" in msg and err.value.exit_code == 2 and "less-secret" not in msg
    assert not [r for r in pve.requests if r[0] != "GET"]
    # the check is not stricter than PVE: without it the cell fails on that very privilege (the
    # clone's "VM.Allocate on the new VMID, or on the pool" check names none: PVE's or-rule)
    refusal = "Permission check failed (clone of" if privilege == "VM.Allocate" else privilege
    with pytest.raises(AuthError, match=re.escape(refusal)):
        vm = b.clone(IMAGE, spec())
        b.start(vm)
        b.wait_ready(vm, timeout=5)
        b.destroy(vm)
    full = backend(pve, pve_env)
    for item in full.list_owned():
        full.remove_owned(item)
    assert pve.vm_ids() == []


def test_every_missing_privilege_is_named_in_one_line(pve, pve_env):
    pve.add_token("lab@pve!few", "few-secret", acl={"/vms": {"VM.Audit", "VM.Clone"}})
    with pytest.raises(AuthError) as err:
        backend(pve, pve_env, token="lab@pve!few=few-secret").check()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(
        "pve1: lab@pve!few lacks a privilege: Permission check failed (/vms, "
        "VM.Allocate); also missing: VM.PowerMgmt on /vms, "
    )
    for privilege in (
        "VM.Config.Disk",
        "VM.Monitor on /vms",
        "Datastore.AllocateSpace on /storage/local-lvm",
        "SDN.Use on /sdn/zones/localnetwork/vmbr0",
    ):
        assert privilege in msg


@pytest.mark.parametrize("pve", ["7.4", "9.1"], indirect=True)
def test_the_privileges_follow_the_version(pve, pve_env):
    """7.x has no SDN.Use check; 9.x's agent privilege is VM.GuestAgent.Audit, not VM.Monitor."""
    vms = VM_PRIVS - ({"VM.GuestAgent.Audit"} if pve.version == "7.4" else {"VM.Monitor"})
    pve.add_token(
        "lab@pve!v",
        "v-secret",
        acl={**FULL_ACL, "/vms": vms, "/sdn/zones": set()} if pve.version == "7.4" else {**FULL_ACL, "/vms": vms},
    )
    b = backend(pve, pve_env, token="lab@pve!v=v-secret")
    b.check()
    b.check_images([IMAGE])
    vm = b.clone(IMAGE, spec())
    b.start(vm)
    assert b.wait_ready(vm, timeout=10) == "10.0.0.5"
    b.destroy(vm)


# --- the MAC is the lab's -------------------------------------------------------------------------


def test_each_clone_gets_its_own_locally_administered_mac(pve, pve_env):
    b = backend(pve, pve_env)
    vms = [b.clone(IMAGE, spec(f"lab-r1-c{i}", cell=f"c{i}")) for i in (1, 2)]
    macs = [vm.handle["mac"] for vm in vms]
    assert macs == [mac_for("r1", "c1").lower(), mac_for("r1", "c2").lower()] and len(set(macs)) == 2
    for vm, mac in zip(vms, macs):
        first = int(mac.split(":")[0], 16)
        assert first & 0b10 and not first & 0b01  # locally administered, unicast
        assert pve.vm(vm.handle["vmid"]).config["net0"] == f"virtio={mac.upper()},bridge=vmbr0"
        assert vm.facts["mac"] == mac
    # address discovery never reads it back: no config GET after the one before the config PUT
    vmid = vms[0].handle["vmid"]
    calls = [(m, path) for m, path, p in pve.requests if path == f"/nodes/pve1/qemu/{vmid}/config"]
    assert calls[-1] == ("PUT", f"/nodes/pve1/qemu/{vmid}/config")
    assert mac_for("r1", "c1") == mac_for("r1", "c1") != mac_for("r2", "c1")
    for vm in vms:
        b.destroy(vm)
