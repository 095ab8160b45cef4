"""The resizing policy: a pure function of (state, observation) -> (state, decision).

Used unchanged by the simulator and by the runtime coordinator::

    policy = ResizePolicy(cfg.policy, SwitchCostModel(costs, opts), candidates)
    state = policy.initial_state()
    state, decision = policy.step(state, observation)   # pure
    # or, keeping the state inside: decision = policy.decide(observation)

Rules, applied in this order after the stage-time estimates are updated (worked examples in the unit tests,
tests/unit/test_policy.py and test_policy_noise.py):

1. **cooldown**: for ``cooldown_steps`` steps after a resize, signals are ignored (the stages are settling).
2. **revert** (prediction-error guard): within ``payback_horizon_steps`` clean steps of a move, go back to the split
   just left if, each corrected by the model's measured error there (mean measured / predicted period), it is faster
   than this one by more than the noise (``noise_z`` standard errors, with the back-off of rule 6) and
   ``min_relative_gain``.
3. **imbalance threshold**: a step signals only if |rollout - train| / max > ``imbalance_threshold``.
4. **consecutive signals**: ``consecutive_signals`` signals in a row, in the same direction, are required.
5. **minimum dwell**: a topology is kept at least ``min_dwell_steps`` steps.
6. **best split**: predicted periods are E[max(rollout, train)] with the measured noise; a split left before (its
   error measured on >= 3 clean steps, and the model's prediction for it within ``memory_tolerance`` of the one when
   it was left, or else the workload's size within it) is never predicted faster than the model's error there says
   (or than its measured period, scaled by the workload's size, once the model has moved). Candidates whose
   predicted saving per step is within ``noise_z`` standard errors of that prediction are out; ``noise_z`` is
   multiplied by 1 + the resizes of the last ``backoff_steps`` steps (back-off). Of the rest, the largest net gain
   horizon x saving - cost (or the nearest to the current split within ``near_best_fraction`` of the best saving);
   hold if none.
7. **minimum gain**: the predicted step time must drop by at least ``min_relative_gain`` (0: off).
8. **payback**: horizon x saving per step must exceed switch cost x ``payback_margin``; the horizon is
   min(``payback_horizon_steps``, ``Observation.steps_left``) (no step left: hold).
9. **play check** (``play_check``; the capacity predictor, where the observations carry their batches): the move
   is played forward on the run's recent batches with the pipeline predictor's play, with the splits near it; it
   goes to the best that plays faster than the current split (the one chosen: on the median batch too, or beyond
   ``DISSENT_Z`` standard errors; another: beyond the noise), else the policy holds
   (:meth:`ResizePolicy._check_by_play`).

Predictor (``predictor``): ``capacity`` (default) predicts a split's period from split-invariant work
(:mod:`dynaresize.policy.predictor`; its rollout from the batches' decode profile wherever the observation carries its
batch, ``rollout_model: decode``, the default); ``pipeline`` plays each candidate forward on the run's recent batches
(:mod:`dynaresize.policy.pipeline_predictor`) wherever the observation carries its batch (the barrier-free
schedule), and then rule 3's imbalance is the predicted relative gain of the best candidate, against
``min_relative_gain``.

Shifts (``follow_shifts``, opt-in): a step size beyond ``noise_z`` standard deviations of its noise,
``consecutive_signals`` steps in a row, carries the estimates to the new size and restarts the play's batches
(:meth:`StageModel.update`), so a sudden change of the response length is not taken as noise (docs/simulator.md, "A
sudden shift").

No I/O, clock or randomness: the same observations always give the same decisions.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import numpy as np

from dynaresize.policy.config import PolicyConfig
from dynaresize.policy.costs import SwitchCostModel
from dynaresize.policy.pipeline_predictor import PipelinePredictor, PlayHooks, extrapolate
from dynaresize.policy.predictor import StageModel
from dynaresize.policy.types import Decision, Estimates, LeftSplit, Observation, PolicyState, ResizeAction, Topology


MEMORY_MIN_STEPS = 3  # clean steps on a split before what was measured there is trusted
# Student's t 97.5% quantiles by degrees of freedom (0: unused; the last entry stands for more)
_T975 = (math.inf, 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120)


# The play check (rule 9): standard errors by which a proposed split's played gain must stand out of its spread where
# the median batch plays slower (a gain a few long batches carry). 16 GPUs x 300 tokens seed 0: 0.67, the window's luck
# (over the whole run the move is 1.5% slower); 32 x 300 seed 1: 1.76, a right move whose gain the long-tailed batches
# carry over the whole run too.
DISSENT_Z = 1.0


def _beyond(gain, z: float, noise):
    """Whether ``gain`` lies beyond ``z`` standard errors ``noise`` (elementwise). ``z = 0`` (the noise tests off) asks
    only for a gain, also where the noise is unknown (infinite: one batch), which ``0 x inf`` would make NaN."""
    return gain > (z * noise if z > 0 else 0.0)


class ResizePolicy:
    def __init__(self, cfg: PolicyConfig, costs: SwitchCostModel, candidates: Sequence[Topology],
                 pipeline_hooks: type[PlayHooks] | None = None):
        """``pipeline_hooks``: a simulator-only mechanism the pipeline predictor plays (the simulator's gradient
        helpers or tail consolidation: ``dynaresize.sim.mechanisms.play_hooks``); the runtime has none."""
        if not candidates:
            raise ValueError("ResizePolicy needs at least one candidate topology")
        self.cfg = cfg
        self.costs = costs
        self.candidates = tuple(candidates)
        self.model = StageModel(cfg.ewma_alpha, cfg.train_scaling_per_doubling, cfg.tail_ewma_alpha, cfg.noise_alpha, cfg.tail_cv_prior,
                                cfg.rollout_model == "decode", cfg.decode_shape_alpha,
                                cfg.noise_z if cfg.follow_shifts else 0.0, cfg.consecutive_signals)
        self.pipeline = PipelinePredictor(cfg.train_scaling_per_doubling, hooks=pipeline_hooks) if cfg.predictor == "pipeline" else None
        # the capacity predictor's moves checked by the same play (rule 9), where the observations carry their batches
        self.checker = (PipelinePredictor(cfg.train_scaling_per_doubling, hooks=pipeline_hooks)
                        if cfg.predictor == "capacity" and cfg.play_check else None)
        ts = sorted({c.n_train for c in self.candidates})
        self._unit = min((b - a for a, b in zip(ts, ts[1:])), default=1)
        self._state = self.initial_state()

    def initial_state(self) -> PolicyState:
        return PolicyState()

    def decide(self, obs: Observation) -> Decision:
        """Stateful convenience wrapper around :meth:`step`."""
        self._state, decision = self.step(self._state, obs)
        return decision

    def step(self, state: PolicyState, obs: Observation) -> tuple[PolicyState, Decision]:
        cfg, cur = self.cfg, obs.topology
        learned = state.estimates is not None and state.estimates.observations > 0
        if obs.mixed and not learned:  # nothing clean measured yet: estimates that only carry the batch (observations 0)
            est = replace(self.model.update(None, obs), observations=0)
        else:  # (estimates with no observation are replaced by the first clean step's)
            est = state.estimates if obs.mixed else self.model.update(state.estimates if learned else None, obs)
        # a shift of the workload (policy.follow_shifts; StageModel.update carried the estimates to the new size): the
        # batches before it describe another workload, so a play replays only those since (the steps beyond it), and a
        # move held by a play is played anew
        shifted = learned and est.shifted and not obs.mixed
        if shifted:
            state = replace(state, vetoed=None, vetoed_at=-1, vetoes=0)
        if self.pipeline is not None or self.checker is not None:  # the batches a play replays (a mixed step's too)
            trace = state.estimates.trace if state.estimates is not None else ()
            keep = cfg.consecutive_signals if shifted else cfg.pipeline_trace_steps
            trace = (trace + (obs.workload,))[-keep:] if obs.workload is not None else ()
            # the pipeline predictor plays at every step: its batches extrapolated once here; the check (rule 9) only
            # when a move is proposed: extrapolated then (_replayed)
            est = replace(est, trace=trace, play=self._replayed(trace) if self.pipeline is not None else ())
        if est.observations == 0:
            return replace(state, estimates=est), Decision(ResizeAction.HOLD, cur, "no clean step measured yet")
        state = replace(self._observe(state, obs), estimates=est, steps_since_resize=state.steps_since_resize + 1)
        imb, direction = self._imbalance(est, cur)

        def hold(reason: str, st: PolicyState) -> tuple[PolicyState, Decision]:
            return st, Decision(ResizeAction.HOLD, cur, reason, imbalance=imb)

        if not cfg.enabled:
            return hold("disabled", state)
        if state.cooldown_left > 0:
            return hold(f"cooldown ({state.cooldown_left} left)", replace(state, cooldown_left=state.cooldown_left - 1, signal_count=0))
        horizon = cfg.payback_horizon_steps if obs.steps_left is None else min(cfg.payback_horizon_steps, obs.steps_left)
        reverted = self._revert(state, est, cur, horizon, obs.step) if horizon > 0 else None
        if reverted is not None:
            return reverted
        threshold = cfg.min_relative_gain if self._piped(est) else cfg.imbalance_threshold  # pipeline: imb is a gain
        if imb <= threshold:
            return hold(f"balanced (imbalance {imb:.3f} <= {threshold})", replace(state, signal_count=0, signal_dir=0))
        count = state.signal_count + 1 if direction == state.signal_dir else 1
        state = replace(state, signal_dir=direction, signal_count=count)
        if count < cfg.consecutive_signals:
            return hold(f"signal {count}/{cfg.consecutive_signals}", state)
        if state.steps_since_resize < cfg.min_dwell_steps:
            return hold(f"dwell ({state.steps_since_resize}/{cfg.min_dwell_steps} steps)", state)

        if horizon <= 0:
            return hold("run ends: no step left to gain on", state)
        pick = self._choose(state, est, cur, horizon, obs.step)
        if isinstance(pick, str):
            return hold(pick, state)
        target, gain_s, cost = pick
        if self.checker is not None and est.trace and 2 * self.checker.play_size(est.trace) <= cfg.play_check_budget:
            # rule 9: the move checked by playing it forward (where two plays fit the budget)
            again = state.vetoes + 1 if state.vetoed == target else 1  # (a resize resets it: the same split then)
            if again > 1 and obs.step - state.vetoed_at < cfg.pipeline_trace_steps * 2 ** (again - 2):
                return hold(f"play check: {target} played no faster at step {state.vetoed_at} (played again once the "
                            f"batches replayed have turned over, each time twice as late)", state)
            checked = self._check_by_play(state, est, cur, target, horizon, obs.step)
            if isinstance(checked, str):
                return hold(checked, replace(state, vetoed=target, vetoed_at=obs.step, vetoes=again))
            target, gain_s, cost, now = checked
        else:
            now = self._period(est, cur)
        saving = gain_s * horizon
        gain = gain_s / now if now > 0 else 0.0
        if gain < cfg.min_relative_gain:
            return hold(f"gain {gain:.3f} < min_relative_gain {cfg.min_relative_gain}", state)
        if cfg.payback_check and saving <= cost * cfg.payback_margin:
            return hold(f"payback: saving {saving:.1f}s over {horizon} steps <= cost {cost:.1f}s x {cfg.payback_margin}", state)
        reason = f"{'rollout' if direction > 0 else 'train'}-bound, imbalance {imb:.3f}: {cur} -> {target}"
        return self._resize(state, est, cur, target, reason, cost, imb, saving, obs.step)

    # --- helpers (pure) -------------------------------------------------------------------------------------------
    def _piped(self, est: Estimates) -> bool:
        """Whether the pipeline predictor is in use for these estimates (configured, and batches observed)."""
        return self.pipeline is not None and bool(est.trace)

    def _period(self, est: Estimates, topo: Topology) -> float:
        """The predicted period of ``topo``: the pipeline predictor's where in use, else the capacity model's."""
        if self._piped(est):
            return self.pipeline.period_s(est.play or est.trace, topo)
        return self.model.period_s(est, topo)

    def _window(self, est: Estimates, cur: Topology, cands: Sequence[Topology]) -> list[Topology]:
        """The candidates the pipeline predictor plays: within ``pipeline_window`` units of the current split or of
        the capacity model's best (0: all)."""
        w = self.cfg.pipeline_window
        if w <= 0 or not cands:
            return list(cands)
        cap = self.model.periods(est, np.array([c.n_rollout for c in cands]), np.array([c.n_train for c in cands]))
        best = cands[int(np.argmin(cap))]
        lim = w * self._unit
        return [c for c in cands if min(abs(c.n_train - cur.n_train), abs(c.n_train - best.n_train)) <= lim]

    def _imbalance(self, est: Estimates, cur: Topology) -> tuple[float, int]:
        """Capacity model: (|rollout - train| / max, +1 if rollout is slower). Pipeline predictor: the predicted
        relative gain of the best candidate, +1 if it has more rollout GPUs than ``cur``."""
        if not self._piped(est):
            return self.model.imbalance(est, cur)
        cands = self._window(est, cur, [c for c in self.candidates if c != cur and c.total == cur.total])
        now = self._period(est, cur)
        if not cands or now <= 0:
            return 0.0, 0
        per = [self._period(est, c) for c in cands]
        i = int(np.argmin(per))
        gain = (now - per[i]) / now
        return (max(0.0, gain), 1 if cands[i].n_rollout > cur.n_rollout else -1) if gain > 0 else (0.0, 0)

    def _observe(self, state: PolicyState, obs: Observation) -> PolicyState:
        """Track how far off the model is on the current split: measured period / the period it predicted before
        seeing this step (a running mean over the clean steps, the newest 10 weighing most)."""
        if obs.mixed or state.estimates is None or state.estimates.observations == 0:
            return state
        pred = self._period(state.estimates, obs.topology)
        if pred <= 0:
            return state
        x = obs.period_s / pred
        n = state.here_steps + 1
        if state.here_ratio is None:
            return replace(state, here_ratio=x, here_ratio_var=0.0, here_steps=n)
        a = max(1.0 / n, 0.1)
        d = x - state.here_ratio
        return replace(state, here_ratio=state.here_ratio + a * d, here_ratio_var=(1 - a) * (state.here_ratio_var + a * d * d),
                       here_steps=n)

    def _memory(self, left: tuple[LeftSplit, ...], est: Estimates) -> dict[Topology, tuple[float, LeftSplit, bool]]:
        """Splits left whose memory is still valid -> (their period as measured, carried to now; the memory; whether
        it was carried by the workload's size).

        While the model's prediction for the split stays within ``memory_tolerance`` of the one when it was left,
        that prediction corrected by the model's error there. Once the model has moved (it re-learned its estimates on
        another split: the capacity model's rollout work differs from split to split where decode waves differ) but
        the workload has not (its size, ``Estimates.level``, within the tolerance of the one then), the period
        measured there, scaled by the workload's size since. Expired when both have moved."""
        tol = self.cfg.memory_tolerance
        out: dict[Topology, tuple[float, LeftSplit, bool]] = {}
        if tol <= 0:
            return out
        for m in left:
            if m.steps < MEMORY_MIN_STEPS or m.predicted_s <= 0:
                continue
            pred = self._period(est, m.topology)
            if abs(pred / m.predicted_s - 1.0) <= tol:
                out[m.topology] = (pred * m.ratio, m, False)
            elif m.level > 0 and est.level > 0 and abs(est.level / m.level - 1.0) <= tol:
                out[m.topology] = (m.predicted_s * m.ratio * est.level / m.level, m, True)
        return out

    def _noise(self, est: Estimates, now_fn, per_fn) -> np.ndarray | float:
        """Standard error of the predicted per-step gain now - period(candidate), from the estimates' noise."""
        ta, a = self.model.tail_alpha, self.cfg.ewma_alpha
        se_tail = math.sqrt(max(0.0, est.tail_var) * ta / (2 - ta))
        se_train = math.sqrt(max(0.0, est.train_var) * a / (2 - a))
        total = 0.0
        if se_tail > 0:
            hi, lo = est.rollout_tail + se_tail, max(0.0, est.rollout_tail - se_tail)
            total = total + ((now_fn(tail=hi) - per_fn(tail=hi)) - (now_fn(tail=lo) - per_fn(tail=lo))) ** 2 / 4
        if se_train > 0:
            e_hi, e_lo = replace(est, train_work=est.train_work * (1 + se_train)), replace(est, train_work=est.train_work * max(0.0, 1 - se_train))
            total = total + ((now_fn(est=e_hi) - per_fn(est=e_hi)) - (now_fn(est=e_lo) - per_fn(est=e_lo))) ** 2 / 4
        return np.sqrt(total)

    @staticmethod
    def _played_noise(pp: PipelinePredictor, play: tuple, cur: Topology, cands: Sequence[Topology]) -> np.ndarray:
        """Standard error of the played gain per step, from its spread over the replayed batches ``play`` (paired
        steps)."""
        d = ResizePolicy._played_gains(pp, play, cur, cands)
        n = d.shape[1]
        if n < 2:
            return np.full(len(cands), np.inf)  # one batch: no spread to judge a gain by
        e = d - d.mean(axis=1, keepdims=True)
        var = (e * e).sum(axis=1) / (n - 1)
        # Student's t over n - 1 degrees of freedom, as a multiple of the normal's: the spread of a few batches is
        # itself uncertain (2 batches: x 6.5, 4: x 1.6, 8: x 1.2)
        return np.sqrt(var / n) * (_T975[min(n - 1, len(_T975) - 1)] / 1.96)

    @staticmethod
    def _played_gains(pp: PipelinePredictor, play: tuple, cur: Topology, cands: Sequence[Topology]) -> np.ndarray:
        """The played gain of each of ``cands`` over ``cur`` on each distinct replayed batch (paired steps: step i
        replays the same batch on both splits; a short trace is cycled), one row per candidate."""
        n = min(len(play), len(pp.step_times(play, cur)))
        now = np.array(pp.step_times(play, cur)[:n])
        return now[None, :] - np.array([pp.step_times(play, c)[:n] for c in cands]).reshape(len(cands), n)

    @staticmethod
    def _played_median(pp: PipelinePredictor, play: tuple, cur: Topology, cands: Sequence[Topology]) -> np.ndarray:
        """The median over the replayed batches of the played gain per step (paired steps), per candidate."""
        return np.median(ResizePolicy._played_gains(pp, play, cur, cands), axis=1)

    def _capacity_fns(self, est: Estimates, cur: Topology, cands: Sequence[Topology]):
        """The capacity model's period of ``cur`` and of each of ``cands``, as functions of the estimates and the tail
        (for :meth:`_noise`'s sensitivities)."""
        m = self.model
        nr, nt = np.array([c.n_rollout for c in cands]), np.array([c.n_train for c in cands])
        cr, ct = np.array([cur.n_rollout]), np.array([cur.n_train])

        def now_fn(est=est, tail=None):
            return m.periods(est, cr, ct, tail)[0]

        def per_fn(est=est, tail=None):
            return m.periods(est, nr, nt, tail)

        return now_fn, per_fn

    def _capacity_sure(self, est: Estimates, cap_gain: np.ndarray, z: float, now_fn, per_fn) -> np.ndarray:
        """Where the capacity model's own gain passes its noise test (``pipeline_noise: agree`` and the check's
        first move: a few batches cannot show a gain of a few % beyond their spread)."""
        return (cap_gain > 0) & _beyond(cap_gain, z, self._noise(est, now_fn, per_fn))

    def _floored(self, state: PolicyState, est: Estimates, cands: Sequence[Topology], per: np.ndarray) -> np.ndarray:
        """``per`` with each split left never predicted faster than it was measured there (rule 6's memory)."""
        memory = self._memory(state.left, est)
        for i, c in enumerate(cands):
            if c in memory:
                per[i] = max(per[i], memory[c][0])
        return per

    def _net(self, cur: Topology, cands: Sequence[Topology], ok: np.ndarray, gain: np.ndarray,
             horizon: int) -> tuple[np.ndarray, np.ndarray]:
        """The switch cost of each split passing (``ok``) and its net gain over ``horizon`` (-inf where not)."""
        costs = np.array([self.costs.critical_cost_s(cur, c) if ok[i] else 0.0 for i, c in enumerate(cands)])
        return costs, np.where(ok, gain * horizon - (costs if self.cfg.payback_check else 0.0), -np.inf)

    def _z(self, state: PolicyState, step: int) -> float:
        """noise_z, raised by the back-off: (1 + resizes in the last backoff_steps steps) x noise_z."""
        cfg = self.cfg
        recent = sum(1 for k in state.resized_at if step - k <= cfg.backoff_steps) if cfg.backoff_steps > 0 else 0
        return cfg.noise_z * (1 + recent)

    def _choose(self, state: PolicyState, est: Estimates, cur: Topology, horizon: int, step: int) -> tuple[Topology, float, float] | str:
        cfg = self.cfg
        cands = [c for c in self.candidates if c != cur and c.total == cur.total]
        if self._piped(est):
            cands = self._window(est, cur, cands)
        if not cands:
            return "no faster split predicted"
        nt = np.array([c.n_train for c in cands])
        now_fn, per_fn = self._capacity_fns(est, cur, cands)
        now, per = now_fn(), per_fn()
        cap_gain = now - per  # the capacity model's
        if self._piped(est):  # the pipeline's periods
            now, per = self._period(est, cur), np.array([self._period(est, c) for c in cands])
        gain = now - self._floored(state, est, cands, per)
        ok = gain > 0
        if cfg.noise_z > 0 and ok.any():
            z = self._z(state, step)
            if self._piped(est):  # the played gain's own spread: step i replays the same batch on both splits
                played = self._played_noise(self.pipeline, est.play or est.trace, cur, cands)
                if cfg.pipeline_noise == "max":  # and the capacity model's sensitivity to its estimates
                    ok &= _beyond(gain, z, np.maximum(played, self._noise(est, now_fn, per_fn)))
                elif cfg.pipeline_noise == "agree" and not state.resized_at:
                    # or, on the way from the configured start split (no resize yet), the capacity model passes its own
                    # test for the same split (a few batches cannot show a gain of a few % beyond their spread)
                    ok &= _beyond(gain, z, played) | self._capacity_sure(est, cap_gain, z, now_fn, per_fn)
                else:
                    ok &= _beyond(gain, z, played)
            else:
                ok &= _beyond(gain, z, self._noise(est, now_fn, per_fn))
        if not ok.any():
            return "no faster split predicted" if not (gain > 0).any() else "predicted gains within the noise"
        costs, net = self._net(cur, cands, ok, gain, horizon)
        best = int(np.argmax(net))  # ties: the first, i.e. the fewest trainers (candidates are sorted)
        elig = np.flatnonzero(ok & (gain >= cfg.near_best_fraction * gain[best]) & (net >= 0 if cfg.payback_check else ok))
        if len(elig) == 0:
            elig = np.array([best])
        dist = np.abs(nt[elig] - cur.n_train)
        i = int(elig[np.lexsort((-gain[elig], dist))[0]])
        return cands[i], float(gain[i]), float(costs[i])

    def _replayed(self, trace: tuple) -> tuple:
        """The batches a play replays: the recent ones as the run will be ``pipeline_lead_steps`` batches on."""
        lead = self.cfg.pipeline_lead_steps
        return trace if lead is None else extrapolate(trace, lead, self.cfg.pipeline_trend_z)

    def _check_by_play(self, state: PolicyState, est: Estimates, cur: Topology, target: Topology, horizon: int,
                       step: int) -> tuple[Topology, float, float, float] | str:
        """Rule 9: the move to ``target`` the capacity model chose, checked by playing the barrier-free pipeline forward
        on the run's recent batches (the pipeline predictor's play, :mod:`dynaresize.policy.pipeline_predictor`):
        ``cur`` and the splits within ``pipeline_window`` units of ``target`` are played (the nearest to ``target``
        first, as many as ``play_check_budget`` sequences decoded allow; ``target`` always: the caller checks only
        where the two plays fit). ``target`` must play faster
        than ``cur``, and either on the median batch replayed too or by more than ``DISSENT_Z`` standard errors of the
        played gain: a gain a few long batches carry while most play slower is often the window's luck on a stationary
        workload, which the capacity model that proposed the move (on the same recent batches) cannot tell apart;
        another split must play faster beyond the played gain's spread over the batches (``noise_z``, the
        back-off's), or, on the first move, pass the capacity model's own noise test for it (a few batches cannot show
        a gain of a few % beyond their spread); each by ``min_relative_gain`` at least and never faster than measured
        where it was left (rule 6's memory). The largest net gain wins (returned with the played period of ``cur``);
        hold if none passes. Plays only when a move is proposed; a move held is played again once the batches
        replayed have turned over (``pipeline_trace_steps``), then after twice as many steps each time it is held
        again (``PolicyState.vetoed``)."""
        cfg, pp = self.cfg, self.checker
        play = self._replayed(est.trace)
        lim = cfg.pipeline_window * self._unit if cfg.pipeline_window > 0 else math.inf
        cands = [c for c in self.candidates if c != cur and c.total == cur.total and abs(c.n_train - target.n_train) <= lim]
        room = cfg.play_check_budget // max(1, pp.play_size(play)) - 1  # plays besides cur's (>= 1: step's test)
        if len(cands) > room:  # the proposed split, then the nearest to it while the budget lasts
            keep = set(sorted(cands, key=lambda c: (abs(c.n_train - target.n_train), c.n_train))[:room])
            cands = [c for c in cands if c in keep]
        now = pp.period_s(play, cur)
        gain = now - self._floored(state, est, cands, np.array([pp.period_s(play, c) for c in cands]))
        z = self._z(state, step)
        noise = self._played_noise(pp, play, cur, cands)
        sure = _beyond(gain, z, noise)
        if not state.resized_at:
            now_fn, per_fn = self._capacity_fns(est, cur, cands)
            sure |= self._capacity_sure(est, now_fn() - per_fn(), z, now_fn, per_fn)
        proposed = np.array([c == target for c in cands])
        # the proposed split: faster on the mean, and on the median batch or else beyond DISSENT_Z standard errors (a
        # gain a few long batches carry while most play slower must stand out of the spread)
        z_dissent = DISSENT_Z if cfg.noise_z > 0 else 0.0  # (noise_z = 0: the noise tests off)
        backed = (self._played_median(pp, play, cur, cands) > 0) | _beyond(gain, z_dissent, noise)
        faster = (gain > 0) & (gain >= cfg.min_relative_gain * now)
        ok = (sure | (proposed & backed)) & faster
        if not ok.any():
            i = cands.index(target)
            if faster[i] and not backed[i]:
                return (f"play check: {target} plays faster than {cur} only on a few of the batches replayed (slower on "
                        f"the median one, and within {z_dissent:g} standard error of the mean), nor a split near it "
                        f"beyond the noise")
            return f"play check: {target} does not play faster than {cur} (nor a split near it beyond the noise)"
        costs, net = self._net(cur, cands, ok, gain, horizon)
        best = int(np.argmax(net))
        return cands[best], float(gain[best]), float(costs[best]), now

    def _revert(self, state: PolicyState, est: Estimates, cur: Topology, horizon: int, step: int) -> tuple[PolicyState, Decision] | None:
        """Prediction-error guard: within payback_horizon_steps of a move, go back to the split just left when, each
        corrected by the model's measured error there, it is faster than this one by more than the noise (and
        min_relative_gain): the move did not deliver."""
        cfg = self.cfg
        if not state.left or state.here_ratio is None or not max(MEMORY_MIN_STEPS, cfg.min_dwell_steps) <= state.here_steps <= cfg.payback_horizon_steps:
            return None  # a guard for the move just made: judged on its first steps, then the normal rules apply
        last = state.left[-1]
        mem = self._memory((last,), est).get(last.topology)
        if mem is None or last.topology.total != cur.total:
            return None
        then, m, by_level = mem
        here = self._period(est, cur) * state.here_ratio
        floor = max(0.0, est.tail_var) / here ** 2 if here > 0 else 0.0  # a few steps do not show the noise: the tail's
        var = max(state.here_ratio_var, floor) / state.here_steps + max(m.ratio_var, floor) / m.steps
        if by_level:  # carried by the workload's size: the level now and then, each an EWMA of noisy step sizes
            na = self.cfg.noise_alpha
            var += 2 * max(0.0, est.level_var) * na / (2 - na)
        noise = here * math.sqrt(var)
        gain_s = here - then
        if gain_s <= max(self._z(state, step) * noise, cfg.min_relative_gain * here, 0.0):
            return None
        cost = self.costs.critical_cost_s(cur, last.topology)
        saving = gain_s * horizon
        if cfg.payback_check and saving <= cost * cfg.payback_margin:
            return None
        reason = f"revert: {last.topology} measures {then:.1f}s/step < {here:.1f}s/step here ({cur})"
        return self._resize(state, est, cur, last.topology, reason, cost, 0.0, saving, step)

    def _resize(self, state: PolicyState, est: Estimates, cur: Topology, target: Topology, reason: str, cost: float,
                imb: float, saving: float, step: int) -> tuple[PolicyState, Decision]:
        left = tuple(x for x in state.left if x.topology not in (cur, target))
        if state.here_ratio is not None and state.here_steps > 0:
            left = left + (LeftSplit(cur, state.here_ratio, state.here_ratio_var, self._period(est, cur), state.here_steps, est.level),)
        new_state = replace(
            state, signal_count=0, signal_dir=0, steps_since_resize=0, cooldown_left=self.cfg.cooldown_steps,
            history=(state.history + (str(cur),))[-8:], here_ratio=None, here_ratio_var=0.0, here_steps=0, left=left[-4:],
            resized_at=(state.resized_at + (step,))[-4:], vetoed=None, vetoed_at=-1, vetoes=0,
        )
        plan = self.costs.plan(cur, target)
        return new_state, Decision(ResizeAction.RESIZE, target, reason, plan, cost, imb, saving)


def greedy_config(cfg: PolicyConfig) -> PolicyConfig:
    """The no-hysteresis baseline: act on every imbalance at once, ignore switch costs."""
    return cfg.model_copy(update=dict(
        imbalance_threshold=0.0, consecutive_signals=1, min_dwell_steps=0, cooldown_steps=0, payback_check=False,
        min_relative_gain=0.0, noise_z=0.0, near_best_fraction=1.0, memory_tolerance=0.0, backoff_steps=0,
        play_check=False,
    ))
