"""The docs site as a reader gets it (issue 37): built with `mkdocs build --strict`, served over HTTP on
loopback, loaded in headless Chromium (Debian's package): the pages render with their titles, the
generated reference holds its tables, and the search finds a lab.toml key.

Marked `browser`: make test's second pass runs it (a site build and a few Chromium loads, ~20 s),
the fast lane does not."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (the Makefile's apt list installs it)"),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # not --quiet: mkdocs 1.6 then stops counting warnings, and --strict would pass a broken link
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stderr[-3000:]
    return out


class _Site(SimpleHTTPRequestHandler):
    """The built site; /__wait holds a request 100 ms of real time (SEARCH_HARNESS's clock)."""

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def do_GET(self):
        if self.path.startswith("/__wait"):
            time.sleep(0.1)
            self.send_response(204)
            self.end_headers()
            return
        super().do_GET()


# The site's page with ?q= (Material opens its search with the query and runs it in a web worker over
# search_index.json) in a frame; the results' links are copied out. Headless Chromium's virtual time
# does not wait for the worker's real CPU time, but it pauses while a fetch is pending: each poll
# waits at the server, so the page sees real time pass.
SEARCH_HARNESS = """<!DOCTYPE html><html><head><title>search check</title></head><body>
<iframe id="site" src="/?q=QUERY" style="width:1200px;height:900px"></iframe><pre id="out">waiting</pre>
<script>
async function poll() {
  for (let i = 0; i < 300; i++) {
    const doc = document.getElementById("site").contentDocument;
    const items = doc ? doc.querySelectorAll(".md-search-result__item a") : [];
    if (items.length) {
      const hrefs = Array.from(items, a => a.getAttribute("href"));
      document.getElementById("out").textContent = "found\\n" + hrefs.join("\\n");
      return;
    }
    await fetch("/__wait?" + i);
  }
  document.getElementById("out").textContent = "timed out";
}
poll();
</script></body></html>
"""


@pytest.fixture(scope="module")
def served(site) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Site, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def dom(url: str, tmp_path: Path, wait_ms: int = 3000) -> str:
    """The page's DOM after its scripts ran for `wait_ms` of virtual time."""
    assert CHROMIUM
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # as root (CI); the page is this test's own
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--virtual-time-budget={wait_ms}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_pages_render_with_titles(served, tmp_path):
    for path, title, text in [
        ("/", "lab", "Getting started"),
        ("/getting-started/", "Getting started", "make run"),
        ("/backends/proxmox/", "Proxmox VE", "lab images publish"),
        ("/statistics/", "Statistics and verdicts", "A/A"),
    ]:
        page = dom(served + path, tmp_path)
        assert f"<title>{title}" in page, path
        assert text in page, path
        assert 'class="md-nav' in page, path  # Material's navigation was laid out


def test_reference_tables_render(served, tmp_path):
    page = dom(served + "/reference/lab-toml/", tmp_path)
    assert "<title>lab.toml keys" in page
    assert page.count("<table>") >= 10
    for key in ("remeasure_flagged", "lease_minutes", "placement", "zone_images", "subnets"):
        assert f"<code>{key}</code>" in page, key
    cli = dom(served + "/reference/cli/", tmp_path)
    assert "<code>--resume</code>" in cli and "<code>--fail-on-regression</code>" in cli
    params = dom(served + "/reference/workloads/", tmp_path)
    assert "iperf3-tcp" in params and "<table>" in params


def test_search_index_has_the_keys(site):
    index = json.loads((site / "search" / "search_index.json").read_text())
    docs = index["docs"]
    where = {d["location"].split("#")[0] for d in docs}
    assert {"reference/lab-toml/", "reference/cli/", "reference/workloads/", "backends/smartos/"} <= where
    text = " ".join(d["text"] for d in docs if d["location"].startswith("reference/lab-toml/"))
    for key in ("remeasure_flagged", "client_known_hosts", "fingerprint", "destroy_timeout"):
        assert key in text, key


def test_search_finds_a_key_in_the_browser(site, served, tmp_path):
    (site / "__search.html").write_text(SEARCH_HARNESS.replace("QUERY", "remeasure_flagged"))
    page = dom(served + "/__search.html", tmp_path, wait_ms=60000)
    out = page.split('<pre id="out">')[1].split("</pre>")[0]
    assert out.startswith("found"), out
    found = out.splitlines()[1:]
    assert any("/reference/lab-toml/" in href for href in found), found
    assert any("/configuration/" in href for href in found), found
