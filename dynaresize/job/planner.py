"""What split to run: the resizing policy over the splits still possible (the trainer set is a prefix without a
lost rank, at least one rank rolls out), fed the last step's measurements; ``policy.forced_splits`` overrides it."""

from __future__ import annotations

import logging

from dynaresize.events import format_ranks
from dynaresize.job.runtime import Job
from dynaresize.job.state import policy_from_dict, policy_to_dict

log = logging.getLogger("dynaresize.job")


class Planner:
    def __init__(self, job: Job):
        self.job = job
        self.reset()

    def reset(self) -> None:
        """The policy over the live ranks, in the state the job's state records."""
        self.rebuild()
        self.pstate = policy_from_dict(self.job.state.policy) or self.policy.initial_state()

    def valid_counts(self, lost=None) -> list[int]:
        """Trainer counts possible now: the trainer set is a prefix (its pre-built group must not hold a lost
        rank) and at least one live rank is left to roll out."""
        from dynaresize.comm.groups import candidate_trainer_counts, unit_from_cluster

        world = self.job.world
        lost = set(self.job.state.lost if lost is None else lost)
        cap = min(lost) if lost else world
        n_alive = world - len(lost)
        return [t for t in candidate_trainer_counts(world, unit_from_cluster(self.job.cfg.cluster)) if t <= cap and n_alive - t >= 1]

    def rebuild(self) -> None:
        """The policy plans over the live ranks only: after a shrink its candidates are the splits still possible."""
        from dynaresize.emulation.model import switch_cost_model
        from dynaresize.policy import ResizePolicy, Topology

        cfg = self.job.cfg
        n_alive = len(self.job.alive())
        cands = [Topology(t, n_alive - t) for t in self.valid_counts()]
        self.policy = ResizePolicy(cfg.policy, switch_cost_model(cfg), cands)  # emulated: in its wall seconds

    def observation(self, k: int):
        from dynaresize.policy import Observation, Topology

        last = self.job.last
        return Observation(
            step=k - 1, topology=Topology(self.job.state.n_train, len(self.job.rollouts())),
            rollout_s=last.rollout_s, train_s=last.train_s, weight_sync_s=last.sync_s,
            tokens_generated=last.tokens_generated, tokens_trained=last.tokens_trained,
            mixed=self.job.switched_last,
        )

    def decide(self, k: int):
        """Feed the last step's measurements to the policy; ``None`` before anything was measured.

        ``policy.forced_splits`` (tests, experiments) replaces the policy's answer at the steps it names."""
        from dynaresize.policy import Action, Decision, Topology

        job, st = self.job, self.job.state
        n_alive = len(job.alive())
        forced, why = job.cfg.policy.forced_splits.get(k), "forced by policy.forced_splits"
        if forced is not None and forced not in self.valid_counts():
            log.warning("step %d: forced split %d trainers is not possible with rank(s) %s lost; ignored", k, forced,
                        format_ranks(st.lost))
            forced = None
        if not job.rollouts():  # lost ranks took every rollout rank: trainers must move
            forced, why = max(self.valid_counts()), f"rank(s) {format_ranks(st.lost)} lost: no rollout rank left"
        if forced is not None and forced != st.n_train:
            d = Decision(Action.RESIZE, Topology(forced, n_alive - forced), why)
            job.events.emit("decision", step=k, action=d.action.value, reason=d.reason, target_train=forced,
                            target_rollout=n_alive - forced)
            return d
        if k == 0 or job.last.train_s <= 0 or not job.cfg.policy.enabled:
            return None
        self.pstate, d = self.policy.step(self.pstate, self.observation(k))
        st.policy = policy_to_dict(self.pstate)
        job.events.emit(
            "decision", step=k, action=d.action.value, reason=d.reason, imbalance=round(d.imbalance, 4),
            target_train=d.target.n_train, target_rollout=d.target.n_rollout,
            expected_saving_s=round(d.expected_saving_s, 4), cost_s=round(d.critical_cost_s, 4),
        )
        return d

    def mixed_ok(self, decision) -> bool:
        """A move from training to rollout can happen inside the step (the mixed step) when a rollout runs beside
        training: the leaving trainers train batch k, then join the rollout of batch k+s, with the weights that
        batch is generated from (kept before the update), so the sample-to-version map is the static run's."""
        return (self.job.cfg.pipeline.mixed_switch and self.job.bound > 0 and decision.target.n_train < self.job.state.n_train
                and bool(self.job.rollouts()))  # with no rollout rank left, no rollout runs beside training
