"""The vagrant backend, its boxes and `lab reproduce` without a VM: settings and capabilities,
the parsers of vagrant's and virsh's output (captured from Vagrant 2.3.4 / vagrant-libvirt 0.11.2),
the Vagrantfile (Ruby-checked when ruby is here), the box's identity, the lease marker, the run's
network, the Packer template's box post-processors, and a reproduction of a stored cell."""

from __future__ import annotations

import ipaddress
import json
import random
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from fakes.vagrant import FakeVagrant, FakeVirsh
from pydantic import ValidationError

import lab
from lab import backends, proc, reproduce
from lab.backends.base import check_spec
from lab.backends.vagrant import backend as vb, box, lease as vlease
from lab.backends.vagrant.settings import Settings
from lab.backends.vagrant.tools import (
    machine_readable,
    parse_box_list,
    parse_domifaddr,
    parse_global_status,
    parse_plugins,
    parse_vol_list,
)
from lab.backends.vagrant.vagrantfile import DISK, Machine, Network, Provisioner, render, ruby_string
from lab.errors import SettingError, UsageError
from lab.model import CloneKind, DiskBus, ImageRef, NicModel, RawOutput, VmSpec
from lab.store import Store

RUBY = shutil.which("ruby")


def ruby_ok(text: str, tmp_path: Path) -> None:
    """`ruby -c`: the file parses as Ruby (Vagrant's own language), when ruby is installed."""
    if RUBY is None:
        return
    path = tmp_path / "Vagrantfile.rb"
    path.write_text(text)
    res = subprocess.run([RUBY, "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


# -- settings and capabilities ------------------------------------------------------------------------


def test_registry_and_defaults():
    assert "vagrant" in backends.names()
    s = backends.settings_model("vagrant")(backend="vagrant")
    assert (s.provider, s.uri, s.driver, s.storage_pool) == ("libvirt", "qemu:///system", "qemu", "default")
    assert backends.backend_class("vagrant") is vb.VagrantBackend


@pytest.mark.parametrize(
    "key,value",
    [
        ("provider", "virtualbox"),
        ("uri", "bhyve:///system"),
        ("workdir", "relative/dir"),
        ("workdir", "/tmp/a&b"),
        ("subnets", "10.0.0.0/25"),
        ("subnets", "nonsense"),
        ("storage_pool", "a pool"),
        ("driver", "xen"),
        ("colour", "blue"),
    ],
)
def test_settings_refuse(key, value):
    with pytest.raises(ValidationError):
        Settings(backend="vagrant", **{key: value})


def test_capabilities_refuse_what_vagrant_libvirt_cannot_make():
    caps = backends.capabilities(Settings(backend="vagrant"))
    image = ImageRef("debian12", "debian", Path("/x"), "d" * 64, "e" * 64)
    spec = VmSpec("lab-abcd1234-c01", "abcd1234", "c01", image, NicModel.E1000, 2, 1024)
    for nic in NicModel:
        check_spec(caps, replace(spec, nic=nic), "h")
    with pytest.raises(SettingError, match="disk_bus = 'nvme'"):
        check_spec(caps, replace(spec, disk_bus=DiskBus.NVME), "h")
    with pytest.raises(SettingError, match="clone = 'full'"):
        check_spec(caps, replace(spec, clone=CloneKind.FULL), "h")
    assert caps.boot_modes == {"bios"} and not caps.bare_metal and not caps.lab_side_link


# -- parsers ----------------------------------------------------------------------------------------------

BOX_LIST = """\
1795607318,,ui,info,lab/debian12 (libvirt%!(VAGRANT_COMMA) 1.0.0-fd70d00224f0.1b7af7848411)
1795607318,,box-name,lab/debian12
1795607318,,box-provider,libvirt
1795607318,,box-version,1.0.0-fd70d00224f0.1b7af7848411
1795607318,,ui,info,generic/debian12 (libvirt%!(VAGRANT_COMMA) 4.3.12)
1795607318,,box-name,generic/debian12
1795607318,,box-provider,libvirt
1795607318,,box-version,4.3.12
"""

GLOBAL_STATUS = """\
1795607517,,metadata,machine-count,2
1795607517,lab-abcd1234-c01,machine-id,4f1c2ab
1795607517,lab-abcd1234-c01,provider-name,libvirt
1795607517,lab-abcd1234-c01,machine-home,/var/tmp/lab/vagrant/abcd1234/lab-abcd1234-c01
1795607517,lab-abcd1234-c01,state,running
1795607517,default,machine-id,9e0d1f3
1795607517,default,provider-name,libvirt
1795607517,default,machine-home,/home/u/my%!(VAGRANT_COMMA)project
1795607517,default,state,shutoff
1795607517,,ui,info,id{PAD}
""".format(PAD=" " * 7)  # vagrant pads its table header: kept, as it prints it

PLUGINS = """\
1795607516,,ui,info,vagrant-libvirt (0.11.2%!(VAGRANT_COMMA) system)
1795607516,,plugin-name,vagrant-libvirt
1795607516,vagrant-libvirt,plugin-version,0.11.2%!(VAGRANT_COMMA) system
"""


def test_machine_readable_unescapes():
    rows = machine_readable("17,t,ui,info,a%!(VAGRANT_COMMA) b\\nc\nnot a row\n")
    assert rows == [["t", "ui", "info", "a, b\nc"]]


def test_box_list_global_status_plugins():
    assert parse_box_list(BOX_LIST) == [
        ("lab/debian12", "libvirt", "1.0.0-fd70d00224f0.1b7af7848411"),
        ("generic/debian12", "libvirt", "4.3.12"),
    ]
    entries = parse_global_status(GLOBAL_STATUS)
    assert [(e.id, e.name, e.provider, e.state, e.directory) for e in entries] == [
        ("4f1c2ab", "lab-abcd1234-c01", "libvirt", "running", "/var/tmp/lab/vagrant/abcd1234/lab-abcd1234-c01"),
        ("9e0d1f3", "default", "libvirt", "shutoff", "/home/u/my,project"),
    ]
    assert parse_plugins(PLUGINS) == {"vagrant-libvirt": "0.11.2"}


def test_virsh_parsers():
    text = (
        " Name       MAC address          Protocol     Address\n"
        "-------------------------------------------------------------------------------\n"
        " vnet3      52:54:00:6a:0e:1b    ipv4         10.79.12.57/24\n"
    )
    assert parse_domifaddr(text) == "10.79.12.57"
    assert parse_domifaddr(" Name MAC address Protocol Address\n----\n") == ""
    vols = (
        " Name                       Path\n------------------------------------\n"
        " lab-abcd1234-c01.img       /var/lib/libvirt/images/lab-abcd1234-c01.img\n"
        " lab-VAGRANTSLASH-debian12_vagrant_box_image_1.0.0-a.b_box.img   /p/x.img\n"
    )
    assert parse_vol_list(vols) == [
        ("lab-abcd1234-c01.img", "/var/lib/libvirt/images/lab-abcd1234-c01.img"),
        ("lab-VAGRANTSLASH-debian12_vagrant_box_image_1.0.0-a.b_box.img", "/p/x.img"),
    ]


# -- lease marker, network, volumes ---------------------------------------------------------------------


def test_lease_marker_round_trip_and_strangers():
    text = vb.lease_text("abcd1234", "c01-aa", 1795607517.9, "vg")
    assert vb.parse_lease(text) == {"run": "abcd1234", "cell": "c01-aa", "expires": "1795607517", "host": "vg"}
    for foreign in (
        None,
        "",
        "Source: /home/u/Vagrantfile",
        "lab reproduce abcd1234 c01",
        "lab-lease run=abcd1234 cell=c01",
    ):
        assert vb.parse_lease(foreign) is None
    # written raw into the domain XML by vagrant-libvirt: nothing to escape
    assert not set(text) & set("<>&'\"")
    assert vb._VOLUME_RE.match("lab-abcd1234-c01.img")
    assert not vb._VOLUME_RE.match("lab-VAGRANTSLASH-debian12_vagrant_box_image_1.0.0-a.b_box.img")
    assert not vb._VOLUME_RE.match("repro-abcd1234-c01.img")
    m = vb._VOLUME_RE.match("lab-kill-1a2b3c-c02-aa.img")
    assert (m["run"], m["cell"]) == ("kill-1a2b3c", "c02-aa")
    assert vb.parse_lease(vb.lease_text("kill-1a2b3c", "c02", 5, "vg"))["run"] == "kill-1a2b3c"


def test_network_is_isolated_with_dhcp():
    xml = vb.network_xml("labvg-abcd1234", ipaddress.IPv4Network("10.79.12.0/24"))
    assert "<forward" not in xml
    bridge = re.search(r"<bridge name='(\w+)'", xml).group(1)
    assert bridge.startswith("labvg") and len(bridge) <= 15
    assert bridge != re.search(
        r"<bridge name='(\w+)'", vb.network_xml("labvg-abcd1235", ipaddress.IPv4Network("10.79.12.0/24"))
    ).group(1)
    assert "<ip address='10.79.12.1' netmask='255.255.255.0'>" in xml
    assert "<range start='10.79.12.10' end='10.79.12.254'/>" in xml


def test_free_subnet_avoids_used_networks():
    used = [ipaddress.IPv4Network(f"10.79.{n}.0/24") for n in range(255)]
    assert vb.free_subnet("10.79.0.0/16", used, random.Random(1)) == ipaddress.IPv4Network("10.79.255.0/24")
    assert vb.free_subnet("10.79.0.0/24", [], random.Random(1)) == ipaddress.IPv4Network("10.79.0.0/24")
    with pytest.raises(UsageError, match="no free /24"):
        vb.free_subnet("10.79.0.0/24", [ipaddress.IPv4Network("10.0.0.0/8")], random.Random(1))


# -- the Vagrantfile ------------------------------------------------------------------------------------------


def machine(**kw) -> Machine:
    base = dict(
        name="lab-abcd1234-c01",
        image="debian12",
        box="lab/debian12",
        box_version="1.0.0-aaaa.bbbb",
        cpus=2,
        memory_mib=1024,
        nic=NicModel.E1000,
        disk_bus=DiskBus.VIRTIO,
        ssh_key=Path("/k/lab_key"),
        purpose="test",
    )
    return Machine(**{**base, **kw})


def test_ruby_strings_cannot_interpolate():
    assert ruby_string('a"b\\c#{x}\n') == '"a\\"b\\\\c\\#{x}\\n"'


@pytest.mark.parametrize("bus", list(DISK))
def test_vagrantfile_carries_the_cell(bus, tmp_path):
    text = render(
        machine(
            disk_bus=bus,
            network=Network("labvg-abcd1234", "10.79.12.0/24"),
            description=vb.lease_text("abcd1234", "c01", 1, "vg"),
            console_log=Path("/w/console.log"),
            uri="qemu:///system",
            storage_pool="lab",
        )
    )
    ruby_ok(text, tmp_path)
    want_bus, device, controller = DISK[bus]
    for line in [
        'config.vm.define "lab-abcd1234-c01"',
        'machine.vm.box = "lab/debian12"',
        'machine.vm.box_version = "1.0.0-aaaa.bbbb"',
        "libvirt.cpus = 2",
        "libvirt.memory = 1024",
        'libvirt.nic_model_type = "e1000"',
        f'libvirt.disk_bus = "{want_bus}"',
        f'libvirt.disk_device = "{device}"',
        'libvirt.default_prefix = ""',
        'libvirt.driver = "qemu"',
        "libvirt.cpu_mode = nil",
        'libvirt.management_network_name = "labvg-abcd1234"',
        'libvirt.management_network_address = "10.79.12.0/24"',
        'libvirt.management_network_mode = "none"',
        'libvirt.description = "lab-lease run=abcd1234 cell=c01 expires=1 host=vg"',
        'libvirt.storage_pool_name = "lab"',
        'libvirt.uri = "qemu:///system"',
        ':source => { :path => "/w/console.log" }',
        'machine.ssh.username = "root"',
        'machine.ssh.private_key_path = "/k/lab_key"',
        "machine.ssh.insert_key = false",
        'synced_folder ".", "/vagrant", disabled: true',
    ]:
        assert line in text, line
    assert ("disk_controller_model" in text) == (controller is not None)
    assert "provision" not in text


def test_vagrantfile_kvm_keeps_the_cpu_default_and_lists_provisioners(tmp_path):
    text = render(
        machine(
            driver="kvm",
            provisioners=(
                Provisioner("tune", "tune.sh", "once", "tune"),
                Provisioner("workloads", "workloads.sh", "never", "w"),
            ),
        )
    )
    ruby_ok(text, tmp_path)
    assert "cpu_mode" not in text and 'libvirt.driver = "kvm"' in text
    assert 'machine.vm.provision "tune", type: "shell", path: "tune.sh",\n      run: "once"' in text
    assert 'machine.vm.provision "workloads", type: "shell", path: "workloads.sh",\n      run: "never"' in text
    assert "management_network" not in text and "libvirt.uri" not in text


# -- boxes ------------------------------------------------------------------------------------------------------


def test_box_version_is_a_release_vagrant_accepts(tmp_path):
    v = box.box_version("fd70d00224f0e632900f4d6b87d12de3", "1b7af784841125887e688254229e2828")
    assert v == "1.0.0-fd70d00224f0.1b7af7848411"
    if RUBY is not None:  # Vagrant parses versions with RubyGems; ">= 0" is its default constraint
        res = subprocess.run(
            [
                RUBY,
                "-e",
                f'v = Gem::Version.new("{v}"); '
                'exit(Gem::Requirement.new(">= 0").satisfied_by?(v) && '
                f'Gem::Requirement.new("{v}").satisfied_by?(v) ? 0 : 1)',
            ],
            timeout=60,
        )
        assert res.returncode == 0


def image_with_box(tmp_path: Path, *, digest="d" * 64, sha="e" * 64, info: dict | None = None) -> ImageRef:
    disk = tmp_path / "debian12.qcow2"
    disk.write_bytes(b"qcow2")
    (tmp_path / "debian12.box").write_bytes(b"box")
    info = info if info is not None else {"name": "debian12", "recipe_digest": digest, "sha256": sha}
    (tmp_path / "debian12.box.json").write_text(json.dumps(info))
    return ImageRef("debian12", "debian", disk, digest, sha)


def test_base_volume_is_named_as_vagrant_libvirt_names_it():
    assert (
        box.base_volume("lab/debian12", "1.0.0-aaaa.bbbb")
        == "lab-VAGRANTSLASH-debian12_vagrant_box_image_1.0.0-aaaa.bbbb_box.img"
    )
    assert not vb._VOLUME_RE.match(box.base_volume("lab/debian12", "1.0.0-aaaa.bbbb"))


def test_built_box_belongs_to_one_build(tmp_path):
    image = image_with_box(tmp_path)
    b = box.built_box(image)
    assert (b.name, b.version, b.path) == (
        "lab/debian12",
        box.box_version("d" * 64, "e" * 64),
        tmp_path / "debian12.box",
    )
    with pytest.raises(UsageError, match="another build") as err:
        box.built_box(replace(image, sha256="f" * 64))
    assert "lab images build debian12 --force" in (err.value.hint or "")
    with pytest.raises(UsageError, match="another build"):
        box.built_box(replace(image, digest="f" * 64))
    # a box whose build was not given the digest still belongs to the build its disk names
    (tmp_path / "debian12.box.json").write_text(
        json.dumps({"name": "debian12", "recipe_digest": "", "sha256": "e" * 64})
    )
    assert box.built_box(image).version == b.version
    (tmp_path / "debian12.box").unlink()
    with pytest.raises(UsageError, match="has no Vagrant box"):
        box.built_box(image)


def test_catalog(tmp_path):
    b = box.built_box(image_with_box(tmp_path))
    cat = box.catalog(b, "c" * 64)
    assert cat["name"] == "lab/debian12"
    [version] = cat["versions"]
    assert version["version"] == b.version and "d" * 64 in version["description"] and "e" * 64 in version["description"]
    assert version["providers"] == [
        {
            "name": "libvirt",
            "url": (tmp_path / "debian12.box").as_uri(),
            "checksum_type": "sha256",
            "checksum": "c" * 64,
        }
    ]


# -- the Packer template ------------------------------------------------------------------------------------------


def test_debian12_template_makes_the_box_from_the_qemu_source_only():
    text = (lab.PACKER_DIR / "debian12.pkr.hcl").read_text()
    pp = text[text.index("post-processors {") :]
    for needed in (
        'post-processor "shell-local"',
        'post-processor "vagrant"',
        "keep_input_artifact            = true",
        'only                           = ["qemu.debian12"]',
        "vagrantfile_template_generated = true",
        '"DIGEST=${var.recipe_digest}"',
        "sha256sum",
        ".box.json",
    ):
        assert needed in pp, needed
    # what `lab images build` passes for the box (lab/images/debian.py), and where the box goes
    for var in ("image_name", "recipe_digest", "box_dir"):
        assert f'variable "{var}"' in text
    assert '"${path.root}/../images"' in text  # box_dir unset: beside the image, where box.paths() looks


def test_plugins_file_declares_the_vagrant_post_processor():
    text = (lab.PACKER_DIR / "plugins.pkr.hcl").read_text()
    assert "required_plugins" in text and 'source  = "github.com/hashicorp/vagrant"' in text
    if shutil.which("packer"):  # HCL syntax (Packer 1.6.6 cannot load required_plugins, but fmt parses it)
        assert proc.run(
            ["packer", "fmt", "-check", str(lab.PACKER_DIR / "plugins.pkr.hcl")], check=False, timeout=60
        ).ok


# -- lab reproduce ------------------------------------------------------------------------------------------------

AXES = {
    "host": "vg",
    "image": "debian12",
    "nic": "e1000",
    "vcpus": 2,
    "memory_mib": 1024,
    "disk_bus": "sata",
    "clone": "linked",
    "tuning": "wan-16m",
    "cc": "bbr",
    "offloads": "lro=off,tso=on",
    "wan": "rtt50",
}


@pytest.fixture
def stored(tmp_path) -> Store:
    s = Store(tmp_path / "results")
    s.create_run(
        "abcd1234",
        "t",
        config_path="lab.toml",
        config_text="[wan.rtt50]\ndelay_ms = 50\nloss_pct = 0.5\n",
        seed=1,
        lab_version="x",
        manifest={"images": {"debian12": {"digest": "d" * 64, "sha256": "e" * 64}}},
    )
    s.add_cell("abcd1234", "c01", 1, "e1000", AXES)
    s.cell_update(
        "abcd1234",
        "c01",
        status="done",
        facts={
            "accel": "tcg",
            "image_digest": "d" * 64,
            "image_sha256": "e" * 64,
            "tuning": {
                "effective": {"net.core.rmem_max": "16777216"},
                "offloads": {"asked": "lro=off,tso=on", "effective": {"lro": "off"}},
            },
        },
    )
    s.add_cell("abcd1234", "bm01", 2, "vg/bare-metal", {"host": "vg", "kind": "bare-metal"})
    s.add_raw("abcd1234", "c01", -1, RawOutput("sysbench-cpu", "sysbench cpu --threads=1 --time=1 run", "warm-up"))
    s.add_raw(
        "abcd1234",
        "c01",
        1,
        RawOutput("sysbench-cpu", "sysbench cpu --threads=1 run ; sysbench cpu --threads=2 run", ""),
    )
    s.add_raw("abcd1234", "c01", 2, RawOutput("sysbench-cpu", "sysbench cpu --threads=1 run", ""))
    s.add_raw("abcd1234", "c01", 1, RawOutput("http", "wrk -t 1 -c 10 -d 5s http://10.77.0.10/", ""))
    yield s
    s.close()


def test_reproduce_writes_the_cells_machine(stored, tmp_path):
    out = tmp_path / "repro"
    r = reproduce.reproduce(stored, "latest", "c01", out, ssh_key=Path("/k/lab_key"))
    text = r.vagrantfile.read_text()
    ruby_ok(text, tmp_path)
    for line in [
        'machine.vm.box_version = "1.0.0-dddddddddddd.eeeeeeeeeeee"',
        'libvirt.nic_model_type = "e1000"',
        "libvirt.cpus = 2",
        "libvirt.memory = 1024",
        'libvirt.disk_bus = "sata"',
        'libvirt.driver = "qemu"',
        'config.vm.define "repro-abcd1234-c01"',
        'path: "tune.sh",\n      run: "once"',
        'path: "workloads.sh",\n      run: "never"',
    ]:
        assert line in text, line
    assert "lab-lease" not in text  # a reproduction is the user's: `lab gc` never takes it
    tune = (out / "tune.sh").read_text()
    # lab.osfacts's own commands, as the tune stage runs them
    for line in [
        "sysctl -w net.core.rmem_max=16777216",
        "sysctl -w net.ipv4.tcp_rmem='4096 4194304 16777216'",
        "modprobe -q tcp_bbr 2>/dev/null; sysctl -q -w net.ipv4.tcp_congestion_control=bbr",
        "ethtool -K eth0 lro off",
        "ethtool -K eth0 tso on",
        "tc qdisc replace dev eth0 root netem limit 100000 delay 50ms loss 0.5%",
        "#   lab read: net.core.rmem_max = 16777216",
    ]:
        assert line in tune, line
    assert proc.run(["sh", "-n", str(out / "tune.sh")], check=False).ok
    work = (out / "workloads.sh").read_text()
    # repetition 1, not the warm-up; each stored command one quoted argument (the store is not trusted)
    assert "sh -c 'sysbench cpu --threads=1 run'\nsh -c 'sysbench cpu --threads=2 run'\n" in work
    assert "--time=1" not in work
    assert "# lab side: wrk -t 1 -c 10 -d 5s http://10.77.0.10/" in work
    assert proc.run(["sh", "-n", str(out / "workloads.sh")], check=False).ok
    with pytest.raises(UsageError, match="exists"):
        reproduce.reproduce(stored, "latest", "c01", out, ssh_key=Path("/k/lab_key"))


def test_reproduce_defaults_to_a_directory_named_after_the_cell(stored, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = reproduce.reproduce(stored, "abcd", "c01", ssh_key=Path("/k/lab_key"))
    assert r.dir == tmp_path / "reproduce-abcd1234-c01" and r.vagrantfile.is_file()


def test_reproduce_refuses_what_has_no_machine(stored, tmp_path):
    with pytest.raises(UsageError, match="ran on the host itself"):
        reproduce.reproduce(stored, "abcd", "bm01", tmp_path / "a", ssh_key=Path("/k"))
    with pytest.raises(UsageError, match="has no cell 'c09'.*c01, bm01"):
        reproduce.reproduce(stored, "abcd", "c09", tmp_path / "b", ssh_key=Path("/k"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_lab_reproduce_command(stored, tmp_path):
    """`lab reproduce RUN CELL --out DIR` writes it; a cell with no machine is one line, exit 2."""
    from click.testing import CliRunner

    from lab.cli import cli

    results = str(tmp_path / "results")
    out = tmp_path / "by-cli"
    res = CliRunner().invoke(
        cli,
        ["reproduce", "abcd", "c01", "--out", str(out), "--results", results, "--config", str(tmp_path / "none.toml")],
    )
    assert res.exit_code == 0, res.output
    assert 'libvirt.nic_model_type = "e1000"' in (out / "Vagrantfile").read_text()
    assert "lab images publish debian12 vagrant" in res.output
    res = CliRunner().invoke(
        cli,
        [
            "reproduce",
            "abcd",
            "bm01",
            "--out",
            str(tmp_path / "x"),
            "--results",
            results,
            "--config",
            str(tmp_path / "none.toml"),
        ],
    )
    assert res.exit_code == 2 and "ran on the host itself" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "x").exists()


# -- lab gc over fakes of vagrant and virsh -------------------------------------------------------------------


def test_gc_lists_only_what_carries_the_marker_and_removes_it(tmp_path, monkeypatch):
    (tmp_path / "locks").mkdir(mode=0o700)
    env = replace(backends.default_env(), state_dir=tmp_path / "locks")
    backend = vb.VagrantBackend("vg", Settings(backend="vagrant", workdir=str(tmp_path / "work")), env)
    mdir = tmp_path / "work" / "r1" / "lab-r1-c01"
    mdir.mkdir(parents=True)
    vlease.write_lease(mdir, {"run": "r1", "cell": "c01", "expires": 5.0, "domain": "lab-r1-c01"})
    (mdir / "Vagrantfile").write_text("")
    (tmp_path / "work" / "r1" / "network.xml").write_text("<network/>")
    (tmp_path / "locks" / "vagrant-vg@r1.lock").write_text("")  # its run died: nobody holds it
    backend.virsh = FakeVirsh(
        {
            "lab-r1-c01": vb.lease_text("r1", "c01", 5, "vg"),
            "lab-other": "Source: /home/u/Vagrantfile",
            "lab-r3-c02": "",
            "repro-r1-c01": "lab reproduce r1 c01",
        },
        [
            "lab-r1-c01.img",
            "lab-r2-c01.img",
            "lab-r3-c02.img",
            "repro-r1-c01.img",
            box.base_volume("lab/debian12", "1.0.0-a.b"),
        ],
        ["labvg-r1", "labvg-r9", "default", "labnet1234"],
    )
    backend.vagrant = FakeVagrant()
    items = {(o.kind, o.name, o.run_id) for o in backend.list_owned()}
    assert items == {
        ("vm", "lab-r1-c01", "r1"),
        ("disk", "lab-r2-c01.img", "r2"),
        ("network", "labvg-r9", "r9"),
        ("lock", "vagrant-vg@r1.lock", "r1"),
    }
    assert backend.run_is_live("r1") is False
    for item in sorted(backend.list_owned(), key=lambda o: {"vm": 0, "disk": 1, "network": 3, "lock": 4}[o.kind]):
        backend.remove_owned(item)
    assert backend.vagrant.calls == [(["destroy", "-f"], str(mdir))]
    assert backend.virsh.removed == [
        "domain lab-r1-c01",
        "volume lab-r1-c01.img",
        "network labvg-r1",
        "volume lab-r2-c01.img",
        "network labvg-r9",
    ]
    assert not (tmp_path / "work" / "r1").exists() and not list((tmp_path / "locks").iterdir())
    assert backend.list_owned() == []
    # the stranger's machines are still there
    assert set(backend.virsh.domains_) == {"lab-other", "lab-r3-c02", "repro-r1-c01"}
