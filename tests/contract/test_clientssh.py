"""client = "ssh:USER@MACHINE" (lab.runner.clientssh) against a real OpenSSH sshd on this
machine's loopback (the tests' own, on a port of its own): what lab.toml accepts, the login check
before anything is made (host key checked strictly, an unreachable machine named), and a run of
two fake hosts whose network workloads run over SSH on that one machine, taking turns on it."""

from __future__ import annotations

import os
import socket
import time

import fakes.backend as fake
import pytest
from smartos_emulator.sshd import Sshd, ensure_sshd
from support.cli import lab_cli
from test_clientload import NetworkWork
from test_lanes import run_with, write_lab

from lab import clients, proc, runner
from lab.errors import ConfigError, UnreachableError
from lab.model import RawOutput

SUITE = 'workloads = ["fake-net", "fake-work"]\n[suite.params.fake-net]\nvalues = [5.0]\nsleep_s = 0.3'


def test_placements_in_words():
    assert clients.ssh_target("ssh:lab@bench-1") == ("lab", "bench-1")
    for bad in ("ssh:bench-1", "ssh:@x", "ssh:a@", "ssh:-oProxyCommand=x@h", "ssh:a@-h", "ssh:a b@c", "sh:a@b"):
        assert clients.ssh_target(bad) is None and not clients.valid(bad), bad
    # one lock per machine: two hosts naming it (as any user) take turns; a client VM is its host's
    assert clients.turn_key("a", "ssh:lab@Bench-1") == clients.turn_key("b", "ssh:root@bench-1") == "ssh:bench-1"
    assert clients.turn_key("a", "vm") != clients.turn_key("b", "vm")
    assert clients.turn_key("a", "local") == clients.turn_key("b", "local") == "local"
    assert "root@m (port 2222) over SSH" in clients.describe("h", "ssh:root@m", port=2222)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def machine(tmp_path):
    """A client machine: sshd on 127.0.0.1, root's key and its host key the test's."""
    if os.geteuid() != 0:
        pytest.skip("sshd runs as root here (privilege separation)")
    why = ensure_sshd()
    if why:
        pytest.skip(why)
    sshd = Sshd(tmp_path / "machine", netns=None, address="127.0.0.1", port=free_port())
    sshd.start()
    try:
        yield sshd
    finally:
        sshd.stop()


def table(sshd: Sshd, **over) -> str:
    keys = {
        "client": '"ssh:root@127.0.0.1"',
        "client_port": str(sshd.port),
        "client_identity": f'"{sshd.client_key}"',
        "client_known_hosts": f'"{sshd.known_hosts}"',
        **over,
    }
    return "\n".join(f"{k} = {v}" for k, v in keys.items())


class OverSsh(NetworkWork):
    """fake-net that runs a command on its client side each repetition and keeps what it saw."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, float, float, str]] = []  # (guest, start, end, $SSH_CONNECTION there)

    def run(self, ctx, repetition: int) -> RawOutput:
        start = time.monotonic()
        raw = super().run(ctx, repetition)
        there = proc.run(ctx.client.argv(["sh", "-c", "echo $SSH_CONNECTION"]), timeout=30).stdout.strip()
        self.seen.append((ctx.guest.address, start, time.monotonic(), there))
        return raw


@pytest.mark.root
def test_two_hosts_run_their_load_generators_on_one_machine_over_ssh_in_turns(fake_lab, machine):
    probe = OverSsh()
    hosts = {"a": table(machine), "b": table(machine)}
    store, rid = run_with(fake_lab, [probe], hosts, vcpus=2, repetitions=2, suite=SUITE)
    run = store.run(rid)
    assert run.status == "done", [(c.cell_id, c.error) for c in store.cells(rid)]
    # every repetition's client-side command ran on the machine, over SSH (sshd set SSH_CONNECTION)
    assert len(probe.seen) == 2 * 2 * 2 and all(
        s[3].split()[2:] == ["127.0.0.1", str(machine.port)] for s in probe.seen
    )
    # one machine, two lanes: their network repetitions never overlapped
    spans = sorted((s[1], s[2]) for s in probe.seen)
    assert all(b_start >= a_end for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans
    net = [s for s in store.samples(rid) if s.workload == "fake-net"]
    loads = [s.labels["client_load"] for s in net]
    # its load read from its /proc/stat over SSH, and judged (it is not the cells' host)
    assert loads and all(w["placement"] == "ssh:root@127.0.0.1" and w["cpus"] == os.cpu_count() for w in loads)
    assert all("shares_host" not in w for w in loads)
    assert run.manifest["client_machines"] == {
        h: {"target": "root@127.0.0.1", "address": "127.0.0.1"} for h in ("a", "b")
    }
    assert fake.LIVE == {} and store.open_leases() == []
    from lab import workloads

    workloads.register(probe)  # the lab.toml names it
    try:
        shown = lab_cli("show", rid, "-c", str(fake_lab.path))
    finally:
        workloads.unregister(probe.name)
    assert "client machine of host b: root@127.0.0.1 at 127.0.0.1 ran its load generators" in shown.stdout
    # logged out: no master connection left
    assert not [p for p in proc_argvs() if "ControlMaster=yes" in p and f"-p\0{machine.port}\0" in p]


def made_nothing() -> bool:
    """The fake backend was only asked (check, images), nothing made or opened."""
    return {event for event, *_ in fake.JOURNAL} <= {"check_images"}


def proc_argvs() -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out.append(open(f"/proc/{pid}/cmdline").read())
        except OSError:
            pass
    return out


@pytest.mark.root
def test_a_client_machine_whose_host_key_is_not_known_is_refused_before_anything_is_made(fake_lab, machine, tmp_path):
    other = tmp_path / "other_known_hosts"
    other.write_text(
        f"[127.0.0.1]:{machine.port} ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPtKDbe0VF0aR0aG7KbNc0zbd7xcBKjE9E3ISaQz4bO7\n"
    )
    cfg = write_lab(fake_lab, {"a": table(machine, client_known_hosts=f'"{other}"')})
    with pytest.raises(UnreachableError) as exc:
        runner.prepare(cfg)
    text = str(exc.value)
    assert "hosts.a.client = 'ssh:root@127.0.0.1'" in text and "cannot log in over SSH" in text
    assert "host key" in text.lower() and "\n" not in text
    assert fake.LIVE == {} and made_nothing()


def test_an_unreachable_client_machine_is_a_one_line_error_naming_the_key(fake_lab, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    port = free_port()  # nothing listens there
    cfg = write_lab(
        fake_lab, {"a": f'client = "ssh:root@127.0.0.1"\nclient_port = {port}\nclient_known_hosts = "{known}"'}
    )
    with pytest.raises(UnreachableError) as exc:
        runner.prepare(cfg)
    text = str(exc.value)
    assert text.startswith(f"{cfg.source}: hosts.a.client = 'ssh:root@127.0.0.1': cannot log in over SSH")
    assert "refused" in text and "\n" not in text
    assert fake.LIVE == {} and made_nothing()


def test_a_missing_known_hosts_file_is_named(fake_lab, tmp_path):
    missing = tmp_path / "nope"
    cfg = write_lab(fake_lab, {"a": f'client = "ssh:root@127.0.0.1"\nclient_known_hosts = "{missing}"'})
    with pytest.raises(ConfigError, match=r"hosts\.a\.client_known_hosts = '.*nope': no such file"):
        runner.prepare(cfg)
    assert made_nothing()


def test_plan_says_where_the_load_generators_run_and_who_takes_turns(fake_lab):
    from support.cli import lab_cli

    from lab import workloads

    workloads.register(NetworkWork())
    try:
        write_lab(
            fake_lab,
            {"a": 'client = "ssh:root@m1"', "b": 'client = "ssh:lab@M1"\nclient_port = 2222', "c": ""},
            suite=SUITE,
        )
        res = lab_cli("plan", "-c", str(fake_lab.path), cwd=fake_lab.dir)
    finally:
        workloads.unregister("fake-net")
    assert res.returncode == 0, res.stderr
    text = res.stdout + res.stderr
    assert "host a: its load generators run on root@m1 (port 22) over SSH" in text
    assert "host b: its load generators run on lab@M1 (port 2222) over SSH" in text
    assert "network measurements (fake-net) of lanes a, b take turns on the client machine m1" in text
    assert "of lanes c" not in text and "local client" not in text  # c alone on this machine
