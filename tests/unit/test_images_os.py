"""Golden images of every OS: the Packer templates validate with the Packer the Makefile installs,
the answer files render and are what their installers need, the provisioning scripts pass
shellcheck, `lab images build|ls|render|publish` behave. Only debian12 can be built here (no ISO
downloads): the others are checked as far as this machine allows, never booted."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.packer_templates import (
    ALL_IMAGES,
    ISO_IMAGES,
    defaults,
    fixtures as fixtures,  # noqa: F401 - the fixture, for pytest
    qemu_source_vars,
    template,
)

import lab
from lab import images, osfacts, proc
from lab.errors import UsageError
from lab.model import DiskBus, NicModel

PUBKEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGxhYi10ZXN0LWtleS1ub3QtYS1yZWFsLW9uZS0tLQ lab@test"
SHELL_ANSWERS = ["alpine-install.sh.j2", "netbsd-install.sh.j2"]

needs_packer = pytest.mark.skipif(shutil.which("packer") is None, reason="packer is not installed (make setup)")
needs_shellcheck = pytest.mark.skipif(
    shutil.which("shellcheck") is None, reason="shellcheck is not installed (make setup)"
)


# ---------------------------------------------------------------------------------------------
# packer validate, offline


def _packer_validate(template: Path, only: str, pvars: dict[str, object]) -> proc.Result:
    argv = [
        "packer",
        "validate",
        f"-only={only}",
        *[a for k, v in pvars.items() for a in ("-var", f"{k}={v}")],
        template,
    ]
    return proc.run(argv, timeout=120, check=False, env={"CHECKPOINT_DISABLE": "1"})


@needs_packer
@pytest.mark.parametrize("name", ISO_IMAGES)
def test_qemu_source_validates(name, fixtures):
    res = _packer_validate(
        template(name),
        f"qemu.{name}",
        qemu_source_vars(name, fixtures),
    )
    assert res.returncode == 0, res.stdout + res.stderr


@needs_packer
@pytest.mark.parametrize("name", ALL_IMAGES)
@pytest.mark.parametrize(
    "key,value",
    [("disk_size", "4096"), ("proxmox_url", "https://pve1:8006"), ("proxmox_username", "root@pam")],
)
def test_a_malformed_input_is_refused_by_its_validation_block(name, key, value):
    """The templates' validation blocks (written with regex_replace: Packer 1.6.6 has no regex())
    refuse a malformed value before anything is built, naming the variable."""
    res = _packer_validate(template(name), f"qemu.{name}", {key: value})
    assert res.returncode != 0
    assert f"The {key} must be" in res.stdout + res.stderr


def _with_password_auth(name: str, dest: Path) -> Path:
    """The template with its proxmox-iso `token` attribute as `password`: Debian's Packer 1.6.6 has
    the proxmox-iso builder built in, but not token auth (the proxmox plugin >= 1.0 has). Every other
    attribute is then checked by the real builder's decoder and Prepare()."""
    text = template(name).read_text()
    line = "  token                    = var.proxmox_token\n"
    assert text.count(line) == 1, "the proxmox-iso source must authenticate with the token variable"
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(lab.PACKER_DIR / "scripts", dest / "scripts", dirs_exist_ok=True)
    out = dest / template(name).name
    out.write_text(text.replace(line, "  password                 = var.proxmox_token\n"))
    return out


@pytest.mark.parametrize("name", ALL_IMAGES)
def test_packer_built_proxmox_template_is_one_the_lab_clones(name):
    """A template built by the proxmox-iso source with `-var recipe_digest=...` carries what the
    Proxmox backend looks for: its marker, the image's name and the recipe digest."""
    from lab.backends.proxmox.ownership import is_lab_template, parse_description

    m = re.search(r'template_description\s*=\s*"((?:[^"\\]|\\.)*)"', template(name).read_text())
    assert m, "the proxmox-iso source has no template_description"
    digest = images.recipe_digest(name)
    text = m.group(1).replace("\\n", "\n").replace("${var.recipe_digest}", digest)
    assert is_lab_template(text, name), text
    assert parse_description(text)["lab-image-digest"] == digest


@needs_packer
@pytest.mark.parametrize("name", ALL_IMAGES)
def test_proxmox_source_validates(name, fixtures, tmp_path):
    template = _with_password_auth(name, tmp_path)
    res = _packer_validate(
        template,
        f"proxmox-iso.{name}",
        {
            "proxmox_token": "token-secret-for-validation",
            "iso_checksum": f"file:{fixtures['sums'][name]}",
            "ssh_key": fixtures["key"],
            "http_dir": fixtures["root"] / "http",
            "stage_dir": fixtures["stage"],
            "proxmox_url": "https://pve.example:8006/api2/json",
        },
    )
    assert res.returncode == 0, res.stdout + res.stderr


@needs_packer
def test_validate_catches_a_checksum_file_without_the_iso(fixtures, tmp_path):
    # The checks above mean something only if validate reads the checksum file for the ISO's name.
    wrong = tmp_path / "sums"
    wrong.write_text(f"SHA256 (install00.iso) = {'ab' * 32}\n")
    res = _packer_validate(
        template("openbsd7"),
        "qemu.openbsd7",
        {
            "iso_checksum": f"file:{wrong}",
            "ssh_key": fixtures["key"],
            "http_dir": fixtures["root"] / "http",
            "stage_dir": fixtures["stage"],
        },
    )
    assert res.returncode != 0 and "no checksum found" in res.stdout + res.stderr


@needs_packer
def test_validate_catches_a_broken_proxmox_source(fixtures, tmp_path):
    template = _with_password_auth("freebsd14", tmp_path)
    template.write_text(template.read_text().replace("    bridge = var.proxmox_bridge\n", ""))
    res = _packer_validate(
        template,
        "proxmox-iso.freebsd14",
        {
            "proxmox_token": "token-secret-for-validation",
            "iso_checksum": f"file:{fixtures['sums']['freebsd14']}",
            "ssh_key": fixtures["key"],
            "http_dir": fixtures["root"] / "http",
            "stage_dir": fixtures["stage"],
        },
    )
    assert res.returncode != 0 and "bridge must be specified" in res.stdout + res.stderr


@needs_packer
@pytest.mark.parametrize("name", ALL_IMAGES)
def test_every_template_is_valid_hcl_and_formatted(name):
    res = proc.run(["packer", "validate", "-syntax-only", template(name)], timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    res = proc.run(["packer", "fmt", "-check", template(name)], timeout=60, check=False)
    assert res.returncode == 0, f"packer fmt would change {template(name)}"


@pytest.mark.parametrize("name", ALL_IMAGES)
def test_template_has_both_sources_and_the_lab_contract(name):
    text = template(name).read_text()
    assert f'source "qemu" "{name}"' in text and f'source "proxmox-iso" "{name}"' in text
    assert f'sources = ["source.qemu.{name}", "source.proxmox-iso.{name}"]' in text
    assert f'template_name            = "lab-{name}"' in text
    assert "insecure_skip_tls_verify = false" in text  # TLS verified
    assert re.search(r'variable "proxmox_token" \{[^}]*sensitive\s*=\s*true', text, re.S)
    assert 'default     = ""\n  sensitive' in text  # no secret in the template
    assert "hostfwd=tcp:127.0.0.1:" in text  # SSH forward on loopback only
    if name in ISO_IMAGES:  # the answer files (a root password hash among them) served on loopback only
        qemu_source = text.split(f'source "qemu" "{name}"', 1)[1].split("\nsource ", 1)[0]
        assert 'http_bind_address = "127.0.0.1"' in qemu_source
    assert 'direction   = "download"' in text and "/etc/lab-image.json" in text


@needs_packer
@pytest.mark.parametrize("name", ALL_IMAGES)
def test_iso_defaults_are_release_urls_with_checksum_files(name):
    d = defaults(name)
    url, checksum = d["iso_url"], d["iso_checksum"]
    assert url.startswith("https://") and url.endswith(".iso")
    assert checksum.startswith("file:https://")
    # The checksum file lives beside the ISO (same release directory, or the ISO's own .sha256).
    assert checksum[len("file:") :].rsplit("/", 1)[0] == url.rsplit("/", 1)[0]
    r = images.recipe(name)
    assert r.release.split(".")[0] in url


# ---------------------------------------------------------------------------------------------
# answer files


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("answers")
    return {name: images.render_answers(name, root / name, PUBKEY) for name in ALL_IMAGES}


def test_every_image_has_its_answer_files(rendered):
    assert set(rendered["debian12"]) == {"preseed.cfg"}
    assert set(rendered["alpine3"]) == {"answers", "install.sh"}
    assert set(rendered["freebsd14"]) == {"installerconfig"}
    assert set(rendered["netbsd10"]) == {"install.sh"}
    assert set(rendered["openbsd7"]) == {"install.conf"}
    for name, files in rendered.items():
        texts = [path.read_text() for path in files.values()]
        assert not any("{{" in t or "{%" in t for t in texts), name
        assert any(PUBKEY in t for t in texts), name  # every installer puts the lab key in place


def test_boot_commands_fetch_what_is_rendered(rendered):
    for name, files in rendered.items():
        text = template(name).read_text()
        for served in files:
            if served == "answers":  # fetched by alpine's install.sh, with the base URL it is given
                assert '"$base/answers"' in files["install.sh"].read_text()
            else:
                assert f"{{{{ .HTTPPort }}}}/{served}" in text, (name, served)


def test_root_password_is_random_per_render(tmp_path):
    a = images.render_answers("openbsd7", tmp_path / "a", PUBKEY)["install.conf"].read_text()
    b = images.render_answers("openbsd7", tmp_path / "b", PUBKEY)["install.conf"].read_text()
    pa = re.search(r"^Password for root account = (\S+)$", a, re.M).group(1)
    pb = re.search(r"^Password for root account = (\S+)$", b, re.M).group(1)
    assert pa != pb and len(pa) >= 20


@needs_shellcheck
def test_shell_answer_files_pass_shellcheck(rendered):
    scripts = [rendered["alpine3"]["install.sh"], rendered["netbsd10"]["install.sh"]]
    res = proc.run(["shellcheck", "-s", "sh", "-S", "warning", *scripts], timeout=60, check=False)
    assert res.returncode == 0, res.stdout


def _installerconfig_parts(text: str) -> tuple[str, str]:
    preamble, sep, script = text.partition("\n#!/bin/sh\n")
    assert sep, "bsdinstall needs the preamble, then a #!/bin/sh line, then the setup script"
    return preamble, "#!/bin/sh\n" + script


@needs_shellcheck
def test_freebsd_installerconfig(rendered, tmp_path):
    preamble, script = _installerconfig_parts(rendered["freebsd14"]["installerconfig"].read_text())
    # The preamble is sourced by bsdinstall's sh: it must be valid sh setting what `script` reads.
    res = (
        proc.run(
            ["sh", "-c", f". '{tmp_path / 'pre'}'; echo \"$PARTITIONS|$DISTRIBUTIONS|$nonInteractive\""],
            timeout=10,
            check=False,
        )
        if (tmp_path / "pre").write_text(preamble)
        else None
    )
    assert res.returncode == 0, res.stderr
    partitions, dists, non_interactive = res.stdout.strip().split("|")
    assert partitions.split()[0] == osfacts.facts("freebsd").install_disk and "GPT" in partitions
    assert set(dists.split()) == {"kernel.txz", "base.txz"} and non_interactive == "YES"
    (tmp_path / "setup.sh").write_text(script)
    res = proc.run(["shellcheck", "-s", "sh", "-S", "warning", tmp_path / "setup.sh"], timeout=60, check=False)
    assert res.returncode == 0, res.stdout
    for needle in (
        'sysrc ifconfig_DEFAULT="DHCP"',
        'sysrc sshd_enable="YES"',
        'console="comconsole',
        "PermitRootLogin prohibit-password",
        "/root/.ssh/authorized_keys",
        "pw usermod root -H 0",
    ):
        assert needle in script, needle
    assert script.rstrip().endswith("reboot")


def _conf_pairs(text: str) -> dict[str, str]:
    pairs = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            key, sep, value = line.partition(" = ")
            assert sep, f"not 'question = answer': {line!r}"
            assert key not in pairs, f"{key!r} answered twice"
            pairs[key] = value
    return pairs


def test_openbsd_install_conf(rendered):
    pairs = _conf_pairs(rendered["openbsd7"]["install.conf"].read_text())
    f = osfacts.facts("openbsd")
    nic = f.device(NicModel.VIRTIO)
    # What autoinstall(8) cannot do without (it stops and asks otherwise).
    assert pairs["System hostname"] == "lab-openbsd7"
    assert pairs["Which network interface do you wish to configure"] == nic == "vio0"
    assert pairs[f"IPv4 address for {nic}"] == "autoconf"
    assert pairs["Password for root account"]
    assert pairs["Public ssh key for root account"] == PUBKEY
    assert pairs["Allow root ssh login"] == "prohibit-password"
    assert pairs["Which disk is the root disk"] == f.install_disk == "sd0"
    assert pairs["Location of sets"] == "cd0"
    assert pairs["Pathname to the sets"] == f"{images.recipe('openbsd7').release}/amd64"
    assert pairs["Change the default console to com0"] == "yes"
    assert pairs["Which speed should com0 use"] == "115200"
    assert "-x*" in pairs["Set name(s)"].split()


def _shell_assignments(text: str) -> dict[str, str]:
    """setup-alpine sources its answer file: read it back with sh itself."""
    res = subprocess.run(
        ["sh", "-c", "set -a; . /dev/stdin; env -0"],
        input=text,
        capture_output=True,
        text=True,
        timeout=10,
        env={"PATH": os.environ["PATH"]},
    )
    assert res.returncode == 0, res.stderr
    return dict(item.split("=", 1) for item in res.stdout.split("\0") if "=" in item)


def test_alpine_answers(rendered):
    env = _shell_assignments(rendered["alpine3"]["answers"].read_text())
    # setup-alpine -f asks for whatever its answer file leaves unset.
    for key in (
        "KEYMAPOPTS",
        "HOSTNAMEOPTS",
        "INTERFACESOPTS",
        "DNSOPTS",
        "TIMEZONEOPTS",
        "PROXYOPTS",
        "APKREPOSOPTS",
        "USEROPTS",
        "SSHDOPTS",
        "NTPOPTS",
        "DISKOPTS",
        "LBUOPTS",
        "APKCACHEOPTS",
    ):
        assert key in env, key
    assert env["HOSTNAMEOPTS"] == "lab-alpine3"
    assert "iface eth0 inet dhcp" in env["INTERFACESOPTS"]
    assert env["DISKOPTS"] == f"-m sys /dev/{osfacts.facts('alpine').install_disk}"
    assert env["ROOTSSHKEY"] == PUBKEY and env["SSHDOPTS"] == "openssh"
    assert "-c" in env["APKREPOSOPTS"].split()  # community: sysbench, iperf3, podman
    install = rendered["alpine3"]["install.sh"].read_text()
    assert "setup-alpine -e -f /tmp/answers" in install and 'ERASE_DISKS="/dev/vda"' in install
    assert "console=ttyS0,115200" in install and "net.ifnames=0" in install


def test_netbsd_install_script(rendered):
    text = rendered["netbsd10"]["install.sh"].read_text()
    f = osfacts.facts("netbsd")
    assert f"disk={f.install_disk}" in text and f.install_disk == "ld0"
    for needle in (
        "gpt create",
        "newfs -O 2",
        "installboot",
        "consdev=com0",
        "dhcpcd=YES",
        "sshd=YES",
        "PermitRootLogin prohibit-password",
        "/root/.ssh/authorized_keys",
        "base.tar.xz",
        "kern-GENERIC",
        "NAME=labroot / ffs",
    ):
        assert needle in text, needle
    assert text.rstrip().endswith("reboot")


def test_debian_preseed_passes_debconf_set_selections(rendered, tmp_path):
    preseed = rendered["debian12"]["preseed.cfg"]
    if shutil.which("debconf-set-selections") is None:
        pytest.skip("debconf-set-selections is not installed")
    res = proc.run(["debconf-set-selections", "-c", preseed], timeout=30, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    broken = tmp_path / "broken.cfg"
    broken.write_text(preseed.read_text() + "d-i partman/confirm\n")
    assert proc.run(["debconf-set-selections", "-c", broken], timeout=30, check=False).returncode != 0


def test_debian_preseed_installs_the_recipe_packages(rendered):
    text = rendered["debian12"]["preseed.cfg"].read_text()
    include = re.search(r"^d-i pkgsel/include string (.*)$", text, re.M).group(1).split()
    assert set(images.DEBIAN12.packages) <= set(include) and "qemu-guest-agent" in include
    assert "net.ifnames=0" in text and "console=ttyS0,115200n8" in text
    assert "in-target usermod -p '*' root" in text


# ---------------------------------------------------------------------------------------------
# provisioning scripts and the upload stage


@needs_shellcheck
def test_provisioning_scripts_pass_shellcheck():
    scripts = sorted((lab.PACKER_DIR / "scripts").glob("provision-*.sh"))
    assert {s.stem.removeprefix("provision-") for s in scripts} >= {
        "common",
        "alpine",
        "freebsd",
        "netbsd",
        "openbsd",
        "debian",
    }
    res = proc.run(
        ["shellcheck", "-x", "-S", "warning", *scripts], timeout=60, check=False, cwd=lab.PACKER_DIR / "scripts"
    )
    assert res.returncode == 0, res.stdout


@pytest.mark.parametrize("name", ISO_IMAGES)
def test_upload_stage_carries_the_os_facts(name, tmp_path):
    images.render_upload(name, tmp_path)
    r = images.recipe(name)
    f = osfacts.facts(r.os)
    res = proc.run(
        [
            "sh",
            "-c",
            '. ./lab-facts.sh; printf \'%s\\n\' "$LAB_PACKAGES" "$LAB_NGINX_CONF" "$LAB_SERIAL" "$LAB_HOSTNAME"',
        ],
        timeout=10,
        cwd=tmp_path,
    )
    packages, conf, serial, hostname = res.stdout.splitlines()
    assert sorted(packages.split()) == sorted(f.packages.values())
    assert (conf, serial, hostname) == (f.nginx.conf, f.serial_device, r.hostname)
    nginx = (tmp_path / "lab-nginx.conf").read_text()
    assert f"user {f.nginx.user};" in nginx and f"include {f.nginx.mime_types};" in nginx
    assert f"ssl_certificate {f.nginx.cert_dir}/lab.crt;" in nginx
    assert (tmp_path / "lab-site" / "index.html").is_file()
    assert (tmp_path / "lab-common.sh").read_bytes() == (lab.PACKER_DIR / "scripts/provision-common.sh").read_bytes()


def _fake_tools(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for tool, line in {
        "sysbench": "sysbench 1.0.20",
        "iperf3": "iperf 3.17.1 (cJSON 1.7.15)",
        "nginx": 'nginx version: nginx/1.26.2 "quoted" \\back',
        "git": "git version 2.47.1",
        "curl": "curl 8.11.1 (x86_64-alpine-linux-musl)",
        "ssh": "OpenSSH_9.9p1, OpenSSL 3.3.2",
    }.items():
        (bin_dir / tool).write_text(f"#!/bin/sh\nprintf '%s\\n' '{line}'\n")
        (bin_dir / tool).chmod(0o755)


def test_common_report_is_json_with_the_same_bulk_bytes_as_debian(tmp_path):
    """provision-common.sh's report and bulk files, run for real on this host's sh and openssl (the
    tools themselves faked): valid JSON, and the bulk files byte-identical to Debian's recipe."""
    _fake_tools(tmp_path / "bin")
    site = tmp_path / "www"
    (site / "bulk").mkdir(parents=True)
    (site / "index.html").write_text("x")
    certdir = tmp_path / "cert"
    certdir.mkdir()
    proc.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=t",
            "-days",
            "1",
            "-keyout",
            certdir / "lab.key",
            "-out",
            certdir / "lab.crt",
        ],
        timeout=60,
    )
    script = f"""
set -eu
. {lab.PACKER_DIR / "scripts/provision-common.sh"}
LAB_IMAGE=alpine3 LAB_PACKAGES='nginx iperf3' LAB_CERT_DIR={certdir} LAB_SITE_ROOT={site}
lab_pkgver() {{ echo "1.2-r$1\\""; }}
lab_keystream 6c61622d62756c6b2d316d0000000000 1 > {site}/bulk/1m.bin
lab_keystream 6c61622d62756c6b2d36346d00000000 64 > {site}/bulk/64m.bin
lab_report 'Alpine Linux 3.21.4'
"""
    report = tmp_path / "lab-image.json"
    script = script.replace("> /etc/lab-image.json", "")
    common = (lab.PACKER_DIR / "scripts/provision-common.sh").read_text().replace("/etc/lab-image.json", str(report))
    (tmp_path / "common.sh").write_text(common)
    script = script.replace(str(lab.PACKER_DIR / "scripts/provision-common.sh"), str(tmp_path / "common.sh"))
    proc.run(["sh", "-c", script], timeout=120, env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    data = json.loads(report.read_text())
    assert data["os_version"] == "Alpine Linux 3.21.4" and data["image"] == "alpine3"
    assert data["tools"]["nginx"] == "nginx version: nginx/1.26.2 quoted back"
    assert data["tools"]["podman"] == "" or "podman" in data["tools"]["podman"]
    assert data["packages"] == {"nginx": "1.2-rnginx", "iperf3": "1.2-riperf3"}
    assert data["site_files"] == 3
    # The same keys and sizes as provision-debian.sh: the bytes every OS serves are the same.
    assert data["bulk_sha256"]["/bulk/1m.bin"] == "976de952f06d9f848a016a4222cc8df2747734876b0b8cff2a0390f16482b546"
    assert (site / "bulk/64m.bin").stat().st_size == 64 * 2**20
    debian = lab.IMAGES_DIR / "debian12.json"
    if debian.is_file():
        assert json.loads(debian.read_text())["nginx"]["bulk_sha256"] == data["bulk_sha256"]


# ---------------------------------------------------------------------------------------------
# lab images build / ls / render / publish


OFFLINE = {
    "https_proxy": "http://127.0.0.1:9",
    "http_proxy": "http://127.0.0.1:9",
    "no_proxy": "",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "NO_PROXY": "",
}


def _lab(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lab", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


@needs_packer
def test_build_without_an_iso_is_one_line_exit_2():
    # A closed local proxy port stands for "no route to the mirror", whatever this machine can reach.
    work = lab.PROJECT_ROOT / "build" / "freebsd14"
    existed = work.exists()
    res = _lab("images", "build", "freebsd14", env=OFFLINE)
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "freebsd14" in lines[0] and "FreeBSD-14.3-RELEASE-amd64-disc1.iso" in lines[0]
    assert "cannot be downloaded" in lines[0] and "--iso PATH" in lines[0]
    assert "Traceback" not in res.stderr
    assert work.exists() == existed  # nothing created


@needs_packer
def test_resolve_iso_prefers_a_local_copy(tmp_path, monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    r = images.recipe("openbsd7")
    with pytest.raises(UsageError, match="no such file"):
        images.resolve_iso(r, tmp_path, iso=str(tmp_path / "missing.iso"))
    iso = tmp_path / "install78.iso"
    iso.write_bytes(b"\0" * 2048)
    with pytest.raises(UsageError, match="expected sha256:HEX"):
        images.resolve_iso(r, tmp_path, iso=str(iso), checksum="md5:abc")
    # Offline, a local ISO needs its checksum given: the release's checksum file is out of reach.
    with pytest.raises(UsageError, match="checksum file .* cannot be downloaded") as err:
        images.resolve_iso(r, tmp_path, iso=str(iso))
    assert "--iso-checksum" in err.value.hint
    src = images.resolve_iso(r, tmp_path, iso=str(iso), checksum="sha256:" + "ab" * 32)
    assert src == images.IsoSource(str(iso), "sha256:" + "ab" * 32, local=True)
    # images/iso/<file name of the default URL> is found without --iso.
    cache = tmp_path / images.ISO_CACHE
    cache.mkdir()
    shutil.copyfile(iso, cache / "install78.iso")
    src = images.resolve_iso(r, tmp_path, checksum="sha256:" + "cd" * 32)
    assert src.url == str(cache / "install78.iso") and src.local


def test_build_refuses_iso_options_for_debian():
    with pytest.raises(UsageError, match="drop --iso"):
        images.build("debian12", iso="/nonexistent.iso")


def test_ls_lists_every_image_built_or_not(tmp_path, monkeypatch):
    monkeypatch.setattr(lab, "IMAGES_DIR", tmp_path)
    rows = {r["name"]: r for r in images.status(tmp_path)}
    assert set(rows) == set(images.RECIPES)
    for name, row in rows.items():
        assert row["state"] == "not built" and row["age_s"] is None
        assert row["recipe_digest"] == images.recipe_digest(name)
    (tmp_path / "openbsd7.json").write_text(
        json.dumps(
            {
                "name": "openbsd7",
                "os": "openbsd",
                "recipe_digest": "0" * 64,
                "sha256": "s" * 64,
                "size": 4,
                "built_at": "2025-01-01T00:00:00+00:00",
                "tools": {"nginx": "nginx version: nginx/1.26.2"},
                "paths": {"disk": "openbsd7.qcow2"},
            }
        )
    )
    (tmp_path / "openbsd7.qcow2").write_bytes(b"QFI\xfb")
    row = {r["name"]: r for r in images.status(tmp_path, now=1735776000.0)}["openbsd7"]
    assert row["state"] == "outdated" and row["built_digest"] == "0" * 64
    assert row["age_s"] == 86400 and row["tools"]["nginx"].endswith("1.26.2")


def test_cli_ls_json_and_table():
    res = _lab("images", "ls", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["images"]
    assert [r["name"] for r in rows] == sorted(images.RECIPES)
    res = _lab("images", "ls")
    assert res.returncode == 0
    for name in images.RECIPES:
        assert name in res.stdout


def _fake_built(idir: Path, name: str = "alpine3") -> None:
    disk = idir / f"{name}.qcow2"
    disk.write_bytes(b"QFI\xfb" + os.urandom(4096))
    (idir / "lab_key").write_text("private")
    (idir / "lab_key.pub").write_text(PUBKEY + "\n")
    (idir / f"{name}.json").write_text(
        json.dumps(
            {
                "name": name,
                "os": "alpine",
                "recipe_digest": "d" * 64,
                "sha256": images.file_sha256(disk),
                "paths": {"disk": f"{name}.qcow2", "ssh_key": "lab_key", "ssh_pubkey": "lab_key.pub"},
            }
        )
    )


def test_publish_local_copies_verifies_and_is_idempotent(tmp_path):
    idir, store = tmp_path / "images", tmp_path / "store"
    idir.mkdir()
    _fake_built(idir)
    ref = images.load("alpine3", idir)
    where = Path(images.publish_local(ref, store))
    assert where == store / "alpine3" / ref.sha256[:12]
    assert (where / "alpine3.qcow2").read_bytes() == ref.path.read_bytes()
    assert json.loads((where / "manifest.json").read_text())["sha256"] == ref.sha256
    assert not (where / "lab_key").exists()  # the private key never leaves images/
    assert (store / "alpine3" / "current").resolve() == where.resolve()
    mtime = (where / "alpine3.qcow2").stat().st_mtime_ns
    assert images.publish_local(ref, store) == str(where)
    assert (where / "alpine3.qcow2").stat().st_mtime_ns == mtime  # nothing copied again
    # A disk that does not match its manifest is refused, and nothing is left half-published.
    ref.path.write_bytes(b"QFI\xfb corrupted")
    (store / "alpine3").rename(tmp_path / "old")
    with pytest.raises(Exception, match="does not match"):
        images.publish_local(ref, store)
    assert not any((store / "alpine3").glob(f"{ref.sha256[:12]}*"))


def test_publish_cli_dispatches_to_the_backend(tmp_path):
    cfg = tmp_path / "lab.toml"
    cfg.write_text('[lab]\nname = "p"\n\n[hosts.local]\nbackend = "local"\nworkdir = "%s"\n' % (tmp_path / "w"))
    res = _lab("images", "publish", "debian12", "nohost", "-c", str(cfg))
    assert res.returncode == 2 and "no host 'nohost'" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_a_backend_without_publish_image_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from lab import cli, config
    from lab.backends import Backend

    class Plain(Backend):  # a backend that cannot publish: it has no Publishing part
        name = "plain"
        capabilities = check = facts = open_run = close_run = run_is_live = None  # type: ignore
        clone = start = wait_ready = destroy = list_owned = remove_owned = renew_lease = None  # type: ignore

    Plain.__abstractmethods__ = frozenset()
    monkeypatch.setattr(
        config.LabConfig, "open_backends", lambda self, hosts=None: {h: Plain(h, self.hosts[h]) for h in hosts}
    )
    monkeypatch.setattr(images, "load", lambda name: images.ImageRef(name, "debian", Path("/x"), "d", "s" * 64))
    cfg = tmp_path / "lab.toml"
    cfg.write_text('[lab]\nname = "p"\n')
    with pytest.raises(SystemExit) as exc:
        cli.main(["images", "publish", "debian12", "local", "-c", str(cfg)])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "host 'local' (plain backend) cannot publish images" in lines[0]


# ---------------------------------------------------------------------------------------------
# per-OS facts in one place


def test_osfacts_cover_every_image_os_and_nic_names():
    for r in images.RECIPES.values():
        f = osfacts.facts(r.os)
        assert f.device(NicModel.VIRTIO) and f.device(NicModel.E1000)
        assert {"sysbench", "iperf3", "nginx", "git", "curl"} <= set(f.packages)
    assert osfacts.facts("freebsd").device(NicModel.VIRTIO) == "vtnet0"
    assert osfacts.facts("freebsd").device(NicModel.E1000) == "em0"
    assert osfacts.facts("netbsd").device(NicModel.VIRTIO) == "vioif0"
    assert osfacts.facts("netbsd").device(NicModel.E1000) == "wm0"
    assert osfacts.facts("openbsd").device(NicModel.VIRTIO) == "vio0"
    assert osfacts.facts("openbsd").device(NicModel.E1000) == "em0"
    assert osfacts.facts("debian").device(NicModel.E1000) == osfacts.facts("alpine").device(NicModel.VIRTIO) == "eth0"
    assert "podman" in osfacts.facts("alpine").packages and "podman" not in osfacts.facts("openbsd").packages


def test_osfacts_driver_tables_are_complete_and_say_what_each_os_lacks():
    """Every image's OS has an entry for every NIC model and disk bus it can drive, and only those
    (the sources are cited in lab/osfacts.py); a device name goes with every NIC driver."""
    for r in images.RECIPES.values():
        f = osfacts.facts(r.os)
        assert set(f.nic_device) == set(f.nic_driver), r.os
        assert set(f.disk_driver) == set(DiskBus), r.os  # every image OS drives every bus the lab offers
        assert all(f.has_driver(m) == (m in f.nic_driver) for m in NicModel)
        assert all(f.has_driver(b) for b in DiskBus)
    # QEMU's rtl8139 is a C+ chip: 8139cp on Linux, re(4) on the BSDs; Alpine's virt kernel has no Realtek
    assert osfacts.facts("debian").nic_driver[NicModel.RTL8139] == "8139cp"
    for bsd in ("freebsd", "netbsd", "openbsd"):
        f = osfacts.facts(bsd)
        assert (f.device(NicModel.RTL8139), f.device(NicModel.VMXNET3)) == ("re0", "vmx0")
        assert set(f.nic_driver) == set(NicModel)
    alpine = osfacts.facts("alpine")
    assert set(alpine.nic_driver) == set(NicModel) - {NicModel.RTL8139} and not alpine.has_driver(NicModel.RTL8139)
    with pytest.raises(UsageError, match="alpine has no driver for NIC model 'rtl8139'"):
        alpine.device(NicModel.RTL8139)
    assert set(osfacts.facts("debian").nic_driver) == set(NicModel)


def test_config_knows_exactly_the_recipes():
    from lab import config

    assert config.KNOWN_IMAGES == {name: r.os for name, r in images.RECIPES.items()}


def test_no_per_os_paths_outside_osfacts():
    """Package names, nginx paths and serial devices of the BSDs and Alpine live in lab/osfacts.py:
    the guest scripts and the rest of the package read them from there."""
    needles = [
        "/usr/local/etc/nginx",
        "/usr/pkg/etc/nginx",
        "podman-suite",
        "git-lite",
        "git-base",
        "/dev/ttyu0",
        "/dev/tty00",
    ]
    offenders = []
    for path in [*lab.PROJECT_ROOT.joinpath("lab").rglob("*.py"), *lab.PACKER_DIR.joinpath("scripts").glob("*.sh")]:
        if path.name == "osfacts.py":
            continue
        text = path.read_text()
        offenders += [f"{path.name}: {n}" for n in needles if n in text]
    assert offenders == []


def test_tuning_reads_sysctl_facts_from_osfacts():
    from lab import tuning

    # Alpine shares the Linux profile files; the watched keys come from osfacts, per OS.
    assert tuning.render("alpine", "wan-16m") == tuning.render("debian", "wan-16m")
    assert tuning.render("alpine", "wan-16m")["net.ipv4.tcp_congestion_control"] == "bbr"
    assert tuning.render("openbsd", "wan-16m") is None  # no profile for it: the cell is n/a

    class Guest:
        def __init__(self):
            self.commands = []

        def run(self, command, timeout):
            self.commands.append(command)
            return type("R", (), {"stdout": "kern.ipc.maxsockbuf\t16777216\n"})()

    g = Guest()
    applied = tuning.apply(g, osfacts.facts("freebsd"), "default")
    assert applied.applicable and applied.effective == {"kern.ipc.maxsockbuf": "16777216"}
    assert all(k in g.commands[-1] for k in osfacts.facts("freebsd").sysctl_watched)


def test_an_unbuilt_iso_image_says_how_to_build_it(tmp_path):
    with pytest.raises(UsageError) as err:
        images.load("netbsd10", images_dir=tmp_path)
    assert str(err.value) == "image 'netbsd10' is not built: run `lab images build netbsd10`"


def test_local_backend_refuses_a_disk_boot_image_with_one_line():
    from lab.backends.local import boot_files

    ref = images.ImageRef(
        "freebsd14",
        "freebsd",
        Path("/nonexistent/freebsd14.qcow2"),
        "d",
        "s",
        manifest={"boot": "disk", "paths": {"disk": "freebsd14.qcow2"}},
    )
    with pytest.raises(UsageError, match="cannot boot by direct kernel boot"):
        boot_files(ref)
