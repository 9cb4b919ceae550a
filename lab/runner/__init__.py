"""A lab run: per cell, lease -> clone -> boot -> verify -> tune -> workloads -> teardown.

- lab.runner.run: the run (checks before anything is made, the run lock, order and rounds, resume)
- lab.runner.lanes: several hosts at once, one lane (thread) per host, slot or node; cancel, lost
  hosts, overlaps
- lab.runner.clientvm: client = "vm": a host's load generators in a VM the run makes on it
- lab.runner.clientssh: client = "ssh:USER@MACHINE": on a machine of the user's, over SSH
- lab.runner.cells: a VM cell and the bare-metal cell, each inside lab.lifecycle.CellLife
- lab.runner.measure: the workloads stage (repetitions, executions); `lab reparse` is lab.reparse
- lab.runner.context: what the parts of one run share
"""

from lab.lifecycle import STAGES, Interrupted, Reporter, SilentReporter, shielded
from lab.reparse import reparse
from lab.runner.cells import run_unit, verify
from lab.runner.context import RunContext, workload_params
from lab.runner.measure import run_workloads
from lab.runner.run import (
    BOOT_ESTIMATE_S,
    estimate_seconds,
    image_lines,
    new_run_id,
    prepare,
    resumable,
    run_lab,
    run_rounds,
)

__all__ = [
    "BOOT_ESTIMATE_S",
    "STAGES",
    "Interrupted",
    "Reporter",
    "RunContext",
    "SilentReporter",
    "estimate_seconds",
    "image_lines",
    "new_run_id",
    "prepare",
    "reparse",
    "resumable",
    "run_lab",
    "run_rounds",
    "run_unit",
    "run_workloads",
    "shielded",
    "verify",
    "workload_params",
]
