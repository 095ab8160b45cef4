"""What trainer-gen is worth at static splits: continuous rollout + streaming training, no resizing, without and
with trainer-gen (idle trainers generating groups of the next batch), one markdown row per split.

    .venv/bin/python tools/bench_trainer_gen.py --steps 100                       # the table of docs/simulator.md
    .venv/bin/python tools/bench_trainer_gen.py --steps 20 --scenarios paper_8gpu

Per scenario: the best static split of ``dynaresize simulate --compare`` and two trainer-heavy (rollout-bound) ones.
``over_s`` is the longest a trainer stayed away beyond the time its pricing allowed (0: never late).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynaresize.config.loader import load_config  # noqa: E402
from dynaresize.policy import Topology  # noqa: E402
from dynaresize.schedule import Mechanisms  # noqa: E402
from dynaresize.sim.compare import run_samples, setup  # noqa: E402

SPLITS = {  # trainers: the best static split (bench_sim), then rollout-bound ones
    "paper_8gpu": (5, 6, 7), "stationary_8gpu": (5, 6, 7), "scale_64gpu": (50, 56, 60),
    "dapo_64gpu": (46, 56, 60), "taskmix_64gpu": (47, 56, 60),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", nargs="*", default=list(SPLITS), choices=list(SPLITS))
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    print("| scenario | split | without (s) | with (s) | gain | excursions | groups | over_s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.scenarios:
        s = setup(load_config(ROOT / f"configs/sim/{name}.yaml", ["sim.write_events=false", f"sim.steps={args.steps}"]))
        n = s.cfg.cluster.gpus
        for i, nt in enumerate(SPLITS[name]):
            topo = Topology(nt, n - nt)
            a = run_samples(s, topo, Mechanisms(True, True, False))
            b = run_samples(s, topo, Mechanisms(True, True, False, False, True))
            label = f"{topo} (best)" if i == 0 else str(topo)
            print(f"| {name} | {label} | {a.total_s:.0f} | {b.total_s:.0f} | {a.total_s / b.total_s - 1:+.1%} | "
                  f"{b.trainer_gens} | {b.trainer_gen_groups} | {b.trainer_gen_over_s:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
