"""The play on exactly the simulated batches, in order (no cycling): cumulative step ends, sim vs play."""
from __future__ import annotations
import argparse, sys
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

ap = argparse.ArgumentParser()
ap.add_argument("--scenario", default="stationary_8gpu")
ap.add_argument("--gpus", type=int)
ap.add_argument("--mean", type=int)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--splits", type=int, nargs="*")
ap.add_argument("--mech", default="1101")
ap.add_argument("--over", nargs="*", default=[])
a = ap.parse_args()
ov = [f"sim.steps={a.steps}", "sim.write_events=false", f"run.seed={a.seed}"] + a.over
if a.gpus:
    ov += [f"cluster.gpus={a.gpus}", f"cluster.initial_train={round(0.75 * a.gpus)}"]
if a.mean:
    ov += [f"sim.workload.response_tokens_start={a.mean}", f"sim.workload.response_tokens_end={a.mean}"]
s = setup(load_config(ROOT / f"configs/sim/{a.scenario}.yaml", ov))
N = s.cfg.cluster.gpus
mech = SimMechanisms(*[c == "1" for c in a.mech])
orig = S.SamplePipeline._step_done
for n in a.splits:
    ends, wls = {}, {}
    def done(self, t, batch):
        ends[batch] = t
        wls[batch] = self._workload(self._batch(batch))
        return orig(self, t, batch)
    S.SamplePipeline._step_done = done
    topo = Topology(n, N - n)
    r = run_samples(s, topo, mech)
    K = max(ends) + 1
    tr = tuple(wls[j] for j in range(K - 1))
    pp = PipelinePredictor(s.cfg.policy.train_scaling_per_doubling, warmup_steps=0)
    st = pp.step_times(tr, topo)
    pe = np.cumsum(st[1:])  # play ends relative to ends[0]
    se = np.array([ends[k] - ends[0] for k in range(1, K - 1)])
    d = (pe - se)
    print(f"{topo}: sim mean step (5:) {np.diff(se)[4:].mean():.2f} play {np.diff(pe)[4:].mean():.2f} ratio {np.diff(se)[4:].mean()/np.diff(pe)[4:].mean():.4f}; end drift play-sim {d[-1]:+.1f}s", flush=True)
