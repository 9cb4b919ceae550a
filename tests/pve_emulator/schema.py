"""Request validation driven by the official PVE API schema (apidata*.json in ../shared/pve).

The schema files are AGPL-3.0 data published by Proxmox; they are loaded at test time from
`<project root>/../shared/pve/` and never copied into this repository.

What is checked, in PVE's wording (pve-common PVE/JSONSchema.pm):
- routing by path template (`{param}` segments); an unknown path/method is the caller's 501
- `additionalProperties: 0`, missing non-optional parameters, `[n]` options with index limits
- types (integer, number, boolean: a top-level boolean accepts only `1`/`0`/`""`), minimum,
  maximum, maxLength, pattern, enum
- named formats: pve-vmid, pve-node, pve-storage-id, pve-configid(-list), dns-name, urlencoded,
  mac-addr, pve-bridge-id, pve-tag-list, pve-qm-ipconfig, pve-vm-cpu-conf, pve-poolid, disk-size
  (other named formats are accepted unchecked)
- property strings (object formats): `k=v,...`, `default_key`, `alias`, `keyAlias`
  (`virtio=MAC` sets model and macaddr), nested types/enums/formats; booleans inside property
  strings accept 1|on|yes|true / 0|off|no|false.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import lab

SCHEMA_DIR = Path(lab.PROJECT_ROOT).parent / "shared" / "pve"
SCHEMA_FILES = {"7.4": "apidata-7.4.json", "8.4": "apidata.json", "9.1": "apidata-9.1.json"}

# qemu-server limits for numbered options whose description does not state them
INDEX_LIMITS = {
    "net": 31,
    "ipconfig": 31,
    "ide": 3,
    "sata": 5,
    "scsi": 30,
    "virtio": 15,
    "unused": 255,
    "hostpci": 15,
    "numa": 7,
    "serial": 3,
    "usb": 14,
    "virtiofs": 9,
    "parallel": 2,
    "mp": 255,
}

TRUE_WORDS = {"1", "on", "yes", "true"}
FALSE_WORDS = {"0", "off", "no", "false"}


class FormatError(Exception):
    """A named format check failed; the message is PVE's (without the trailing newline)."""


@dataclass
class Route:
    path: str
    regex: re.Pattern
    names: list[str]
    literal_segments: int
    info: dict  # METHOD -> method schema


class Schema:
    def __init__(self, version: str):
        if version not in SCHEMA_FILES:
            raise ValueError(f"unknown PVE schema version {version!r}; have {sorted(SCHEMA_FILES)}")
        self.version = version
        self.routes: list[Route] = []
        for path, info in _load(version).items():
            names = re.findall(r"\{([^}]+)\}", path)
            pattern = re.sub(r"\\\{[^}]+\\\}", "([^/]+)", re.escape(path))
            literal = sum(1 for seg in path.split("/") if seg and not seg.startswith("{"))
            self.routes.append(Route(path, re.compile(f"^{pattern}$"), names, literal, info))
        self.routes.sort(key=lambda r: -r.literal_segments)

    def route(self, path: str) -> tuple[Route, dict[str, str]] | None:
        for r in self.routes:
            m = r.regex.match(path)
            if m:
                return r, dict(zip(r.names, m.groups()))
        return None

    def method(self, path_template: str, method: str) -> dict:
        for r in self.routes:
            if r.path == path_template:
                return r.info[method]
        raise KeyError(path_template)

    def param_schema(self, path_template: str, method: str, name: str) -> dict | None:
        props = self.method(path_template, method).get("parameters", {}).get("properties", {})
        return lookup_property(props, name)


@cache
def _load(version: str) -> dict[str, dict]:
    path = SCHEMA_DIR / SCHEMA_FILES[version]
    with open(path, encoding="utf-8") as fh:
        tree = json.load(fh)
    index: dict[str, dict] = {}

    def walk(nodes):
        for node in nodes:
            if node.get("info"):
                index[node["path"]] = node["info"]
            walk(node.get("children") or [])

    walk(tree)
    return index


def lookup_property(props: dict, name: str) -> dict | None:
    if name in props:
        return props[name]
    m = re.fullmatch(r"([a-z][a-z_-]*?)(\d+)", name)
    if m and f"{m.group(1)}[n]" in props:
        spec = props[f"{m.group(1)}[n]"]
        desc = spec.get("description", "")
        lim = re.search(r"n is 0 to (\d+)", desc)
        top = int(lim.group(1)) if lim else INDEX_LIMITS.get(m.group(1), 31)
        if int(m.group(2)) <= top and str(int(m.group(2))) == m.group(2):
            return spec
    return None


def validate(
    method_schema: dict,
    params: dict[str, str],
    *,
    strict_booleans: bool = True,
) -> tuple[dict[str, object], dict[str, str]]:
    """Check params (all strings, path params included) against a method schema.

    Returns (typed values, errors); errors maps parameter name to PVE's message."""
    pschema = method_schema.get("parameters") or {}
    props = pschema.get("properties") or {}
    errors: dict[str, str] = {}
    typed: dict[str, object] = {}
    for name, value in params.items():
        spec = lookup_property(props, name)
        if spec is None:
            if not pschema.get("additionalProperties", 0):
                errors[name] = "property is not defined in schema and the schema does not allow additional properties"
            else:
                typed[name] = value
            continue
        err, val = check_value(name, value, spec, strict_booleans=strict_booleans)
        if err:
            errors[name] = err
        else:
            typed[name] = val
    for name, spec in props.items():
        if name.endswith("[n]") or spec.get("optional"):
            continue
        if name not in params:
            errors[name] = "property is missing and it is not optional"
    for name, spec in props.items():
        req = spec.get("requires")
        if req and name in params and req not in params:
            errors[req] = f"parameter '{req}' is required when '{name}' is set"  # approximated
    return typed, errors


def check_value(
    name: str, value: object, spec: dict, *, strict_booleans: bool = True, in_property_string: bool = False
) -> tuple[str | None, object]:
    """One value against one schema. Returns (error message or None, typed value)."""
    typ = spec.get("type", "string")
    sval = value if isinstance(value, str) else str(value)
    if isinstance(value, list):  # repeated form fields: PVE >= 8 arrays, 7.x joins with \0
        if typ == "array":
            return None, value
        sval = "\0".join(value)
    if typ == "boolean":
        low = sval.lower()
        if in_property_string:
            if low in TRUE_WORDS:
                return None, 1
            if low in FALSE_WORDS:
                return None, 0
        elif sval in ("1",) or (not strict_booleans and low in TRUE_WORDS):
            return None, 1
        elif sval in ("0", "") or (not strict_booleans and low in FALSE_WORDS):
            return None, 0
        return f"type check ('boolean') failed - got '{sval}'", None
    if typ == "integer":
        if not re.fullmatch(r"[+-]?\d+", sval):
            return f"type check ('integer') failed - got '{sval}'", None
        val: object = int(sval)
    elif typ == "number":
        try:
            val = float(sval)
        except ValueError:
            return f"type check ('number') failed - got '{sval}'", None
    elif typ == "array":
        return None, [sval]
    else:
        val = sval
    if typ in ("integer", "number"):
        if "minimum" in spec and val < spec["minimum"]:
            return f"value must have a minimum value of {spec['minimum']}", None
        if "maximum" in spec and val > spec["maximum"]:
            return f"value must have a maximum value of {spec['maximum']}", None
    if typ == "string":
        if "maxLength" in spec and len(sval) > spec["maxLength"]:
            return f"value may only be {spec['maxLength']} characters long", None
        if "minLength" in spec and len(sval) < spec["minLength"]:
            return f"value must be at least {spec['minLength']} characters long", None
        pattern = spec.get("pattern")
        if pattern:
            py = re.sub(r"^\(\?\^\w*:(.*)\)$", r"\1", pattern)
            if not re.fullmatch(py, sval):
                return "value does not match the regex pattern", None
    if "enum" in spec and sval not in [str(e) for e in spec["enum"]]:
        return (
            f"value '{sval}' does not have a value in the enumeration '{', '.join(str(e) for e in spec['enum'])}'"
        ), None
    fmt = spec.get("format")
    if isinstance(fmt, str):
        try:
            check_format(fmt, sval)
        except FormatError as exc:
            return f"invalid format - {exc}\n", None
    elif isinstance(fmt, dict):
        errs, _parsed = parse_property_string(fmt, sval)
        if errs:
            body = "".join(f"{name}.{k}: {m}\n" for k, m in errs.items())
            return f"invalid format - format error\n{body}", None
    return None, val


def parse_property_string(fmt: dict, text: str) -> tuple[dict[str, str], dict[str, object]]:
    """Parse `k=v,k=v` against a property-string format. Returns (errors by key, values)."""
    errors: dict[str, str] = {}
    values: dict[str, object] = {}
    default_key = next((k for k, s in fmt.items() if s.get("default_key")), None)
    for part in text.split(","):
        if part == "":
            continue
        if "=" in part:
            key, val = part.split("=", 1)
        elif default_key is not None:
            key, val = default_key, part
        else:
            errors[part] = "invalid key in comma-separated list property"
            continue
        spec = fmt.get(key)
        if spec is None:
            errors[key] = "property is not defined in schema and the schema does not allow additional properties"
            continue
        if "alias" in spec:
            if "keyAlias" in spec:  # e.g. virtio=MAC: model=virtio, macaddr=MAC
                values[spec["keyAlias"]] = key
            key, spec = spec["alias"], fmt[spec["alias"]]
        if key in values:
            errors[key] = "duplicate key in comma-separated list property"
            continue
        err, typed = check_value(key, val, spec, in_property_string=True)
        if err:
            errors[key] = err.rstrip("\n")
        else:
            values[key] = typed
    for key, spec in fmt.items():
        if "alias" in spec or spec.get("optional") or "default" in spec:
            continue
        if key not in values and key not in errors:
            errors[key] = "property is missing and it is not optional"
    for key, val in list(values.items()):  # keyAlias values are enum-checked like the real key
        spec = fmt.get(key, {})
        if "enum" in spec and str(val) not in [str(e) for e in spec["enum"]]:
            errors[key] = (
                f"value '{val}' does not have a value in the enumeration '{', '.join(str(e) for e in spec['enum'])}'"
            )
    return errors, values


# --- named formats (pve-common JSONSchema.pm, qemu-server) ------------------------------------

_DNS_LABEL = r"[a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?"
_TAG = re.compile(r"[a-z0-9_][a-z0-9_\-+.]*", re.I)


def _ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
        return True
    except ValueError:
        return False


def _cidr(text: str, v6: bool = False) -> bool:
    if "/" not in text:
        return False
    try:
        iface = ipaddress.ip_interface(text)
    except ValueError:
        return False
    return iface.version == (6 if v6 else 4)


def check_format(fmt: str, value: str) -> None:
    if fmt == "pve-vmid":
        if not re.fullmatch(r"[1-9][0-9]{2,8}", value):
            raise FormatError("value does not look like a valid VM ID")
    elif fmt == "pve-node":
        if not re.fullmatch(r"[a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?", value):
            raise FormatError("value does not look like a valid node name")
    elif fmt == "pve-storage-id":
        if not re.fullmatch(r"[a-z][a-z0-9\-_.]*[a-z0-9]", value, re.I):
            raise FormatError(f"storage ID '{value}' contains illegal characters")
    elif fmt == "pve-configid":
        if not re.fullmatch(r"[a-z][a-z0-9_-]+", value, re.I):
            raise FormatError(f"invalid configuration ID '{value}'")
    elif fmt == "pve-configid-list":
        for item in re.split(r"[,;\s]+", value.strip()):
            if item and not re.fullmatch(r"[a-z][a-z0-9_-]+", item, re.I):
                raise FormatError(f"invalid configuration ID '{item}'")
    elif fmt == "dns-name":
        if not re.fullmatch(rf"({_DNS_LABEL}\.)*{_DNS_LABEL}", value):
            raise FormatError("value does not look like a valid DNS name")
    elif fmt == "urlencoded":
        if not re.fullmatch(r"[-%a-zA-Z0-9_.!~*'()]*", value):
            raise FormatError(f"invalid urlencoded string: {value}")
    elif fmt == "mac-addr":
        if not re.fullmatch(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}", value, re.I):
            raise FormatError("value does not look like a valid MAC address")
        if int(value[:2], 16) & 1:
            raise FormatError("value does not look like a valid unicast MAC address")
    elif fmt == "pve-bridge-id":
        if not re.fullmatch(r"[-_.\w\d]+", value):
            raise FormatError(f"invalid bridge ID '{value}'")
    elif fmt == "pve-poolid":
        if not re.fullmatch(r"[A-Za-z0-9_\-/]+", value):
            raise FormatError(f"invalid pool ID '{value}'")
    elif fmt == "pve-tag-list":
        tags = [t for t in re.split(r"[;, ]", value) if t]
        if not tags:
            raise FormatError("empty tag list")
        for tag in tags:
            if not _TAG.fullmatch(tag):
                raise FormatError(f"invalid tag '{tag}'")  # wording approximated
    elif fmt == "pve-qm-ipconfig":
        for part in value.split(","):
            if not part:
                continue
            if "=" not in part:
                raise FormatError(f"invalid key in comma-separated list property: {part}")
            key, val = part.split("=", 1)
            if key == "ip" and not (val == "dhcp" or _cidr(val)):
                raise FormatError(f"invalid IPv4 address or CIDR: '{val}'")  # approximated
            elif key == "gw" and not _ipv4(val):
                raise FormatError(f"invalid IPv4 address: '{val}'")
            elif key == "ip6" and not (val in ("dhcp", "auto") or _cidr(val, v6=True)):
                raise FormatError(f"invalid IPv6 address or CIDR: '{val}'")
            elif key not in ("ip", "gw", "ip6", "gw6"):
                raise FormatError(f"invalid key in comma-separated list property: {key}")
    elif fmt == "pve-vm-cpu-conf":
        first = value.split(",", 1)[0]
        cputype = first.split("=", 1)[1] if first.startswith("cputype=") else first
        if not re.fullmatch(r"[a-zA-Z0-9_.\-]+", cputype):
            raise FormatError(f"Built-in cputype '{cputype}' is not defined (missing 'custom-' prefix?)")
    elif fmt == "disk-size":
        if not re.fullmatch(r"\d+(\.\d+)?[KMGT]?", value):
            raise FormatError(f"unable to parse size '{value}'")
    # any other named format: accepted unchecked (documented gap)
