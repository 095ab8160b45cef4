"""The simulator's own mechanisms (dynaresize/sim/mechanisms.py): the gradient helpers, a subclass of the scheduler
core, checked like the core itself: by hand, and over random event orders by the core's world model
(tests/support/schedule_world.py) with the helpers' contract added (a helper takes no groups and does not switch
while it helps, the step waits for its gradient, a lost helper's groups are trained again, every group trained once).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynaresize.policy.types import Observation
from dynaresize.schedule import (
    Assign, GroupsDone, RankLost, RankReady, Role, ScheduleError, SchedulerConfig, Step, StepMeasured, Switch,
    Train, TrainChunkDone, Validate,
)
from dynaresize.sim.mechanisms import Help, HelpDone, HelperConfig, HelpingScheduler, SimMechanisms
from tests.support.schedule_world import World, check_finished, feature_config, run_at_random, run_world

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FAST = HelperConfig(rate=1.0, cost_s=0.05)  # helpers as fast as a trainer, nearly free: the random worlds reach them


def helping_core(helpers: HelperConfig):
    """``run_world``'s core factory: the helping core with these helpers."""
    return lambda cfg, policy: HelpingScheduler(cfg, helpers, policy)


@dataclass
class HelperWorld(World):
    """The core's world, playing the helpers too."""

    helping: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    helps: int = 0

    def check(self, a) -> None:
        if isinstance(a, (Assign, Validate)):
            assert a.rank not in self.helping, "work for a helping rank"
        elif isinstance(a, Switch):
            assert a.rank not in self.helping, "switched a rank in the middle of its help"
        elif isinstance(a, Step):
            assert not any(b == a.batch for b, _ in self.helping.values()), "step before the helpers' gradients"

    def extra(self, a) -> bool:
        if not isinstance(a, Help):
            return False
        rank, batch, groups = a.rank, a.batch, a.groups
        assert self.core.role(rank) is Role.ROLLOUT and not self.inflight[rank] and rank not in self.lost
        assert batch == self.steps_done, "a helper on another batch than the one in training"
        assert batch in self.held[rank], "a helper without the version the batch trains from"
        for g in groups:
            assert (batch, g) in self.generated
            assert g not in self.trained.setdefault(batch, set()), "group trained twice"
            self.trained[batch].add(g)
        self.helping[rank] = (batch, groups)
        self.helps += 1
        self.pending.append(HelpDone(rank, batch))
        return True

    def busy(self, rank: int) -> bool:
        return rank in self.helping

    def fire(self, ev) -> None:
        if isinstance(ev, HelpDone):
            del self.helping[ev.rank]
        elif isinstance(ev, RankLost):
            helped = self.helping.pop(ev.rank, None)
            if helped is not None:  # its gradient is lost with it
                self.trained[helped[0]] -= set(helped[1])
                self.pending = [p for p in self.pending if not (isinstance(p, HelpDone) and p.rank == ev.rank)]
        super().fire(ev)


def test_an_idle_rollout_rank_holding_the_training_version_helps_the_training():
    cfg = SchedulerConfig(3, 1, (4, 4, 4), mechanisms=SimMechanisms(continuous_rollout=True, gradient_helpers=True))
    core = HelpingScheduler(cfg, HelperConfig(rate=1.0, cost_s=0.1, train_chunks=4))
    core.start()
    core.handle(StepMeasured(Observation(0, core.topology(), 1.0, 4.0), 3, train_gpu_s_per_group=1.0))
    assert core.handle(RankReady(1, 4)) == [Assign(1, 0, (0, 1), 0)]  # an even share each
    assert core.handle(RankReady(2, 4)) == [Assign(2, 0, (2, 3), 0)]
    core.handle(GroupsDone(1, 0, (0, 1)))
    assert core.handle(RankReady(1, 4)) == [Assign(1, 1, (0, 1), 0)]  # batch 1 is version 0 too
    assert core.handle(GroupsDone(2, 0, (2, 3))) == [Train(0, (0,), (0,), True)]  # a micro-chunk of a quarter
    assert core.handle(RankReady(2, 4)) == [Assign(2, 1, (2, 3), 0)]
    core.handle(GroupsDone(2, 1, (2, 3)))
    # rank 2 waits for version 1 (batch 2) and holds version 0, the weights T_0 trains from: it helps, one group
    # (3 left: the trainer alone 3 s; with the helper max(2 s, 1 s + 0.1 s) = 2 s)
    assert core.handle(RankReady(2, 4)) == [Help(2, 0, (3,))]
    assert core.handle(TrainChunkDone(0)) == [Train(0, (1,), (0,), False)]
    assert core.handle(HelpDone(2, 0)) == []  # the trainer is still busy
    assert core.handle(TrainChunkDone(0)) == [Train(0, (2,), (0,), False)]
    assert core.handle(TrainChunkDone(0)) == [Step(0, (0,))]  # every group once: 0, 1, 2 by the trainer, 3 by rank 2
    with pytest.raises(ScheduleError):
        core.handle(HelpDone(2, 0))  # it is not helping any more


def test_a_helper_takes_the_groups_its_share_fits_by_their_reported_tokens():
    """The groups that complete last are the longest: priced at the batch's mean, a helper taking them would end long
    after the trainers. With tokens reported it takes the groups whose own cost fits its share."""
    cfg = SchedulerConfig(3, 1, (4, 4, 4), mechanisms=SimMechanisms(continuous_rollout=True, gradient_helpers=True))
    core = HelpingScheduler(cfg, HelperConfig(rate=1.0, cost_s=0.1, train_chunks=4))
    core.start()
    core.handle(StepMeasured(Observation(0, core.topology(), 1.0, 4.0), 3, train_gpu_s_per_group=1.0,
                             train_gpu_s_per_token=0.25))
    core.handle(RankReady(1, 4))
    core.handle(RankReady(2, 4))
    core.handle(GroupsDone(1, 0, (0, 1), (4, 4)))
    core.handle(RankReady(1, 4))
    assert core.handle(GroupsDone(2, 0, (2, 3), (4, 12))) == [Train(0, (0,), (0,), True)]
    core.handle(RankReady(2, 4))
    core.handle(GroupsDone(2, 1, (2, 3), (4, 4)))
    # ready 1, 2, 3 cost 1, 1 and 3 s: the trainer alone 5 s; the helper's share (5 - 0.1) / 2 = 2.45 s skips group 3
    # (3 s) and takes 2 and 1: max(3 s, 2 s + 0.1 s) = 3 s. At the mean (1 s each) it would take group 3 and end last.
    assert core.handle(RankReady(2, 4)) == [Help(2, 0, (1, 2))]
    assert core.handle(TrainChunkDone(0)) == [Train(0, (3,), (0,), False)]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), stream=st.booleans(), n=st.integers(3, 5), steps=st.integers(2, 5), groups=st.integers(4, 6),
       slots=st.integers(1, 3), losses=st.integers(0, 1), tokens=st.booleans())
def test_gradient_helpers_keep_the_contract(data, stream, n, steps, groups, slots, losses, tokens):
    cfg = SchedulerConfig(n, 1, (groups,) * steps, staleness=1, mechanisms=SimMechanisms(True, stream, False, True))
    w = run_world(cfg, data, slots, losses=losses, tokens=tokens, world=HelperWorld,
                  make_core=helping_core(HelperConfig(rate=1.0, cost_s=0.05, train_chunks=groups)))
    check_finished(w)


MIXES = st.builds(SimMechanisms, st.booleans(), st.booleans(), st.just(True), st.just(True))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MIXES, n=st.integers(3, 6), steps=st.integers(1, 5), s=st.integers(0, 2),
       groups=st.integers(1, 4), slots=st.integers(1, 3), losses=st.integers(0, 1), feature=st.sampled_from(
           ["plain", "resize", "validation", "sampling", "resume"]),
       script=st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_helpers_keep_the_contract_with_every_core_feature(data, mech, n, steps, s, groups, slots, losses, feature, script):
    """What the core's property tests ran with helpers drawn on, before the helpers left the core: any mechanism mix,
    staleness, a resize script, validation passes, dynamic sampling or a resume, and a lost rank."""
    cfg = feature_config(n, steps, groups, s, mech, feature)
    w = run_world(cfg, data, slots, script=script if feature == "resize" else None, losses=losses, world=HelperWorld,
                  make_core=helping_core(FAST))
    check_finished(w)


def test_the_random_worlds_do_exercise_the_helpers():
    """Guard for the property tests above: their random event orders reach helpers (else they check nothing)."""
    helps = {False: 0, True: 0}
    for seed in range(60):
        cfg = SchedulerConfig(4, 1, (5,) * 4, staleness=1, mechanisms=SimMechanisms(True, seed % 2 == 0, False, True))
        tokens = seed % 4 < 2
        world = run_at_random(cfg, seed, make_core=helping_core(HelperConfig(rate=1.0, cost_s=0.05, train_chunks=5)),
                              world=HelperWorld, tokens=tokens)
        helps[tokens] += world.helps
    assert helps[False] > 0 and helps[True] > 0  # priced at the mean and by tokens


def test_the_label_names_the_helpers_and_the_core_mechanisms_stay_the_cores():
    assert SimMechanisms(True, True, True, True).label == "continuous+streaming+helpers"
    assert SimMechanisms(False, False, True).label == "barrier"
    core = HelpingScheduler(SchedulerConfig(3, 1, (2,), mechanisms=SimMechanisms(True, True, True, True)))
    assert core.mech.continuous_rollout and core.helping == {}


def test_the_runtime_never_imports_the_simulators_mechanisms():
    """A mechanism only the simulator runs stays out of the shared core and the runtime (issue 25): no module under
    dynaresize/job, dynaresize/worker or dynaresize/schedule imports dynaresize.sim.mechanisms; nor does the shared
    policy (its pipeline predictor plays the helpers only through the simulator's HelperPlay, handed to it)."""
    for pkg, banned in (("job", "dynaresize.sim"), ("worker", "dynaresize.sim"), ("schedule", "dynaresize.sim"),
                        ("policy", "dynaresize.sim.mechanisms")):
        for p in (ROOT / "dynaresize" / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ImportFrom):
                    assert not (node.module or "").startswith(banned), f"{p} imports {node.module}"
                elif isinstance(node, ast.Import):
                    assert not any(a.name.startswith(banned) for a in node.names), f"{p} imports the simulator"
