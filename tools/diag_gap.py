"""Where the run with every mechanism loses against the tight bound: its GPU-seconds split into what the bound counts
and what it does not (issue 28, item 2: the bound fractions).

    .venv/bin/python tools/diag_gap.py                                   # the bench's five scenarios, 100 steps
    .venv/bin/python tools/diag_gap.py --scenarios paper_8gpu --steps 200

Per scenario, one sample-level run from the configured split with continuous rollout, streaming training, gradient
helpers, tail consolidation and resizing (the bench's "all mechanisms" row), then its ``N x T`` GPU-seconds as

- **rollout busy**: the rollout ranks' time with sequences in flight (``SampleRunResult.busy_rollout_gpu_s``), against
  the tight bound's rollout GPU-seconds (every token decoded at the concurrency its version's sequences allow, plus
  prefill: ``TightBound.rollout_gpu_s``); the difference is decode below that concurrency: a rank's share of a batch
  drains (its last sequences decode at a few per iteration) and the iteration's fixed cost is paid per rank;
- **train busy**: the trainers' chunks and optimizer steps, against the bound's training GPU-seconds (one trainer,
  no scaling loss: ``TightBound.train_gpu_s``); the difference is the data-parallel efficiency and every trainer's
  optimizer step;
- **idle**: neither (a rollout rank waiting for a version or a claim, a trainer waiting for groups, switches).

Beside it, the tight bound of the schedules without gradient helpers (``tight_bound(..., helper_share=0)``:
``no_helpers_s``, ``of tight/nh``): the full bound lets a batch train on helpers at the simulator's assumed
``helper_rate`` with no data-parallel loss, and where that beats the trainers' efficiency (64 GPUs) most of the
distance to it is training every schedule without helpers must pay. Not a bound of this run (it has helpers): above
100% would mean the helpers took the run past any schedule of trainers alone.

How much training the helpers would have to take: ``--helper-shares`` (default 0 0.1 0.2 0.3 0.5 1) prints, per share
``h``, the most any schedule whose helpers take at most ``h`` of every batch's training can reach of the full tight
bound (``tight_bound(..., helper_share=h)``: such a schedule takes at least that bound), beside the share the run's
helpers took (``SampleRunResult.helped_work_s / train_work_s``).

The tight bound itself lies above its work (``tight - work``, GPU-seconds): the chain of trainings and the rollout
windows. So ``N x (run - tight) = rollout excess + train excess + idle - (N x tight - bound work)``. Prints a table,
then ONE JSON line. Deterministic (the simulator has no randomness beyond the scenario's seed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynaresize.config.loader import load_config  # noqa: E402
from dynaresize.sim.compare import SAMPLE_ROWS, run_samples, setup, tight_bound_of  # noqa: E402

SCENARIOS = ["paper_8gpu", "stationary_8gpu", "scale_64gpu", "dapo_64gpu", "taskmix_64gpu"]


def gap(name: str, steps: int, shares: tuple[float, ...] = ()) -> dict:
    cfg = load_config(ROOT / f"configs/sim/{name}.yaml", [f"sim.steps={steps}", "sim.write_events=false"])
    s = setup(cfg)
    run = run_samples(s, s.initial, SAMPLE_ROWS[-1][2])  # every mechanism
    tb = tight_bound_of(s)
    free = tight_bound_of(s, helper_share=0)
    N = cfg.cluster.gpus
    total = run.total_s * N
    roll_b, train_b = float(tb.rollout_gpu_s.sum()), float(tb.train_gpu_s.sum())
    idle = total - run.busy_rollout_gpu_s - run.busy_train_gpu_s
    known = {0.0: free, 1.0: tb}  # (the two bounds already computed: no share's bound twice)
    bound_at = lambda h: known[h] if h in known else tight_bound_of(s, helper_share=h)  # noqa: E731
    return {
        "scenario": name, "gpus": N, "steps": steps, "run_s": round(run.total_s, 1), "tight_s": round(tb.total_s, 1),
        "fraction_of_tight": round(tb.total_s / run.total_s, 4), "no_helpers_s": round(free.total_s, 1),
        "fraction_of_tight_no_helpers": round(free.total_s / run.total_s, 4), "gap_gpu_s": round(total - tb.total_s * N),
        "rollout_busy": round(run.busy_rollout_gpu_s), "rollout_bound": round(roll_b),
        "rollout_excess": round(run.busy_rollout_gpu_s - roll_b),
        "train_busy": round(run.busy_train_gpu_s), "train_bound": round(train_b),
        "train_excess": round(run.busy_train_gpu_s - train_b), "idle": round(idle),
        "bound_above_work": round(tb.total_s * N - roll_b - train_b),
        "helped_share": round(run.helped_work_s / run.train_work_s, 4) if run.train_work_s > 0 else 0.0,
        "ceiling_by_helper_share": {str(h): round(tb.total_s / bound_at(h).total_s, 4) for h in shares},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", nargs="*", default=SCENARIOS)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--helper-shares", type=float, nargs="*", default=[0, 0.1, 0.2, 0.3, 0.5, 1.0],
                    help="shares of every batch's training the helpers may take: the ceiling of the tight bound for each")
    args = ap.parse_args(argv)
    if any(not 0 <= h <= 1 for h in args.helper_shares):
        ap.error(f"--helper-shares must lie in [0, 1] (got {args.helper_shares})")
    rows = []
    print(f"{'scenario':>16} {'of tight':>9} {'tight/nh':>9} {'gap':>9} | {'rollout busy / bound (excess)':>32} | "
          f"{'train busy / bound (excess)':>30} | {'idle':>8} | {'tight - work':>12}   (GPU-seconds)")
    for name in args.scenarios:
        r = gap(name, args.steps, tuple(args.helper_shares))
        rows.append(r)
        share = (lambda x: f"{100 * x / r['gap_gpu_s']:.0f}%") if r["gap_gpu_s"] > 0 else (lambda x: "-")
        print(f"{name:>16} {100 * r['fraction_of_tight']:>8.1f}% {100 * r['fraction_of_tight_no_helpers']:>8.1f}% {r['gap_gpu_s']:>9} | "
              f"{r['rollout_busy']:>9} / {r['rollout_bound']:>8} ({r['rollout_excess']:>7}, {share(r['rollout_excess']):>4}) | "
              f"{r['train_busy']:>9} / {r['train_bound']:>8} ({r['train_excess']:>6}, {share(r['train_excess']):>4}) | "
              f"{r['idle']:>8} | {r['bound_above_work']:>12}", flush=True)
    if args.helper_shares:
        print("\nthe most a schedule can reach of the tight bound when its helpers take at most a share of every batch's "
              "training (the run's helpers took 'run'):")
        print(f"{'scenario':>16} {'run':>7} " + " ".join(f"{'<= ' + format(h, 'g'):>8}" for h in args.helper_shares))
        for r in rows:
            print(f"{r['scenario']:>16} {100 * r['helped_share']:>6.1f}% "
                  + " ".join(f"{100 * v:>7.1f}%" for v in r["ceiling_by_helper_share"].values()))
    print(json.dumps({"steps": args.steps, "scenarios": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
