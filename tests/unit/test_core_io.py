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
    s, d = p.step(PolicyState(), obs(1))  # after T_1: the split that trains batch 2
    assert d.resize and d.target == Topology(1, 3) and d.reason == "forced by policy.forced_splits"
    assert s.forced_step == 2
    _, d = p.step(s, obs(2))  # no forced split for step 3 and the policy is off
    assert not d.resize and d.target == Topology(2, 2)
    s, d = p.step(PolicyState(), obs(1, n_train=1))  # already there
    assert not d.resize and s.forced_step == 2


def test_a_forced_split_due_while_a_switch_was_in_flight_comes_late_not_never():
    p = PlannedPolicy(Always(), {2: 1, 4: 3, 5: 2}, enabled=False)
    s, d = p.step(PolicyState(), obs(0))
    assert not d.resize and s.forced_step == -1
    # after T_1 a switch was in flight: the core asked nothing. After T_2 the split due at step 2 comes, late
    s, d = p.step(s, obs(2))
    assert d.resize and d.target == Topology(1, 3) and d.reason == "forced by policy.forced_splits (due at step 2)"
    s, d = p.step(s, obs(3, n_train=1))  # step 4's split
    assert d.target == Topology(3, 1) and s.forced_step == 4
    # two came due unasked (4 and 5): the newest one wins, once
    s, d = p.step(PolicyState(forced_step=2), obs(5, n_train=1))
    assert d.target == Topology(2, 2) and s.forced_step == 5
    s, d = p.step(s, obs(6, n_train=1))
    assert not d.resize
    # with the policy on, it decides between forced splits and keeps the forced step in its state
    q = PlannedPolicy(Always(), {2: 1}, enabled=True)
    s, d = q.step(PolicyState(forced_step=2), obs(3, n_train=1))
    assert d.reason == "always 3" and s.forced_step == 2


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


def test_the_policys_state_survives_a_checkpoint_whole_but_its_batches():
    import json

    from dynaresize.job.state import policy_from_dict, policy_to_dict
    from dynaresize.policy.types import Estimates, LeftSplit, PipelineWorkload

    wl = PipelineWorkload((3.0, 5.0), 2, 4, 0.01, 0.001, 0.002, (1.0,))
    est = Estimates(10.0, 1.5, 20.0, 0.3, tail_var=0.2, train_var=0.01, observations=7, trace=(wl, wl))
    st = PolicyState(estimates=est, signal_dir=-1, signal_count=2, steps_since_resize=5, cooldown_left=1,
                     history=("2:2",), here_ratio=1.07, here_ratio_var=0.002, here_steps=4,
                     left=(LeftSplit(Topology(2, 2), 0.98, 0.001, 12.5, 6),), resized_at=(3, 9), forced_step=4)
    d = json.loads(json.dumps(policy_to_dict(st)))
    assert "trace" not in d["estimates"] and "play" not in d["estimates"]  # no response lengths in coordinator.json
    back = policy_from_dict(d)
    assert back == PolicyState(**{**{f: getattr(st, f) for f in st.__dataclass_fields__},
                                  "estimates": Estimates(10.0, 1.5, 20.0, 0.3, 0.2, 0.01, 7)})
    assert policy_from_dict(json.loads(json.dumps(policy_to_dict(PolicyState())))) == PolicyState()
