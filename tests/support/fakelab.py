"""A lab on the fake backend (tests/fakes) in a test's directory: the `fake_lab` fixture's object."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path


class FakeLab:
    """A lab on the fake backend in a test's directory: `write()` its lab.toml, `load()` it."""

    def __init__(self, tmp_path: Path, workload):
        self.dir, self.workload = tmp_path, workload
        self.path = tmp_path / "lab.toml"

    def write(self, *, matrix: str = "", suite: str = "", host: str = "", extra: str = "", name: str = "fake") -> Path:
        suite = textwrap.dedent(suite)
        given = {line.split("=")[0].strip() for line in suite.splitlines()}
        defaults = "".join(
            f"{k} = {v}\n"
            for k, v in (("workloads", '["fake-work"]'), ("repetitions", 2), ("warmup", 1))
            if k not in given
        )
        text = (
            f'[lab]\nname = {json.dumps(name)}\nresults = "results"\n\n[hosts.f]\nbackend = "fake"\n'
            + textwrap.dedent(host)
            + "\n"
            + textwrap.dedent(extra)
            + '\n[matrix]\nhost = ["f"]\n'
            + textwrap.dedent(matrix)
            + "\n[suite]\n"
            + defaults
            + suite
        )
        if "[hosts.local]" not in text:
            # the always-defined local host gets this test's own workdir: a test's `lab gc` or
            # listing must never see (or remove) this machine's real leases and warm snapshots
            text += f'\n[hosts.local]\nbackend = "local"\nworkdir = {json.dumps(str(self.dir / "local"))}\n'
        self.path.write_text(text)
        return self.path

    def load(self):
        from lab import config

        return config.load(self.path)
