"""`lab explain`: find the knob behind a difference between two cells, as the studies did by hand.

Two cells A and B of a run (or of two runs of one lab) differ in some knobs: matrix axes (nic,
wan, tuning, ...) and workload parameters. The lab flips them in follow-up cells, measures those
as a normal run recorded as a child of the parent run, and says per knob how much of the A-to-B
gap it carries and whether it matters (lab.verdicts' better/worse), does not matter (same) or is
unknown. What it cannot flip (two hosts' CPU or kernel, an image rebuilt since) is listed.

- lab.explain.knobs: what differs between A and B (knobs, and what cannot be tested here)
- lab.explain.design: which follow-up cells: 2^k factorial, a resolution-IV fractional factorial
  then a full factorial of the active knobs (pyDOE), or one knob reverted at a time
- lab.explain.effects: main effects and interactions with bootstrap CIs, shares of the gap, verdicts
- lab.explain.record: the record a follow-up run keeps in its manifest, and the samples it names
- lab.explain.followup: the follow-up cells as a lab (config, cells, cells the store already holds)
- lab.explain.session: the phases, each run by the runner (lab.runner) as a normal run
- lab.explain.bench: how many cells the design needs against the full factorial (`make bench`)

Nothing here prints; lab.cli.explaincmds does.
"""
