"""A small world model of the ranks for the scheduler core's property tests (tests/unit/test_schedule_core.py, and
tests/unit/test_sim_mechanisms.py for the simulator's subclass of the core).

The world answers every action the core returns with the event that action leads to, and a test picks which pending
event happens next (hypothesis, or a seeded random), so completions, weight arrivals, switch ends, losses and claims
interleave in any order. After every action it checks the contract (test_schedule_core.py's docstring lists it);
``check_finished`` checks the end: every group generated once by its version and trained once, as the static run.
A world for a core subclass extends it through ``check``, ``extra`` and ``busy``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import strategies as st

from dynaresize.policy import Topology
from dynaresize.policy.types import Decision, Observation, PolicyState, ResizeAction
from dynaresize.schedule import (
    Assign, Decided, DynamicSampling, Extend, GroupsDone, OptimizerStepDone, PipelineScheduler, RankLost, RankReady, Restart, Role,
    SchedulerConfig, SendWeights, Step, StepMeasured, Switch, SwitchDone, Train, TrainChunkDone, Validate,
    ValidationDone, WeightsArrived, version_of,
)


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
    chunks: list[Train] = field(default_factory=list)  # training chunks the trainers hold, run in the order sent
    stepping: int | None = None
    lost: set[int] = field(default_factory=set)
    restarted: bool = False
    switches: int = 0
    losses_left: int = 1
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
        for j in range(self.cfg.generated_before):  # a resume: generated (and trained) before
            for g in range(self.cfg.groups[j]):
                self.generated[(j, g)] = version_of(j, s)
            if j < k:
                self.trained[j] = set(range(self.cfg.groups[j]))
        self.steps_done = k

    # hooks for a world that plays a core subclass's mechanism too (tests/unit/test_sim_mechanisms.py)
    def check(self, a) -> None:
        """Checks of action ``a`` before the world plays it (none here)."""

    def extra(self, a) -> bool:
        """Play an action the core's vocabulary does not have; whether it was one."""
        return False

    def busy(self, rank: int) -> bool:
        """Whether ``rank`` holds work besides generation (it may then be lost with work)."""
        return False

    # the world's reaction to the core's actions, with the contract checked on each
    def apply(self, actions) -> None:
        switched: dict[int, list[int]] = {}
        for a in actions:
            self.check(a)
            if isinstance(a, Switch):
                switched.setdefault(a.switch_id, []).append(a.rank)
                if self.cfg.collective_switch:  # the trainers take part: never in the middle of a batch
                    assert not self.chunks and self.stepping is None, "a collective switch while the trainers train"
                    assert not self.trained.get(self.steps_done), "a collective switch in the middle of a batch"
            match a:
                case Assign(rank, batch, groups, version):
                    assert rank not in self.lost, "work for a lost rank"
                    assert version == self.cfg.batch_version(batch), "sample-to-version map broken"
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
                    assert self.stepping is None, "a chunk after the batch's step"
                    assert len(self.chunks) < self.cfg.train_queue, f"more than {self.cfg.train_queue} training commands held"
                    assert batch == self.steps_done, "batches trained out of order"
                    assert all(self.core.role(r) is Role.TRAIN for r in ranks) and ranks
                    assert self.t_set.setdefault(batch, ranks) == ranks, "the trainer set changed within a batch"
                    for g in groups:
                        assert (batch, g) in self.generated, "trained a group before it was generated"
                        assert g not in self.trained.setdefault(batch, set()), "group trained twice"
                        self.trained[batch].add(g)
                    self.chunks.append(a)
                    self.pending.append(TrainChunkDone(batch))
                case Step(batch, ranks):
                    assert batch == self.steps_done and self.stepping is None
                    assert len(self.chunks) < self.cfg.train_queue, f"more than {self.cfg.train_queue} training commands held"
                    assert self.t_set.get(batch, ranks) == ranks, "the trainer set changed within a batch"
                    assert self.trained.get(batch, set()) == set(static_selection(self, batch)[1]), "step before the batch trained"
                    self.stepping = batch
                    self.pending.append(OptimizerStepDone(batch))
                case SendWeights(rank, version, _):
                    assert version <= self.steps_done
                    self.pending.append(WeightsArrived(rank, version))
                case Switch(rank, to, _):
                    assert not self.inflight[rank] and not self.vinflight[rank], "switched a rank that holds work"
                    assert not any(rank in c.ranks for c in self.chunks), "a trainer left in the middle of a batch"
                    self.held[rank] = set()
                    self.switches += 1
                    self.pending.append(("switch", rank, to))
                case Decided():
                    pass
                case Restart():
                    self.restarted = True
                case _:
                    if not self.extra(a):
                        raise AssertionError(f"unexpected action {a!r}")
        if self.cfg.collective_switch and switched and not self.lost:
            ranks = self.core.ranks
            for sid in switched:  # every mover of the resize at once, in one action list
                assert all(r.switch_id != sid for r in ranks if r.role is not None), f"switch {sid} split in two"
            heading = [i for i, r in enumerate(ranks) if r.role is Role.TRAIN or r.to is Role.TRAIN]
            assert heading == list(range(len(heading))), f"trainers {heading} are not a prefix"

    def enabled(self) -> list:
        # the trainers run their commands in order: the step ends after every chunk queued before it
        ev = [e for e in self.pending if not (isinstance(e, OptimizerStepDone) and self.chunks)]
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
            busy = self.inflight[r] or self.vinflight[r] or self.busy(r)
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
                self.chunks.pop(0)  # the trainers run their commands in the order sent
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
            case RankLost(rank):
                self.lost.add(rank)
                self.losses_left -= 1
                self.inflight[rank] = []
                self.vinflight[rank] = []
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
              make_core=PipelineScheduler, world=None, **measured) -> World:
    """A fresh core (``make_core(cfg, policy)``) driven to its end by a world (``world``: its class, ``World`` by
    default) whose next event hypothesis draws from ``choices`` (or an int picks, for a fixed order)."""
    core = make_core(cfg, ScriptedPolicy(script) if script is not None else None)
    w = (world or World)(core, cfg, slots, losses_left=losses, **measured)
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
        assert all(w.generated[(j, g)] == w.cfg.batch_version(j) for g in range(n))
        assert w.trained[j] == set(chosen), f"batch {j} trained {sorted(w.trained[j])}, the static run {chosen}"
    for v, n in w.cfg.validations:
        if v not in w.core.vals_abandoned:
            assert {g for (u, g) in w.validated if u == v} == set(range(n)), f"validation of {v} not generated"
    assert all(c == 1 for c in w.validated.values()), "a validation group generated twice"




def run_at_random(cfg: SchedulerConfig, seed: int, make_core=PipelineScheduler, world=None, **world_kw) -> World:
    """A fresh core driven to the end by events picked at random among the enabled ones; its invariants checked."""
    core = make_core(cfg, None)
    w = (world or World)(core, cfg, 2, losses_left=0, **world_kw)
    w.apply(core.start())
    rnd = random.Random(seed)
    while not core.finished:
        ev = w.enabled()
        w.fire(ev[rnd.randrange(len(ev))])
    check_finished(w)
    return w


def feature_config(n: int, steps: int, groups: int, staleness: int, mechanisms, feature: str) -> SchedulerConfig:
    """A subclass's property test over every core feature ("plain", "resize", "validation", "sampling", "resume"): ``n`` ranks, half training, ``steps`` batches
    of ``groups`` groups, with validation passes, dynamic sampling or a resume as ``feature`` says ("resize" and
    "plain" add nothing here: the caller's script does the resizing)."""
    kw: dict = {}
    if feature == "validation":
        kw["validations"] = ((0, 2), (steps, 1))
    elif feature == "sampling":
        kw["sampling"] = DynamicSampling(need=groups, round_groups=2, max_rounds=2)
    elif feature == "resume":
        steps, kw["resume_step"] = max(steps, 2), 1
    return SchedulerConfig(n, n // 2, (groups,) * steps, staleness=staleness, mechanisms=mechanisms, **kw)
