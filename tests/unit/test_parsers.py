"""Workload parsers against captured real outputs (tests/data/README.md says where each came from).

Every number asserted here is printed in the data file (or is simple arithmetic on printed numbers,
written out). Parsers are pure: these tests need no VM, no network and no subprocess.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.errors import LabError
from lab.model import RawOutput
from lab.workloads import cpu, http, iperf3, ping, sysbench, toolkit

DATA = Path(__file__).parents[1] / "data"


def read(rel: str) -> str:
    return (DATA / rel).read_text()


def by_metric(samples):
    out = {}
    for s in samples:
        assert s.metric not in out, f"metric {s.metric} emitted twice"
        out[s.metric] = s
    return out


# ---------------------------------------------------------------------------------------------
# sysbench cpu


@pytest.mark.parametrize(
    "rel, eps, avg, p95, threads, total_time, events",
    [
        ("sysbench/linux-1.0.20-cpu-t1.txt", 1100.46, 0.91, 0.97, 1, 2.0007, 2203),
        ("sysbench/linux-1.0.20-cpu-t2.txt", 1336.06, 1.49, 4.91, 2, 2.0009, 2676),
        ("sysbench/freebsd-constructed-1.0.20-cpu-t2.txt", 512.34, 3.90, 4.10, 2, 10.0021, 5125),
    ],
)
def test_sysbench_cpu_1_0(rel, eps, avg, p95, threads, total_time, events):
    r = sysbench.parse_cpu_output(read(rel))
    assert r["events_per_s"] == pytest.approx(eps, abs=1e-9)
    assert r["latency_avg_ms"] == pytest.approx(avg, abs=1e-9)
    assert r["latency_p95_ms"] == pytest.approx(p95, abs=1e-9)
    assert r["threads"] == threads
    assert r["total_time_s"] == pytest.approx(total_time)
    assert r["total_events"] == events


def test_sysbench_cpu_1_1_without_speed_block_derives_events_per_s():
    r = sysbench.parse_cpu_output(read("sysbench/published-1.1.0-cpu-no-speed-block.txt"))
    assert r["events_per_s"] == pytest.approx(314 / 10.0103)
    assert r["latency_avg_ms"] == pytest.approx(31.86)
    assert r["latency_p95_ms"] == pytest.approx(38.94)


def test_sysbench_cpu_0_4_old_format():
    r = sysbench.parse_cpu_output(read("sysbench/published-0.4.12-cpu-t1.txt"))
    assert r["events_per_s"] == pytest.approx(10000 / 46.1131)
    assert r["latency_avg_ms"] == pytest.approx(4.61)
    assert r["latency_p95_ms"] == pytest.approx(4.65)  # "approx.  95 percentile: 4.65ms"
    assert r["threads"] == 1


@pytest.mark.parametrize(
    "rel",
    ["sysbench/linux-1.0.20-cpu-rate1-no-event.txt", "sysbench/freebsd-constructed-1.0.20-cpu-rate1-no-event.txt"],
)
def test_sysbench_cpu_no_event_measured_no_rate_and_no_latency(rel):
    # --rate=1: sysbench printed "events per second: 0.00" and 0.00 latencies for an event that never ran
    r = sysbench.parse_cpu_output(read(rel))
    assert r["total_events"] == 0 and r["total_time_s"] == pytest.approx(1.1898)
    assert not {"events_per_s", "latency_avg_ms", "latency_p95_ms"} & set(r)
    assert r[toolkit.UNMEASURED] == "sysbench completed no event in 1.1898 s"


def test_sysbench_cpu_one_slow_event_is_a_measurement():
    r = sysbench.parse_cpu_output(read("sysbench/linux-1.0.20-cpu-rate1-one-event.txt"))
    assert (r["events_per_s"], r["latency_avg_ms"], r["total_events"]) == (pytest.approx(0.43), pytest.approx(1.26), 1)
    assert toolkit.UNMEASURED not in r


def test_sysbench_cpu_rate_printed_as_zero_is_derived_from_the_counts():
    # 1.0 prints %8.2f: below 0.005 events/s "0.00" hides real events; events / time does not
    text = read("sysbench/linux-1.0.20-cpu-rate1-one-event.txt").replace(
        "events per second:     0.43", "events per second:     0.00"
    )
    assert sysbench.parse_cpu_output(text)["events_per_s"] == pytest.approx(1 / 2.3207)


# ---------------------------------------------------------------------------------------------
# sysbench memory


@pytest.mark.parametrize(
    "rel, mib_s, ops_s, mib, threads",
    [
        ("sysbench/linux-1.0.20-memory-1K-write.txt", 7574.83, 7756630.44, 15160.81, 1),
        ("sysbench/linux-1.0.20-memory-1M-read-t2.txt", 43250.88, 43250.88, 86561.00, 2),
        ("sysbench/linux-1.0.20-memory-1K-write-t2-unlimited.txt", 3908.46, 4002258.66, 3914.22, 2),
        ("sysbench/freebsd-constructed-1.0.20-memory-1K-write.txt", 204.80, 209714.33, 2048.00, 1),
        ("sysbench/published-0.4.12-memory-1M-write.txt", 3855.80, 3855.80, 10240.00, 1),  # "MB/sec" = MiB
    ],
)
def test_sysbench_memory(rel, mib_s, ops_s, mib, threads):
    r = sysbench.parse_memory_output(read(rel))
    assert r["mib_per_s"] == pytest.approx(mib_s, abs=1e-9)
    assert r["operations_per_s"] == pytest.approx(ops_s, abs=1e-9)
    assert r["mib_transferred"] == pytest.approx(mib, abs=1e-9)
    assert r["threads"] == threads


def test_sysbench_memory_zero_operations_measured_nothing():
    r = sysbench.parse_memory_output(read("sysbench/linux-1.0.20-memory-0-operations.txt"))
    assert r["operations"] == 0 and r["mib_transferred"] == 0
    assert not {"mib_per_s", "operations_per_s", "latency_avg_ms", "latency_p95_ms"} & set(r)
    assert r[toolkit.UNMEASURED] == "sysbench did no memory operation in 0.0001 s"


def test_sysbench_memory_fatal_names_the_fatal_line():
    with pytest.raises(LabError, match=r"sysbench-memory: .*FATAL: Invalid value for memory-oper: bogus"):
        sysbench.parse_memory_output(read("sysbench/linux-1.0.20-memory-fatal.txt"))


@pytest.mark.parametrize(
    "text", ["", "garbage\nmore garbage\n", "sysbench 1.0.20 (using system LuaJIT 2.1.0-beta3)\n\nRunning"]
)
def test_sysbench_garbage_raises(text):
    with pytest.raises(LabError, match="sysbench-cpu"):
        sysbench.parse_cpu_output(text)
    with pytest.raises(LabError, match="sysbench-memory"):
        sysbench.parse_memory_output(text)


def test_sysbench_truncated_cpu_output_raises_with_first_line():
    text = read("sysbench/linux-1.0.20-cpu-t1.txt")
    cut = text[: text.index("CPU speed:")]
    with pytest.raises(LabError, match=r"first line of output: 'sysbench 1\.0\.20"):
        sysbench.parse_cpu_output(cut)


def test_sysbench_cpu_cut_after_events_but_before_latency_raises():
    text = read("sysbench/linux-1.0.20-cpu-t1.txt")
    with pytest.raises(LabError, match="latency"):
        sysbench.parse_cpu_output(text[: text.index("Latency (ms):")])


# ---------------------------------------------------------------------------------------------
# iperf3


@pytest.mark.parametrize(
    "rel, bps, retrans, reverse, streams",
    [
        ("iperf3/linux-3.12-tcp.json", 21154438809.41108, 0, False, 1),
        ("iperf3/linux-3.12-tcp-R.json", 20857376924.792233, 0, True, 1),
        ("iperf3/linux-3.12-tcp-P2.json", 19562097872.395683, 0, False, 2),
        ("iperf3/freebsd-constructed-tcp.json", 21154438809.41108, 17, False, 1),
    ],
)
def test_iperf3_tcp(rel, bps, retrans, reverse, streams):
    r = iperf3.parse_iperf3_json(read(rel))
    assert r["protocol"] == "tcp"
    assert r["throughput_mbit_s"] == pytest.approx(bps / 1e6, rel=1e-12)  # end.sum_received
    assert r["retransmits"] == retrans
    assert r["reverse"] is reverse
    assert r["streams"] == streams


def test_iperf3_tcp_bsd_without_retransmits():
    r = iperf3.parse_iperf3_json(read("iperf3/openbsd-constructed-tcp.json"))
    assert r["throughput_mbit_s"] == pytest.approx(21154438809.41108 / 1e6, rel=1e-12)
    assert "retransmits" not in r


@pytest.mark.parametrize(
    "rel, bps, jitter, loss, lost, packets, reverse",
    [
        ("iperf3/linux-3.12-udp-b100M.json", 100111277.17622218, 0.008237356458808494, 0, 0, 382, False),
        (
            "iperf3/linux-3.12-udp-b1G-R.json",
            982123927.6415513,
            0.004307828969535717,
            1.729559748427673,
            66,
            3813,
            True,
        ),
    ],
)
def test_iperf3_udp(rel, bps, jitter, loss, lost, packets, reverse):
    r = iperf3.parse_iperf3_json(read(rel))
    assert r["protocol"] == "udp"
    assert r["throughput_mbit_s"] == pytest.approx(bps / 1e6, rel=1e-12)  # end.sum_received
    assert r["jitter_ms"] == pytest.approx(jitter, rel=1e-12)
    assert r["loss_pct"] == pytest.approx(loss, rel=1e-12)
    assert r["lost_packets"] == lost and r["packets"] == packets
    assert r["reverse"] is reverse


def test_iperf3_udp_legacy_end_sum_only():
    r = iperf3.parse_iperf3_json(read("iperf3/legacy-3.9-constructed-udp-R.json"))
    # only end.sum (sender's rate 1000150475.2592255 bit/s) minus the 1.729559748427673 % lost
    assert r["throughput_mbit_s"] == pytest.approx(1000150475.2592255 * (1 - 1.729559748427673 / 100) / 1e6)
    assert r["jitter_ms"] == pytest.approx(0.004307828969535717)
    assert r["loss_pct"] == pytest.approx(1.729559748427673)
    assert r["packets"] == 3816


def test_iperf3_error_document():
    with pytest.raises(
        LabError, match="iperf3-tcp: iperf3 reported an error: unable to connect to server: Connection refused"
    ):
        iperf3.parse_iperf3_json(read("iperf3/linux-3.12-error-refused.json"), "iperf3-tcp")


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "not iperf3 JSON"),
        ("iperf3: error - unable to connect to server\n", r"first line of output: 'iperf3: error - unable to connect"),
        ("[1, 2]", "not an object"),
        ('{"start": {}, "end": {}}', "no start.test_start.protocol"),
    ],
)
def test_iperf3_garbage(text, match):
    with pytest.raises(LabError, match=match):
        iperf3.parse_iperf3_json(text)


def test_iperf3_truncated_json():
    text = read("iperf3/linux-3.12-tcp.json")
    with pytest.raises(LabError, match=r"not iperf3 JSON; first line of output: '\{'"):
        iperf3.parse_iperf3_json(text[: len(text) // 2])


def test_iperf3_tcp_without_end_sums():
    import json

    doc = json.loads(read("iperf3/linux-3.12-tcp.json"))
    doc["end"] = {}
    with pytest.raises(LabError, match="no end.sum_received"):
        iperf3.parse_iperf3_json(json.dumps(doc))


# ---------------------------------------------------------------------------------------------
# wrk


@pytest.mark.parametrize(
    "rel, rps, transfer_mib, p50, p75, p90, p99, requests",
    [
        ("wrk/linux-4.1.0-http-c10.txt", 1638.84, 340.98 / 1024, 3.49, 3.97, 4.51, 6.34, 3285),
        ("wrk/linux-4.1.0-http-c50.txt", 1640.85, 341.40 / 1024, 3.50, 4.07, 4.98, 500.07, 3302),
        ("wrk/linux-4.1.0-http-1m.txt", 892.10, 0.87 * 1024, 1.51, 4.34, 5.63, 7.72, 1785),
        ("wrk/linux-4.1.0-https-c10.txt", 172.25, 35.83 / 1024, 4.13, 8.02, 11.39, 19.23, 357),
    ],
)
def test_wrk_clean(rel, rps, transfer_mib, p50, p75, p90, p99, requests):
    r = http.parse_wrk_output(read(rel))
    assert r["requests_per_s"] == pytest.approx(rps)
    assert r["transfer_mib_s"] == pytest.approx(transfer_mib)
    assert (r["latency_p50_ms"], r["latency_p75_ms"], r["latency_p90_ms"], r["latency_p99_ms"]) == pytest.approx(
        (p50, p75, p90, p99)
    )
    assert r["requests"] == requests
    assert r["errors"] == 0 and r["non_2xx"] == 0


def test_wrk_errors_file():
    r = http.parse_wrk_output(read("wrk/linux-4.1.0-http-errors.txt"))
    assert (
        r["socket_errors_connect"],
        r["socket_errors_read"],
        r["socket_errors_write"],
        r["socket_errors_timeout"],
    ) == (0, 20, 0, 10)
    assert r["non_2xx"] == 19
    assert r["errors"] == 49
    assert r["requests_per_s"] == pytest.approx(80.86)
    assert r["transfer_mib_s"] == pytest.approx(5.45 / 1024)
    assert r["latency_p50_ms"] == pytest.approx(0.045)  # "45.00us"
    assert r["latency_p99_ms"] == pytest.approx(2.06)


def test_wrk_404_is_non_2xx():
    r = http.parse_wrk_output(read("wrk/linux-4.1.0-http-404.txt"))
    assert r["non_2xx"] == 3594 and r["requests"] == 3594 and r["errors"] == 3594
    assert r["transfer_mib_s"] == pytest.approx(869.44 / 1024)


def test_wrk_write_errors():
    r = http.parse_wrk_output(read("wrk/linux-4.1.0-http-write-errors.txt"))
    assert (r["socket_errors_read"], r["socket_errors_write"]) == (3, 208097)
    assert r["requests_per_s"] == pytest.approx(89027.08)
    assert r["transfer_mib_s"] == pytest.approx(5.69)
    assert r["latency_p75_ms"] == pytest.approx(0.025)


def test_wrk_connect_errors_no_requests():
    r = http.parse_wrk_output(read("wrk/linux-4.1.0-https-connect-errors.txt"))
    assert r["socket_errors_connect"] == 3006 and r["requests"] == 0
    # wrk prints "Requests/sec: 0.00" and 0.00us latencies: nothing was measured, so nothing is kept
    assert not {"requests_per_s", "transfer_mib_s", *http.LATENCIES} & set(r)
    assert r[toolkit.UNMEASURED] == "wrk completed no request in 2.1 s"


def test_wrk_server_that_never_answers():
    r = http.parse_wrk_output(read("wrk/linux-4.1.0-http-never-answers.txt"))
    assert r["requests"] == 0 and r["errors"] == 0  # no error line: wrk saw no error, and no answer
    assert not {"requests_per_s", "transfer_mib_s", *http.LATENCIES} & set(r)
    assert r[toolkit.UNMEASURED] == "wrk completed no request in 2.02 s"


def test_wrk_all_timeouts_has_a_rate_but_no_latency():
    r = http.parse_wrk_output(read("wrk/linux-4.1.0-http-all-timeouts.txt"))
    assert (r["requests"], r["socket_errors_timeout"], r["errors"]) == (8, 8, 8)
    assert r["requests_per_s"] == pytest.approx(1.98)  # the answers came, late
    assert not set(http.LATENCIES) & set(r)  # "50%    0.00us": wrk's latency histogram is empty
    assert r[toolkit.UNMEASURED] == "wrk recorded no latency: all 8 completed requests timed out in 4.04 s"


def test_wrk_refused_raises_with_first_line():
    with pytest.raises(LabError, match=r"https: .*'unable to connect to 127\.0\.0\.1:18081 Connection refused'"):
        http.parse_wrk_output(read("wrk/linux-4.1.0-http-refused.txt"), "https")


@pytest.mark.parametrize(
    "cut_at, match",
    [
        ("Requests/sec:", "Requests/sec"),
        ("  Latency Distribution", "Latency Distribution"),
    ],
)
def test_wrk_truncated(cut_at, match):
    text = read("wrk/linux-4.1.0-http-c10.txt")
    cut = text[: text.index(cut_at)]
    if cut_at.strip() == "Latency Distribution":  # keep the tail so only the distribution is missing
        cut += text[text.index("  3285 requests") :]
    with pytest.raises(LabError, match=match):
        http.parse_wrk_output(cut)


def test_wrk_garbage():
    with pytest.raises(LabError, match=r"http: .*first line of output: 'hello'"):
        http.parse_wrk_output("hello\nworld\n")
    with pytest.raises(LabError, match="printed nothing"):
        http.parse_wrk_output("")


# ---------------------------------------------------------------------------------------------
# CPU ticks


def test_proc_stat_parse():
    t = cpu.parse_ticks(read("cpu/linux-proc-stat-before.txt"))  # cpu  8513 0 4215 120249 690 0 386 20 0 0
    assert t.source == "linux"
    assert (t.user, t.system, t.idle, t.steal) == (8513 + 0, 4215 + 0 + 386, 120249 + 690, 20)


def test_proc_stat_busy_pct_under_sysbench():
    before, after = read("cpu/linux-proc-stat-before.txt"), read("cpu/linux-proc-stat-after.txt")
    # after: cpu  8702 0 4224 120250 694 0 386 20 0 0
    d_user, d_sys, d_idle = 8702 - 8513, 4224 - 4215, (120250 + 694) - (120249 + 690)
    total = d_user + d_sys + d_idle
    assert cpu.busy_pct(before, after) == pytest.approx(100 * (d_user + d_sys) / total)
    u = cpu.usage(before, after)
    assert u["user_pct"] == pytest.approx(100 * 189 / 203)
    assert u["sys_pct"] == pytest.approx(100 * 9 / 203)
    assert u["steal_pct"] == 0


def test_proc_stat_busy_pct_sleep():
    u = cpu.usage(read("cpu/linux-sleep1-before.txt"), read("cpu/linux-sleep1-after.txt"))
    # before: cpu  30953 0 7918 165949 1219 0 566 44 0 0 ; after: cpu  31051 0 7928 166038 1221 0 567 44 0 0
    assert u["busy_pct"] == pytest.approx(100 * (98 + 10 + 1) / (98 + 10 + 1 + 89 + 2))


def test_freebsd_cp_time():
    t = cpu.parse_ticks(read("cpu/freebsd-14.4-published-sysctl-kern.cp_time.txt"))
    assert t.source == "freebsd"
    assert (t.user, t.system, t.idle) == (12473173 + 1, 3448733 + 167285, 326340387)
    # `sysctl -n` (what osfacts runs) prints the same numbers without the name
    assert cpu.parse_ticks("12473173 1 3448733 167285 326340387\n") == t


def test_netbsd_cp_time_named():
    t = cpu.parse_ticks(read("cpu/netbsd-published-sysctl-kern.cp_time.txt"))
    assert t.source == "netbsd"
    assert (t.user, t.system, t.idle) == (2930 + 42, 1334 + 1877, 46354)
    assert cpu.parse_ticks("user = 2930, nice = 42, sys = 1334, intr = 1877, idle = 46354") == t


def test_openbsd_cp_time_six_fields_with_spin():
    t = cpu.parse_ticks(read("cpu/openbsd-published-sysctl-kern.cp_time.txt"))
    assert t.source == "openbsd"
    assert (t.user, t.system, t.idle) == (765981 + 576, 193424 + 42002 + 3534, 3819889)
    t2 = cpu.parse_ticks(read("cpu/openbsd-7.3-published-sysctl-n-kern.cp_time.txt"))
    assert (t2.user, t2.system, t2.idle) == (2391, 1987 + 60 + 117, 976656)


def test_openbsd_named_form():
    t = cpu.parse_ticks("kern.cp_time=user=217735,nice=0,sys=167138,spin=0,intr=14268,idle=6855742")
    assert (t.user, t.system, t.idle, t.source) == (217735, 167138 + 14268, 6855742, "openbsd")


def test_bsd_busy_pct_from_real_snapshot_plus_derived_later_one():
    before = read("cpu/freebsd-14.4-published-sysctl-kern.cp_time.txt")
    # derived: 4 CPUs x 1 s at stathz 127 = 508 ticks; 300 user, 50 sys, 8 intr, 150 idle
    after = f"kern.cp_time: {12473173 + 300} 1 {3448733 + 50} {167285 + 8} {326340387 + 150}"
    assert cpu.busy_pct(before, after) == pytest.approx(100 * 358 / 508)
    ob = read("cpu/openbsd-7.3-published-sysctl-n-kern.cp_time.txt")  # 2391,0,1987,60,117,976656
    oa = "2491,0,2087,60,117,976756"  # +100 user, +100 sys, +100 idle
    assert cpu.busy_pct(ob, oa) == pytest.approx(100 * 200 / 300)


@pytest.mark.parametrize(
    "text",
    ["", "garbage", "cpu  1 2", "1 2 3 4", "1 2 3 4 5 6 7", "kern.cp_time: user = 1, nice = 2", "cpu0 1 2 3 4 5"],
)
def test_ticks_garbage(text):
    with pytest.raises(LabError, match="cpu ticks"):
        cpu.parse_ticks(text)


def test_busy_pct_refuses_backwards_and_still_counters():
    a, b = read("cpu/linux-proc-stat-before.txt"), read("cpu/linux-proc-stat-after.txt")
    with pytest.raises(LabError, match="backwards"):
        cpu.busy_pct(b, a)
    with pytest.raises(LabError, match="did not advance"):
        cpu.busy_pct(a, a)


def test_split_guest_output_real_capture():
    text = read("sysbench/linux-1.0.20-guest-script-cpu-t1.txt")
    before, out, after, rc = cpu.split_guest_output(text, "sysbench-cpu")
    assert before == "cpu  31067 0 7929 166038 1222 0 567 44 0 0"
    assert after == "cpu  31251 0 7944 166039 1224 0 567 44 0 0"
    assert rc == 0
    assert out.startswith("sysbench 1.0.20") and "events per second:  1026.31" in out
    assert sysbench.parse_cpu_output(out)["events_per_s"] == pytest.approx(1026.31)
    # busy: user +184, sys +15, idle +1 (+2 iowait)
    assert cpu.busy_pct(before, after) == pytest.approx(100 * 199 / 202)


def test_split_guest_output_cut_short_and_missing_markers():
    text = read("sysbench/linux-1.0.20-guest-script-cpu-t1.txt")
    before, out, after, rc = cpu.split_guest_output(text[: text.index("@@lab-cpu-after@@")])
    assert rc is None and after == "" and before.startswith("cpu ")
    with pytest.raises(LabError, match="no CPU snapshot markers"):
        cpu.split_guest_output("Permission denied\n", "sysbench-cpu")


# ---------------------------------------------------------------------------------------------
# Workload.parse on whole RawOutputs (segments + CPU snapshots)


def _segments(*items):
    return toolkit.join_segments([(tag, 0, read(rel)) for tag, rel in items])


LIN_B, LIN_A = "cpu  8513 0 4215 120249 690 0 386 20 0 0", "cpu  8702 0 4224 120250 694 0 386 20 0 0"


def test_sysbench_cpu_workload_parse():
    raw = RawOutput(
        "sysbench-cpu",
        "",
        _segments(("1t", "sysbench/linux-1.0.20-cpu-t1.txt"), ("nt", "sysbench/linux-1.0.20-cpu-t2.txt")),
        params={"vcpus": 2},
        extra={
            "cpu_before.1t": LIN_B,
            "cpu_after.1t": LIN_A,
            "cpu_before.nt": LIN_B,
            "cpu_after.nt": LIN_A,
            "cpu_before": LIN_B,
            "cpu_after": LIN_A,
        },
    )
    m = by_metric(sysbench.SYSBENCH_CPU.parse(raw))
    assert m["events_per_s_1t"].value == pytest.approx(1100.46)
    assert m["events_per_s_nt"].value == pytest.approx(1336.06)
    assert m["events_per_s_nt"].labels == {"threads": 2}
    assert (m["events_per_s_1t"].unit, m["events_per_s_1t"].higher_is_better) == ("events/s", True)
    assert (m["latency_p95_ms_nt"].value, m["latency_p95_ms_nt"].unit, m["latency_p95_ms_nt"].higher_is_better) == (
        pytest.approx(4.91),
        "ms",
        False,
    )
    assert m["latency_avg_ms_1t"].value == pytest.approx(0.91)
    busy = 100 * 198 / 203
    for name in ("cpu_busy_pct", "cpu_busy_pct_1t", "cpu_busy_pct_nt"):
        assert (m[name].value, m[name].unit, m[name].higher_is_better) == (pytest.approx(busy), "%", False)
    assert m["cpu_user_pct"].higher_is_better is None


def test_sysbench_cpu_parse_plain_output_without_segments():
    raw = RawOutput(
        "sysbench-cpu",
        "",
        read("sysbench/linux-1.0.20-cpu-t2.txt"),
        params={"vcpus": 2},
        extra={"cpu_before": LIN_B, "cpu_after": LIN_A},
    )
    m = by_metric(sysbench.SYSBENCH_CPU.parse(raw))
    assert m["events_per_s_nt"].value == pytest.approx(1336.06)
    assert "cpu_busy_pct" in m


def test_sysbench_cpu_failed_segment_mentions_exit_status():
    stdout = toolkit.join_segments([("1t", 1, read("sysbench/linux-1.0.20-memory-fatal.txt"))])
    raw = RawOutput("sysbench-cpu", "", stdout, returncode=1, extra={})
    with pytest.raises(LabError, match=r"sysbench-cpu: .*FATAL.*exit status 1"):
        sysbench.SYSBENCH_CPU.parse(raw)


def test_sysbench_memory_workload_parse_bsd_ticks():
    raw = RawOutput(
        "sysbench-memory",
        "",
        read("sysbench/freebsd-constructed-1.0.20-memory-1K-write.txt"),
        params={"block_size": "1K", "operation": "write"},
        extra={"cpu_before": "100 0 50 10 840", "cpu_after": "300 0 70 10 1020"},
    )
    m = by_metric(sysbench.SYSBENCH_MEMORY.parse(raw))
    assert (m["throughput_mib_s"].value, m["throughput_mib_s"].unit, m["throughput_mib_s"].higher_is_better) == (
        pytest.approx(204.80),
        "MiB/s",
        True,
    )
    assert m["throughput_mib_s"].labels == {"block_size": "1K", "operation": "write", "threads": 1}
    assert m["operations_per_s"].value == pytest.approx(209714.33)
    assert m["cpu_busy_pct"].value == pytest.approx(100 * 220 / 400)
    assert "cpu_steal_pct" not in m  # BSD counters have no steal


def test_sysbench_memory_missing_cpu_snapshots_raise():
    raw = RawOutput("sysbench-memory", "", read("sysbench/linux-1.0.20-memory-1K-write.txt"))
    with pytest.raises(LabError, match="sysbench-memory: no cpu_before"):
        sysbench.SYSBENCH_MEMORY.parse(raw)


def test_sysbench_cpu_workload_no_event_is_an_unmeasured_row_and_flags_the_rest():
    raw = RawOutput(
        "sysbench-cpu",
        "",
        _segments(("1t", "sysbench/linux-1.0.20-cpu-t1.txt"), ("nt", "sysbench/linux-1.0.20-cpu-rate1-no-event.txt")),
        params={"vcpus": 2},
        extra={"cpu_before.1t": LIN_B, "cpu_after.1t": LIN_A, "cpu_before.nt": LIN_B, "cpu_after.nt": LIN_A},
    )
    m = by_metric(sysbench.SYSBENCH_CPU.parse(raw))
    assert m["events_per_s_1t"].labels == {"threads": 1}  # the other load is untouched
    assert not any(k.endswith("_nt") and not k.startswith(("cpu_", "unmeasured")) for k in m)
    why = "sysbench completed no event in 1.1898 s"
    assert m["unmeasured_nt"].labels == {
        "threads": 1,
        "flagged": 1,
        "flagged_why": why,
        "unmeasured": "events_per_s_nt latency_avg_ms_nt latency_p95_ms_nt",
    }
    assert m["cpu_busy_pct_nt"].labels["flagged_why"] == why
    assert m["cpu_busy_pct"].labels == {"flagged": 1, "flagged_why": f"nt: {why}"}


def test_sysbench_memory_workload_zero_operations():
    raw = RawOutput(
        "sysbench-memory",
        "",
        read("sysbench/linux-1.0.20-memory-0-operations.txt"),
        params={"block_size": "1K", "operation": "write"},
        extra={"cpu_before": LIN_B, "cpu_after": LIN_A},
    )
    m = by_metric(sysbench.SYSBENCH_MEMORY.parse(raw))
    assert "throughput_mib_s" not in m and "operations_per_s" not in m
    assert m["unmeasured"].labels["unmeasured"] == "throughput_mib_s operations_per_s"
    assert m["unmeasured"].labels["flagged_why"] == "sysbench did no memory operation in 0.0001 s"
    assert m["cpu_busy_pct"].labels["flagged"] == 1


def test_iperf3_tcp_workload_parse_both_directions():
    raw = RawOutput(
        "iperf3-tcp",
        "",
        _segments(("tx", "iperf3/linux-3.12-tcp.json"), ("rx", "iperf3/linux-3.12-tcp-R.json")),
        extra={
            "cpu_before.tx": LIN_B,
            "cpu_after.tx": LIN_A,
            "cpu_before.rx": "cpu  1 0 1 98 0 0 0 0 0 0",
            "cpu_after.rx": "cpu  11 0 31 158 0 0 0 0 0 0",
            "cpu_before": LIN_B,
            "cpu_after": "cpu  11 0 31 158 0 0 0 0 0 0",
        },
    )
    m = by_metric(iperf3.IPERF3_TCP.parse(raw))
    assert m["throughput_mbit_s_tx"].value == pytest.approx(21154.43880941108)
    assert m["throughput_mbit_s_rx"].value == pytest.approx(20857.376924792232)
    assert (m["throughput_mbit_s_tx"].unit, m["throughput_mbit_s_tx"].higher_is_better) == ("Mbit/s", True)
    assert m["throughput_mbit_s_rx"].labels == {"direction": "rx", "streams": 1}
    assert (m["retransmits_tx"].value, m["retransmits_tx"].unit, m["retransmits_tx"].higher_is_better) == (
        0,
        "count",
        False,
    )
    assert m["cpu_busy_pct_rx"].value == pytest.approx(100 * 40 / 100)
    assert m["cpu_busy_pct_tx"].value == pytest.approx(100 * 198 / 203)
    # over both segments, tick-weighted: (198 + 40) / (203 + 100)
    assert m["cpu_busy_pct"].value == pytest.approx(100 * 238 / 303)


def test_iperf3_tcp_workload_parse_bsd_has_no_retransmits_sample():
    raw = RawOutput(
        "iperf3-tcp",
        "",
        _segments(("tx", "iperf3/openbsd-constructed-tcp.json")),
        extra={"cpu_before.tx": "1,0,1,0,0,98", "cpu_after.tx": "51,0,11,5,4,128"},
    )
    m = by_metric(iperf3.IPERF3_TCP.parse(raw))
    assert "retransmits_tx" not in m
    assert m["cpu_busy_pct_tx"].value == pytest.approx(100 * 69 / 99)


def test_iperf3_udp_workload_parse():
    raw = RawOutput(
        "iperf3-udp",
        "",
        _segments(("tx", "iperf3/linux-3.12-udp-b100M.json"), ("rx", "iperf3/linux-3.12-udp-b1G-R.json")),
        params={"bitrate": "100M"},
        extra={"cpu_before.tx": LIN_B, "cpu_after.tx": LIN_A, "cpu_before.rx": LIN_B, "cpu_after.rx": LIN_A},
    )
    m = by_metric(iperf3.IPERF3_UDP.parse(raw))
    assert m["throughput_mbit_s_tx"].value == pytest.approx(100.11127717622218)
    assert (m["jitter_ms_rx"].value, m["jitter_ms_rx"].unit, m["jitter_ms_rx"].higher_is_better) == (
        pytest.approx(0.004307828969535717),
        "ms",
        False,
    )
    assert (m["loss_pct_rx"].value, m["loss_pct_rx"].unit, m["loss_pct_rx"].higher_is_better) == (
        pytest.approx(1.729559748427673),
        "%",
        False,
    )
    assert m["loss_pct_tx"].value == 0


def test_iperf3_udp_receiver_that_got_nothing_measured_no_rate_jitter_or_loss():
    # captured: the data datagrams dropped after iperf3's UDP handshake; the receiver reports
    # packets 0, lost 0, "lost_percent": 0 and jitter 0 for the 39 datagrams the sender sent
    r = iperf3.parse_iperf3_json(read("iperf3/linux-3.12-udp-receiver-got-nothing.json"))
    assert not {"throughput_mbit_s", "jitter_ms", "loss_pct"} & set(r)
    assert r[toolkit.UNMEASURED] == "the iperf3 receiver got no datagram of the 39 sent"
    raw = RawOutput(
        "iperf3-udp",
        "",
        _segments(("tx", "iperf3/linux-3.12-udp-receiver-got-nothing.json")),
        params={"bitrate": "10M"},
        extra={"cpu_before.tx": LIN_B, "cpu_after.tx": LIN_A},
    )
    m = by_metric(iperf3.IPERF3_UDP.parse(raw))
    assert m["unmeasured_tx"].labels["unmeasured"] == "throughput_mbit_s_tx jitter_ms_tx loss_pct_tx"
    assert m["cpu_busy_pct_tx"].labels["flagged"] == 1


def test_iperf3_tcp_receiver_that_got_nothing():
    r = iperf3.parse_iperf3_json(read("iperf3/linux-constructed-tcp-receiver-got-nothing.json"))
    assert "throughput_mbit_s" not in r and r["retransmits"] == 0
    assert r[toolkit.UNMEASURED].startswith("the iperf3 receiver got no data in ")
    raw = RawOutput(
        "iperf3-tcp",
        "",
        _segments(("tx", "iperf3/linux-constructed-tcp-receiver-got-nothing.json")),
        extra={"cpu_before.tx": LIN_B, "cpu_after.tx": LIN_A},
    )
    m = by_metric(iperf3.IPERF3_TCP.parse(raw))
    assert m["unmeasured_tx"].labels["unmeasured"] == "throughput_mbit_s_tx"
    assert m["retransmits_tx"].labels["flagged"] == 1  # a count iperf3 made, kept beside the flag


def test_iperf3_workload_refuses_the_wrong_protocol():
    raw = RawOutput("iperf3-tcp", "", _segments(("tx", "iperf3/linux-3.12-udp-b100M.json")), extra={})
    with pytest.raises(LabError, match="UDP test"):
        iperf3.IPERF3_TCP.parse(raw)


def test_http_workload_parse_flags_errors():
    raw = RawOutput(
        "http",
        "",
        _segments(("c10", "wrk/linux-4.1.0-http-c10.txt"), ("c50", "wrk/linux-4.1.0-http-errors.txt")),
        extra={"cpu_before.c10": LIN_B, "cpu_after.c10": LIN_A, "cpu_before.c50": LIN_B, "cpu_after.c50": LIN_A},
    )
    samples = http.HTTP.parse(raw)
    m = by_metric(samples)
    assert m["requests_per_s_c10"].value == pytest.approx(1638.84)
    assert (m["requests_per_s_c10"].unit, m["requests_per_s_c10"].higher_is_better) == ("req/s", True)
    assert (m["transfer_mib_s_c10"].unit, m["transfer_mib_s_c10"].higher_is_better) == ("MiB/s", True)
    assert m["latency_p90_ms_c10"].value == pytest.approx(4.51)
    assert (m["latency_p99_ms_c10"].unit, m["latency_p99_ms_c10"].higher_is_better) == ("ms", False)
    assert m["requests_per_s_c10"].labels == {"connections": 10}
    assert m["errors_c10"].value == 0
    # the erroring segment is kept, and flagged with the reason
    why = "wrk counted 49 errors (20 read, 10 timeout, 19 non-2xx/3xx answers)"
    flagged = {"connections": 50, "flagged": 1, "flagged_why": why}
    assert m["errors_c50"].value == 49 and m["errors_c50"].labels == flagged
    assert m["requests_per_s_c50"].labels == flagged
    assert m["socket_errors_read_c50"].value == 20 and m["socket_errors_timeout_c50"].value == 10
    assert m["non_2xx_c50"].value == 19
    run_flag = {"flagged": 1, "flagged_why": f"c50: {why}"}
    assert (m["errors"].value, m["errors"].labels, m["errors"].higher_is_better) == (49, run_flag, False)
    assert m["cpu_busy_pct"].labels == run_flag
    assert m["cpu_busy_pct_c10"].labels == {"connections": 10}
    assert m["cpu_busy_pct_c50"].labels == flagged
    assert not any(k.startswith("unmeasured") for k in m)  # everything wrk printed there was measured


def test_https_workload_parse_no_requests_has_no_rate_and_no_latency():
    raw = RawOutput(
        "https",
        "",
        _segments(("c10", "wrk/linux-4.1.0-https-connect-errors.txt")),
        extra={"cpu_before.c10": LIN_B, "cpu_after.c10": LIN_A},
    )
    m = by_metric(http.HTTPS.parse(raw))
    assert m["socket_errors_connect_c10"].value == 3006  # a count wrk made: kept (flagged)
    assert not any(k.startswith(("requests_per_s", "transfer_", "latency_")) for k in m)
    row = m["unmeasured_c10"]
    assert (row.value, row.unit, row.higher_is_better) == (1.0, toolkit.UNMEASURED_UNIT, None)
    assert row.labels["unmeasured"] == (
        "requests_per_s_c10 transfer_mib_s_c10 latency_p50_ms_c10 latency_p75_ms_c10 "
        "latency_p90_ms_c10 latency_p99_ms_c10"
    )
    assert row.labels["flagged"] == 1
    assert row.labels["flagged_why"] == "wrk counted 3006 errors (3006 connect); wrk completed no request in 2.1 s"
    assert m["errors"].labels["flagged"] == 1 and m["cpu_busy_pct_c10"].labels["flagged"] == 1


def test_http_workload_all_timeouts_keeps_the_rate_flagged_and_drops_the_latencies():
    raw = RawOutput(
        "http",
        "",
        _segments(("c4", "wrk/linux-4.1.0-http-all-timeouts.txt")),
        extra={"cpu_before.c4": LIN_B, "cpu_after.c4": LIN_A},
    )
    m = by_metric(http.HTTP.parse(raw))
    assert m["requests_per_s_c4"].value == pytest.approx(1.98) and m["requests_per_s_c4"].labels["flagged"] == 1
    assert not any(k.startswith("latency_") for k in m)
    assert (
        m["unmeasured_c4"].labels["unmeasured"]
        == "latency_p50_ms_c4 latency_p75_ms_c4 latency_p90_ms_c4 latency_p99_ms_c4"
    )
    assert "all 8 completed requests timed out" in m["unmeasured_c4"].labels["flagged_why"]


def test_a_tool_that_exits_non_zero_flags_what_it_printed():
    raw = RawOutput(
        "http",
        "",
        toolkit.join_segments([("c10", 2, read("wrk/linux-4.1.0-http-c10.txt"))]),
        extra={"cpu_before.c10": LIN_B, "cpu_after.c10": LIN_A},
    )
    m = by_metric(http.HTTP.parse(raw))
    assert m["requests_per_s_c10"].labels == {
        "connections": 10,
        "flagged": 1,
        "flagged_why": "wrk exited with status 2",
    }


def test_segments_roundtrip():
    segs = [("tx", 0, "a\nb\n"), ("rx", 1, "c")]
    assert toolkit.split_segments(toolkit.join_segments(segs)) == [("tx", 0, "a\nb\n"), ("rx", 1, "c\n")]
    assert toolkit.split_segments("plain\n") == [("", 0, "plain\n")]


def test_parse_errors_carry_exit_status_and_stderr():
    raw = RawOutput(
        "iperf3-tcp", "", toolkit.join_segments([("tx", 127, "")]), stderr="sh: iperf3: not found\n", returncode=127
    )
    with pytest.raises(LabError, match=r"iperf3-tcp: .*\(iperf3 exit status 127\); stderr: 'sh: iperf3: not found'"):
        iperf3.IPERF3_TCP.parse(raw)
    raw = RawOutput(
        "http", "", toolkit.join_segments([("c10", 1, read("wrk/linux-4.1.0-http-refused.txt"))]), returncode=1
    )
    with pytest.raises(LabError, match=r"http: .*unable to connect.*\(wrk exit status 1\)"):
        http.HTTP.parse(raw)


# ---------------------------------------------------------------------------------------------
# ping (iputils, in the golden image's guest)


def test_ping_parses_iputils_summary():
    r = ping.parse_ping_output(read("ping/linux-iputils-20221126-replies.txt"))
    assert (r["sent"], r["received"], r["loss_pct"]) == (20, 20, 0.0)
    assert (r["min"], r["avg"], r["max"], r["mdev"]) == (0.419, 1.678, 6.2, 1.776)


def test_ping_rtt_line_with_pipe_or_ipg_suffix():
    """iputils (ping_common.c) appends ", pipe N" to the rtt line when N pings were in flight at once,
    as a loaded TCG guest makes it do, and ", ipg/ewma ..." when flooding: a CI run failed on it."""
    text = read("ping/linux-iputils-20221126-replies.txt").replace(" ms\n", " ms, pipe 2\n")
    assert text.rstrip().endswith("ms, pipe 2")
    r = ping.parse_ping_output(text)
    assert (r["min"], r["avg"], r["max"], r["mdev"]) == (0.419, 1.678, 6.2, 1.776)
    r = ping.parse_ping_output(text.replace("pipe 2", "pipe 3, ipg/ewma 0.204/1.013 ms"))
    assert r["avg"] == 1.678


def test_ping_without_a_reply_measured_no_round_trip():
    r = ping.parse_ping_output(read("ping/linux-iputils-20221126-no-reply.txt"))
    assert (r["sent"], r["received"], r["loss_pct"]) == (12, 0, 100.0) and "avg" not in r
    assert r[toolkit.UNMEASURED] == "no reply to the 12 pings sent"
    with pytest.raises(LabError, match="no 'packets transmitted"):
        ping.parse_ping_output("ping: connect: Network is unreachable\n")


def test_ping_workload_rows_flags_and_command():
    cpu = {"cpu_before": LIN_B, "cpu_after": LIN_A}
    raw = RawOutput("ping", "ping ...", read("ping/linux-iputils-20221126-replies.txt"), params={"size": 56}, extra=cpu)
    rows = by_metric(ping.PING.parse(raw))
    assert rows["rtt_avg_ms"].value == 1.678 and rows["rtt_avg_ms"].unit == "ms"
    assert rows["loss_pct"].value == 0 and not rows["rtt_avg_ms"].higher_is_better and "cpu_busy_pct" in rows
    lost = RawOutput("ping", "ping ...", read("ping/linux-iputils-20221126-no-reply.txt"), returncode=1, extra=cpu)
    rows = by_metric(ping.PING.parse(lost))
    assert rows["loss_pct"].value == 100 and "rtt_avg_ms" not in rows
    assert rows["unmeasured"].labels["flagged"] == 1 and rows["loss_pct"].labels["flagged"] == 1
    assert ping.ping_command("10.77.0.1", 20, 0.2, 56) == "ping -q -c 20 -i 0.2 -s 56 -w 9 10.77.0.1"
    assert ping.PING.estimate_seconds({"count": 20, "interval": 0.2, "size": 56}) == pytest.approx(5.0)
