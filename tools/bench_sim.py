"""Simulator benchmark: every scenario in configs/sim compared, and the 4096-GPU x 1000-step wall time.

    .venv/bin/python tools/bench_sim.py            # ~1 minute on 2 busy cores

Prints a table per scenario, a summary table, then ONE JSON object as the last line. Targets (issue 3):
>= 90% of oracle, >= 50% of switch overhead hidden, 4096 GPUs x 1000 steps simulated in <= 10 s.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynaresize.config.loader import load_config  # noqa: E402
from dynaresize.events import EventLog, EventType, make_event  # noqa: E402
from dynaresize.sim.compare import compare, format_table, run_dynamic, setup  # noqa: E402

SCENARIOS = ["paper_8gpu", "stationary_8gpu", "scale_64gpu", "scale_512gpu", "scale_4096gpu"]


def timed_4096(log: bool) -> tuple[float, int]:
    """Wall seconds to simulate (and, with log, write) the 4096 x 1000 run; and the events written."""
    cfg = load_config(ROOT / "configs/sim/scale_4096gpu.yaml", ["sim.steps=1000"])
    t0 = time.perf_counter()
    res = run_dynamic(setup(cfg), log)
    n = 0
    if log:
        with tempfile.TemporaryDirectory() as d:
            with EventLog(Path(d) / "events.jsonl", t0=0.0) as ev:
                ev.write_many([make_event(EventType.RUN_START, 0.0, run_id="bench", source="sim", world_size=4096, wall_time=0.0),
                               *res.events, make_event(EventType.RUN_END, round(res.total_s, 6), status="completed", steps=res.steps)])
            n = len(res.events) + 2
    return time.perf_counter() - t0, n


def main() -> int:
    out: dict = {"scenarios": {}}
    lines = []
    for name in SCENARIOS:
        cfg = load_config(ROOT / f"configs/sim/{name}.yaml")
        r = compare(setup(cfg))
        sm = r["summary"]
        print(f"== {name}: {cfg.cluster.gpus} GPUs, {cfg.sim.steps} steps, start {sm['initial_split']}")
        print(format_table(r["rows"]))
        print()
        out["scenarios"][name] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in sm.items()}
        lines.append(f"{name:<18} {sm['best_static_split']:>10} {100 * sm['gain_vs_best_static']:>+8.1f}% {100 * sm['fraction_of_oracle']:>8.1f}% "
                     f"{sm['switches']:>8} {100 * sm['overhead_hidden_fraction']:>7.0f}% {100 * sm['greedy_gain_vs_best_static']:>+8.1f}% "
                     f"{100 * sm['naive_gain_vs_best_static']:>+8.1f}% {sm['compare_wall_s']:>7.1f}")
    wall_nolog, _ = timed_4096(False)
    wall_log, nev = timed_4096(True)
    print(f"{'scenario':<18} {'best':>10} {'gain':>9} {'%oracle':>9} {'switches':>8} {'hidden':>8} {'greedy':>9} {'naive':>9} {'wall_s':>7}")
    print("\n".join(lines))
    print(f"4096 GPUs x 1000 steps: {wall_nolog:.2f} s without event log, {wall_log:.2f} s with it ({nev} events)")
    out["sim_4096x1000_wall_s"] = round(wall_nolog, 3)
    out["sim_4096x1000_with_log_wall_s"] = round(wall_log, 3)
    out["sim_4096x1000_events"] = nev
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
