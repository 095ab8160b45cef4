"""A predictor of the barrier-free pipeline's period: play a candidate split forward on the run's own recent batches.

The capacity model (:mod:`dynaresize.policy.predictor`) predicts a split's rollout as ``tail + work / n_rollout``.
Without a step barrier the pace is also set by the latency chain, which is not monotone in the pool size: a rollout
GPU decodes one weight version at a time, batch ``j`` needs the version of ``T_{j-s-1}``, each GPU holds at most an
even share of a batch in flight, and a GPU's share fits its KV slots in one or several decode waves; so on some
pool sizes two batches are in flight and a step takes half a batch's latency, on others one (docs/simulator.md,
"What the policy's model cannot see").

:class:`PipelinePredictor` plays a split forward with the sample-level simulator's step model, stripped to what
sets the period: per rollout GPU continuous batching with its KV slots (:class:`~dynaresize.policy.decode_rank.DecodeRank`,
the simulator's own decode model: ``iteration_s + sum of the active sequences' per-iteration cost``), the core's
hand-out rules (oldest batch first, one version per GPU, at most an even share of a batch in flight per GPU, claims
when ``claim_groups`` groups of slots are free or the GPU drained, waiting GPUs served when a version arrives), the
versions (``T_k``'s optimizer step makes version ``k + 1``, which reaches the GPUs ``sync_s`` later), streaming
training (a chunk of the batch's finished groups once ``stream_min_groups`` are ready, on ``n_train`` trainers at
the measured per-group cost and data-parallel efficiency) and the control-plane latency per command. The batches
are the run's own recent ones (:class:`~dynaresize.policy.types.PipelineWorkload`, cycled); the period is the
mean step time once the pipeline has filled. Not modelled: switches, preemption.

Mechanisms only the simulator runs are played by the simulator's own plug-in (:class:`PlayHooks`, passed as
``PipelinePredictor(hooks=...)``): the gradient helpers' is ``dynaresize.sim.mechanisms.HelperPlay``, tail
consolidation's ``ConsolidationPlay`` (both: ``ConsolidationHelperPlay``), which the simulator gives its policy when it
runs them. Without it a batch with ``helper_rate > 0`` or ``consolidation_min_gain > 0`` is refused.

Pure and deterministic: the same workloads and split give the same period (no clock, no randomness); results are
memoised by their inputs.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
import math
from typing import Sequence

from dynaresize.policy.decode_rank import DecodeRank
from dynaresize.policy.predictor import efficiency
from dynaresize.policy.types import PipelineWorkload, Topology

PLAY_EPS = 1e-9  # a version counts as arrived this close to its time


class PlayHooks:
    """A mechanism only the simulator runs, inside the forward play (its extension points; the base does nothing).
    ``start`` is called once per play with the play's state (:class:`PlayState`); the others where the play would
    act for the mechanism: a drained GPU left waiting, a GPU left waiting with sequences still decoding (its tail),
    the sequences on their way to a GPU (it takes no work meanwhile), the size of a training chunk, a chunk just
    started (before it is timed), whether batch ``k``'s optimizer step must wait, and an event of a kind of its own
    (``kind >= 4``). ``rank_class``: the decode model of the play's GPUs (a subclass of DecodeRank)."""

    rank_class: type[DecodeRank] = DecodeRank
    moves_tails = False  # whether ``tail`` and ``incoming`` do anything (the play skips them otherwise)

    def start(self, st: "PlayState") -> "PlayHooks":
        return self

    def drained(self, r: int, t: float) -> None:
        pass

    def tail(self, r: int, t: float) -> None:
        pass

    def incoming(self, r: int) -> int:
        return 0

    def chunk_size(self, k: int, take: int) -> int:
        return take

    def chunk_started(self, k: int, t: float) -> None:
        pass

    def step_waits(self, k: int) -> bool:
        return False

    def event(self, kind: int, key: int, t: float) -> None:
        raise ValueError(f"pipeline play: no mechanism handles events of kind {kind}")


class PlayState:
    """What a :class:`PlayHooks` sees of a play in progress: the batches played (``wl``, ``K`` of them), the rollout
    GPUs' decode state (``ranks``, ``token``: the current event of each), the groups ``ready`` to train and
    ``trained`` per batch, ``version_at`` (when a version reaches the GPUs), the trainers' ``rate`` (GPU-equivalents),
    the command latency ``c``, ``ngroups`` per batch, ``waiting`` (GPUs with free slots and nothing to take), ``produced()`` (versions made),
    ``trainers_started[k]``, ``held_v`` (the version each GPU decodes with, None: drained) and ``held_n`` (per GPU,
    batch -> its groups in flight there), ``cursor`` (per batch, its next group never handed out), the staleness
    ``s``, and ``push(t, kind, key)`` (an event) and ``then(r, t)`` (a GPU back from the mechanism: it takes work,
    and its next event is scheduled) and ``maybe_step(t, k)``."""

    __slots__ = ("wl", "K", "ngroups", "ranks", "token", "ready", "trained", "version_at", "rate", "c", "waiting", "produced",
                 "trainers_started", "held_v", "held_n", "cursor", "s", "push", "then", "maybe_step")

    def __init__(self, **kw) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


class PipelinePredictor:
    """``period_s(trace, topo)``: the barrier-free period of ``topo`` on the batches of ``trace`` (oldest first).

    ``warmup_steps`` batches fill the pipeline before the steps measured (``len(trace)`` of them, at least
    ``min_measured``); ``train_scaling_per_doubling`` is the policy's data-parallel efficiency model.
    """

    def __init__(self, train_scaling_per_doubling: float, warmup_steps: int = 11, min_measured: int = 3, cache_size: int = 4096,
                 lookahead_steps: int = 2, hooks: type[PlayHooks] | None = None):
        self.hooks = hooks  # a simulator-only mechanism's play (a PlayHooks class, one instance per play)
        self.per_doubling = train_scaling_per_doubling
        self.warmup = warmup_steps
        self.lookahead = lookahead_steps
        self.min_measured = min_measured
        self.cache_size = cache_size
        self._cache: dict = {}
        self.plays = 0  # forward plays run (the cache's misses), for the bench

    def period_s(self, trace: Sequence[PipelineWorkload], topo: Topology) -> float:
        steps = self.step_times(trace, topo)
        return sum(steps) / len(steps)

    def step_times(self, trace: Sequence[PipelineWorkload], topo: Topology) -> tuple[float, ...]:
        """The played step times once the pipeline has filled (one per measured step; the period is their mean). Two
        splits' step times are paired: step i replays the same batch in both."""
        key = (tuple(trace), topo.n_train, topo.n_rollout)
        got = self._cache.get(key)
        if got is None:
            if len(self._cache) >= self.cache_size:
                self._cache.clear()
            got = self._cache[key] = self._play(tuple(trace), topo)
            self.plays += 1
        return got

    def play_size(self, trace: Sequence[PipelineWorkload]) -> int:
        """The sequences one play of ``trace`` decodes (its cost grows with them)."""
        n = len(trace)
        K = self.warmup + max(n, self.min_measured) + self.lookahead
        return sum(len(trace[(j - self.warmup) % n].lengths) for j in range(K)) if n else 0

    # --- the forward play (pure) -------------------------------------------------------------------------------------
    def _play(self, trace: tuple[PipelineWorkload, ...], topo: Topology) -> tuple[float, ...]:
        if not trace:
            raise ValueError("the pipeline predictor needs at least one observed batch")
        m = max(len(trace), self.min_measured)
        M = self.warmup + m  # batches played to their optimizer step
        K = M + self.lookahead  # and batches behind them, so that the last measured ones share the GPUs as in a run
        # batch j of the play is the trace's batch (j - warmup) mod len(trace): the measured steps see each once
        wl = [trace[(j - self.warmup) % len(trace)] for j in range(K)]
        w0 = trace[-1]
        if self.hooks is None and any(x.helper_rate > 0 for x in trace):
            raise ValueError("the batches have gradient helpers (a simulator-only mechanism): the simulator plays them "
                             "with PipelinePredictor(hooks=dynaresize.sim.mechanisms.HelperPlay)")
        if not (self.hooks is not None and self.hooks.moves_tails) and any(x.consolidation_min_gain > 0 for x in trace):
            raise ValueError("the batches have tail consolidation (a simulator-only mechanism): the simulator plays it "
                             "with PipelinePredictor(hooks=dynaresize.sim.mechanisms.ConsolidationPlay)")
        s, c, sync, G = max(1, w0.staleness), w0.command_latency_s, w0.sync_s, w0.group_size
        n_r, n_t = topo.n_rollout, topo.n_train
        rate = n_t * efficiency(n_t, self.per_doubling)
        ranks = [(DecodeRank if self.hooks is None else self.hooks.rank_class)(r, w0.iteration_s) for r in range(n_r)]
        for dr in ranks:
            dr.slots = wl[0].kv_slots
        held_v: list[int | None] = [None] * n_r  # the version a GPU decodes with (None: drained)
        held_n: list[dict[int, int]] = [dict() for _ in range(n_r)]  # batch -> groups in flight on the GPU
        waiting: set[int] = set()
        cursor = [0] * K  # next group never handed out, per batch
        ngroups = [len(x.lengths) // G for x in wl]
        ready: list[list[int]] = [[] for _ in range(K)]  # finished groups not trained yet
        trained = [0] * K
        version_at = [0.0] + [math.inf] * K  # when version v reaches the GPUs
        produced = 0  # versions made (optimizer steps taken)
        q = max(1, w0.train_queue)  # training commands the trainers hold at once (run in the order sent)
        t_queued = 0  # chunks and the step sent, not done
        stepping = False  # the step of batch ``produced`` is sent
        t_free = 0.0  # when the trainers end what they hold
        trainers_started = [False] * K
        ends = [0.0] * K
        heap: list = []
        seq = 0
        token = [0] * n_r

        def push(t: float, kind: int, key: int, tok: int = 0) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(heap, (t, seq, kind, key, tok))

        def version_of(j: int) -> int:
            return max(0, j - s)

        claim_seqs = G * w0.claim_groups
        first = 0  # the oldest batch with groups never handed out (the cursors only rise)

        def schedule(r: int, t: float) -> None:
            dr = ranks[r]
            nxt = dr.next_group_time()
            active = len(dr.rs) - dr.head  # (dr.active)
            if moves and hook.incoming(r):
                pass  # it claims nothing until the sequences on their way arrive
            elif r not in waiting:
                claim = max(1, min(dr.slots, claim_seqs))
                nxt = min(nxt, dr.claim_time(claim) if (dr.slots - active < claim and active) else t)
            elif active:
                nxt = min(nxt, dr.drain_time())
            token[r] += 1
            if nxt < math.inf:
                push(max(nxt, t), 0, r, token[r])

        def assign(r: int, t: float) -> None:
            """The core's hand-out: oldest batch first, one version per GPU, at most an even share in flight."""
            nonlocal first
            dr = ranks[r]
            dr.advance(t)
            if moves and hook.incoming(r):  # sequences on their way to it: it takes no work until they arrive
                waiting.discard(r)
                return
            active = len(dr.rs) - dr.head  # (dr.active)
            cap = max(1 if active == 0 else 0, (dr.slots - active) // G)
            if cap <= 0:
                waiting.discard(r)
                return
            while first < K and cursor[first] >= ngroups[first]:
                first += 1
            j = first
            last = min(K - 1, produced + s)
            while cap > 0 and j <= last:
                v = version_of(j)
                usable = version_at[v] <= t + PLAY_EPS and (held_v[r] is None or held_v[r] == v)
                room = -(-ngroups[j] // n_r) - held_n[r].get(j, 0)
                if cursor[j] < ngroups[j] and usable and room > 0:
                    n = min(cap, room, ngroups[j] - cursor[j])
                    gs = range(cursor[j], cursor[j] + n)
                    cursor[j] += n
                    x = wl[j]
                    if len(dr.rs) == dr.head:  # (dr.active == 0)
                        dr.slots = x.kv_slots
                    else:
                        dr.slots = min(dr.slots, x.kv_slots)
                    lens = [y for g in gs for y in x.lengths[g * G:(g + 1) * G]]
                    dr.admit(t, lens, x.seq_iteration_s, [(j, g) for g in gs], G, c + x.prefill_s_per_group * n)
                    held_v[r] = v
                    held_n[r][j] = held_n[r].get(j, 0) + n
                    cap = 0 if n == room else cap - n
                j += 1
            if cap > 0:
                waiting.add(r)
                if dr.active == 0 and hook is not None:
                    hook.drained(r, t)
            else:
                waiting.discard(r)

        def try_train(t: float) -> None:
            nonlocal t_queued, t_free
            k = produced
            if t_queued >= q or stepping or k >= K:
                return
            left = ngroups[k] - trained[k]
            if left == 0 or len(ready[k]) < min(w0.stream_min_groups, left):
                return
            take = len(ready[k]) if hook is None else hook.chunk_size(k, len(ready[k]))
            chunk, ready[k] = ready[k][:take], ready[k][take:]
            trained[k] += len(chunk)
            t_queued += 1
            trainers_started[k] = True
            if hook is not None:
                hook.chunk_started(k, t)
            tpg = wl[k].train_s_per_group
            dur = sum(tpg[g] for g in chunk) / rate
            t_free = max(t + c, t_free) + dur  # (train_queue > 1: behind the chunk running)
            push(t_free, 1, k)
            try_step(t, k)  # (train_queue > 1: the step queued behind the batch's last chunk)

        def try_step(t: float, k: int) -> None:
            nonlocal t_queued, stepping, t_free
            if (k == produced and not stepping and t_queued < q and trained[k] == ngroups[k] and not ready[k]
                    and (hook is None or not hook.step_waits(k))):
                t_queued += 1  # the optimizer step
                stepping = True
                t_free = max(t + c, t_free) + w0.step_overhead_s
                push(t_free, 2, k)

        def maybe_step(t: float, k: int) -> None:
            try_step(t, k)
            try_train(t)

        def then(r: int, t: float) -> None:
            assign(r, t)
            schedule(r, t)

        hook = None
        moves = self.hooks is not None and self.hooks.moves_tails
        if self.hooks is not None:
            hook = self.hooks().start(PlayState(
                wl=wl, K=K, ngroups=ngroups, ranks=ranks, token=token, ready=ready, trained=trained, version_at=version_at, rate=rate,
                c=c, waiting=waiting, produced=lambda: produced, trainers_started=trainers_started, held_v=held_v,
                held_n=held_n, cursor=cursor, s=s, push=push, then=then, maybe_step=maybe_step))
        for r in range(n_r):
            assign(r, 0.0)
        for r in range(n_r):
            schedule(r, 0.0)
        while heap and produced < M:
            t, _, kind, key, tok = heapq.heappop(heap)
            if kind == 0:  # a rollout GPU: groups done, slots free, or drained
                r = key
                if tok != token[r]:
                    continue
                dr = ranks[r]
                done = dr.pop_groups(t)
                dr.advance(t)
                for j, g in done:
                    held_n[r][j] -= 1
                    if not held_n[r][j]:
                        del held_n[r][j]
                    ready[j].append(g)
                active = len(dr.rs) - dr.head  # (dr.active)
                if active == 0 and not (moves and hook.incoming(r)):
                    held_v[r] = None
                free = dr.slots - active
                if (free // G > 0 or active == 0) and (active == 0 or free >= max(1, min(dr.slots, claim_seqs))):
                    assign(r, t)
                schedule(r, t)
                if moves and active and r in waiting:  # a tail left waiting: the mechanism may move it
                    hook.tail(r, t)
                if done:
                    try_train(t)
            elif kind == 1:  # a training chunk done
                t_queued -= 1
                maybe_step(t, key)
            elif kind >= 4:  # a simulator-only mechanism's event
                hook.event(kind, key, t)
            elif kind == 2:  # optimizer step done: version key + 1 is made, reaches the GPUs sync_s later
                t_queued, stepping = 0, False
                ends[key] = t
                produced = key + 1
                push(t + c + sync, 3, produced)
                try_train(t)
            else:  # version key reaches the GPUs: waiting GPUs take work
                version_at[key] = t
                for r in sorted(waiting):
                    assign(r, t)
                    schedule(r, t)
        if produced < M:
            raise RuntimeError(f"pipeline play of {topo} stalled at batch {produced}")
        return tuple(ends[k] - ends[k - 1] for k in range(self.warmup, M))


def _trend(ys: Sequence[float], z: float) -> tuple[float, float] | None:
    """Least-squares line ``a + b i`` through ``ys`` (i = 0, 1, ...), or None when its slope is within ``z`` standard
    errors of zero (no drift shown) or there are fewer than 4 points."""
    n = len(ys)
    if n < 4:
        return None
    xm = (n - 1) / 2.0
    ym = sum(ys) / n
    sxx = sum((i - xm) ** 2 for i in range(n))
    b = sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / sxx
    a = ym - b * xm
    sse = sum((y - a - b * i) ** 2 for i, y in enumerate(ys))
    se = math.sqrt(sse / (n - 2) / sxx)
    if b == 0.0 or abs(b) <= z * se:
        return None
    return a, b


def extrapolate(trace: Sequence[PipelineWorkload], lead: float, z: float = 2.0) -> tuple[PipelineWorkload, ...]:
    """The trace as the run will be ``lead`` batches after its newest, where it drifts: each batch's response lengths
    and training per group scaled by the linear trend of the batches' means (its value ``lead`` batches past the
    newest over its value at the batch), and the decode model's per-sequence cost and KV slots set to their trend's
    value there. A quantity whose trend is within ``z`` standard errors of flat is left as observed (a stationary run
    is replayed as it is). Pure."""
    n = len(trace)
    if n < 4 or lead < 0:
        return tuple(trace)
    target = n - 1 + lead

    def factors(ys: Sequence[float]) -> list[float] | None:
        fit = _trend(ys, z)
        if fit is None:
            return None
        a, b = fit
        at = a + b * target
        out = []
        for i in range(n):
            here = a + b * i
            if here <= 0 or at <= 0:
                return None
            out.append(min(2.0, max(0.5, at / here)))
        return out

    fl = factors([sum(w.lengths) / max(1, len(w.lengths)) for w in trace])
    ft = factors([sum(w.train_s_per_group) / max(1, len(w.train_s_per_group)) for w in trace])
    fu = factors([w.seq_iteration_s for w in trace])
    fk = factors([float(w.kv_slots) for w in trace])
    if fl is None and ft is None and fu is None and fk is None:
        return tuple(trace)
    out = []
    for i, w in enumerate(trace):
        ch: dict = {}
        if fl is not None:
            ch["lengths"] = tuple(x * fl[i] for x in w.lengths)
        if ft is not None:
            ch["train_s_per_group"] = tuple(x * ft[i] for x in w.train_s_per_group)
        if fu is not None:
            ch["seq_iteration_s"] = w.seq_iteration_s * fu[i]
        if fk is not None:
            ch["kv_slots"] = max(1, round(w.kv_slots * fk[i]))
        out.append(replace(w, **ch))
    return tuple(out)
