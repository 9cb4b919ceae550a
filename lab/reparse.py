"""`lab reparse`: a run's samples rebuilt from its stored raw outputs, after a parser fix.

Each workload's `parse` is pure (lab.workloads): it sees only the RawOutput the runner stored before
parsing, so the new samples are what the run would have stored with the fixed parser. The runner's
own labels (axes, round, the host's and client's load) are kept; the parser's are recomputed.
"""

from __future__ import annotations

from typing import Any

from lab import flags, workloads
from lab.store import Store


def reparse(store: Store, run_id: str) -> int:
    """Rebuild a run's samples from its stored raw outputs (after a parser fix)."""
    known = set(workloads.names())
    cells = {c.cell_id: c for c in store.cells(run_id)}
    old: dict[tuple[str, str, int], dict[str, Any]] = {}
    for s in store.samples(run_id):
        old.setdefault((s.cell_id, s.workload, s.repetition), s.labels)
    rows, count = [], 0
    for raw_id, cell_id, rep, raw in store.raw_outputs(run_id):
        if rep < 0 or raw.workload not in known:
            continue
        # the runner's labels (axes, round, the host's load) stay; the parser's own are recomputed
        base = {k: v for k, v in old.get((cell_id, raw.workload, rep), {}).items() if k not in flags.PARSER_LABELS}
        if not base and cell_id in cells:
            base = {**cells[cell_id].axes, "repetition": rep}
        samples = workloads.get(raw.workload).parse(raw)
        stamped = [
            type(s)(s.metric, s.value, s.unit, s.higher_is_better, {**base, **s.labels, "repetition": rep})
            for s in samples
        ]
        rows.append((cell_id, raw_id, raw.workload, rep, stamped))
        count += len(stamped)
    store.replace_samples(run_id, rows)  # parsed first, swapped in one transaction
    return count
