"""Issue 35: a results store is never trusted. It travels between people; `lab reproduce` turns it
into a Vagrantfile (Ruby, run by `vagrant up` on this machine), a tune.sh and a workloads.sh. A
value lab would not have stored is refused in one line naming the store, the cell, the key and
the value (exit 2, nothing written); what is written carries store values escaped: Ruby strings,
shell words, comments folded to one line. And what the store shows on a terminal (`lab show`,
`lab ls`, CSV) never carries a terminal control sequence."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from support.cli import lab_cli

from lab.model import RawOutput
from lab.store import Store

AXES = {"host": "local", "image": "debian12", "nic": "virtio", "vcpus": 1, "memory_mib": 512, "disk_bus": "virtio"}
RUBY_ATTACK = 'x\nsystem("touch /tmp/lab-pwned-by-a-label")\n#'


def stored(
    tmp_path: Path,
    *,
    run_id: str = "r1",
    label: str = "local/debian12/virtio",
    facts: dict | None = None,
    commands: tuple[str, ...] = ("sysbench cpu --threads=1 run",),
    config_text: str = "",
    **axes,
) -> Path:
    s = Store(tmp_path / "results")
    s.create_run(
        run_id,
        "t",
        config_path="",
        config_text=config_text,
        seed=1,
        lab_version="0",
        manifest={"images": {"debian12": {"digest": "d" * 64, "sha256": "e" * 64}}},
    )
    s.add_cell(run_id, "c01", 1, label, {**AXES, **axes})
    s.cell_update(run_id, "c01", status="done", facts={"accel": "tcg", **(facts or {})})
    s.add_raw(run_id, "c01", 1, RawOutput("sysbench-cpu", " ; ".join(commands), ""))
    s.finish_run(run_id, "done")
    s.close()
    return tmp_path / "results"


def reproduce(tmp_path: Path, run: str = "r1"):
    return lab_cli(
        "reproduce", run, "c01", "--out", str(tmp_path / "repro"), "--results", str(tmp_path / "results"), cwd=tmp_path
    )


def parses_as_ruby(path: Path) -> bool:
    ruby = shutil.which("ruby")
    return ruby is None or subprocess.run([ruby, "-c", str(path)], capture_output=True, timeout=60).returncode == 0


def parses_as_sh(path: Path) -> bool:
    return subprocess.run(["sh", "-n", str(path)], capture_output=True, timeout=60).returncode == 0


def test_a_label_with_code_in_it_stays_a_comment(tmp_path):
    stored(
        tmp_path,
        label=f"local/{RUBY_ATTACK}",
        facts={"tuning": {"effective": {"net.core.somaxconn": "4096\nreboot"}}},
        commands=("sysbench cpu run'; touch /tmp/lab-pwned-by-a-command; echo '",),
    )
    res = reproduce(tmp_path)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "repro"
    vagrantfile = (out / "Vagrantfile").read_text()
    code_lines = [ln for ln in vagrantfile.splitlines() if "system(" in ln]
    assert code_lines and all(ln.lstrip().startswith("#") for ln in code_lines), code_lines
    assert parses_as_ruby(out / "Vagrantfile")
    tune = (out / "tune.sh").read_text()
    assert [ln for ln in tune.splitlines() if "system(" in ln or "reboot" in ln] == [
        ln for ln in tune.splitlines() if ln.startswith("#") and ("system(" in ln or "reboot" in ln)
    ]
    assert parses_as_sh(out / "tune.sh")
    work = (out / "workloads.sh").read_text()
    (line,) = [ln for ln in work.splitlines() if "pwned" in ln]
    assert line == "sh -c 'sysbench cpu run'\"'\"'; touch /tmp/lab-pwned-by-a-command; echo '\"'\"''"
    assert parses_as_sh(out / "workloads.sh")
    assert not Path("/tmp/lab-pwned-by-a-label").exists() and not Path("/tmp/lab-pwned-by-a-command").exists()


@pytest.mark.parametrize(
    "axes,facts,key,value",
    [
        ({"cc": "bbr; touch /tmp/x"}, {}, "axes.cc", "bbr; touch /tmp/x"),
        ({"tuning": "../../../../etc/passwd"}, {}, "axes.tuning", "../../../../etc/passwd"),
        ({"nic": 'virtio", cpus: system("x")'}, {}, "axes.nic", 'virtio", cpus: system("x")'),
        ({"disk_bus": "sata\nx"}, {}, "axes.disk_bus", "sata\nx"),
        ({"vcpus": "2); system(x"}, {}, "axes.vcpus", "2); system(x"),
        ({"memory_mib": 0}, {}, "axes.memory_mib", 0),
        ({"image": "../debian12"}, {}, "axes.image", "../debian12"),
        ({"offloads": "lro=off;reboot"}, {}, "axes.offloads", "lro=off;reboot"),
        ({"wan": "x'y"}, {}, "axes.wan", "x'y"),
        ({}, {"image_digest": "abc'def0123456"}, "facts.image_digest", "abc'def0123456"),
        ({}, {"isolation": {"kind": "container", "runtime": "sh -c x"}}, "facts.isolation.runtime", "sh -c x"),
    ],
)
def test_a_value_lab_would_not_have_stored_is_refused_in_one_line(tmp_path, axes, facts, key, value):
    results = stored(tmp_path, facts=facts, **axes)
    res = reproduce(tmp_path)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"lab: error: {results / 'lab.db'}: run r1 cell c01: {key} = {value!r}: "
        + res.stderr.split(f"{key} = {value!r}: ", 1)[1].strip()
    ]
    assert "(not trusted)" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "repro").exists()


def test_a_broken_wan_profile_in_the_stored_lab_toml_is_one_line(tmp_path):
    stored(tmp_path, wan="slow", config_text="[wan.slow]\ndelay_ms = 'a lot'\n")
    res = reproduce(tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "[wan.slow] is not usable" in res.stderr and not (tmp_path / "repro").exists()


def test_a_run_of_an_older_lab_with_a_dash_in_its_id_is_still_reproduced(tmp_path):
    stored(tmp_path, run_id="nightly-1")
    res = reproduce(tmp_path, "nightly-1")
    assert res.returncode == 0, res.stderr
    assert 'config.vm.define "repro-nightly-1-c01"' in (tmp_path / "repro" / "Vagrantfile").read_text()


# -- what the store shows on a terminal --------------------------------------------------------------

ESC = "\x1b]0;owned\x07\x1b[2J\x1b[31m"


def test_control_sequences_from_a_store_never_reach_the_terminal(tmp_path):
    s = Store(tmp_path / "results")
    s.create_run("r1", f"lab{ESC}", config_path="", config_text="", seed=1, lab_version="0", manifest={})
    s.add_cell("r1", "c01", 1, f"local/{ESC}/virtio", {"nic": "virtio"})
    s.cell_update("r1", "c01", status="failed", stage="boot", error=f"guest said {ESC}hello\rbye")
    s.finish_run("r1", "failed", f"tool said {ESC}")
    s.close()
    for argv in (["show", "r1"], ["show", "r1", "--csv"], ["show", "r1", "--json"], ["ls"]):
        res = lab_cli(*argv, "--results", str(tmp_path / "results"), cwd=tmp_path)
        assert res.returncode in (0, 1), res.stderr
        for stream in (res.stdout, res.stderr):
            assert "\x1b" not in stream and "\x07" not in stream and "\r" not in stream, (argv, stream)
    res = lab_cli("show", "r1", "--results", str(tmp_path / "results"), cwd=tmp_path)
    # the words stay, the sequences go whole (a carriage return is a line break)
    assert (
        "run r1 (lab), failed" in res.stdout
        and "c01 local//virtio: failed at boot: guest said hello\nbye" in res.stdout
    )


def test_plaintext_drops_sequences_whole_and_keeps_the_words():
    from lab import plaintext

    assert plaintext.printable("a\x1b[2Jb\x1b]0;title\x07c\x1b]52;c;ZXZpbA==\x1b\\d\x9b31me") == "abcde"
    assert plaintext.printable("tab\tok\x00\x7f") == "tab\tok??"
    assert plaintext.printable("unterminated \x1b]0;title") == "unterminated 0;title"  # words stay visible
    assert plaintext.one_line("one\r\ntwo\n\tthree\x1b[A") == "one two three"
    assert plaintext.printable("plain ünïcode – text") == "plain ünïcode – text"
