"""Pure: which samples count. A flagged sample is stored and shown, never averaged in.

A sample is flagged
- by its parser (lab.workloads.toolkit.flag): labels `flagged` = 1 and `flagged_why`, on every
  sample of a load that failed in part or measured nothing, and on the `unmeasured_<tag>` rows
  that stand where a tool measured nothing;
- by its host (lab.hostload.label): labels[HOST_LOAD]["flag"], when foreign load or CPU steal on
  the host exceeded `[suite] foreign_load_pct` during its repetition, or the host was not quiet
  before it;
- by its client (lab.clientload.label): labels[CLIENT_LOAD]["flag"], when the machine that ran a
  network workload's load generator (not the cell's host) was busy at or above `[suite]
  client_saturated_pct` % of its CPUs during the repetition.
Medians, CIs, verdicts, the A/A band and adaptive repetition use the samples no flag holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lab.clientload import CLIENT_LOAD
from lab.hostload import HOST_LOAD

FLAGGED = "flagged"  # the parsers' label (lab.workloads.toolkit.FLAGGED)
FLAGGED_WHY = "flagged_why"
PARSER_LABELS = (FLAGGED, FLAGGED_WHY, "unmeasured")  # what a parser sets: dropped before a reparse


def reasons(labels: Mapping[str, Any]) -> list[str]:
    """Why a sample is flagged, in words ([] when it counts)."""
    out = []
    if labels.get(FLAGGED):
        out.append(str(labels.get(FLAGGED_WHY) or "flagged by its parser (errors during the load)"))
    return out + load_reasons(labels)


def load_reasons(labels: Mapping[str, Any]) -> list[str]:
    """The flags of the host's and the client's load windows, in words."""
    windows = (labels.get(key) for key in (HOST_LOAD, CLIENT_LOAD))
    return [str(w["flag"]) for w in windows if isinstance(w, Mapping) and w.get("flag")]


def is_flagged(labels: Mapping[str, Any]) -> bool:
    return bool(reasons(labels))


def load_flagged(labels: Mapping[str, Any]) -> bool:
    """Flagged for the machines' load (its host's or its client's), not for the measurement itself:
    the repetitions `[suite] remeasure_flagged` measures again."""
    return bool(load_reasons(labels))


def foreign_pct(labels: Mapping[str, Any]) -> float | None:
    """The foreign load on the host during the sample's repetition (% of one core), if measured."""
    host = labels.get(HOST_LOAD)
    value = host.get("foreign_pct") if isinstance(host, Mapping) else None
    return float(value) if isinstance(value, (int, float)) else None


def steal_pct(labels: Mapping[str, Any]) -> float | None:
    host = labels.get(HOST_LOAD)
    value = host.get("steal_pct") if isinstance(host, Mapping) else None
    return float(value) if isinstance(value, (int, float)) else None
