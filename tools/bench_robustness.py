"""The resize policy on stationary workloads at sample level (barrier-free), for several tail shares side by side.

For each case (cluster size x mean response length x seed, ``configs/sim/stationary_8gpu.yaml``, start 3/4 of the
GPUs training) it runs continuous rollout + streaming training + gradient helpers + resizing once per tail share
(``SamplePipeline``'s ``tail_share``: the share of a batch's longest response that the policy's observation reports
as a rollout tail; ``TAIL_SHARE_BARRIER_FREE`` is the default), and compares each run with the best static split with
the same mechanisms (a local search over splits from the step-level best, shared by the shares). The issue's target
(13, item 6): at most 2 switches and within 1% of that split on every case. Prints one line per case, a summary
table, then ONE JSON line.

    .venv/bin/python tools/bench_robustness.py                       # 24 cases x shares 1, 0.5, 0.25, 0 (~6 min)
    .venv/bin/python tools/bench_robustness.py --gpus 8 --shares 0.5 --steps 100
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynaresize.config.loader import load_config  # noqa: E402
from dynaresize.schedule import Mechanisms  # noqa: E402
from dynaresize.sim.compare import best_static_samples, run_samples, setup  # noqa: E402
from dynaresize.sim.samples import TAIL_SHARE_BARRIER_FREE  # noqa: E402

BARRIER_FREE = Mechanisms(True, True, True, True)


def stationary(gpus: int, mean: int, seed: int, steps: int):
    return load_config(ROOT / "configs/sim/stationary_8gpu.yaml", [
        f"sim.steps={steps}", "sim.write_events=false", f"cluster.gpus={gpus}", f"cluster.initial_train={round(0.75 * gpus)}",
        f"sim.workload.response_tokens_start={mean}", f"sim.workload.response_tokens_end={mean}", f"run.seed={seed}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--means", type=int, nargs="*", default=[300, 1000, 3000, 6000], help="mean response tokens")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--shares", type=float, nargs="*", default=[1.0, 0.5, 0.25, 0.0, TAIL_SHARE_BARRIER_FREE],
                    help="tail shares to compare (default: the whole tail, half, a quarter, none, and the default)")
    args = ap.parse_args(argv)
    shares = list(dict.fromkeys(args.shares))
    res: dict[float, list[tuple[float, int]]] = {sh: [] for sh in shares}
    for g, m, seed in itertools.product(args.gpus, args.means, args.seeds):
        s = setup(stationary(g, m, seed, args.steps))
        split, best = best_static_samples(s, BARRIER_FREE)
        cells = []
        for sh in shares:
            dyn = run_samples(s, s.initial, BARRIER_FREE, tail_share=sh)
            loss = dyn.total_s / best - 1
            res[sh].append((loss, dyn.switches))
            cells.append(f"share {sh:g}: {dyn.switches} sw {100 * loss:+.2f}%{' MISS' if dyn.switches > 2 or loss > 0.01 else ''}")
        print(f"{g:3d} GPUs, {m:5d} tokens, seed {seed}: best {str(split):>6} | " + " | ".join(cells), flush=True)
    print()
    print(f"{'tail share':>10} {'ok (<=2 sw, <=1%)':>18} {'worst loss':>11} {'most sw':>8} {'within 3%':>10}")
    out = {"cases": len(res[shares[0]]), "steps": args.steps, "default_share": TAIL_SHARE_BARRIER_FREE, "shares": {}}
    for sh in shares:
        rows = res[sh]
        ok = sum(1 for loss, sw in rows if loss <= 0.01 and sw <= 2)
        worst, most = max(loss for loss, _ in rows), max(sw for _, sw in rows)
        within3 = sum(1 for loss, _ in rows if loss <= 0.03)
        print(f"{sh:>10g} {f'{ok} / {len(rows)}':>18} {100 * worst:>10.2f}% {most:>8} {f'{within3} / {len(rows)}':>10}")
        out["shares"][f"{sh:g}"] = {"ok": ok, "worst_loss": round(worst, 4), "most_switches": most, "within_3pct": within3}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
