"""Golden images: Packer template validity, the recipe digest, load() errors, the built manifest."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import pytest
from support.packer_templates import (
    fake_stage,
)

import lab
from lab import images, proc
from lab.errors import LabError, UsageError

# ---------------------------------------------------------------------------------------------
# the Packer template


def _validate(template: Path, pvars: dict[str, str], only: str = "qemu.debian12") -> proc.Result:
    argv = [
        "packer",
        "validate",
        f"-only={only}",
        *[a for k, v in pvars.items() for a in ("-var", f"{k}={v}")],
        template,
    ]
    return proc.run(argv, timeout=60, check=False, env={"CHECKPOINT_DISABLE": "1"})


def test_packer_template_validates(tmp_path):
    res = _validate(lab.PACKER_DIR / images.DEBIAN12.packer_template, fake_stage(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Error" not in res.stdout + res.stderr


def test_packer_validate_catches_a_broken_template(tmp_path):
    # The test above means something only if validate rejects a template that is wrong.
    broken = tmp_path / "broken.pkr.hcl"
    text = (lab.PACKER_DIR / images.DEBIAN12.packer_template).read_text()
    broken.write_text(text.replace('accelerator      = "tcg"', 'accelerator      = "warp-drive"'))
    scripts = tmp_path / "scripts"
    shutil.copytree(lab.PACKER_DIR / "scripts", scripts)
    res = _validate(broken, fake_stage(tmp_path))
    assert res.returncode != 0
    assert "accelerator" in (res.stdout + res.stderr)


def test_debian_build_selects_the_qemu_source():
    # The template also has a proxmox-iso source that needs a PVE node: the local build must not run it.
    import inspect

    from lab.images import debian, steps

    assert '"-only=qemu.{name}"' in inspect.getsource(steps.packer_build).replace('f"-only', '"-only')
    # whitespace-insensitive: ruff format may put the arguments on their own lines
    assert "packer_build(name," in "".join(inspect.getsource(debian.build_debian).split())


def test_packer_template_keeps_the_build_contract():
    text = (lab.PACKER_DIR / images.DEBIAN12.packer_template).read_text()
    for needle in (
        "disk_image       = true",
        "use_backing_file = false",
        '"-kernel"',
        '"-initrd"',
        '"-append"',
        "headless         = true",
        "provision-debian.sh",
        'direction   = "download"',
        "hostfwd=tcp:127.0.0.1:",
    ):
        assert needle in text, needle


# ---------------------------------------------------------------------------------------------
# the recipe digest


def _copy_inputs(tmp_path: Path) -> tuple[Path, Path]:
    pdir, tdir = tmp_path / "packer", tmp_path / "templates"
    shutil.copytree(lab.PACKER_DIR, pdir)
    shutil.copytree(lab.TEMPLATES_DIR, tdir)
    return pdir, tdir


def test_digest_is_stable_and_matches_a_copy_of_the_inputs(tmp_path):
    pdir, tdir = _copy_inputs(tmp_path)
    a = images.recipe_digest("debian12")
    assert a == images.recipe_digest("debian12")
    assert len(a) == 64 and int(a, 16) >= 0
    # The digest depends on content and relative paths only, not on where the checkout lives.
    assert images.recipe_digest("debian12", packer_dir=pdir, templates_dir=tdir) == a


@pytest.mark.parametrize(
    "rel",
    [
        "packer/debian12.pkr.hcl",
        "packer/scripts/provision-debian.sh",
        "packer/scripts/debian-rootfs-customize.sh",
        "templates/nginx.conf.j2",
        "templates/image/masked-units",
        "templates/image/rootfs/usr/local/sbin/lab-net",
        "templates/site/css/style.css",
    ],
)
def test_digest_changes_when_an_input_changes(tmp_path, rel):
    pdir, tdir = _copy_inputs(tmp_path)
    before = images.recipe_digest("debian12", packer_dir=pdir, templates_dir=tdir)
    f = tmp_path / rel
    assert f.is_file(), rel
    f.write_bytes(f.read_bytes() + b"\n# changed\n")
    after = images.recipe_digest("debian12", packer_dir=pdir, templates_dir=tdir)
    assert after != before


def test_digest_changes_when_a_site_file_is_added_or_a_script_loses_its_x_bit(tmp_path):
    pdir, tdir = _copy_inputs(tmp_path)
    base = images.recipe_digest("debian12", packer_dir=pdir, templates_dir=tdir)
    (tdir / "site" / "pages" / "new.html").write_text("{% extends 'layout.html.j2' %}\n")
    added = images.recipe_digest("debian12", packer_dir=pdir, templates_dir=tdir)
    assert added != base
    (tdir / "site" / "pages" / "new.html").unlink()
    assert images.recipe_digest("debian12", packer_dir=pdir, templates_dir=tdir) == base
    os.chmod(pdir / "scripts" / "provision-debian.sh", 0o644)
    assert images.recipe_digest("debian12", packer_dir=pdir, templates_dir=tdir) != base


def test_digest_changes_when_the_package_list_changes(monkeypatch):
    base = images.recipe_digest("debian12")
    changed = images.Recipe(**{**images.DEBIAN12.__dict__, "packages": images.DEBIAN12.packages + ("podman",)})
    monkeypatch.setitem(images.RECIPES, "debian12", changed)
    assert images.recipe_digest("debian12") != base


def test_every_input_file_is_covered():
    labels = [label for label, _ in images.input_files("debian12")]
    for needed in (
        "packer/debian12.pkr.hcl",
        "packer/scripts/provision-debian.sh",
        "templates/nginx.conf.j2",
        "templates/image/masked-units",
        "templates/site/layout.html.j2",
        "templates/site/css/style.css",
    ):
        assert needed in labels
    assert labels == sorted(labels)


# ---------------------------------------------------------------------------------------------
# load() and list_images()


def test_load_missing_image_says_how_to_build_it(tmp_path):
    with pytest.raises(UsageError) as err:
        images.load("debian12", images_dir=tmp_path)
    assert str(err.value) == "image 'debian12' is not built: run `make images`"
    assert images.list_images(images_dir=tmp_path) == []


def test_load_unknown_image_lists_known_names(tmp_path):
    with pytest.raises(UsageError) as err:
        images.load("windows95", images_dir=tmp_path)
    assert "windows95" in str(err.value)
    assert "debian12" in str(err.value)


def test_load_manifest_without_its_disk_is_not_built(tmp_path):
    (tmp_path / "debian12.json").write_text(
        json.dumps(
            {
                "name": "debian12",
                "os": "debian",
                "recipe_digest": "d" * 64,
                "sha256": "s" * 64,
                "paths": {"disk": "debian12.qcow2"},
            }
        )
    )
    with pytest.raises(UsageError, match="not built"):
        images.load("debian12", images_dir=tmp_path)
    (tmp_path / "debian12.qcow2").write_bytes(b"QFI\xfb")
    ref = images.load("debian12", images_dir=tmp_path)
    assert ref.path == tmp_path / "debian12.qcow2"
    assert ref.digest == "d" * 64 and ref.sha256 == "s" * 64 and ref.os == "debian"
    assert [r.name for r in images.list_images(images_dir=tmp_path)] == ["debian12"]
    # Not up to date: the digest is not the current recipe's and artifacts are missing.
    assert images.up_to_date("debian12", tmp_path) is None


# ---------------------------------------------------------------------------------------------
# pure helpers


def test_key_fingerprint_matches_ssh_keygen(tmp_path):
    key = tmp_path / "k"
    proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], timeout=30)
    expected = proc.run(["ssh-keygen", "-lf", f"{key}.pub"], timeout=30).stdout.split()[1]
    assert images.key_fingerprint((tmp_path / "k.pub").read_text()) == expected


def test_png_is_deterministic_and_valid():
    a = images.png(40, 30, 7)
    assert a == images.png(40, 30, 7)
    assert a != images.png(40, 30, 8)
    assert a.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", a[16:24])
    assert (width, height) == (40, 30)
    idat_len = struct.unpack(">I", a[33:37])[0]
    assert a[37:41] == b"IDAT"
    raw = zlib.decompress(a[41 : 41 + idat_len])
    assert len(raw) == height * (1 + 3 * width)


def test_render_stage_makes_the_site_and_nginx_conf(tmp_path):
    images.render_stage("debian12", tmp_path)
    conf = (tmp_path / "nginx.conf").read_text()
    assert "worker_processes auto;" in conf
    assert "listen 443 ssl" in conf and "http2" not in conf.replace("no http2", "")
    assert "access_log off;" in conf and "root /srv/www;" in conf
    assert "ssl_certificate /etc/nginx/lab.crt;" in conf
    site = tmp_path / "site"
    pages = sorted(p.name for p in site.glob("*.html"))
    assert "index.html" in pages and len(pages) >= 5
    index = (site / "index.html").read_text()
    for p in pages:
        if p != "index.html":
            assert f'href="/{p}"' in index
    assert (site / "css" / "style.css").is_file()
    pngs = list((site / "img").glob("*.png"))
    assert len(pngs) >= 3 and all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)
    again = tmp_path / "again"
    images.render_stage("debian12", again)
    for f in site.rglob("*"):
        if f.is_file():
            assert (again / "site" / f.relative_to(site)).read_bytes() == f.read_bytes()


def test_mirrors_come_from_the_host_apt_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("LAB_DEBIAN_MIRROR", raising=False)
    deb822 = tmp_path / "debian.sources"
    deb822.write_text(
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n"
    )
    other = tmp_path / "other.list"
    other.write_text("deb [signed-by=/k.gpg] https://packages.example/apt cloud-sdk main\n")
    lines = images.debian_mirrors("bookworm", sources=[other, deb822])
    assert lines == [
        "deb http://mirror.example/debian bookworm main",
        "deb http://mirror.example/debian bookworm-updates main",
        "deb http://mirror.example/debian-security bookworm-security main",
    ]
    one_line = tmp_path / "sources.list"
    one_line.write_text("# comment\ndeb http://ftp.example/debian bookworm main contrib\n")
    assert images.debian_mirrors("bookworm", sources=[one_line])[0] == "deb http://ftp.example/debian bookworm main"
    assert images.debian_mirrors("bookworm", sources=[])[2].startswith("deb http://deb.debian.org/debian-security")


# ---------------------------------------------------------------------------------------------
# the built image (needs `make images`)


def test_guest_and_build_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (make setup installs it)")
    scripts = sorted((lab.PACKER_DIR / "scripts").glob("*debian*.sh"))
    scripts += sorted((lab.TEMPLATES_DIR / "image" / "rootfs" / "usr" / "local" / "sbin").iterdir())
    assert len(scripts) >= 5
    res = proc.run(["shellcheck", "-S", "warning", *scripts], timeout=60, check=False)
    assert res.returncode == 0, res.stdout


# ---------------------------------------------------------------------------------------------
# the guest's network unit script, run on the host with a fake `ip`

LAB_NET = lab.TEMPLATES_DIR / "image" / "rootfs" / "usr" / "local" / "sbin" / "lab-net"
LAB_CIDATA = LAB_NET.with_name("lab-cidata")
CIDATA = Path(__file__).parents[1] / "data" / "cidata"


def _run_lab_net(
    tmp_path: Path, cmdline: str, cidata: Path | None = None, mac: str = "bc:24:11:5e:0a:04", one_ip_call: bool = True
) -> str:
    """Run lab-net with fake `ip`, `systemctl`, `modprobe` and `blkid` (no cidata drive unless
    `cidata` names a directory standing in for it); return the `ip -batch` input."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    # `ip -4 -o addr show` (the DHCP wait) reports a lease; every other call is logged
    (fake / "ip").write_text(
        f"#!/bin/sh\ncase \"$*\" in *'-o addr show'*) echo '2: eth0 inet 10.0.2.15/24'; exit 0;; esac\n"
        f'echo "$@" >> {tmp_path}/ip.args\n'
        f'[ "$1" = -batch ] && cat >> {tmp_path}/ip.batch\nexit 0\n'
    )
    for tool in ("systemctl", "modprobe", "blkid"):
        (fake / tool).write_text(f'#!/bin/sh\necho {tool} "$@" >> {tmp_path}/calls\n')
    for tool in ("ip", "systemctl", "modprobe", "blkid"):
        (fake / tool).chmod(0o755)
    (tmp_path / "cmdline").write_text(cmdline + "\n")
    (tmp_path / "ip.batch").write_text("")
    (tmp_path / "sys" / "eth0").mkdir(parents=True, exist_ok=True)
    (tmp_path / "sys" / "eth0" / "address").write_text(mac + "\n")
    env = {
        "PATH": f"{fake}:/usr/bin:/bin",
        "LAB_CMDLINE_FILE": str(tmp_path / "cmdline"),
        "LAB_SYS_NET": str(tmp_path / "sys"),
        "LAB_SSH_DIR": str(tmp_path / "ssh"),
        "LAB_NETWORKD_DIR": str(tmp_path / "networkd"),
    }
    if cidata is not None:
        env["LAB_CIDATA_DIR"] = str(cidata)
    out = proc.run(["sh", LAB_NET], timeout=30, env=env).stdout
    (tmp_path / "stdout").write_text(out)
    if one_ip_call:
        assert (tmp_path / "ip.args").read_text().split() == ["-batch", "-"]  # one process only
    return (tmp_path / "ip.batch").read_text()


def test_lab_net_configures_eth0_from_the_kernel_command_line(tmp_path):
    batch = _run_lab_net(tmp_path, images.DEBIAN12.cmdline + " lab.ip=10.77.0.23/24 lab.gw=10.77.0.1")
    lines = [line for line in batch.splitlines() if line.strip()]
    assert lines == [
        "link set lo up",
        "link set eth0 up",
        "addr replace 10.77.0.23/24 dev eth0",
        "route replace default via 10.77.0.1 dev eth0",
    ]
    assert not (tmp_path / "calls").exists()  # the fast path: no module loads, no drive scan


def test_lab_net_without_gateway_and_without_lab_ip(tmp_path):
    batch = _run_lab_net(tmp_path, "root=LABEL=labroot lab.ip=192.0.2.5/28")
    assert "addr replace 192.0.2.5/28 dev eth0" in batch and "route" not in batch
    (tmp_path / "ip.args").unlink()
    # no lab.ip, no cidata drive: DHCP through networkd, for eth0 only, client id = MAC
    batch = _run_lab_net(tmp_path, "console=ttyS0 root=LABEL=labroot quiet", one_ip_call=False)
    assert batch == ""
    calls = (tmp_path / "calls").read_text()
    assert "blkid -l -o device -t LABEL=cidata" in calls
    assert "systemctl start --no-block systemd-networkd.service" in calls
    network = (tmp_path / "networkd" / "10-lab-eth0.network").read_text()
    assert "Name=eth0" in network and "DHCP=ipv4" in network and "ClientIdentifier=mac" in network
    assert "lab-net: eth0 10.0.2.15/24 (dhcp)" in (tmp_path / "stdout").read_text()


def test_lab_net_takes_the_address_and_keys_from_a_pve_cidata_drive(tmp_path):
    drive = tmp_path / "cidata"
    drive.mkdir()
    shutil.copyfile(CIDATA / "pve-v2-static.network-config", drive / "network-config")
    shutil.copyfile(CIDATA / "pve-user-data", drive / "user-data")
    (tmp_path / "ssh").mkdir()
    (tmp_path / "ssh" / "authorized_keys").write_text("ssh-ed25519 AAAAbaked lab\n")
    # eth0 has net1's MAC: its entry wins (DHCP) over the first one
    batch = _run_lab_net(tmp_path, "root=LABEL=labroot", cidata=drive, mac="bc:24:11:5e:0a:05", one_ip_call=False)
    assert batch == "" and (tmp_path / "networkd" / "10-lab-eth0.network").is_file()
    # eth0 has net0's MAC: the static address and gateway, one `ip -batch`
    for f in ("ip.args", "ip.batch", "calls"):
        (tmp_path / f).unlink(missing_ok=True)
    batch = _run_lab_net(tmp_path / "", "root=LABEL=labroot", cidata=drive, mac="bc:24:11:5e:0a:04")
    assert "addr replace 10.20.30.40/16 dev eth0" in batch
    assert "route replace default via 10.20.0.1 dev eth0" in batch
    keys = (tmp_path / "ssh" / "authorized_keys").read_text().splitlines()
    assert keys[0] == "ssh-ed25519 AAAAbaked lab"  # the baked-in key stays
    assert len(keys) == 3 and keys[1].startswith("ssh-ed25519 AAAAC3") and keys[2].endswith("other key with spaces")


def test_image_units_keep_the_boot_contract():
    root = lab.TEMPLATES_DIR / "image" / "rootfs"
    ready = (root / "etc/systemd/system/lab-ready.service").read_text()
    assert "After=lab-net.service ssh.service" in ready
    assert "LAB-READY" in (root / "usr/local/sbin/lab-ready").read_text()
    assert "/dev/ttyS0" in (root / "usr/local/sbin/lab-ready").read_text()
    masked = (lab.TEMPLATES_DIR / "image" / "masked-units").read_text().split()
    assert "systemd-logind.service" in masked and "ssh.service" not in masked
    assert "lab-net.service" not in masked and "nginx.service" not in masked
    modules = (root / "usr/share/initramfs-tools/modules.d/lab").read_text().split()
    for m in (
        "virtio_pci",
        "virtio_blk",
        "virtio_scsi",
        "virtio_net",
        "e1000",
        "e1000e",
        "ahci",
        "sd_mod",
        "nvme",
        "ext4",
    ):
        assert m in modules
    sshd = (root / "etc/ssh/sshd_config.d/lab.conf").read_text()
    assert "PasswordAuthentication no" in sshd and "PermitRootLogin prohibit-password" in sshd
    # what boots faster must not stop a bus, a NIC or the root filesystem from working
    blacklisted = {line.split()[1] for line in (root / "etc/modprobe.d/lab.conf").read_text().splitlines()
                   if line.startswith("blacklist ")}  # fmt: skip
    assert blacklisted and not blacklisted & set(modules)
    assert not blacklisted & {"virtio_net", "e1000", "e1000e", "8139cp", "8139too", "vmxnet3", "ata_piix", "ext4"}
    masked_generators = (lab.TEMPLATES_DIR / "image" / "masked-generators").read_text().splitlines()
    generators = [g.strip() for g in masked_generators if g.strip() and not g.startswith("#")]
    assert all(g.startswith("systemd-") and g.endswith("-generator") for g in generators), generators
    assert "systemd-sysv-generator" in generators and "systemd-fstab-generator" not in generators


def test_ensure_key_makes_one_key_and_keeps_it(tmp_path):
    key = images.ensure_key(tmp_path)
    assert key == tmp_path / "lab_key" and oct(key.stat().st_mode & 0o777) == "0o600"
    pub = (tmp_path / "lab_key.pub").read_text()
    assert pub.startswith("ssh-ed25519 ")
    private = key.read_bytes()
    assert images.ensure_key(tmp_path) == key and key.read_bytes() == private
    # A lost public half is derived again from the private key, never a new key.
    (tmp_path / "lab_key.pub").unlink()
    images.ensure_key(tmp_path)
    assert key.read_bytes() == private
    assert images.key_fingerprint((tmp_path / "lab_key.pub").read_text()) == images.key_fingerprint(pub)


# ---------------------------------------------------------------------------------------------
# the cidata reader (lab-cidata, awk) on files in the shapes PVE and cloud-init write


@pytest.mark.parametrize(
    "name,expected",
    [
        ("pve-v1-static", ["bc:24:11:5e:0a:01 10.77.5.21/24 10.77.5.1"]),
        ("pve-v2-static", ["bc:24:11:5e:0a:04 10.20.30.40/16 10.20.0.1", "bc:24:11:5e:0a:05 dhcp -"]),
        ("cloudinit-v1-netmask", ["bc:24:11:5e:0a:02 192.168.40.77/22 192.168.40.1"]),
        ("cloudinit-v1-dhcp", ["bc:24:11:5e:0a:03 dhcp -"]),
    ],
)
def test_lab_cidata_reads_network_config(name, expected):
    out = proc.run(["sh", LAB_CIDATA, "net", CIDATA / f"{name}.network-config"], timeout=30).stdout
    assert out.splitlines() == expected


def test_lab_cidata_reads_user_data_keys_and_rejects_bad_use(tmp_path):
    out = proc.run(["sh", LAB_CIDATA, "keys", CIDATA / "pve-user-data"], timeout=30).stdout
    assert out.splitlines() == [
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGxhYi10ZXN0LWtleS1vbmUtMDAwMDAwMDAwMDAwMDAw lab@host",
        "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQC0bGFiLXRlc3Qta2V5LXR3bw== other key with spaces",
    ]
    flow = tmp_path / "user-data"
    flow.write_text(
        "#cloud-config\nusers:\n  - name: root\n"
        "    ssh_authorized_keys: ['ssh-ed25519 AAAA1 a', \"ssh-ed25519 AAAA2 b\"]\n"
    )
    assert proc.run(["sh", LAB_CIDATA, "keys", flow], timeout=30).stdout.splitlines() == [
        "ssh-ed25519 AAAA1 a",
        "ssh-ed25519 AAAA2 b",
    ]
    for argv in (["net", tmp_path / "missing"], ["yaml", flow]):
        res = proc.run(["sh", LAB_CIDATA, *argv], timeout=30, check=False)
        assert res.returncode == 2 and "lab-cidata" in res.stderr


# ---------------------------------------------------------------------------------------------
# the partitioned disk (no loop device) and the boot modes in the manifest


def test_make_disk_writes_gpt_and_the_root_filesystem_at_its_offset(tmp_path):
    import dataclasses

    r = dataclasses.replace(images.DEBIAN12, disk_mib=80)
    parts = r.partitions()
    assert [p["name"] for p in parts] == ["bios", "esp", "root"]
    assert parts[2]["start_mib"] == 66 and parts[2]["size_mib"] == 80 - 66 - 1
    root = tmp_path / "root.raw"
    proc.run(["mkfs.ext4", "-q", "-F", "-L", images.ROOT_LABEL, root, f"{parts[2]['size_mib']}M"], timeout=60)
    raw = tmp_path / "disk.raw"
    images.make_disk(raw, r.disk_mib, parts, root)
    assert raw.stat().st_size == 80 * 2**20
    table = json.loads(proc.run(["sfdisk", "--json", raw], timeout=30).stdout)["partitiontable"]
    assert table["label"] == "gpt"
    got = [(p["start"], p["size"], p["type"], p["name"]) for p in table["partitions"]]
    assert got == [(p["start_mib"] * 2048, p["size_mib"] * 2048, p["type"], p["name"]) for p in parts]
    probe = proc.run(["blkid", "-p", "-O", str(66 * 2**20), "-o", "export", raw], timeout=30).stdout
    assert f"LABEL={images.ROOT_LABEL}" in probe and "TYPE=ext4" in probe
    with pytest.raises(LabError, match="partition"):
        images.make_disk(raw, r.disk_mib, [*parts[:2], {**parts[2], "size_mib": 5}], root)


def test_backends_refuse_an_image_that_cannot_boot_their_way():
    from lab.backends.local import boot_files

    def ref(manifest):
        return images.ImageRef("debian12", "debian", Path("/nonexistent/debian12.qcow2"), "d", "s", manifest=manifest)

    old = ref({"paths": {"disk": "debian12.qcow2", "kernel": "debian12/vmlinuz"}})  # recipe version 1
    assert images.boot_modes(old.manifest) == {"kernel"}
    with pytest.raises(UsageError, match=r"cannot boot by BIOS firmware \(SeaBIOS\) \(a Proxmox") as err:
        images.require_boot(old, "bios", "a Proxmox VE template on pve1 boots its disk by SeaBIOS")
    assert "lab images build debian12 --force" in err.value.hint
    new = ref({"boot": ["kernel", "bios", "uefi"], "paths": {"disk": "debian12.qcow2"}})
    for mode in ("kernel", "bios", "uefi"):
        images.require_boot(new, mode, "anyone")
    firmware_only = ref({"boot": ["bios", "uefi"], "paths": {"disk": "debian12.qcow2"}})
    with pytest.raises(UsageError, match="cannot boot by direct kernel boot .the local backend."):
        boot_files(firmware_only)
    assert images.boot_modes({"paths": {"disk": "x.qcow2"}}) is None  # not recorded: not refused
    assert images.DEBIAN12.constants()["boot"] == ["kernel", "bios", "uefi"]


# ---------------------------------------------------------------------------------------------
# the image's SSH host keys: recorded at build, checked by whoever logs in


def _host_keys(etc_ssh: Path) -> Path:
    etc_ssh.mkdir(parents=True)
    for kind in ("ed25519", "ecdsa"):
        proc.run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                kind,
                "-N",
                "",
                "-C",
                "root@lab-debian12",
                "-f",
                etc_ssh / f"ssh_host_{kind}_key",
            ],
            timeout=30,
        )
    return etc_ssh


def test_host_keys_are_read_from_the_image_with_ssh_keygen_fingerprints(tmp_path):
    from lab.images import hostkeys

    etc = _host_keys(tmp_path / "rootfs" / "etc" / "ssh")
    keys = hostkeys.read_host_keys(etc)
    assert [k["type"] for k in keys] == ["ecdsa-sha2-nistp256", "ssh-ed25519"]
    for k in keys:
        kind = "ecdsa" if k["type"].startswith("ecdsa") else "ed25519"
        listed = proc.run(["ssh-keygen", "-lf", etc / f"ssh_host_{kind}_key.pub"], timeout=30).stdout.split()[1]
        assert k["fingerprint"] == listed
        assert (etc / f"ssh_host_{kind}_key.pub").read_text().split()[1] == k["key"]
    with pytest.raises(LabError, match="no SSH host key"):
        hostkeys.read_host_keys(tmp_path)
    # an ISO image's version report lists public key lines
    lines = [(etc / "ssh_host_ed25519_key.pub").read_text(), (etc / "ssh_host_ecdsa_key.pub").read_text()]
    assert hostkeys.host_keys_from_report(lines) == keys
    assert hostkeys.host_keys_from_report(None) is None and hostkeys.host_keys_from_report([]) is None


def test_known_hosts_lines_are_what_openssh_looks_up(tmp_path):
    from lab.images import hostkeys

    keys = hostkeys.read_host_keys(_host_keys(tmp_path / "etc" / "ssh"))
    ref = images.ImageRef("debian12", "debian", tmp_path / "d.qcow2", "d", "s", manifest={"ssh_host_keys": keys})
    text = images.known_hosts(ref, ["10.77.0.10", "lab-debian12"])
    assert text.count("\n") == 2 and text.startswith("10.77.0.10,lab-debian12 ")
    kh = tmp_path / "known_hosts"
    kh.write_text(text)
    for host in ("10.77.0.10", "lab-debian12"):  # ssh-keygen -F looks hosts up as ssh does
        found = proc.run(["ssh-keygen", "-F", host, "-f", kh], timeout=30, check=False)
        assert found.returncode == 0 and keys[1]["key"] in found.stdout, found.stdout
    assert proc.run(["ssh-keygen", "-F", "10.77.0.11", "-f", kh], timeout=30, check=False).returncode != 0
    kh.write_text(images.known_hosts(ref, ["fd00::a"], port=2222))
    assert proc.run(["ssh-keygen", "-F", "[fd00::a]:2222", "-f", kh], timeout=30, check=False).returncode == 0
    for bad in ([], [""], ["a b"], ["a,b"]):
        with pytest.raises(LabError, match="no usable host name"):
            images.known_hosts(ref, bad)


def test_an_image_built_before_host_keys_loads_but_cannot_be_checked(tmp_path):
    old = images.ImageRef("debian12", "debian", tmp_path / "d.qcow2", "d", "s", manifest={"name": "debian12"})
    with pytest.raises(LabError) as err:
        images.known_hosts(old, ["10.77.0.10"])
    assert "\n" not in err.value.message and "built before the lab recorded its SSH host keys" in err.value.message
    assert err.value.hint == "rebuild it: `lab images build debian12 --force`"
