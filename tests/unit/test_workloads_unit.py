"""Workload command construction and run() wiring, without a VM.

* Pure: the exact argv/command strings each workload would run for given params.
* Scripted guest: run() against a fake Guest that answers with captured outputs, checking what
  reaches the guest and what lands in RawOutput.
* Loopback: run() end to end on this machine, with a "guest" that executes the command locally and
  a client on 127.0.0.1 (real sysbench, iperf3 server/client, wrk against python's http.server).
"""

from __future__ import annotations

import importlib
import pkgutil
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lab import proc, workloads
from lab.errors import LabError, UsageError
from lab.wait import wait_until
from lab.workloads import WorkloadContext, cpu, http, iperf3, load_all, sysbench, toolkit

DATA = Path(__file__).parents[1] / "data"


@dataclass
class FakeClient:
    address: str = "10.77.0.1"
    prefix: list[str] = field(default_factory=list)

    def argv(self, argv: list[str]) -> list[str]:
        return [*self.prefix, *argv]

    def server_argv(self, argv: list[str]) -> list[str]:
        return self.argv(argv)


@dataclass
class ScriptedGuest:
    """Answers guest commands from a list of (predicate substring, stdout, returncode)."""

    answers: list[tuple[str, str, int]]
    commands: list[str] = field(default_factory=list)

    def run(self, command: str, *, timeout: float = 120.0, check: bool = True, input=None) -> proc.Result:
        self.commands.append(command)
        for needle, out, rc in self.answers:
            if needle in command:
                return proc.Result(["ssh", command], rc, out, "", 0.5)
        return proc.Result(["ssh", command], 127, "", "sh: not found", 0.1)


class LocalGuest:
    """A 'guest' that is this machine: runs the command line with sh, as sshd would."""

    def run(self, command: str, *, timeout: float = 120.0, check: bool = True, input=None) -> proc.Result:
        return proc.run(["sh", "-c", command], timeout=timeout, check=check, input=input)


def ctx(workload_params=None, *, guest=None, client=None, os="debian", vcpus=2, guest_address="10.77.0.10"):
    return WorkloadContext(
        guest=guest,
        client=client or FakeClient(),
        os=os,
        vcpus=vcpus,
        params=dict(workload_params or {}),
        guest_address=guest_address,
    )


def test_the_registry_names_each_workload_and_the_module_that_registers_it():
    """REGISTRY is the one list: each name loads from its module, and no module of the package
    registers a workload the registry lacks (the toolkit modules register none)."""
    for name, module in workloads.REGISTRY.items():
        wl = workloads.get(name)
        assert wl.name == name and type(wl).__module__ == module
    registered = set()
    for mod in pkgutil.iter_modules(workloads.__path__):
        loaded = importlib.import_module(f"lab.workloads.{mod.name}")
        registered |= {v.name for v in vars(loaded).values() if isinstance(v, workloads.Workload)}
    assert registered == set(workloads.REGISTRY)
    with pytest.raises(UsageError, match="unknown workload 'nope'; known: bulk-http, container-start"):
        workloads.get("nope")


def test_importing_the_seam_imports_no_workload():
    """The registry is plain: nothing imports every module of the package; a workload's module
    loads when its name is first asked for."""
    code = (
        "import sys, lab.workloads as w; before = sorted(m for m in sys.modules if m.startswith('lab.workloads.'));"
        "w.get('idle'); after = sorted(m for m in sys.modules if m.startswith('lab.workloads.'));"
        "print(before, 'lab.workloads.idle' in after, 'lab.workloads.git_clone' in after)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "True", "False"]


def test_every_workload_declares_its_traits():
    """What the runner, the plan and the docs read of a workload is declared: every parameter with
    a one-line meaning, headline metrics, and defaults its own checks accept."""
    for name, wl in load_all().items():
        t = wl.traits
        assert isinstance(t, workloads.Traits) and t.summary and "\n" not in t.summary, name
        keys = [p.name for p in t.params]
        assert len(set(keys)) == len(keys) and wl.defaults == {p.name: p.default for p in t.params}, name
        for p in t.params:
            assert p.meaning and "\n" not in p.meaning and len(p.meaning) <= 110, (name, p.name)
        pm = t.primary_metrics
        assert isinstance(pm, workloads.PrimaryMetrics) and pm.patterns, name
        assert all(isinstance(m, str) and m for m in pm.patterns) and set(pm.per) <= set(keys), name
        assert wl.params(ctx(workload_params=wl.defaults)) is not None, name
        assert wl.estimate_seconds(wl.params(ctx(workload_params=wl.defaults))) > 0, name
    net = {n for n, wl in load_all().items() if wl.traits.network}
    assert net == {"iperf3-tcp", "iperf3-udp", "http", "https", "bulk-http", "scp", "git-clone", "podman-build", "ping"}
    assert {n for n, wl in load_all().items() if wl.traits.client_files} == {"scp", "git-clone", "podman-build"}
    assert {n for n, wl in load_all().items() if wl.traits.serves_web} == {"http", "https"}


def test_own_containers_comes_from_the_declared_traits():
    get = workloads.get
    assert get("podman-build").own_containers({}) == "it starts containers itself"
    clone = get("git-clone")
    assert clone.own_containers({"network": ["guest", "host"]}) == "its network places are containers of its own"
    assert clone.own_containers({"network": "guest"}) == ""
    assert get("http").own_containers({"network": ["default"]}) == ""  # declares no places


# ---------------------------------------------------------------------------------------------
# Pure command construction


def test_sysbench_cpu_commands_default_both_thread_settings():
    cmds = sysbench.SYSBENCH_CPU.commands(ctx(vcpus=4))
    assert cmds == [
        ("1t", 1, "sysbench cpu --cpu-max-prime=20000 --threads=1 --time=10 run"),
        ("nt", 4, "sysbench cpu --cpu-max-prime=20000 --threads=4 --time=10 run"),
    ]


def test_sysbench_cpu_commands_params():
    cmds = sysbench.SYSBENCH_CPU.commands(ctx({"threads": ["vcpus", 8], "time": 3, "max_prime": 1000}, vcpus=2))
    assert [(t, n) for t, n, _ in cmds] == [("nt", 2), ("8t", 8)]
    assert cmds[1][2] == "sysbench cpu --cpu-max-prime=1000 --threads=8 --time=3 run"


@pytest.mark.parametrize("threads", [[0], ["all"], [], [1, 1], [True]])
def test_sysbench_cpu_bad_threads(threads):
    with pytest.raises(UsageError, match="sysbench-cpu"):
        sysbench.SYSBENCH_CPU.commands(ctx({"threads": threads}))


def test_sysbench_memory_command():
    assert sysbench.SYSBENCH_MEMORY.command(ctx()) == (
        "sysbench memory --memory-block-size=1K --memory-oper=write --memory-total-size=0 --threads=1 --time=10 run"
    )
    assert sysbench.SYSBENCH_MEMORY.command(
        ctx({"block_size": "1M", "operation": "read", "time": 5, "threads": 2})
    ) == ("sysbench memory --memory-block-size=1M --memory-oper=read --memory-total-size=0 --threads=2 --time=5 run")


@pytest.mark.parametrize("params", [{"block_size": "1KB"}, {"operation": "copy"}, {"time": 0}, {"threads": "2"}])
def test_sysbench_memory_bad_params(params):
    with pytest.raises(UsageError, match="sysbench-memory"):
        sysbench.SYSBENCH_MEMORY.command(ctx(params))


def test_iperf3_tcp_commands():
    cmds = iperf3.IPERF3_TCP.commands(ctx({"streams": 4, "time": 5}))
    assert cmds == [
        (
            "tx",
            ["iperf3", "-s", "-1", "-B", "10.77.0.1", "-p", "5201", "--forceflush"],
            "iperf3 -c 10.77.0.1 -p 5201 -J -t 5 -P 4",
        ),
        (
            "rx",
            ["iperf3", "-s", "-1", "-B", "10.77.0.1", "-p", "5201", "--forceflush"],
            "iperf3 -c 10.77.0.1 -p 5201 -J -t 5 -P 4 -R",
        ),
    ]


def test_iperf3_udp_commands():
    cmds = iperf3.IPERF3_UDP.commands(ctx({"bitrate": "1G", "directions": ["rx"], "port": 5301}))
    assert cmds == [
        (
            "rx",
            ["iperf3", "-s", "-1", "-B", "10.77.0.1", "-p", "5301", "--forceflush"],
            "iperf3 -c 10.77.0.1 -p 5301 -J -t 10 -P 1 -u -b 1G -R",
        )
    ]


@pytest.mark.parametrize(
    "params",
    [
        {"directions": ["up"]},
        {"directions": []},
        {"directions": ["tx", "tx"]},
        {"streams": 0},
        {"port": 70000},
        {"time": "long"},
    ],
)
def test_iperf3_bad_params(params):
    with pytest.raises(UsageError, match="iperf3-tcp"):
        iperf3.IPERF3_TCP.commands(ctx(params))


def test_http_commands():
    cmds = http.HTTP.commands(ctx())
    assert cmds == [
        ("c10", ["wrk", "-t4", "-c10", "-d10s", "--latency", "http://10.77.0.10/"]),
        ("c50", ["wrk", "-t4", "-c50", "-d10s", "--latency", "http://10.77.0.10/"]),
    ]
    cmds = http.HTTPS.commands(ctx({"connections": [2], "path": "/1m.bin", "duration": 3}, guest_address="fd00::5"))
    assert cmds == [("c2", ["wrk", "-t2", "-c2", "-d3s", "--latency", "https://[fd00::5]/1m.bin"])]


@pytest.mark.parametrize(
    "params", [{"connections": []}, {"connections": [0]}, {"path": "index.html"}, {"path": "/a b"}, {"duration": 0}]
)
def test_http_bad_params(params):
    with pytest.raises(UsageError, match="http"):
        http.HTTP.commands(ctx(params))


def test_http_needs_guest_address():
    with pytest.raises(UsageError, match="guest_address"):
        http.HTTP.commands(ctx(guest_address=""))


def test_guest_script_shape():
    s = cpu.guest_script("sysbench cpu run", "sysctl -n kern.cp_time")
    assert s.startswith("sh -c '")
    inner = shlex.split(s)[2]
    assert inner == (
        "echo @@lab-cpu-before@@; sysctl -n kern.cp_time; echo @@lab-load@@; sysbench cpu run; "
        "rc=$?; echo @@lab-cpu-after@@; sysctl -n kern.cp_time; echo @@lab-rc=$rc@@; exit $rc"
    )


def test_guest_script_runs_and_keeps_exit_status():
    res = proc.run(["sh", "-c", cpu.guest_script("echo hello; sh -c 'exit 3'", "echo cpu  1 2 3 4")], check=False)
    before, out, after, rc = cpu.split_guest_output(res.stdout)
    assert (before, out, after, rc, res.returncode) == ("cpu 1 2 3 4", "hello\n", "cpu 1 2 3 4", 3, 3)


# ---------------------------------------------------------------------------------------------
# run() against a scripted guest


def _wrapped(load_text: str, before: str, after: str, rc: int = 0) -> str:
    return f"@@lab-cpu-before@@\n{before}\n@@lab-load@@\n{load_text}@@lab-cpu-after@@\n{after}\n@@lab-rc={rc}@@\n"


def test_sysbench_cpu_run_with_scripted_guest_uses_os_ticks_command():
    t1 = (DATA / "sysbench/linux-1.0.20-cpu-t1.txt").read_text()
    t2 = (DATA / "sysbench/freebsd-constructed-1.0.20-cpu-t2.txt").read_text()
    g = ScriptedGuest(
        [
            ("--threads=1", _wrapped(t1, "100 0 50 10 840", "300 0 70 10 1020"), 0),
            ("--threads=2", _wrapped(t2, "300 0 70 10 1020", "700 0 70 10 1020"), 0),
        ]
    )
    c = ctx({"time": 2}, guest=g, os="freebsd", vcpus=2)
    raw = sysbench.SYSBENCH_CPU.run(c, repetition=3)
    assert all("sysctl -n kern.cp_time" in cmd for cmd in g.commands)
    assert [toolkit.split_segments(raw.stdout)[i][0] for i in (0, 1)] == ["1t", "nt"]
    assert raw.extra["cpu_before"] == "100 0 50 10 840" and raw.extra["cpu_after"] == "700 0 70 10 1020"
    assert raw.params["vcpus"] == 2 and raw.params["repetition"] == 3 and raw.returncode == 0
    m = {s.metric: s for s in sysbench.SYSBENCH_CPU.parse(raw)}
    assert m["events_per_s_1t"].value == pytest.approx(1100.46)
    assert m["events_per_s_nt"].value == pytest.approx(512.34)
    assert m["cpu_busy_pct_nt"].value == pytest.approx(100.0)
    assert m["cpu_busy_pct"].value == pytest.approx(100 * (220 + 400) / (400 + 400))


def test_sysbench_memory_run_records_failure_for_parse():
    fatal = (DATA / "sysbench/linux-1.0.20-memory-fatal.txt").read_text()
    g = ScriptedGuest([("sysbench memory", _wrapped(fatal, "cpu  1 0 1 98", "cpu  2 0 2 99", rc=1), 1)])
    raw = sysbench.SYSBENCH_MEMORY.run(ctx(guest=g), 0)
    assert raw.returncode == 1 and raw.stdout == fatal
    with pytest.raises(LabError, match="exit status 1"):
        sysbench.SYSBENCH_MEMORY.parse(raw)


def test_guest_dropping_mid_load_is_an_error():
    g = ScriptedGuest([("sysbench", "@@lab-cpu-before@@\ncpu  1 0 1 98\n@@lab-load@@\nsysbench 1.0.20\n", 255)])
    with pytest.raises(LabError, match="before its closing CPU snapshot"):
        sysbench.SYSBENCH_MEMORY.run(ctx(guest=g), 0)


def test_prepare_reports_missing_tool_with_package_name():
    g = ScriptedGuest([])
    with pytest.raises(LabError, match=r"sysbench-cpu: sysbench is not installed in the guest \(freebsd\)") as ei:
        sysbench.SYSBENCH_CPU.prepare(ctx(guest=g, os="freebsd"))
    assert "'sysbench'" in ei.value.hint
    assert g.commands == ["sh -c 'command -v sysbench'"]


# ---------------------------------------------------------------------------------------------
# Loopback: the real tools on this machine (127.0.0.1 only)


def _need(tool: str):
    import shutil

    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_loopback_sysbench_cpu_run_and_parse():
    _need("sysbench")
    c = ctx({"threads": [1], "time": 1, "max_prime": 2000}, guest=LocalGuest(), vcpus=1)
    sysbench.SYSBENCH_CPU.prepare(c)
    raw = sysbench.SYSBENCH_CPU.run(c, 0)
    m = {s.metric: s for s in sysbench.SYSBENCH_CPU.parse(raw)}
    assert m["events_per_s_1t"].value > 0
    assert 0 <= m["cpu_busy_pct"].value <= 100


def test_loopback_iperf3_tcp_both_directions():
    _need("iperf3")
    port = _free_port()
    c = ctx({"time": 1, "port": port}, guest=LocalGuest(), client=FakeClient("127.0.0.1"))
    iperf3.IPERF3_TCP.prepare(c)
    raw = iperf3.IPERF3_TCP.run(c, 0)
    assert "Server listening" in raw.extra["server_log.tx"]
    m = {s.metric: s for s in iperf3.IPERF3_TCP.parse(raw)}
    assert m["throughput_mbit_s_tx"].value > 0 and m["throughput_mbit_s_rx"].value > 0
    assert "retransmits_tx" in m and "cpu_busy_pct_rx" in m
    # the one-shot servers are gone
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_loopback_iperf3_guest_failure_leaves_no_server():
    _need("iperf3")
    port = _free_port()
    c = ctx({"time": 1, "port": port, "directions": ["tx"]}, guest=LocalGuest(), client=FakeClient("127.0.0.1"))
    # the "guest" connects to a port nobody listens on: iperf3 -J reports an error document
    cmds = iperf3.IPERF3_UDP.commands(c)
    assert cmds[0][2].startswith("iperf3 -c 127.0.0.1")

    class WrongPortGuest(LocalGuest):
        def run(self, command, **kw):
            return super().run(command.replace(f"-p {port}", f"-p {_free_port()}"), **kw)

    c.guest = WrongPortGuest()
    t0 = time.monotonic()
    raw = iperf3.IPERF3_UDP.run(c, 0)  # iperf3 3.12 -J exits 0 even then; the error is in the JSON
    assert time.monotonic() - t0 < 8  # did not sit out the 10 s wait for a server that got no client
    with pytest.raises(LabError, match="iperf3-udp: iperf3 reported an error"):
        iperf3.IPERF3_UDP.parse(raw)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def http_server(tmp_path):
    (tmp_path / "index.html").write_text("<html>lab</html>\n")
    port = _free_port()
    p = proc.spawn(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    )
    try:

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_until(up, timeout=10, what="python http.server")
        yield port
    finally:
        p.terminate()
        p.wait(timeout=5)


def test_loopback_http_run_and_parse(http_server):
    _need("wrk")
    _need("curl")

    class PortClient(FakeClient):  # the guest's nginx listens on 80; here it is http.server's port
        def argv(self, argv):
            return [a.replace("http://127.0.0.1/", f"http://127.0.0.1:{http_server}/") for a in argv]

    c = ctx(
        {"connections": [2], "duration": 1, "threads": 1},
        guest=LocalGuest(),
        client=PortClient("127.0.0.1"),
        guest_address="127.0.0.1",
    )
    c.guest.run = lambda command, **kw: (
        proc.Result(["sh"], 0, "/usr/sbin/nginx\n", "", 0.0)
        if "command -v" in command
        else LocalGuest().run(command, **kw)
    )
    http.HTTP.prepare(c)
    raw = http.HTTP.run(c, 0)
    m = {s.metric: s for s in http.HTTP.parse(raw)}
    assert m["requests_per_s_c2"].value > 0
    assert m["errors"].value == 0 and "flagged" not in m["errors"].labels
    assert "cpu_busy_pct_c2" in m


def test_loopback_http_prepare_refuses_404(http_server):
    _need("curl")

    class PortClient(FakeClient):
        def argv(self, argv):
            return [a.replace("http://127.0.0.1/", f"http://127.0.0.1:{http_server}/") for a in argv]

    c = ctx(
        {"path": "/missing"},
        guest=ScriptedGuest([("command -v nginx", "/usr/sbin/nginx\n", 0)]),
        client=PortClient("127.0.0.1"),
        guest_address="127.0.0.1",
    )
    with pytest.raises(LabError, match="HTTP 404"):
        http.HTTP.prepare(c)


def test_tool_check_command_falls_back_to_sbin_dirs(tmp_path):
    (tmp_path / "labfaketool").write_text("#!/bin/sh\n")
    (tmp_path / "labfaketool").chmod(0o755)
    found = proc.run(
        ["sh", "-c", toolkit.tool_check_command("labfaketool", ("/nonexistent", str(tmp_path)))], check=False
    )
    assert (found.returncode, found.stdout.strip()) == (0, f"{tmp_path}/labfaketool")
    missing = proc.run(["sh", "-c", toolkit.tool_check_command("labfaketool2", (str(tmp_path),))], check=False)
    assert missing.returncode == 1 and missing.stdout == ""
    assert toolkit.tool_check_command("sysbench") == "sh -c 'command -v sysbench'"
