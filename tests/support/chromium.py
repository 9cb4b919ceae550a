"""Pages rendered in headless Chromium: the HTML report and the docs site, as a browser shows them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
]


def chromium_render(page: Path, shot: Path, profile: Path, size: tuple[int, int] = (1280, 2000)):
    """Open `page` in headless Chromium (a fresh profile: the machine's network is closed), take a
    screenshot, dump the DOM. Returns (dom, console lines). Missing Chromium fails in CI (CI set),
    skips elsewhere. As root Chromium needs --no-sandbox."""
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (apt-get install chromium); required in CI")
        pytest.skip("chromium not installed (apt-get install -y chromium); CI runs this test")
    proc = subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--screenshot={shot}",
            f"--window-size={size[0]},{size[1]}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # page errors and failed loads are what the console shows; they must not happen
    console = [
        line
        for line in proc.stderr.splitlines()
        if "CONSOLE" in line or "Uncaught" in line or "net::ERR" in line or "Failed to load" in line
    ]
    return proc.stdout, console
