"""What a lost trainer costs, with and without the in-memory snapshots (``faults.snapshot_every``; docs/FAULTS.md
row 31), and what the snapshots cost per step: one command, the two side by side.

    .venv/bin/python tools/bench_recovery.py                      # 3 pairs of runs, ~2 min a run on 2 cores
    .venv/bin/python tools/bench_recovery.py --runs 5 --steps 16 --seed 2

Each of ``--runs`` draws a step k (in 2 .. steps-2) and a trainer rank (0 .. initial_train-1) from ``--seed``, then
runs the quickstart (``configs/quickstart.yaml run.steps=S run.checkpoint_every=50 policy.enabled=false``, real
processes: coordinator, redis-server, 4 ranks with DeepSpeed on CPU) twice with that rank SIGKILLed after its first
chunk of step k (the test hooks' kill point ``train_chunk.accumulated``, ranks started through
``tests.support.run``): once with ``faults.snapshot_every=0`` (today: every rank restarts from the last disk
checkpoint, here the start) and once with ``faults.snapshot_every=1``, the two at the same time (so that whatever
else loads the machine loads both alike; each then runs slower than alone). Steps retrained: the ``step_end`` events
beyond one per step (each is one training of a step). Per-step cost, two ways: the median wall time between consecutive
``step_end`` events before the kill (where the pair runs side by side), snapshots on over off, per pair and over all
pairs (a loaded 2-core machine is noisy: read the ratio with its spread); and what the ranks measured themselves
(the ``snapshot/*`` metrics each rank logs at its shutdown): the seconds a snapshot takes from a trainer's main thread
(starting it, waiting for a copy or the last transfer: what a step can wait for) and from its background thread
(the copy and the transfer to the peer, beside the next step), per snapshot, the slowest trainer's, over the median
step time.

Prints one row per run pair, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start(out: Path, i: int, steps: int, every: int, rank: int, k: int, seed: int, extra: list[str]):
    tmp = out / f"run{i}-every{every}-r{rank}-k{k}"
    once = tmp / "once"
    once.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               DYNARESIZE_TEST_KILL_AT=f"{rank}:train_chunk.accumulated@step-{k}", DYNARESIZE_TEST_KILL_ONCE=str(once))
    argv = [sys.executable, "-m", "tests.support.run", "configs/quickstart.yaml", f"run.steps={steps}",
            "run.checkpoint_every=50", "policy.enabled=false", f"run.seed={seed}", f"faults.snapshot_every={every}",
            "run.progress=false", f"run.output_dir={tmp / 'runs'}", *extra, "--quiet"]
    log = open(tmp / "output.txt", "w")
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return p, tmp, time.monotonic()


def finish(started, every: int, rank: int, k: int) -> dict:
    p, tmp, t0 = started
    rc = p.wait(timeout=3600)
    wall = time.monotonic() - t0
    if rc != 0:
        raise SystemExit(f"run failed (faults.snapshot_every={every}, rank {rank} killed in step {k}):\n"
                         f"{(tmp / 'output.txt').read_text()[-3000:]}")
    rd = next(d for d in (tmp / "runs").iterdir() if d.is_dir())
    from dynaresize.events import EventType, read_events

    ev = list(read_events(rd))  # damaged lines (a killed writer) skipped, as the project's readers do
    ends = [e for e in ev if e.type is EventType.STEP_END]
    retrained = len(ends) - len({e["step"] for e in ends})
    # the wall time between consecutive step_end events before the kill: the two runs of a pair run side by side
    # there (after it, one retrains while the other goes on, or has ended: not the same load)
    first: dict[int, float] = {}
    for e in ends:
        first.setdefault(e["step"], e.t)
    step_s = [first[j] - first[j - 1] for j in range(1, k) if j in first and j - 1 in first]
    snap = {}  # what the snapshots cost each rank (its metrics at shutdown: the processes after the restart)
    for e in ev:
        if e.type is EventType.METRIC and str(e.get("name", "")).startswith("snapshot/"):
            snap.setdefault(e["rank"], {})[e["name"].split("/", 1)[1]] = e["value"]
    used = [e["reason"] for e in ev if e.get("what") == "snapshot_restore"]
    unused = [e["reason"] for e in ev if e.get("what") == "snapshot_unused"]
    return {"run_dir": str(rd), "retrained": retrained, "step_s": step_s, "wall_s": round(wall, 1), "snap": snap,
            "restored_from": "snapshot" if used else "disk", "why": (used or unused or [""])[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="pairs of runs (off, on), each with its own kill (default 3)")
    ap.add_argument("--steps", type=int, default=12, help="run.steps of each run (default 12)")
    ap.add_argument("--seed", type=int, default=1, help="draws the kills; also run.seed (default 1)")
    ap.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="more config overrides for every run (k=v)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_recovery-"))
    n_train = 3  # the quickstart's cluster.initial_train (policy off: it stays)
    rows, pairs = [], []
    print(f"{'run':>3} {'rank':>4} {'kill@':>5} {'retrained off':>13} {'retrained on':>12} {'from (on)':>9} "
          f"{'step s off':>10} {'step s on':>9} {'ratio':>6} {'main ms':>7} {'main/step':>9} {'bg ms':>6}")
    for i in range(args.runs):
        k, rank = rng.randint(2, args.steps - 2), rng.randrange(n_train)
        # side by side, at the same time: whatever else loads the machine loads both alike
        runs = {every: start(out, i, args.steps, every, rank, k, args.seed, args.overrides) for every in (0, 1)}
        off, on = (finish(runs[every], every, rank, k) for every in (0, 1))
        s_off, s_on = statistics.median(off["step_s"]), statistics.median(on["step_s"])
        per = [(x["main_s"] / x["taken"], x["background_s"] / x["taken"]) for x in on["snap"].values() if x.get("taken")]
        main_s = max((m for m, _ in per), default=0.0)  # the slowest trainer's: a step waits for every trainer
        bg_s = max((b for _, b in per), default=0.0)
        pairs.append((off, on, s_off, s_on, main_s, bg_s))
        rows.append({"run": i, "rank": rank, "kill_step": k, "retrained_off": off["retrained"],
                     "retrained_on": on["retrained"], "restored_from_on": on["restored_from"], "why_on": on["why"],
                     "step_s_off": round(s_off, 4), "step_s_on": round(s_on, 4), "ratio": round(s_on / s_off, 4),
                     "main_ms_per_snapshot": round(main_s * 1e3, 3), "background_ms_per_snapshot": round(bg_s * 1e3, 3)})
        r = rows[-1]
        print(f"{i:>3} {rank:>4} {k:>5} {r['retrained_off']:>13} {r['retrained_on']:>12} {r['restored_from_on']:>9} "
              f"{s_off:>10.3f} {s_on:>9.3f} {r['ratio']:>6.3f} {main_s * 1e3:>7.2f} {main_s / s_off:>9.3%} "
              f"{bg_s * 1e3:>6.1f}", flush=True)
    all_off = [x for p in pairs for x in p[0]["step_s"]]
    all_on = [x for p in pairs for x in p[1]["step_s"]]
    med_off, med_on = statistics.median(all_off), statistics.median(all_on)
    main_ms = statistics.median(p[4] for p in pairs) * 1e3
    bg_ms = statistics.median(p[5] for p in pairs) * 1e3
    summary = {
        "runs": args.runs, "steps": args.steps, "seed": args.seed,
        "retrained_off": [r["retrained_off"] for r in rows], "retrained_on": [r["retrained_on"] for r in rows],
        "retrained_ratio_on_over_off": round(sum(r["retrained_on"] for r in rows) / max(1, sum(r["retrained_off"] for r in rows)), 4),
        "restored_from_snapshot": sum(r["restored_from_on"] == "snapshot" for r in rows),
        "step_s_off_median": round(med_off, 4), "step_s_on_median": round(med_on, 4),
        "step_time_ratio_on_over_off": round(med_on / med_off, 4),
        "step_time_ratio_per_pair": [r["ratio"] for r in rows],
        "step_time_ratio_spread": [min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)],
        "main_thread_ms_per_snapshot": round(main_ms, 3), "main_thread_share_of_step": round(main_ms / 1e3 / med_off, 5),
        "background_ms_per_snapshot": round(bg_ms, 3), "background_share_of_step": round(bg_ms / 1e3 / med_off, 5),
        "target": "snapshot cost under 2% of a step", "out": str(out), "rows": rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
