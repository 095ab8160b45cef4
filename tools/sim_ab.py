"""The sample-level simulator, an older commit's engine and today's side by side in one process (same load): CPU seconds.

    .venv/bin/python tools/sim_ab.py --old d60ba8a --scenario scale_4096gpu --steps 30 --reps 3
    .venv/bin/python tools/sim_ab.py --old d60ba8a --scenario scale_512gpu --steps 50 --reps 6

The old commit's ``dynaresize`` package is extracted (``git archive``) into a temporary folder as ``dynaresize_old``
(its imports renamed), so both engines run in this process, alternating (old, new, new, old, ...), each from a fresh
setup, every mechanism on, no event log. Each run's result (end time, switches, helps, the splits) must be equal
between the two; the CPU seconds (``time.process_time``) of each run, their minimum and median, and the 1-minute load
average are printed. The machine is shared: CPU time grows with the load too, so only runs
alternated like this compare like with like.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def extract_old(commit: str, into: Path) -> None:
    """``dynaresize`` at ``commit`` as the package ``dynaresize_old`` under ``into``."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "dynaresize"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    (into / "dynaresize").rename(into / "dynaresize_old")
    word = re.compile(r"\bdynaresize\b(?=[.\s])")
    for p in (into / "dynaresize_old").rglob("*.py"):
        p.write_text(word.sub("dynaresize_old", p.read_text()))


def runner(pkg: str, scenario: str, steps: int, consolidation: bool = False):
    loader = importlib.import_module(pkg + ".config.loader")
    comp = importlib.import_module(pkg + ".sim.compare")
    sched = importlib.import_module(pkg + ".schedule")
    cfg = loader.load_config(ROOT / f"configs/sim/{scenario}.yaml", [f"sim.steps={steps}", "sim.write_events=false"])
    s = comp.setup(cfg)
    try:  # the gradient helpers' flag moved to the simulator's own mechanisms (issue 25)
        mech = importlib.import_module(pkg + ".sim.mechanisms").SimMechanisms(True, True, True, True, consolidation)
    except ModuleNotFoundError:
        mech = sched.Mechanisms(True, True, True, True)
    return lambda: comp.run_samples(s, s.initial, mech)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="the commit whose engine is compared with the working tree's")
    ap.add_argument("--scenario", default="scale_4096gpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        extract_old(args.old, Path(tmp))
        sys.path.insert(0, tmp)
        cpu: dict[str, list[float]] = {"old": [], "new": []}
        key: dict[str, tuple] = {}
        for i in range(args.reps):
            for which in ("old", "new") if i % 2 == 0 else ("new", "old"):
                run = runner("dynaresize_old" if which == "old" else "dynaresize", args.scenario, args.steps)
                c0 = time.process_time()
                r = run()
                c = time.process_time() - c0
                cpu[which].append(c)
                k = (repr(r.total_s), r.switches, r.helps, tuple(r.topologies))
                if key.setdefault(which, k) != k:
                    raise SystemExit(f"{which}: two runs of the same engine differ")
                print(f"{which}: {c:.2f} s CPU (end {r.total_s!r}, {r.switches} switches, load {os.getloadavg()[0]:.1f})",
                      flush=True)
    same = key["old"] == key["new"]
    print(f"results equal: {same}")
    mo, mn = min(cpu["old"]), min(cpu["new"])
    do, dn = statistics.median(cpu["old"]), statistics.median(cpu["new"])
    print(f"{args.scenario} x {args.steps} steps, {args.reps} runs each: old {mo:.2f} s CPU min / {do:.2f} median, new "
          f"{mn:.2f} / {dn:.2f}: {mo / mn:.2f}x (min), {do / dn:.2f}x (median)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
