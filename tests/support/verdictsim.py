"""The verdicts' simulation: seeded synthetic comparisons of the default lab's primary rows, A/A and
with one row 10 % lower, with and without an A/A twin. tests/unit/test_verdicts.py asserts its
rates on 100 trials; tests/support/verdictrates.py prints them on 1,000."""

from __future__ import annotations

import collections

import numpy as np

from lab import stats, verdicts
from lab.compare import MetricSeries, Verdict, compare
from lab.workloads import load_all

N = 5  # lab.toml's repetitions


R = 999  # bootstrap resamples where a test checks the logic, not a rate


# The rows `lab compare latest --a nic=virtio --b nic=e1000` shows for the default lab, with the
# CV each had in this project's TCG runs (rounded): which are primary comes from the workloads.
DEFAULT_LAB_ROWS = [
    ("iperf3-tcp", "throughput_mbit_s_tx", "Mbit/s", True, 0.10),
    ("iperf3-tcp", "throughput_mbit_s_rx", "Mbit/s", True, 0.10),
    ("iperf3-tcp", "retransmits_tx", "count", False, 0.30),
    ("iperf3-tcp", "retransmits_rx", "count", False, 0.30),
    ("iperf3-tcp", "cpu_busy_pct_tx", "%", False, 0.05),
    ("iperf3-tcp", "cpu_busy_pct_rx", "%", False, 0.05),
    ("http", "requests_per_s_c50", "req/s", True, 0.05),
    ("http", "transfer_mib_s_c50", "MiB/s", True, 0.05),
    ("http", "latency_p50_ms_c50", "ms", False, 0.08),
    ("http", "latency_p75_ms_c50", "ms", False, 0.10),
    ("http", "latency_p90_ms_c50", "ms", False, 0.15),
    ("http", "latency_p99_ms_c50", "ms", False, 0.25),
    ("http", "cpu_busy_pct_c50", "%", False, 0.05),
    ("sysbench-cpu", "events_per_s_1t", "events/s", True, 0.03),
    ("sysbench-cpu", "events_per_s_nt", "events/s", True, 0.03),
    ("sysbench-cpu", "latency_avg_ms_1t", "ms", False, 0.03),
    ("sysbench-cpu", "latency_avg_ms_nt", "ms", False, 0.03),
    ("sysbench-cpu", "latency_p95_ms_1t", "ms", False, 0.05),
    ("sysbench-cpu", "latency_p95_ms_nt", "ms", False, 0.05),
    ("sysbench-cpu", "cpu_busy_pct_1t", "%", False, 0.02),
    ("sysbench-cpu", "cpu_busy_pct_nt", "%", False, 0.02),
]


def primary(workload: str, metric: str) -> bool:
    return load_all()[workload].primary_metrics.pattern_of(metric) is not None


PRIMARY = [row for row in DEFAULT_LAB_ROWS if primary(row[0], row[1])]


def sides(rng: np.random.Generator, rows, *, cv: float | None = None, shift: dict[int, float] | None = None):
    """Side A and B of one comparison, every row with N samples (normal, its CV or `cv`); `shift`:
    row index -> B's median over A's."""
    a, b = {}, {}
    for i, (wl, metric, unit, hib, row_cv) in enumerate(rows):
        c = row_cv if cv is None else cv
        mean_b = 100.0 * (shift or {}).get(i, 1.0)
        a[(wl, metric)] = MetricSeries(rng.normal(100.0, 100.0 * c, N), unit, hib, primary=primary(wl, metric))
        b[(wl, metric)] = MetricSeries(rng.normal(mean_b, mean_b * c, N), unit, hib, primary=primary(wl, metric))
    return a, b


def twin_bands(rng: np.random.Generator, a: dict, cv: float | None = None, resamples: int = R) -> dict:
    """The A/A band of each row, from a twin of side A measured N times as well."""
    out = {}
    for (*_, row_cv), (key, s) in zip(PRIMARY, a.items(), strict=True):
        c = row_cv if cv is None else cv
        out[key] = stats.noise_floor(s.values, rng.normal(100.0, 100.0 * c, N), n_resamples=resamples)
    return out


TRIALS_SHIFTED = PRIMARY[0][:2]  # the row 10 % lower in B: iperf3 throughput tx


def simulate(trials: int, resamples: int = R, margin_pct: float = verdicts.DEFAULT_MARGIN_PCT) -> dict[str, list[dict]]:
    """Per trial, without and with an A/A twin ("aa/False", "aa/True", "shift/..."): the verdicts
    (by key) of an A/A comparison of the default lab's primary rows at their own CVs, and of one at
    CV 3 % with iperf3's tx throughput 10 % lower in B. With the twin, each row is judged again
    against its band as compare() would (the same evidence and q, the margin from the band: what
    test_compare's band tests check compare itself does). tests/support/verdictrates.py runs it longer."""
    out: dict[str, list[dict]] = collections.defaultdict(list)
    for t in range(trials):
        rng = np.random.default_rng(34_000 + t)
        for what, (a, b), cv in (
            ("aa", sides(rng, PRIMARY), None),
            ("shift", sides(rng, PRIMARY, cv=0.03, shift={0: 0.9}), 0.03),
        ):
            bands = twin_bands(rng, a, cv, resamples)
            rows = compare(a, b, seed=t, n_resamples=resamples, margin_pct=margin_pct)
            out[f"{what}/False"].append({r.key: r.verdict for r in rows})
            out[f"{what}/True"].append({r.key: against_band(r, bands[r.key], margin_pct) for r in rows})
    return out


def against_band(r, band: stats.RatioCI, margin_pct: float) -> Verdict:
    ev = r.evidence()
    margin = verdicts.margin_for(band.band(), margin_pct)
    return Verdict(verdicts.decide(ev, higher_is_better=r.higher_is_better, margin=margin, q=r.q_value).value)
