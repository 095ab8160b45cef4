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
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynaresize.policy import Topology
from dynaresize.policy.types import Decision, Observation, PolicyState, ResizeAction
from dynaresize.schedule import (
    Assign, Decided, DynamicSampling, Extend, GroupsDone, Help, HelpDone, Mechanisms, OptimizerStepDone, PipelineScheduler, RankLost, RankReady, Restart, Role,
    ScheduleError, SchedulerConfig, SendWeights, Step, StepMeasured, Switch, SwitchDone, Train, TrainChunkDone,
    Validate, ValidationDone, WeightsArrived, version_of,
)

pytestmark = pytest.mark.unit


class ScriptedPolicy:
    """A fake resize policy with the real interface (``initial_state``/``step``): resizes to the splits it is given,
    one per consultation, then holds."""

    def __init__(self, script: list[int]):
        self.script = list(script)

    def initial_state(self) -> PolicyState:
        return PolicyState()

    def step(self, state: PolicyState, obs: Observation) -> tuple[PolicyState, Decision]:
        if not self.script:
            return state, Decision(ResizeAction.HOLD, obs.topology, "script done")
        nt = max(1, min(obs.topology.total - 1, self.script.pop(0)))
        target = Topology(nt, obs.topology.total - nt)
        return state, Decision(ResizeAction.RESIZE, target, "scripted")


@dataclass
class World:
    core: PipelineScheduler
    cfg: SchedulerConfig
    slots: int
    pending: list = field(default_factory=list)  # events that may happen next
    held: dict[int, set[int]] = field(default_factory=dict)  # rank -> versions it really holds
    inflight: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # rank -> (batch, group, version)
    generated: dict[tuple[int, int], int] = field(default_factory=dict)  # (batch, group) -> version that made it
    trained: dict[int, set[int]] = field(default_factory=dict)
    steps_done: int = 0
    chunk: Train | None = None
    stepping: int | None = None
    lost: set[int] = field(default_factory=set)
    restarted: bool = False
    switches: int = 0
    losses_left: int = 1
    helping: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    helps: int = 0
    t_set: dict[int, tuple[int, ...]] = field(default_factory=dict)  # batch -> trainer set of its first chunk
    gpu_s: float = 1.0  # what the world reports in StepMeasured: training GPU-s per group
    tokens: bool = False  # GroupsDone reports each group's trained tokens (world_tokens), StepMeasured the compute per token
    vinflight: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # rank -> validation (version, group)
    validated: dict[tuple[int, int], int] = field(default_factory=dict)  # (version, group) -> times generated
    newest: dict[int, int] = field(default_factory=dict)  # rank -> newest version it decoded with
    salt: int = 0  # dynamic sampling: which groups are informative (judge)
    extended: dict[int, int] = field(default_factory=dict)  # batch -> extra rounds the core added

    def judge(self, batch: int, g: int) -> bool:
        return (31 * batch + 17 * g + self.salt) % 3 != 0

    def done(self, rank: int, batch: int, g: int) -> GroupsDone:
        kept = (self.judge(batch, g),) if self.cfg.sampling is not None else ()
        return GroupsDone(rank, batch, (g,), (world_tokens(batch, g),) if self.tokens else (), kept)

    def __post_init__(self) -> None:
        k, s = self.cfg.resume_step, self.cfg.staleness
        for r in range(self.cfg.n_ranks):
            self.held[r] = {k} if r >= self.cfg.n_train else set()
            self.inflight[r] = []
            self.vinflight[r] = []
        for j in range(min(k + s, self.cfg.steps) if k else 0):  # a resume: generated (and trained) before
            for g in range(self.cfg.groups[j]):
                self.generated[(j, g)] = version_of(j, s)
            if j < k:
                self.trained[j] = set(range(self.cfg.groups[j]))
        self.steps_done = k

    # the world's reaction to the core's actions, with the contract checked on each
    def apply(self, actions) -> None:
        switched: dict[int, list[int]] = {}
        for a in actions:
            if isinstance(a, Switch):
                switched.setdefault(a.switch_id, []).append(a.rank)
                if self.cfg.collective_switch:  # the trainers take part: never in the middle of a batch
                    assert self.chunk is None and self.stepping is None, "a collective switch while the trainers train"
                    assert not self.trained.get(self.steps_done), "a collective switch in the middle of a batch"
            match a:
                case Assign(rank, batch, groups, version):
                    assert rank not in self.lost and rank not in self.helping, "work for a lost or helping rank"
                    assert version == version_of(batch, self.cfg.staleness), "sample-to-version map broken"
                    assert self.core.role(rank) is Role.ROLLOUT, "work for a rank that is not a rollout rank"
                    assert version in self.held[rank], f"rank {rank} lacks version {version}"
                    assert all(v == version for _, _, v in self.inflight[rank]), "two versions on one rank"
                    assert all(v == version for v, _ in self.vinflight[rank]), "two versions on one rank"
                    self.newest[rank] = max(self.newest.get(rank, 0), version)
                    for g in groups:
                        assert (batch, g) not in self.generated, f"group {g} of batch {batch} assigned after it was made"
                        self.inflight[rank].append((batch, g, version))
                case Validate(rank, version, groups):
                    assert rank not in self.lost and self.core.role(rank) is Role.ROLLOUT, "validation for a lost rank"
                    assert version in self.held[rank], f"rank {rank} validates {version} without holding it"
                    assert self.newest.get(rank, 0) <= version, f"rank {rank} went back to version {version}"
                    assert all(v == version for _, _, v in self.inflight[rank]), "two versions on one rank"
                    assert all(v == version for v, _ in self.vinflight[rank]), "two versions on one rank"
                    self.newest[rank] = version
                    for g in groups:
                        assert (version, g) not in self.validated, f"validation group {g} of {version} handed out again"
                        self.vinflight[rank].append((version, g))
                case Extend(batch, round_, groups):
                    ds = self.cfg.sampling
                    assert ds is not None and round_ == self.extended.get(batch, 0) + 1 <= ds.max_rounds
                    first = self.cfg.groups[batch] + (round_ - 1) * ds.round_groups
                    assert groups == tuple(range(first, first + ds.round_groups)), "a round of other prompts"
                    self.extended[batch] = round_
                case Train(batch, groups, ranks, first):
                    assert self.chunk is None and self.stepping is None
                    assert batch == self.steps_done, "batches trained out of order"
                    assert all(self.core.role(r) is Role.TRAIN for r in ranks) and ranks
                    assert self.t_set.setdefault(batch, ranks) == ranks, "the trainer set changed within a batch"
                    for g in groups:
                        assert (batch, g) in self.generated, "trained a group before it was generated"
                        assert g not in self.trained.setdefault(batch, set()), "group trained twice"
                        self.trained[batch].add(g)
                    self.chunk = a
                    self.pending.append(TrainChunkDone(batch))
                case Help(rank, batch, groups):
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
                case Step(batch, ranks):
                    assert batch == self.steps_done and self.chunk is None
                    assert self.t_set.get(batch, ranks) == ranks, "the trainer set changed within a batch"
                    assert not any(b == batch for b, _ in self.helping.values()), "step before the helpers' gradients"
                    assert self.trained.get(batch, set()) == set(static_selection(self, batch)[1]), "step before the batch trained"
                    self.stepping = batch
                    self.pending.append(OptimizerStepDone(batch))
                case SendWeights(rank, version, _):
                    assert version <= self.steps_done
                    self.pending.append(WeightsArrived(rank, version))
                case Switch(rank, to, _):
                    assert not self.inflight[rank] and not self.vinflight[rank], "switched a rank that holds work"
                    assert rank not in self.helping, "switched a rank in the middle of its help"
                    if self.chunk is not None:
                        assert rank not in self.chunk.ranks, "a trainer left in the middle of a batch"
                    self.held[rank] = set()
                    self.switches += 1
                    self.pending.append(("switch", rank, to))
                case Decided():
                    pass
                case Restart():
                    self.restarted = True
                case _:
                    raise AssertionError(f"unexpected action {a!r}")
        if self.cfg.collective_switch and switched and not self.lost:
            ranks = self.core.ranks
            for sid in switched:  # every mover of the resize at once, in one action list
                assert all(r.switch_id != sid for r in ranks if r.role is not None), f"switch {sid} split in two"
            heading = [i for i, r in enumerate(ranks) if r.role is Role.TRAIN or r.to is Role.TRAIN]
            assert heading == list(range(len(heading))), f"trainers {heading} are not a prefix"

    def enabled(self) -> list:
        ev = list(self.pending)
        for r in range(self.cfg.n_ranks):
            if r in self.lost or self.core.role(r) is not Role.ROLLOUT:
                continue
            free = self.slots - len(self.inflight[r]) - len(self.vinflight[r])
            if free > 0:
                ev.append(RankReady(r, free))
            for batch, g, _ in self.inflight[r]:
                ev.append(self.done(r, batch, g))
            for v, g in self.vinflight[r]:
                ev.append(ValidationDone(r, v, (g,)))
            busy = self.inflight[r] or self.vinflight[r] or r in self.helping
            if self.losses_left > 0 and busy and len(self.core.rollout_ranks()) > 1:  # loses work
                ev.append(RankLost(r))
        return ev

    def fire(self, ev) -> None:
        if ev in self.pending:
            self.pending.remove(ev)
        match ev:
            case GroupsDone(rank, batch, (g,)):
                v = next(v for b, gg, v in self.inflight[rank] if (b, gg) == (batch, g))
                self.inflight[rank].remove((batch, g, v))
                self.generated[(batch, g)] = v
            case ValidationDone(rank, v, (g,)):
                self.vinflight[rank].remove((v, g))
                self.validated[(v, g)] = self.validated.get((v, g), 0) + 1
            case TrainChunkDone():
                self.chunk = None
            case OptimizerStepDone(batch):
                self.stepping = None
                self.steps_done = batch + 1
            case WeightsArrived(rank, version):
                if rank in self.lost:
                    return
                self.held[rank].add(version)
                if not self.cfg.mechanisms.continuous_rollout:  # the barrier's syncs load the weights in place, in order
                    self.held[rank] = {max(self.held[rank])}
                    self.newest[rank] = max(self.newest.get(rank, 0), version)
            case HelpDone(rank, _):
                del self.helping[rank]
            case RankLost(rank):
                self.lost.add(rank)
                self.losses_left -= 1
                self.inflight[rank] = []
                self.vinflight[rank] = []
                helped = self.helping.pop(rank, None)
                if helped is not None:  # its gradient is lost with it
                    self.trained[helped[0]] -= set(helped[1])
                    self.pending = [p for p in self.pending if not (isinstance(p, HelpDone) and p.rank == rank)]
                self.pending = [p for p in self.pending if not (isinstance(p, WeightsArrived) and p.rank == rank)]
            case ("switch", rank, to):
                if to is Role.ROLLOUT:
                    self.held[rank] = {self.steps_done}
                    self.newest[rank] = self.steps_done
                self.apply(self.core.handle(SwitchDone(rank)))
                return
        self.apply(self.core.handle(ev))
        if isinstance(ev, OptimizerStepDone):
            obs = Observation(step=ev.batch, topology=self.core.topology(), rollout_s=1.0, train_s=1.0)
            self.apply(self.core.handle(StepMeasured(obs, self.cfg.steps - self.steps_done, self.gpu_s,
                                                     self.gpu_s / 4.0 if self.tokens else 0.0)))


def static_selection(w: "World", batch: int) -> tuple[int, tuple[int, ...]]:
    """What the static barrier run generates and trains for ``batch``: (prompts, trained groups), by
    ``dynaresize.rl.dapo`` round by round (every group of every batch without dynamic sampling)."""
    from dynaresize.rl.dapo import next_round_prompts, select_groups

    ds, n = w.cfg.sampling, w.cfg.groups[batch]
    if ds is None:
        return n, tuple(range(n))
    rounds = 0
    while True:
        kept = sum(w.judge(batch, g) for g in range(n))
        more = next_round_prompts(kept, ds.need, rounds, ds.max_rounds, ds.round_groups)
        if not more:
            break
        n, rounds = n + more, rounds + 1
    rewards = [[0.0, 1.0] if w.judge(batch, g) else [1.0, 1.0] for g in range(n)]
    return n, select_groups(rewards, ds.need, pad=ds.pad).trained


def world_tokens(batch: int, g: int) -> int:
    """A group's trained tokens in the random worlds: 1 .. 7 (mean 4), uneven across groups and batches."""
    return 1 + (3 * batch + 5 * g) % 7


def run_world(cfg: SchedulerConfig, choices, slots: int, script: list[int] | None = None, losses: int = 0,
              **measured) -> World:
    core = PipelineScheduler(cfg, ScriptedPolicy(script) if script is not None else None)
    w = World(core, cfg, slots, losses_left=losses, **measured)
    w.apply(core.start())
    for _ in range(5000):
        if core.finished or w.restarted:
            break
        ev = w.enabled()
        assert ev, "the pipeline stalled with nothing left to happen"
        w.fire(ev[choices.draw(st.integers(0, len(ev) - 1)) if not isinstance(choices, int) else choices % len(ev)])
    return w


def check_finished(w: World) -> None:
    if w.restarted:
        return
    assert w.core.finished, "the run did not finish"
    for j in range(w.cfg.steps):
        n, chosen = static_selection(w, j)
        assert {g for (b, g) in w.generated if b == j} == set(range(n)), f"batch {j} not generated exactly once"
        assert all(w.generated[(j, g)] == version_of(j, w.cfg.staleness) for g in range(n))
        assert w.trained[j] == set(chosen), f"batch {j} trained {sorted(w.trained[j])}, the static run {chosen}"
    for v, n in w.cfg.validations:
        if v not in w.core.vals_abandoned:
            assert {g for (u, g) in w.validated if u == v} == set(range(n)), f"validation of {v} not generated"
    assert all(c == 1 for c in w.validated.values()), "a validation group generated twice"


MECHS = st.builds(Mechanisms, st.booleans(), st.booleans(), st.just(True), st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, n=st.integers(3, 6), steps=st.integers(1, 5), s=st.integers(0, 2),
       groups=st.integers(1, 4), slots=st.integers(1, 3))
def test_random_event_orders_keep_the_contract(data, mech, n, steps, s, groups, slots):
    cfg = SchedulerConfig(n, n // 2, (groups,) * steps, staleness=s, mechanisms=mech, helper_cost_s=0.1)
    w = run_world(cfg, data, slots)
    check_finished(w)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, n=st.integers(3, 6), steps=st.integers(1, 5), groups=st.integers(1, 4),
       vals=st.lists(st.integers(0, 5), max_size=4, unique=True), vgroups=st.integers(1, 4), slots=st.integers(1, 3),
       script=st.one_of(st.none(), st.lists(st.integers(1, 5), min_size=1, max_size=3)), losses=st.integers(0, 1))
def test_validation_passes_interleave_and_keep_the_contract(data, mech, n, steps, groups, vals, vgroups, slots, script,
                                                            losses):
    validations = tuple((v, vgroups) for v in sorted(vals) if v <= steps)
    cfg = SchedulerConfig(n, n // 2, (groups,) * steps, staleness=1, mechanisms=mech, helper_cost_s=0.1,
                          validations=validations)
    w = run_world(cfg, data, slots, script=script, losses=losses)
    check_finished(w)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, n=st.integers(3, 6), steps=st.integers(1, 5), need=st.integers(1, 4),
       rgroups=st.integers(1, 3), max_rounds=st.integers(0, 3), salt=st.integers(0, 2),
       slots=st.integers(1, 3), script=st.one_of(st.none(), st.lists(st.integers(1, 5), min_size=1, max_size=3)),
       losses=st.integers(0, 1), s=st.integers(0, 2))
def test_dynamic_sampling_keeps_the_static_runs_groups_whatever_the_order(data, mech, n, steps, need, rgroups, max_rounds,
                                                                         salt, slots, script, losses, s):
    ds = DynamicSampling(need, rgroups, max_rounds, pad=True)  # unfilled batches: the next test
    cfg = SchedulerConfig(n, n // 2, (need,) * steps, staleness=s, mechanisms=mech, helper_cost_s=0.1, sampling=ds)
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
       script=st.lists(st.integers(1, 5), min_size=1, max_size=4), slots=st.integers(1, 3))
def test_resizes_in_both_directions_keep_the_contract(data, mech, n, steps, script, slots):
    cfg = SchedulerConfig(n, n // 2, (3,) * steps, staleness=1, mechanisms=mech, helper_cost_s=0.1)
    w = run_world(cfg, data, slots, script=script)
    check_finished(w)
    assert w.core.topology().total == n


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, steps=st.integers(1, 5), slots=st.integers(1, 3))
def test_a_lost_rollout_rank_has_its_groups_handed_out_again(data, mech, steps, slots):
    cfg = SchedulerConfig(5, 2, (4,) * steps, staleness=1, mechanisms=mech, helper_cost_s=0.1)
    w = run_world(cfg, data, slots, losses=1)
    check_finished(w)
    assert w.losses_left == 0 or w.core.finished  # a rank holding work was lost (unless the run ended first)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), stream=st.booleans(), n=st.integers(3, 6), steps=st.integers(2, 6),
       script=st.lists(st.integers(1, 5), min_size=1, max_size=4), slots=st.integers(1, 3))
def test_collective_switches_move_all_movers_at_a_batch_boundary(data, stream, n, steps, script, slots):
    """The runtime's switch (one collective over old and new trainers): the contract holds, and every resize
    switches its movers together, between two training batches, with the trainers a prefix (World.apply checks)."""
    cfg = SchedulerConfig(n, n // 2, (3,) * steps, staleness=1, mechanisms=Mechanisms(True, stream, True),
                          collective_switch=True)
    w = run_world(cfg, data, slots, script=script)
    check_finished(w)
    assert w.core.topology().total == n


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mech=MECHS, k=st.integers(1, 4), s=st.integers(0, 2), slots=st.integers(1, 3))
def test_a_resume_trains_the_batches_generated_before_and_generates_only_the_rest(data, mech, k, s, slots):
    cfg = SchedulerConfig(4, 2, (2,) * 5, staleness=s, mechanisms=mech, resume_step=k, helper_cost_s=0.1)
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




def test_an_idle_rollout_rank_holding_the_training_version_helps_the_training():
    mech = Mechanisms(continuous_rollout=True, gradient_helpers=True)
    cfg = SchedulerConfig(3, 1, (4, 4, 4), mechanisms=mech, helper_cost_s=0.1, helper_rate=1.0, train_chunks=4)
    core = PipelineScheduler(cfg)
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
    mech = Mechanisms(continuous_rollout=True, gradient_helpers=True)
    cfg = SchedulerConfig(3, 1, (4, 4, 4), mechanisms=mech, helper_cost_s=0.1, helper_rate=1.0, train_chunks=4)
    core = PipelineScheduler(cfg)
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


def test_tokens_that_do_not_match_the_groups_are_refused_clearly():
    core = PipelineScheduler(SchedulerConfig(3, 1, (4, 4), mechanisms=Mechanisms(continuous_rollout=True)))
    core.start()
    core.handle(RankReady(1, 4))
    with pytest.raises(ScheduleError, match=r"tokens \[4\] for the 2 groups \[0, 1\] of batch 0"):
        core.handle(GroupsDone(1, 0, (0, 1), (4,)))
    with pytest.raises(ScheduleError, match="one count >= 0 per group"):
        core.handle(GroupsDone(1, 0, (0, 1), (4, -1)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), stream=st.booleans(), n=st.integers(3, 5), steps=st.integers(2, 5), groups=st.integers(4, 6),
       slots=st.integers(1, 3), losses=st.integers(0, 1), tokens=st.booleans())
def test_gradient_helpers_keep_the_contract(data, stream, n, steps, groups, slots, losses, tokens):
    cfg = SchedulerConfig(n, 1, (groups,) * steps, staleness=1, mechanisms=Mechanisms(True, stream, False, True),
                          helper_cost_s=0.05, helper_rate=1.0, train_chunks=groups)
    w = run_world(cfg, data, slots, losses=losses, tokens=tokens)
    check_finished(w)


def run_at_random(cfg: SchedulerConfig, seed: int, **world_kw) -> "World":
    """A fresh core driven to the end by events picked at random among the enabled ones; its invariants checked."""
    core = PipelineScheduler(cfg)
    world = World(core, cfg, 2, losses_left=0, **world_kw)
    world.apply(core.start())
    rnd = random.Random(seed)
    while not core.finished:
        ev = world.enabled()
        world.fire(ev[rnd.randrange(len(ev))])
    check_finished(world)
    return world


def test_the_random_worlds_do_exercise_the_helpers():
    """Guard for the property test above: its random event orders reach helpers (else it checks nothing)."""
    helps = {False: 0, True: 0}
    for seed in range(60):
        cfg = SchedulerConfig(4, 1, (5,) * 4, staleness=1, mechanisms=Mechanisms(True, seed % 2 == 0, False, True),
                              helper_cost_s=0.05, helper_rate=1.0, train_chunks=5)
        tokens = seed % 4 < 2
        world = run_at_random(cfg, seed, tokens=tokens)
        helps[tokens] += world.helps
    assert helps[False] > 0 and helps[True] > 0  # priced at the mean and by tokens


def test_step_measurements_survive_the_schedule_log_codec():
    from dynaresize.schedule.codec import decode, encode

    obs = Observation(3, Topology(2, 2), 1.0, 2.0)
    ev = StepMeasured(obs, 4, 0.5, 0.01)
    assert decode(encode(ev)) == ev
    cfg = SchedulerConfig(4, 2, (3, 3), mechanisms=Mechanisms(True, True, True, True), helper_cost_s=3.0)
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
    random worlds with every mechanism mix, helpers and a lost rank, answer for answer."""
    fast = 0
    for seed in range(40):
        cfg = SchedulerConfig(4, 1, (5,) * 4, staleness=1 + seed % 2,
                              mechanisms=Mechanisms(seed % 4 != 3, seed % 2 == 0, False, True),
                              helper_cost_s=0.05, helper_rate=1.0, train_chunks=5)
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
    cfg = SchedulerConfig(5, 2, (2, 2), staleness=1, mechanisms=Mechanisms(False, False, True), helper_cost_s=0.1)
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
