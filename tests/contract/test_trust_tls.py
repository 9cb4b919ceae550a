"""Issue 16: TLS to Proxmox, against the PVE emulator's real TLS. https only (checked as lab.toml is
read); a ca_file that cannot be read is a one-line error before anything runs, and a relative one
is relative to lab.toml; the node certificate can be pinned by its SHA-256 fingerprint as PVE's
GUI shows it ("sha256:AB:CD:…"), for token and ticket logins alike, and a certificate that is not
the pinned one is an AuthError (exit 2) naming the fingerprint it has. No message ever suggests
turning verification off."""

from __future__ import annotations

import shutil
import ssl
import textwrap

import pytest
from pve_emulator.certs import make_certs
from pve_emulator.fixtures import (  # noqa: F401  (fixtures)
    FULL_ACL,
    TEST_IMAGE as IMAGE,
    VM_PRIVS,
    backend_settings,
    pve_certs_fixture,
    pve_env_fixture,
    pve_fixture,
)
from support.cli import lab_cli

from lab import config
from lab.backends.proxmox import ProxmoxBackend, tls
from lab.errors import AuthError, ConfigError


def fingerprint_of(pem_file) -> str:
    return tls.of_certificate(ssl.PEM_cert_to_DER_cert(pem_file.read_text()))


def test_fingerprints_read_as_pve_shows_them():
    colons = ":".join(["ab"] * 32)
    want = "sha256:" + ":".join(["AB"] * 32)
    assert tls.normalise(f"sha256:{colons}") == want
    assert tls.normalise(colons.upper()) == want
    assert tls.normalise("ab" * 32) == want
    assert tls.normalise("sha256:AB:CD") is None and tls.normalise("sha1:" + ":".join(["AB"] * 20)) is None
    err = Exception(f'Fingerprints did not match. Expected "{"ab" * 32}", got "{"cd" * 32}"')
    assert tls.seen_in(err) == "sha256:" + ":".join(["CD"] * 32)
    assert tls.seen_in(Exception("certificate verify failed")) is None


def test_the_pinned_certificate_is_trusted_without_a_ca(pve, pve_env):
    pin = fingerprint_of(pve.certs.cert_file)
    b = ProxmoxBackend("pve1", backend_settings(pve, ca_file=None, fingerprint=pin), pve_env)
    b.check()
    vm = b.clone(IMAGE, _spec())
    b.destroy(vm)
    assert pve.vm_ids() == []


def test_a_ticket_login_goes_through_the_pin_too(pve, pve_env):
    pve.add_user(
        "lab@pve", "pa55word", acl={"/vms": VM_PRIVS, "/storage": {"Datastore.AllocateSpace"}, "/sdn": {"SDN.Use"}}
    )
    pin = fingerprint_of(pve.certs.cert_file)
    b = ProxmoxBackend(
        "pve1",
        backend_settings(pve, ca_file=None, fingerprint=pin, token=None, user="lab@pve", password="pa55word"),
        pve_env,
    )
    b.check()
    b.session._call_once("renew", lambda: b.session.api()._backend.auth._get_new_tokens(password="pa55word"))
    assert any(path.endswith("/access/ticket") for _m, path, _p in pve.requests)
    bad = ProxmoxBackend(
        "pve1",
        backend_settings(pve, ca_file=None, fingerprint=pin, token=None, user="lab@pve", password="wrong"),
        pve_env,
    )
    with pytest.raises(AuthError, match="authentication failed"):
        bad.check()


@pytest.mark.parametrize("auth", ["token", "ticket"])
def test_another_certificate_is_refused_naming_its_fingerprint(pve, pve_env, tmp_path, auth):
    """The node answers with a certificate other than the pinned one (a machine posing as the node,
    or a renewed certificate): exit 2, one line naming what it saw; nothing is sent past TLS."""
    pin = fingerprint_of(make_certs(tmp_path / "other").cert_file)
    seen = fingerprint_of(pve.certs.cert_file)
    over = {"token": None, "user": "lab@pve", "password": "pa55word"} if auth == "ticket" else {}
    if auth == "ticket":
        pve.add_user("lab@pve", "pa55word", acl=FULL_ACL)
    before = len(pve.requests)
    b = ProxmoxBackend("pve1", backend_settings(pve, ca_file=None, fingerprint=pin, **over), pve_env)
    for look in (b.check, b.host_facts):
        with pytest.raises(AuthError) as err:
            look()
        assert err.value.exit_code == 2 and "\n" not in str(err.value)
        assert str(err.value) == f"pve1: the TLS certificate of {pve.url} has fingerprint {seen}, not the pinned {pin}"
        assert "verify" not in (err.value.hint or "") and "disable" not in (err.value.hint or "")
    assert len(pve.requests) == before  # no request (no token, no password) reached the server


def test_an_untrusted_certificate_hints_at_the_ca_or_a_pin_never_at_turning_checks_off(pve, pve_env):
    b = ProxmoxBackend("pve1", backend_settings(pve, ca_file=None), pve_env)  # the system's CAs only
    with pytest.raises(AuthError) as err:
        b.check()
    assert "TLS verification failed" in str(err.value)
    assert "ca_file" in err.value.hint and "fingerprint" in err.value.hint
    assert "verify_tls" not in err.value.hint and "disable" not in err.value.hint.lower()


PVE_TOML = """
[lab]
results = "results"
[hosts.pve1]
backend = "proxmox"
url = "{url}"
node = "pve1"
token = "env:LAB_TEST_TLS_TOKEN"
{tls}
template = 9000
[matrix]
host = ["pve1"]
"""


def write_lab(tmp_path, url: str, tls_lines: str):
    (tmp_path / "lab.toml").write_text(textwrap.dedent(PVE_TOML.format(url=url, tls=tls_lines)))
    return tmp_path / "lab.toml"


def test_a_relative_ca_file_is_relative_to_lab_toml(pve, tmp_path, monkeypatch):
    shutil.copy(pve.certs.ca_file, tmp_path / "pve-root-ca.pem")
    path = write_lab(tmp_path, pve.url, 'ca_file = "pve-root-ca.pem"')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = config.load(path)
    assert cfg.hosts["pve1"].ca_file == str(tmp_path / "pve-root-ca.pem")
    (tmp_path / "pve-root-ca.pem").unlink()
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert f"hosts.pve1.ca_file = 'pve-root-ca.pem': cannot read {tmp_path / 'pve-root-ca.pem'}" in str(err.value)


def test_snapshot_of_a_host_with_the_wrong_pin_exits_2_in_one_line_and_stores_nothing(pve, tmp_path, monkeypatch):
    pin = fingerprint_of(make_certs(tmp_path / "other").cert_file)
    write_lab(tmp_path, pve.url, f'fingerprint = "{pin}"')
    res = lab_cli(
        "snapshot", "pve1", cwd=tmp_path, env={"LAB_TEST_TLS_TOKEN": "lab@pve!lab=5ec2e75e-c2e7-4b00-9e11-d0n07l0g1t00"}
    )
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert (
        line.startswith("lab: error: pve1: the TLS certificate of")
        and f"fingerprint {fingerprint_of(pve.certs.cert_file)}" in line
    )
    assert not (tmp_path / "results").exists()


def test_snapshot_with_the_right_pin_works(pve, tmp_path):
    write_lab(tmp_path, pve.url, f'fingerprint = "{fingerprint_of(pve.certs.cert_file).lower()}"')
    res = lab_cli(
        "snapshot",
        "pve1",
        "--json",
        cwd=tmp_path,
        env={"LAB_TEST_TLS_TOKEN": "lab@pve!lab=5ec2e75e-c2e7-4b00-9e11-d0n07l0g1t00"},
    )
    assert res.returncode == 0, res.stderr
    assert '"fingerprint"' in res.stdout


def _spec():
    from lab.model import NicModel, VmSpec

    return VmSpec(
        name="lab-r1-c1",
        run_id="r1",
        cell_id="c1",
        image=IMAGE,
        nic=NicModel.VIRTIO,
        vcpus=1,
        memory_mib=512,
        ip="10.0.0.5",
        expires_at=1_900_000_000.0,
    )
