"""The verdict rates of `lab compare` on seeded simulations of the default lab, with more trials
than the fast lane affords (tests/unit/test_verdicts.py asserts the same figures on 100 trials). Prints
figures, asserts nothing:

    python tests/support/verdictrates.py                 # 1,000 trials, 9,999 bootstrap resamples (~10 min)
    python tests/support/verdictrates.py --trials 300 --margin 5    # another stated margin

Each trial simulates the default lab's 5 primary rows at n = 5 a side: an A/A comparison (every
row at the CV it had in this project's TCG runs) and one at CV 3 % with iperf3's tx throughput 10 %
lower in B; each with the stated margin alone and with an A/A twin measured beside it.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the support package, run as a script

from lab.compare import Verdict  # noqa: E402
from support.verdictsim import PRIMARY, TRIALS_SHIFTED, simulate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--resamples", type=int, default=9999)
    ap.add_argument("--margin", type=float, default=7.5, help="the stated margin, %% (lab compare --margin)")
    args = ap.parse_args()
    said = simulate(args.trials, args.resamples, args.margin)
    n = args.trials
    print(f"{n} trials, n = 5 a side, {len(PRIMARY)} primary rows, {args.resamples} bootstrap resamples")
    for twin in (False, True):
        margin = f"the A/A twin's band (at least ±{args.margin:g} %)" if twin else f"±{args.margin:g} % (no twin)"
        aa = said[f"aa/{twin}"]
        false = sum(any(v in (Verdict.BETTER, Verdict.WORSE) for v in run.values()) for run in aa)
        same = collections.Counter(v for run in aa for v in run.values())
        shifted = collections.Counter(run[TRIALS_SHIFTED] for run in said[f"shift/{twin}"])
        null3 = collections.Counter(v for run in said[f"shift/{twin}"] for k, v in run.items() if k != TRIALS_SHIFTED)
        print(f"margin {margin}:")
        print(f"  A/A, any better/worse among the primary rows: {false / n:.1%} of comparisons")
        print(f"  A/A rows called same: {same[Verdict.SAME] / sum(same.values()):.1%}")
        print(
            f"  10 % shift at CV 3 %: worse {shifted[Verdict.WORSE] / n:.1%}, unknown "
            f"{shifted[Verdict.UNKNOWN] / n:.1%}, same {shifted[Verdict.SAME] / n:.1%}"
        )
        print(f"  true null at CV 3 %: same {null3[Verdict.SAME] / sum(null3.values()):.1%}")


if __name__ == "__main__":
    main()
