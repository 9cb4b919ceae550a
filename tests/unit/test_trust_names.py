"""Issue 35: one rule per kind of name (lab.names). A host name is checked as lab.toml is read,
like every other name (a `/` in one collided with a slot lane's "pve1/2"; a quote, a space, a
line break or an ESC would break a label, a path, a shell line or a Vagrantfile). A run id has no
"-": the names made of it are split on "-" to find their run, and a sweep of run `nightly` took
`nightly-1`'s machines for its own and killed its QEMU."""

from __future__ import annotations

import json

import pytest
from support.cli import lab_cli

from lab import backends, config, gc, names
from lab.backends.local import layout
from lab.errors import ConfigError
from lab.model import Owned
from lab.store import Store

BAD_HOSTS = [
    "pve/2",
    "pve@node1",
    "a b",
    "it's",
    'say"',
    "a\nb",
    "a\x1b[2Jb",
    "-oProxyCommand=x",
    ".hidden",
    "$(x)",
    "",
]


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_a_host_name_other_names_could_not_carry_is_refused_in_one_line(host):
    with pytest.raises(ConfigError) as err:
        config.parse({"hosts": {host: {"backend": "local"}}, "matrix": {"host": [host]}}, "lab.toml")
    message = str(err.value)
    assert message.startswith(f"lab.toml: hosts.{json.dumps(host)} = {host!r}: is not a usable host name: ")
    assert "\n" not in message and "\x1b" not in message


def test_host_names_lanes_and_labels_stay_apart():
    """A slot lane's name ("pve1/2") and a place's ("pve@node") cannot be a host's."""
    cfg = config.parse(
        {"hosts": {"pve1": {"backend": "local", "slots": 2}, "pve1.b_c-d": {"backend": "local"}}},
        "lab.toml",
    )
    lanes = [n for h, s in cfg.hosts.items() for n, _ in backends.host_lanes(h, s)]
    assert "pve1/2" in lanes and len(lanes) == len(set(lanes))
    assert not any(names.HOST.valid(lane) for lane in lanes if "/" in lane)


def test_the_cli_refuses_a_bad_host_name_and_creates_nothing(tmp_path):
    (tmp_path / "lab.toml").write_text('[lab]\nresults = "results"\n[hosts."pve/2"]\nbackend = "local"\n')
    for argv in (["plan"], ["run"], ["gc"], ["snapshot", "pve/2"]):
        res = lab_cli(*argv, cwd=tmp_path)
        assert res.returncode == 2, (argv, res.stderr)
        assert res.stderr.strip().splitlines() == [
            "lab: error: lab.toml: hosts.\"pve/2\" = 'pve/2': is not a usable host name: 1-40 letters, digits, "
            "'_', '.' or '-', starting with a letter or digit (no '/', '@', spaces or quotes)"
        ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.toml"]


# -- run ids ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("run_id", ["nightly-1", "a-", "x" * 17, "Nightly", "a_b", "a.b"])
def test_a_run_id_is_letters_and_digits_only(tmp_path, run_id):
    (tmp_path / "lab.toml").write_text(
        f'[lab]\nresults = "results"\n[hosts.local]\nbackend = "local"\nworkdir = "{tmp_path / "w"}"\n'
    )
    res = lab_cli("run", "--run-id", run_id, cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"lab: error: --run-id {run_id!r}: is not a usable run id: 1-16 lower-case letters or digits (no '-')"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.toml"]


def test_a_run_of_an_older_lab_with_a_dash_is_not_resumed(tmp_path):
    s = Store(tmp_path / "results")
    s.create_run("nightly-1", "t", config_path="", config_text="", seed=1, lab_version="0", manifest={})
    s.finish_run("nightly-1", "failed")
    s.close()
    (tmp_path / "lab.toml").write_text('[lab]\nresults = "results"\n')
    before = (tmp_path / "results" / "lab.db").read_bytes()
    res = lab_cli("run", "--resume", "nightly-1", cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "cannot resume run 'nightly-1': its id is not a usable run id" in res.stderr
    assert (tmp_path / "results" / "lab.db").read_bytes() == before


def test_a_machines_run_is_read_only_from_names_lab_makes():
    assert layout.run_of("lab-nightly-c01") == "nightly"
    assert layout.run_of("lab-nightly-c01-aa") == "nightly"
    assert layout.run_of("lab-nightly-bm01") == "nightly"
    assert layout.run_of("lab-nightly-client1") == "nightly"
    assert layout.run_of("lab-nightly-wdeadbeef") == "nightly"
    assert layout.run_of("lab-nightly-b001") == "nightly"
    for name in ("lab-nightly-1-c01", "lab-nightly-1-bm01", "lab-x-y-z", "lab-nightly", "lab--c01", "lab-NIGHT-c01"):
        assert layout.run_of(name) == "", name  # not the run "nightly", nor any other
    assert layout.run_of_netns("lab-nightly") == "nightly" and layout.run_of_netns("lab-nightly-bm01") == "nightly"
    assert layout.run_of_netns("lab-nightly-1") == "" and layout.run_of_netns("lab-nightly-1-bm01") == ""


class _Host:
    """A backend that lists what it was given and says which runs are live (gc's view of one)."""

    warm = None  # no warm snapshots (an optional part, lab.backends.base)

    def __init__(self, items, live):
        self.items, self.live, self.removed = items, live, []

    def list_owned(self):
        return self.items

    def run_is_live(self, run_id):
        return run_id in self.live

    def remove_owned(self, item):
        self.removed.append(item.name)


def test_gc_never_takes_a_machine_whose_run_it_cannot_tell_for_a_dead_runs(tmp_path):
    items = [
        Owned("local", "process", "lab-nightly-1-c01", layout.run_of("lab-nightly-1-c01"), 0.0, "4242"),
        Owned("local", "process", "lab-dead-c01", layout.run_of("lab-dead-c01"), 0.0, "4343"),
    ]
    host = _Host(items, live=set())
    cfg = config.parse({"lab": {"results": str(tmp_path / "results")}})
    report = gc.collect(cfg, hosts=["local"], backends={"local": host})
    assert host.removed == ["lab-dead-c01"]
    assert "keep   local process lab-nightly-1-c01 (its run cannot be told from its name (--force removes it))" in (
        report.lines
    )
    gc.collect(cfg, hosts=["local"], backends={"local": host}, force=True)
    assert host.removed[-1] == "lab-nightly-1-c01"
