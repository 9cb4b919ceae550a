"""The built golden image (make images): its manifest, artifacts, host keys, and that it is up to date
with the checkout."""

from __future__ import annotations

import pytest

import lab
from lab import images

MANIFEST = lab.IMAGES_DIR / "debian12.json"


needs_image = pytest.mark.skipif(
    not MANIFEST.is_file(), reason="images/debian12.json is absent: run `make images` first"
)


@pytest.mark.image
@needs_image
def test_manifest_describes_the_image():
    ref = images.load("debian12")
    m = ref.manifest
    assert m["name"] == "debian12" and m["os"] == "debian" and ref.os == "debian"
    assert m["root_label"] == "labroot"
    assert "root=LABEL=labroot" in m["cmdline"] and "console=ttyS0" in m["cmdline"]
    assert "net.ifnames=0" in m["cmdline"]
    assert m["ready_marker"] == "LAB-READY"
    assert m["kernel"].endswith("-amd64") and not m["kernel"].endswith("cloud-amd64")
    assert m["kernels"] == [m["kernel"]]
    assert m["build_seconds"] > 0 and m["built_at"]
    for tool, prefix in {
        "sysbench": "sysbench 1.",
        "iperf3": "iperf 3.",
        "nginx": "nginx version: nginx/1.",
        "openssl": "OpenSSL 3.",
        "git": "git version 2.",
        "curl": "curl 7.",
        "openssh": "OpenSSH_9.",
    }.items():
        assert m["tools"][tool].startswith(prefix), (tool, m["tools"].get(tool))
    for pkg in ("sysbench", "iperf3", "nginx", "openssl", "git", "curl", "openssh-server", "linux-image-amd64"):
        assert m["packages"][pkg], pkg
    bulk = m["nginx"]["bulk_sha256"]
    assert set(bulk) == {"/bulk/1m.bin", "/bulk/64m.bin"}
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in bulk.values())
    assert m["nginx"]["site_files"] >= 10
    for mod in ("virtio_pci", "virtio_blk", "virtio_net", "e1000", "e1000e", "nvme", "ahci", "ext4"):
        assert mod in m["initrd_modules"]


@pytest.mark.image
@needs_image
def test_manifest_artifacts_exist_and_sha256_matches():
    ref = images.load("debian12")
    m = ref.manifest
    for rel in m["paths"].values():
        assert (lab.IMAGES_DIR / rel).is_file(), rel
    assert ref.path.stat().st_size == m["size"]
    assert images.file_sha256(ref.path) == m["sha256"] == ref.sha256
    assert ref.path.read_bytes()[:4] == b"QFI\xfb"  # qcow2 magic
    pub = (lab.IMAGES_DIR / m["paths"]["ssh_pubkey"]).read_text()
    assert pub.startswith("ssh-ed25519 ")
    assert images.key_fingerprint(pub) == m["ssh_key_fingerprint"]
    assert oct((lab.IMAGES_DIR / m["paths"]["ssh_key"]).stat().st_mode & 0o777) == "0o600"


@pytest.mark.image
@needs_image
def test_built_image_is_up_to_date_with_the_checkout():
    ref = images.load("debian12")
    current = images.recipe_digest("debian12")
    if ref.digest != current:
        pytest.skip("the recipe changed since the image was built: run `make images`")
    assert images.up_to_date("debian12") == ref
    # build() is a no-op for an up-to-date image: it returns at once and reports so.
    heard: list[str] = []
    assert images.build("debian12", progress=heard.append) == ref
    assert len(heard) == 1 and heard[0].startswith("up to date")


@pytest.mark.image
@needs_image
def test_manifest_records_the_image_host_keys():
    ref = images.load("debian12")
    if "ssh_host_keys" not in ref.manifest:
        pytest.skip("images/debian12.json predates the host keys: `lab images build debian12 --force`")
    keys = images.host_keys(ref)
    assert "ssh-ed25519" in [k["type"] for k in keys]  # the one sshd offers (templates/image sshd_config)
    for k in keys:
        assert k["fingerprint"] == images.key_fingerprint(f"{k['type']} {k['key']}")
