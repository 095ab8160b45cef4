"""Mechanisms only the simulator runs, added to the scheduler core through its extension points.

A mechanism lives in the shared core (:mod:`dynaresize.schedule`) only if the runtime drives it (issue 25). The
gradient helpers pay in the simulator (docs/simulator.md, "Gradient helpers: simulator only") but the runtime has none,
so they live here: :class:`HelpingScheduler` is the core's :class:`~dynaresize.schedule.PipelineScheduler` with the
helpers' state and logic, plugged into the core's documented extension points (``_occupied``, ``_idle``,
``_chunk_limit``, ``_chunk_started``, ``_step_waits``, ``_rank_lost``). The sample-level simulator
(:mod:`dynaresize.sim.samples`) builds it when ``sim.pipeline.gradient_helpers`` is on; nothing under
``dynaresize/job`` imports this module.

Gradient helpers (within-step role flow): in a training-bound step the rollout ranks finish batch ``k + s`` with
version ``k`` and wait for ``k + 1``; they hold exactly the weights ``T_k`` computes gradients with. The trainers then
take batch ``k`` in micro-chunks (``HelperConfig.train_chunks``); an idle rollout rank with no generation work of a
version it holds takes some of the groups not yet trained (``Help``), computes their gradient and sends it
(``HelpDone``); the optimizer step waits for it (the gradients add up: the same sum, the loss normalised over the
whole batch). A lost helper's groups go back to the trainers. Assumed for a real system (not built there): the helper
has the samples' old and reference logprobs from the rollout and the trainers (it holds no reference model).

Worked example (1 trainer, 2 rollout ranks, batches of 4 groups, continuous rollout, a helper as fast as a trainer
with a 0.1 s cost; tests/unit/test_sim_mechanisms.py walks it)::

    core = HelpingScheduler(SchedulerConfig(3, 1, (4, 4, 4), mechanisms=SimMechanisms(True, gradient_helpers=True)),
                            HelperConfig(rate=1.0, cost_s=0.1, train_chunks=4))
    ...                                   # batch 0 complete, T_0 trains group 0 (1 s a group); rank 2 generated
    core.handle(RankReady(2, 4))          # batch 1 with version 0 and waits for version 1
    -> [Help(2, 0, (3,))]                 # 3 groups left: the trainer alone 3 s, with the helper max(2, 1 + 0.1) s
    core.handle(HelpDone(2, 0))           # its gradient is in; the step waits for the trainer's chunks only
"""

from __future__ import annotations

from dataclasses import dataclass

from dynaresize.policy import ResizePolicy
from dynaresize.policy.decode_rank import _EPS, DecodeRank
from dynaresize.policy.pipeline_predictor import PLAY_EPS, PlayHooks, PlayState
from dynaresize.policy.predictor import efficiency
from dynaresize.schedule import Mechanisms, PipelineScheduler, Role, ScheduleError, SchedulerConfig, StepMeasured


HELP_DONE = 4  # the pipeline play's event kind of a help done (the play's own kinds are 0-3)
TAIL_MOVED = 5  # the pipeline play's event kind of a moved tail arriving at its receiver


def help_share(total: float, trate: float, rate: float, cost: float, margin: float) -> float:
    """The training compute one more helper should take of ``total`` (ready groups on one GPU), the trainers' rate
    ``trate`` against the helper's ``rate`` and ``cost`` per help: ``(total / trate - cost) / (1 / trate + 1 / rate)``,
    or 0 when not even a helper filling that share would end the batch's training sooner by more than
    ``(margin - 1) x cost``. The core's helpers and the predictor's play price a help alike."""
    share = (total / trate - cost) / (1.0 / trate + 1.0 / rate)
    if share <= 0 or total / trate - max((total - share) / trate, share / rate + cost) <= (margin - 1.0) * cost:
        return 0.0
    return share


@dataclass(frozen=True, slots=True)
class SimMechanisms(Mechanisms):
    """The core's mechanisms plus the ones only the simulator runs."""

    gradient_helpers: bool = False  # idle rollout ranks holding the training version compute gradients of the batch
    tail_consolidation: bool = False  # a draining rank's last sequences move, with their KV cache, to a rank decoding the same version

    @property
    def label(self) -> str:
        parts = [n for n, on in (("continuous", self.continuous_rollout), ("streaming", self.streaming_training),
                                 ("helpers", self.gradient_helpers), ("consolidation", self.tail_consolidation)) if on]
        return "+".join(parts) or "barrier"


def helpers_on(mech: Mechanisms) -> bool:
    """Whether ``mech`` turns the gradient helpers on (a plain core ``Mechanisms`` never does)."""
    return isinstance(mech, SimMechanisms) and mech.gradient_helpers


def consolidation_on(mech: Mechanisms) -> bool:
    """Whether ``mech`` turns tail consolidation on (a plain core ``Mechanisms`` never does)."""
    return isinstance(mech, SimMechanisms) and mech.tail_consolidation


@dataclass(frozen=True, slots=True)
class HelperConfig:
    """The gradient helpers' pricing (every figure an ASSUMPTION; the simulator's from ``sim.pipeline``)."""

    rate: float = 0.9  # a helper's forward/backward rate relative to one trainer GPU
    cost_s: float = 1.0  # a helper's own overhead per help: leave decoding, send its gradient, come back
    margin: float = 1.5  # a helper joins only when its predicted saving exceeds its cost times this
    train_chunks: int = 8  # the trainers take a batch in chunks of 1/train_chunks of its groups
    train_scaling_per_doubling: float = 0.95  # data-parallel efficiency kept per doubling of trainers


# --- the helpers' action and event (the simulator's alone: the core's vocabulary has neither) ----------------------
@dataclass(frozen=True, slots=True)
class Help:
    """Idle rollout rank ``rank`` computes the gradient of ``groups`` of ``batch`` with the version it holds, which
    is the version ``T_batch`` trains from (it generated the next batch with it), and sends it to the trainers; the
    optimizer step waits for it. The loss stays normalised over the whole batch (the gradients add up)."""

    rank: int
    batch: int
    groups: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HelpDone:
    """Gradient helper ``rank`` finished forward/backward over its groups of ``batch`` and sent the gradient."""

    rank: int
    batch: int


class HelpingScheduler(PipelineScheduler):
    """The core with gradient helpers (``cfg.mechanisms`` a :class:`SimMechanisms` with ``gradient_helpers``).

    Besides the core's events it takes :class:`HelpDone` and reads ``StepMeasured``'s training compute per group and
    per token (the helpers' pricing); besides the core's actions it returns :class:`Help`."""

    def __init__(self, cfg: SchedulerConfig, helpers: HelperConfig = HelperConfig(), policy: ResizePolicy | None = None):
        super().__init__(cfg, policy)
        self.hcfg = helpers
        self.helping: dict[int, tuple[int, tuple[int, ...]]] = {}  # helper rank -> (batch, groups)
        self.gpu_s_per_group = 0.0  # the newest measured training compute per group on one GPU
        self.gpu_s_per_token = 0.0  # the same per trained token (0: not measured)

    def handle(self, ev):
        if type(ev) is HelpDone:
            out: list = []
            if not self.restarting:
                self._help_done(ev.rank, ev.batch, out)
            return out
        if type(ev) is StepMeasured and not self.restarting:
            if ev.train_gpu_s_per_group > 0:
                self.gpu_s_per_group = ev.train_gpu_s_per_group
            if ev.train_gpu_s_per_token > 0:
                self.gpu_s_per_token = ev.train_gpu_s_per_token
        return super().handle(ev)

    # --- the core's extension points ------------------------------------------------------------------------------
    def _occupied(self, rank: int) -> bool:
        return rank in self.helping

    def _idle(self, rank: int, out: list) -> None:
        self._offer_help(rank, out)

    def _chunk_limit(self, b) -> int:
        """Micro-chunks, so that helpers who fall idle meanwhile can take the rest."""
        return max(1, -(-b.train_total // self.hcfg.train_chunks))

    def _chunk_started(self, out: list) -> None:
        """At each training chunk: the idle ranks may help with what is left (a rank falling idle later is offered
        help in ``_idle``)."""
        if self.gpu_s_per_group > 0 and self.batches[min(self.produced, self.n_steps - 1)].ready:
            # the versions of the batches with groups to hand out: no help changes them, so once for every rank
            last = min(self.n_steps - 1, self.produced + self.s)
            gen = {self.batches[j].version for j in range(self.first_open, last + 1) if self.batches[j].unclaimed}
            k, ranks = self.produced, self.ranks
            if k >= self.n_steps or not self.t_started:
                return  # (_offer_help's first test: no rank helps)
            for rank in sorted(self.waiting):
                # most waiting ranks hold groups (hundreds a chunk at 4096 GPUs): _offer_help's test of the rank,
                # here, before the call (it answers True for such a rank: the next one)
                r = ranks[rank]
                if r.inflight or k not in r.versions:
                    continue
                if not self._offer_help(rank, out, gen):
                    return  # not worth a helper now, for any rank (each help only shrinks what is left)

    def _step_waits(self, batch: int) -> bool:
        return any(hb == batch for hb, _ in self.helping.values())

    def _rank_lost(self, rank: int, out: list) -> None:
        helped = self.helping.pop(rank, None)
        if helped is not None:  # its gradient is lost: the trainers compute those groups again
            hb = self.batches[helped[0]]
            hb.add_ready(helped[1])
            hb.trained -= len(helped[1])
            self._try_train(out)
            self._maybe_step(out)

    # --- the helpers ------------------------------------------------------------------------------------------------
    def _group_cost(self, b, g: int) -> float:
        """Training compute of group ``g`` of ``b`` on one GPU: by its reported tokens where known, else the mean."""
        t = b.tokens.get(g) if self.gpu_s_per_token > 0 else None
        return self.gpu_s_per_group if t is None else t * self.gpu_s_per_token

    def _help_groups(self) -> tuple[int, ...]:
        """Ready groups of the batch in training that one more helper should take now (none: a helper would not pay).

        The share balances the trainers' rest against the helper's groups plus its cost: with ``C`` the ready groups'
        training compute on one GPU, ``r`` the trainers' rate (GPUs x efficiency) and ``h`` the helper's, the helper
        takes up to ``(C / r - cost_s) / (1 / r + 1 / h)`` of it, and the batch's training must end sooner by more
        than ``(margin - 1) x cost_s``. Each group is priced by its reported tokens where the driver reports them
        (``GroupsDone.tokens``), else at the measured mean per group: the groups that complete last are the longest,
        and priced at the mean a helper taking them finished long after the trainers. The helper takes from the newest
        ready groups (the trainers take the oldest), skipping one that would overshoot its share."""
        c = self.hcfg
        nt = len(self.t_ranks)
        if not self.t_started or nt == 0 or self.gpu_s_per_group <= 0 or self.produced >= self.n_steps:
            return ()
        b = self.batches[self.produced]
        if not b.ready:
            return ()
        trate = nt * efficiency(nt, c.train_scaling_per_doubling)
        if self.gpu_s_per_token > 0:
            total = b.ready_tokens * self.gpu_s_per_token + b.ready_untokened * self.gpu_s_per_group
        else:
            total = len(b.ready) * self.gpu_s_per_group
        share = help_share(total, trate, c.rate, c.cost_s, c.margin)
        if share <= 0:
            return ()  # not even a helper filling its whole share would pay
        need = (c.margin - 1.0) * c.cost_s
        mean = total / len(b.ready)
        scan = 4 * int(share / mean) + 16 if mean > 0 else len(b.ready)  # enough to fill the share, bounded
        chosen: list[int] = []
        acc = 0.0
        for g in reversed(b.ready[-scan:]):
            cost = self._group_cost(b, g)
            if acc + cost <= share:
                chosen.append(g)
                acc += cost
        if not chosen:
            return ()
        saving = total / trate - max((total - acc) / trate, acc / c.rate + c.cost_s)
        return tuple(reversed(chosen)) if saving > need else ()

    def _offer_help(self, rank: int, out: list, gen: set[int] | None = None) -> bool:
        """An idle rollout rank that holds version ``k`` (it generated batch ``k + s`` with it and waits for the next
        version) computes the gradient of some of batch ``k``'s groups not yet trained, when the batch's training then
        ends sooner by more than ``(margin - 1) x cost_s`` (``_help_groups``). False when a helper would not pay now,
        whichever rank it were. ``gen``: the versions of the batches from ``first_open`` to the newest open one that
        have unclaimed groups, where the caller knows them."""
        k = self.produced
        if k >= self.n_steps or self.gpu_s_per_group <= 0 or not self.t_started:
            return False
        r, b = self.ranks[rank], self.batches[k]
        if not (b.ready and r.inflight == 0 and k in r.versions and r.role is Role.ROLLOUT and not r.lost
                and not r.leaving and rank not in self.helping):  # (self.accepting(rank): the same tests)
            return True
        if gen is None:
            last = min(self.n_steps - 1, self.produced + self.s)
            generate = any(self.batches[j].unclaimed and self.batches[j].version in r.versions
                           for j in range(self.first_open, last + 1))
        else:
            generate = not gen.isdisjoint(r.versions)
        if generate:
            return True  # generation comes first: it waits for its even share of a batch, not for a version
        groups = self._help_groups()
        if not groups:
            return False
        b.take_ready(groups)
        b.trained += len(groups)
        self.helping[rank] = (k, groups)
        self.waiting.discard(rank)
        r.capacity = 0
        out.append(Help(rank, k, groups))
        return True

    def _help_done(self, rank: int, batch: int, out: list) -> None:
        got = self.helping.pop(rank, None)
        if got is None or got[0] != batch:
            if self.ranks[rank].lost:
                return
            raise ScheduleError(f"rank {rank} finished helping batch {batch} it was not helping")
        self._maybe_step(out)
        r = self.ranks[rank]
        if r.leaving and r.inflight == 0:
            self._start_switch(rank, out)


class HelperPlay(PlayHooks):
    """The gradient helpers in the policy's pipeline predictor (:mod:`dynaresize.policy.pipeline_predictor`): the
    simulator's policy plays them when the simulator runs them (``ResizePolicy(..., pipeline_hooks=HelperPlay)``,
    ``PipelinePredictor(..., hooks=HelperPlay)``). As the core prices a help (:meth:`HelpingScheduler._offer_help`): a drained GPU holding
    the version of the batch in training takes a share of its ready groups when the batch's training then ends sooner
    by more than (margin - 1) x the cost; the trainers take micro-chunks (1/``train_chunks`` of the batch) so that
    helpers who fall idle meanwhile can take the rest; the optimizer step waits for the helps."""

    __slots__ = ("st", "helping", "open", "memo")

    def start(self, st: PlayState) -> "HelperPlay":
        self.st = st
        self.memo: tuple = (None, None)  # _help's last key and answer
        self.helping: dict[int, int] = {}  # rollout GPU -> the batch in training it computes gradients of
        self.open = [0] * st.K  # per batch: helps not finished
        return self

    def drained(self, r: int, t: float) -> None:
        self._offer(r, t)

    def chunk_size(self, k: int, take: int) -> int:
        x = self.st.wl[k]
        if x.helper_rate > 0:
            return min(take, max(1, -(-self.st.ngroups[k] // max(1, x.train_chunks))))
        return take

    def chunk_started(self, k: int, t: float) -> None:
        st = self.st
        if st.ready[k]:
            for r in sorted(st.waiting):
                if st.ranks[r].active == 0 and st.ready[k]:
                    self._offer(r, t)

    def step_waits(self, k: int) -> bool:
        return self.open[k] != 0

    def event(self, kind: int, key: int, t: float) -> None:
        if kind != HELP_DONE:
            super().event(kind, key, t)
        k = self.helping.pop(key)  # a help done: the GPU is a rollout GPU again
        self.open[k] -= 1
        self.st.maybe_step(t, k)
        self.st.then(key, t)

    def _help(self, t: float) -> tuple[int, list[int], float] | None:
        """The help a GPU holding the training version would take now, as the core prices it: the batch in training,
        its ready groups chosen (newest first) and their compute; None if no help pays. The price is memoised by the
        ready groups (tail consolidation asks at many rank events in a row)."""
        st = self.st
        k = st.produced()
        x = st.wl[k] if k < st.K else None
        ready = st.ready
        if (x is None or x.helper_rate <= 0 or not st.trainers_started[k] or not ready[k]
                or st.version_at[k] > t + PLAY_EPS):
            return None
        key = (k, tuple(ready[k]))
        if key == self.memo[0]:
            return self.memo[1]
        got = self._price(k, x)
        self.memo = (key, got)
        return got

    def _price(self, k: int, x) -> tuple[int, list[int], float] | None:
        st = self.st
        ready = st.ready
        tpg, rate = x.train_s_per_group, st.rate
        total = sum(tpg[g] for g in ready[k])
        share = help_share(total, rate, x.helper_rate, x.helper_cost_s, x.helper_margin)
        if share <= 0:
            return None
        chosen, acc = [], 0.0
        for g in reversed(ready[k]):
            if acc + tpg[g] <= share:
                chosen.append(g)
                acc += tpg[g]
        return (k, chosen, acc) if chosen else None

    def _offer(self, r: int, t: float) -> None:
        st = self.st
        got = None if r in self.helping else self._help(t)
        if got is None:
            return
        k, chosen, acc = got
        x, ready = st.wl[k], st.ready
        h, hc = x.helper_rate, x.helper_cost_s
        ready[k] = [g for g in ready[k] if g not in set(chosen)]
        st.trained[k] += len(chosen)
        self.open[k] += 1
        self.helping[r] = k
        st.waiting.discard(r)
        st.token[r] += 1
        st.push(t + st.c + hc + acc / h, HELP_DONE, r)



# --- tail consolidation ----------------------------------------------------------------------------------------------
# A rollout rank decodes one weight version at a time. Once its share of a batch is handed out, its last sequences
# decode a few per iteration, each iteration paying the GPU's fixed cost, and the rank cannot take the next version's
# groups until they end. Tail consolidation hands those sequences, with their KV cache, to a rank still decoding the
# same version with free slots (``ConsolidatingScheduler.move_groups``); the freed rank takes the next version's work
# (or switches roles, if it was leaving). The same weights generate the same sequences from the same prefix: the
# sample-to-version map, the batches and the loss normalisation stay the static run's. Simulator only: the runtime
# has no generate resumed from another rank's KV cache (docs/simulator.md, "Tail consolidation: simulator only").


class Consolidating:
    """The core's side of tail consolidation (a mixin on the core; ``sim_scheduler`` builds the class): who holds which
    groups after a move, and whether a rank freed now would get other work."""

    def move_groups(self, src: int, dst: int, batch: int, groups: tuple[int, ...]) -> list:
        """Groups of ``batch`` in flight on rollout rank ``src`` continue on ``dst`` (which decodes their version or
        nothing, and holds it): their owner, both ranks' groups in flight and ``dst``'s version change. A rank left
        with nothing moves on as after its last ``GroupsDone``: it switches if it was leaving, else it is offered
        work (the driver then sends its ``RankReady``). Raises ``ScheduleError`` for a move the core cannot make."""
        out: list = []
        if self.restarting:
            return out
        b = self.batches[batch]
        rs, rd = self.ranks[src], self.ranks[dst]
        bad = None
        if src == dst or not groups:
            bad = "needs two ranks and at least one group"
        elif any(b.owner.get(g) != src for g in groups):
            bad = f"moves groups {sorted(g for g in groups if b.owner.get(g) != src)} that rank {src} does not hold"
        elif rd.role is not Role.ROLLOUT or rd.lost or rd.leaving or self._occupied(dst):
            bad = f"sends them to rank {dst}, which does not take rollout work"
        elif b.version not in rd.versions or (rd.inflight and rd.inflight_version != b.version) or rd.newest > b.version:
            bad = f"sends them to rank {dst}, which does not decode version {b.version}"
        if bad:
            raise ScheduleError(f"tail consolidation of batch {batch} from rank {src} to rank {dst} {bad}")
        n = len(groups)
        for g in groups:
            b.owner[g] = dst
        b.held[src] -= n
        b.held[dst] = b.held.get(dst, 0) + n
        rs.inflight -= n
        rd.inflight += n
        rd.inflight_version = b.version
        if rs.inflight == 0:
            rs.inflight_version = None
            if rs.leaving:
                self._start_switch(src, out)
            else:
                self._assign(src, out)
        return out

    def other_work(self, rank: int) -> bool:
        """Whether rollout rank ``rank``, once it holds nothing, could take groups of another version it holds now
        (the first batch of such a version with groups unclaimed within its even share)."""
        r = self.ranks[rank]
        v = r.inflight_version
        last = min(self.n_steps - 1, self.produced + self.s)
        cont = self.mech.continuous_rollout
        for j in range(self.first_open, last + 1):
            if not (cont or j < self.released):
                break
            b = self.batches[j]
            if (b.version != v and b.version in r.versions and b.version >= r.newest and b.unclaimed
                    and -(-b.groups // max(1, self.n_rollout)) > b.held.get(rank, 0)):
                return True
        return False


class ConsolidatingScheduler(Consolidating, PipelineScheduler):
    """The core with tail consolidation."""


class ConsolidatingHelpingScheduler(Consolidating, HelpingScheduler):
    """The core with gradient helpers and tail consolidation: a freed rank may also help the trainers."""

    def other_work(self, rank: int) -> bool:
        """As the core's, or: the rank holds the version of the batch in training and a helper would pay now."""
        if super().other_work(rank):
            return True
        k = self.produced
        return (k < self.n_steps and k in self.ranks[rank].versions and self.gpu_s_per_group > 0 and self.t_started
                and bool(self._help_groups()))


def sim_scheduler(cfg: SchedulerConfig, helpers: HelperConfig, policy: ResizePolicy | None) -> PipelineScheduler:
    """The scheduler the sample-level simulator drives for ``cfg.mechanisms``: the core itself, or the core with the
    simulator's mechanisms that are on."""
    mech = cfg.mechanisms
    if consolidation_on(mech):
        if helpers_on(mech):
            return ConsolidatingHelpingScheduler(cfg, helpers, policy)
        return ConsolidatingScheduler(cfg, policy)
    if helpers_on(mech):
        return HelpingScheduler(cfg, helpers, policy)
    return PipelineScheduler(cfg, policy)


class MovableDecodeRank(DecodeRank):
    """A rollout GPU whose sequences in flight can leave it (tail consolidation)."""

    def _left(self, t: float) -> tuple[list[float], list[float], list[int]] | None:
        """The sequences still decoding at ``t``, in plan order: the tokens each has left, its per-iteration cost and
        its local group id; None if none is. Not during an admission's prefill pause (the plan must have started)."""
        self.advance(t)
        head = self.head
        if head == len(self.rs):
            return None
        if t < self.t0:
            raise ValueError(f"rank {self.rank}: no eviction during a prefill pause (t={t}, the plan starts at {self.t0})")
        left = self.rs[head:]
        if t > self.t0:
            d = self._done_iterations(t)
            left = [max(r - d, _EPS) for r in left]
        _, us, gs = self._ids()
        return left, us[head:], gs[head:]

    def in_flight_at(self, t: float) -> list[tuple[tuple[int, int], list[float], float]]:
        """The sequences still decoding at ``t``, per group: ``((batch, group), tokens left of each of its sequences
        still decoding, their per-iteration cost)``, in plan order (``_left``, grouped)."""
        got = self._left(t)
        if got is None:
            return []
        by_gid: dict[int, tuple[list[float], float]] = {}
        for r, u, g in zip(*got):
            seqs = by_gid.get(g)
            if seqs is None:
                by_gid[g] = ([r], u)
            else:
                seqs[0].append(r)
        return [(self.gkey[g], rs, u) for g, (rs, u) in by_gid.items()]

    def tail_load(self, t: float) -> tuple[int, float]:
        """What ``in_flight_at(t)`` lists, summed without the per-group lists (most tails looked at do not move): its
        sequences, and the decode they add to a receiver's iterations, the sum over its groups in plan order of
        ``u x`` the group's tokens left (the same floating-point operations in the same order as summing that list)."""
        got = self._left(t)
        if got is None:
            return 0, 0.0
        per: dict[int, list[float]] = {}
        for r, u, g in zip(*got):
            acc = per.get(g)
            if acc is None:
                per[g] = [r, u]
            else:
                acc[0] += r
        delay = 0.0
        for left, u in per.values():
            delay += u * left
        return len(got[0]), delay

    def evict(self, t: float, listed: list | None = None) -> list[tuple[tuple[int, int], list[float], float]]:
        """Take every sequence still decoding at ``t`` off this GPU (what ``in_flight_at(t)`` lists; ``listed``: that
        list, where the caller has it already). Groups that ended by ``t`` stay, to be reported."""
        out = self.in_flight_at(t) if listed is None else listed
        if not out:
            return out
        moved = {key for key, _, _ in out}
        self.gkey = {gid: key for gid, key in self.gkey.items() if key not in moved}
        ended = [g for g in self.groups[self.gptr:] if g[0] <= t + _EPS]
        self.planned, self.rs, self.an, self.us, self.gs, self.fresh, self.u_same = False, [], [], [], [], None, None
        self.t_marks, self.cost, self.head, self.groups, self.gptr = [], [], 0, ended, 0
        return out

    def admit_moved(self, t: float, moved: list, group_size: int) -> None:
        """Sequences another GPU decoded (what its ``evict`` returned) arrive with their KV cache and decode on here:
        no prefill; one admission per per-iteration cost."""
        by_u: dict[float, list] = {}
        for item in moved:
            by_u.setdefault(item[2], []).append(item)
        for u, items in by_u.items():
            self.admit(t, [x for _, left, _ in items for x in left], u, [key for key, _, _ in items], group_size, 0.0,
                       [len(left) for _, left, _ in items])

    def tail_decode(self, t: float) -> float:
        """``tail_load(t)``'s decode, summed in one pass (the pipeline play's; the simulator keeps ``tail_load``'s order
        of additions): the per-iteration cost x tokens left of every sequence still decoding."""
        head = self.head
        d = self._done_iterations(t) if t > self.t0 else 0.0
        if self.u_same is not None:
            return self.u_same * max(0.0, sum(self.rs[head:]) - (len(self.rs) - head) * d)
        _, us, _ = self._ids()
        return sum(u * max(r - d, 0.0) for r, u in zip(self.rs[head:], us[head:]))


def moved_kv_tokens(prompt_tokens: float, ordered: list[float], left: list[float]) -> float:
    """The KV cache a moved group carries, in tokens: its prompt and what its sequences still decoding generated (a
    group's sequences decode together, so the longest of its ``ordered`` lengths are the ones ``left``)."""
    return prompt_tokens + sum(ordered[-len(left):]) - sum(left)


class ConsolidationPlay(PlayHooks):
    """Tail consolidation in the policy's pipeline predictor (:mod:`dynaresize.policy.pipeline_predictor`): the
    simulator's policy plays it when the simulator runs it (``ConsolidationHelperPlay`` with the gradient helpers), so
    that the play check and the pipeline predictor see the moves it makes. As the simulator decides a move
    (``SamplePipeline._consolidate``): a GPU left waiting with sequences still decoding, while work of another
    version it holds waits (:meth:`_other_work`), hands them with their KV cache to the latest-draining GPU decoding
    the same version that has the free slots, drains no sooner, and with their decode added (and the tails already on
    their way to it) still drains no later than the version's last GPU; when the tail would have lasted
    ``consolidation_min_gain`` x the move's time (the command latency plus each group's prompt and generated tokens at
    ``kv_move_s_per_token``). The sequences decode on at the receiver after the move; it takes no work meanwhile. A
    play, not the simulator: the receiver is the best over every GPU of the version (the simulator searches its
    latest-draining ones), and the prompt's KV is the batch's mean."""

    rank_class = MovableDecodeRank
    moves_tails = True

    def start(self, st: PlayState) -> "ConsolidationPlay":
        super().start(st)
        self.st = st
        self.coming: dict[int, tuple[int, float]] = {}  # GPU -> sequences on their way to it, the decode they add
        self.moving: dict[int, tuple[int, list]] = {}  # a move on its way -> its receiver and what it carries
        self.moves = 0
        return self

    def incoming(self, r: int) -> int:
        got = self.coming.get(r)
        return got[0] if got else 0

    def _other_work(self, r: int, t: float) -> bool:
        """Whether GPU ``r``, once drained, could take groups of another version that has reached it (the first batch of
        such a version with groups never handed out within its even share), as the core's ``other_work``."""
        st = self.st
        v, n_r, s = st.held_v[r], len(st.ranks), st.s
        k = st.produced()
        for j in range(k, min(st.K - 1, k + s) + 1):
            vj = max(0, j - s)
            if (vj != v and st.version_at[vj] <= t + PLAY_EPS and st.cursor[j] < st.ngroups[j]
                    and -(-st.ngroups[j] // n_r) > st.held_n[r].get(j, 0)):
                return True
        return False

    def tail(self, r: int, t: float) -> None:
        st = self.st
        dr = st.ranks[r]
        v = st.held_v[r]
        helping, coming, ranks, held_v = getattr(self, "helping", ()), self.coming, st.ranks, st.held_v
        n = len(dr.rs) - dr.head
        if v is None or not n or not dr.planned or dr.t0 > t or r in helping or r in coming or not self._other_work(r, t):
            return  # (most attempts end at the last test: nothing else waits for the GPU)
        d_src = d_max = dr.t_marks[-1]
        cands = []  # the version's other GPUs that drain no sooner and have the slots: (drain, GPU)
        for q in range(len(ranks)):
            if held_v[q] != v or q == r:
                continue
            y = ranks[q]
            a = len(y.rs) - y.head
            if not a:
                continue
            got = coming.get(q)
            d = y.t_marks[-1] + (got[1] if got else 0.0)  # its drain with the tails on their way
            if d > d_max:
                d_max = d
            if d >= d_src and y.t0 <= t and q not in helping and y.slots - a - (got[0] if got else 0) >= n:
                cands.append((d, q))
        if not cands:
            return
        delay = dr.tail_decode(t)
        best = max((c for c in cands if c[0] + delay <= d_max), default=None)  # the latest-draining that still fits
        if best is None:
            return
        dst = best[1]
        moving = dr.in_flight_at(t)
        kv_tokens = 0.0
        for (j, g), left, _ in moving:
            x = st.wl[j]
            G = x.group_size
            kv_tokens += moved_kv_tokens(x.prefill_s_per_group * x.prefill_tokens_per_s,
                                         sorted(x.lengths[g * G:(g + 1) * G]), left)
        x = st.wl[moving[0][0][0]]
        move_s = st.c + kv_tokens * x.kv_move_s_per_token
        if d_src - t < x.consolidation_min_gain * move_s:
            return
        moved = dr.evict(t, moving)
        src_n, dst_n = st.held_n[r], st.held_n[dst]
        for (j, _), _, _ in moved:
            src_n[j] -= 1
            if not src_n[j]:
                del src_n[j]
            dst_n[j] = dst_n.get(j, 0) + 1
        if not src_n:
            st.held_v[r] = None
        got = self.coming.get(dst, (0, 0.0))
        self.coming[dst] = (got[0] + n, got[1] + delay)
        self.moves += 1
        self.moving[self.moves] = (dst, moved, n, delay)
        st.push(t + move_s, TAIL_MOVED, self.moves)
        st.then(r, t)

    def event(self, kind: int, key: int, t: float) -> None:
        if kind != TAIL_MOVED:
            super().event(kind, key, t)
            return
        st = self.st
        dst, moved, n, delay = self.moving.pop(key)
        got = self.coming[dst]
        if got[0] == n:
            del self.coming[dst]
        else:
            self.coming[dst] = (got[0] - n, got[1] - delay)
        st.ranks[dst].admit_moved(t, moved, st.wl[moved[0][0][0]].group_size)
        st.then(dst, t)


class ConsolidationHelperPlay(ConsolidationPlay, HelperPlay):
    """Tail consolidation and the gradient helpers in the play: a GPU's tail may also move so that it helps the
    trainers (as ``ConsolidatingHelpingScheduler.other_work``)."""

    def _other_work(self, r: int, t: float) -> bool:
        return super()._other_work(r, t) or (self.st.held_v[r] is not None and self._help(t) is not None)


def play_hooks(mech: Mechanisms) -> type[PlayHooks] | None:
    """The simulator-only mechanisms of ``mech`` as the policy's pipeline predictor plays them (None: none)."""
    helpers, consolidation = helpers_on(mech), consolidation_on(mech)
    if consolidation:
        return ConsolidationHelperPlay if helpers else ConsolidationPlay
    return HelperPlay if helpers else None
