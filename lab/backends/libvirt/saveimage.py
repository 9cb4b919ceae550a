"""libvirt's QEMU save image (what virDomainSave writes), and a warm clone's copy of it. Pure.

The file is a fixed header, a data section (the domain XML, NUL, a migration cookie, zero
padding) and QEMU's migration stream::

    "LibvirtQemudSave" | version, data_len, was_running, compressed, cookie_offset, unused[14]
    | data_len bytes: XML \\0 COOKIE \\0 zeros | migration stream ...

(src/qemu/qemu_saveimage.c: an on-disk format libvirt keeps stable; version 2 since libvirt 1.3.)
A warm clone is restored from a copy whose XML names the clone: its name, UUID and VM generation
ID must differ from the snapshot's, which virDomainRestoreFlags's own XML override refuses ("Target
domain uuid ... does not match source": its ABI check). libvirt's saveImageDefineXML rewrites the
same section the same way; here it is done without that check, into the clone's own copy."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from xml.etree import ElementTree as ET

MAGIC = b"LibvirtQemudSave"
VERSION = 2
HEADER = struct.Struct("<16s19I")  # magic, version, data_len, was_running, compressed, cookie_offset, unused[14]


@dataclass(frozen=True)
class SaveHeader:
    version: int
    data_len: int
    was_running: int
    compressed: int
    xml: str
    cookie: str
    unused: tuple[int, ...] = (0,) * 14

    @property
    def size(self) -> int:
        """Bytes before the migration stream."""
        return HEADER.size + self.data_len

    def as_dict(self) -> dict:
        return {
            "version": self.version,
            "data_len": self.data_len,
            "was_running": self.was_running,
            "compressed": self.compressed,
            "xml": self.xml,
            "cookie": self.cookie,
            "unused": list(self.unused),
        }

    @classmethod
    def from_dict(cls, d: dict) -> SaveHeader:
        return cls(
            version=int(d["version"]),
            data_len=int(d["data_len"]),
            was_running=int(d["was_running"]),
            compressed=int(d["compressed"]),
            xml=str(d["xml"]),
            cookie=str(d["cookie"]),
            unused=tuple(int(u) for u in d["unused"]),
        )


def data_length(head: bytes) -> int:
    """From the fixed header alone: how many bytes the data section holds (ValueError: not a save image)."""
    if len(head) < HEADER.size:
        raise ValueError(f"a save image starts with {HEADER.size} header bytes, got {len(head)}")
    magic, version, data_len, *_ = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise ValueError("not a libvirt QEMU save image (bad magic)")
    if version != VERSION:
        raise ValueError(f"save image version {version}; lab reads version {VERSION}")
    return data_len


def parse(blob: bytes) -> SaveHeader:
    """The header and data section of a save image (at least SaveHeader.size bytes of it)."""
    data_len = data_length(blob)
    _, version, _, was_running, compressed, cookie_offset, *unused = HEADER.unpack_from(blob)
    data = blob[HEADER.size : HEADER.size + data_len]
    if len(data) < data_len:
        raise ValueError(f"save image data section cut short ({len(data)} of {data_len} bytes)")
    if not 0 < cookie_offset <= data_len:
        raise ValueError(f"save image cookie offset {cookie_offset} outside its data ({data_len} bytes)")
    xml = data[:cookie_offset].split(b"\0", 1)[0].decode()
    cookie = data[cookie_offset:].split(b"\0", 1)[0].decode()
    return SaveHeader(
        version=version,
        data_len=data_len,
        was_running=was_running,
        compressed=compressed,
        xml=xml,
        cookie=cookie,
        unused=tuple(unused),
    )


def with_xml(header: SaveHeader, xml: str) -> bytes:
    """The header and data section of a copy whose domain XML is `xml`: the same length as the
    original's, so the migration stream after it is copied unchanged."""
    text = xml.encode() + b"\0"
    data = text + header.cookie.encode() + b"\0"
    if len(data) > header.data_len:
        raise ValueError(
            f"the clone's domain XML ({len(text)} bytes) does not fit the save image's "
            f"data section ({header.data_len} bytes)"
        )
    data += b"\0" * (header.data_len - len(data))
    head = HEADER.pack(
        MAGIC, header.version, header.data_len, header.was_running, header.compressed, len(text), *header.unused
    )
    return head + data


# -- the clone's domain XML ------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """What makes a restored domain this clone and not the snapshot it came from."""

    name: str
    uuid: str
    genid: str  # a new VM generation ID: the guest kernel reseeds its RNG when it changes
    lease: dict[str, str]  # the lab lease's attributes (domain.LEASE_NS)
    disk_path: str
    disk_format: str
    console: str  # the serial console's log file
    mac: str


def clone_xml(template: str, ident: Identity, lease_ns: str) -> str:
    """The snapshot's domain XML (as its save image holds it) with the clone's identity; every
    device, address and model stays as saved (the migration stream describes exactly those), and
    so does the kernel command line (the restored kernel booted with the snapshot's)."""
    ET.register_namespace("lab", lease_ns)
    root = ET.fromstring(template)
    _set_text(root, "name", ident.name)
    _set_text(root, "uuid", ident.uuid)
    _set_text(root, "genid", ident.genid)
    lease = root.find(f"metadata/{{{lease_ns}}}lease")
    if lease is None:
        raise ValueError("the snapshot's domain carries no lab lease")
    lease.attrib.clear()
    lease.attrib.update(ident.lease)
    disks = [d for d in root.findall("devices/disk") if d.get("device", "disk") == "disk"]
    nics = root.findall("devices/interface")
    if len(disks) != 1 or len(nics) != 1:
        raise ValueError(f"a warm snapshot has one disk and one NIC, this one {len(disks)} and {len(nics)}")
    _one(disks[0], "source").set("file", ident.disk_path)
    _one(disks[0], "driver").set("type", ident.disk_format)
    _one(nics[0], "mac").set("address", ident.mac)
    for log in _logs(root.findall("devices/serial") + root.findall("devices/console")):
        log.set("file", ident.console)
    return ET.tostring(root, encoding="unicode")


def _set_text(root: ET.Element, tag: str, text: str) -> None:
    _one(root, tag).text = text


def _one(parent: ET.Element, tag: str) -> ET.Element:
    el = parent.find(tag)
    if el is None:
        raise ValueError(f"the snapshot's domain XML has no <{tag}> under <{parent.tag}>")
    return el


def _logs(chardevs: Iterable[ET.Element]) -> list[ET.Element]:
    return [log for c in chardevs if (log := c.find("log")) is not None]
