"""What users and tools wrote is printed as text: a `[/x]` in a lab name, a label or an error is
never read as rich markup (it used to crash plan, show and the end of run); a host name cannot
carry one (lab.names refuses it: tests/unit/test_trust_names.py). And the CLI's last guard: an
unexpected error is one line and a log, exit 1."""

from __future__ import annotations

import re
from pathlib import Path

from support.cli import lab_cli

from lab import plan

NAME = "[bold]x[/] [/oops]"
HOST = "h.1_x-y"  # every mark a host name may have


def _lab(fake_lab) -> Path:
    path = fake_lab.dir / "lab.toml"
    path.write_text(f'''[lab]
name = "{NAME}"
results = "results"
[hosts."{HOST}"]
backend = "fake"
[matrix]
host = ["{HOST}"]
nic = ["virtio", "e1000"]
[suite]
workloads = ["fake-work"]
repetitions = 2
warmup = 0
''')
    return path


def test_markup_in_names_prints_literally_everywhere(fake_lab):
    cfg = str(_lab(fake_lab))
    res = lab_cli("plan", "-c", cfg, cwd=fake_lab.dir)
    assert res.returncode == 0, res.stderr
    assert NAME in res.stdout and HOST in res.stdout
    res = lab_cli("run", "-c", cfg, "--run-id", "r1", cwd=fake_lab.dir)
    assert res.returncode == 0, res.stderr
    assert f"({NAME})" in res.stdout and f"{HOST}/debian12/virtio" in res.stderr
    res = lab_cli("run", "-c", cfg, "--run-id", "r2", cwd=fake_lab.dir)
    assert res.returncode == 0, res.stderr
    res = lab_cli("show", "r1", "-c", cfg, cwd=fake_lab.dir)
    assert res.returncode == 0 and f"({NAME})" in res.stdout, res.stderr
    res = lab_cli("ls", "-c", cfg, cwd=fake_lab.dir)
    assert res.returncode == 0 and NAME in res.stdout, res.stderr
    res = lab_cli("compare", "r1", "r2", "-c", cfg, cwd=fake_lab.dir)
    assert res.returncode == 0, res.stderr
    assert "virtio" in res.stdout and "Traceback" not in res.stderr
    res = lab_cli("compare", "r1", "--a", f"host={HOST},nic=virtio", "--b", "nic=e1000", "-c", cfg, cwd=fake_lab.dir)
    assert res.returncode == 0 and f"A = r1 [host={HOST},nic=virtio]" in res.stdout, res.stderr


def test_markup_in_a_failed_cells_error_prints_literally(fake_lab):
    cfg = _lab(fake_lab)
    cfg.write_text(cfg.read_text().replace('backend = "fake"', 'backend = "fake"\nfail = { c01 = "boot" }'))
    res = lab_cli("run", "-c", str(cfg), "--run-id", "r1", cwd=fake_lab.dir)
    assert res.returncode == 1
    assert "c01 failed at boot: c01: injected failure at boot" in res.stderr
    assert f"{HOST}/debian12/virtio/2c/1024m/virtio/linked/default: failed at boot" in res.stdout


def test_an_unexpected_error_is_one_line_and_a_log(fake_lab, monkeypatch):
    cfg = str(_lab(fake_lab))

    def broken(cfg):
        raise RuntimeError("a bug [/x]\nsecond line")

    monkeypatch.setattr(plan, "units", broken)
    res = lab_cli("plan", "-c", cfg, cwd=fake_lab.dir)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    m = re.fullmatch(r"lab: error: RuntimeError: a bug \[/x\]; details in (\S+\.log)", lines[0])
    assert m, lines[0]
    log = Path(m.group(1))
    try:
        assert "Traceback" in log.read_text() and "broken" in log.read_text()
    finally:
        log.unlink()


def test_ctrl_c_outside_a_run_is_exit_130(fake_lab, monkeypatch):
    cfg = str(_lab(fake_lab))

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan, "units", interrupted)
    res = lab_cli("plan", "-c", cfg, cwd=fake_lab.dir)
    assert res.returncode == 130 and res.stderr.strip() == "lab: aborted"  # click turns Ctrl-C into Abort
