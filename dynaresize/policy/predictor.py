"""Stage-time predictors: an EWMA, and a model of each stage's time under another split.

Model (the same form the simulator's physics produces, with parameters learned from observations):

- rollout(n_r) = tail + rollout_work / n_r. ``tail`` is the time of the longest response decoded alone: no number
  of GPUs shortens it; the bulk (everything else) divides over the rollout GPUs (dynamic dispatch).
- train(n_t) = train_work / (n_t x eff(n_t)), eff(n) = scaling_per_doubling ** log2(n) (data-parallel losses).
- weight sync is added to the rollout stage; the pipeline period is max(rollout + sync, train).

Work is kept in GPU-seconds, so what was learned on one split predicts every other split.

Noise: the tail is the longest of a step's responses and moves by tens of % from step to step (the bulk, a sum
over many responses, hardly moves). The model keeps an EWMA variance of the tail (and of the relative train
work) beside the means, and predicts the period as the expectation of the max of two normal variables (Clark,
1961): near the balance point the slower stage changes from step to step, and E[max(R, T)] > max(E[R], E[T]).
With no noise it is the plain max.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from dynaresize.policy.decode_profile import busy_span_s, profile_of
from dynaresize.policy.types import DecodeProfile, Estimates, Observation, Topology


RATIO_MIN_STEPS = 2  # a pool size's ratio is remembered once measured on this many steps (3, as the policy's memory,
# left stationary_8gpu's first move unremembered after the pipeline's fill: 6:2 -> 5:3 -> 6:2 -> 5:3 with consolidation)
RATIO_MIN_WEIGHT = 0.1  # the decode profile's measured ratio: a running mean down to this weight (as the policy's here-ratio)


def ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else alpha * new + (1 - alpha) * old


def blend(old: DecodeProfile, new: DecodeProfile, alpha: float, shape_alpha: float) -> DecodeProfile:
    """The EWMA of two decode profiles: the decode costs and the tokens (the level) with weight ``alpha`` on ``new``;
    the longest responses relative to the mean tokens of a group (the shape), rank by rank, with ``shape_alpha``: a
    batch's few longest responses vary by tens of % from batch to batch, while a drift (lengths growing over a
    run) moves the level, not the shape. The batch's shape (groups, slots) is the newest."""
    tokens = ewma(old.tokens, new.tokens, alpha)
    gm = new.group_max
    if len(gm) == len(old.group_max) and old.tokens > 0 and new.tokens > 0:
        was, now, level = old.tokens / old.groups, new.tokens / new.groups, tokens / new.groups
        gm = tuple(level * ewma(a / was, b / now, shape_alpha) for a, b in zip(old.group_max, gm))
    return replace(new, iteration_s=ewma(old.iteration_s, new.iteration_s, alpha),
                   seq_iteration_s=ewma(old.seq_iteration_s, new.seq_iteration_s, alpha),
                   prefill_s_per_group=ewma(old.prefill_s_per_group, new.prefill_s_per_group, alpha), tokens=tokens, group_max=gm)


def efficiency(n: int, per_doubling: float) -> float:
    return per_doubling ** math.log2(n) if n > 1 else 1.0


def _phi(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF (Abramowitz & Stegun 7.1.26 for erf, |error| < 1.5e-7), vectorised."""
    z = np.abs(x) / math.sqrt(2)
    t = 1.0 / (1.0 + 0.3275911 * z)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * np.exp(-z * z)
    return 0.5 * (1.0 + np.sign(x) * y)


def expected_max(mr: np.ndarray, sr: np.ndarray, mt: np.ndarray, st: np.ndarray) -> np.ndarray:
    """E[max(R, T)] for independent R ~ N(mr, sr^2), T ~ N(mt, st^2) (Clark 1961); max(mr, mt) without noise."""
    mr, mt = np.asarray(mr, dtype=np.float64), np.asarray(mt, dtype=np.float64)
    s = np.sqrt(np.asarray(sr, dtype=np.float64) ** 2 + np.asarray(st, dtype=np.float64) ** 2)
    safe = np.where(s > 0, s, 1.0)
    d = np.clip((mr - mt) / safe, -40.0, 40.0)
    clark = mt + (mr - mt) * _Phi(d) + s * _phi(d)
    return np.where(s > 0, np.maximum(clark, np.maximum(mr, mt)), np.maximum(mr, mt))


class StageModel:
    """Turns observations into :class:`Estimates` and estimates into predicted stage times for any topology.

    ``tail_alpha`` (default ``alpha``) is the EWMA weight of the tail, the noisy part; ``noise_alpha`` that of the
    variances; both weigh the first observations equally (a running mean, 1/n) until 1/n falls below them; the tail's
    variance starts at ``(tail_cv_prior x tail)^2``, weighted as one observation.
    """

    def __init__(self, alpha: float, scaling_per_doubling: float, tail_alpha: float | None = None, noise_alpha: float = 0.2,
                 tail_cv_prior: float = 0.0, decode: bool = False, shape_alpha: float = 0.1, shift_z: float = 0.0,
                 shift_steps: int = 2):
        self.alpha = alpha
        self.shift_z, self.shift_steps = shift_z, shift_steps  # a shift of the workload: see update
        self.decode = decode  # rollout from the observed batches' decode profile where they are observed
        self.shape_alpha = shape_alpha  # the profile's shape (longest responses relative to the mean): its EWMA weight
        self.tail_cv_prior = tail_cv_prior
        self.per_doubling = scaling_per_doubling
        self.tail_alpha = alpha if tail_alpha is None else tail_alpha
        self.noise_alpha = noise_alpha

    def measure(self, obs: Observation) -> Estimates:
        tail = max(0.0, min(obs.rollout_tail_s, obs.rollout_s))
        profile = profile_of(obs.workload) if self.decode and obs.workload is not None else None
        modelled = busy_span_s(profile, obs.topology.n_rollout) if profile is not None else 0.0
        return Estimates(
            rollout_work=(obs.rollout_s - tail) * obs.topology.n_rollout,
            rollout_tail=tail,
            train_work=obs.train_s * obs.topology.n_train * efficiency(obs.topology.n_train, self.per_doubling),
            sync=obs.weight_sync_s,
            decode=profile if modelled > 0 else None,
            rollout_ratio=(obs.rollout_s - tail) / modelled if modelled > 0 else 1.0,
            ratio_rollout=obs.topology.n_rollout,
            level=float(obs.tokens_generated + obs.tokens_trained),
        )

    def update(self, old: Estimates | None, obs: Observation) -> Estimates:
        m = self.measure(obs)
        if old is None:  # the variance starts at its prior and is learned from there
            return replace(m, tail_var=(self.tail_cv_prior * m.rollout_tail) ** 2)
        # a shift of the workload's size (beyond shift_z standard deviations of its step-to-step noise, shift_steps
        # steps in a row in one direction): the tail and the train work are carried to the new size (each scaled by
        # the size now over the size it stands for) and a step beyond is not measured as noise until the shift is
        # refuted (a sudden x4 of the response length, taken as noise, had held every move for 25-37 steps)
        d_level = m.level / old.level - 1.0 if old.level > 0 and m.level > 0 else 0.0
        out = self.shift_z > 0 and abs(d_level) > self.shift_z * math.sqrt(max(0.0, old.level_var)) > 0
        beyond = (old.level_beyond + (1 if d_level > 0 else -1) if out and old.level_beyond * d_level >= 0 else
                  (1 if d_level > 0 else -1) if out else 0)
        shift = abs(beyond) >= self.shift_steps and old.tail_size > 0 and old.work_size > 0
        rt = m.level / old.tail_size if shift else 1.0
        rw = m.level / old.work_size if shift else 1.0
        if shift:
            old = replace(old, rollout_tail=old.rollout_tail * rt, tail_var=old.tail_var * rt * rt,
                          train_work=old.train_work * rw, tail_size=m.level, work_size=m.level, level=m.level)
        n = old.observations + 1  # a running mean until the EWMA's window is reached (the prior counts as one)
        a, ta, na = self.alpha, self.tail_alpha, self.noise_alpha
        d_tail = m.rollout_tail - old.rollout_tail
        d_train = m.train_work / old.train_work - 1.0 if old.train_work > 0 else 0.0
        both = old.decode is not None and m.decode is not None
        # the ratio is the profile's error on the split measured: a running mean from the move there (the model's
        # error differs from split to split), down to RATIO_MIN_WEIGHT (a window for slow drift)
        same = both and old.ratio_rollout == obs.topology.n_rollout
        k = old.ratio_steps + 1 if same else 1
        ratios = old.ratios  # the ratios of the pool sizes left, measured on at least RATIO_MIN_STEPS steps
        if both and not same and old.ratio_steps >= RATIO_MIN_STEPS:
            ratios = tuple(x for x in ratios if x[0] != old.ratio_rollout)[-3:] + ((old.ratio_rollout, old.rollout_ratio),)
        return Estimates(
            rollout_work=ewma(old.rollout_work, m.rollout_work, a),
            rollout_tail=old.rollout_tail + ta * d_tail,
            train_work=ewma(old.train_work, m.train_work, a),
            sync=ewma(old.sync, m.sync, a),
            tail_var=old.tail_var if out else (1 - na) * (old.tail_var + na * d_tail * d_tail),
            train_var=old.train_var if out else (1 - na) * (old.train_var + na * d_train * d_train),
            observations=n,
            decode=blend(old.decode, m.decode, a, max(1.0 / n, self.shape_alpha)) if both else m.decode,
            rollout_ratio=ewma(old.rollout_ratio, m.rollout_ratio, max(1.0 / k, RATIO_MIN_WEIGHT)) if same else m.rollout_ratio,
            ratio_rollout=obs.topology.n_rollout, ratio_steps=k, ratios=ratios if both else (),
            # the workload's size: a running mean, then an EWMA as slow as the noise's (tokens vary by ~10% a step)
            level=ewma(old.level, m.level, max(1.0 / n, na)) if old.level > 0 and m.level > 0 else (m.level or old.level),
            level_var=old.level_var if out else (1 - na) * (old.level_var + na * d_level * d_level),
            level_beyond=0 if shift else beyond, shifted=shift,
            tail_size=(old.tail_size + ta * (m.level - old.tail_size)) if old.tail_size > 0 and m.level > 0 else (m.level or old.tail_size),
            work_size=ewma(old.work_size, m.level, a) if old.work_size > 0 and m.level > 0 else (m.level or old.work_size),
        )

    def bulk_s(self, est: Estimates, n_rollout: int) -> float:
        """The rollout stage but its tail on ``n_rollout`` GPUs: the work over them, or with a decode profile its
        busy span there times the ratio measured to it (on that pool size when it was left after RATIO_MIN_STEPS
        steps, else on the current one: the profile's error differs from size to size)."""
        if est.decode is not None:
            ratio = est.rollout_ratio
            if n_rollout != est.ratio_rollout:
                ratio = next((r for n, r in est.ratios if n == n_rollout), ratio)
            return ratio * busy_span_s(est.decode, n_rollout)
        return est.rollout_work / n_rollout

    def rollout_s(self, est: Estimates, topo: Topology) -> float:
        return est.rollout_tail + self.bulk_s(est, topo.n_rollout) + est.sync

    def train_s(self, est: Estimates, topo: Topology) -> float:
        return est.train_work / (topo.n_train * efficiency(topo.n_train, self.per_doubling))

    def period_s(self, est: Estimates, topo: Topology) -> float:
        """Predicted steady-state step time of the one-step-off pipeline on ``topo`` (E[max] with the noise)."""
        r, t = self.rollout_s(est, topo), self.train_s(est, topo)
        sd = math.sqrt(max(0.0, est.tail_var) + t * t * max(0.0, est.train_var))
        if sd <= 0:
            return max(r, t)
        d = min(40.0, max(-40.0, (r - t) / sd))
        clark = t + (r - t) * 0.5 * (1.0 + math.erf(d / math.sqrt(2))) + sd * math.exp(-0.5 * d * d) / math.sqrt(2 * math.pi)
        return max(clark, r, t)

    def periods(self, est: Estimates, n_rollout: np.ndarray, n_train: np.ndarray, tail: float | None = None) -> np.ndarray:
        """:meth:`period_s` for many splits at once; ``tail`` replaces the tail estimate (for sensitivities)."""
        nr = np.asarray(n_rollout, dtype=np.float64)
        nt = np.asarray(n_train, dtype=np.float64)
        eff = np.where(nt > 1, self.per_doubling ** np.log2(np.maximum(nt, 1)), 1.0)
        bulk = est.rollout_work / nr if est.decode is None else np.array([self.bulk_s(est, int(x)) for x in nr])
        r = (est.rollout_tail if tail is None else tail) + bulk + est.sync
        t = est.train_work / (nt * eff)
        return expected_max(r, math.sqrt(max(0.0, est.tail_var)), t, t * math.sqrt(max(0.0, est.train_var)))

    def imbalance(self, est: Estimates, topo: Topology) -> tuple[float, int]:
        """(|rollout - train| / max, +1 if rollout is slower else -1)."""
        r, t = self.rollout_s(est, topo), self.train_s(est, topo)
        hi = max(r, t)
        if hi <= 0:
            return 0.0, 0
        return abs(r - t) / hi, (1 if r > t else -1)
