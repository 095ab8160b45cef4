"""What the coordinator gives the scheduler core: the policy it consults (forced splits first) and the config."""

from __future__ import annotations

import pytest

from dynaresize.config.loader import load_config
from dynaresize.job.core_io import PlannedPolicy, scheduler_config
from dynaresize.policy import Topology
from dynaresize.policy.types import Decision, Observation, PolicyState, ResizeAction

pytestmark = pytest.mark.unit


class Always:
    """A fake resize policy with the real interface: always asks for 3 trainers."""

    def initial_state(self) -> PolicyState:
        return PolicyState()

    def step(self, state, obs):
        return state, Decision(ResizeAction.RESIZE, Topology(3, obs.topology.total - 3), "always 3")


def obs(step: int, n_train: int = 2, train_s: float = 1.0) -> Observation:
    return Observation(step=step, topology=Topology(n_train, 4 - n_train), rollout_s=1.0, train_s=train_s)


def test_a_forced_split_answers_the_consultation_after_the_step_before_it():
    p = PlannedPolicy(Always(), {2: 1}, enabled=False)
    _, d = p.step(PolicyState(), obs(1))  # after T_1: the split that trains batch 2
    assert d.resize and d.target == Topology(1, 3) and "forced" in d.reason
    _, d = p.step(PolicyState(), obs(2))  # no forced split for step 3 and the policy is off
    assert not d.resize and d.target == Topology(2, 2)
    _, d = p.step(PolicyState(), obs(1, n_train=1))  # already there
    assert not d.resize


def test_the_policy_decides_when_enabled_and_something_was_measured():
    p = PlannedPolicy(Always(), {}, enabled=True)
    assert p.step(PolicyState(), obs(0))[1].target == Topology(3, 1)
    assert not p.step(PolicyState(), obs(0, train_s=0.0))[1].resize


def test_the_cores_config_follows_the_run():
    cfg = load_config("configs/quickstart.yaml", ["pipeline.schedule=continuous", "task.dataset.val_every=0",
                                                   "run.steps=5", "pipeline.streaming_training=false"])
    c = scheduler_config(cfg, n_train=2, resume_step=3)
    assert c.groups == (cfg.rollout.prompts_per_step,) * 5 and c.n_ranks == cfg.cluster.gpus and c.resume_step == 3
    assert c.mechanisms.continuous_rollout and not c.mechanisms.streaming_training and c.collective_switch
