"""The resizing policy: a pure function of (state, observation) -> (state, decision).

Used unchanged by the simulator and by the runtime coordinator::

    policy = ResizePolicy(cfg.policy, SwitchCostModel(costs, opts), candidates)
    state = policy.initial_state()
    state, decision = policy.step(state, observation)   # pure
    # or, keeping the state inside: decision = policy.decide(observation)

Rules, applied in this order after the stage-time estimates are updated (worked example in the unit tests):

1. **cooldown**: for ``cooldown_steps`` steps after a resize, signals are ignored (the stages are settling).
2. **imbalance threshold**: a step signals only if |rollout - train| / max > ``imbalance_threshold``.
3. **consecutive signals**: ``consecutive_signals`` signals in a row, in the same direction, are required.
4. **minimum dwell**: a topology is kept at least ``min_dwell_steps`` steps.
5. **best split**: the candidate with the largest net gain horizon x saving - cost; hold if none beats the current.
6. **minimum gain**: the predicted step time must drop by at least ``min_relative_gain`` (noise guard; 0: off).
7. **payback**: horizon x saving per step must exceed switch cost x ``payback_margin``.

No I/O, clock or randomness: the same observations always give the same decisions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from dynaresize.policy.config import PolicyConfig
from dynaresize.policy.costs import SwitchCostModel
from dynaresize.policy.predictor import StageModel
from dynaresize.policy.types import Action, Decision, Observation, PolicyState, Topology


class ResizePolicy:
    def __init__(self, cfg: PolicyConfig, costs: SwitchCostModel, candidates: Sequence[Topology]):
        if not candidates:
            raise ValueError("ResizePolicy needs at least one candidate topology")
        self.cfg = cfg
        self.costs = costs
        self.candidates = tuple(candidates)
        self.model = StageModel(cfg.ewma_alpha, cfg.train_scaling_per_doubling)
        self._state = self.initial_state()

    def initial_state(self) -> PolicyState:
        return PolicyState()

    def decide(self, obs: Observation) -> Decision:
        """Stateful convenience wrapper around :meth:`step`."""
        self._state, decision = self.step(self._state, obs)
        return decision

    def step(self, state: PolicyState, obs: Observation) -> tuple[PolicyState, Decision]:
        cfg, cur = self.cfg, obs.topology
        est = state.estimates if obs.mixed and state.estimates else self.model.update(state.estimates, obs)
        state = replace(state, estimates=est, steps_since_resize=state.steps_since_resize + 1)
        imb, direction = self.model.imbalance(est, cur)

        def hold(reason: str, st: PolicyState) -> tuple[PolicyState, Decision]:
            return st, Decision(Action.HOLD, cur, reason, imbalance=imb)

        if not cfg.enabled:
            return hold("disabled", state)
        if state.cooldown_left > 0:
            return hold(f"cooldown ({state.cooldown_left} left)", replace(state, cooldown_left=state.cooldown_left - 1, signal_count=0))
        if imb <= cfg.imbalance_threshold:
            return hold(f"balanced (imbalance {imb:.3f} <= {cfg.imbalance_threshold})", replace(state, signal_count=0, signal_dir=0))
        count = state.signal_count + 1 if direction == state.signal_dir else 1
        state = replace(state, signal_dir=direction, signal_count=count)
        if count < cfg.consecutive_signals:
            return hold(f"signal {count}/{cfg.consecutive_signals}", state)
        if state.steps_since_resize < cfg.min_dwell_steps:
            return hold(f"dwell ({state.steps_since_resize}/{cfg.min_dwell_steps} steps)", state)

        now = self.model.period_s(est, cur)
        best: tuple[float, Topology, float, float] | None = None  # (net, topo, saving over horizon, cost)
        for cand in self.candidates:
            if cand == cur or cand.total != cur.total:
                continue
            saving = (now - self.model.period_s(est, cand)) * cfg.payback_horizon_steps
            if saving <= 0:
                continue
            cost = self.costs.critical_cost_s(cur, cand)
            net = saving - (cost if cfg.payback_check else 0.0)
            if best is None or net > best[0] or (net == best[0] and cand < best[1]):
                best = (net, cand, saving, cost)
        if best is None:
            return hold("no faster split predicted", state)
        _, target, saving, cost = best
        gain = saving / cfg.payback_horizon_steps / now if now > 0 else 0.0
        if gain < cfg.min_relative_gain:
            return hold(f"gain {gain:.3f} < min_relative_gain {cfg.min_relative_gain}", state)
        if cfg.payback_check and saving <= cost * cfg.payback_margin:
            return hold(f"payback: saving {saving:.1f}s over {cfg.payback_horizon_steps} steps <= cost {cost:.1f}s x {cfg.payback_margin}", state)
        plan = self.costs.plan(cur, target)
        new_state = replace(
            state, signal_count=0, signal_dir=0, steps_since_resize=0, cooldown_left=cfg.cooldown_steps,
            history=(state.history + (str(cur),))[-8:],
        )
        reason = f"{'rollout' if direction > 0 else 'train'}-bound, imbalance {imb:.3f}: {cur} -> {target}"
        return new_state, Decision(Action.RESIZE, target, reason, plan, cost, imb, saving)


def greedy_config(cfg: PolicyConfig) -> PolicyConfig:
    """The no-hysteresis baseline: act on every imbalance at once, ignore switch costs."""
    return cfg.model_copy(update=dict(
        imbalance_threshold=0.0, consecutive_signals=1, min_dwell_steps=0, cooldown_steps=0, payback_check=False,
        min_relative_gain=0.0,
    ))
