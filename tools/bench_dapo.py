"""What DAPO dynamic sampling costs and buys in the real job: two runs of ``dynaresize run``, filtering off and on.

Both runs use the same config, seed and binary reward (``task.params={partial_credit: false}``, so groups whose
responses all fail or all succeed are common); the second adds ``algorithm.dynamic_sampling.enabled=true``. For
each it reports the share of trained groups that carry a gradient (rewards not all equal), the samples generated
per step (extra rounds included), the RL loop's time, and mean reward. Prints a table, then one JSON line.

    .venv/bin/python tools/bench_dapo.py                          # quickstart config, 10 steps
    .venv/bin/python tools/bench_dapo.py --steps 20 -o algorithm.dynamic_sampling.max_rounds=2
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


def one_run(out: Path, config: str, overrides: list[str]) -> Path:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    argv = [sys.executable, "-m", "dynaresize.cli", "run", config, f"run.output_dir={out}", "run.progress=false", *overrides, "--quiet"]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    return run_dir


def measure(run_dir: Path, group: int) -> dict:
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    batches = [json.loads(l) for l in (run_dir / "batches.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    informative = total = 0
    for b in batches:
        for g in range(0, len(b["rewards"]), group):
            rs = b["rewards"][g : g + group]
            informative += max(rs) > min(rs)
            total += 1
    generated = sum(e.get("samples", 0) for e in events if e["type"] == "stage" and e["stage"] == "rollout")
    ends = [e for e in events if e["type"] == "step_end"]
    return {
        "steps": len(batches),
        "informative_share": round(informative / max(1, total), 3),
        "samples_generated_per_step": round(generated / max(1, len(batches)), 1),
        "extra_rounds_per_step": round(sum(e.get("rounds", 0) for e in ends) / max(1, len(ends)), 2),
        "padded_steps": sum(1 for e in ends if e.get("groups_filler")),
        "loop_s": summary["loop_s"],
        "reward_first3": round(summary["reward_first3"], 4),
        "reward_last3": round(summary["reward_last3"], 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="configs/quickstart.yaml")
    ap.add_argument("-o", "--override", action="append", default=[], help="dotted config override for both runs")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from dynaresize.config.loader import load_config

    common = [f"run.steps={args.steps}", f"run.seed={args.seed}", "run.checkpoint_every=0", "policy.enabled=false",
              "task.params={partial_credit: false}", *args.override]
    group = load_config(args.config, common).rollout.group_size
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-dapo-") as tmp:
        for name, extra in (("off", []), ("dynamic_sampling", ["algorithm.dynamic_sampling.enabled=true"])):
            rows[name] = measure(one_run(Path(tmp) / name, args.config, common + extra), group)
    cols = list(next(iter(rows.values())))
    print(f"{'variant':<18}" + "".join(f"{c:>28}" for c in cols))
    for name, r in rows.items():
        print(f"{name:<18}" + "".join(f"{r[c]!s:>28}" for c in cols))
    print(json.dumps({"config": args.config, "overrides": common, **{k: v for k, v in rows.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
