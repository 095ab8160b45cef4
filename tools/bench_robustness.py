"""The resize policy on stationary workloads at sample level (barrier-free), for its predictors and tail shares side by side.

For each case (cluster size x mean response length x seed, ``configs/sim/stationary_8gpu.yaml``, start 3/4 of the
GPUs training) it runs continuous rollout + streaming training + gradient helpers + resizing once per tail share
(``SamplePipeline``'s ``tail_share``: the share of a batch's longest response that the policy's observation reports
as a rollout tail; ``TAIL_SHARE_BARRIER_FREE`` is the default), and compares each run with the best static split with
the same mechanisms (a local search over splits from the step-level best, shared by the shares). Each share runs
once per ``policy.predictor`` (``--predictors``: capacity, pipeline), the capacity predictor once per
``policy.rollout_model`` (``--rollout-models``: work, decode; decode is the default), the pipeline predictor with the
default rollout model (its capacity model's part: the window, the first move's agreement), on the same workloads
(rows ``capacity/work``, ``capacity/decode``, ``pipeline``, each with its tail share); the capacity predictor once per
``policy.play_check`` (``--play-checks``: on, the default, and off: rows ``... unchecked``); ``--runtime-mechanisms`` runs
without the simulator's gradient helpers (what the runtime has), against the best static split with the same. The
issue's target
(13, item 6; 28): at most 2 switches and within 1% of that split on every case. Prints one line per case, a summary
table, then ONE JSON line (``cases``; per row ``cases_within``, the cases within the target, and
``ms_per_decision``, the run's wall time per step beyond the static run's: what the policy costs; ``step_level``: the
same target for the step-level model on the same cases, the barrier schedule with the capacity policy against its
best static split, unless ``--no-step-level``).

    .venv/bin/python tools/bench_robustness.py                       # 24 cases x both predictors (~10 min)
    .venv/bin/python tools/bench_robustness.py --shares 1 0.5 0.25 0 --predictors capacity --rollout-models work   # the tail shares
    .venv/bin/python tools/bench_robustness.py --gpus 8 --steps 100
    .venv/bin/python tools/bench_robustness.py --predictors capacity --consolidation   # with tail consolidation too
    .venv/bin/python tools/bench_robustness.py --predictors capacity --runtime-mechanisms --no-step-level   # ~1 min
    .venv/bin/python tools/bench_robustness.py --predictors capacity --rollout-models decode --play-checks on off --no-step-level
    .venv/bin/python tools/bench_robustness.py --seeds 8 9 10 11 --predictors capacity --rollout-models decode --set policy.follow_shifts=true
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynaresize.config.loader import load_config  # noqa: E402
from dynaresize.policy.config import PolicyConfig  # noqa: E402
from dynaresize.sim.mechanisms import SimMechanisms  # noqa: E402
from dynaresize.sim.compare import best_static_samples, run_dynamic, run_samples, run_static, setup  # noqa: E402
from dynaresize.sim.samples import TAIL_SHARE_BARRIER_FREE  # noqa: E402

BARRIER_FREE = SimMechanisms(True, True, True, True)


def stationary(gpus: int, mean: int, seed: int, steps: int, extra: tuple[str, ...] = ()):
    return load_config(ROOT / "configs/sim/stationary_8gpu.yaml", [
        f"sim.steps={steps}", "sim.write_events=false", f"cluster.gpus={gpus}", f"cluster.initial_train={round(0.75 * gpus)}",
        f"sim.workload.response_tokens_start={mean}", f"sim.workload.response_tokens_end={mean}", f"run.seed={seed}", *extra])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--means", type=int, nargs="*", default=[300, 1000, 3000, 6000], help="mean response tokens")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--shares", type=float, nargs="*", default=[TAIL_SHARE_BARRIER_FREE],
                    help="tail shares to compare (default: the default; 1 0.5 0.25 0: the whole tail, half, a quarter, none)")
    ap.add_argument("--predictors", nargs="*", default=["capacity", "pipeline"], choices=["capacity", "pipeline"],
                    help="policy.predictor values to compare")
    ap.add_argument("--rollout-models", nargs="*", default=["work", "decode"], choices=["work", "decode"],
                    help="policy.rollout_model values the capacity predictor runs with, side by side")
    ap.add_argument("--play-checks", nargs="*", default=["on"], choices=["on", "off"],
                    help="policy.play_check values the capacity predictor runs with, side by side (off: the rows "
                         "labelled 'unchecked')")
    ap.add_argument("--runtime-mechanisms", action="store_true",
                    help="the runtime's own mechanisms (continuous rollout, streaming training) without the simulator's "
                         "gradient helpers, against the best static split with the same")
    ap.add_argument("--consolidation", action="store_true",
                    help="with tail consolidation too (the simulator's; the bench's all-mechanisms row has it)")
    ap.add_argument("--no-step-level", action="store_true",
                    help="skip the step-level row (the barrier schedule, the capacity policy, against the best static split)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for every case (e.g. policy.follow_shifts=true)")
    args = ap.parse_args(argv)
    mech = replace(BARRIER_FREE, gradient_helpers=not args.runtime_mechanisms, tail_consolidation=args.consolidation)
    shares = list(dict.fromkeys(args.shares))
    default_rm = PolicyConfig().rollout_model  # the pipeline predictor runs with the default (its capacity model's part)
    checks = [c == "on" for c in dict.fromkeys(args.play_checks)]
    rows_of = [(p, rm, sh, pc) for p in dict.fromkeys(args.predictors)
               for rm in (dict.fromkeys(args.rollout_models) if p == "capacity" else (default_rm,)) for sh in shares
               for pc in (checks if p == "capacity" else (True,))]
    label = {k: f"{k[0]}{'/' + k[1] if k[0] == 'capacity' else ''} {k[2]:g}{'' if k[3] else ' unchecked'}" for k in rows_of}
    res: dict[tuple, list[tuple[float, int, float]]] = {k: [] for k in rows_of}
    step_level: list[tuple[float, int]] = []  # (loss against the best static split, switches) per case
    for g, m, seed in itertools.product(args.gpus, args.means, args.seeds):
        s = setup(stationary(g, m, seed, args.steps, tuple(args.set)))
        split, best, static_wall = "-", 0.0, 0.0
        if rows_of:  # (``--predictors`` with none: the step-level row alone)
            split, best = best_static_samples(s, mech)
            t0 = time.perf_counter()
            run_samples(s, split, replace(mech, resize=False))
            static_wall = time.perf_counter() - t0
        cells = []
        for p, rm, sh, pc in rows_of:
            upd = {"predictor": p, "rollout_model": rm, "play_check": pc}
            sp = replace(s, cfg=s.cfg.model_copy(update={"policy": s.cfg.policy.model_copy(update=upd)}))
            t0 = time.perf_counter()
            dyn = run_samples(sp, s.initial, mech, tail_share=sh)
            extra_ms = 1000 * max(0.0, time.perf_counter() - t0 - static_wall) / args.steps
            loss = dyn.total_s / best - 1
            res[(p, rm, sh, pc)].append((loss, dyn.switches, extra_ms))
            cells.append(f"{label[(p, rm, sh, pc)]}: {dyn.switches} sw {100 * loss:+.2f}%{' MISS' if dyn.switches > 2 or loss > 0.01 else ''}")
        if not args.no_step_level:  # the step-level model (the barrier schedule) on the same case, its own best split
            s.table.sweep([c.n_rollout for c in s.candidates])
            best_step = min(run_static(s, c).total_s for c in s.candidates)
            dyn = run_dynamic(s, False)
            step_level.append((dyn.total_s / best_step - 1, dyn.switches))
            loss, sw = step_level[-1]
            cells.append(f"step level: {sw} sw {100 * loss:+.2f}%{' MISS' if sw > 2 or loss > 0.01 else ''}")
        print(f"{g:3d} GPUs, {m:5d} tokens, seed {seed}: best {str(split):>6} | " + " | ".join(cells), flush=True)
    print()
    print(f"{'predictor, tail share':>32} {'ok (<=2 sw, <=1%)':>18} {'worst loss':>11} {'most sw':>8} {'within 3%':>10} {'ms/decision':>12}")
    out = {"cases": len(res[rows_of[0]]) if rows_of else len(step_level), "steps": args.steps, "default_share": TAIL_SHARE_BARRIER_FREE, "mechanisms": mech.label, "rows": {}}
    for k in rows_of:
        rows = res[k]
        ok = sum(1 for loss, sw, _ in rows if loss <= 0.01 and sw <= 2)
        worst, most = max(r[0] for r in rows), max(r[1] for r in rows)
        within3 = sum(1 for r in rows if r[0] <= 0.03)
        ms = sum(r[2] for r in rows) / len(rows)
        print(f"{label[k]:>32} {f'{ok} / {len(rows)}':>18} {100 * worst:>10.2f}% {most:>8} {f'{within3} / {len(rows)}':>10} {ms:>12.1f}")
        out["rows"][label[k]] = {"predictor": k[0], "rollout_model": k[1], "tail_share": k[2], "play_check": k[3],
                                 "cases_within": ok, "worst_loss": round(worst, 4),
                                 "most_switches": most, "within_3pct": within3, "ms_per_decision": round(ms, 2)}
    if step_level:
        ok = sum(1 for loss, sw in step_level if loss <= 0.01 and sw <= 2)
        worst, most = max(r[0] for r in step_level), max(r[1] for r in step_level)
        print(f"{'step level (barrier)':>32} {f'{ok} / {len(step_level)}':>18} {100 * worst:>10.2f}% {most:>8} "
              f"{f'{sum(1 for r in step_level if r[0] <= 0.03)} / {len(step_level)}':>10}")
        out["step_level"] = {"cases_within": ok, "worst_loss": round(worst, 4), "most_switches": most}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
