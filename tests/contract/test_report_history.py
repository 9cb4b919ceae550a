"""`lab report --history`: a trend chart per series of the run, opened in headless Chromium."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from support.chromium import chromium_render
from support.cli import lab_cli
from support.seriesstore import FACTS, add_runs
from test_history import STEP

from lab import report
from lab.store import Store

CAPPED = {**FACTS, "cpu_quota": "0.5 CPUs"}


class _Trends(HTMLParser):
    """The DOM Chromium built: each trend <figure> with its verdict and whether an <svg> is inside."""

    def __init__(self):
        super().__init__()
        self.figures: list[dict] = []
        self.ids: set[str] = set()
        self.depth = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "figure" and "trend" in (a.get("class") or ""):
            self.figures.append({"verdict": a.get("data-verdict"), "metric": a.get("data-metric"), "svg": 0})
            self.depth = 1
        elif self.depth and tag == "svg":
            self.figures[-1]["svg"] += 1

    def handle_endtag(self, tag):
        if tag == "figure":
            self.depth = 0


def test_report_history_shows_a_trend_chart_per_series_in_chromium(tmp_path):
    where = tmp_path / "results"
    add_runs(where, STEP, facts=[FACTS] * 3 + [CAPPED] * 3)
    add_runs(where, [900.0, 901.0, 899.0], prefix="e", axes={"nic": "e1000"})  # another series: too short
    res = lab_cli("report", "r4", "--history", "--results", str(where), "-o", str(tmp_path / "r.html"))
    assert res.returncode == 0, res.stderr
    page = tmp_path / "r.html"
    text = page.read_text()
    # the run's own series only, with the change, its size and the fact beside the chart
    assert text.count('class="trend"') == 1 and 'data-verdict="changed"' in text
    assert re.search(r'<div class="change worse">worse -30\.\d % \[', text)
    assert "changed: cpu_quota none -&gt; 0.5 CPUs" in text
    assert "http://" not in text and "<script" not in text  # self-contained, as every report
    dom_text, console = chromium_render(page, tmp_path / "shot.png", tmp_path / "profile")
    assert not console, console
    dom = _Trends()
    dom.feed(dom_text)
    assert "history" in dom.ids
    assert dom.figures == [{"verdict": "changed", "metric": "events_per_s_1t", "svg": 1}]
    # the chart itself: the six run labels on its axis and the change's size at its line
    svg = text[text.index('<figure id="history-0"') :]
    svg = svg[: svg.index("</figure>")]
    assert all(f">r{i}<" in svg for i in range(6)) and ">-30." in svg
    # without --history, no such section; the other run's report has its own series
    assert 'id="history"' not in report.render(Store(where, readonly=True), "r4")
    other = report.render(Store(where, readonly=True), "e1", history=True)
    assert other.count('class="trend"') == 1 and 'data-verdict="too short"' in other
