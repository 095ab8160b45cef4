"""The pipeline scheduler core's invariants, without hardware: random event orders drawn by hypothesis.

A small world model plays the ranks: it answers every action the core returns with the event that action leads to,
and hypothesis picks which pending event happens next (so completions, weight arrivals, switch ends, losses and
claims interleave in any order). After every action the world checks the contract:

- a group is generated only by a rank holding ``version_of(batch)``, each group exactly once (a lost rank's groups
  again, elsewhere), and a rank decodes one version at a time;
- batches are trained in order, each group in exactly one chunk, only once complete; ``Step(k)`` after all of them;
- no rank is a trainer and a rollout rank at once; a rank switches only without work;
- the trainer set of ``T_k`` is the same from its first chunk to its step;
- validation passes: each validation group generated exactly once, by a rank holding that version and never by one
  that decoded a newer version already, interleaved with the training work (or the pass is abandoned when a loss
  left no live rank holding its version);
- the run finishes (every optimizer step taken) unless a trainer was lost (then the core asks for a restart).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynaresize.policy import Topology
from dynaresize.policy.types import Observation
from dynaresize.schedule import (
    Assign, Decided, DynamicSampling, Extend, GroupsDone, Mechanisms, OptimizerStepDone, PipelineScheduler, RankLost,
    RankReady, Restart, Role, ScheduleError, SchedulerConfig, SendWeights, Step, StepMeasured, Switch, SwitchDone, Train,
    TrainChunkDone, Validate, ValidationDone, WeightsArrived, version_of,
)
from tests.support.schedule_world import ScriptedPolicy, World, check_finished, run_world

pytestmark = pytest.mark.unit


MECHS = st.builds(Mechanisms, st.booleans(), st.booleans(), st.just(True))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, n=st.integers(3, 6), steps=st.integers(1, 5), s=st.integers(0, 2),
       groups=st.integers(1, 4), slots=st.integers(1, 3), q=st.integers(1, 2))
def test_random_event_orders_keep_the_contract(data, mech, n, steps, s, groups, slots, q):
    cfg = SchedulerConfig(n, n // 2, (groups,) * steps, staleness=s, mechanisms=mech, train_queue=q)
    w = run_world(cfg, data, slots)
    check_finished(w)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, n=st.integers(3, 6), steps=st.integers(1, 5), groups=st.integers(1, 4),
       vals=st.lists(st.integers(0, 5), max_size=4, unique=True), vgroups=st.integers(1, 4), slots=st.integers(1, 3),
       script=st.one_of(st.none(), st.lists(st.integers(1, 5), min_size=1, max_size=3)), losses=st.integers(0, 1),
       q=st.integers(1, 2))
def test_validation_passes_interleave_and_keep_the_contract(data, mech, n, steps, groups, vals, vgroups, slots, script,
                                                            losses, q):
    validations = tuple((v, vgroups) for v in sorted(vals) if v <= steps)
    cfg = SchedulerConfig(n, n // 2, (groups,) * steps, staleness=1, mechanisms=mech,
                          validations=validations, train_queue=q)
    w = run_world(cfg, data, slots, script=script, losses=losses)
    check_finished(w)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, n=st.integers(3, 6), steps=st.integers(1, 5), need=st.integers(1, 4),
       rgroups=st.integers(1, 3), max_rounds=st.integers(0, 3), salt=st.integers(0, 2),
       slots=st.integers(1, 3), script=st.one_of(st.none(), st.lists(st.integers(1, 5), min_size=1, max_size=3)),
       losses=st.integers(0, 1), s=st.integers(0, 2), q=st.integers(1, 2))
def test_dynamic_sampling_keeps_the_static_runs_groups_whatever_the_order(data, mech, n, steps, need, rgroups, max_rounds,
                                                                         salt, slots, script, losses, s, q):
    ds = DynamicSampling(need, rgroups, max_rounds, pad=True)  # unfilled batches: the next test
    cfg = SchedulerConfig(n, n // 2, (need,) * steps, staleness=s, mechanisms=mech, sampling=ds, train_queue=q)
    check_finished(run_world(cfg, data, slots, script=script, losses=losses, salt=salt))


def test_dynamic_sampling_without_padding_marks_a_short_batch_unfilled_and_does_not_train_it():
    ds = DynamicSampling(need=2, round_groups=1, max_rounds=1, pad=False)
    core = PipelineScheduler(SchedulerConfig(3, 1, (2, 2), mechanisms=Mechanisms(True, True), sampling=ds))
    core.start()
    assert core.handle(RankReady(1, 2)) == [Assign(1, 0, (0,), 0)]
    assert core.handle(RankReady(2, 2)) == [Assign(2, 0, (1,), 0)]
    with pytest.raises(ScheduleError, match="without their judgement"):
        core.handle(GroupsDone(1, 0, (0,)))
    out = core.handle(GroupsDone(1, 0, (0,), kept=(False,)))  # 1 of 2 prompts left: a shortfall is certain
    assert out == [Extend(0, 1, (2,))]
    assert core.handle(RankReady(1, 2)) == [Assign(1, 0, (2,), 0), Assign(1, 1, (0,), 0)]  # the round first
    out = core.handle(GroupsDone(2, 0, (1,), kept=(True,)))
    assert Train(0, (1,), (0,), True) in out  # streaming: group 1 is selected (prompt 0 is judged: dropped)
    core.handle(GroupsDone(1, 0, (2,), kept=(False,)))  # the last round is in: 1 informative group of 2
    assert core.unfilled(0) and not core.unfilled(1)
    assert core.handle(TrainChunkDone(0)) == []  # never stepped: the driver stops the run


def test_validation_goes_before_the_training_work_of_its_version_and_the_last_version_is_sent_for_it():
    cfg = SchedulerConfig(3, 1, (2, 2), staleness=1, mechanisms=Mechanisms(False, False), validations=((0, 1), (2, 2)))
    core = PipelineScheduler(cfg)
    assert core.start() == []
    assert core.handle(RankReady(1, 2)) == [Validate(1, 0, (0,))]  # its version's pass first (an even share of it)
    assert core.handle(RankReady(2, 2)) == [Assign(2, 0, (0,), 0)]
    assert core.handle(RankReady(1, 2)) == [Assign(1, 0, (1,), 0)]  # interleaved with the training work, one version
    core.handle(ValidationDone(1, 0, (0,)))
    assert core.validated(0) and not core.finished
    core.handle(GroupsDone(2, 0, (0,)))
    assert core.handle(GroupsDone(1, 0, (1,))) == [Train(0, (0, 1), (0,), True)]
    assert core.handle(RankReady(1, 2)) == [Assign(1, 1, (0,), 0)]
    assert core.handle(RankReady(2, 2)) == [Assign(2, 1, (1,), 0)]
    core.handle(TrainChunkDone(0))
    assert core.handle(OptimizerStepDone(0)) == []  # version 1: no batch, no pass uses it
    core.handle(GroupsDone(1, 1, (0,)))
    core.handle(GroupsDone(2, 1, (1,)))
    core.handle(TrainChunkDone(1))
    out = core.handle(OptimizerStepDone(1))  # version 2, the run's last: only its validation pass uses it
    assert [a for a in out if isinstance(a, SendWeights)] == [SendWeights(1, 2, True), SendWeights(2, 2, True)]
    assert not core.finished
    core.handle(WeightsArrived(1, 2))
    assert core.handle(RankReady(1, 2)) == [Validate(1, 2, (0,))]
    core.handle(WeightsArrived(2, 2))
    assert core.handle(RankReady(2, 2)) == [Validate(2, 2, (1,))]
    core.handle(ValidationDone(1, 2, (0,)))
    assert not core.finished
    core.handle(ValidationDone(2, 2, (1,)))
    assert core.finished and core.validated(2)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, n=st.integers(3, 6), steps=st.integers(2, 6),
       script=st.lists(st.integers(1, 5), min_size=1, max_size=4), slots=st.integers(1, 3), q=st.integers(1, 2))
def test_resizes_in_both_directions_keep_the_contract(data, mech, n, steps, script, slots, q):
    cfg = SchedulerConfig(n, n // 2, (3,) * steps, staleness=1, mechanisms=mech, train_queue=q)
    w = run_world(cfg, data, slots, script=script)
    check_finished(w)
    assert w.core.topology().total == n


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, steps=st.integers(1, 5), slots=st.integers(1, 3))
def test_a_lost_rollout_rank_has_its_groups_handed_out_again(data, mech, steps, slots):
    cfg = SchedulerConfig(5, 2, (4,) * steps, staleness=1, mechanisms=mech)
    w = run_world(cfg, data, slots, losses=1)
    check_finished(w)
    assert w.losses_left == 0 or w.core.finished  # a rank holding work was lost (unless the run ended first)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), stream=st.booleans(), n=st.integers(3, 6), steps=st.integers(2, 6),
       script=st.lists(st.integers(1, 5), min_size=1, max_size=4), slots=st.integers(1, 3), q=st.integers(1, 2))
def test_collective_switches_move_all_movers_at_a_batch_boundary(data, stream, n, steps, script, slots, q):
    """The runtime's switch (one collective over old and new trainers): the contract holds, and every resize
    switches its movers together, between two training batches, with the trainers a prefix (World.apply checks)."""
    cfg = SchedulerConfig(n, n // 2, (3,) * steps, staleness=1, mechanisms=Mechanisms(True, stream, True),
                          collective_switch=True, train_queue=q)
    w = run_world(cfg, data, slots, script=script)
    check_finished(w)
    assert w.core.topology().total == n


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, k=st.integers(1, 4), s=st.integers(0, 2), slots=st.integers(1, 3))
def test_a_resume_trains_the_batches_generated_before_and_generates_only_the_rest(data, mech, k, s, slots):
    cfg = SchedulerConfig(4, 2, (2,) * 5, staleness=s, mechanisms=mech, resume_step=k)
    core = PipelineScheduler(cfg)
    first = core.start()
    trains = [a for a in first if isinstance(a, Train)]
    assert (trains and trains[0].batch == k) or s == 0 or mech.streaming_training is None
    w = World(core, cfg, slots)
    w.apply(first)
    for _ in range(5000):
        if core.finished:
            break
        ev = w.enabled()
        assert ev, "the pipeline stalled"
        w.fire(ev[data.draw(st.integers(0, len(ev) - 1))])
    check_finished(w)  # the World's Assign check: nothing generated before the checkpoint is generated again


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, k=st.integers(1, 4), s=st.integers(0, 2), more=st.integers(0, 2), slots=st.integers(1, 3))
def test_an_extended_run_generates_the_batches_past_its_old_end_with_the_checkpoints_version(data, mech, k, s, more, slots):
    """A completed run of ``old`` steps extended to 6 (``generated=old``): batches k..old-1 were generated before the
    checkpoint; the rest are generated now, each exactly once, none with a version older than the checkpoint's k."""
    old = min(k + more, 5)
    cfg = SchedulerConfig(4, 2, (2,) * 6, staleness=s, mechanisms=mech, resume_step=k, generated=old)
    assert [cfg.batch_version(j) for j in range(6)] == [
        version_of(j, s) if j < min(k + s, old) else max(k, version_of(j, s)) for j in range(6)]
    w = run_world(cfg, data, slots)
    check_finished(w)  # each batch generated once, with cfg.batch_version; nothing before the checkpoint again
    assert all(v >= k for (j, _), v in w.generated.items() if j >= min(k + s, old))


def test_lost_rank_groups_go_to_another_rank_first():
    cfg = SchedulerConfig(4, 1, (4,), mechanisms=Mechanisms(True, True))
    core = PipelineScheduler(cfg)
    core.start()
    assert core.handle(RankReady(1, 2)) == [Assign(1, 0, (0, 1), 0)]
    assert core.handle(RankReady(2, 1)) == [Assign(2, 0, (2,), 0)]
    assert core.handle(RankReady(3, 2)) == [Assign(3, 0, (3,), 0)]  # one capacity left over: rank 3 waits
    assert core.handle(RankLost(1)) == [Assign(3, 0, (0,), 0)]  # the waiting rank takes a returned group at once
    assert core.handle(RankReady(2, 1)) == [Assign(2, 0, (1,), 0)]
    with pytest.raises(ScheduleError):
        core.handle(GroupsDone(2, 0, (3,)))  # a group this rank was not given
    assert core.handle(GroupsDone(1, 0, (0,))) == []  # the fenced rank's late report is ignored


def test_losing_the_last_rollout_rank_moves_a_trainer_to_rollout():
    core = PipelineScheduler(SchedulerConfig(4, 3, (2, 2), mechanisms=Mechanisms(True, True)))
    core.start()
    assert core.handle(RankReady(3, 2)) == [Assign(3, 0, (0, 1), 0)]
    out = core.handle(RankLost(3))
    assert [a for a in out if isinstance(a, Switch)] == [Switch(2, Role.ROLLOUT, 0)]
    (d,) = [a for a in out if isinstance(a, Decided)]
    assert d.decision.target == Topology(2, 1) and "no rollout rank left" in d.decision.reason
    core.handle(SwitchDone(2))
    assert core.handle(RankReady(2, 2)) == [Assign(2, 0, (0, 1), 0)]  # the lost rank's groups, on the new rollout rank


def test_losing_the_last_rollout_rank_while_its_groups_are_trained_asks_for_a_restart():
    """The quickstart's 3:1 on the default schedule, its one rollout rank frozen past the heartbeat deadline while
    the trainers were in the middle of a batch whose last groups it held (tools/chaos.py, seed 1): the border
    trainer could leave only at that batch's optimizer step, which waits for those very groups. Before, the run
    stalled ("the scheduler has no work to hand out"); now every rank restarts from the checkpoint."""
    core = PipelineScheduler(SchedulerConfig(4, 3, (8, 8), mechanisms=Mechanisms(True, True), stream_min_groups=4))
    core.start()
    core.handle(RankReady(3, 8))
    assert core.handle(GroupsDone(3, 0, (0, 1, 2, 3))) == [Train(0, (0, 1, 2, 3), (0, 1, 2), True)]
    assert core.handle(TrainChunkDone(0)) == []  # groups 4..7 are still on rank 3
    (restart,) = core.handle(RankLost(3))
    assert isinstance(restart, Restart) and "batch 0 still has groups to generate with version 0" in restart.reason


def test_losing_the_last_rollout_rank_before_it_generated_the_older_versions_batch_asks_for_a_restart():
    """The quickstart's 3:1 on the default schedule, its one rollout rank SIGKILLed after step 9 while batch 10
    (version 9) was still to generate (tools/chaos.py, seed 3): the trainer that moves to rollout holds version 10
    and cannot generate batch 10. Before, it took batch 11 and the run stalled; now every rank restarts."""
    core = PipelineScheduler(SchedulerConfig(4, 3, (4, 4, 4), mechanisms=Mechanisms(True, True), stream_min_groups=4))
    core.start()
    assert core.handle(RankReady(3, 8)) == [Assign(3, 0, (0, 1, 2, 3), 0)]
    core.handle(GroupsDone(3, 0, (0, 1, 2, 3)))
    core.handle(TrainChunkDone(0))
    core.handle(OptimizerStepDone(0))  # batch 1 (version 0) not generated yet
    (restart,) = core.handle(RankLost(3))
    assert isinstance(restart, Restart) and "batch 1 still has groups to generate with version 0" in restart.reason


def test_losing_the_last_rollout_rank_with_one_trainer_asks_for_a_restart():
    core = PipelineScheduler(SchedulerConfig(2, 1, (2,), mechanisms=Mechanisms(True, True)))
    core.start()
    core.handle(RankReady(1, 2))
    assert [type(a) for a in core.handle(RankLost(1))] == [Restart]


def test_a_lost_trainer_asks_for_a_restart():
    core = PipelineScheduler(SchedulerConfig(3, 1, (2, 2)))
    core.start()
    acts = core.handle(RankLost(0))
    assert len(acts) == 1 and isinstance(acts[0], Restart)
    assert core.handle(RankReady(1, 1)) == []  # nothing more until the restart


def test_barrier_opens_a_batch_only_when_the_previous_one_is_complete():
    core = PipelineScheduler(SchedulerConfig(3, 1, (1, 1, 1), staleness=1))
    core.start()
    assert core.handle(RankReady(1, 2)) == [Assign(1, 0, (0,), 0)]
    assert core.handle(RankReady(2, 2)) == []  # batch 1 is version 0 too, but the barrier keeps it closed
    acts = core.handle(GroupsDone(1, 0, (0,)))
    assert Assign(2, 1, (0,), 0) in acts and Train(0, (0,), (0,), True) in acts  # rank 2 was waiting
    core.handle(TrainChunkDone(0))
    acts = core.handle(OptimizerStepDone(0))  # batch 2 (version 1) waits for batch 1, then one blocking sync
    assert not any(isinstance(a, SendWeights) for a in acts)
    acts = core.handle(GroupsDone(2, 1, (0,)))
    assert SendWeights(1, 1, blocking=True) in acts and SendWeights(2, 1, blocking=True) in acts


def test_continuous_rollout_sends_versions_in_the_background_and_fills_the_tail():
    core = PipelineScheduler(SchedulerConfig(3, 1, (2, 2, 2), mechanisms=Mechanisms(continuous_rollout=True)))
    core.start()
    assert core.handle(RankReady(1, 1)) == [Assign(1, 0, (0,), 0)]
    assert core.handle(RankReady(2, 1)) == [Assign(2, 0, (1,), 0)]
    core.handle(GroupsDone(1, 0, (0,)))
    # batch 1's head while batch 0's tail decodes on rank 2 (a claim takes at most an even share: 1 of 2 groups)
    assert core.handle(RankReady(1, 2)) == [Assign(1, 1, (0,), 0)]
    assert core.handle(GroupsDone(2, 0, (1,))) == [Train(0, (0, 1), (0,), True)]
    assert core.handle(TrainChunkDone(0)) == [Step(0, (0,))]
    # version 1 goes to both ranks in the background, though rank 1 still decodes batch 1 with version 0
    assert core.handle(OptimizerStepDone(0)) == [SendWeights(1, 1), SendWeights(2, 1)]
    assert core.handle(RankReady(2, 2)) == [Assign(2, 1, (1,), 0)]
    assert core.handle(WeightsArrived(2, 1)) == []  # it asked for one even share and got it
    core.handle(GroupsDone(2, 1, (1,)))
    # drained, rank 2 switches to version 1 and takes batch 2 while batch 1's group 0 still decodes on rank 1
    assert core.handle(RankReady(2, 2)) == [Assign(2, 2, (0,), 1)]
    with pytest.raises(ScheduleError):
        core.handle(TrainChunkDone(1))  # no chunk of batch 1 is running


def test_streaming_training_starts_before_the_batch_is_complete_and_steps_after():
    core = PipelineScheduler(SchedulerConfig(3, 1, (3,), mechanisms=Mechanisms(streaming_training=True)))
    core.start()
    core.handle(RankReady(1, 2))
    core.handle(RankReady(2, 1))
    assert core.handle(GroupsDone(2, 0, (2,))) == [Train(0, (2,), (0,), True)]
    assert core.handle(GroupsDone(1, 0, (0,))) == []  # the trainers are busy: the group waits
    assert core.handle(TrainChunkDone(0)) == [Train(0, (0,), (0,), False)]
    core.handle(GroupsDone(1, 0, (1,)))
    assert core.handle(TrainChunkDone(0)) == [Train(0, (1,), (0,), False)]
    assert core.handle(TrainChunkDone(0)) == [Step(0, (0,))]


def test_a_train_queue_of_two_sends_the_next_chunk_and_then_the_step_behind_the_one_running():
    """``train_queue=2``: the trainers hold the next chunk (or the batch's step) while one runs, so they never wait a
    round trip between two; the same groups train, in the same order, and the step still follows every chunk."""
    core = PipelineScheduler(SchedulerConfig(3, 1, (3, 3), mechanisms=Mechanisms(streaming_training=True), train_queue=2))
    core.start()
    core.handle(RankReady(1, 2))
    core.handle(RankReady(2, 1))
    assert core.handle(GroupsDone(2, 0, (2,))) == [Train(0, (2,), (0,), True)]
    assert core.handle(GroupsDone(1, 0, (0,))) == [Train(0, (0,), (0,), False)]  # queued behind the first
    assert core.handle(GroupsDone(1, 0, (1,))) == []  # two held: the group waits
    assert core.handle(TrainChunkDone(0)) == [Train(0, (1,), (0,), False)]  # the last chunk, behind the second
    assert core.handle(TrainChunkDone(0)) == [Step(0, (0,))]  # the step, behind the last chunk
    assert core.handle(TrainChunkDone(0)) == []
    with pytest.raises(ScheduleError):
        core.handle(TrainChunkDone(0))  # only the step is held now
    out = core.handle(OptimizerStepDone(0))
    assert core.produced == 1 and not any(isinstance(a, (Train, Step)) for a in out)  # batch 1 is not generated yet




def test_tokens_that_do_not_match_the_groups_are_refused_clearly():
    core = PipelineScheduler(SchedulerConfig(3, 1, (4, 4), mechanisms=Mechanisms(continuous_rollout=True)))
    core.start()
    core.handle(RankReady(1, 4))
    with pytest.raises(ScheduleError, match=r"tokens \[4\] for the 2 groups \[0, 1\] of batch 0"):
        core.handle(GroupsDone(1, 0, (0, 1), (4,)))
    with pytest.raises(ScheduleError, match="one count >= 0 per group"):
        core.handle(GroupsDone(1, 0, (0, 1), (4, -1)))


def test_step_measurements_survive_the_schedule_log_codec():
    from dynaresize.schedule.codec import decode, encode

    obs = Observation(3, Topology(2, 2), 1.0, 2.0)
    ev = StepMeasured(obs, 4, 0.5, 0.01)
    assert decode(encode(ev)) == ev
    cfg = SchedulerConfig(4, 2, (3, 3), mechanisms=Mechanisms(True, True, True), stream_min_groups=2)
    assert decode(encode(cfg)) == cfg
    # a log written while trainer-gen existed: its removed fields are ignored, the rest decodes as it was
    old = {**encode(ev), "decode_s_per_group": 2.5, "group_latency_s": 30.0}
    assert decode(old) == ev


class _FastEntries(PipelineScheduler):
    """A core answering RankReady and GroupsDone (no ``kept``) through ``rank_ready``/``groups_done``, each answer
    checked against a twin core fed the same events through ``handle`` alone."""

    def __init__(self, cfg: SchedulerConfig):
        super().__init__(cfg)
        self.twin = PipelineScheduler(cfg)
        self.fast = 0

    def start(self):
        out = super().start()
        assert out == self.twin.start()
        return out

    def handle(self, ev):
        if type(ev) is RankReady:
            out = self.rank_ready(ev.rank, ev.capacity)
            self.fast += 1
        elif type(ev) is GroupsDone and not ev.kept:
            out = self.groups_done(ev.rank, ev.batch, ev.groups, ev.tokens)
            self.fast += 1
        else:
            out = super().handle(ev)
        assert out == self.twin.handle(ev), ev
        return out


def test_the_fast_entry_points_answer_as_handle():
    """``rank_ready``/``groups_done`` (the simulator's calls) are ``handle(RankReady(...))``/``handle(GroupsDone(...))``:
    random worlds with every mechanism mix, reported tokens and a lost rank, answer for answer."""
    fast = 0
    for seed in range(40):
        cfg = SchedulerConfig(4, 1, (5,) * 4, staleness=1 + seed % 2,
                              mechanisms=Mechanisms(seed % 4 != 3, seed % 2 == 0, False))
        core = _FastEntries(cfg)
        world = World(core, cfg, 2, losses_left=seed % 2, tokens=seed % 4 < 2)
        world.apply(core.start())
        rnd = random.Random(seed)
        while not core.finished and not world.restarted:
            ev = world.enabled()
            if not ev:
                break
            world.fire(ev[rnd.randrange(len(ev))])
        fast += core.fast
    assert fast > 500


def test_the_last_rollout_rank_lost_while_the_other_one_leaves_for_training_restarts():
    """A resize to 4:1 moves ranks 2 and 3 to training; rank 4, the one rollout rank it keeps, is lost while rank 2
    still finishes its groups (so rank 2 still counted as a rollout rank then). Once rank 2 is a trainer no rank is
    left to generate rank 4's group: the core asks for a restart (it stalled, found by the property test above)."""
    cfg = SchedulerConfig(5, 2, (2, 2), staleness=1, mechanisms=Mechanisms(False, False, True))
    core = PipelineScheduler(cfg, ScriptedPolicy([4]))
    w = World(core, cfg, 2, losses_left=1)
    w.apply(core.start())
    script = ["RankReady(rank=2, capacity=2)", "RankReady(rank=2, capacity=1)",
              "GroupsDone(rank=2, batch=0, groups=(0,), tokens=(), kept=())", "RankReady(rank=2, capacity=1)",
              "RankReady(rank=4, capacity=2)", "GroupsDone(rank=2, batch=0, groups=(1,), tokens=(), kept=())",
              "TrainChunkDone(batch=0)", "OptimizerStepDone(batch=0)", "('switch', 3, <Role.TRAIN: 'train'>)",
              "RankLost(rank=4)", "GroupsDone(rank=2, batch=1, groups=(0,), tokens=(), kept=())",
              "('switch', 2, <Role.TRAIN: 'train'>)"]
    for want in script:
        ev = [e for e in w.enabled() if repr(e) == want]
        assert ev, f"{want} is not possible here: {w.enabled()}"
        w.fire(ev[0])
    assert w.restarted and not core.finished


def test_a_rank_that_validated_a_newer_version_is_not_handed_an_older_pass_back():
    """A validation pass moves its rank on to its version like training work does: rank 2 validates version 1, then
    rank 3 is lost with a group of version 0's pass; that group goes to a rank still on version 0 (rank 4), never
    back to rank 2 (a rank decodes one version and cannot go back). The core handed it to rank 2 before: its
    validation did not record the rank's newest version (found by the random-order property test)."""
    cfg = SchedulerConfig(5, 2, (1,), staleness=1, mechanisms=Mechanisms(True, False, True), validations=((0, 2), (1, 1)))
    core = PipelineScheduler(cfg)
    core.start()
    assert core.handle(RankReady(2, 1)) == [Validate(2, 0, (0,))]
    assert core.handle(RankReady(3, 1)) == [Validate(3, 0, (1,))]
    assert core.handle(RankReady(4, 1)) == [Assign(4, 0, (0,), 0)]
    core.handle(GroupsDone(4, 0, (0,)))
    core.handle(TrainChunkDone(0))
    core.handle(OptimizerStepDone(0))
    core.handle(ValidationDone(2, 0, (0,)))
    core.handle(WeightsArrived(2, 1))
    assert core.handle(RankReady(2, 1)) == [Validate(2, 1, (0,))]
    core.handle(RankLost(3))
    core.handle(ValidationDone(2, 1, (0,)))
    assert core.handle(RankReady(2, 1)) == []  # version 0's returned group is not for it
    assert core.handle(RankReady(4, 1)) == [Validate(4, 0, (1,))]  # rank 4 still decodes version 0


class _Recorder:
    """A fake resize policy with the real interface that records what it is shown and holds."""

    def __init__(self):
        self.seen: list[Observation] = []

    def initial_state(self):
        from dynaresize.policy.types import PolicyState
        return PolicyState()

    def step(self, state, obs):
        from dynaresize.policy.types import Decision, ResizeAction
        self.seen.append(obs)
        return state, Decision(ResizeAction.HOLD, obs.topology, "recorded")


@pytest.mark.parametrize("continuous,s", [(True, 1), (True, 2), (False, 1)])
def test_the_pipeline_fill_is_shown_to_the_policy_as_mixed_with_continuous_rollout(continuous, s):
    """With continuous rollout, batches 0..s are all made by version 0 and share the rollout ranks at the start: their
    steps describe no split's steady state, so the policy is shown them as mixed; the barrier's are clean."""
    rec = _Recorder()
    cfg = SchedulerConfig(4, 2, (3,) * 6, staleness=s, mechanisms=Mechanisms(continuous, continuous, True))
    core = PipelineScheduler(cfg, rec)
    core.start()
    for k in range(5):
        core.handle(StepMeasured(Observation(k, Topology(2, 2), 10.0, 8.0), 5 - k, 1.0))
    assert [o.mixed for o in rec.seen] == [continuous and k <= s for k in range(5)]
