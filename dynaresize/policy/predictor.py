"""Stage-time predictors: an EWMA, and a model of each stage's time under another split.

Model (the same form the simulator's physics produces, with parameters learned from observations):

- rollout(n_r) = tail + rollout_work / n_r. ``tail`` is the time of the longest response decoded alone: no number
  of GPUs shortens it; the bulk (everything else) divides over the rollout GPUs (dynamic dispatch).
- train(n_t) = train_work / (n_t x eff(n_t)), eff(n) = scaling_per_doubling ** log2(n) (data-parallel losses).
- weight sync is added to the rollout stage; the pipeline period is max(rollout + sync, train).

Work is kept in GPU-seconds, so what was learned on one split predicts every other split.
"""

from __future__ import annotations

import math

from dynaresize.policy.types import Estimates, Observation, Topology


def ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else alpha * new + (1 - alpha) * old


def efficiency(n: int, per_doubling: float) -> float:
    return per_doubling ** math.log2(n) if n > 1 else 1.0


class StageModel:
    """Turns observations into :class:`Estimates` and estimates into predicted stage times for any topology."""

    def __init__(self, alpha: float, scaling_per_doubling: float):
        self.alpha = alpha
        self.per_doubling = scaling_per_doubling

    def measure(self, obs: Observation) -> Estimates:
        tail = max(0.0, min(obs.rollout_tail_s, obs.rollout_s))
        return Estimates(
            rollout_work=(obs.rollout_s - tail) * obs.topology.n_rollout,
            rollout_tail=tail,
            train_work=obs.train_s * obs.topology.n_train * efficiency(obs.topology.n_train, self.per_doubling),
            sync=obs.weight_sync_s,
        )

    def update(self, old: Estimates | None, obs: Observation) -> Estimates:
        m = self.measure(obs)
        if old is None:
            return m
        a = self.alpha
        return Estimates(
            rollout_work=ewma(old.rollout_work, m.rollout_work, a),
            rollout_tail=ewma(old.rollout_tail, m.rollout_tail, a),
            train_work=ewma(old.train_work, m.train_work, a),
            sync=ewma(old.sync, m.sync, a),
        )

    def rollout_s(self, est: Estimates, topo: Topology) -> float:
        return est.rollout_tail + est.rollout_work / topo.n_rollout + est.sync

    def train_s(self, est: Estimates, topo: Topology) -> float:
        return est.train_work / (topo.n_train * efficiency(topo.n_train, self.per_doubling))

    def period_s(self, est: Estimates, topo: Topology) -> float:
        """Predicted steady-state step time of the one-step-off pipeline on ``topo``."""
        return max(self.rollout_s(est, topo), self.train_s(est, topo))

    def imbalance(self, est: Estimates, topo: Topology) -> tuple[float, int]:
        """(|rollout - train| / max, +1 if rollout is slower else -1)."""
        r, t = self.rollout_s(est, topo), self.train_s(est, topo)
        hi = max(r, t)
        if hi <= 0:
            return 0.0, 0
        return abs(r - t) / hi, (1 if r > t else -1)
