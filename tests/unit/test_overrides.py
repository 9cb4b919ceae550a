"""`--set KEY=VALUE` (lab.overrides): TOML keys and values put into the parsed lab.toml before it is
validated; errors name --set, the key and the value (a secret's never); a run stores the lab it ran."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from support.cli import lab_cli

from lab import config, overrides
from lab.errors import ConfigError

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize(
    ("text", "path", "value"),
    [
        ("suite.repetitions=2", ("suite", "repetitions"), 2),
        (' matrix.nic = ["virtio", "e1000"] ', ("matrix", "nic"), ["virtio", "e1000"]),
        ("suite.params.http.duration=3", ("suite", "params", "http", "duration"), 3),
        ("'hosts.\"kvm 1\".slots'=2", ('hosts."kvm 1".slots',), 2),  # one quoted key, as TOML reads it
        ('hosts."kvm 1".slots=2', ("hosts", "kvm 1", "slots"), 2),
        ('matrix.exclude=[{ host = "kvm1" }]', ("matrix", "exclude"), [{"host": "kvm1"}]),
        ('lab.name="a=b"', ("lab", "name"), "a=b"),  # the first = splits key from value
    ],
)
def test_keys_and_values_are_read_as_toml(text, path, value):
    o = overrides.parse(text, "lab.toml")
    assert (o.path, o.value) == (path, value)


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("suite.repetitions", "--set", "expected KEY=VALUE"),
        ("=2", "--set", "expected KEY=VALUE"),
        ("matrix.start=warm", "--set matrix.start", 'quote a string ("warm")'),
        ("suite..x=1", "--set", "not a TOML key"),
        ("a=1\nb=2", "--set a", "no line breaks"),
        ("suite.repetitions=2 3", "--set suite.repetitions", "the value is TOML"),
    ],
)
def test_a_malformed_override_is_one_error_naming_set(text, key, fragment):
    with pytest.raises(ConfigError) as e:
        overrides.parse(text, "lab.toml")
    assert e.value.key == key and fragment in str(e.value) and "\n" not in str(e.value)


def test_a_secret_is_never_echoed_where_the_file_has_no_table_for_it():
    data = {"hosts": {"pve1": {"backend": "proxmox", "token": "env:PVE_TOKEN"}}}
    with pytest.raises(ConfigError) as e:
        overrides.apply(data, [overrides.parse('hosts.pve1.token.x="s3cret-v4lue"', "f")], "f")
    assert "s3cret" not in str(e.value) and "hosts.pve1.token is not a table" in str(e.value)


def test_a_secret_is_never_echoed_by_a_malformed_override():
    for text in ("hosts.pve1.token=s3cret-v4lue", "hosts.pve1.password=s3cret v4lue", "s3cret-v4lue"):
        with pytest.raises(ConfigError) as e:
            overrides.parse(text, "lab.toml")
        assert "s3cret" not in str(e.value), str(e.value)


def test_apply_replaces_makes_tables_and_leaves_the_original_alone():
    data = {"suite": {"workloads": ["iperf3-tcp"], "repetitions": 5}, "matrix": {"nic": ["virtio"]}}
    sets = [
        overrides.parse(t, "f") for t in ("suite.repetitions=2", "suite.params.scp.size_mib=8", 'matrix.nic=["e1000"]')
    ]
    out = overrides.apply(data, sets, "f")
    assert out["suite"] == {"workloads": ["iperf3-tcp"], "repetitions": 2, "params": {"scp": {"size_mib": 8}}}
    assert out["matrix"]["nic"] == ["e1000"] and data["matrix"]["nic"] == ["virtio"] and "params" not in data["suite"]
    with pytest.raises(ConfigError, match=r"--set suite\.repetitions\.x.*suite\.repetitions is not a table"):
        overrides.apply(data, [overrides.parse("suite.repetitions.x=1", "f")], "f")


def test_a_value_the_schema_refuses_names_the_override_not_only_the_file(tmp_path):
    lab = tmp_path / "lab.toml"
    lab.write_text('[matrix]\nimage = ["debian12"]\n')
    with pytest.raises(ConfigError) as e:
        config.load(lab, ["suite.repetitions=0"])
    assert e.value.path == f"{lab} (--set suite.repetitions)" and e.value.key == "suite.repetitions"
    with pytest.raises(ConfigError) as e:  # an unknown key, from the command line
        config.load(lab, ["matrix.nics=[]"])
    assert "--set matrix.nics" in str(e.value) and "unknown key" in str(e.value)
    with pytest.raises(ConfigError) as e:  # a mistake in the file is still the file's
        lab.write_text('[matrix]\nimage = ["debian12"]\nnic = ["rtl9999"]\n')
        config.load(lab, ["suite.repetitions=2"])
    assert e.value.path == str(lab) and e.value.key.startswith("matrix.nic")


def test_the_stored_lab_is_the_lab_that_ran_and_reads_back_the_same(tmp_path):
    study = EXAMPLES / "study-start.toml"
    sets = ["suite.repetitions=2", "suite.bare_metal=false", 'suite.params.container-start.network=["host"]']
    cfg, text = config.loaded(study, sets)
    assert (cfg.suite.repetitions, cfg.suite.bare_metal) == (2, False)
    assert text.startswith(f"# {study}, with suite.repetitions, suite.bare_metal, suite.params.container-start.network")
    again = config.parse(tomllib.loads(text), str(study))
    assert again == cfg
    plain, plain_text = config.loaded(study)  # no override: the file's own text, comments and all
    assert plain_text == study.read_text() and plain.suite.repetitions == 6


def test_lab_plan_with_set_small_version_of_a_study_and_a_bad_one_exits_2(tmp_path):
    study = str(EXAMPLES / "study-build.toml")
    small = ['matrix.host=["local"]', 'matrix.image=["debian12"]', "matrix.exclude=[]", "suite.repetitions=1"]
    res = lab_cli("plan", "-c", study, *(a for s in small for a in ("--set", s)), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert {c["axes"]["host"] for c in doc["cells"]} == {"local"} and len(doc["cells"]) == 2  # lro on, off
    bad = lab_cli("plan", "-c", study, "--set", "suite.repetitions=many", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--set suite.repetitions" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr + bad.stdout and not list(tmp_path.iterdir())
