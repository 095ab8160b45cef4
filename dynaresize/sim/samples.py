"""The sample-level simulator: per-GPU continuous batching, driven by the pure scheduler core.

Where the step-level model (:mod:`dynaresize.sim.engine`) prices a whole rollout stage with one formula, this one
follows every rollout GPU: sequences enter and leave its batch, each decode iteration costs
``iteration_fixed_s + sum of the active sequences' per-iteration costs`` (compute and KV reads, from
:class:`~dynaresize.sim.stages.StepPhysics`), and KV memory caps how many sequences a GPU holds. So a GPU whose last
long response decodes alone runs at a few percent of its throughput, and a GPU with nothing left is idle, and both
show in the event log (one ``stage`` interval per rank and batch, from the first admission to the last response).

Who decides what: the :class:`~dynaresize.schedule.PipelineScheduler` (the same core the runtime will drive) hands
out groups, starts training chunks and optimizer steps, sends weight versions and switches roles. This module only
turns its actions into simulated durations and its events into the core's inputs:

- a rollout rank claims work (``RankReady``) when its free slots reach ``claim`` sequences (a few groups) or when
  it has drained; the groups it gets start at once, after their prefill (which stalls that GPU's decoding);
- a group is done when its last response ends (``GroupsDone`` at that exact time);
- a training chunk of groups costs their share of the batch's trained tokens at the trainers' rate
  (``TrainPhysicsConfig``), the optimizer step ``step_overhead_s``; so in the barrier schedule a training stage
  costs exactly what the step-level model says;
- a weight version reaches a rank ``weight_sync_s`` after it was sent (blocking in the barrier pipeline, in the
  background of decoding otherwise: NCCL's copy is assumed not to slow the decode, ASSUMPTION); with charged links
  (``links``: :mod:`dynaresize.sim.links`) when its sender's link, shared with the sender's other transfers, has
  carried it, the sender picked by the runtime's plan (the star or the relay);
- a role switch costs the ops of :class:`~dynaresize.policy.SwitchCostModel`'s plan: the moving ranks' critical ops
  before they work in their new role, the staying trainers' critical ops (and any deferred optimizer state that
  the first forward/backward cannot hide) on the first training chunk of the new trainer set.

The resize policy observes capacities, not overlapping stage times: per finished step, the GPU-seconds its rollout
kept rollout ranks busy and the trainers' compute time, as a barrier-equivalent ``Observation`` (with continuous
rollout and streaming training the longest response counts as no tail: ``TAIL_SHARE_BARRIER_FREE``).

Assumptions beyond the step-level model's (also in docs/simulator.md): claims in chunks of ``claim`` sequences (a
GPU admits new sequences a few groups at a time, not one by one); a GPU holds one weight version at a time; per
sequence, the per-iteration cost uses its batch's mean context; no preemption of running sequences.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from bisect import bisect_right, insort
from itertools import chain
from dataclasses import dataclass, field

import numpy as np

from dynaresize.events import Event, EventType, format_ranks, make_event
from dynaresize.policy import Observation, OpGroup, ResizePolicy, SwitchCostModel, Topology
from dynaresize.policy.decode_rank import DecodeRank
from dynaresize.policy.types import PipelineWorkload
from dynaresize.policy.predictor import efficiency
from dynaresize.schedule import (
    Assign, Decided, Mechanisms, OptimizerStepDone, RankReady, Restart, Role,
    SchedulerConfig, SendWeights, Step, StepMeasured, Switch, SwitchDone, Train, TrainChunkDone, WeightsArrived,
)
from dynaresize.sim.engine import RunResult
from dynaresize.sim.mechanisms import (
    Help, HelpDone, HelperConfig, MovableDecodeRank, consolidation_on, helpers_on, moved_kv_tokens, sim_scheduler,
)
from dynaresize.sim.links import Links, LinkStats
from dynaresize.sim.stages import StageTable

_EPS = 1e-9
_COMMANDS = (Assign, Train, Help, Step, SendWeights)  # what the coordinator sends a rank (command_latency_s each)

# With continuous rollout and streaming training, the share of a batch's longest response decoded alone that the
# policy's observation reports as a rollout tail (the part of the rollout that more GPUs do not shorten): none. The
# next batch's head fills that time, so the rollout is observed as pure capacity (the ranks' mean busy span), as the
# runtime observes it. Measured side by side (docs/simulator.md, "Robustness at sample level"; 24 stationary cases):
# the whole tail made the policy predict a smaller rollout pool far faster than it measured, so it swung between two
# splits (7 of 24 within <= 2 switches and 1%, worst 10.3%); half: 15 of 24, worst 4.2%; none: 16 of 24, worst 2.7%,
# all within 3%. (Before the gradient helpers were priced by their groups' tokens, none lost 7% in taskmix_64gpu.)
TAIL_SHARE_BARRIER_FREE = 0.0

@dataclass
class _BatchInfo:
    lengths: list[list[float]]  # per group, its responses' lengths
    group_size: int
    groups: int
    u: float
    cap: int
    prefill_s: np.ndarray  # per group: its prompt's prefill seconds (once per prompt: the G responses share it)
    prefill_list: list[float]  # the same as a list (a rank's admission sums a few of them in Python)
    train_per_group: np.ndarray  # trainer GPU-seconds at 1 GPU (eff tokens / rate) per group
    tokens_per_group: list[int]  # trained tokens per group (0: dropped), reported with GroupsDone
    samples: int
    tokens_generated: int
    tokens_trained: int
    tail_s: float
    sorted_lengths: list[list[float] | None] = field(default_factory=list)  # per group, its lengths sorted (tail
    # consolidation's KV bytes: made as it first needs them)

    def __post_init__(self) -> None:
        if not self.sorted_lengths:
            self.sorted_lengths = [None] * self.groups


@dataclass
class SampleRunResult(RunResult):
    versions: dict[tuple[int, int], int] = field(default_factory=dict)  # (batch, group) -> version that made it
    busy_rollout_gpu_s: float = 0.0
    busy_train_gpu_s: float = 0.0
    gpus: int = 0
    helps: int = 0  # gradient helps by rollout ranks
    train_work_s: float = 0.0  # the training compute of every chunk and help, single-GPU seconds (no scaling loss)
    helped_work_s: float = 0.0  # of it, what gradient helpers computed
    moves: int = 0  # tail consolidations: a rank's sequences in flight moved to another rank
    moved_sequences: int = 0
    links: LinkStats | None = None  # charged links: what the weight delivery cost


@dataclass(frozen=True)
class SampleSettings:
    """How one sample-level run is driven, besides its world (the stage table, the split, the mechanisms, the switch
    costs and the policy): ``sim.pipeline.*`` and ``switching.costs.deferred_overlap_fraction`` of the config."""

    staleness: int = 1
    log: bool = False  # write the run's event log
    overlap_fraction: float = 0.9  # of a switch's deferred optimizer stage-in hidden behind training
    claim_groups: int = 4  # groups a rollout GPU claims at a time
    stream_chunks: int = 8  # streaming training starts a chunk once 1/stream_chunks of a batch's groups are ready
    record_versions: bool = False  # keep the sample-to-version map (semantics tests)
    helper_rate: float = 0.9
    helper_cost_s: float = 1.2
    tail_share: float = TAIL_SHARE_BARRIER_FREE  # barrier-free observations: the share of the longest response reported as tail
    train_queue: int = 1  # training commands the trainers hold at once, run in order (SchedulerConfig.train_queue)
    # a rollout GPU claims one control-plane latency before its slots free (the runtime's rank holds a group queued
    # beyond its KV slots' worth, so its refills never wait a round trip); off: it claims when they free, and waits the latency
    claim_ahead: bool = False
    # tail consolidation: the moved sequences' KV cache crosses at this rate (GB/s; ASSUMPTION) and a move is made
    # when the freed rank's tail would have lasted ``consolidation_min_gain`` x the move's time
    kv_move_gbps: float = 25.0
    consolidation_min_gain: float = 2.0
    # charged links (sim.pipeline.link_model: star|relay): (relay fan-out, 0 = the star; seconds of one version over one
    # link); None: every rank charged weight_sync_s on its own (the model before issue 46)
    links: tuple[int, float] | None = None


class SamplePipeline:
    """One sample-level simulated run; ``run()`` returns a :class:`SampleRunResult`."""

    READY, TRAIN, STEP, WEIGHTS, SWITCH, HELP, CMD, MOVE, LINK = range(9)  # heap event kinds

    def __init__(self, name: str, table: StageTable, initial: Topology, mechanisms: Mechanisms,
                 costs: SwitchCostModel, policy: ResizePolicy | None = None, settings: SampleSettings = SampleSettings()):
        st = settings
        staleness, overlap_fraction, claim_groups, stream_chunks = st.staleness, st.overlap_fraction, st.claim_groups, st.stream_chunks
        record_versions, helper_rate, helper_cost_s, tail_share = st.record_versions, st.helper_rate, st.helper_cost_s, st.tail_share
        self.name, self.tab, self.costs, self.log = name, table, costs, st.log
        self.tail_share = tail_share  # barrier-free observations: the share of the longest response reported as tail
        self.N, self.K, self.s = initial.total, table.steps, staleness
        self.initial, self.mech, self.policy = initial, mechanisms, policy
        self.helpers = helpers_on(mechanisms)  # gradient helpers (a sim-only mechanism: dynaresize.sim.mechanisms)
        self.overlap, self.claim_groups, self.record = overlap_fraction, claim_groups, record_versions
        sim = table.sim
        self.w = sim.rollout.iteration_fixed_s
        self.sync_s = costs.weight_sync_s()
        self.links = Links(st.links[0], st.links[1]) if st.links is not None else None
        self.train_cfg = sim.train
        self.info: dict[int, _BatchInfo] = {}
        self.samples_of: dict[int, int] = {}  # batch -> its samples (kept when its _BatchInfo is dropped)
        w = sim.workload
        if w.trace is None and not w.dynamic_sampling.enabled:  # every batch has prompts_per_step groups
            groups = (w.prompts_per_step,) * self.K  # (not drawing every batch up front: seconds at 1000 steps)
        else:
            groups = tuple(self.tab.physics(j).batch.prompts_generated for j in range(self.K))
        self.group_size = self._batch(0).group_size  # G: every batch's groups have the same size
        stream_min = max(1, min(groups) // max(1, stream_chunks))
        self.stream_min = stream_min
        self.helper_rate, self.helper_cost_s = helper_rate, helper_cost_s
        self.helper_cfg = HelperConfig(helper_rate, helper_cost_s, train_chunks=stream_chunks,
                                       train_scaling_per_doubling=sim.train.scaling_per_doubling)
        core_cfg = SchedulerConfig(self.N, initial.n_train, groups, staleness, mechanisms, stream_min,
                                   train_queue=st.train_queue)
        core_policy = policy if mechanisms.resize else None
        self.core = sim_scheduler(core_cfg, self.helper_cfg, core_policy)
        self.helping: dict = self.core.helping if self.helpers else {}  # helper rank -> (batch, groups)
        self.consolidate = consolidation_on(mechanisms)  # tail consolidation (sim-only: dynaresize.sim.mechanisms)
        rank_cls = MovableDecodeRank if self.consolidate else DecodeRank
        self.ranks = {r: rank_cls(r, self.w) for r in range(self.N)}
        # consolidation's receivers: per version, the (drain time with the tails on their way, stamp, rank) of the ranks
        # decoding it, sorted, added at each admission and move; an entry whose stamp is not its rank's newest is stale
        self.drains: dict[int, list[tuple[float, int, int]]] = {}
        self.stamp = [0] * self.N
        self.incoming: dict[int, float] = {}  # rank -> the decode seconds moves on their way add to its iterations
        self.kv_move_s_per_token = sim.rollout.kv_bytes_per_token / (st.kv_move_gbps * 1e9)
        self.min_gain = st.consolidation_min_gain
        self.heap: list = []
        self.seq = 0
        self.ev: list[Event] = []
        self.res = SampleRunResult(name, 0.0, 0, self.K, gpus=self.N)
        self.rank_batch: dict[int, dict[int, list[float]]] = {}  # batch -> rank -> [first admission, last end]
        self.train_busy: dict[int, float] = {}  # batch -> trainer compute seconds (wall, on its trainer set)
        self.train_start: dict[int, float] = {}
        self.t_free = 0.0  # when the trainers end the training commands they hold (they run them in the order sent)
        self.prev_trainers: tuple[int, ...] = tuple(range(initial.n_train))
        self.switch_plans: dict[int, tuple[float, float, float, float]] = {}  # sid -> (moving, trainers, bg, overhead)
        self.pending_trainer_cost = 0.0
        self.pending_bg = 0.0
        self.step_mixed: set[int] = set()
        self.open_switches: dict[int, int] = {}  # sid -> ranks still switching
        self.topology_at_step: dict[int, Topology] = {}
        self.busy_start: dict[int, float] = {}  # rollout rank -> when it last went from no sequence to some
        self.topo = initial  # the split the last decision aimed at
        self.latency = sim.command_latency_s  # control-plane latency per command (0: every action at once)
        self.ahead = self.latency if st.claim_ahead else 0.0  # how long before its slots free a GPU claims
        self.in_flight: dict[int, int] = {}  # rank -> sequences assigned to it whose Assign has not arrived yet
        self.claim_max = self.group_size * claim_groups  # sequences a rank claims at most at a time
        self._deferred = -1  # the rank whose event is being handled (its next event is scheduled at the event's end)

    # --- workload -----------------------------------------------------------------------------------------------
    def _batch(self, j: int) -> _BatchInfo:
        bi = self.info.get(j)
        if bi is None:
            ph = self.tab.physics(j)
            b = ph.batch
            G = b.group_size
            n_groups = b.prompts_generated
            L = b.lengths
            per_group_tokens = L.reshape(n_groups, G).sum(axis=1)
            if self.tab.sim.workload.trained_tokens == "sequence":
                per_group_tokens = per_group_tokens + G * b.prompt_lengths
            per_group_tokens = per_group_tokens * b.kept.reshape(n_groups, G)[:, 0]  # dropped groups train nothing
            share = per_group_tokens / max(1.0, float(per_group_tokens.sum()))
            train_gpu_s = ph.train_tokens_eff / self.train_cfg.tokens_per_gpu_s * share
            prefill = b.prompt_lengths / self.tab.sim.rollout.prefill_tokens_per_s
            bi = _BatchInfo(np.asarray(L, dtype=float).reshape(n_groups, G).tolist(), G, n_groups, float(ph.u), ph.cap, prefill, prefill.tolist(), train_gpu_s,
                            np.rint(per_group_tokens).astype(int).tolist(), b.samples, b.tokens_generated, b.tokens_trained,
                            ph.tail_s)
            self.info[j] = bi
            self.samples_of[j] = bi.samples
        return bi

    # --- event plumbing -------------------------------------------------------------------------------------------
    def push(self, t: float, kind: int, key: int, payload=None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, key, payload))

    def emit(self, t: float, etype: EventType, **data) -> None:
        if self.log:
            self.ev.append(make_event(etype, round(t, 6), **data))

    def _schedule_rank(self, rank: int, t: float) -> None:
        dr = self.ranks[rank]
        nxt = dr.groups[dr.gptr][0] if dr.gptr < len(dr.groups) else math.inf  # dr.next_group_time()
        c = self._claim_at(dr)
        if c < nxt:
            nxt = c
        dr.token += 1  # only the newest scheduled event of a rank counts
        if nxt < math.inf:
            self.seq += 1
            heapq.heappush(self.heap, (nxt if nxt > t else t, self.seq, 0, rank, dr.token))  # kind READY

    def _claim_at(self, dr: DecodeRank) -> float:
        core, rank = self.core, dr.rank
        r = core.ranks[rank]
        if r.role is not Role.ROLLOUT or r.lost or r.leaving or rank in self.helping:  # not core.accepting(rank)
            return math.inf  # draining for a switch, or helping the trainers: only its completions matter
        if rank in core.waiting:
            # it waits for work of a new version: the next chance is when it is empty (else woken by the core)
            return dr.drain_time() if len(dr.rs) > dr.head else math.inf  # (dr.active > 0)
        if self.in_flight and self.in_flight.get(rank):
            return math.inf  # an assignment is on its way: its arrival schedules the next claim
        c = dr.claim_time(self._claim_seqs(dr))
        if self.ahead and c < math.inf:  # claim_ahead: asked one command latency before (now, if they free sooner)
            c = max(dr.t_valid, c - self.ahead)
        return c

    def _claim_seqs(self, dr: DecodeRank) -> int:
        return max(1, min(dr.slots, self.claim_max))

    @property
    def G(self) -> int:
        return self.group_size

    # --- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> SampleRunResult:
        """The whole run, with Python's cyclic garbage collector paused (restored after): the run allocates millions
        of short-lived tuples and lists and builds no reference cycle of its own, and the collector's passes over the
        ranks' plans cost 15-25% of the run's CPU time (docs/simulator.md, "Speed")."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if enabled:
                gc.enable()

    def _run(self) -> SampleRunResult:
        t0w = time.perf_counter()
        topo = self.initial
        self.emit(0.0, EventType.TOPOLOGY, step=0, train_ranks=format_ranks(range(topo.n_train)),
                  rollout_ranks=format_ranks(range(topo.n_train, self.N)))
        for r in range(self.N):
            self.ranks[r].slots = self._batch(0).cap
        self.do(0.0, self.core.start())
        for r in self.core.rollout_ranks():
            self.do(0.0, self.core.handle(RankReady(r, self._capacity(self.ranks[r]))))
        for r in self.core.rollout_ranks():
            self._schedule_rank(r, 0.0)
        t = 0.0
        heap, core, steps, pop = self.heap, self.core, self.core.cfg.steps, heapq.heappop
        rank_event = self._rank_event
        while heap and (core.produced != steps or not core.finished):  # (finished: produced == steps and ...)
            t, _, kind, key, payload = pop(heap)
            if kind == 0:  # READY
                rank_event(t, key, payload)
            elif kind == self.TRAIN:
                self.do(t, self.core.handle(TrainChunkDone(key)))
            elif kind == self.STEP:
                self._step_done(t, key)
            elif kind == self.WEIGHTS:
                self.do(t, self.core.handle(WeightsArrived(key, payload)))
                if self.consolidate and self._consolidate(t, key):
                    self._schedule_rank(key, t)
            elif kind == self.SWITCH:
                self._switch_done(t, key, payload)
            elif kind == self.CMD:
                if isinstance(payload, Assign):
                    self.in_flight[payload.rank] -= len(payload.groups) * self.G
                self._apply(t, payload)
            elif kind == self.MOVE:
                self._moved_in(t, key, *payload)
            elif kind == self.LINK:
                self._link_done(t, payload)
            elif kind == self.HELP:
                self.do(t, self.core.handle(HelpDone(key, payload)))
                if self.core.accepting(key):
                    self.do(t, self.core.handle(RankReady(key, self._capacity(self.ranks[key]))))
                    self._schedule_rank(key, t)
        if not self.core.finished:
            raise RuntimeError(f"{self.name}: the simulated pipeline stalled at t={t:.1f}s before step {self.core.produced}")
        r = self.res
        r.total_s = t
        r.links = self.links.stats if self.links is not None else None
        r.samples = sum(self.samples_of[j] if j in self.samples_of else self._batch(j).samples for j in range(self.K))
        r.wall_s = time.perf_counter() - t0w
        if self.log:
            self.ev.sort(key=lambda e: e.t)
            r.events = self.ev
        return r

    def _capacity(self, dr: DecodeRank) -> int:
        coming = self.in_flight.get(dr.rank, 0) if self.in_flight else 0  # assigned, not arrived (command_latency_s > 0 only)
        active = len(dr.rs) - dr.head
        free = dr.slots - active - coming
        return max(1 if active == 0 and not coming else 0, free // self.group_size)

    def _rank_event(self, t: float, rank: int, token: int) -> None:
        dr = self.ranks[rank]
        core = self.core
        crank = core.ranks[rank]
        if token != dr.token or crank.role is not Role.ROLLOUT:
            return
        lim = t + _EPS
        heap, in_flight, G, claim_max = self.heap, self.in_flight, self.group_size, self.claim_max
        ahead = self.ahead
        busy_start, helping, waiting = self.busy_start, self.helping, core.waiting
        helpers, info = self.helpers, self.info
        self._deferred = rank  # its own next event is scheduled below, once (an Assign to it does not schedule one)
        while True:
            groups, p = dr.groups, dr.gptr
            if p < len(groups) and groups[p][0] <= lim:  # dr.pop_groups(t)
                gkey = dr.gkey
                done = []
                while p < len(groups) and groups[p][0] <= lim:
                    done.append(gkey.pop(groups[p][1]))
                    p += 1
                dr.gptr = p
            else:
                done = None
            if dr.planned:  # dr.advance(t)
                dr.head = bisect_right(dr.t_marks, lim, dr.head)
            if t > dr.t_valid:
                dr.t_valid = t
            if done:
                if len(done) == 1:  # (most events: one group)
                    b, g = done[0]
                    self.rank_batch[b][rank][1] = t
                    if helpers:  # self._tokens(b, gs)
                        acts = core.groups_done(rank, b, (g,), ((info.get(b) or self._batch(b)).tokens_per_group[g],))
                    else:
                        acts = core.groups_done(rank, b, (g,))  # core.handle(GroupsDone(...))
                    if acts:
                        self.do(t, acts)
                    by_batch = ()
                else:
                    bb: dict[int, list[int]] = {}
                    for b, g in done:
                        bb.setdefault(b, []).append(g)
                        self.rank_batch[b][rank][1] = t
                    by_batch = bb.items()
                for b, gs in by_batch:
                    if helpers:  # self._tokens(b, gs)
                        tk = self._batch(b).tokens_per_group
                        acts = core.groups_done(rank, b, tuple(gs), tuple([tk[g] for g in gs]))
                    else:
                        acts = core.groups_done(rank, b, tuple(gs))  # core.handle(GroupsDone(...))
                    if acts:
                        self.do(t, acts)
            active = len(dr.rs) - dr.head
            if active == 0:  # self._idle(rank, t)
                s0 = busy_start.pop(rank, None)
                if s0 is not None:
                    self.res.busy_rollout_gpu_s += t - s0
            if crank.role is Role.ROLLOUT and not (in_flight and in_flight.get(rank)):
                if ahead and dr.planned:  # claim_ahead: the slots free when the assignment arrives
                    active = len(dr.rs) - bisect_right(dr.t_marks, t + ahead + _EPS, dr.head)
                free = dr.slots - active  # self._capacity(dr), with nothing on its way
                cap = free // G
                if active == 0 and cap < 1:
                    cap = 1
                claim = dr.slots if dr.slots < claim_max else claim_max  # self._claim_seqs(dr), without min and max
                if claim < 1:
                    claim = 1
                if cap > 0 and (active == 0 or free >= claim):
                    acts = core.rank_ready(rank, cap)  # core.handle(RankReady(rank, cap))
                    if acts:
                        self.do(t, acts)
            if (self.consolidate and len(dr.rs) > dr.head and (crank.leaving or rank in waiting) and dr.t0 <= t
                    and not (in_flight and in_flight.get(rank))):  # (_consolidate's first tests, before the call)
                self._consolidate(t, rank)  # its tail may move, so that it takes the next version's work now
            # self._schedule_rank(rank, t); an event due now with nothing else due now runs here at once (the heap
            # would pop it next: the same order)
            nxt = dr.groups[dr.gptr][0] if dr.gptr < len(dr.groups) else math.inf  # dr.next_group_time()
            # c = self._claim_at(dr), inlined
            if crank.role is not Role.ROLLOUT or crank.lost or crank.leaving or rank in helping:
                c = math.inf
            elif rank in waiting:
                c = dr.t_marks[-1] if len(dr.rs) > dr.head else math.inf  # (a plan exists while it holds sequences)
            elif in_flight and in_flight.get(rank):
                c = math.inf
            else:  # dr.claim_time(self._claim_seqs(dr))
                active = len(dr.rs) - dr.head
                claim = dr.slots if dr.slots < claim_max else claim_max  # self._claim_seqs(dr), without min and max
                if claim < 1:
                    claim = 1
                free = dr.slots - active
                if free >= claim or not dr.planned:
                    c = dr.t_valid
                else:
                    k = min(claim - free, active) - 1
                    c = dr.t_marks[dr.head + k] if k >= 0 else dr.t_valid
                    if ahead:  # claim_ahead: asked one command latency before (now, if they free sooner)
                        c = max(dr.t_valid, c - ahead)
            if c < nxt:
                nxt = c
            dr.token += 1  # only the newest scheduled event of a rank counts
            if nxt < math.inf:
                if nxt <= t and (not heap or heap[0][0] > t) and not (core.produced == core.n_steps and core.finished):
                    if crank.role is not Role.ROLLOUT:
                        break
                    continue
                self.seq += 1
                heapq.heappush(heap, (nxt if nxt > t else t, self.seq, 0, rank, dr.token))  # kind READY
            break
        self._deferred = -1

    # --- tail consolidation (a sim-only mechanism: dynaresize.sim.mechanisms) -----------------------------------------
    def _consolidate(self, t: float, rank: int) -> bool:
        """Move every sequence ``rank`` still decodes to another rank decoding the same version, when the freed rank
        has other work (a newer version's groups, or its switch) and the move pays: the tail would have lasted
        ``min_gain`` x the move's time (the control-plane latency plus the sequences' KV cache, each group's prompt
        once and every sequence's generated tokens, at ``kv_move_gbps``). The receiver has the free slots, drains
        no sooner than this rank, and with the moved sequences' decode added to its iterations (``sum tokens left x
        u``) still no later than the version's last rank; the latest-draining such rank. Whether it moved."""
        core = self.core
        cr = core.ranks[rank]
        v = cr.inflight_version
        dr = self.ranks[rank]
        if (v is None or cr.role is not Role.ROLLOUT or cr.lost or not dr.planned or dr.t0 > t or rank in self.helping
                or (self.in_flight and self.in_flight.get(rank))):
            return False
        d_src = dr.t_marks[-1]
        entries = self.drains.get(v)
        while entries and self._stale(v, entries[-1]):  # the latest entry, once the stale ones after it are dropped
            entries.pop()
        if not entries or entries[-1][0] < d_src:
            return False  # no rank of its version drains later
        if not (cr.leaving or core.other_work(rank)):
            return False
        n, delay = dr.tail_load(t)
        if n == 0:
            return False
        # the receiver first: most attempts that get this far find none, and the KV bytes are then not needed (the
        # search only drops stale entries, so the order of the two tests changes no decision)
        dst = self._receiver(v, rank, t, d_src, delay, n)
        if dst is None:
            return False
        moving = dr.in_flight_at(t)
        kv_tokens = 0.0
        prompt_rate = self.tab.sim.rollout.prefill_tokens_per_s
        for (b, g), left, _ in moving:
            bi = self._batch(b)
            ordered = bi.sorted_lengths[g]
            if ordered is None:
                ordered = bi.sorted_lengths[g] = sorted(bi.lengths[g])
            kv_tokens += moved_kv_tokens(bi.prefill_list[g] * prompt_rate, ordered, left)
        move_s = self.latency + kv_tokens * self.kv_move_s_per_token
        if d_src - t < self.min_gain * move_s:
            return False
        moved = dr.evict(t, moving)
        self.stamp[rank] += 1  # its entries among the receivers are stale
        by_batch: dict[int, list[int]] = {}
        for (b, g), _, _ in moved:
            by_batch.setdefault(b, []).append(g)
        acts: list = []
        for b, gs in by_batch.items():
            self.rank_batch[b][rank][1] = t  # its stage on the batch ends here
            acts.extend(core.move_groups(rank, dst, b, tuple(gs)))
        self._idle(rank, t)
        self.in_flight[dst] = self.in_flight.get(dst, 0) + n
        self.incoming[dst] = self.incoming.get(dst, 0.0) + delay
        self._note_drain(dst, v)  # its entry keyed by its drain with the tails on their way
        self.res.moves += 1
        self.res.moved_sequences += n
        self.push(t + move_s, self.MOVE, dst, (moved, delay))
        self.do(t, acts)
        if core.accepting(rank):
            self.do(t, core.rank_ready(rank, self._capacity(dr)))
        return True

    RECEIVERS_TRIED = 256  # the latest-draining ranks under the ceiling a tail may move to (a bound on the search)

    def _receiver(self, v: int, src: int, t: float, d_src: float, delay: float, n: int) -> int | None:
        """The rank a tail of ``n`` sequences moves to from ``src`` (``_consolidate``): among the ranks decoding
        version ``v``, the latest-draining one that drains no sooner than ``src`` (``d_src``), has ``n`` slots free
        and, with the decode ``delay`` its iterations gain and the tails already on their way to it, still drains no
        later than the version's last rank (the latest of the last 8 to drain); the first of ``RECEIVERS_TRIED`` live
        candidates under that ceiling that qualifies. None if none does. Stale entries are dropped as they are met."""
        entries = self.drains.get(v)
        if not entries:
            return None
        ranks, crank, incoming = self.ranks, self.core.ranks, self.incoming

        def live(i: int) -> float | None:
            """Entry i's drain with the tails on their way, or None for a stale entry (dropped)."""
            if self._stale(v, entries[i]):
                del entries[i]
                return None
            r = entries[i][2]
            return ranks[r].t_marks[-1] + incoming.get(r, 0.0)

        d_max, seen, i = d_src, 0, len(entries) - 1
        while i >= 0 and seen < 8:  # the version's last ranks to drain (the latest of the last 8 live entries)
            d = live(i)
            if d is not None:
                seen += 1
                if d > d_max:
                    d_max = d
            i -= 1
        in_flight, helping = self.in_flight, self.helping
        i = bisect_right(entries, (d_max - delay, math.inf, 0)) - 1
        tried = 0
        while i >= 0 and entries[i][0] >= d_src and tried < self.RECEIVERS_TRIED:
            r = entries[i][2]
            d = live(i)
            if d is None:
                i -= 1
                continue
            tried += 1
            c, x = crank[r], ranks[r]
            if (r != src and d + delay <= d_max and x.t0 <= t and not c.leaving and not c.lost
                    and c.role is Role.ROLLOUT and r not in helping
                    and x.slots - (len(x.rs) - x.head) - in_flight.get(r, 0) >= n):
                return r
            i -= 1
        return None

    def _stale(self, v: int, entry: tuple[float, int, int]) -> bool:
        """Whether a receiver entry of version ``v`` is stale: its rank re-planned since, moved on to another
        version, or drained."""
        _, st, r = entry
        x = self.ranks[r]
        return st != self.stamp[r] or self.core.ranks[r].inflight_version != v or len(x.rs) == x.head

    def _note_drain(self, rank: int, version: int) -> None:
        """``rank`` re-planned its decoding of ``version``, or a tail is on its way to it: a receiver entry with its
        new drain time (the tails on their way included)."""
        dr = self.ranks[rank]
        self.stamp[rank] += 1
        if dr.planned and len(dr.rs) > dr.head:
            entries = self.drains.get(version)
            if entries is None:
                entries = self.drains[version] = []
            insort(entries, (dr.t_marks[-1] + self.incoming.get(rank, 0.0), self.stamp[rank], rank))

    def _moved_in(self, t: float, rank: int, moved: list, delay: float) -> None:
        """Sequences another rank decoded arrive with their KV cache and decode on here (no prefill)."""
        n = sum(len(left) for _, left, _ in moved)
        self.in_flight[rank] -= n
        self.incoming[rank] -= delay
        dr = self.ranks[rank]
        if len(dr.rs) == dr.head:
            self.busy_start.setdefault(rank, t)
        dr.admit_moved(t, moved, self.G)
        for (b, _), _, _ in moved:
            by_rank = self.rank_batch.setdefault(b, {})
            if rank not in by_rank:
                by_rank[rank] = [t, t]
        self._note_drain(rank, self.core.ranks[rank].inflight_version)
        self._schedule_rank(rank, t)

    def _tokens(self, batch: int, groups) -> tuple[int, ...]:
        """The groups' trained tokens, for the helpers' pricing (only then: the core keeps them per group)."""
        if not self.helpers:
            return ()
        tokens = self._batch(batch).tokens_per_group
        return tuple(tokens[g] for g in groups)

    def _idle(self, rank: int, t: float) -> None:
        s = self.busy_start.pop(rank, None)
        if s is not None:
            self.res.busy_rollout_gpu_s += t - s

    # --- actions --------------------------------------------------------------------------------------------------
    def do(self, t: float, actions) -> None:
        if not actions:
            return
        c = self.latency
        for a in actions:
            if c > 0 and isinstance(a, _COMMANDS):
                # the control plane: the command reaches its rank ``command_latency_s`` later; an assignment on its
                # way counts against the rank's free slots meanwhile (so it is not offered the same room twice)
                if isinstance(a, Assign):
                    self.in_flight[a.rank] = self.in_flight.get(a.rank, 0) + len(a.groups) * self.G
                self.push(t + c, self.CMD, 0, a)
            elif type(a) is Assign:  # the most frequent actions, without the match's pattern tests
                self._assign(t, a.rank, a.batch, a.groups, a.version)
            elif type(a) is SendWeights and not (a.blocking and self.log) and self.links is None:
                self.seq += 1
                heapq.heappush(self.heap, (t + self.sync_s, self.seq, self.WEIGHTS, a.rank, a.version))  # self.push
            else:
                self._apply(t, a)

    def _apply(self, t: float, a) -> None:
        match a:
            case Assign(rank, batch, groups, version):
                self._assign(t, rank, batch, groups, version)
            case Train(batch, groups, ranks, first):
                self._train(t, batch, groups, ranks, first)
            case Help(rank, batch, groups):
                bi = self._batch(batch)
                work = float(bi.train_per_group[list(groups)].sum())
                dur = self.helper_cost_s + work / self.helper_rate
                self.res.busy_rollout_gpu_s += dur
                self.res.helps += 1
                self.res.helped_work_s += work
                self.res.train_work_s += work
                if self.log:
                    self.emit(t, EventType.STAGE, step=batch, stage="train", ranks=str(rank), start=round(t, 6),
                              end=round(t + dur, 6), samples=len(groups) * bi.group_size, helper=True)
                self.push(t + dur, self.HELP, rank, batch)
            case Step(batch, ranks):
                dur = self.train_cfg.step_overhead_s
                t = max(t, self.t_free)  # queued behind the batch's last chunk (train_queue > 1)
                self.t_free = t + dur
                self.train_busy[batch] = self.train_busy.get(batch, 0.0) + dur
                self.res.busy_train_gpu_s += dur * len(ranks)
                self.push(t + dur, self.STEP, batch, (t, ranks))
            case SendWeights(rank, version, blocking) if self.links is not None:
                self._link_start(t, self.links.request(t, rank, version), blocking)
            case SendWeights(rank, version, blocking):
                self.push(t + self.sync_s, self.WEIGHTS, rank, version)
                if blocking and self.log:
                    self.emit(t, EventType.STAGE, step=version + self.s, stage="weight_sync", ranks=str(rank),
                              start=round(t, 6), end=round(t + self.sync_s, 6))
            case Switch(rank, to, sid):
                self._switch(t, rank, to, sid)
            case Decided(step, dec, sid):
                self._decided(t, step, dec, sid)
            case Restart():
                raise RuntimeError("a trainer was lost in the simulator (not modelled)")

    def _link_start(self, t: float, transfers, blocking: bool = False) -> None:
        for end, tr in transfers:
            self.push(end, self.LINK, tr.dst, (t, tr, blocking))

    def _link_done(self, t: float, payload) -> None:
        """A transfer over a charged link ended: its receiver holds the version (and may forward it)."""
        asked, tr, blocking = payload
        self._link_start(t, self.links.arrived(t, tr))
        if blocking and self.log:
            self.emit(t, EventType.STAGE, step=tr.version + self.s, stage="weight_sync", ranks=str(tr.dst),
                      start=round(asked, 6), end=round(t, 6))
        self.do(t, self.core.handle(WeightsArrived(tr.dst, tr.version)))
        if self.consolidate and self._consolidate(t, tr.dst):
            self._schedule_rank(tr.dst, t)

    def _assign(self, t: float, rank: int, batch: int, groups: tuple[int, ...], version: int) -> None:
        """The groups' responses start decoding on ``rank`` after their prompts' prefill; the version that makes them
        is recorded."""
        bi = self.info.get(batch) or self._batch(batch)
        dr = self.ranks[rank]
        if len(dr.rs) == dr.head:  # (dr.active == 0)
            dr.slots = bi.cap
            self.busy_start.setdefault(rank, t)  # a rank given work the moment it drained stays busy
        else:
            dr.slots = min(dr.slots, bi.cap)
        if len(groups) < 8:  # numpy sums fewer than 8 numbers from the first, in order: the same, bit for bit
            pf = bi.prefill_list
            prefill = pf[groups[0]]
            for g in groups[1:]:
                prefill += pf[g]
        else:
            prefill = float(bi.prefill_s[list(groups)].sum())
        lengths = bi.lengths
        dr.admit(t, list(chain.from_iterable(map(lengths.__getitem__, groups))), bi.u, [(batch, g) for g in groups],
                 bi.group_size, prefill)
        if self.record:
            for g in groups:
                self.res.versions[(batch, g)] = version
        if self.consolidate:
            self._note_drain(rank, version)
        by_rank = self.rank_batch.get(batch)  # self.rank_batch.setdefault(batch, {}).setdefault(rank, [t, t]),
        if by_rank is None:  # without a dict and a list made for nothing at each admission
            by_rank = self.rank_batch[batch] = {}
        if rank not in by_rank:
            by_rank[rank] = [t, t]
        if rank != self._deferred:  # (inside the rank's own event, its next event is scheduled once, at its end)
            self._schedule_rank(rank, t)

    def _train(self, t: float, batch: int, groups: tuple[int, ...], ranks: tuple[int, ...], first: bool) -> None:
        t = max(t, self.t_free)  # queued behind the chunk the trainers run (train_queue > 1)
        bi = self._batch(batch)
        n = len(ranks)
        eff = efficiency(n, self.train_cfg.scaling_per_doubling)
        work = float(bi.train_per_group[list(groups)].sum())
        self.res.train_work_s += work
        dur = work / (n * eff)
        extra = 0.0
        if first:
            self.train_start[batch] = t
            self.topology_at_step[batch] = Topology(n, max(1, self.N - n))
            if ranks != self.prev_trainers:  # a new trainer set: the staying trainers rebuild first
                extra = self.pending_trainer_cost
                self.pending_trainer_cost = 0.0
                self.step_mixed.add(batch)
                self.prev_trainers = ranks
            full = float(bi.train_per_group.sum()) / (n * eff)
            extra += max(0.0, self.pending_bg - self.overlap * full)  # deferred state the fwd/bwd cannot hide
            self.pending_bg = 0.0
            self.res.critical_s += extra
        self.train_busy[batch] = self.train_busy.get(batch, 0.0) + dur
        self.res.busy_train_gpu_s += (dur + extra) * n
        if self.log:
            self.emit(t, EventType.STAGE, step=batch, stage="train", ranks=format_ranks(ranks), start=round(t, 6),
                      end=round(t + extra + dur, 6), tokens=bi.tokens_trained if first else 0,
                      samples=len(groups) * bi.group_size)
        self.t_free = t + extra + dur
        self.push(t + extra + dur, self.TRAIN, batch)

    def _step_done(self, t: float, batch: int) -> None:
        bi = self._batch(batch)
        self.do(t, self.core.handle(OptimizerStepDone(batch)))
        by_rank = self.rank_batch.pop(batch, {})
        if self.log:
            self.emit(self.train_start.get(batch, t), EventType.STEP_START, step=batch)
            self.emit(t, EventType.STEP_END, step=batch, samples=bi.samples, tokens_generated=bi.tokens_generated,
                      tokens_trained=bi.tokens_trained)
            for rank, (a, e) in by_rank.items():
                self.emit(a, EventType.STAGE, step=batch, stage="rollout", ranks=str(rank), start=round(a, 6),
                          end=round(e, 6), version=max(0, batch - self.s))
        spans = [e - a for a, e in by_rank.values()]
        now = self.core.topology()
        topo = self.topology_at_step.get(batch, now)
        self.res.topologies.append(str(topo))
        if batch < self.K - 1:
            # capacity, not overlapping wall time: while training waits for a whole batch (the barrier, or continuous
            # rollout alone) the batch is ready when its slowest rank is (the longest busy span); with continuous
            # rollout and streaming training a rank that finishes early moves on, so the pool's capacity is the mean,
            # and the longest response's solo time is no tail that more GPUs cannot shorten (the next batch's head
            # fills it): TAIL_SHARE_BARRIER_FREE.
            # Training: the trainers' compute for the whole batch (helpers' groups included) on their set.
            n_r, n_t = max(1, topo.n_rollout), max(1, topo.n_train)
            overlap = self.mech.continuous_rollout and self.mech.streaming_training
            roll = sum(spans) / n_r if overlap else max(spans, default=0.0)
            eff = efficiency(n_t, self.train_cfg.scaling_per_doubling)
            work = float(bi.train_per_group.sum())  # the batch's training compute on one GPU
            train = work / (n_t * eff) + self.train_cfg.step_overhead_s
            obs = Observation(
                step=batch, topology=now, rollout_s=roll, train_s=train, rollout_tail_s=(self.tail_share if overlap else 1.0) * bi.tail_s,
                weight_sync_s=0.0 if self.mech.continuous_rollout else (self.sync_s if batch >= self.s + 1 else 0.0),
                tokens_generated=bi.tokens_generated, tokens_trained=bi.tokens_trained,
                mixed=batch in self.step_mixed or bool(self.core.switching) or topo != now,
                workload=self._workload(bi) if overlap else None,
            )
            per_group = work / bi.groups  # the step's training per group on one GPU
            per_token = work / max(1, sum(bi.tokens_per_group))
            self.do(t, self.core.handle(StepMeasured(obs, self.K - batch - 1, per_group, per_token)))
        self.info.pop(batch - 2, None)
        for v in [v for v in self.drains if v <= batch - self.s]:  # every batch of version v is complete
            del self.drains[v]

    def _workload(self, bi: _BatchInfo) -> PipelineWorkload:
        """The finished batch as the policy's pipeline predictor replays it (its lengths, its training per group, the
        decode model and the pipeline's settings)."""
        return PipelineWorkload(
            tuple(chain.from_iterable(bi.lengths)), bi.group_size, bi.cap, self.w, bi.u,
            float(bi.prefill_s.mean()) if len(bi.prefill_s) else 0.0, tuple(bi.train_per_group.tolist()),
            self.train_cfg.step_overhead_s, self.sync_s, self.latency, self.s, self.claim_groups, self.stream_min,
            self.helper_rate if self.helpers else 0.0, self.helper_cost_s, self.helper_cfg.margin,
            self.helper_cfg.train_chunks, self.core.cfg.train_queue,
            self.min_gain if self.consolidate else 0.0, self.kv_move_s_per_token, self.tab.sim.rollout.prefill_tokens_per_s)

    # --- switches -------------------------------------------------------------------------------------------------
    def _decided(self, t: float, step: int, dec, sid: int | None) -> None:
        if self.log:
            extra = {}
            if dec.resize:
                extra = dict(target_train=dec.target.n_train, target_rollout=dec.target.n_rollout,
                             expected_saving_s=round(dec.expected_saving_s, 6), cost_s=round(dec.critical_cost_s, 6))
            self.emit(t, EventType.DECISION, step=step, action=dec.action.value, reason=dec.reason,
                      imbalance=round(dec.imbalance, 6), **extra)
        if sid is None:
            return
        old = self.topo
        plan = self.costs.plan(old, dec.target)
        crit = {g: 0.0 for g in OpGroup}
        bg = 0.0
        for p in plan:
            if p.critical:
                crit[p.group] += p.cost_s
            elif p.group is OpGroup.TRAINERS:
                bg += p.cost_s
        overhead = sum(p.cost_s for p in plan)
        self.switch_plans[sid] = (crit[OpGroup.MOVING] + crit[OpGroup.ALL], crit[OpGroup.TRAINERS], bg, overhead)
        self.open_switches[sid] = abs(dec.target.n_train - old.n_train)
        self.pending_trainer_cost += crit[OpGroup.TRAINERS]
        self.pending_bg += bg
        self.res.switches += 1
        self.res.overhead_s += overhead
        self.topo = dec.target
        if self.log:
            self.emit(t, EventType.SWITCH_START, switch_id=f"s{sid}", step=step, from_train=old.n_train,
                      from_rollout=old.n_rollout, to_train=dec.target.n_train, to_rollout=dec.target.n_rollout,
                      planned_critical_s=round(dec.critical_cost_s, 6), mode="optimized")
            self.emit(t, EventType.TOPOLOGY, step=step, train_ranks=format_ranks(range(dec.target.n_train)),
                      rollout_ranks=format_ranks(range(dec.target.n_train, self.N)))

    def _switch(self, t: float, rank: int, to: Role, sid: int) -> None:
        moving, _, _, _ = self.switch_plans.get(sid, (0.0, 0.0, 0.0, 0.0))
        dr = self.ranks[rank]
        if self.links is not None:  # its buffers go: it forwards no version from now on
            self.links.leaves(rank)
        if to is Role.TRAIN:
            self._idle(rank, t)
            dr.token += 1
        if self.log:
            self.emit(t, EventType.ROLE_CHANGE, step=self.core.produced, ranks=str(rank),
                      from_role="rollout" if to is Role.TRAIN else "train", to_role=to.value)
            self.emit(t, EventType.SWITCH_OP, switch_id=f"s{sid}", op="offload", ranks=str(rank), start=round(t, 6),
                      end=round(t + moving, 6), critical=True)
        self.push(t + moving, self.SWITCH, rank, sid)

    def _switch_done(self, t: float, rank: int, sid: int) -> None:
        self.do(t, self.core.handle(SwitchDone(rank)))
        if self.core.role(rank) is Role.ROLLOUT:
            dr = self.ranks[rank]
            dr.slots = self._batch(min(self.K - 1, self.core.produced + self.s)).cap
            self.do(t, self.core.handle(RankReady(rank, self._capacity(dr))))
            self._schedule_rank(rank, t)
        self.open_switches[sid] -= 1
        if self.open_switches[sid] == 0 and self.log:
            _, trainers, _, overhead = self.switch_plans[sid]
            self.emit(t, EventType.SWITCH_END, switch_id=f"s{sid}", critical_path_s=round(trainers, 6),
                      hidden_s=round(max(0.0, overhead - trainers), 6))
