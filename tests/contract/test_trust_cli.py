"""Issue 16 at the command line: results made private ([lab] results_mode), a read-only results
store still read (show, ls, compare, report elsewhere), a SIGTERM before a command's own handlers
ends in one line and exit 130, a bad --resume named before any host is asked, cells that do not
fit their host warned about with the numbers, and what the last guard turns into one line: a
file that cannot be written, a terminal that cannot print a table's characters, emoji codes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.cli import LAB, lab_cli

import lab
from lab import check, config, proc, store as store_module
from lab.store import Store, StoreError


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _store_with_runs(where: Path) -> None:
    s = Store(where)
    for rid in ("r1", "r2"):
        s.create_run(rid, "t", config_path="", config_text="", seed=1, lab_version="0", manifest={})
        s.add_cell(rid, "c01", 1, "local/debian12/virtio", {"nic": "virtio"})
        s.finish_run(rid, "done")
    s.close()


# -- private results -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,dir_mode,file_mode", [(None, 0o700, 0o600), ("0750", 0o750, 0o640)])
def test_a_new_results_store_is_private_unless_results_mode_says(tmp_path, mode, dir_mode, file_mode):
    line = f'results_mode = "{mode}"\n' if mode else ""
    (tmp_path / "lab.toml").write_text(f'[lab]\nresults = "results"\n{line}')
    old = os.umask(0o022)
    try:
        res = lab_cli("snapshot", "local", cwd=tmp_path)
    finally:
        os.umask(old)
    assert res.returncode == 0, res.stderr
    assert _mode(tmp_path / "results") == dir_mode and _mode(tmp_path / "results" / "lab.db") == file_mode
    assert os.umask(0o022) == 0o022  # the command gave the umask back


def test_results_mode_is_an_octal_mode_that_keeps_others_from_writing():
    cfg = config.parse({"lab": {"results_mode": "750"}})
    assert cfg.lab.results_mode == "0750" and cfg.lab.umask == 0o027
    for bad in ("0777", "0500", "rwx", "07000"):
        with pytest.raises(Exception, match="lab.results_mode"):
            config.parse({"lab": {"results_mode": bad}}, "lab.toml")


# -- a read-only store -----------------------------------------------------------------------------


def test_a_read_only_store_reads_and_refuses_writes(tmp_path):
    _store_with_runs(tmp_path / "results")
    s = Store(tmp_path / "results", readonly=True)
    assert [r.id for r in s.runs()] == ["r1", "r2"] and s.readonly
    with pytest.raises(StoreError, match="read-only|readonly"):
        s.create_run("r3", "t", config_path="", config_text="", seed=1, lab_version="0", manifest={})
    s.close()
    with pytest.raises(Exception, match="no runs in"):
        Store(tmp_path / "nothing", readonly=True)
    assert not (tmp_path / "nothing").exists()


@pytest.fixture
def unwritable_results(tmp_path, monkeypatch):
    """A results store this process may not write to (as on a read-only mount, or someone else's):
    os.access says so, as it would."""
    _store_with_runs(tmp_path / "results")
    (tmp_path / "lab.toml").write_text('[lab]\nresults = "results"\n')
    real = os.access

    def access(path, mode, *a, **k):
        if mode & os.W_OK and str(path).startswith(str(tmp_path / "results")):
            return False
        return real(path, mode, *a, **k)

    monkeypatch.setattr(store_module.os, "access", access)
    return tmp_path


@pytest.mark.parametrize(
    "argv",
    [
        ["ls"],
        ["show", "r1"],
        ["show", "r1", "--json"],
        ["compare", "r1", "r2"],
        ["report", "r1", "-o", "{out}/report.html"],
    ],
)
def test_reading_commands_work_on_a_store_that_cannot_be_written(unwritable_results, argv):
    out = unwritable_results / "out"
    out.mkdir()
    db = unwritable_results / "results" / "lab.db"
    before = db.read_bytes()
    res = lab_cli(*(a.format(out=out) for a in argv), cwd=unwritable_results)
    assert res.returncode == 0, res.stderr
    assert db.read_bytes() == before  # read only (SQLite may leave its -wal/-shm where it can make them)
    assert {p.name for p in (unwritable_results / "results").iterdir()} <= {"lab.db", "lab.db-wal", "lab.db-shm"}


@pytest.mark.root
def test_reading_commands_work_on_a_read_only_mount(tmp_path):
    src, ro = tmp_path / "src", tmp_path / "ro"
    _store_with_runs(src)
    ro.mkdir()
    proc.run(["mount", "--bind", str(src), str(ro)])
    try:
        proc.run(["mount", "-o", "remount,bind,ro", str(ro)])
        (tmp_path / "lab.toml").write_text('[lab]\nresults = "ro"\n')
        for argv in (["ls"], ["show", "r1"], ["compare", "r1", "r2"], ["report", "r1", "-o", str(tmp_path / "r.html")]):
            res = lab_cli(*argv, cwd=tmp_path)
            assert res.returncode == 0, (argv, res.stderr)
        res = lab_cli("reparse", "r1", cwd=tmp_path)  # a write: one line, not a traceback
        assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
        assert "read-only" in res.stderr
    finally:
        released = proc.run(["umount", str(ro)], check=False)
        if not released.ok:
            proc.run(["umount", "-l", str(ro)], check=False)
    assert released.ok, f"a store connection was left open: {released.stderr}"


# -- exit 2 means nothing was created; signals from the first moment -----------------------------


def test_a_bad_resume_is_named_before_any_host_is_asked(fake_lab):
    path = fake_lab.dir / "lab.toml"
    path.write_text(
        '[lab]\nresults = "results"\n[hosts.unreachable1]\nbackend = "fake"\n'
        '[matrix]\nhost = ["unreachable1"]\n[suite]\nworkloads = ["fake-work"]\n'
    )
    _store_with_runs(fake_lab.dir / "results")
    res = lab_cli("run", "-c", str(path), "--resume", "nope", cwd=fake_lab.dir)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"lab: error: no run 'nope' in {fake_lab.dir / 'results' / 'lab.db'} (see `lab ls`)"
    ]


def test_sigterm_while_lab_toml_is_read_ends_in_one_line(tmp_path):
    """Before `lab run` installed its own handlers, a SIGTERM killed the process silently."""
    (tmp_path / "lab.toml").write_text("")
    script = textwrap.dedent("""
        import sys, time
        from lab import config
        load = config.load
        def slow(path, *sets):
            print("loading", flush=True)
            time.sleep(30)
            return load(path, *sets)
        config.load = slow
        from lab.cli import main
        main(sys.argv[1:])
        """)
    p = subprocess.Popen(
        [sys.executable, "-c", script, "plan"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(lab.PROJECT_ROOT)},
    )
    assert p.stdout.readline().strip() == "loading"
    p.send_signal(signal.SIGTERM)
    _out, stderr = p.communicate(timeout=30)
    assert p.returncode == 130
    assert stderr.strip().splitlines() == ["lab: interrupted (SIGTERM); every VM created was destroyed"]


# -- cells larger than their host ---------------------------------------------------------------------


def test_cells_that_do_not_fit_their_host_are_warned_about_with_the_numbers():
    cfg = config.parse({"matrix": {"vcpus": [1, 8], "memory_mib": [512, 65536]}})
    (line,) = check.capacity_warnings(cfg, {"local": {"cores": 2, "mem_kib": 4 * 1024 * 1024}})
    assert line.startswith(
        "host 'local': cells ask for 8 vCPUs (the host has 2 CPUs) and 65536 MiB of memory (the host has 4096 MiB)"
    )
    assert check.capacity_warnings(cfg, {"local": {"cores": 16, "mem_kib": 128 * 1024 * 1024}}) == []
    assert check.capacity_warnings(cfg, {"local": {}}) == []  # facts unknown: nothing said
    assert check.capacity_warnings(cfg, {"elsewhere": {"cores": 1}}) == []


def test_lab_run_warns_before_it_starts(fake_lab, monkeypatch):
    import fakes.backend

    monkeypatch.setattr(fakes.backend.FakeBackend, "host_facts", lambda self: {"cores": 1, "mem_kib": 512 * 1024})
    path = fake_lab.write(matrix="vcpus = [2]\nmemory_mib = [1024]\n")
    res = lab_cli("run", "-c", str(path), cwd=fake_lab.dir)
    assert res.returncode == 0, res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("lab: warning: ")]
    assert warnings == [
        "lab: warning: host 'f': cells ask for 2 vCPUs (the host has 1 CPUs) and 1024 MiB of memory "
        "(the host has 512 MiB): they run overcommitted, slowly and with noisy numbers; lower "
        "matrix.vcpus / matrix.memory_mib or exclude those cells"
    ]


# -- the last guard and the consoles ------------------------------------------------------------------


def test_a_report_that_cannot_be_written_is_one_line_naming_the_file(tmp_path):
    """A path that cannot be a file (its folder is a file) is bad input: said before anything is made."""
    _store_with_runs(tmp_path / "results")
    (tmp_path / "lab.toml").write_text('[lab]\nresults = "results"\n')
    (tmp_path / "a-file").write_text("")
    res = lab_cli("report", "r1", "-o", str(tmp_path / "a-file" / "report.html"), cwd=tmp_path)
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"lab: error: {tmp_path / 'a-file' / 'report.html'} cannot be made: ")


def test_a_terminal_that_cannot_print_the_tables_gets_replacements_not_an_error(tmp_path):
    (tmp_path / "lab.toml").write_text('[lab]\nname = "ünïcode × –"\n')
    res = subprocess.run(
        [*LAB, "plan"], cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONIOENCODING": "ascii"}
    )
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "?n?code" in res.stdout


def test_emoji_codes_in_user_text_print_as_themselves(fake_lab):
    path = fake_lab.write(name=":ab: :smile: lab")
    res = lab_cli("plan", "-c", str(path), cwd=fake_lab.dir)
    assert res.returncode == 0 and ":ab: :smile: lab" in res.stdout
    res = lab_cli("plan", "-c", str(path), "--check", cwd=fake_lab.dir)
    assert ":ab:" in res.stdout


def test_library_warnings_are_one_line_each(fake_lab, monkeypatch):
    import logging

    from lab.cli import group

    def noisy(cfg_path):
        logging.getLogger("lab.somewhere").warning("first line\nsecond line")
        return []

    monkeypatch.setattr(group.config, "load", lambda p, *sets: (noisy(p), config.parse({}, p))[1])
    res = lab_cli("plan", cwd=fake_lab.dir)
    assert [ln for ln in res.stderr.splitlines() if "warning" in ln] == ["lab: warning: first line"]


def test_the_state_directory_in_doctor(monkeypatch, tmp_path):
    from lab import doctor

    monkeypatch.setenv("LAB_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(doctor, "_tool", lambda name, *a, **k: doctor.Check(name, "ok", "x"))
    state = {c.name: c for c in doctor.run_checks(str(tmp_path / "none.toml"))}["state"]
    assert state.status == "ok" and "made on first use" in state.detail
    (tmp_path / "state").mkdir()
    (tmp_path / "state").chmod(0o777)
    state = {c.name: c for c in doctor.run_checks(str(tmp_path / "none.toml"))}["state"]
    assert state.status == "fail" and "writable by group and others" in state.detail
    time.sleep(0)
