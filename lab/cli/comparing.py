"""`lab compare`: two runs, two hosts or any two cell selections side by side, or every cell of a
run against its baseline; a verdict per primary metric (lab.compare, lab.verdicts)."""

from __future__ import annotations

import dataclasses

import click
from rich.text import Text

from lab import analysis, compare as compare_mod, results, stats, variants, verdicts
from lab.cli import shapes
from lab.cli.group import cli, config_option, read_store, results_option
from lab.cli.printing import VERDICT_STYLES, fmt, line, out, say, styled, table
from lab.cli.views import flag_mark
from lab.errors import UsageError
from lab.store import RunRow, Store

REVERSES = " †"  # beside a verdict whose sibling goes the other way


def _asdict(record: object) -> dict | None:
    return dataclasses.asdict(record) if record is not None else None  # type: ignore[call-overload]


def _verdict(r: compare_mod.Row) -> Text:
    """The verdict word, coloured, with † when a sibling row goes the other way."""
    style = VERDICT_STYLES.get(r.verdict, "yellow" if r.verdict.startswith(("missing", "only")) else "")
    differs = r.verdict in (compare_mod.Verdict.BETTER, compare_mod.Verdict.WORSE)
    mark = REVERSES if differs and r.siblings is not None and r.siblings.reverses else ""
    return line(styled(r.verdict.value, style), mark)


def _margin_pct(value: float) -> float:
    try:
        verdicts.Margin.stated(value)
    except ValueError:
        raise UsageError(f"--margin {value:g}: must be a percentage between 0 and 100 (exclusive)") from None
    return value


@cli.command("compare")
@click.argument("run_a")
@click.argument("run_b", required=False)
@click.option(
    "--a",
    "sel_a",
    multiple=True,
    metavar="AXIS=VALUE",
    help="side A: only the cells of RUN_A with these axes (repeatable, or comma-separated); "
    "variant=TAG: only the rows whose tag (a metric's last _ part) has TAG",
)
@click.option(
    "--b",
    "sel_b",
    multiple=True,
    metavar="AXIS=VALUE",
    help="side B: only the cells of RUN_B (or of RUN_A when RUN_B is not given) with these axes",
)
@click.option(
    "--baseline",
    "baseline",
    default=None,
    is_flag=False,
    flag_value="kind=bare-metal",
    metavar="[AXIS=VALUE]",
    help="every cell of RUN_A against the baseline cell of its host: "
    "the bare-metal cell, or the cell these axes select",
)
@click.option(
    "--margin",
    "margin",
    type=float,
    default=verdicts.DEFAULT_MARGIN_PCT,
    show_default=True,
    metavar="PCT",
    help="the smallest change worth a verdict, in %: 'same' within it, better/worse beyond it "
    "(a metric's A/A band widens it where measured)",
)
@click.option("--all", "everything", is_flag=True, help="every metric (CPU breakdowns, zero error counters)")
@config_option
@results_option
@click.option("--json", "as_json", is_flag=True, help="the comparison as JSON (shape lab.compare/2)")
def compare_cmd(run_a, run_b, sel_a, sel_b, baseline, margin, everything, config_path, results_dir, as_json):
    """Two runs, two hosts or any two cell selections side by side: ratio of medians (B/A) with
    its 95 % CI, Mann-Whitney p and, for each workload's primary metrics, q (corrected together)
    and a verdict: better, worse, same (within the margin) or unknown; the other metrics are
    exploratory. `lab compare A B`, `lab compare RUN --a nic=virtio --b nic=e1000`,
    `lab compare RUN --a host=pve1 --b host=bsd1`, `lab compare RUN --baseline`; a workload's own
    variants, rows of the same cells: `lab compare RUN --a variant=crun --b variant=runc`."""
    margin = _margin_pct(margin)
    store = read_store(config_path, results_dir)
    ra = store.run(run_a)
    if baseline is not None:
        if run_b or sel_a or sel_b:
            raise UsageError(
                "--baseline compares the cells of one run with its baseline cell; it takes no RUN_B, --a or --b"
            )
        _print_overheads(store, ra, analysis.parse_selector([baseline], "--baseline"), everything, as_json, margin)
        return
    if run_b is None and not (sel_a or sel_b):
        raise UsageError("lab compare needs two runs (A B), or --a/--b selections of one run's cells, or --baseline")
    rb = store.run(run_b) if run_b else ra
    sides, picked = [], []
    for r, sel, opt in ((ra, sel_a, "--a"), (rb, sel_b, "--b")):
        selector, variant = variants.take(analysis.parse_selector(sel, opt, (variants.KEY,)), opt)
        picked.append(variant)
        sd = analysis.side(
            r.id, r.seed, store.cells(r.id), store.samples(r.id), store.host_facts.of_run(r.id), selector
        )
        if not sd.cells:
            raise UsageError(
                f"{opt} {','.join(sel)}: no cell of run {r.id} matches"
                f" (cells: {', '.join(c.label for c in store.cells(r.id))})"
            )
        sides.append(sd)
    if any(picked):  # a workload's own variants (rows of the same cells) as the two sides
        sides = list(variants.sides(sides[0], sides[1], picked[0], picked[1]))
    cmp = analysis.compare_sides(
        sides[0],
        sides[1],
        noise=_noise(store, ra, rb),
        everything=everything,
        threshold_pct=analysis.threshold_of(ra.manifest, rb.manifest),
        margin_pct=margin,
    )
    if as_json:
        shapes.emit(
            "compare",
            {
                "a": {"run": ra.id, "selector": sides[0].selector},
                "b": {"run": rb.id, "selector": sides[1].selector},
                **_rule(cmp.rows, margin),
                "rows": [r.as_dict() for r in cmp.rows],
                "families": [{**f.__dict__, "agrees": f.agrees, "reverses": f.reverses} for f in cmp.families()],
                "host_differences": [dict(zip(("host", "fact", "a", "b"), d)) for d in cmp.host_diffs],
                "host_load": {
                    "a": _asdict(sides[0].load),
                    "b": _asdict(sides[1].load),
                    "difference": cmp.load_diff,
                },
            },
        )
        return
    title = (
        f"A = {ra.id}"
        + (f" [{','.join(sel_a)}]" if sel_a else "")
        + f"   B = {rb.id}"
        + (f" [{','.join(sel_b)}]" if sel_b else "")
    )
    t = table(
        ("cell", "workload", "metric", "median A", "median B", "B/A", "95 % CI", "p", "q", "margin", "verdict"),
        title=title,
        right=("median A", "median B", "B/A", "95 % CI", "p", "q", "margin"),
    )
    short = results.short_labels(sorted({r.key[0] for r in cmp.rows}))
    for r in sorted(cmp.rows, key=lambda r: (r.key[0], r.key[1], not r.primary, r.key[2])):
        cell, wl, metric = r.key
        t.add_row(
            short.get(cell, cell),
            wl,
            f"{metric} ({r.unit})",
            line(fmt(r.median_a), flag_mark(r.flagged_a)),
            line(fmt(r.median_b), flag_mark(r.flagged_b)),
            fmt(r.ratio),
            f"{fmt(r.ratio_ci[0])}–{fmt(r.ratio_ci[1])}" if r.ratio_ci else "–",
            fmt(r.p_value),
            fmt(r.q_value),
            r.margin.text() if r.margin else "–",
            _verdict(r),
        )
    out.print(t)
    _print_rule(cmp)
    if any(r.flagged_a or r.flagged_b for r in cmp.rows):
        say(
            styled("⚑n", "red"),
            ": n flagged samples of that side, shown in `lab show`, left out of the median and the verdict",
        )
    if not cmp.noise:
        say("A/A band: not measured ([suite] noise_floor = true runs the first cell twice to measure it)")
    _print_host_diffs(cmp.host_diffs, ra.id == rb.id and not (set(sides[0].hosts) ^ set(sides[1].hosts)))
    for name, sd in (("A", sides[0]), ("B", sides[1])):
        say(f"host load under {name}: {sd.load.text() if sd.load else 'not measured'}")
    if cmp.load_diff:
        say(styled("host load differs: ", "yellow"), cmp.load_diff)


def _noise(store: Store, *runs: RunRow) -> dict:
    """(workload, metric) -> the widest A/A band of these runs' twins."""
    noise: dict = {}
    for r in {r.id: r for r in runs}.values():
        for k, v in analysis.noise_floor(
            results.series(store.samples(r.id), store.cells(r.id)), seed=r.seed or 0
        ).items():
            noise[k] = stats.widest(noise.get(k), v)
    return noise


def _rule(rows: list[compare_mod.Row], margin: float) -> dict:
    """How the verdicts were reached, for the JSON documents."""
    return {
        "alpha": compare_mod.DEFAULT_ALPHA,
        "margin_pct": margin,
        "primary_rows": sum(1 for r in rows if r.q_value is not None),
    }


def _print_rule(cmp: analysis.Comparison) -> None:
    """Under the table: what the verdicts rest on, and how each family of primary rows agrees."""
    tested = sum(1 for r in cmp.rows if r.q_value is not None)
    if not tested:
        say("verdicts: no primary metric has enough samples on both sides; the rows are figures only")
    else:
        say(
            f"verdicts: {tested} primary row{'s' if tested != 1 else ''}, q = p corrected over them "
            "(Benjamini-Hochberg); better/worse: "
            f"q < {compare_mod.DEFAULT_ALPHA:g}, the 95 % CI excludes 1 and B/A is beyond the margin; same: the "
            f"90 % CI of B/A inside the margin (the metric's A/A band, at least ±{cmp.margin_pct:g} %); "
            "exploratory rows: figures only, no verdict",
            soft_wrap=True,
        )
    for f in cmp.families():
        if f.reverses:
            say(styled("† ", "yellow"), f.text())
        else:
            say(f"  siblings: {f.text()}")


def _print_host_diffs(diffs, same_run: bool) -> None:
    if not diffs:
        say("host facts: " + ("one run, the same hosts" if same_run else "no difference between the two sides"))
        return
    t = table(("host", "fact", "A", "B"), title=f"host facts that differ ({len(diffs)})")
    for host, fact, va, vb in diffs:
        t.add_row(host, fact, va, vb)
    out.print(t)


def _print_overheads(store: Store, run: RunRow, selector: dict, everything: bool, as_json: bool, margin: float) -> None:
    cells = store.cells(run.id)
    rows = analysis.overheads(
        cells,
        store.samples(run.id),
        selector,
        seed=run.seed or 0,
        everything=everything,
        noise=_noise(store, run),
        margin_pct=margin,
    )
    if as_json:
        shapes.emit(
            "compare.baseline",
            {
                "run": run.id,
                "selector": selector,
                **_rule([o.row for o in rows], margin),
                "rows": [
                    {
                        "cell": o.cell,
                        "baseline": o.reference,
                        "change_pct": o.change_pct,
                        "change_ci_pct": o.change_ci_pct,
                        **o.row.as_dict(),
                    }
                    for o in rows
                ],
            },
        )
        return
    short = results.short_labels([c.label for c in cells])
    refs = sorted({short.get(o.reference, o.reference) for o in rows})
    t = table(
        ("cell", "workload", "metric", "baseline", "cell median", "change vs baseline", "p", "q", "verdict"),
        title=f"run {run.id}: overhead vs {', '.join(refs) or 'baseline'} (change of the median, 95 % CI)",
        right=("baseline", "cell median", "change vs baseline", "p", "q"),
    )
    for o in rows:
        r = o.row
        t.add_row(
            short.get(o.cell, o.cell),
            r.key[1],
            f"{r.key[2]} ({r.unit})",
            fmt(r.median_a),
            fmt(r.median_b),
            analysis.fmt_change(o.change_pct, o.change_ci_pct),
            fmt(r.p_value),
            fmt(r.q_value),
            _verdict(r),
        )
    out.print(t)
