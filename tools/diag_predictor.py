"""Diagnose the pipeline predictor (``policy.predictor: pipeline``) on a simulated run: three views, one scenario setup.

    .venv/bin/python tools/diag_predictor.py exact --gpus 32 --mean 1000 --splits 8 15      # play vs sim, in order
    .venv/bin/python tools/diag_predictor.py fidelity --gpus 16 --mean 3000 --splits 9 10   # the 8-batch window
    .venv/bin/python tools/diag_predictor.py decisions --gpus 16 --mean 3000 --best          # the policy, step by step

- ``exact``: a static run per split, then the play on exactly its batches, in order (no cycling, no warm-up):
  the mean step from the 5th on, simulated and played, and how far the play's end drifts from the run's;
- ``fidelity``: a static run per split; every ``--every`` steps from step 12 on, the newest 8 batches played on that
  split, against the mean wall step of the same 8 batches and of the next 8;
- ``decisions``: a resizing run; per step the split, the observed and wall step times, the played period of the
  current split before the step, the played best candidate, the model's error here and the decision, and at each
  choice the played gain's noise against the capacity model's per candidate.

Diagnostics, not a benchmark: they wrap the simulator's and the policy's own methods (``SamplePipeline._step_done``,
``ResizePolicy.step``, ``_choose``, ``_played_noise``, ``_noise``) in this process to read what they computed.
Scenarios: ``configs/sim/<scenario>.yaml``; ``--gpus``/``--mean`` make it the robustness bench's stationary case.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynaresize.config.loader import load_config  # noqa: E402
from dynaresize.policy import policy as P  # noqa: E402
from dynaresize.policy.pipeline_predictor import PipelinePredictor  # noqa: E402
from dynaresize.policy.types import Topology  # noqa: E402
from dynaresize.sim import samples as S  # noqa: E402
from dynaresize.sim.compare import best_static_samples, run_samples, setup  # noqa: E402
from dynaresize.sim.mechanisms import HelperPlay, SimMechanisms, play_hooks  # noqa: E402


def scenario(a, extra: list[str]):
    ov = [f"sim.steps={a.steps}", "sim.write_events=false", f"run.seed={a.seed}", *extra, *a.over]
    if a.gpus:
        ov += [f"cluster.gpus={a.gpus}", f"cluster.initial_train={round(0.75 * a.gpus)}"]
    if a.mean:
        ov += [f"sim.workload.response_tokens_start={a.mean}", f"sim.workload.response_tokens_end={a.mean}"]
    return setup(load_config(ROOT / f"configs/sim/{a.scenario}.yaml", ov))


_STEP_DONE = S.SamplePipeline._step_done  # the simulator's own, wrapped while a Capture is installed


class Capture:
    """While installed: each finished step's end time (``ends``) and, with ``workloads``, its batch as the policy
    sees it (``wls``), from the simulator's own ``_step_done``."""

    def __init__(self, workloads: bool = True):
        self.ends: dict[int, float] = {}
        self.wls: dict = {}
        cap, orig = self, _STEP_DONE

        def done(pipe, t, batch):
            cap.ends[batch] = t
            if workloads:
                cap.wls[batch] = pipe._workload(pipe._batch(batch))
            return orig(pipe, t, batch)

        S.SamplePipeline._step_done = done

    @staticmethod
    def remove() -> None:
        S.SamplePipeline._step_done = _STEP_DONE


def exact(a) -> None:
    s = scenario(a, [])
    N = s.cfg.cluster.gpus
    mech = SimMechanisms(*[c == "1" for c in a.mech])
    for n in a.splits:
        cap = Capture()
        topo = Topology(n, N - n)
        run_samples(s, topo, mech)
        K = max(cap.ends) + 1
        pp = PipelinePredictor(s.cfg.policy.train_scaling_per_doubling, warmup_steps=0, hooks=play_hooks(mech))
        st = pp.step_times(tuple(cap.wls[j] for j in range(K - 1)), topo)
        pe = np.cumsum(st[1:])  # play ends relative to ends[0]
        se = np.array([cap.ends[k] - cap.ends[0] for k in range(1, K - 1)])
        sim_m, play_m = np.diff(se)[4:].mean(), np.diff(pe)[4:].mean()
        print(f"{topo}: sim mean step (5:) {sim_m:.2f} play {play_m:.2f} ratio {sim_m / play_m:.4f}; "
              f"end drift play-sim {pe[-1] - se[-1]:+.1f}s", flush=True)


def fidelity(a) -> None:
    s = scenario(a, [])
    N = s.cfg.cluster.gpus
    for n in a.splits:
        cap = Capture()
        topo = Topology(n, N - n)
        r = run_samples(s, topo, SimMechanisms(True, True, False, True))
        pp = PipelinePredictor(s.cfg.policy.train_scaling_per_doubling, hooks=HelperPlay)
        if a.warmup is not None:
            pp.warmup = a.warmup
        if a.lookahead is not None:
            pp.lookahead = a.lookahead
        K = max(cap.ends)
        wall = np.array([cap.ends[k] - cap.ends[k - 1] for k in range(1, K + 1)])
        at = range(12, K - 8, a.every)
        played = np.array([pp.period_s(tuple(cap.wls[j] for j in range(k - 7, k + 1)), topo) for k in at])
        nxt = np.array([wall[k:k + 8].mean() for k in at])  # the next 8 steps' wall
        own = np.array([wall[k - 8:k].mean() for k in at])  # the same batches' own wall
        print(f"{topo}: total {r.total_s:.1f} mean wall(10:) {wall[10:].mean():.2f} played {played.mean():.2f} "
              f"own-window wall {own.mean():.2f} ratio own/played {np.mean(own / played):.3f} "
              f"next/played {np.mean(nxt / played):.3f}", flush=True)


def decisions(a) -> None:
    every = SimMechanisms(True, True, True, True)
    s = scenario(a, [f"policy.predictor={a.predictor}"])
    cap = Capture(workloads=False)
    log, last = [], {}
    o_step, o_pn, o_n, o_choose = (P.ResizePolicy.step, P.ResizePolicy._played_noise, P.ResizePolicy._noise,
                                   P.ResizePolicy._choose)

    def step(self, state, obs):
        pre = self._period(state.estimates, obs.topology) if state.estimates is not None and self._piped(state.estimates) else None
        st, dec = o_step(self, state, obs)
        best = None
        if self._piped(st.estimates):
            cands = self._window(st.estimates, obs.topology, [c for c in self.candidates if c.total == obs.topology.total])
            pers = {c: self._period(st.estimates, c) for c in cands}
            b = min(pers, key=pers.get)
            best = (b, pers[b], pers.get(obs.topology))
        log.append((obs.step, obs.topology, obs.mixed, obs.period_s, pre, best, dec, st.here_ratio))
        return st, dec

    def played_noise(self, est, cur, cands):
        r = o_pn(self, est, cur, cands)
        last["pn"] = (r, cands)
        return r

    def noise(self, est, now_fn, per_fn):
        r = o_n(self, est, now_fn, per_fn)
        last["n"] = r
        return r

    def choose(self, state, est, cur, horizon, k):
        last.clear()
        r = o_choose(self, state, est, cur, horizon, k)
        if "pn" in last:
            pnv, cands = last["pn"]
            nv = last.get("n", np.zeros(len(cands)))
            print(f"   choose@{k}: z {self._z(state, k):.1f} " + " ".join(
                f"{c}:pn{pnv[i]:.2f}/cn{(nv[i] if hasattr(nv, '__len__') else nv):.2f}" for i, c in enumerate(cands)))
        return r

    P.ResizePolicy.step, P.ResizePolicy._played_noise, P.ResizePolicy._noise, P.ResizePolicy._choose = (
        step, played_noise, noise, choose)
    for n in a.static:
        r = run_samples(s, Topology(n, s.cfg.cluster.gpus - n), replace(every, resize=False))
        print(f"static {n}: total {r.total_s:.1f}")
    res = run_samples(s, s.initial, every)
    print(f"dynamic total {res.total_s:.1f} switches {res.switches}")
    for k, topo, mixed, per, pre, best, dec, hr in log:
        wall = cap.ends.get(k, 0) - cap.ends.get(k - 1, 0)
        b = f"best {best[0]} {best[1]:.2f} cur {best[2] if best[2] is None else round(best[2], 2)}" if best else ""
        print(f"{k:4d} {str(topo):>6} {'M' if mixed else ' '} obs {per:7.2f} wall {wall:7.2f} "
              f"pred {pre if pre is None else round(pre, 2)} hr {hr if hr is None else round(hr, 3)} {b} | "
              f"{dec.action.value} {dec.reason[:90]}")
    if a.best:
        Capture.remove()
        split, tot = best_static_samples(s, every)
        print(f"best static {split} {tot:.1f}; dyn loss {res.total_s / tot - 1:+.4f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="view", required=True)
    views = {"exact": (exact, 40), "fidelity": (fidelity, 60), "decisions": (decisions, 200)}
    for name, (_, steps) in views.items():
        p = sub.add_parser(name)
        p.add_argument("--scenario", default="stationary_8gpu")
        p.add_argument("--gpus", type=int)
        p.add_argument("--mean", type=int, help="mean response tokens (a stationary workload)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--over", nargs="*", default=[], help="extra dotted overrides")
        if name in ("exact", "fidelity"):
            p.add_argument("--splits", type=int, nargs="+", required=True, help="trainer counts of the static runs")
        if name == "exact":
            p.add_argument("--mech", default="1101", help="continuous, streaming, resize, helpers as 0/1")
        if name == "fidelity":
            p.add_argument("--every", type=int, default=4)
            p.add_argument("--warmup", type=int, help="the predictor's warm-up batches (default: its own)")
            p.add_argument("--lookahead", type=int, help="batches played behind the measured ones (default: its own)")
        if name == "decisions":
            p.add_argument("--predictor", default="pipeline")
            p.add_argument("--best", action="store_true", help="also the best static split (a local search) and the loss")
            p.add_argument("--static", type=int, nargs="*", default=[], help="static runs to print first")
    a = ap.parse_args()
    views[a.view][0](a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
