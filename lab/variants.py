"""A workload's own variants as the two sides of a comparison: `lab compare RUN --a variant=crun
--b variant=runc`.

Much of what the studies compared is not a cell axis but a workload's variant, measured in the same
cell as a row of its own: container-start's runtime, network and store (`start_ms_crun-none-persistent`),
podman-build's engine and network (`build_seconds_podman-default`), git-clone's places, iperf3's
directions. A row's variant is its tag, the last `_` part of its metric's name; a tag's parts are
joined by `-`. `variant=` in a selection names one or more of those parts: side A keeps the rows
whose tag has A's parts (in a row, in order), side B the rows whose tag is that tag with A's parts
replaced by B's. Each pair of rows is renamed on both sides to A's name with A's parts written `A/B`
(`start_ms_crun/runc-none-persistent`), so that they pair as one row and stay primary where the stem
is a primary metric's (`start_ms_*`): verdicts are corrected for every pair the comparison tests, as
cell comparisons are. Cells pair as they would
without `variant=` (the same cells on both sides when nothing else is selected)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from lab import results
from lab.analysis import Side, metric_series
from lab.errors import UsageError

KEY = "variant"  # the selector key: a row's tag, not a cell's axis


def take(selector: dict[str, str], option: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """(the selector without `variant`, the parts it names; () if none)."""
    rest = {k: v for k, v in selector.items() if k != KEY}
    if KEY not in selector:
        return rest, ()
    parts = tuple(selector[KEY].split("-"))
    if not all(parts) or any("_" in p or "/" in p for p in parts):
        raise UsageError(
            f"{option} variant={selector[KEY]}: a variant is one or more parts of a row's tag joined by '-' "
            "(the tag is what a metric's name ends with after its last '_', e.g. crun-none-persistent)"
        )
    return rest, parts


def split_metric(metric: str) -> tuple[str, tuple[str, ...]] | None:
    """(stem, tag parts) of a metric whose name ends in a tag; None for one without ('rc', 'x')."""
    stem, sep, tag = metric.rpartition("_")
    return (stem, tuple(tag.split("-"))) if sep and stem and tag else None


def swap(tag: tuple[str, ...], a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...] | None:
    """`tag` with its first run of `a`'s parts replaced by `b`'s; None if `a` is not in it."""
    for i in range(len(tag) - len(a) + 1):
        if tag[i : i + len(a)] == a:
            return tag[:i] + b + tag[i + len(a) :]
    return None


def pair_tag(tag: tuple[str, ...], a: tuple[str, ...], b: tuple[str, ...]) -> str:
    """A's tag with A's parts written `A/B`: crun-none-persistent, crun, runc -> crun/runc-none-persistent."""
    both = ("-".join(a) + "/" + "-".join(b),)
    return "-".join(swap(tag, a, both) or tag)


def tags(series: Iterable[results.Series]) -> list[str]:
    """The distinct tags of these series' primary rows (the workloads' headline metrics), sorted."""
    return sorted({"-".join(got[1]) for s in series if (got := split_metric(s.metric)) and metric_series(s).primary})


def sides(a: Side, b: Side, va: tuple[str, ...], vb: tuple[str, ...]) -> tuple[Side, Side]:
    """Sides A and B keeping only their variant's rows, each pair renamed to one name. UsageError
    when only one side names a variant, both name the same, or no row pairs."""
    if not va or not vb:
        raise UsageError("variant= compares two variants of the same rows: give one on each side (--a and --b)")
    if va == vb:
        raise UsageError(f"--a and --b both select variant={'-'.join(va)}: nothing to compare")
    named = []  # (a row of A, the key of its counterpart in B: workload, stem, B's tag, the pair's name)
    for s in a.series:
        got = split_metric(s.metric)
        tb = swap(got[1], va, vb) if got else None
        if got and tb is not None:
            named.append((s, (s.workload, got[0], "-".join(tb)), f"{got[0]}_{pair_tag(got[1], va, vb)}"))
    wanted = {key: name for _, key, name in named}
    renamed_b = [
        dataclasses.replace(s, metric=wanted[key])
        for s in b.series
        if (got := split_metric(s.metric)) and (key := (s.workload, got[0], "-".join(got[1]))) in wanted
    ]
    paired = {(s.workload, s.metric) for s in renamed_b}
    renamed_a = [dataclasses.replace(s, metric=name) for s, key, name in named if (key[0], name) in paired]
    if not renamed_a:
        a_, b_ = "-".join(va), "-".join(vb)
        raise UsageError(
            f"variant={a_} against variant={b_}: no row of side A has a tag with {a_} whose counterpart "
            f"with {b_} side B has (tags: {', '.join(tags(a.series)) or 'none'})"
        )
    return (
        dataclasses.replace(a, series=renamed_a, selector={**a.selector, KEY: "-".join(va)}),
        dataclasses.replace(b, series=renamed_b, selector={**b.selector, KEY: "-".join(vb)}),
    )
