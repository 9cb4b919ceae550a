"""`make bench`'s scale section: a simulated lab of many hosts on the fake backend (tests/fakes),
run by the real runner in lanes (lab.runner.lanes), each cell a fixed wall time. Prints the wall
time next to Σ cell time / lanes, the orchestrator's CPU time and peak memory (the fake backend's
records of every VM and guest included), and whether a lost host stopped anything. Figures, not a
pass/fail test (tests/contract/test_lanes.py asserts a smaller one).

    python tests/support/scalebench.py                       # 50 hosts × 1,000 cells of 0.5 s, h07 lost
    python tests/support/scalebench.py --hosts 20 --cells 200 --cell-seconds 0.05
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # tests/: the fakes package, as pyproject's pythonpath gives it

import fakes.backend  # noqa: E402
from fakes.workload import FakeWorkload  # noqa: E402

from lab import backends, config, images, plan, runner, workloads  # noqa: E402
from lab.store import Store  # noqa: E402


def fake_image(name: str, images_dir=None) -> images.ImageRef:
    return images.ImageRef(
        name=name,
        os=images.RECIPES[name].os,
        path=Path(f"/fake/{name}.qcow2"),
        digest=f"digest-{name}",
        sha256="f" * 64,
        manifest={"boot": list(images.BOOT_MODES), "tools": {"fake": "1"}},
    )


def lab_text(hosts: list[str], cells: int, cell_seconds: float, lost: dict[str, str]) -> str:
    """A lab of `hosts` × `cells` cells each (vcpus × memory_mib make the cells of a host)."""
    vcpus = min(cells, 50)
    memory = -(-cells // vcpus)
    text = '[lab]\nname = "scale"\nresults = "results"\n'
    text += "".join(f'[hosts.{h}]\nbackend = "fake"\n' + (f'lost = "{lost[h]}"\n' if h in lost else "") for h in hosts)
    text += (
        f"[matrix]\nhost = {json.dumps(hosts)}\nvcpus = {json.dumps(list(range(1, vcpus + 1)))}\n"
        f"memory_mib = {json.dumps([1024 + i for i in range(memory)])}\n"
    )
    return text + (
        '[suite]\nworkloads = ["fake-work"]\nrepetitions = 1\nwarmup = 0\nquiet_host = "off"\n'
        f"[suite.params.fake-work]\nsleep_s = {cell_seconds}\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=50)
    ap.add_argument("--cells", type=int, default=1000, help="cells per host")
    ap.add_argument("--cell-seconds", type=float, default=0.5, help="each cell's simulated wall time")
    ap.add_argument("--lose", default="h07", help="a host lost at its 10th cell ('' for none)")
    args = ap.parse_args(argv)

    backends.register("fake", "fakes")
    workloads.load_all()
    workloads.register(FakeWorkload())
    images.load = fake_image  # the fake backend's images exist nowhere
    hosts = [f"h{i:02d}" for i in range(args.hosts)]
    with tempfile.TemporaryDirectory(prefix="lab-scalebench-") as tmp:
        path = Path(tmp) / "lab.toml"
        path.write_text(lab_text(hosts, args.cells, args.cell_seconds, {}))
        units = plan.units(config.load(path))
        lost = {}
        if args.lose in hosts:
            lost[args.lose] = [u.id for u in units if u.host == args.lose][min(9, args.cells - 1)]
        path.write_text(lab_text(hosts, args.cells, args.cell_seconds, lost))
        cfg = config.load(path)
        n = len(plan.units(cfg))
        store = Store(cfg.results_dir)
        print(
            f"scale: {args.hosts} hosts × {n // args.hosts} cells of {args.cell_seconds:g} s"
            + (f", host {args.lose} lost at cell {lost[args.lose]}" if lost else ""),
            flush=True,
        )
        cpu0, wall0 = time.process_time(), time.monotonic()
        rid = runner.run_lab(cfg, store)
        wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before this script reads the store
        cells = store.cells(rid)
        sigma = n * args.cell_seconds
        ideal = sigma / args.hosts
        done = sum(c.status == "done" for c in cells)
        failed = [c for c in cells if c.status == "failed"]
        others_done = all(c.status == "done" for c in cells if c.axes["host"] not in lost)
        print(
            f"  wall {wall:.1f} s; Σ cell time {sigma:.0f} s / {args.hosts} lanes = {ideal:.1f} s "
            f"(a whole lane: {n // args.hosts} × {args.cell_seconds:g} s); "
            f"wall / (Σ/lanes) = {wall / ideal if ideal else float('inf'):.3f}"
        )
        print(f"  orchestrator CPU {cpu:.1f} s ({1000 * cpu / n:.2f} ms a cell); peak RSS {peak_mib:.0f} MiB")
        print(
            f"  cells: {done} done, {len(failed)} failed (lost host), the other hosts' all done: {others_done}; "
            f"VMs left: {len(fakes.backend.LIVE)}, open leases: {len(store.open_leases())}"
        )
        store.close()
    return 0 if others_done and not fakes.backend.LIVE else 1


if __name__ == "__main__":
    sys.exit(main())
