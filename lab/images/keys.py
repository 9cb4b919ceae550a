"""The lab's SSH key (images/lab_key): made once, baked into every image, root's only way in."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import lab
from lab import proc

KEY_NAME = "lab_key"


def ensure_key(images_dir: Path | None = None) -> Path:
    """images/lab_key (ed25519, no passphrase): generated once, the lab's SSH key for root."""
    idir = Path(images_dir or lab.IMAGES_DIR)
    key, pub = idir / KEY_NAME, idir / f"{KEY_NAME}.pub"
    if key.is_file() and pub.is_file():
        return key
    if key.is_file():  # never throw a private key away: derive its public half
        res = proc.run(["ssh-keygen", "-y", "-f", key], timeout=30, what="ssh-keygen -y")
        pub.write_text(res.stdout.strip() + " lab@golden-images\n")
        return key
    key.parent.mkdir(parents=True, exist_ok=True)
    pub.unlink(missing_ok=True)
    proc.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "lab@golden-images", "-f", key],
        timeout=30,
        what="ssh-keygen",
    )
    key.chmod(0o600)
    return key


def key_fingerprint(pubkey_line: str) -> str:
    """OpenSSH's SHA256 fingerprint of a public key line (as `ssh-keygen -lf` prints it)."""
    parts = pubkey_line.split()
    if len(parts) < 2:
        raise ValueError("not an OpenSSH public key line")
    blob = base64.b64decode(parts[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
