"""Domain XML the libvirt backend generates.

bhyve: every combination of firmware (uefi, bhyveload) x NIC (virtio, e1000) x disk bus
(sata, virtio, nvme) x vCPUs (1, 2 = CPU topology) must
  1. validate against libvirt's RNG schema (the installed /usr/share/libvirt/schemas/domain.rng;
     the 9.0 schema predates bus='nvme' (libvirt 11.9), so NVMe cases use a temporary copy of
     the schema that adds only that one value), and
  2. have the shape libvirt's real bhyve driver accepts, compared element by element with the
     driver's own test inputs in ../shared/bhyve/xml2argv (base, net-e1000, macaddr, disk-virtio,
     uefi, cputopology, serial) — not byte equality.
QEMU: every NIC model x disk bus validates against the schema and carries the cell's values.
"""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

import lab
from lab import proc
from lab.backends.libvirt import drivers
from lab.backends.libvirt.backend import LibvirtBackend
from lab.backends.libvirt.domain import LEASE_NS, mac_for
from lab.backends.libvirt.settings import Settings, capabilities
from lab.errors import ConfigError, SettingError, UsageError
from lab.model import CloneKind, DiskBus, ImageRef, NicModel, VmSpec

XML2ARGV = Path(lab.PROJECT_ROOT).parent / "shared" / "bhyve" / "xml2argv"
SCHEMA_DIR = Path("/usr/share/libvirt/schemas")
UUID = "6f1c16e8-01c4-4429-87cd-e652e3edee5c"

# libvirt tests/bhyvexml2argvdata/bhyvexml2argv-nvme.xml (libvirt >= 11.9; not in ../shared):
# <disk type='file'><driver name='file' type='raw' .../><source file='/tmp/freebsd.img'/>
#   <target dev='nvme0n1' bus='nvme'/></disk>  ->  -s 2:0,nvme,/tmp/freebsd.img
NVME_REFERENCE = (
    "<disk type='file'><driver name='file' type='raw'/><source file='/tmp/freebsd.img'/>"
    "<target dev='nvme0n1' bus='nvme'/></disk>"
)

FIRMWARES = ["uefi", "bhyveload"]
NICS = [NicModel.VIRTIO, NicModel.E1000]
BUSES = [DiskBus.SATA, DiskBus.VIRTIO, DiskBus.NVME]
VCPUS = [1, 2]
COMBOS = list(itertools.product(FIRMWARES, NICS, BUSES, VCPUS))

needs_xmllint = pytest.mark.skipif(
    not shutil.which("xmllint") or not (SCHEMA_DIR / "domain.rng").exists(),
    reason="xmllint / libvirt schemas not installed (make setup)",
)


def ref(name: str) -> ET.Element:
    path = XML2ARGV / f"bhyvexml2argv-{name}.xml"
    if not path.exists():
        pytest.fail(f"{path} is missing: the bhyve driver test data lives in ../shared/bhyve/xml2argv")
    return ET.parse(path).getroot()


def image() -> ImageRef:
    return ImageRef(name="fbsd14", os="freebsd", path=Path("/nonexistent/fbsd14.raw"), digest="d1")


def host(name: str, **table) -> LibvirtBackend:
    """The backend of a `[hosts.NAME]` table, typed as lab.config hands it over."""
    return LibvirtBackend(name, Settings(backend="libvirt", **table))


def bhyve(firmware: str = "uefi", **extra) -> LibvirtBackend:
    return host(
        "bsd1",
        uri="bhyve+ssh://root@bsd1/system",
        dataset="zroot/lab",
        firmware=firmware,
        **{"bridge": "bridge0", **extra},
    )


def spec(nic=NicModel.VIRTIO, bus=DiskBus.VIRTIO, vcpus=2, **kw) -> VmSpec:
    base = dict(
        name="lab-r1-c1",
        run_id="r1",
        cell_id="c1",
        image=image(),
        nic=nic,
        vcpus=vcpus,
        memory_mib=1024,
        disk_bus=bus,
        expires_at=1_900_000_000.0,
    )
    base.update(kw)
    return VmSpec(**base)


@pytest.fixture(scope="module")
def nvme_schema(tmp_path_factory) -> Path:
    """A copy of the installed schema that also allows what libvirt 11.9 added for bhyve NVMe:
    bus='nvme' and target dev names nvmeXnY. Nothing else is changed."""
    d = tmp_path_factory.mktemp("rng")
    for f in SCHEMA_DIR.glob("*.rng"):
        shutil.copy(f, d / f.name)
    common = d / "domaincommon.rng"
    text = common.read_text()
    anchor = "<value>sata</value>\n            <value>sd</value>"
    if "<value>nvme</value>\n            <value>sata</value>" not in text:
        assert anchor in text, "unexpected domaincommon.rng layout"
        text = text.replace(anchor, "<value>nvme</value>\n            " + anchor, 1)
    pattern = '<param name="pattern">(ioemu:)?(fd|hd|sd|vd|xvd|ubd)[a-zA-Z0-9_]+</param>'
    if pattern in text:
        text = text.replace(pattern, pattern.replace("+</param>", "+|nvme[0-9]+n[0-9]+</param>"), 1)
    common.write_text(text)
    return d / "domain.rng"


def xmllint(xml: str, tmp_path: Path, schema: Path) -> proc.Result:
    f = tmp_path / "domain.xml"
    f.write_text(xml)
    return proc.run(["xmllint", "--noout", "--relaxng", str(schema), str(f)], timeout=60, check=False)


def paths(root: ET.Element) -> dict[str, set[str]]:
    """element path -> attribute names, for every element under root (metadata excluded)."""
    out: dict[str, set[str]] = {}

    def walk(el: ET.Element, prefix: str) -> None:
        for child in el:
            if child.tag == "metadata":
                continue
            p = f"{prefix}/{child.tag}"
            out.setdefault(p, set()).update(child.attrib)
            walk(child, p)

    walk(root, "domain")
    return out


# --------------------------------------------------------------------------------------------
# 1. schema


@needs_xmllint
@pytest.mark.parametrize("firmware,nic,bus,vcpus", COMBOS, ids=lambda v: getattr(v, "value", str(v)))
def test_bhyve_xml_validates_against_libvirt_schema(firmware, nic, bus, vcpus, tmp_path, nvme_schema):
    xml = bhyve(firmware).domain_xml(spec(nic, bus, vcpus), vm_uuid=UUID)
    if bus is DiskBus.NVME:
        plain = xmllint(xml, tmp_path, SCHEMA_DIR / "domain.rng")
        if plain.ok:  # a newer installed schema knows NVMe already
            return
        res = xmllint(xml, tmp_path, nvme_schema)
    else:
        res = xmllint(xml, tmp_path, SCHEMA_DIR / "domain.rng")
    assert res.ok, res.stderr


@needs_xmllint
def test_virt_xml_validate_accepts_a_bhyve_domain(tmp_path):
    if not shutil.which("virt-xml-validate"):
        pytest.skip("virt-xml-validate not installed")
    f = tmp_path / "d.xml"
    f.write_text(bhyve().domain_xml(spec(NicModel.E1000, DiskBus.SATA), vm_uuid=UUID))
    res = proc.run(["virt-xml-validate", str(f), "domain"], timeout=60, check=False)
    assert res.ok, res.stdout + res.stderr


def test_the_schema_check_catches_a_broken_domain(tmp_path):
    if not shutil.which("xmllint"):
        pytest.skip("xmllint missing")
    xml = bhyve().domain_xml(spec(), vm_uuid=UUID).replace("<type>hvm</type>", "<type>hvm</type><bogus/>")
    assert not xmllint(xml, tmp_path, SCHEMA_DIR / "domain.rng").ok


# --------------------------------------------------------------------------------------------
# 2. shape the real bhyve driver accepts (../shared/bhyve/xml2argv)


@pytest.fixture(scope="module")
def vocabulary() -> dict[str, set[str]]:
    """Every element path and attribute the driver's test inputs use."""
    vocab: dict[str, set[str]] = {}
    for f in sorted(XML2ARGV.glob("bhyvexml2argv-*.xml")):
        for p, attrs in paths(ET.parse(f).getroot()).items():
            vocab.setdefault(p, set()).update(attrs)
    assert vocab, f"no xml2argv inputs in {XML2ARGV}"
    return vocab


# Where we deliberately go beyond the test inputs (each backed by the driver source; see research):
# <boot order='1'/> on the root disk pins bhyveload's disk (gotcha G7; per-device boot order is
# parsed by the generic domain code and used by bhyveload); memory unit is not used (KiB as in data).
EXTRA_PATHS = {"domain/devices/disk/boot": {"order"}}


@pytest.mark.parametrize("firmware,nic,bus,vcpus", COMBOS, ids=lambda v: getattr(v, "value", str(v)))
def test_bhyve_xml_has_the_drivers_shape(firmware, nic, bus, vcpus, vocabulary):
    s = spec(nic, bus, vcpus)
    root = ET.fromstring(bhyve(firmware).domain_xml(s, vm_uuid=UUID))

    # only elements/attributes the real driver's inputs use (plus the documented extras)
    for p, attrs in paths(root).items():
        allowed = vocabulary.get(p, set()) | EXTRA_PATHS.get(p, set())
        assert p in vocabulary or p in EXTRA_PATHS, f"{p} never appears in the bhyve driver's test data"
        assert attrs <= allowed, f"{p}: attributes {attrs - allowed} unknown to the bhyve driver data"

    base = ref("base")
    assert root.get("type") == base.get("type") == "bhyve"
    assert root.findtext("name") == "lab-r1-c1"
    assert root.findtext("uuid") == UUID
    # memory in KiB without unit, as in the data: bhyve -m = ceil(KiB/1024) MiB
    assert root.find("memory").attrib == base.find("memory").attrib == {}
    assert int(root.findtext("memory")) == 1024 * 1024
    assert root.findtext("vcpu") == str(vcpus)

    # os: plain <type>hvm</type>; UEFI = read-only pflash loader like 'uefi'; bhyveload = like 'base'
    os_el = root.find("os")
    assert os_el.find("type").attrib == base.find("os/type").attrib == {}
    assert os_el.findtext("type") == "hvm"
    assert os_el.find("bootloader") is None and os_el.find("boot") is None
    if firmware == "uefi":
        want = ref("uefi").find("os/loader")
        got = os_el.find("loader")
        assert got is not None and got.attrib == want.attrib == {"readonly": "yes", "type": "pflash"}
        assert got.text == "/usr/local/share/uefi-firmware/BHYVE_UEFI.fd"
        assert root.find("os/nvram") is None  # no vars file: plain undefine works everywhere
        assert "firmware" not in os_el.attrib
    else:
        assert [c.tag for c in os_el] == [c.tag for c in base.find("os")] == ["type"]

    # CPU topology like 'cputopology' (product must equal vcpu), absent for one vCPU as in 'base'
    if vcpus > 1:
        want = ref("cputopology").find("cpu/topology")
        got = root.find("cpu/topology")
        assert got is not None and set(got.attrib) == set(want.attrib)
        assert int(got.get("sockets")) * int(got.get("cores")) * int(got.get("threads")) == vcpus
        assert [c.tag for c in root.find("cpu")] == [c.tag for c in ref("cputopology").find("cpu")]
    else:
        assert root.find("cpu") is None

    assert root.find("clock").get("offset") == "utc"  # -u, the driver default

    # exactly one disk: file + raw driver, target per bus as in base / disk-virtio / nvme
    disks = root.findall("devices/disk")
    assert len(disks) == 1
    disk = disks[0]
    want = {
        DiskBus.SATA: ref("base").find("devices/disk"),
        DiskBus.VIRTIO: ref("disk-virtio").find("devices/disk"),
        DiskBus.NVME: ET.fromstring(NVME_REFERENCE),
    }[bus]
    assert disk.get("type") == want.get("type") == "file"
    assert disk.get("device", "disk") == "disk"
    assert disk.find("driver").attrib == want.find("driver").attrib == {"name": "file", "type": "raw"}
    assert disk.find("target").attrib == want.find("target").attrib
    assert set(disk.find("source").attrib) == set(want.find("source").attrib) == {"file"}
    assert disk.find("source").get("file") == "/dev/zvol/zroot/lab/lab-r1-c1"
    assert disk.find("boot").attrib == {"order": "1"}

    # one bridged NIC: model always explicit (no default on bhyve), fixed MAC like 'macaddr'
    ifaces = root.findall("devices/interface")
    assert len(ifaces) == 1
    iface = ifaces[0]
    want = ref({NicModel.VIRTIO: "base", NicModel.E1000: "net-e1000"}[nic]).find("devices/interface")
    assert iface.get("type") == want.get("type") == "bridge"
    assert iface.find("model").attrib == want.find("model").attrib == {"type": nic.value}
    assert set(iface.find("source").attrib) == set(want.find("source").attrib) == {"bridge"}
    assert iface.find("source").get("bridge") == "bridge0"
    assert iface.find("mac").attrib.keys() == ref("macaddr").find("devices/interface/mac").attrib.keys()
    assert iface.find("mac").get("address") == mac_for("lab-r1-c1")

    # nmdm serial console like 'serial': master A / slave B of one nmdm pair
    serials = root.findall("devices/serial")
    assert len(serials) == 1
    want = ref("serial").find("devices/serial")
    assert serials[0].get("type") == want.get("type") == "nmdm"
    src = serials[0].find("source")
    assert set(src.attrib) == set(want.find("source").attrib) == {"master", "slave"}
    assert re.fullmatch(r"/dev/nmdm[0-9a-f]{8}A", src.get("master"))
    assert src.get("slave") == src.get("master")[:-1] + "B"

    # nothing bhyve lacks: graphics only with a video device and UEFI, no agent channel, no balloon
    for absent in ("graphics", "video", "channel", "memballoon", "controller"):
        assert root.find(f"devices/{absent}") is None, absent

    # the lease in <metadata>
    lease = root.find(f"metadata/{{{LEASE_NS}}}lease")
    assert lease is not None
    assert lease.attrib == {
        "run": "r1",
        "cell": "c1",
        "expires": "1900000000",
        "host": "bsd1",
        "ip": "",
        "disk": "zfs:zroot/lab/lab-r1-c1",
        "console": src.get("slave"),
    }


def test_bhyve_network_interface_and_loader_settings():
    b = bhyve(network="labnet", bridge=None, loader="/boot/BHYVE_UEFI_CSM.fd")
    root = ET.fromstring(b.domain_xml(spec(mac="58:9C:FC:00:00:01"), vm_uuid=UUID))
    iface = root.find("devices/interface")
    assert iface.get("type") == "network" and iface.find("source").attrib == {"network": "labnet"}
    assert iface.find("mac").get("address") == "58:9c:fc:00:00:01"
    assert root.findtext("os/loader") == "/boot/BHYVE_UEFI_CSM.fd"


def test_values_are_xml_escaped():
    b = host("h&1", uri="qemu:///system", dir="/tmp/a&b", bridge="br0")
    xml = b.domain_xml(
        spec(name="lab-x", image=ImageRef(name="debian12", os="debian", path=Path("/nonexistent/x.qcow2"), digest="d"))
    )
    root = ET.fromstring(xml)  # would raise on an unescaped '&'
    assert root.find("devices/disk/source").get("file") == "/tmp/a&b/lab-x.qcow2"


# --------------------------------------------------------------------------------------------
# QEMU

QEMU_NICS = list(NicModel)
QEMU_BUSES = [DiskBus.VIRTIO, DiskBus.SCSI, DiskBus.SATA, DiskBus.IDE]


def qemu(**extra) -> LibvirtBackend:
    return host("local", uri="qemu:///system", dir="/var/tmp/labdisks", bridge="labvbr0", **extra)


def debian(tmp_path: Path) -> ImageRef:
    (tmp_path / "debian12").mkdir(exist_ok=True)
    for f in ("vmlinuz", "initrd.img"):
        (tmp_path / "debian12" / f).write_bytes(b"")
    return ImageRef(
        name="debian12",
        os="debian",
        path=tmp_path / "debian12.qcow2",
        digest="d",
        manifest={
            "cmdline": "console=ttyS0 root=LABEL=labroot rw quiet",
            "boot": ["kernel", "bios", "uefi"],
            "paths": {"kernel": "debian12/vmlinuz", "initrd": "debian12/initrd.img"},
        },
    )


@needs_xmllint
@pytest.mark.parametrize("nic,bus", list(itertools.product(QEMU_NICS, QEMU_BUSES)), ids=lambda v: v.value)
def test_qemu_xml_validates_and_carries_the_cell(nic, bus, tmp_path):
    img = debian(tmp_path)
    b = qemu(gateway="10.78.5.1", bios="/usr/share/qemu/qboot.rom")
    s = spec(nic, bus, vcpus=2, image=img, ip="10.78.5.10", memory_mib=768)
    xml = b.domain_xml(s, vm_uuid=UUID)
    res = xmllint(xml, tmp_path, SCHEMA_DIR / "domain.rng")
    assert res.ok, res.stderr
    root = ET.fromstring(xml)
    assert root.get("type") == "qemu"  # TCG by default
    assert root.find("memory").attrib == {"unit": "MiB"} and root.findtext("memory") == "768"
    assert root.findtext("vcpu") == "2"
    assert root.find("cpu/topology").get("cores") == "2"
    assert root.findtext("os/kernel") == str(tmp_path / "debian12" / "vmlinuz")
    assert root.findtext("os/initrd") == str(tmp_path / "debian12" / "initrd.img")
    assert root.findtext("os/cmdline") == (
        "console=ttyS0 root=LABEL=labroot rw quiet lab.ip=10.78.5.10/24 lab.gw=10.78.5.1"
    )
    assert root.findtext("os/loader") == "/usr/share/qemu/qboot.rom"
    disk = root.find("devices/disk")
    assert disk.find("driver").attrib["type"] == "qcow2"
    assert disk.find("target").get("bus") == bus.value
    assert disk.find("boot") is None  # direct kernel boot
    assert (root.find("devices/controller[@type='scsi']") is not None) == (bus is DiskBus.SCSI)
    iface = root.find("devices/interface")
    assert iface.get("type") == "bridge" and iface.find("source").get("bridge") == "labvbr0"
    assert iface.find("model").get("type") == nic.value
    log = root.find("devices/serial/log")
    assert log.get("file") == "/var/tmp/labdisks/lab-r1-c1.console.log"


@needs_xmllint
def test_qemu_disk_boot_kvm_user_network_agent(tmp_path):
    b = host(
        "k",
        uri="qemu:///system",
        dir="/var/tmp/labdisks",
        boot="disk",
        domain_type="kvm",
        guest_agent=True,
        disk_format="raw",
    )
    xml = b.domain_xml(spec(image=debian(tmp_path), clone=CloneKind.FULL), vm_uuid=UUID)
    assert xmllint(xml, tmp_path, SCHEMA_DIR / "domain.rng").ok
    root = ET.fromstring(xml)
    assert root.get("type") == "kvm" and root.find("cpu").get("mode") == "host-passthrough"
    assert root.find("os/kernel") is None
    assert root.find("devices/disk/boot").attrib == {"order": "1"}
    assert root.find("devices/disk/driver").get("type") == "raw"
    assert root.find("devices/interface").get("type") == "user"
    assert root.find("devices/channel/target").get("name") == "org.qemu.guest_agent.0"
    # a debian12 built before the bootloader (a bare filesystem, kernel boot only) is refused
    old = debian(tmp_path)
    old.manifest.pop("boot")
    with pytest.raises(UsageError, match=r"cannot boot by BIOS firmware \(SeaBIOS\) \(host 'k'"):
        b.domain_xml(spec(image=old, clone=CloneKind.FULL), vm_uuid=UUID)
    with pytest.raises(UsageError, match=r"cannot boot by UEFI firmware \(host 'b'"):
        host("b", uri="bhyve:///system", dataset="zroot/lab").domain_xml(spec(image=old), vm_uuid=UUID)


# --------------------------------------------------------------------------------------------
# capabilities: checked at plan time, UsageError naming the value


@pytest.mark.parametrize("nic", [NicModel.E1000E, NicModel.RTL8139, NicModel.VMXNET3])
def test_bhyve_rejects_nic_models_it_cannot_emulate(nic):
    with pytest.raises(SettingError, match=rf"nic = '{nic.value}': not available.*offers e1000, virtio") as exc:
        bhyve().validate_spec(spec(nic=nic))
    assert (exc.value.key, exc.value.value) == ("nic", nic.value)


@pytest.mark.parametrize("bus", [DiskBus.SCSI, DiskBus.IDE])
def test_bhyve_rejects_disk_buses(bus):
    with pytest.raises(SettingError, match=rf"disk_bus = '{bus.value}': not available") as exc:
        bhyve().validate_spec(spec(bus=bus))
    assert (exc.value.key, exc.value.value) == ("disk_bus", bus.value)


def test_qemu_rejects_nvme_on_this_libvirt():
    with pytest.raises(SettingError, match="disk_bus = 'nvme'"):
        qemu().validate_spec(spec(bus=DiskBus.NVME))


def test_bhyve_disk_format_and_agent_are_settings_errors():
    with pytest.raises(SettingError, match=r"hosts.bsd1.disk_format = 'qcow2': .*reads only raw"):
        bhyve(disk_format="qcow2")
    with pytest.raises(SettingError, match=r"hosts.bsd1.guest_agent = True"):
        bhyve(guest_agent=True)
    with pytest.raises(SettingError, match=r"hosts.b.dataset = \(missing\)"):
        host("b", uri="bhyve+ssh://root@b/system")
    from lab import config

    # at plan time, through plan_check: the lab.toml, the host's key and the value
    bsd = {"backend": "libvirt", "uri": "bhyve+ssh://root@b/system", "dataset": "zroot/lab"}
    for key, value, problem in (
        ("disk_format", "qcow2", "the bhyve driver reads only raw disks"),
        ("guest_agent", True, "bhyve has no qemu-guest-agent"),
        ("dataset", None, "a bhyve host needs the ZFS dataset"),
    ):
        table = {k: v for k, v in {**bsd, key: value}.items() if v is not None}
        with pytest.raises(ConfigError) as exc:
            config.parse({"hosts": {"b": table}})
        assert (exc.value.path, exc.value.key, exc.value.value) == ("lab.toml", f"hosts.b.{key}", value)
        assert exc.value.problem.startswith(problem)
    config.parse({"hosts": {"b": bsd}})
    # the typed settings refuse what no libvirt host takes, naming key and value
    with pytest.raises(UsageError, match=r"hosts.b.firmware = 'grub': Input should be 'uefi' or 'bhyveload'"):
        config.parse({"hosts": {"b": {"backend": "libvirt", "uri": "bhyve+ssh://root@b/system", "firmware": "grub"}}})
    with pytest.raises(UsageError, match=r"hosts.b.brige = 'x': unknown key"):
        config.parse({"hosts": {"b": {"backend": "libvirt", "uri": "qemu:///system", "brige": "x"}}})


@pytest.mark.parametrize(
    "feature", ["snapshots", "save-restore", "suspend", "hotplug", "memory-balloon", "migration", "direct-kernel-boot"]
)
def test_bhyve_lacks_features(feature):
    bsd = drivers.DRIVERS["bhyve"]
    assert not drivers.supports(bsd, feature, None)
    with pytest.raises(SettingError, match=rf"requires = '{feature}': not available on libvirt/bhyve"):
        drivers.require(bsd, feature, None, "bsd1")
    with pytest.raises(UsageError, match=feature):
        bhyve().validate_spec(spec(labels={"requires": feature}))
    drivers.require(drivers.DRIVERS["qemu"], feature, None, "local")  # QEMU has them all
    qemu().validate_spec(spec(labels={"requires": feature}))


def test_version_gated_bhyve_features():
    b = bhyve()
    b.connection.lib_version = 10_000_000  # libvirt 10.0 on the host (learnt by check())
    with pytest.raises(SettingError, match=r"disk_bus = 'nvme': needs libvirt >= 11.9.0.*10.0.0"):
        b.validate_spec(spec(bus=DiskBus.NVME))
    with pytest.raises(UsageError, match="interface-addresses.*12.3.0"):
        b.validate_spec(spec(labels={"requires": "interface-addresses"}))
    b.validate_spec(spec(bus=DiskBus.SATA, nic=NicModel.E1000))
    b.connection.lib_version = 3_001_000  # e1000 yes, UEFI (3.2) not yet
    with pytest.raises(SettingError, match=r"hosts.bsd1.firmware = 'uefi': needs libvirt >= 3.2.0"):
        b.validate_spec(spec(bus=DiskBus.SATA, nic=NicModel.E1000))
    b.connection.lib_version = 12_004_000
    b.validate_spec(spec(bus=DiskBus.NVME))
    b.validate_spec(spec(labels={"requires": "guest-agent"}))
    # at plan time the host's version is unknown: the gates wait for check()
    LibvirtBackend.plan_check("bsd1", bhyve().settings, [spec(bus=DiskBus.NVME)])


def test_linked_raw_clone_is_a_usage_error_on_qemu():
    with pytest.raises(UsageError, match="linked clone"):
        qemu(disk_format="raw").validate_spec(spec(clone=CloneKind.LINKED))
    qemu(disk_format="raw").validate_spec(spec(clone=CloneKind.FULL))


def test_capabilities_from_the_uri_alone():
    def caps(uri: str, **table):
        return capabilities(Settings(backend="libvirt", uri=uri, **table))

    bsd = caps("bhyve+ssh://root@h/system")
    assert bsd.nic_models == {NicModel.VIRTIO, NicModel.E1000}
    assert bsd.disk_buses == {DiskBus.SATA, DiskBus.VIRTIO, DiskBus.NVME}
    assert (bsd.description, bsd.max_vcpus, bsd.snapshots) == ("libvirt/bhyve", 16, False)
    assert "snapshots" in bsd.missing
    assert caps("qemu:///system").nic_models == frozenset(NicModel)
    assert caps("test:///default", flavour="bhyve") == bsd and caps("test:///default").description == "libvirt/qemu"
    from lab import config

    with pytest.raises(ConfigError, match=r"hosts.x.uri = 'xen:///system': .*unsupported libvirt driver 'xen'"):
        config.parse({"hosts": {"x": {"backend": "libvirt", "uri": "xen:///system"}}})


# --------------------------------------------------------------------------------------------
# the generated bhyve XML is also accepted by libvirt's own parser (test driver, schema-validating
# define); this proves parseability, not that bhyve runs it (the test driver checks no driver rules)


@pytest.mark.parametrize(
    "firmware,nic,bus,vcpus", [c for c in COMBOS if c[2] is not DiskBus.NVME], ids=lambda v: getattr(v, "value", str(v))
)
def test_libvirt_parses_the_bhyve_xml(firmware, nic, bus, vcpus):
    libvirt = pytest.importorskip("libvirt")
    from lab.backends.libvirt.connection import libvirt_module

    libvirt_module()  # silences libvirt's stderr error printing
    conn = libvirt.open("test:///default")
    try:
        dom = conn.defineXMLFlags(bhyve(firmware).domain_xml(spec(nic, bus, vcpus)), libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
        try:
            back = ET.fromstring(dom.XMLDesc(0))
            assert back.get("type") == "bhyve"
            assert back.find("devices/interface/model").get("type") == nic.value
            assert back.find("devices/disk/target").get("bus") == bus.value
            assert back.find(f"metadata/{{{LEASE_NS}}}lease").get("run") == "r1"
        finally:
            dom.undefine()
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# bhyve command line: a small model of the driver's command builder, for the features lab uses,
# checked first against the driver's own xml -> args pairs, then applied to lab's XML

MODEL_PAIRS = [
    "base",
    "net-e1000",
    "macaddr",
    "disk-virtio",
    "addr-multiple-virtio-disks",
    "uefi",
    "cputopology",
    "serial",
    "console",
    "acpiapic",
    "localtime",
    "wired",
]
TEST_MOCK_MAC = "52:54:00:00:00:00"  # the driver test mock's "random" MAC


def bhyve_model(root: ET.Element) -> tuple[list[str], list[str] | None]:
    """(bhyve argv with PCI slots as N, bhyveload argv or None) for `root`."""
    name = root.findtext("name")
    mib = -(-int(root.findtext("memory")) // 1024)  # KiB (no unit attribute) -> MiB, rounded up
    vcpus = root.findtext("vcpu")
    topo = root.find("cpu/topology")
    argv = [
        "bhyve",
        "-c",
        f"cpus={vcpus},sockets={topo.get('sockets')},cores={topo.get('cores')},threads={topo.get('threads')}"
        if topo is not None
        else vcpus,
        "-m",
        str(mib),
    ]
    if root.find("memoryBacking/locked") is not None:
        argv.append("-S")
    if root.find("clock") is None or root.find("clock").get("offset", "utc") == "utc":
        argv.append("-u")
    argv += ["-H", "-P", "-s", "0:0,hostbridge"]
    loader = root.find("os/loader")
    serials = root.findall("devices/serial[@type='nmdm']") + root.findall("devices/console[@type='nmdm']")
    if loader is not None:
        argv += ["-l", f"bootrom,{loader.text},fwcfg=qemu"]
    if loader is not None or serials:
        argv += ["-s", "N:0,lpc"]
    disks = root.findall("devices/disk")
    sata = [d for d in disks if d.find("target").get("bus") == "sata"]
    if sata:
        argv += [
            "-s",
            "N:0,ahci,"
            + ",".join(("cd:" if d.get("device") == "cdrom" else "hd:") + d.find("source").get("file") for d in sata),
        ]
    for nic in root.findall("devices/interface"):
        model = {"virtio": "virtio-net", "e1000": "e1000"}[nic.find("model").get("type")]
        mac = nic.find("mac").get("address") if nic.find("mac") is not None else TEST_MOCK_MAC
        argv += ["-s", f"N:0,{model},faketapdev,mac={mac}"]
    for d in disks:
        bus = d.find("target").get("bus")
        if bus in ("virtio", "nvme"):
            argv += ["-s", f"N:0,{'virtio-blk' if bus == 'virtio' else 'nvme'},{d.find('source').get('file')}"]
    for i, s in enumerate(serials, 1):
        argv += ["-l", f"com{i},{s.find('source').get('master')}"]
    argv.append(name)
    loader_argv = None
    if loader is None and root.find("os/bootloader") is None:
        boot_dev = root.find("os/boot")
        usable = [
            d
            for d in disks
            if d.get("device", "disk")
            == ("cdrom" if boot_dev is not None and boot_dev.get("dev") == "cdrom" else "disk")
        ]
        ordered = [d for d in disks if d.find("boot") is not None]
        boot_disk = ordered[0] if ordered else usable[-1]  # no boot order: the last usable disk (G7)
        loader_argv = ["bhyveload", "-m", str(mib), "-d", boot_disk.find("source").get("file"), name]
    return argv, loader_argv


def read_args(path: Path) -> list[str]:
    tokens = path.read_text().replace("\\\n", " ").split()
    return [re.sub(r"^\d+:0,(?!hostbridge)", "N:0,", t) for t in tokens]  # slots vary, 0 is fixed


@pytest.mark.parametrize("name", MODEL_PAIRS + ["bhyveload-bootorder"])
def test_command_model_matches_the_drivers_test_data(name):
    root = ref(name)
    argv, loader = bhyve_model(root)
    assert argv == read_args(XML2ARGV / f"bhyvexml2argv-{name}.args")
    ld = XML2ARGV / f"bhyvexml2argv-{name}.ldargs"
    if ld.exists():
        assert loader == read_args(ld)


@pytest.mark.parametrize("firmware,nic,bus,vcpus", COMBOS, ids=lambda v: getattr(v, "value", str(v)))
def test_bhyve_command_for_lab_xml(firmware, nic, bus, vcpus):
    root = ET.fromstring(bhyve(firmware).domain_xml(spec(nic, bus, vcpus), vm_uuid=UUID))
    argv, loader = bhyve_model(root)
    zvol = "/dev/zvol/zroot/lab/lab-r1-c1"
    assert argv[:5] == ["bhyve", "-c", "cpus=2,sockets=1,cores=2,threads=1" if vcpus == 2 else "1", "-m", "1024"]
    assert "-u" in argv and "-A" not in argv
    disk_arg = {
        DiskBus.SATA: f"N:0,ahci,hd:{zvol}",
        DiskBus.VIRTIO: f"N:0,virtio-blk,{zvol}",
        DiskBus.NVME: f"N:0,nvme,{zvol}",
    }[bus]
    assert disk_arg in argv
    assert f"N:0,{'virtio-net' if nic is NicModel.VIRTIO else 'e1000'},faketapdev,mac={mac_for('lab-r1-c1')}" in argv
    assert argv[-3:] == ["-l", "com1,/dev/nmdm6f1c16e8A", "lab-r1-c1"]
    if firmware == "uefi":
        assert argv[argv.index("0:0,hostbridge") + 1 :][:4] == [
            "-l",
            "bootrom,/usr/local/share/uefi-firmware/BHYVE_UEFI.fd,fwcfg=qemu",
            "-s",
            "N:0,lpc",
        ]
        assert loader is None
    else:
        assert loader == ["bhyveload", "-m", "1024", "-d", zvol, "lab-r1-c1"]
