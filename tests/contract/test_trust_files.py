"""Issue 35: the files the lab writes where it was told (lab.outfiles). `lab report -o` and `lab
reproduce --out` never replace a symbolic link, a device node, a FIFO, a socket or a directory
(one line naming the file, exit 2, the target as it was), never a user's own file without
--force, leave no temporary file behind on any error (a full disk: the line names the file, exit
1), and give report files [lab] results_mode without x (0600 by default, whatever the umask)."""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

import pytest
from support.cli import lab_cli

from lab import outfiles, report
from lab.errors import LabError, UsageError
from lab.model import RawOutput
from lab.store import Store


def _store(where: Path) -> Store:
    s = Store(where)
    s.create_run("r1", "t", config_path="", config_text="", seed=1, lab_version="0", manifest={})
    s.add_cell("r1", "c01", 1, "local/debian12/virtio", {"nic": "virtio"})
    s.finish_run("r1", "done")
    return s


@pytest.fixture
def lab_dir(tmp_path):
    _store(tmp_path / "results").close()
    (tmp_path / "lab.toml").write_text('[lab]\nresults = "results"\n')
    return tmp_path


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _socket(p: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()


def _device(p: Path) -> None:
    os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # a /dev/null of its own, where replacing it is harmless


def _symlink(p: Path) -> None:
    (p.parent / "victim").write_text("precious")
    p.symlink_to(p.parent / "victim")


def _dangling(p: Path) -> None:
    p.symlink_to(p.parent / "nowhere")


def _directory(p: Path) -> None:
    p.mkdir()


KINDS = {
    "symlink": (_symlink, "a symbolic link"),
    "dangling-symlink": (_dangling, "a symbolic link"),
    "fifo": (_fifo, "a FIFO"),
    "socket": (_socket, "a socket"),
    "device": (_device, "a character device"),
    "directory": (_directory, "a directory"),
}


def _snapshot(p: Path) -> tuple:
    st = os.lstat(p)
    return (stat.S_IFMT(st.st_mode), st.st_ino, os.readlink(p) if p.is_symlink() else None)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_report_never_replaces_what_is_not_a_regular_file(lab_dir, kind):
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("mknod needs root")
    make, words = KINDS[kind]
    target = lab_dir / "out.html"
    make(target)
    before = _snapshot(target)
    res = lab_cli("report", "r1", "-o", str(target), cwd=lab_dir)
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    if kind == "directory":  # click's own check of -o says it first, in its words
        assert line.startswith("lab: error: ") and str(target) in line and "is a directory" in line
    else:
        assert line == f"lab: error: {target} is {words}, not a regular file: refusing to replace it"
    assert _snapshot(target) == before  # the same node, untouched
    if kind == "symlink":
        assert (lab_dir / "victim").read_text() == "precious"
    assert not [p for p in lab_dir.iterdir() if p.name.endswith(".tmp")]


def test_report_replaces_its_own_regular_file_whole_with_the_results_mode(lab_dir):
    target = lab_dir / "out.html"
    target.write_text("an older report")
    old = os.umask(0o022)
    try:
        res = lab_cli("report", "r1", "-o", str(target), cwd=lab_dir)
    finally:
        os.umask(old)
    assert res.returncode == 0, res.stderr
    assert target.read_text().startswith("<!DOCTYPE html>") and stat.S_IMODE(target.stat().st_mode) == 0o600
    (lab_dir / "lab.toml").write_text('[lab]\nresults = "results"\nresults_mode = "0750"\n')
    res = lab_cli("report", "r1", cwd=lab_dir)  # the default file, beside the store
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE((lab_dir / "results" / "report-r1.html").stat().st_mode) == 0o640


def test_a_full_disk_leaves_no_partial_file_and_names_the_target(tmp_path, monkeypatch):
    target = tmp_path / "r.html"
    target.write_text("the old one")
    real = os.write
    calls = []

    def full(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data[:10])  # a short write first: the rest must follow, then the disk is full

    monkeypatch.setattr(outfiles.os, "write", full)
    with pytest.raises(LabError) as err:
        outfiles.write(target, "x" * 100_000)
    assert str(err.value) == f"{target}: cannot be written: No space left on device; nothing was written there"
    assert err.value.exit_code == 1 and len(calls) == 2
    assert target.read_text() == "the old one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


def test_write_without_replace_never_takes_an_existing_name(tmp_path):
    mine = tmp_path / "mine.sh"
    mine.write_text("my script")
    with pytest.raises(UsageError, match="exists: refusing to replace a file the lab did not write here"):
        outfiles.write(mine, "lab's", replace=False)
    assert mine.read_text() == "my script"
    made = outfiles.write(tmp_path / "sub" / "new.sh", "lab's", replace=False, mode=0o640)
    assert made.read_text() == "lab's" and stat.S_IMODE(made.stat().st_mode) == 0o640
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["new.sh"]


def test_report_write_checks_the_target_before_it_renders(tmp_path, monkeypatch):
    s = _store(tmp_path / "results")
    (tmp_path / "d").mkdir()
    monkeypatch.setattr(report, "render", lambda *a, **k: pytest.fail("rendered before the target was checked"))
    with pytest.raises(UsageError, match="is a directory"):
        report.write(s, "r1", out=tmp_path / "d")
    s.close()


# -- lab reproduce --out DIR -----------------------------------------------------------------------


AXES = {"host": "local", "image": "debian12", "nic": "virtio", "vcpus": 1, "memory_mib": 512, "disk_bus": "virtio"}


def _reproducible(tmp_path: Path, *, run_id: str = "r1", label: str = "local/debian12/virtio", **axes) -> Path:
    s = Store(tmp_path / "results")
    s.create_run(
        run_id,
        "t",
        config_path="",
        config_text="",
        seed=1,
        lab_version="0",
        manifest={"images": {"debian12": {"digest": "d" * 64, "sha256": "e" * 64}}},
    )
    s.add_cell(run_id, "c01", 1, label, {**AXES, **axes})
    s.cell_update(run_id, "c01", status="done", facts={"accel": "tcg"})
    s.add_raw(run_id, "c01", 1, RawOutput("sysbench-cpu", "sysbench cpu --threads=1 run", ""))
    s.finish_run(run_id, "done")
    s.close()
    return tmp_path / "results"


def _reproduce(tmp_path: Path, *extra: str, out: Path | None = None, run: str = "r1"):
    return lab_cli(
        "reproduce", run, "c01", "--out", str(out or tmp_path / "repro"), "--results", str(tmp_path / "results"),
        *extra, cwd=tmp_path,
    )  # fmt: skip


def test_reproduce_refuses_to_overwrite_the_users_files_unless_forced(tmp_path):
    _reproducible(tmp_path)
    out = tmp_path / "repro"
    out.mkdir()
    (out / "tune.sh").write_text("#!/bin/sh\necho my own tuning\n")
    res = _reproduce(tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"lab: error: {out / 'tune.sh'} exists: refusing to replace a file the lab did not write here "
        "(--force replaces it)"
    ]
    assert sorted(p.name for p in out.iterdir()) == ["tune.sh"]  # nothing else was written either
    assert (out / "tune.sh").read_text() == "#!/bin/sh\necho my own tuning\n"
    res = _reproduce(tmp_path, "--force")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["Vagrantfile", "tune.sh", "workloads.sh"]
    assert "my own tuning" not in (out / "tune.sh").read_text()
    res = _reproduce(tmp_path)  # its own files are files it did not write *now*: refused again
    assert res.returncode == 2 and "exists" in res.stderr


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_reproduce_never_replaces_a_link_or_a_special_file_even_when_forced(tmp_path, kind):
    _reproducible(tmp_path)
    out = tmp_path / "repro"
    out.mkdir()
    make, words = KINDS[kind]
    make(out / "Vagrantfile")
    before = _snapshot(out / "Vagrantfile")
    res = _reproduce(tmp_path, "--force")
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"lab: error: {out / 'Vagrantfile'} is {words}, not a regular file: refusing to replace it"
    ]
    assert _snapshot(out / "Vagrantfile") == before
    assert not (out / "tune.sh").exists() and not (out / "workloads.sh").exists()


def test_reproduce_refuses_an_out_dir_that_is_a_file_or_a_link(tmp_path):
    _reproducible(tmp_path)
    (tmp_path / "a-file").write_text("x")
    res = _reproduce(tmp_path, out=tmp_path / "a-file")
    assert res.returncode == 2 and str(tmp_path / "a-file") in res.stderr and "is a file" in res.stderr
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    res = _reproduce(tmp_path, out=tmp_path / "link")
    assert res.returncode == 2 and "is a symbolic link, not a directory" in res.stderr
    assert list((tmp_path / "real").iterdir()) == []


def test_images_render_never_writes_through_a_link_in_its_directory(tmp_path):
    """`lab images render NAME DIR` writes where the user said: a link planted at one of its files'
    names is refused, not followed (root would write the victim)."""
    out = tmp_path / "render"
    (out / "http").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (out / "http" / "install.sh").symlink_to(victim)
    res = lab_cli("images", "render", "alpine3", str(out), cwd=tmp_path)  # an ISO recipe: no container to stage
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"lab: error: {out / 'http' / 'install.sh'} is a symbolic link, not a regular file: refusing to replace it"
    ]
    assert victim.read_text() == "precious" and (out / "http" / "install.sh").is_symlink()
    (out / "http" / "install.sh").unlink()
    res = lab_cli("images", "render", "alpine3", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (out / "http" / "install.sh").is_file() and (out / "stage" / "lab-nginx.conf").is_file()


def test_a_runs_store_and_report_get_the_results_mode_whatever_the_umask(fake_lab):
    path = fake_lab.write()
    old = os.umask(0o022)
    try:
        assert lab_cli("run", "-c", str(path), "--run-id", "m1", cwd=fake_lab.dir).returncode == 0
        assert lab_cli("report", "m1", "-c", str(path), cwd=fake_lab.dir).returncode == 0
    finally:
        os.umask(old)
    results = fake_lab.dir / "results"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in results.iterdir() if p.is_file()}
    assert modes["lab.db"] == 0o600 and modes["report-m1.html"] == 0o600, modes
    assert stat.S_IMODE(results.stat().st_mode) == 0o700
