"""Tail consolidation side by side: every other mechanism without it and with it, at a fixed split and with resizing.

    .venv/bin/python tools/bench_consolidation.py            # seven scenarios, about a minute on 2 busy cores
    .venv/bin/python tools/bench_consolidation.py --scenarios paper_8gpu:200:5

Per scenario (``name:steps:trainers`` of the fixed split), four sample-level runs with continuous rollout, streaming
training and gradient helpers: the fixed split without and with tail consolidation, then resizing from the
configured split without and with it. Prints a table (simulated seconds, the gain of consolidation, its moves), then
ONE JSON line. Deterministic (the scenarios' seeds); the CPU seconds beside each run are the machine's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynaresize.config.loader import load_config  # noqa: E402
from dynaresize.policy import Topology  # noqa: E402
from dynaresize.sim.compare import run_samples, setup  # noqa: E402
from dynaresize.sim.mechanisms import SimMechanisms  # noqa: E402

DEFAULT = ["paper_8gpu:200:5", "stationary_8gpu:200:5", "scale_64gpu:100:50", "taskmix_64gpu:100:47",
           "dapo_64gpu:100:46", "scale_512gpu:50:384", "scale_4096gpu:20:3072"]


def run(s, topo: Topology, resize: bool, consolidation: bool) -> dict:
    c0 = time.process_time()
    r = run_samples(s, topo, SimMechanisms(True, True, resize, True, consolidation))
    return dict(total_s=round(r.total_s, 1), moves=r.moves, moved_sequences=r.moved_sequences, switches=r.switches,
                helps=r.helps, cpu_s=round(time.process_time() - c0, 2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", nargs="*", default=DEFAULT, help="name:steps:trainers of the fixed split")
    args = ap.parse_args(argv)
    out = {}
    print(f"{'scenario':<16} {'steps':>5} {'split':>10} {'fixed: without':>15} {'with':>10} {'gain':>7} {'moves':>6}"
          f" {'resizing: without':>18} {'with':>10} {'gain':>7} {'moves':>6}")
    for spec in args.scenarios:
        name, steps, nt = spec.split(":")
        cfg = load_config(ROOT / f"configs/sim/{name}.yaml", [f"sim.steps={steps}", "sim.write_events=false"])
        s = setup(cfg)
        topo = Topology(int(nt), cfg.cluster.gpus - int(nt))
        row = {k: run(s, topo if k[0] == "fixed" else s.initial, k[0] == "resizing", k[1])
               for k in (("fixed", False), ("fixed", True), ("resizing", False), ("resizing", True))}
        gain = {m: row[(m, False)]["total_s"] / row[(m, True)]["total_s"] - 1 for m in ("fixed", "resizing")}
        out[name] = dict(steps=int(steps), split=str(topo), **{f"{m}_{'with' if c else 'without'}": v
                                                                for (m, c), v in row.items()},
                         fixed_gain=round(gain["fixed"], 4), resizing_gain=round(gain["resizing"], 4))
        print(f"{name:<16} {steps:>5} {str(topo):>10} {row[('fixed', False)]['total_s']:>15,.0f} "
              f"{row[('fixed', True)]['total_s']:>10,.0f} {100 * gain['fixed']:>+6.1f}% {row[('fixed', True)]['moves']:>6} "
              f"{row[('resizing', False)]['total_s']:>18,.0f} {row[('resizing', True)]['total_s']:>10,.0f} "
              f"{100 * gain['resizing']:>+6.1f}% {row[('resizing', True)]['moves']:>6}")
    print("gain: the run without consolidation over the run with it, less 1 (positive: consolidation is faster)")
    print(json.dumps({"scenarios": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
