"""Diagnose the pipeline predictor: per step, the split, measured obs period, measured wall step time, the played
period of the current split (before the obs), the played best candidate and the decision."""
from __future__ import annotations
import argparse, sys
import numpy as np
from dataclasses import replace
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dynaresize.config.loader import load_config
from dynaresize.sim.mechanisms import SimMechanisms
from dynaresize.sim.compare import run_samples, setup, best_static_samples
from dynaresize.sim import samples as S
from dynaresize.policy import policy as P

ALL = SimMechanisms(True, True, True, True)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="stationary_8gpu")
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--mean", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--predictor", default="pipeline")
    ap.add_argument("--best", action="store_true")
    ap.add_argument("--over", nargs="*", default=[])
    ap.add_argument("--static", type=int, nargs="*", default=[])
    a = ap.parse_args()
    ov = [f"sim.steps={a.steps}", "sim.write_events=false", f"run.seed={a.seed}", f"policy.predictor={a.predictor}"] + a.over
    if a.gpus:
        ov += [f"cluster.gpus={a.gpus}", f"cluster.initial_train={round(0.75 * a.gpus)}"]
    if a.mean:
        ov += [f"sim.workload.response_tokens_start={a.mean}", f"sim.workload.response_tokens_end={a.mean}"]
    s = setup(load_config(ROOT / f"configs/sim/{a.scenario}.yaml", ov))
    ends = {}
    orig_done = S.SamplePipeline._step_done
    def done(self, t, batch):
        ends[batch] = t
        return orig_done(self, t, batch)
    S.SamplePipeline._step_done = done
    log = []
    orig_step = P.ResizePolicy.step
    def step(self, state, obs):
        pre = None
        if state.estimates is not None and self._piped(state.estimates):
            pre = self._period(state.estimates, obs.topology)
        st, dec = orig_step(self, state, obs)
        best = None
        if self._piped(st.estimates):
            cands = self._window(st.estimates, obs.topology, [c for c in self.candidates if c.total == obs.topology.total])
            pers = {c: self._period(st.estimates, c) for c in cands}
            best = min(pers, key=pers.get)
            best = (best, pers[best], pers[obs.topology] if obs.topology in pers else None)
        log.append((obs.step, obs.topology, obs.mixed, obs.period_s, pre, best, dec, st.here_ratio))
        return st, dec
    P.ResizePolicy.step = step
    last = {}
    o_pn, o_n = P.ResizePolicy._played_noise, P.ResizePolicy._noise
    def pn(self, est, cur, cands):
        r = o_pn(self, est, cur, cands); last['pn'] = (r, cands); return r
    def nn(self, est, a, b):
        r = o_n(self, est, a, b); last['n'] = r; return r
    P.ResizePolicy._played_noise = pn
    P.ResizePolicy._noise = nn
    o_choose = P.ResizePolicy._choose
    def ch(self, state, est, cur, horizon, step):
        last.clear()
        r = o_choose(self, state, est, cur, horizon, step)
        if 'pn' in last:
            pnv, cands = last['pn']
            nv = last.get('n', np.zeros(len(cands)))
            print(f"   choose@{step}: z {self._z(state, step):.1f} " + " ".join(f"{c}:pn{pnv[i]:.2f}/cn{(nv[i] if hasattr(nv, '__len__') else nv):.2f}" for i, c in enumerate(cands)))
        return r
    P.ResizePolicy._choose = ch
    for n in a.static:
        from dynaresize.policy.types import Topology
        r = run_samples(s, Topology(n, s.cfg.cluster.gpus - n), replace(ALL, resize=False))
        print(f"static {n}: total {r.total_s:.1f}")
    res = run_samples(s, s.initial, ALL)
    print(f"dynamic total {res.total_s:.1f} switches {res.switches}")
    for (k, topo, mixed, per, pre, best, dec, hr) in log:
        wall = ends.get(k, 0) - ends.get(k - 1, 0)
        b = f"best {best[0]} {best[1]:.2f} cur {best[2] if best[2] is None else round(best[2], 2)}" if best else ""
        print(f"{k:4d} {str(topo):>6} {'M' if mixed else ' '} obs {per:7.2f} wall {wall:7.2f} pred {pre if pre is None else round(pre, 2)} hr {hr if hr is None else round(hr, 3)} {b} | {dec.action.value} {dec.reason[:90]}")
    if a.best:
        S.SamplePipeline._step_done = orig_done
        split, tot = best_static_samples(s, ALL)
        print(f"best static {split} {tot:.1f}; dyn loss {res.total_s / tot - 1:+.4f}")

main()
