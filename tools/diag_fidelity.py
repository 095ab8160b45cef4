"""Played vs simulated period per static split: for each split, a static barrier-free run; at each step from 11 on,
play the last 8 batches on that split; compare the mean played period with the mean measured wall step time."""
from __future__ import annotations
import argparse, sys
from dataclasses import replace
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import numpy as np
from dynaresize.config.loader import load_config
from dynaresize.sim.mechanisms import SimMechanisms
from dynaresize.sim.compare import run_samples, setup
from dynaresize.sim import samples as S
from dynaresize.policy.pipeline_predictor import PipelinePredictor
from dynaresize.policy.types import Topology

ALL = SimMechanisms(True, True, False, True)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="stationary_8gpu")
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--mean", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--splits", type=int, nargs="*")
    ap.add_argument("--every", type=int, default=4)
    a = ap.parse_args()
    ov = [f"sim.steps={a.steps}", "sim.write_events=false", f"run.seed={a.seed}"]
    if a.gpus:
        ov += [f"cluster.gpus={a.gpus}", f"cluster.initial_train={round(0.75 * a.gpus)}"]
    if a.mean:
        ov += [f"sim.workload.response_tokens_start={a.mean}", f"sim.workload.response_tokens_end={a.mean}"]
    s = setup(load_config(ROOT / f"configs/sim/{a.scenario}.yaml", ov))
    N = s.cfg.cluster.gpus
    orig = S.SamplePipeline._step_done
    for n in a.splits:
        ends, wls = {}, {}
        def done(self, t, batch):
            ends[batch] = t
            wls[batch] = self._workload(self._batch(batch))
            return orig(self, t, batch)
        S.SamplePipeline._step_done = done
        topo = Topology(n, N - n)
        r = run_samples(s, topo, ALL)
        pp = PipelinePredictor(s.cfg.policy.train_scaling_per_doubling)
        import os; pp.warmup = int(os.environ.get("WU", 3)); pp.lookahead = int(os.environ.get("LA", 2))
        K = max(ends)
        wall = np.array([ends[k] - ends[k - 1] for k in range(1, K + 1)])
        played, meas = [], []
        for k in range(12, K - 8, a.every):
            tr = tuple(wls[j] for j in range(k - 7, k + 1))
            played.append(pp.period_s(tr, topo))
            meas.append(wall[k + 1 - 1: k + 9 - 1].mean())  # the next 8 steps' wall
            # also the same batches' own wall
        own = [wall[k - 7 - 1:k].mean() for k in range(12, K - 8, a.every)]
        played, meas, own = map(np.array, (played, meas, own))
        print(f"{topo}: total {r.total_s:.1f} mean wall(10:) {wall[10:].mean():.2f} played {played.mean():.2f} "
              f"own-window wall {own.mean():.2f} ratio own/played {np.mean(own / played):.3f} next/played {np.mean(meas / played):.3f}", flush=True)

main()
