"""The default schedule (barrier-free, resizing on) against the barrier schedule at every static split, on the
emulated accelerator, each row beside the simulator's prediction for it; all rows in one run.

    .venv/bin/python tools/bench_schedule.py                                  # configs/emulated-8gpu.yaml, 20 steps
    .venv/bin/python tools/bench_schedule.py configs/emulated-8gpu.yaml --steps 30 --time-scale 0.1

Rows (each one real run: Redis, 8 worker processes, DeepSpeed on CPU with the emulated accelerator's timing, the
same seed):

- ``barrier n:m``: ``pipeline.schedule: barrier`` (the scheduler core with its step barrier: the static one-step-off
  baseline, what verl's one-step-off runs), resizing off, at every split ``n`` trainers : ``m`` rollout ranks;
- ``default from best``: the default schedule (``barrier_free``: continuous rollout, streaming training, resizing on)
  started at the best static barrier split of the rows above;
- ``default from config``: the same started at the config's own ``cluster.initial_train``.

Each row's figure is samples per wall second over the run's span (``dynaresize analyze``'s ``span_s``), and beside
it the sample-level simulator's prediction for the same schedule on the run's own profile and samples
(:func:`dynaresize.analysis.whatif.emulated_sim_config`, as ``tools/bench_emulated.py``). Then one JSON line:
``default_vs_best_static_barrier`` (the default started at the best split, over that split with the barrier, minus 1),
``default_from_start_vs_best_static_barrier`` and ``sim_predicted_gain`` (the simulator's figure for the first).
Target (issue 25): the first > 0 and at least ``sim_predicted_gain`` minus 2 points. ``overrun_s``: the seconds the
emulated ops ran past their modelled time (the CPU could not keep up: a row the simulator cannot match). ``--keep
DIR`` keeps the run directories.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.bench_emulated import observed, one_run, simulate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="configs/emulated-8gpu.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--time-scale", type=float, default=0.1, help="emulation.time_scale of every run (docs/emulation.md)")
    ap.add_argument("-o", "--override", action="append", default=[], help="extra dotted override for every run")
    ap.add_argument("--splits", type=int, nargs="*", help="trainer counts of the barrier rows (default: every split)")
    ap.add_argument("--keep", type=Path, default=None, help="keep every row's run directory under this folder")
    args = ap.parse_args()
    from dynaresize.comm.groups import candidate_trainer_counts, unit_from_cluster
    from dynaresize.config.loader import load_config

    base = [f"run.steps={args.steps}", f"emulation.time_scale={args.time_scale}", "task.dataset.val_every=0",
            "run.checkpoint_every=0", *args.override]
    cfg = load_config(ROOT / args.config, base)
    gpus = cfg.cluster.gpus
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-schedule-") as tmp_dir:
        tmp = str(args.keep) if args.keep is not None else tmp_dir
        def row(name: str, n_train: int, schedule: str, resize: bool) -> dict:
            over = [*base, f"pipeline.schedule={schedule}", f"cluster.initial_train={n_train}",
                    f"policy.enabled={str(resize).lower()}"]
            rd = one_run(Path(tmp) / f"{len(rows)}", args.config, over)
            c = load_config(rd / "config.yaml")
            free = schedule == "barrier_free"
            obs = observed(rd)
            try:
                sim = simulate(rd, n_train, free, free and c.pipeline.streaming_training, resize)
            except RuntimeError as e:  # the simulator's own failure (a stall) is this row's, not the bench's
                print(f"  {name}: the simulator failed on this run: {e}", file=sys.stderr, flush=True)
                sim = {"samples_per_s": float("nan"), "switches": None}
            r = {"row": name, "runtime": round(obs["samples_per_s"], 4), "sim": round(sim["samples_per_s"], 4),
                 "ratio": round(obs["samples_per_s"] / sim["samples_per_s"], 4), "switches": obs["switches"],
                 "sim_switches": sim["switches"], "faithful": obs["faithful"], "overrun_s": round(obs["overrun_s"], 2)}
            rows.append(r)
            print(f"  {name}: {r['runtime']:.3f} samples/s (sim {r['sim']:.3f})", file=sys.stderr, flush=True)
            return r

        splits = args.splits or candidate_trainer_counts(gpus, unit_from_cluster(cfg.cluster))
        barrier = {n: row(f"barrier {n}:{gpus - n}", n, "barrier", False) for n in splits}
        best = max(barrier, key=lambda n: barrier[n]["runtime"])
        from_best = row(f"default from best {best}:{gpus - best}", best, "barrier_free", True)
        init = cfg.cluster.initial_train
        from_start = row(f"default from config {init}:{gpus - init}", init, "barrier_free", True)
    head = ["row", "runtime", "sim", "ratio", "switches", "sim_switches", "faithful", "overrun_s"]
    print("samples per wall second (sim: the simulator's prediction for the same schedule, per modelled second / "
          "time_scale)")
    print("  ".join(f"{h:>28}" if h == "row" else f"{h:>12}" for h in head))
    for r in rows:
        print("  ".join((f"{r[h]:>28}" if h == "row" else f"{r[h]:>12.3f}" if isinstance(r[h], float) else f"{str(r[h]):>12}")
                        for h in head))
    b = barrier[best]
    print(json.dumps({
        "config": args.config, "steps": args.steps, "time_scale": args.time_scale, "best_static_barrier": f"{best}:{gpus - best}",
        "default_vs_best_static_barrier": round(from_best["runtime"] / b["runtime"] - 1.0, 4),
        "default_from_start_vs_best_static_barrier": round(from_start["runtime"] / b["runtime"] - 1.0, 4),
        "sim_predicted_gain": round(from_best["sim"] / b["sim"] - 1.0, 4),
        "sim_predicted_gain_from_start": round(from_start["sim"] / b["sim"] - 1.0, 4),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
