"""Throw-away TLS material for the emulator, made with the `openssl` CLI (through lab.proc)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lab import proc


@dataclass(frozen=True)
class CertSet:
    ca_file: Path  # what a client trusts
    cert_file: Path  # server certificate, signed by the CA
    key_file: Path


def make_ca(directory: Path, name: str = "lab-test-ca") -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    key, crt = directory / f"{name}.key", directory / f"{name}.pem"
    proc.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            key,
            "-out",
            crt,
            "-days",
            "2",
            "-subj",
            f"/CN={name}",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
        timeout=30,
        what="openssl req (CA)",
    )
    return key, crt


def make_certs(directory: Path) -> CertSet:
    """A CA and a server certificate for 127.0.0.1/localhost signed by it."""
    directory = Path(directory)
    ca_key, ca_crt = make_ca(directory)
    key, csr, crt = directory / "server.key", directory / "server.csr", directory / "server.pem"
    ext = directory / "server.ext"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
    )
    proc.run(
        [
            "openssl",
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            key,
            "-out",
            csr,
            "-subj",
            "/CN=pve-emulator",
        ],
        timeout=30,
        what="openssl req (server)",
    )
    proc.run(
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            ca_crt,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            crt,
            "-days",
            "2",
            "-extfile",
            ext,
        ],
        timeout=30,
        what="openssl x509 (sign)",
    )
    return CertSet(ca_crt, crt, key)
