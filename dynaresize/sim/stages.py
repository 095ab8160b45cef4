"""Stage times from physics: rollout with memory-bound decode and dynamic dispatch, training from tokens.

Rollout on n GPUs (all sequences of a step dispatched to a shared queue; a GPU takes the next request when it has
a free slot; at most ``cap`` sequences per GPU, from KV-cache memory and the scheduler limit):

- a decode iteration on a GPU holding ``a`` sequences costs ``iteration_fixed_s + a x u`` with
  ``u = compute_per_seq_s + context x kv_bytes_per_token / hbm`` (memory-bound: reading the weights dominates
  until the batch is large; each sequence adds its KV-cache reads and its compute);
- active sequences are spread evenly over the GPUs (``a = active / n``), but a GPU never holds less than one: when
  fewer sequences than GPUs remain, each runs alone at ``1 / (iteration_fixed_s + u)`` tokens/s. That is the long
  tail: a few long responses at low utilisation, which more GPUs cannot shorten.

When every sequence fits at once (N <= n x cap), the active count after the j-th shortest response finishes is
N - j and the time has a closed form over the sorted lengths (``_uncapped``), O(1) per n after one sort. When it
does not fit, sequences queue and a list schedule (a heap over n x cap slots, in dispatch order) gives each
sequence's start and end in decode iterations (``_capped``).

Assumptions (also in docs/simulator.md): context per sequence is the step's token-weighted mean (prompt +
E[L^2] / 2E[L]); prefill happens once per prompt (prefix caching) at ``prefill_tokens_per_s``; no preemption.
``sim.rollout.model = empirical`` (a calibrated CPU run): rollout_s(n) = overhead + tokens_generated / (n x rate),
no decode physics, prefill or KV cap; the tail is the overhead.
Training: tokens x (1 + attention_per_context_token x context) / (tokens_per_gpu_s x n x eff(n)) + step_overhead_s,
eff(n) = scaling_per_doubling ** log2 n (context: the token-weighted mean position in a sample, ``train_context``).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

import numpy as np

from dynaresize.sim.config import SimConfig
from dynaresize.sim.workload import Batch, make_batch

CAPPED_EXACT = 2048  # sequences above which the capped list schedule runs on a thinned sample


def train_context(batch: Batch) -> float:
    """Token-weighted mean context of a trained token: E[S^2] / 2E[S] over samples S = prompt + response (causal
    attention: the token at position i attends to i tokens; prompt lengths taken at their mean)."""
    L, p = batch.lengths, batch.prompt_mean
    m1 = p + float(L.mean())
    m2 = p * p + 2 * p * float(L.mean()) + float((L * L).mean())
    return m2 / (2 * m1)


class StepPhysics:
    """Stage times of one step's batch for any number of GPUs."""

    def __init__(self, sim: SimConfig, batch: Batch):
        r = sim.rollout
        self.batch = batch
        L = np.sort(batch.lengths)
        self.N = len(L)
        self.lmax = float(L[-1])
        m1, m2 = float(L.mean()), float((L * L).mean())
        ctx = batch.prompt_mean + m2 / (2 * m1)
        self.w = r.iteration_fixed_s
        self.u = r.compute_per_seq_s + ctx * r.kv_bytes_per_token / (r.hbm_gbps * 1e9)
        self.cap = max(1, min(r.max_seqs_per_gpu, int(r.kv_cache_gb * 1e9 // max(1.0, r.kv_bytes_per_token * ctx))))
        self.prefill = batch.prompt_tokens / r.prefill_tokens_per_s
        dL = np.diff(L, prepend=0.0)
        active = self.N - np.arange(self.N, dtype=np.float64)
        self._cum_hi = np.cumsum(dL * active)  # sum_{j<=i} dL_j * a_j
        self._L = L
        self.tail_s = self.lmax * (self.w + self.u)
        self._empirical = (r.empirical_overhead_s, batch.tokens_generated / r.empirical_tokens_per_gpu_s) if r.model == "empirical" else None
        if self._empirical is not None:
            self.tail_s = r.empirical_overhead_s  # the part more GPUs do not shorten
        t = sim.train
        self.train_tokens_eff = batch.tokens_trained * (1.0 + t.attention_per_context_token * train_context(batch))
        self._train = (self.train_tokens_eff / t.tokens_per_gpu_s, t.scaling_per_doubling, t.step_overhead_s)

    def rollout_s(self, n: int) -> float:
        return float(self.rollout_many(np.array([n]))[0])

    def rollout_many(self, ns: np.ndarray) -> np.ndarray:
        ns = np.asarray(ns, dtype=np.int64)
        if self._empirical is not None:
            overhead, work = self._empirical
            return overhead + work / ns
        out = np.empty(len(ns), dtype=np.float64)
        capped = self.N > ns * self.cap
        if (~capped).any():
            out[~capped] = self._uncapped(ns[~capped])
        for i in np.flatnonzero(capped):
            out[i] = self._capped(int(ns[i]))
        return out + self.prefill / ns

    def _uncapped(self, ns: np.ndarray) -> np.ndarray:
        jn = self.N - ns  # segments j <= jn have >= n active sequences
        hi = np.where(jn >= 0, self._cum_hi[np.clip(jn, 0, self.N - 1)], 0.0)
        lo = np.where(jn >= 0, self.lmax - self._L[np.clip(jn, 0, self.N - 1)], self.lmax)
        return self.w * self.lmax + self.u * (hi / ns + lo)

    def _capped(self, n: int) -> float:
        """List schedule over n x cap slots in dispatch order (exact up to CAPPED_EXACT sequences; above, on an evenly
        thinned sample that keeps the longest sequence, with slots scaled alike)."""
        L = self.batch.lengths
        g = 1
        if self.N > CAPPED_EXACT:
            g = -(-self.N // CAPPED_EXACT)
            idx = np.arange(0, self.N, g)
            L = L[idx].copy()
            L[np.argmax(L)] = self.lmax
        N = len(L)
        m = max(1, round(n * self.cap / g))
        starts = np.zeros(N)
        heap = L[:m].tolist()
        heapq.heapify(heap)
        rest = L[m:].tolist()
        s_out = [0.0] * len(rest)
        for i, length in enumerate(rest):
            s = heap[0]
            heapq.heapreplace(heap, s + length)
            s_out[i] = s
        starts[m:] = s_out
        ends = starts + L
        times = np.concatenate([starts, ends])
        delta = np.concatenate([np.ones(N), -np.ones(N)])
        order = np.argsort(times, kind="stable")
        times, delta = times[order], delta[order]
        active = np.cumsum(delta)[:-1] * g
        seg = np.diff(times)
        per_iter = self.w + self.u * np.maximum(1.0, active / n)
        return float(np.sum(seg * np.where(active > 0, per_iter, 0.0)))

    def train_s(self, n: int) -> float:
        work, per_doubling, overhead = self._train
        eff = per_doubling ** math.log2(n) if n > 1 else 1.0
        return work / (n * eff) + overhead


class StageTable:
    """Stage times for (step, GPUs), computed on demand; one sweep can precompute every candidate split."""

    def __init__(self, sim: SimConfig, seed: int, steps: int, total_gpus: int):
        self.sim, self.seed, self.steps, self.total = sim, seed, steps, total_gpus
        self._phys: OrderedDict[int, StepPhysics] = OrderedDict()
        self._roll = np.full((steps, total_gpus + 1), np.nan)
        self.tail = np.full(steps, np.nan)
        self.batches: dict[int, tuple[int, int, int]] = {}  # step -> (samples, generated, trained)
        self._train_eff: dict[int, float] = {}  # step -> trained tokens weighted by attention cost

    def physics(self, k: int) -> StepPhysics:
        ph = self._phys.get(k)
        if ph is None:
            ph = StepPhysics(self.sim, make_batch(self.sim.workload, self.seed, k, self.steps))
            self._phys[k] = ph
            if len(self._phys) > 8:
                self._phys.popitem(last=False)
            self.tail[k] = ph.tail_s
            b = ph.batch
            self.batches[k] = (b.samples, b.tokens_generated, b.tokens_trained)
            self._train_eff[k] = ph.train_tokens_eff
        return ph

    def rollout_s(self, k: int, n: int) -> float:
        v = self._roll[k, n]
        if v != v:  # NaN: not computed yet
            v = self._roll[k, n] = self.physics(k).rollout_s(n)
        return float(v)

    def train_s(self, k: int, n: int) -> float:
        return self.physics(k).train_s(n) if k not in self.batches else self._train_fast(k, n)

    def _train_fast(self, k: int, n: int) -> float:
        t = self.sim.train
        eff = t.scaling_per_doubling ** math.log2(n) if n > 1 else 1.0
        return self._train_eff[k] / t.tokens_per_gpu_s / (n * eff) + t.step_overhead_s

    def tail_s(self, k: int) -> float:
        v = self.tail[k]
        return float(v) if v == v else self.physics(k).tail_s

    def sweep(self, rollout_ns: list[int]) -> None:
        """Precompute rollout times of every step for every n in ``rollout_ns`` (one batch draw per step)."""
        ns = np.array(sorted(set(rollout_ns)), dtype=np.int64)
        for k in range(self.steps):
            self._roll[k, ns] = self.physics(k).rollout_many(ns)
