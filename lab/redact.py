"""One function keeps a password out of whatever the lab prints, logs or stores: the password in a
URL's user-info (`https://user:PASSWORD@pve1:8006`, `qemu+ssh://root:PASSWORD@kvm1/system`).

lab.toml refuses such URLs (secrets are `env:`/`file:` references), but the refusal itself, a
tool's error message or a library's exception may still carry one: every LabError's message and
hint, every warning and unexpected error the CLI prints, every line the consoles render and the
JSON the results store keeps pass through `passwords`.
"""

from __future__ import annotations

import re

# scheme://user:password@ ; the user may hold an "@" (PVE's root@pam), the password runs to the
# authority's last "@" (an unencoded "@" in it stays hidden), neither past a "/", a space or a quote
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:'\"]*):[^/\s'\"]*@")
HIDDEN = "<redacted>"


def passwords(text: str) -> str:
    """`text` with the password of every URL's user-info replaced by <redacted>."""
    return _USERINFO.sub(rf"\1:{HIDDEN}@", text) if "://" in text else text
