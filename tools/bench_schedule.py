"""The quickstart with the step barrier (``pipeline.schedule: lockstep``) and without it (``continuous``: the
scheduler core, continuous rollout, streaming training), side by side in one run, on this machine.

    .venv/bin/python tools/bench_schedule.py               # 30 steps each, ~5 min on 2 cores
    .venv/bin/python tools/bench_schedule.py --steps 100   # the quickstart's whole run
    .venv/bin/python tools/bench_schedule.py -o policy.enabled=false   # both static at the quickstart's 3:1

Each row is one real run (4 worker processes, Redis, DeepSpeed on CPU, the same seed): the loop time per step
(``summary.json``'s loop seconds / steps), samples/s, and the bubble fraction that ``dynaresize analyze`` measures
from the run's event log (idle GPU-s / total GPU-s: a rank is busy only inside its logged stage intervals).
Validation passes are off in both (the continuous schedule has none). Then one JSON line.

What to expect on a CPU machine: the four ranks share two cores, so a rank that goes idle hands its core to the
others, and overlapping rollout with training mostly competes for the same cores; the bubble fraction shows the
schedule's idle time, the loop time what that is worth here. ``tools/bench_sim.py`` and ``dynaresize simulate
--compare`` give the same comparison at cluster scale (issue 17 makes the runtime rehearse it with GPU timing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS = [("lockstep", ["pipeline.schedule=lockstep"]), ("continuous", ["pipeline.schedule=continuous"])]


def one_run(out: Path, config: str, steps: int, extra: list[str]) -> dict:
    from dynaresize.analysis.metrics import analyze
    from dynaresize.analysis.reader import load_run

    cmd = [sys.executable, "-m", "dynaresize.cli", "run", config, f"run.steps={steps}", f"run.output_dir={out}",
           "run.progress=false", "task.dataset.val_every=0", "run.checkpoint_every=0", *extra, "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}")
    rd = next(d for d in out.iterdir() if d.is_dir())
    s = json.loads((rd / "summary.json").read_text())
    a = analyze(load_run(rd))
    return {"run_dir": str(rd), "steps": s["steps"], "loop_s_per_step": s["loop_s"] / max(1, s["steps"]),
            "samples_per_s": s["samples_per_s"], "bubble_fraction": a.totals["bubble_fraction"],
            "switches": len(s["switches"]), "switch_critical_path_s": s["switch_critical_path_s"],
            "reward_last": s.get("reward_last")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="configs/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("-o", "--override", action="append", default=[], help="dotted config override for both rows")
    args = ap.parse_args()
    res = {}
    with tempfile.TemporaryDirectory(prefix="bench-schedule-") as tmp:
        for name, extra in ROWS:
            res[name] = one_run(Path(tmp) / name, args.config, args.steps, [*args.override, *extra])
            print(f"  {name}: done ({res[name]['loop_s_per_step']:.3f} s/step)", file=sys.stderr)
    lock, cont = res["lockstep"], res["continuous"]
    print(f"{'schedule':<11} {'steps':>5} {'loop s/step':>11} {'samples/s':>9} {'bubble':>7} {'switches':>8} "
          f"{'switch crit s':>13} {'reward last':>11}")
    for name, r in res.items():
        print(f"{name:<11} {r['steps']:>5} {r['loop_s_per_step']:>11.3f} {r['samples_per_s']:>9.1f} "
              f"{r['bubble_fraction']:>7.3f} {r['switches']:>8} {r['switch_critical_path_s']:>13.3f} "
              f"{(r['reward_last'] or 0.0):>11.3f}")
    ratio = cont["loop_s_per_step"] / lock["loop_s_per_step"]
    print(f"continuous / lockstep: loop time per step x{ratio:.3f}, bubble {lock['bubble_fraction']:.3f} -> "
          f"{cont['bubble_fraction']:.3f}")
    print(json.dumps({"loop_s_per_step_lockstep": round(lock["loop_s_per_step"], 4),
                      "loop_s_per_step_continuous": round(cont["loop_s_per_step"], 4),
                      "loop_time_ratio": round(ratio, 4), "bubble_lockstep": round(lock["bubble_fraction"], 4),
                      "bubble_continuous": round(cont["bubble_fraction"], 4), "steps": args.steps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
