"""`lab report`: the HTML report of a run (and against a second run), built from a real Store.

The store is made with the Store API (two runs, two cells each, one failed cell, host facts that
differ) and the report is checked as text (tables, verdicts, a chart per metric, manifest, lab.toml,
escaping, self-contained) and rendered by a real headless Chromium (screenshot + DOM).
"""

from __future__ import annotations

import html
import json
import re
import struct
import subprocess
import sys
import time
from html.parser import HTMLParser

import pytest
from support.chromium import chromium_render

from lab import report, stats
from lab.model import RawOutput, Sample
from lab.store import Store

HOSTILE = '<script>alert("toml")</script>'
CONFIG_A = f"""[lab]
name = "nic & tuning {HOSTILE}"
results = "results"

[matrix]
nic = ["virtio", "e1000"]   # a < b && c > d
"""
CONFIG_B = CONFIG_A.replace("virtio", "virtio") + "\n[suite]\nrepetitions = 5\n"

MANIFEST = {
    "images": {
        "debian12": {
            "digest": "d" * 64,
            "sha256": "5" * 64,
            "tools": {"iperf3": "iperf 3.12", "sysbench": "sysbench 1.0.20"},
        }
    },
    "workloads": {"iperf3-tcp": {"time": 3, "directions": ["tx", "rx"]}, "sysbench-memory": {"time": 2}},
    "order": ["c01", "c02"],
    "backends": {"local": {"accel": "tcg", "qemu": "7.2.22"}},
}

AXES = {
    "virtio": {
        "host": "local",
        "image": "debian12",
        "nic": "virtio",
        "vcpus": 2,
        "memory_mib": 1024,
        "disk_bus": "virtio",
        "clone": "linked",
        "tuning": "default",
    }
}
AXES["e1000"] = {**AXES["virtio"], "nic": "e1000"}
LABEL = {nic: f"local/debian12/{nic}/2c/1024m/virtio/linked/default" for nic in AXES}

# (run, nic) -> per-repetition values; 5 repetitions so the exact test can reach p < 0.05.
THROUGHPUT_TX = {
    ("run-a", "virtio"): [2300, 2310, 2290, 2305, 2295],
    ("run-a", "e1000"): [300, 305, 298, 302, 301],
    ("run-b", "virtio"): [2600, 2610, 2590, 2605, 2620],
}  # B better
MEMORY = {
    ("run-a", "virtio"): [290, 291, 289, 292, 290],
    ("run-a", "e1000"): [99, 100, 98, 101, 99],
    ("run-b", "virtio"): [250, 251, 249, 252, 250],
}  # B worse
HTTP = {
    ("run-a", "virtio"): [900, 905, 899, 902, 901],
    ("run-a", "e1000"): [1048, 1050, 1047, 1049, 1046],
    ("run-b", "virtio"): [901, 903, 900, 904, 899],
}


def _cell_facts(nic: str) -> dict:
    return {
        "accel": "tcg",
        "boot_seconds": 15.34 if nic == "virtio" else 19.34,
        "clone": "linked",
        "image_digest": "d" * 64,
        "tuning": {
            "profile": "default",
            "applicable": True,
            "reason": "",
            "effective": {"net.ipv4.tcp_congestion_control": "cubic"},
        },
        "verified": {
            "kernel": "Linux 6.1.0-56-amd64",
            "mem_kib": 983624,
            "nic_driver": "virtio_net" if nic == "virtio" else "e1000",
            "vcpus": 2,
        },
    }


def _host(kernel: str, microcode: str) -> dict:
    return {
        "host": "local",
        "backend": "local",
        "cpu_model": "Intel(R) Xeon(R) Processor",
        "cores": 2,
        "kernel": kernel,
        "microcode": microcode,
        "mitigations": {"retbleed": "Vulnerable"},
        "virt_flags": ["hypervisor"],
        "kvm_device": True,
    }


def _samples(store: Store, run: str, cell: str, nic: str) -> None:
    for rep in range(5):
        raw = RawOutput("iperf3-tcp", "iperf3 -c 10.0.0.1", "{}")
        rid = store.add_raw(run, cell, rep, raw)
        lab = {"nic": nic, "repetition": rep}
        tx = THROUGHPUT_TX[(run, nic)][rep]
        store.add_samples(
            run,
            cell,
            rid,
            "iperf3-tcp",
            rep,
            [
                Sample("throughput_mbit_s_tx", tx, "Mbit/s", True, lab),
                Sample("throughput_mbit_s_rx", tx * 0.9, "Mbit/s", True, lab),
                Sample("cpu_busy_pct_tx", 50 + rep, "%", False, lab),
                Sample("cpu_busy_pct_rx", 60 + rep, "%", False, lab),
                Sample("cpu_busy_pct", 55 + rep, "%", False, lab),
                Sample("cpu_sys_pct_tx", 40 + rep, "%", None, lab),
            ],
        )
        store.add_samples(
            run,
            cell,
            None,
            "sysbench-memory",
            rep,
            [
                Sample("throughput_mib_s", MEMORY[(run, nic)][rep], "MiB/s", True, lab),
                Sample("cpu_busy_pct", 45 + rep, "%", False, lab),
            ],
        )
        flagged = {**lab, "flagged": 1} if rep == 2 and run == "run-a" and nic == "e1000" else lab
        store.add_samples(
            run,
            cell,
            None,
            "http",
            rep,
            [
                Sample("requests_per_s_c10", HTTP[(run, nic)][rep], "req/s", True, flagged),
                Sample("errors_c10", 3 if flagged is not lab else 0, "count", False, flagged),
                Sample("cpu_busy_pct_c10", 80 + rep, "%", False, flagged),
            ],
        )


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    s = Store(tmp_path_factory.mktemp("report") / "results")
    for run, text, kernel, mc in (
        ("run-a", CONFIG_A, "6.1.0-56-amd64", "0x1"),
        ("run-b", CONFIG_B, "6.12.9-amd64", "0x2"),
    ):
        s.create_run(
            run,
            f"nic {HOSTILE}",
            config_path="/srv/lab/lab.toml",
            config_text=text,
            seed=7,
            lab_version="0.1.0",
            manifest=MANIFEST,
        )
        s.host_facts.add(run, "local", f"fp-{run}", _host(kernel, mc))
        for idx, nic in enumerate(("virtio", "e1000"), start=1):
            cell = f"c{idx:02d}"
            s.add_cell(run, cell, idx, LABEL[nic], AXES[nic])
            if run == "run-b" and nic == "e1000":
                s.cell_update(
                    run,
                    cell,
                    status="failed",
                    stage="boot",
                    error="no LAB-READY on the serial console within 300 s <tail: 'kernel panic'>",
                )
                continue
            s.cell_update(run, cell, status="done", stage="workloads", facts=_cell_facts(nic))
            _samples(s, run, cell, nic)
        s.finish_run(run, "done" if run == "run-a" else "failed", None if run == "run-a" else "1 cell failed")
    yield s
    s.close()


@pytest.fixture(scope="module")
def single(store) -> str:
    return report.render(store, "run-a", generated_at=0)


@pytest.fixture(scope="module")
def versus(store) -> str:
    return report.render(store, "run-a", "run-b", generated_at=0)


# -- text checks -------------------------------------------------------------------------------------

CHARTED = {
    ("iperf3-tcp", "throughput_mbit_s_tx"),
    ("iperf3-tcp", "throughput_mbit_s_rx"),
    ("sysbench-memory", "throughput_mib_s"),
    ("http", "requests_per_s_c10"),
    ("http", "errors_c10"),
}


def _figures(page: str) -> dict[str, str]:
    """figure id -> its inner HTML."""
    return dict(re.findall(r'<figure id="(chart-[^"]+)"[^>]*>(.*?)</figure>', page, re.S))


@pytest.mark.parametrize("which", ["single", "versus"])
def test_a_chart_per_metric_with_cpu_beside_it(which, request):
    page = request.getfixturevalue(which)
    figs = _figures(page)
    assert set(figs) == {f"chart-{wl}-{m}" for wl, m in CHARTED}  # CPU and zero error counters have no chart
    for fid, inner in figs.items():
        assert inner.count("<svg") == 1, fid
        assert "</svg>" in inner
    # the CPU panel is the one measured with the metric's variant
    assert "cpu_busy_pct_tx" in figs["chart-iperf3-tcp-throughput_mbit_s_tx"]
    assert "cpu_busy_pct_rx" in figs["chart-iperf3-tcp-throughput_mbit_s_rx"]
    assert "cpu_busy_pct_c10" in figs["chart-http-requests_per_s_c10"]
    assert re.search(r"CPU: <span[^>]*>cpu_busy_pct</span>", figs["chart-sysbench-memory-throughput_mib_s"])
    # SVG ids are unique across the charts (they all live in one document)
    ids = re.findall(r'\sid="([^"]+)"', page)
    assert len(ids) == len(set(ids))


def test_results_table_has_median_ci_cv_n_cpu_and_flags(single):
    tables = re.findall(r'<table class="results" data-run="run-a" data-workload="([^"]+)">(.*?)</table>', single, re.S)
    by_wl = dict(tables)
    assert set(by_wl) == {"iperf3-tcp", "sysbench-memory", "http"}
    for col in ("median", "95 % CI", "min–max", "CV", "n", "CPU busy %"):
        assert f">{col}</th>" in by_wl["sysbench-memory"]
    s = stats.summarize(MEMORY[("run-a", "virtio")], seed=7)
    row = re.search(
        r"<tr[^>]*>\s*<td[^>]*>virtio</td>\s*<td><span class=\"mono\">throughput_mib_s</span>(.*?)</tr>",
        by_wl["sysbench-memory"],
        re.S,
    ).group(1)
    cells = [html.unescape(c) for c in re.findall(r'<td class="num">(.*?)</td>', row, re.S)]
    assert cells[0].startswith(report.fmt(s.median))
    assert cells[1] == f"{report.fmt(s.ci_low)} – {report.fmt(s.ci_high)}"
    assert cells[2] == f"{report.fmt(s.min)} – {report.fmt(s.max)}"
    assert cells[3] == f"{s.cv * 100:.1f} %"
    assert cells[4] == "5"
    assert cells[5] == report.fmt(47.0)  # median of cpu_busy_pct 45..49
    # one flagged repetition of e1000's http run is marked; zero error counters are not listed
    assert "⚑1" in by_wl["http"]
    assert "errors_c10" in by_wl["http"]  # non-zero there (3) so shown
    assert "cpu_sys_pct" not in single.split('id="results"')[1].split('id="cells"')[0]


def test_comparison_table_verdicts_and_missing(versus):
    table = re.search(r'<table class="wide" id="compare-table">(.*?)</table>', versus, re.S).group(1)
    rows = re.findall(r'<tr class="([^"]*)" data-verdict="([^"]+)">(.*?)</tr>', table, re.S)
    verdict = {}
    for cls, v, body in rows:
        cell = re.search(r'<td class="mono[^"]*">([^<]+)</td>', body).group(1)
        metric = re.search(r'<span class="mono">([^<]+)</span>', body).group(1)
        verdict[(cell, metric)] = (v, cls.split()[0])
    assert verdict[("virtio", "throughput_mbit_s_tx")] == ("better", "better")
    assert verdict[("virtio", "throughput_mib_s")] == ("worse", "worse")
    assert verdict[("virtio", "requests_per_s_c10")] == ("same", "same")  # +0.1 %: within ±7.5 %
    assert verdict[("e1000", "throughput_mbit_s_tx")] == ("missing in B", "missing")
    assert verdict[("virtio", "cpu_busy_pct_tx")] == ("exploratory", "info")  # not a headline metric
    # q over the 4 primary rows both sides have (3 moved at p = 0.0079: q = 0.0079 x 4 / 3), the margin
    tx = [b for _, _, b in rows if ">throughput_mbit_s_tx<" in b and ">virtio<" in b][0]
    assert '<td class="num">0.011</td><td class="num">±7.5 %</td>' in tx
    assert "4 primary rows tested" in versus
    siblings = re.search(r'<ul class="small" id="compare-siblings">(.*?)</ul>', versus, re.S).group(1)
    assert "iperf3-tcp throughput_mbit_s_*: 2 rows, every estimate on the better side (verdicts: 2 better)" in siblings
    # ratio B/A of the medians is shown
    assert report.fmt(2605 / 2300) in tx
    # the cells overview says which cell B is missing / failed
    cells = re.search(r'<table id="compare-cells">(.*?)</table>', versus, re.S).group(1)
    assert "status-failed" in cells and ">failed<" in cells
    assert "A = run-a, B = run-b" in versus


def test_failed_cells_with_stage_and_error(versus):
    failed = re.search(r'<section class="alert" id="failed">(.*?)</section>', versus, re.S).group(1)
    assert ">boot<" in failed
    assert (
        html.escape("no LAB-READY on the serial console within 300 s <tail: 'kernel panic'>", quote=False).replace(
            "'", "&#39;"
        )
        in failed
    )
    # the chart says why the failed cell has no bar
    assert (
        ">failed</text>" in _figures(versus)["chart-iperf3-tcp-throughput_mbit_s_tx"]
        or "failed" in _figures(versus)["chart-iperf3-tcp-throughput_mbit_s_tx"]
    )


def test_cell_facts_and_hosts(single, versus):
    cells = single.split('id="cells"')[1].split('id="hosts"')[0]
    for text in (
        "tcg",
        "virtio_net",
        "e1000",
        "15.34",
        "19.34",
        "961 MiB",
        "asked 1024 MiB",
        "net.ipv4.tcp_congestion_control = cubic",
        "Linux 6.1.0-56-amd64",
    ):
        assert text in cells, text
    hosts = versus.split('id="hosts"')[1].split('id="manifest"')[0]
    diff_rows = re.findall(r'<tr class="diff"><td class="mono">([^<]+)</td>', hosts)
    assert set(diff_rows) == {"fingerprint", "kernel", "microcode"}
    assert "6.12.9-amd64" in hosts and "mitigations.retbleed" in hosts
    assert "3</strong> host fact(s) differ" in hosts


def test_manifest_and_lab_toml_exact(versus):
    for run, text in (("run-a", CONFIG_A), ("run-b", CONFIG_B)):
        pre = re.search(rf'<pre class="manifest" data-run="{run}">(.*?)</pre>', versus, re.S).group(1)
        assert json.loads(html.unescape(pre)) == MANIFEST
        pre = re.search(rf'<pre class="config" data-run="{run}">(.*?)</pre>', versus, re.S).group(1)
        assert html.unescape(pre) == text


@pytest.mark.parametrize("which", ["single", "versus"])
def test_html_special_characters_are_escaped(which, request):
    page = request.getfixturevalue(which)
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(&#34;toml&#34;)&lt;/script&gt;" in page
    assert "a &lt; b &amp;&amp; c &gt; d" in page


@pytest.mark.parametrize("which", ["single", "versus"])
def test_self_contained(which, request):
    page = request.getfixturevalue(which)
    assert (
        "http://" not in page and "https://" not in page and "//" not in re.sub(r"<pre.*?</pre>", "", page, flags=re.S)
    )
    refs = re.findall(r"""\b(?:src|href|xlink:href|action|data)\s*=\s*["']?([^"'\s>]+)""", page)
    assert refs and all(r.startswith("#") for r in refs), [r for r in refs if not r.startswith("#")]
    assert "@import" not in page
    assert all(u.startswith("#") for u in re.findall(r"url\(\s*['\"]?([^)'\"]*)", page))
    assert "<link" not in page and "<iframe" not in page and "<img" not in page


def test_cli_writes_default_path_next_to_store(store):
    out = subprocess.run(
        [sys.executable, "-m", "lab", "report", "run-a", "--vs", "run-b", "--results", str(store.dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    path = store.dir / "report-run-a-vs-run-b.html"
    assert out.stdout.strip() == str(path)
    assert path.read_text().startswith("<!DOCTYPE html>")
    bad = subprocess.run(
        [sys.executable, "-m", "lab", "report", "nope", "--results", str(store.dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no run 'nope'" in bad.stderr


# -- a real browser --------------------------------------------------------------------------------


class _Dom(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.count: dict[str, int] = {}
        self.svg_in_figure = 0
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.count[tag] = self.count.get(tag, 0) + 1
        if tag == "svg" and "figure" in self.stack:
            self.svg_in_figure += 1
        if dict(attrs).get("id"):
            self.ids.add(dict(attrs)["id"])
        if tag not in ("br", "meta", "path", "use", "rect", "circle", "line", "polyline", "ellipse", "stop", "img"):
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.stack:
            while self.stack and self.stack.pop() != tag:
                pass


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_chromium_renders_it(store, tmp_path):
    page = report.write(store, "run-a", "run-b", tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    started = time.monotonic()
    dom_text, console = chromium_render(page, shot, tmp_path / "profile")
    assert time.monotonic() - started < 60
    assert not console, console
    # the screenshot: a PNG of the window size with real content
    data = shot.read_bytes()
    assert _png_size(data) == (1280, 2000)
    assert len(data) > 30_000, len(data)
    from PIL import Image  # pillow comes with matplotlib

    with Image.open(shot) as im:
        colours = im.convert("RGB").resize((320, 500)).getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 50  # text, bars, tables: not a blank page
    # the DOM the browser built: every chart is an <svg> inside its <figure>, the tables are there
    dom = _Dom()
    dom.feed(dom_text)
    figures = len(_figures(page.read_text()))
    assert dom.count.get("figure") == figures == len(CHARTED)
    assert dom.svg_in_figure == figures
    assert {
        "comparison",
        "compare-table",
        "compare-cells",
        "failed",
        "charts",
        "results",
        "cells",
        "hosts",
        "manifest",
    } <= dom.ids
    assert dom.count.get("script", 0) == 0


def test_a_run_without_samples_or_hosts_still_renders(tmp_path):
    s = Store(tmp_path / "results")
    s.create_run(
        "run-c",
        "empty",
        config_path="lab.toml",
        config_text="not [valid toml",
        seed=None,
        lab_version="0.1.0",
        manifest={},
    )
    s.add_cell("run-c", "c01", 1, LABEL["virtio"], AXES["virtio"])
    s.cell_update("run-c", "c01", status="failed", stage="clone", error="disk full")
    page = report.render(s, "run-c")
    assert "No samples in this run." in page and "No host facts recorded." in page
    assert ">clone<" in page and "disk full" in page and "<svg" not in page
    s.close()
