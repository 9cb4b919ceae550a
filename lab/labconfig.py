"""The typed records of a lab.toml: frozen pydantic models, one per section.

`[matrix]` is built from the axes table (lab.axes); each `[hosts.NAME]` table is its backend's own
Settings model (lab.backends registry). Defaults live here, once. Reading a file, shaping pydantic's
errors and the checks across sections are lab.config's and lab.check's: this module only says what
each section may hold, so that lab.plan and lab.check can use the records without importing the
module that calls them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, create_model, field_validator

from lab import IMAGES_DIR, axes, backends, lease, paths, statedir
from lab.backends import HostSettings
from lab.errors import UsageError
from lab.images import RECIPES
from lab.wan import WanProfile

# Known golden images and the OS each one is: lab.images' recipes are the one list.
KNOWN_IMAGES: dict[str, str] = {name: r.os for name, r in RECIPES.items()}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class LabSection(Strict):
    name: str = Field(default="lab", description="the lab's name, recorded with each run")
    results: str = Field(
        default="results",
        description=(
            "directory holding lab.db and raw artefacts; `~` is your home, a relative path is relative to lab.toml"
        ),
    )
    # a machine whose lease was not renewed for this long is fair game for `lab gc` anywhere; a live
    # run renews its machines' leases every third of it (lab.lease, lab.runner.renewal)
    lease_minutes: float = Field(
        default=120,
        ge=lease.MIN_LEASE_MINUTES,
        le=7 * 24 * 60,
        description=(
            "a VM whose lease was not renewed this long is fair game for `lab gc` anywhere (a live run renews its own)"
        ),
    )
    # the mode a new results directory is made with; its store and report files get the same bits
    # without x: "0700" (private: the default), "0750" (readable by the group), "0755"
    results_mode: str = Field(
        default="0700",
        description=(
            'mode of a new results directory; its store and report files get the same bits without x ("0700": private, '
            '"0750": the group may read)'
        ),
    )

    @field_validator("results")
    @classmethod
    def _results(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must name the results directory")
        paths.expand(v)  # `~` as a shell reads it (ValueError for an unknown user's home)
        return v

    @field_validator("results_mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        if not re.fullmatch(r"0?[0-7]{3}", v):
            raise ValueError('must be an octal directory mode such as "0700" or "0750"')
        mode = int(v, 8)
        if mode & 0o700 != 0o700:
            raise ValueError("must give its owner rwx (7 in the first place)")
        if mode & 0o002:
            raise ValueError("must not let others write (the results of every user would be open to changes)")
        return f"{mode:04o}"

    @property
    def umask(self) -> int:
        """The umask that makes new results files and directories with results_mode."""
        return 0o777 & ~int(self.results_mode, 8)

    @property
    def file_mode(self) -> int:
        """The mode of a results file (the store, a report): results_mode without x (0600, 0640)."""
        return int(self.results_mode, 8) & 0o666


def _non_empty_unique(cls, v: list) -> list:
    if not v:
        raise ValueError("must list at least one value")
    if len(set(v)) != len(v):
        raise ValueError("lists a value twice")
    return v


# [matrix]: a list of values per axis (default: the axis's one default), and `exclude`.
if TYPE_CHECKING:
    # What the type checker sees: create_model's fields are invisible to it, so each axis's list
    # (matrix.nic, matrix.vcpus, ...) is a list of Any to it.
    class MatrixSection(Strict):
        exclude: list[dict[str, Any]] = []

        def __getattr__(self, name: str) -> list[Any]: ...
else:
    MatrixSection = create_model(
        "MatrixSection",
        __base__=Strict,
        __validators__={"non_empty_unique": field_validator(*axes.AXES)(_non_empty_unique)},
        **{a.name: (list[a.element], [a.default]) for a in axes.AXES_TABLE},
        exclude=(list[dict[str, Any]], []),
    )


class SuiteSection(Strict):
    workloads: list[str] = Field(
        default=["sysbench-cpu", "iperf3-tcp"],
        description="the workloads every cell runs, in this order (see Workload parameters)",
    )
    # Fixed n; with target_ci_pct, the minimum n before the CI is looked at.
    repetitions: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="measured repetitions per cell and workload (fixed n); with target_ci_pct, the minimum n",
    )
    warmup: int = Field(
        default=1,
        ge=0,
        le=100,
        description="repetitions per VM boot that are run and discarded before the measured ones",
    )
    # sequential: cells in matrix order; random: cells shuffled; interleaved: rounds in which
    # every cell is booted, measured for repetitions_per_boot repetitions and destroyed, in a
    # new shuffled order each round (lab.runner). The seed of every shuffle is recorded.
    order: Literal["sequential", "random", "interleaved"] = Field(
        default="sequential",
        description=(
            "sequential: cells in matrix order; random: shuffled; interleaved: rounds that boot, measure and destroy "
            "every cell, in a new shuffled order each round"
        ),
    )
    seed: int | None = Field(
        default=None, description="seed of every shuffle and bootstrap (unset: random, and recorded)"
    )
    repetitions_per_boot: int = Field(
        default=1, ge=1, le=1000, description="interleaved only: repetitions of a cell per round"
    )
    # Adaptive repetition: repeat until the 95 % CI of the median of every throughput-like metric
    # is within +-target_ci_pct % of the median, or a budget is spent.
    target_ci_pct: float | None = Field(
        default=None,
        gt=0,
        le=100,
        description=(
            "adaptive repetition: repeat until the 95 % CI of the median of every throughput-like metric is within ± "
            "this % (unset: fixed n)"
        ),
    )
    max_repetitions: int = Field(
        default=30, ge=1, le=10000, description="adaptive repetition's budget per cell and workload, in repetitions"
    )
    max_seconds: float | None = Field(
        default=None,
        gt=0,
        le=7 * 86400,
        description="adaptive repetition's budget per cell and workload, in measured seconds",
    )
    # Fixed n: a repetition flagged for its host's or client's load (below) is measured again, at
    # most this many times per cell and workload, so that a busy spell does not leave the cell with
    # fewer than n figures that count. Adaptive repetition already measures until the unflagged
    # figures suffice (or max_repetitions), so it takes no such key.
    remeasure_flagged: int = Field(
        default=0,
        ge=0,
        le=1000,
        description=(
            "fixed n: a repetition flagged for its host's or client's load is measured again, at most this many times "
            "per cell and workload"
        ),
    )
    bare_metal: bool = Field(
        default=False, description="add a cell that runs the suite on the (local) host itself: the baseline"
    )
    noise_floor: bool = Field(
        default=False, description="run the first cell twice (an A/A twin) to measure the noise floor"
    )
    params: dict[str, dict[str, Any]] = {}
    # The host under the samples (lab.hostload). A measured repetition during which anything that
    # is not the lab used more than foreign_load_pct % of one core on its host (or the host's CPU
    # steal exceeded it) is flagged: shown, kept out of medians and verdicts.
    foreign_load_pct: float = Field(
        default=10.0,
        ge=0,
        le=100_000,
        description=(
            "a repetition during which anything that is not the lab used more than this % of one core on its host (or "
            "CPU steal exceeded it) is flagged"
        ),
    )
    # wait: before each measured repetition, wait until the host has been quiet (at or below
    # foreign_load_pct) for quiet_seconds, at most quiet_timeout_s, then flag the repetition and go
    # on; record: measure and flag only; off: neither. Unset: wait where the host is this machine
    # (Capabilities.local_host), record elsewhere.
    quiet_host: Literal["wait", "record", "off"] | None = Field(
        default=None,
        description=(
            "wait: before each repetition wait until the host is quiet; record: measure and flag only; off: neither "
            "(unset: wait on this machine, record elsewhere)"
        ),
    )
    quiet_seconds: float = Field(
        default=2.0,
        gt=0,
        le=600,
        description='quiet_host = "wait": how long the host must stay at or below foreign_load_pct',
    )
    quiet_timeout_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description='quiet_host = "wait": the longest wait, after which the repetition is flagged and measured',
    )
    # The client under network samples (lab.clientload): a repetition during which the machine
    # running the load generator (when it is not the cell's host) was busy at or above this % of
    # all its CPUs is flagged: the generator, not the guest, may have set the figure.
    client_saturated_pct: float = Field(
        default=90.0,
        gt=0,
        le=100,
        description=(
            "a network repetition during which the load generator's machine was busy at or above this % of all its CPUs"
            " is flagged"
        ),
    )

    def quiet_mode(self, local_host: bool) -> str:
        """What a host gets: the setting; unset, $LAB_QUIET_HOST (a machine that runs several labs at
        once, as the test suite does, where each lab's VMs are the others' foreign load); else
        "wait" on this machine and "record" elsewhere."""
        if self.quiet_host:
            return self.quiet_host
        env = os.environ.get("LAB_QUIET_HOST", "")
        if env:
            if env not in ("wait", "record", "off"):
                raise UsageError(f"LAB_QUIET_HOST = {env!r}: expected wait, record or off")
            return env
        return "wait" if local_host else "record"


class IsolationSection(Strict):
    """[isolation]: how the matrix's isolation kinds are made (lab.isolation)."""

    # The container's network: "host" shares the machine's stack (what the VM cell measures, plus
    # the container); "bridge" is podman's own namespace behind NAT, the ports the suite serves
    # published on the machine's address.
    network: Literal["host", "bridge"] = Field(
        default="host",
        description=(
            'the container\'s network: "host" shares the machine\'s stack; "bridge" is podman\'s own namespace'
            " behind NAT, ports published"
        ),
    )


class LabConfig(Strict):
    lab: LabSection = LabSection()
    # Each host's table is validated by its backend's own Settings model (lab.backends registry).
    hosts: dict[str, SerializeAsAny[HostSettings]] = {}
    matrix: MatrixSection = MatrixSection()
    wan: dict[str, WanProfile] = {}
    suite: SuiteSection = SuiteSection()
    isolation: IsolationSection = IsolationSection()
    # Where the file was read from; relative paths in it are relative to its folder.
    source: str = Field(default="lab.toml", exclude=True)

    @property
    def base_dir(self) -> Path:
        return Path(self.source).resolve().parent

    @property
    def results_dir(self) -> Path:
        """`[lab] results`: `~` expanded, relative to lab.toml's folder (lab.paths, as every path)."""
        return paths.local(self.lab.results, self.base_dir)

    def backend_env(self) -> backends.BackendEnv:
        """What each host's backend is built with besides its settings."""
        return backends.BackendEnv(
            source=self.source, base_dir=self.base_dir, state_dir=statedir.default_dir(), ssh_key=IMAGES_DIR / "lab_key"
        )

    def open_backends(self, hosts: set[str] | list[str] | None = None) -> dict[str, backends.Backend]:
        """A backend per host (every host when `hosts` is None); nothing is contacted yet."""
        names = self.hosts if hosts is None else hosts
        return backends.open_backends({n: self.hosts[n] for n in names}, self.backend_env())

    def image_os(self, image: str) -> str:
        return KNOWN_IMAGES[image]
