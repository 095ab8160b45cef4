"""What splits are possible: the resizing policy over the splits still possible (the trainer set is a prefix without
a lost rank, at least one rank rolls out, its trainers fit in GPU memory: docs/memory.md), rebuilt after a shrink, and its state; the scheduler core consults it
(``dynaresize.job.core_io.PlannedPolicy``, which also applies ``policy.forced_splits``)."""

from __future__ import annotations

from dynaresize.job.runtime import Job
from dynaresize.job.state import policy_from_dict


class Planner:
    def __init__(self, job: Job):
        self.job = job
        from dynaresize.config.memory import feasible_trainer_counts

        self.fits = feasible_trainer_counts(job.cfg)  # trainer counts the memory model admits (None: all)
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
        return [t for t in candidate_trainer_counts(world, unit_from_cluster(self.job.cfg.cluster))
                if t <= cap and n_alive - t >= 1 and (self.fits is None or t in self.fits)]

    def rebuild(self) -> None:
        """The policy plans over the live ranks only: after a shrink its candidates are the splits still possible."""
        from dynaresize.emulation.model import switch_cost_model
        from dynaresize.policy import ResizePolicy, Topology

        cfg = self.job.cfg
        n_alive = len(self.job.alive())
        cands = [Topology(t, n_alive - t) for t in self.valid_counts()]
        self.policy = ResizePolicy(cfg.policy, switch_cost_model(cfg), cands)  # emulated: in its wall seconds
