"""The pipeline scheduler core: one event-driven state machine for the one-step-off RL pipeline, with or without
its step barrier. Pure: events in, actions out; no Redis, no clock, no randomness. The simulator
(:mod:`dynaresize.sim.samples`) feeds it simulated completions; the runtime coordinator will feed it Redis events.

What it guarantees, whatever the order of the events (``tests/unit/test_schedule_core.py`` checks each):

- every group of every batch is generated exactly once (a lost rank's groups are handed out again), and only by a
  rank holding version ``version_of(batch)`` at the moment it is assigned: the static one-step-off run's
  sample-to-version map, exactly (an extended run's batches past its old end that precede the checkpoint's
  version's own: the checkpoint's version, ``SchedulerConfig.batch_version``);
- every batch is trained exactly once and in order: ``Train`` chunks of batch ``k`` only after ``T_{k-1}``'s
  optimizer step, each group in exactly one chunk, ``Step(k)`` once every group of batch ``k`` went through
  forward/backward (the loss is normalised over the whole batch by the trainer, as in the barrier run);
- a rank has one role at a time; a rank switches only when it holds no work; the trainer set of ``T_k`` is fixed
  from its first chunk to its optimizer step.

Mechanisms (:class:`~dynaresize.schedule.types.Mechanisms`):

- *barrier* (both off): the static one-step-off pipeline. Batch ``j`` opens once batch ``j - 1`` is complete
  and its version exists; then the whole rollout pool receives the version in one blocking sync; ``T_k`` starts once
  batch ``k`` is complete.
- *continuous rollout*: no barrier for the rollout pool. A version is sent to every rollout rank the moment it is
  produced, in the background (double-buffered: ``max_versions_per_rank``); a rank with no work of its current
  version takes groups of the oldest batch whose version it holds, so the next batch's head fills the current
  batch's tail. A rank decodes one version at a time (one engine, one set of weights).
- *streaming training*: ``T_k`` starts on batch ``k``'s complete groups as they arrive (at least
  ``stream_min_groups`` at a time), accumulates, and steps once the batch is complete.
- *resizing* on top: at each ``StepMeasured`` the pure :class:`~dynaresize.policy.ResizePolicy` is consulted;
  rollout ranks at the border stop taking work, drain and switch; trainers at the border leave after the optimizer
  step of the batch they train (at once if that batch has not started). A new trainer joins at the next batch's
  first chunk.

Extension points: a subclass adds a mechanism only the simulator runs (the gradient helpers:
:mod:`dynaresize.sim.mechanisms`) by overriding ``_occupied``, ``_idle``, ``_chunk_limit``, ``_chunk_started``,
``_step_waits`` and ``_rank_lost`` (each documented below, under "extension points"). The core's own mechanisms never
use them and the base versions do nothing, so this class alone is what the runtime drives.

Worked example (2 trainers + 2 rollout ranks, batches of 2 groups, s = 1, continuous rollout and streaming)::

    core = PipelineScheduler(SchedulerConfig(4, 2, (2, 2, 2), mechanisms=Mechanisms(True, True)))
    core.start()                      # -> []   (ranks 2, 3 hold version 0)
    core.handle(RankReady(2, 1))      # -> [Assign(2, batch=0, groups=(0,), version=0)]
    core.handle(RankReady(3, 2))      # -> [Assign(3, 0, (1,), 0), Assign(3, 1, (0,), 0)]  batch 1 is version 0 too
    core.handle(GroupsDone(2, 0, (0,)))  # -> [Train(0, (0,), ranks=(0, 1), first=True)]   streaming: T_0 starts
                                         #    (rank 2 is free again: the driver sends RankReady(2, 1) ...)
    core.handle(RankReady(2, 1))      # -> [Assign(2, 1, (1,), 0)]
    core.handle(TrainChunkDone(0))    # -> []   (group 1 of batch 0 is still decoding on rank 3)
    core.handle(GroupsDone(3, 0, (1,)))  # -> [Train(0, (1,), (0, 1), first=False)]
    core.handle(TrainChunkDone(0))    # -> [Step(0, (0, 1))]
    core.handle(OptimizerStepDone(0)) # -> [SendWeights(2, 1), SendWeights(3, 1)]   version 1, in the background
                                      #    (T_1 waits for a complete group of batch 1)

See docs/schedule.md for the state diagram.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from dynaresize.policy import ResizePolicy, Topology
from dynaresize.policy.types import Decision, PolicyState, ResizeAction
from dynaresize.schedule.types import (
    Assign, Decided, Extend, GroupsDone, OptimizerStepDone, RankLost, RankReady, Restart, Role, ScheduleError,
    SchedulerAction, SchedulerConfig, SchedulerEvent, SendWeights, Step, StepMeasured, Switch, SwitchDone, Train, TrainChunkDone, Validate,
    ValidationDone, WeightsArrived,
)


@dataclass
class _Batch:
    index: int
    groups: int
    version: int
    cursor: int = 0  # next group never handed out
    returned: list[int] = field(default_factory=list)  # groups of lost ranks, handed out again first
    owner: dict[int, int] = field(default_factory=dict)  # group -> rank, while in flight
    held: dict[int, int] = field(default_factory=dict)  # rank -> groups of this batch it has in flight
    done: set[int] = field(default_factory=set)
    ready: list[int] = field(default_factory=list)  # complete groups not yet given to the trainers
    trained: int = 0  # groups given to the trainers
    tokens: dict[int, int] = field(default_factory=dict)  # group -> its trained tokens, where the driver reported them
    ready_tokens: int = 0  # the reported tokens of the ready groups
    ready_untokened: int = 0  # ready groups with no reported tokens
    # dynamic sampling (need > 0): only the first ``need`` informative groups by prompt index are trained
    need: int = 0
    sealed: bool = True  # no extra round can be added any more (always, without dynamic sampling)
    judged: dict[int, bool] = field(default_factory=dict)  # group -> informative (its rewards differ)
    scan: int = 0  # the groups before it are judged and were selected or passed over, in prompt order
    selected: int = 0  # groups selected for training so far
    rounds: int = 0  # extra rounds added
    unfilled: bool = False  # sealed with fewer than ``need`` informative groups and no padding: cannot be trained

    def add_ready(self, groups) -> None:
        self.ready.extend(groups)
        tokens = self.tokens
        for g in groups:  # (self._tally(groups, 1), inline: once per generated group)
            t = tokens.get(g)
            if t is None:
                self.ready_untokened += 1
            else:
                self.ready_tokens += t

    def take_ready(self, groups: tuple[int, ...]) -> None:
        """Remove ``groups`` (ready ones) from the ready list."""
        if tuple(self.ready[:len(groups)]) == groups:
            del self.ready[:len(groups)]
        else:
            gone = set(groups)
            self.ready = [g for g in self.ready if g not in gone]
        self._tally(groups, -1)

    def _tally(self, groups, sign: int) -> None:
        """Keep ``ready_tokens`` and ``ready_untokened`` in step with ``groups`` entering (+1) or leaving (-1)."""
        for g in groups:
            t = self.tokens.get(g)
            if t is None:
                self.ready_untokened += sign
            else:
                self.ready_tokens += sign * t

    @property
    def unclaimed(self) -> bool:
        return bool(self.returned) or self.cursor < self.groups

    @property
    def complete(self) -> bool:
        return len(self.done) == self.groups and self.sealed

    @property
    def train_total(self) -> int:
        """Groups the batch trains: every group, or with dynamic sampling the ``need`` it selects."""
        return self.need or self.groups

    def give_back(self, rank: int) -> bool:
        """A lost rank's groups in flight go back, to be handed out again first; whether it had any."""
        mine = sorted(g for g, owner in self.owner.items() if owner == rank)
        for g in mine:
            del self.owner[g]
        self.held.pop(rank, None)
        if mine:
            self.returned = sorted(self.returned + mine)
        return bool(mine)

    def claim(self, n: int) -> tuple[int, ...]:
        out = self.returned[:n]
        del self.returned[:n]
        take = min(n - len(out), self.groups - self.cursor)
        out.extend(range(self.cursor, self.cursor + take))
        self.cursor += take
        return tuple(out)


@dataclass
class _Rank:
    role: Role | None  # None while switching
    versions: set[int] = field(default_factory=set)  # weight versions held (rollout)
    sending: set[int] = field(default_factory=set)  # versions on their way
    deferred: list[int] = field(default_factory=list)  # versions to send once a buffer is free
    inflight: int = 0
    inflight_version: int | None = None
    capacity: int = 0  # groups the rank asked for and did not get yet
    leaving: bool = False
    to: Role | None = None
    switch_id: int | None = None  # the resize this rank is part of
    lost: bool = False
    newest: int = 0  # the newest version it decoded with or received in place (it cannot go back to an older one)


class PipelineScheduler:
    """The state machine. ``start()`` once, then ``handle(event)`` for every event; both return actions."""

    def __init__(self, cfg: SchedulerConfig, policy: ResizePolicy | None = None):
        self.cfg = cfg
        self.mech = cfg.mechanisms
        self.s = cfg.staleness
        self.policy = policy
        self.policy_state: PolicyState | None = policy.initial_state() if policy is not None else None
        k = cfg.resume_step
        # batches generated before the checkpoint (a resume) wait for training; an extended run's batches past the
        # old end were not: they are generated now, with the checkpoint's version at the oldest (SchedulerConfig.generated)
        gen = cfg.generated_before
        self.fresh = (k, gen) if k > 0 and gen < min(k + self.s, cfg.steps) else None  # (version, first batch)
        self.batches = [_Batch(j, g, cfg.batch_version(j)) for j, g in enumerate(cfg.groups)]
        self.sampling = cfg.sampling
        if self.sampling is not None:
            for b in self.batches:
                b.need, b.sealed = self.sampling.need, False
        self.n_steps = cfg.steps
        self.ranks = [_Rank(Role.TRAIN if r < cfg.n_train else Role.ROLLOUT) for r in range(cfg.n_ranks)]
        for r in self.ranks:
            if r.role is Role.ROLLOUT:
                r.versions.add(k)  # every rank starts from the initial weights (a resume: the checkpoint's)
        self.produced = k  # newest policy version (number of optimizer steps taken)
        for b in self.batches[:gen]:  # trained before the checkpoint, or generated and waiting
            if self.sampling is not None:
                b.sealed = True
                if b.index >= k:  # its rounds and its selection, replayed by the driver from the stored samples
                    b.groups, chosen = cfg.resumed[b.index - k]
                    b.need = b.selected = len(chosen)
                    b.add_ready(chosen)
            b.cursor, b.done = b.groups, set(range(b.groups))
            if b.index < k:
                b.trained = b.train_total
            elif self.sampling is None:
                b.add_ready(range(b.groups))
        self.first_open = min(gen, cfg.steps) if k > 0 else 0  # oldest batch that may still have unclaimed groups
        self.released = self.first_open  # barrier: batches < released are open to the rollout pool
        self.t_queued = 0  # training commands sent and not done yet (chunks, the step): at most cfg.train_queue
        self.t_stepping = False  # the optimizer step of batch ``produced`` is sent
        self.t_ranks: tuple[int, ...] = ()  # trainer set of the batch in training (fixed from its first chunk)
        self.t_started = False
        self.switch_id = 0
        self.switching: set[int] = set()  # ranks leaving their role or running switch ops
        self.waiting: set[int] = set()
        self.restarting = False
        self.n_rollout = cfg.n_ranks - cfg.n_train  # live rollout ranks (for the even share of a batch)
        self.grow_ready: set[int] = set()  # collective switches: drained movers waiting for the others and a boundary
        # validation passes: version -> its held-out groups (one _Batch each; never trained on)
        self.vals: dict[int, _Batch] = {v: _Batch(v, n, v) for v, n in cfg.validations}
        self.vals_abandoned: set[int] = set()  # passes whose returned groups no live rank can generate any more
        for r in self.ranks:
            r.newest = k
        # views over every rank, kept until a rank's role, move or loss changes (``_roles_changed``): they were
        # scanned over all ranks several times a step (4096 at the largest scale)
        self._rollout_view: tuple[int, ...] | None = None  # rollout_ranks()
        self._topology_view: Topology | None = None  # topology()
        self._staying_view: tuple[int, ...] | None = None  # _staying_trainers()

    # --- public views -----------------------------------------------------------------------------------------------
    @property
    def t_busy(self) -> bool:
        """The trainers hold a training command (a chunk or the optimizer step)."""
        return self.t_queued > 0

    @property
    def finished(self) -> bool:
        return self.produced == self.cfg.steps and all(b.complete for b in self.vals.values())

    def validated(self, version: int) -> bool:
        """Whether every group of ``version``'s validation pass was generated (or the pass was abandoned)."""
        return self.vals[version].complete

    def topology(self) -> Topology:
        """The split the pipeline is heading for: trainers (and ranks on their way to training) vs rollout ranks."""
        if self._topology_view is None:
            nt = live = 0
            for r in self.ranks:
                if not r.lost:
                    live += 1
                    if (r.role is Role.TRAIN and not r.leaving) or r.to is Role.TRAIN:
                        nt += 1
            self._topology_view = Topology(max(1, nt), max(1, live - nt))
        return self._topology_view

    def complete(self, batch: int) -> bool:
        """Whether every group of ``batch`` was generated."""
        return self.batches[batch].complete

    def role(self, rank: int) -> Role | None:
        return self.ranks[rank].role

    def versions_counted(self, rank: int) -> tuple[int, ...]:
        """The weight versions the core counts in a rollout rank's buffers (held or on their way). A version it
        dropped as no batch needs it any more is not among them: the rank may free that buffer."""
        r = self.ranks[rank]
        return tuple(sorted(r.versions | r.sending))

    def groups_in_flight(self, rank: int) -> int:
        """Groups handed to a rollout rank (training work and validation) it has not reported done: the one count of
        which groups are where (the runtime sizes a rank's next command from it)."""
        return self.ranks[rank].inflight

    def accepting(self, rank: int) -> bool:
        """Whether a rollout rank takes new work (not lost, not draining for a switch)."""
        r = self.ranks[rank]
        return r.role is Role.ROLLOUT and not r.lost and not r.leaving

    def trainers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.ranks) if r.role is Role.TRAIN and not r.lost)

    def rollout_ranks(self) -> tuple[int, ...]:
        if self._rollout_view is None:
            self._rollout_view = tuple(i for i, r in enumerate(self.ranks) if r.role is Role.ROLLOUT and not r.lost)
        return self._rollout_view

    def _staying_trainers(self) -> tuple[int, ...]:
        """The trainers that are not leaving (the trainer set of a batch that starts now)."""
        if self._staying_view is None:
            self._staying_view = tuple(i for i, r in enumerate(self.ranks)
                                       if r.role is Role.TRAIN and not r.lost and not r.leaving)
        return self._staying_view

    def _roles_changed(self) -> None:
        """A rank's role, move (``leaving``, ``to``) or loss changed: the views over every rank are out of date."""
        self._rollout_view = self._topology_view = self._staying_view = None

    # --- entry points -------------------------------------------------------------------------------------------------
    def start(self) -> list[SchedulerAction]:
        out: list[SchedulerAction] = []
        self._release(out)
        self._try_train(out)  # a resume: the batch generated before the checkpoint trains at once
        return out

    def handle(self, ev: SchedulerEvent) -> list[SchedulerAction]:
        out: list[SchedulerAction] = []
        if self.restarting:
            return out
        tp = type(ev)
        if tp is RankReady:  # the two most frequent events first, without the match's pattern tests
            return self.rank_ready(ev.rank, ev.capacity)
        if tp is GroupsDone:
            return self.groups_done(ev.rank, ev.batch, ev.groups, ev.tokens, ev.kept)
        if tp is WeightsArrived:
            self._weights_arrived(ev.rank, ev.version, out)
        elif tp is ValidationDone:
            self._validation_done(ev.rank, ev.version, ev.groups, out)
        else:
            self._handle_rest(ev, out)
        return out

    def rank_ready(self, rank: int, capacity: int) -> list[SchedulerAction]:
        """``handle(RankReady(rank, capacity))``, without building the event (the simulator's most frequent call)."""
        out: list[SchedulerAction] = []
        if self.restarting:
            return out
        r = self.ranks[rank]
        if r.role is Role.ROLLOUT and not r.lost:  # self._rank(rank, Role.ROLLOUT)
            r.capacity = max(0, capacity)
            self._assign(rank, out)
        return out

    def groups_done(self, rank: int, batch: int, groups: tuple[int, ...], tokens: tuple[int, ...] = (),
                    kept: tuple[bool, ...] = ()) -> list[SchedulerAction]:
        """``handle(GroupsDone(rank, batch, groups, tokens, kept))``, without building the event."""
        out: list[SchedulerAction] = []
        if self.restarting:
            return out
        b = self.batches[batch]
        r = self.ranks[rank]
        if r.lost and any(b.owner.get(g) != rank for g in groups):
            return out  # a late report of a rank already fenced off: its groups were handed out again
        if tokens:
            if len(tokens) != len(groups) or min(tokens) < 0:
                raise ScheduleError(f"rank {rank} reported tokens {list(tokens)} for the {len(groups)} groups "
                                    f"{list(groups)} of batch {batch}: one count >= 0 per group expected")
            b.tokens.update(zip(groups, tokens))
        if self.sampling is not None and len(kept) != len(groups):
            raise ScheduleError(f"rank {rank} reported groups {list(groups)} of batch {batch} without their judgement "
                                f"(dynamic sampling needs one kept flag per group, got {list(kept)})")
        mine = self._finish_groups(b, rank, groups, None)  # (None: "of batch {batch}", built only for the error)
        if self.sampling is None:
            b.add_ready(mine)
        else:
            b.judged.update(zip(groups, kept))
            self._select(b, out)
        if r.inflight == 0:
            r.inflight_version = None
            if r.leaving:
                self._start_switch(rank, out)
        if len(b.done) == b.groups and b.sealed:  # b.complete
            self._prune_and_send(out)
            self._release(out)
            if self.sampling is not None and batch == self.produced:
                self._maybe_step(out)  # its last surplus prompt: the step waited for the whole batch
        if self.t_queued < self.cfg.train_queue:  # (_try_train's own first test)
            self._try_train(out)
        if r.inflight == 0 and not r.leaving:
            self._assign(rank, out)  # a drained rank may move on to the next version
        return out

    def _handle_rest(self, ev: SchedulerEvent, out: list[SchedulerAction]) -> None:
        match ev:
            case TrainChunkDone(batch):
                self._chunk_done(batch, out)
            case OptimizerStepDone(batch):
                self._step_done(batch, out)
            case WeightsArrived(rank, version):
                self._weights_arrived(rank, version, out)
            case SwitchDone(rank):
                self._switch_done(rank, out)
            case RankLost(rank):
                self._lost(rank, out)
            case StepMeasured(obs, steps_left):
                self._measured(obs, steps_left, out)
            case _:
                raise ScheduleError(f"unknown event {ev!r}")

    # --- rollout ----------------------------------------------------------------------------------------------------
    def _weights_arrived(self, rank: int, version: int, out: list[SchedulerAction]) -> None:
        r = self.ranks[rank]
        if version not in r.sending:
            return  # sent before the rank switched roles (a switch drops what was on its way)
        r.sending.discard(version)
        if not r.lost and r.role is Role.ROLLOUT:
            r.versions.add(version)
            if not self.mech.continuous_rollout:
                r.newest = max(r.newest, version)  # the barrier's sync loads the weights in place
            self._assign(rank, out)

    def _rank(self, rank: int, role: Role) -> _Rank | None:
        r = self.ranks[rank]
        return r if r.role is role and not r.lost else None

    def _open(self, j: int) -> bool:
        """Whether the rollout pool may take groups of batch ``j`` (versions aside)."""
        return self.mech.continuous_rollout or j < self.released

    def _assign(self, rank: int, out: list[SchedulerAction]) -> None:
        r = self.ranks[rank]
        if r.role is not Role.ROLLOUT or r.lost or r.leaving or r.capacity <= 0 or self._occupied(rank):
            self.waiting.discard(rank)
            return
        if self.vals:
            self._assign_validation(rank, r, out)
        batches, n_steps = self.batches, self.n_steps
        j = self.first_open
        while j < n_steps and not (batches[j].returned or batches[j].cursor < batches[j].groups):  # .unclaimed
            j += 1
        self.first_open = j
        last = self.produced + self.s  # no later batch has its version yet
        if last >= n_steps:
            last = n_steps - 1  # (min(n_steps - 1, ...) without the call: ~6,000 calls a step at 4096 GPUs)
        cont = self.mech.continuous_rollout
        while r.capacity > 0 and j <= last and (cont or j < self.released):  # self._open(j)
            b = batches[j]
            # unclaimed, usable (it holds the version and decodes no other) and within its even share in flight
            if ((b.returned or b.cursor < b.groups) and b.version in r.versions
                    and (r.inflight == 0 or r.inflight_version == b.version)):
                room = -(-b.groups // max(1, self.n_rollout)) - b.held.get(rank, 0)
                if room > 0:
                    got = self._hand_out(rank, b, min(r.capacity, room), out)
                    r.capacity = 0 if len(got) == room else r.capacity - len(got)  # it asks again when it wants more
            j += 1
        if r.capacity > 0:
            self.waiting.add(rank)
            if r.inflight == 0:
                self._idle(rank, out)
        else:
            self.waiting.discard(rank)

    def _hand_out(self, rank: int, b: _Batch, n: int, out: list[SchedulerAction]) -> tuple[int, ...]:
        """Up to ``n`` groups of batch ``b`` to rollout rank ``rank``: their owner, the rank's groups in flight and its
        version recorded, the ``Assign`` emitted."""
        r = self.ranks[rank]
        got = b.claim(n)
        for g in got:
            b.owner[g] = rank
        b.held[rank] = b.held.get(rank, 0) + len(got)
        r.inflight += len(got)
        r.inflight_version = b.version
        r.newest = max(r.newest, b.version)
        out.append(Assign(rank, b.index, got, b.version))
        return got

    # --- validation ---------------------------------------------------------------------------------------------
    def _assign_validation(self, rank: int, r: _Rank, out: list[SchedulerAction]) -> None:
        """A validation pass of a version this rank holds and has not moved past goes before its training work: the
        pass must be handed out while ranks still hold its version (a rank decodes one version at a time and cannot
        go back to an older one)."""
        for v, b in self.vals.items():
            if r.capacity <= 0:
                return
            if not b.unclaimed or v > self.produced or v not in r.versions or r.newest > v:
                continue
            if r.inflight and r.inflight_version != v:
                continue
            room = -(-b.groups // max(1, self.n_rollout)) - b.held.get(rank, 0)
            if room <= 0:
                continue
            got = b.claim(min(r.capacity, room))
            for g in got:
                b.owner[g] = rank
            b.held[rank] = b.held.get(rank, 0) + len(got)
            r.inflight += len(got)
            r.inflight_version = v
            r.newest = max(r.newest, v)  # it decodes with v now: it cannot go back to an older version
            r.capacity = 0 if len(got) == room else r.capacity - len(got)
            out.append(Validate(rank, v, got))

    def _validation_done(self, rank: int, version: int, groups: tuple[int, ...], out: list[SchedulerAction]) -> None:
        b = self.vals.get(version)
        r = self.ranks[rank]
        if b is None:
            raise ScheduleError(f"rank {rank} reported validation groups of version {version}, which has no pass")
        if self._finish_groups(b, rank, groups, f"of version {version}'s validation pass") is None:
            return
        if r.inflight == 0:
            r.inflight_version = None
            if r.leaving:
                self._start_switch(rank, out)
        if b.complete:
            self._prune_and_send(out)
        if r.inflight == 0 and not r.leaving:
            self._assign(rank, out)

    def _validation_open(self, v: int) -> bool:
        """Barrier: the pool moves to version ``v`` only once every older validation pass was handed out."""
        return not any(b.unclaimed for u, b in self.vals.items() if u < v)

    def _assign_waiting(self, out: list[SchedulerAction]) -> None:
        for rank in sorted(self.waiting):
            self._assign(rank, out)

    def _finish_groups(self, b: _Batch, rank: int, groups: tuple[int, ...], of: str | None) -> list[int] | None:
        """The groups of ``b`` that ``rank`` reports done: checked against what it was given, then no longer its and
        done. None for a late report of a rank already fenced off (its groups were handed out again)."""
        r = self.ranks[rank]
        if len(groups) == 1:  # (most reports: one group, without the comprehension)
            mine = list(groups) if b.owner.get(groups[0]) == rank else []
        else:
            mine = [g for g in groups if b.owner.get(g) == rank]
        if len(mine) != len(groups):
            if r.lost:
                return None
            of = f"of batch {b.index}" if of is None else of
            raise ScheduleError(f"rank {rank} reported groups {sorted(set(groups) - set(mine))} {of} it was not given")
        b.held[rank] -= len(mine)
        for g in mine:
            del b.owner[g]
            b.done.add(g)
        r.inflight -= len(mine)
        return mine

    # --- dynamic sampling ---------------------------------------------------------------------------------------------
    def _select(self, b: _Batch, out: list[SchedulerAction]) -> None:
        """Select, in prompt order, the judged informative groups of ``b`` up to ``need`` (ready for training once every
        earlier prompt is judged); add a round while a shortfall is certain; seal the batch once its selection is fixed
        (padding with the earliest dropped groups after the last round, or marking it unfilled)."""
        ds = self.sampling
        while b.scan < b.groups and b.scan in b.done:
            g = b.scan
            b.scan += 1
            if b.judged[g] and b.selected < b.need:
                b.selected += 1
                b.add_ready((g,))
        if b.sealed:
            return
        informative = sum(1 for v in b.judged.values() if v)
        if informative >= b.need:
            b.sealed = True
            return
        while informative + (b.groups - len(b.done)) < b.need and b.rounds < ds.max_rounds:  # a shortfall is certain
            first = b.groups
            b.groups += ds.round_groups
            b.rounds += 1
            self.first_open = min(self.first_open, b.index)
            out.append(Extend(b.index, b.rounds, tuple(range(first, b.groups))))
        if len(b.done) == b.groups and informative < b.need:  # the last round is in: the selection is what it is
            b.sealed = True
            if ds.pad:
                filler = [g for g in range(b.groups) if not b.judged[g]][:b.need - b.selected]
                b.selected += len(filler)
                b.add_ready(filler)
            if b.selected < b.need:
                b.unfilled = True
        self._assign_waiting(out)

    def unfilled(self, batch: int) -> bool:
        """Dynamic sampling without padding found too few informative groups after its last round: the batch cannot
        be trained (the driver stops the run, naming the setting)."""
        return self.batches[batch].unfilled

    def _release(self, out: list[SchedulerAction]) -> None:
        """Barrier pipeline: open the next batch once the previous one is complete and its version exists; the pool
        then receives the version in one blocking sync."""
        if self.mech.continuous_rollout:
            return
        while self.released < self.cfg.steps:
            j = self.released
            if j > 0 and not self.batches[j - 1].complete:
                return
            v = self.batches[j].version
            if v > self.produced or (self.vals and not self._validation_open(v)):
                return
            self.released += 1
            self._sync_pool(v, out)
            self._assign_waiting(out)
        if self.vals and self.batches[-1].complete:  # the versions only a validation pass uses (the run's last ones)
            for v in self.vals:
                if v <= self.produced and not self._batches_of(v) and self._validation_open(v):
                    self._sync_pool(v, out)
            self._assign_waiting(out)

    def _sync_pool(self, v: int, out: list[SchedulerAction]) -> None:
        """Barrier: version ``v`` to every rollout rank (not leaving) that lacks it, in one blocking sync."""
        for rank in self.rollout_ranks():
            r = self.ranks[rank]
            if v not in r.versions and v not in r.sending and not r.leaving and r.newest <= v:
                # (a rank holding a newer version, a former trainer with staleness >= 2, cannot go back in place)
                r.sending.add(v)
                out.append(SendWeights(rank, v, blocking=True))

    def _batches_of(self, v: int) -> range:
        """The batches generated by version ``v`` (with s = 1: batches 0 and 1 for version 0, then batch v + 1)."""
        lo, hi = (0, self.s + 1) if v == 0 else (v + self.s, v + self.s + 1)
        if self.fresh is not None and v == self.fresh[0]:  # an extended run's first batches, with the checkpoint's
            lo = self.fresh[1]
        return range(lo, min(hi, self.cfg.steps))

    def _needed(self, v: int) -> bool:
        """Whether a batch generated by version ``v`` (or its validation pass) is not complete yet."""
        vb = self.vals.get(v) if self.vals else None
        return any(not self.batches[j].complete for j in self._batches_of(v)) or (vb is not None and not vb.complete)

    def _prune_and_send(self, out: list[SchedulerAction]) -> None:
        """Continuous rollout: drop versions no batch needs any more, then send deferred ones into the free buffers."""
        if not self.mech.continuous_rollout:
            return
        needed: dict[int, bool] = {}  # per version (no batch completes during this loop)
        cap = self.cfg.max_versions_per_rank
        produced = self.produced
        ranks = self.ranks
        for rank in self.rollout_ranks():
            r = ranks[rank]
            if len(r.versions) > 1 and min(r.versions) < produced:  # (else no version is dropped)
                for v in sorted(r.versions):
                    if len(r.versions) > 1 and v != r.inflight_version and v < self.produced:
                        if v not in needed:
                            needed[v] = self._needed(v)
                        if not needed[v]:
                            r.versions.discard(v)
            while r.deferred and len(r.versions) + len(r.sending) < cap:
                v = r.deferred.pop(0)
                r.sending.add(v)
                out.append(SendWeights(rank, v))

    def _send_new_version(self, v: int, out: list[SchedulerAction]) -> None:
        if not self._batches_of(v) and v not in self.vals:
            return  # no batch is generated by this version, nor validated
        if not self.mech.continuous_rollout:
            self._release(out)
            return
        for rank in self.rollout_ranks():
            r = self.ranks[rank]
            if r.leaving:
                continue
            r.deferred.append(v)
        self._prune_and_send(out)

    # --- training -----------------------------------------------------------------------------------------------
    def _try_train(self, out: list[SchedulerAction]) -> None:
        k = self.produced
        if self.t_queued >= self.cfg.train_queue or self.t_stepping or k >= self.cfg.steps or self.restarting:
            return
        b = self.batches[k]
        left = b.train_total - b.trained
        if left == 0 or b.unfilled:
            return
        if self.mech.streaming_training:
            if len(b.ready) < min(self.cfg.stream_min_groups, left):
                return
        elif not b.complete:
            return
        first = not self.t_started
        if first:
            self._trainers_leave_now(out)
            if self.cfg.collective_switch and self._switch_running():
                return  # the trainers take part in the switch: the batch starts on the new trainer set
            self.t_ranks = self._staying_trainers()
            self.t_started = True
        take = len(b.ready)
        limit = self._chunk_limit(b)
        if limit is not None:
            take = min(take, limit)
        chunk = tuple(b.ready[:take])
        b.take_ready(chunk)
        b.trained += len(chunk)
        self.t_queued += 1
        out.append(Train(k, chunk, self.t_ranks, first))
        self._chunk_started(out)
        self._maybe_step(out)  # (train_queue > 1: the step queued behind the batch's last chunk)

    def _maybe_step(self, out: list[SchedulerAction]) -> None:
        """The optimizer step once every group went through forward/backward (and no extension's work on the batch is
        outstanding: ``_step_waits``)."""
        k = self.produced
        if self.t_queued >= self.cfg.train_queue or self.t_stepping or k >= self.cfg.steps:
            return
        b = self.batches[k]
        if b.complete and b.trained == b.train_total and not b.ready and not self._step_waits(k):
            self.t_queued += 1
            self.t_stepping = True
            out.append(Step(k, self.t_ranks))

    def _chunk_done(self, batch: int, out: list[SchedulerAction]) -> None:
        if batch != self.produced or self.t_queued <= self.t_stepping:
            raise ScheduleError(f"training chunk of batch {batch} finished, but batch {self.produced} is in training")
        self.t_queued -= 1
        b = self.batches[batch]
        if b.trained == b.train_total and b.sealed:
            self._maybe_step(out)  # (dynamic sampling: once every prompt of its rounds is generated, as a static run)
        else:
            self._try_train(out)

    def _step_done(self, batch: int, out: list[SchedulerAction]) -> None:
        if batch != self.produced or self.t_queued != 1 or not self.t_stepping:
            raise ScheduleError(f"optimizer step of batch {batch} finished, but batch {self.produced} is in training")
        self.t_queued = 0
        self.t_stepping = False
        self.t_started = False
        self.produced = batch + 1
        for rank in self.t_ranks:
            r = self.ranks[rank]
            if r.leaving and not r.lost:
                self._start_switch(rank, out)
        self._collective_grow(out)
        self._send_new_version(self.produced, out)
        self._try_train(out)
        self._assign_waiting(out)

    def _trainers_leave_now(self, out: list[SchedulerAction]) -> None:
        for rank in sorted(self.switching):  # (a leaving rank is among the switching ones: not a scan of every rank)
            r = self.ranks[rank]
            if r.role is Role.TRAIN and r.leaving and not r.lost:
                self._start_switch(rank, out)

    # --- resizing ------------------------------------------------------------------------------------------------
    def _measured(self, obs, steps_left: int, out: list[SchedulerAction]) -> None:
        if self.policy is None or not self.mech.resize or self.switching:
            return
        cur = self.topology()
        obs = replace(obs, topology=cur, steps_left=steps_left)  # the payback horizon ends with the run
        if self.mech.continuous_rollout and obs.step <= self.s:
            # the pipeline's fill: batches 0..s are all made by version 0, so a rollout rank decodes several of them at
            # once and each one's busy span counts their shared time: no step of the split's steady state
            obs = replace(obs, mixed=True)
        self.policy_state, dec = self.policy.step(self.policy_state, obs)
        if not dec.resize or dec.target == cur or dec.target.total != cur.total:
            out.append(Decided(obs.step, dec))
            return
        sid = self.switch_id
        self.switch_id += 1
        out.append(Decided(obs.step, dec, sid))
        delta = dec.target.n_train - cur.n_train
        if delta > 0:  # rollout ranks at the border become trainers
            movers = [i for i in self.rollout_ranks() if not self.ranks[i].leaving][:delta]
            for rank in movers:  # every mover is marked before any starts (a collective switch waits for all)
                r = self.ranks[rank]
                r.leaving, r.to, r.switch_id = True, Role.TRAIN, sid
                self.switching.add(rank)
                self.waiting.discard(rank)
                r.capacity = 0
            self._roles_changed()
            for rank in movers:
                if self.ranks[rank].inflight == 0 and not self._occupied(rank):
                    self._start_switch(rank, out)
        else:  # trainers at the border become rollout ranks after the step they are in
            movers = [i for i in self.trainers() if not self.ranks[i].leaving][delta:]
            for rank in movers:
                r = self.ranks[rank]
                r.leaving, r.to, r.switch_id = True, Role.ROLLOUT, sid
                self._roles_changed()
                self.switching.add(rank)
                if not (self.t_started and rank in self.t_ranks):
                    self._start_switch(rank, out)

    def _switch_running(self) -> bool:
        return any(r.role is None and r.to is not None and not r.lost for r in self.ranks)

    def _collective_grow(self, out: list[SchedulerAction]) -> None:
        """Collective switches: the rollout ranks moving to training of one resize switch together, once all of them
        are drained and the trainers are between two batches."""
        if not self.grow_ready or self.t_started or self.t_busy:
            return
        for sid in sorted({self.ranks[r].switch_id for r in self.grow_ready}):
            movers = [i for i, r in enumerate(self.ranks) if r.switch_id == sid and r.to is Role.TRAIN and not r.lost]
            if all(i in self.grow_ready for i in movers):
                for i in movers:
                    self.grow_ready.discard(i)
                    self._start_switch(i, out, now=True)

    def _start_switch(self, rank: int, out: list[SchedulerAction], now: bool = False) -> None:
        r = self.ranks[rank]
        if r.role is None:
            return
        if self.cfg.collective_switch and r.to is Role.TRAIN and not now:
            self.grow_ready.add(rank)
            self._collective_grow(out)
            return
        if r.role is Role.ROLLOUT:
            self.n_rollout -= 1
        r.role = None
        r.leaving = False
        self._roles_changed()
        r.versions.clear()
        r.sending.clear()
        r.deferred.clear()
        out.append(Switch(rank, r.to, r.switch_id))

    def _switch_done(self, rank: int, out: list[SchedulerAction]) -> None:
        r = self.ranks[rank]
        if r.role is not None or r.to is None:
            raise ScheduleError(f"rank {rank} finished a switch it was not told to make")
        r.role, r.to, r.switch_id = r.to, None, None
        self._roles_changed()
        self.switching.discard(rank)
        if r.lost:
            return
        if r.role is Role.ROLLOUT:
            self.n_rollout += 1
            r.versions = {self.produced}  # a former trainer holds the newest weights
            r.newest = self.produced
            self._release(out)
            if self.cfg.collective_switch:
                self._try_train(out)  # the trainers that stayed took part in the switch
        else:
            self._try_train(out)
            # the last rollout rank was lost while this one was leaving for training (still counted a rollout rank
            # then): only now is none left; the pipeline stalled with the lost rank's groups to generate
            self._rescue(out)

    # --- faults ------------------------------------------------------------------------------------------------
    def _lost(self, rank: int, out: list[SchedulerAction]) -> None:
        r = self.ranks[rank]
        if r.lost:
            return
        r.lost = True
        self._roles_changed()
        self.waiting.discard(rank)
        self.switching.discard(rank)
        if r.role is Role.TRAIN:  # its optimizer state and gradients are gone: the runtime's restart path
            self.restarting = True
            out.append(Restart(rank, f"trainer rank {rank} lost: every rank restarts from the newest checkpoint"))
            return
        if r.role is Role.ROLLOUT:
            self.n_rollout -= 1
        returned = False
        for b in self.batches[self.produced:]:  # batches before it are complete
            if b.give_back(rank):
                self.first_open = min(self.first_open, b.index)
                returned = True
        for v, b in self.vals.items():
            returned = b.give_back(rank) or returned
            if b.returned and not any(v in self.ranks[i].versions and self.ranks[i].newest <= v
                                      for i in self.rollout_ranks()) and v < self.produced:
                b.done.update(b.returned)  # no live rank holds the version any more: the pass cannot be finished
                b.cursor, b.returned = b.groups, []
                self.vals_abandoned.add(v)
        r.inflight, r.capacity, r.inflight_version = 0, 0, None
        self._rank_lost(rank, out)
        if returned:
            self._assign_waiting(out)
        if rank in self.grow_ready:
            self.grow_ready.discard(rank)
            self._collective_grow(out)  # the other movers of its resize may go now
        self._rescue(out)

    def _rescue(self, out: list[SchedulerAction]) -> None:
        """The last rollout rank was lost and work is left to generate: the border trainer moves to rollout (a resize
        the core makes itself, like a policy's; with one trainer left nothing can move and the driver restarts)."""
        if self.n_rollout > 0 or any(x.to is Role.ROLLOUT and not x.lost for x in self.ranks):
            return
        if all(b.complete for b in self.batches) and all(b.complete for b in self.vals.values()):
            return
        movable = [i for i in self.trainers() if not self.ranks[i].leaving]
        if len(movable) < 2:
            self.restarting = True
            out.append(Restart(movable[0] if movable else 0, "no rollout rank is left and one trainer cannot be "
                               "split: every rank restarts from the newest checkpoint"))
            return
        rank = movable[-1]
        # The mover holds the newest version once it is a rollout rank: a trainer in the middle of a batch leaves at
        # that batch's optimizer step (which waits for the batch's groups), with the version after it; a batch of an
        # older version still to generate can then never be (a rank does not go back to an older version in place).
        holds = self.produced + (1 if self.t_started and rank in self.t_ranks else 0)
        stuck = [b.index for b in self.batches if not b.complete and b.version < holds]
        if stuck:
            self.restarting = True
            out.append(Restart(rank, f"no rollout rank is left and batch {stuck[0]} still has groups to generate "
                               f"with version {self.batches[stuck[0]].version}, which the trainer that would move "
                               f"to rollout no longer holds (it holds version {holds}): every rank restarts from the "
                               "newest checkpoint"))
            return
        sid = self.switch_id
        self.switch_id += 1
        dec = Decision(ResizeAction.RESIZE, Topology(len(movable) - 1, 1), "no rollout rank left: a trainer moves to rollout")
        out.append(Decided(max(0, self.produced - 1), dec, sid))
        r = self.ranks[rank]
        r.leaving, r.to, r.switch_id = True, Role.ROLLOUT, sid
        self._roles_changed()
        self.switching.add(rank)
        if not (self.t_started and rank in self.t_ranks):
            self._start_switch(rank, out)

    # --- extension points ------------------------------------------------------------------------------------------
    # A mechanism the runtime does not drive lives in a subclass, never here (dynaresize.sim.mechanisms: the gradient
    # helpers). These are the only places a subclass hooks in; each base version does nothing, so without a subclass
    # the core is exactly the state machine above. A subclass may read the core's state and call its steps
    # (``_assign``, ``_try_train``, ``_maybe_step``, ``_start_switch``), and move groups in flight between rollout ranks
    # of their version inside the core (tail consolidation's ``move_groups``); it must keep the contract in the module
    # docstring (its tests drive it through the same random-order world as the core's).
    def _occupied(self, rank: int) -> bool:
        """Whether rollout rank ``rank`` is busy with work other than generation (it takes no groups, and a resize
        that moves it waits for that work to end; the subclass starts the switch then)."""
        return False

    def _idle(self, rank: int, out: list[SchedulerAction]) -> None:
        """Rollout rank ``rank`` has room, holds no groups and has nothing of a version it holds to generate: it
        waits (in ``waiting``) for a version or for work handed back."""

    def _chunk_limit(self, b: _Batch) -> int | None:
        """The most ready groups of ``b`` the next training chunk takes (None: every ready one)."""
        return None

    def _chunk_started(self, out: list[SchedulerAction]) -> None:
        """A training chunk was just handed to the trainers (its ``Train`` is the last action in ``out``)."""

    def _step_waits(self, batch: int) -> bool:
        """Whether ``batch``'s optimizer step waits for work outside the trainers' chunks (every group trained)."""
        return False

    def _rank_lost(self, rank: int, out: list[SchedulerAction]) -> None:
        """Rollout rank ``rank`` was lost; its groups in flight are already handed back."""


def replay(cfg: SchedulerConfig, events: Sequence[SchedulerEvent], policy: ResizePolicy | None = None) -> list[list[SchedulerAction]]:
    """Feed ``events`` to a fresh core; the actions of ``start()`` then of each event (for replay tests)."""
    core = PipelineScheduler(cfg, policy)
    return [core.start()] + [core.handle(e) for e in events]
