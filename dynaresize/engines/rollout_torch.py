"""Rollout engine on torch/transformers (CPU or GPU): batched sampling with a KV cache, per-sample seeding.

Why not ``model.generate``: every sample must draw its randomness from its *own* generator, seeded by
``(run seed, step, prompt, index)`` (the work item's ``seed``), so that the tokens of a sample do not depend on
which rank generates it or which other samples share its batch. ``generate`` has one global RNG. This loop does
a batched forward with a KV cache and samples each row with its own ``torch.Generator``.

Sampling (:func:`processed_logits`): ``logits / temperature``, then top-k (``top_k``; -1, the default, is off,
unlike transformers 5's default of 50), then nucleus filtering (``top_p``), vLLM's order; then a categorical draw.
Temperature 0 is greedy (only the argmax stays; its logprob is 0). The returned logprob of a token is under that
*processed* distribution (what vLLM calls ``processed_logprobs``): at temperature 1, top_k -1 and top_p 1 it equals
the raw policy logprob.

Continuous batching (the stream of :mod:`dynaresize.engines.protocol`): the engine holds ``max_running`` KV slots.
``add`` queues requests; each ``step`` admits waiting requests into free slots once an eighth of the slots are free
(one prefill of the newcomers, their caches left-padded and concatenated onto the running batch's), samples one token for every running request, drops
the finished ones (their cache rows go, and the columns every remaining row pads), and runs one decode forward of
the rest, each row at its own position. A request draws from its own ``torch.Generator`` once per token, so its
tokens are those of the one-batch loop for the same seed, whatever the other rows and whenever it was admitted.
``generate`` is ``add`` then ``step`` until its requests ended.

Caveat (documented in docs/workers.md): logits of a row can differ in the last bits with the batch shape (BLAS
blocking, the number of padded columns), so "same sample on any rank, in any batch" holds exactly for the
randomness and up to such rare near-ties (a draw within ~1e-6 of a token boundary of the cumulative
distribution); the tests compare tokens exactly on fixed seeds and logprobs to 1e-5.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from dynaresize.engines.protocol import Finished, Generation, Request, RolloutError, SamplingParams


def _cache_kw() -> str:
    import inspect

    from transformers import Qwen2ForCausalLM

    return "cache" if "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters else "past_key_values"


_CACHE_KW = _cache_kw()  # transformers 5.2x renamed past_key_values -> cache


def _cache_of(out):
    return getattr(out, "cache", None) if _CACHE_KW == "cache" else out.past_key_values


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tail outside the smallest set of tokens whose probability reaches ``top_p``."""
    if top_p >= 1.0:
        return logits
    sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, dim=-1)
    cum = probs.cumsum(-1)
    remove = (cum - probs) >= top_p  # keep a token while the mass before it is below top_p
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mask (to -inf) every token outside the ``top_k`` largest logits of each row (``top_k`` <= 0: off). Ties at the
    k-th value are kept, as vLLM's sampler keeps them."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits the draw samples from: temperature, then top-k, then top-p (temperature 0: the argmax alone)."""
    if params.temperature == 0:
        best = logits.argmax(dim=-1, keepdim=True)
        return torch.full_like(logits, float("-inf")).scatter(-1, best, 0.0)
    return top_p_filter(top_k_filter(logits / params.temperature, params.top_k), params.top_p)


ADMIT_SHARE = 8  # admit when 1/8 of the slots are free (see TorchRollout.admit_min)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(int(seed) & ((1 << 63) - 1))


@dataclass
class _Row:
    """A running request: its own generator, what it sampled, the position id of its next token."""

    req: Request
    gen: torch.Generator
    pos: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class TorchRollout:
    """Holds a causal LM (any HF ``*ForCausalLM``) and samples from it, as a stream of requests over ``max_running``
    KV slots (see the module docstring). The module is shared, not copied, so a weight sync into
    :meth:`named_weights` tensors updates the engine in place (between requests: the worker drains first)."""

    def __init__(self, module: torch.nn.Module, eos_ids: Iterable[int], pad_id: int, device: str | torch.device = "cpu",
                 max_running: int = 64):
        if max_running < 1:
            raise RolloutError(f"max_running must be >= 1 KV slot, got {max_running}")
        self.module = module.eval()
        self.eos = torch.tensor(sorted(set(int(e) for e in eos_ids)), dtype=torch.long)
        self._eos = frozenset(int(e) for e in eos_ids)
        self.pad_id = int(pad_id)
        self.device = torch.device(device)
        self.version = 0
        self.asleep = False
        self.max_running = int(max_running)
        # newcomers are admitted once this many slots are free (or the batch is empty, or all that wait fit): each
        # admission is a prefill forward of its own, so single-slot refills would double the forwards per token
        self.admit_min = max(1, self.max_running // ADMIT_SHARE)
        self._waiting: deque = deque()
        self._rows: list[_Row] = []  # running, in batch order
        self._cache = None  # the running rows' KV cache (left-padded), rows in self._rows order
        self._mask: torch.Tensor | None = None  # (rows, columns) 1 where the cache holds a real token
        self._logits: torch.Tensor | None = None  # (rows, vocab): the distribution of each row's next token
        self._keys: set[str] = set()
        self._cached_prompts: Counter = Counter()  # prompts of the running rows (a newcomer's prefix is cached)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.module.named_parameters()]

    def load_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, t in items:
                params[name].copy_(t)

    def sleep(self) -> None:
        """Release the KV caches (the torch engine holds nothing else). Requests still running are aborted: a
        worker drains or aborts before it puts the engine to sleep."""
        self.abort()
        self.asleep = True

    def wake_up(self) -> None:
        self.asleep = False

    def _prefilled(self, start: float, prompts: Sequence[Sequence[int]]) -> None:
        """Called after a prefill of newly admitted prompts (only those whose prefix no running request holds;
        ``start``: ``time.perf_counter()`` before it). Nothing here; the emulated engine
        (dynaresize.emulation.engine) waits out a modelled time."""

    def _decoded(self, start: float, active: int, context: float) -> None:
        """Called after each decode iteration of ``active`` sequences at mean context ``context`` tokens (``start``:
        ``time.perf_counter()`` before it). Nothing here; see :meth:`_prefilled`."""

    # -- the stream --------------------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._waiting) + len(self._rows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def add(self, requests: Sequence[Request]) -> None:
        for r in requests:
            if not r.prompt_ids:
                raise RolloutError(f"request {r.key!r}: empty prompt")
            if r.key in self._keys:
                raise RolloutError(f"request {r.key!r} is already in the engine")
            if r.params.max_tokens < 1:
                raise RolloutError(f"request {r.key!r}: max_tokens must be >= 1, got {r.params.max_tokens}")
        for r in requests:
            self._keys.add(r.key)
            self._waiting.append(r)

    def abort(self, keys: Iterable[str] | None = None) -> list[str]:
        drop = set(self._keys) if keys is None else set(keys) & self._keys
        if not drop:
            return []
        self._waiting = deque(r for r in self._waiting if r.key not in drop)
        keep = [i for i, row in enumerate(self._rows) if row.req.key not in drop]
        for row in self._rows:
            if row.req.key in drop:
                self._cached_prompts[row.req.prompt_ids] -= 1
        self._select(keep)
        self._keys -= drop
        return sorted(drop)

    @torch.no_grad()
    def step(self) -> list[Finished]:
        """One iteration: admit waiting requests into free slots (their prefill), sample one token of every running
        request, then one decode forward of those that did not end. Returns the requests that ended."""
        if self.asleep:
            raise RolloutError("step() on a sleeping rollout engine (wake_up first)")
        free = self.max_running - len(self._rows)
        if self._waiting and free > 0 and (free >= self.admit_min or not self._rows or len(self._waiting) <= free):
            self._admit([self._waiting.popleft() for _ in range(min(free, len(self._waiting)))])
        if not self._rows:
            return []
        t0 = time.perf_counter()
        rows = self._rows
        # mean context of the token each row decodes now (+ 0.5: the mean over the modelled tokens it stands for,
        # so a batch sums to the simulator's prompt + E[L^2] / 2E[L] per token)
        context = sum(len(r.req.prompt_ids) + len(r.tokens) for r in rows) / len(rows) + 0.5
        logp = self._logprobs(rows)
        probs = logp.exp()
        finished, keep, nxt = [], [], []
        for i, row in enumerate(rows):
            tok = int(torch.multinomial(probs[i], 1, generator=row.gen))
            row.tokens.append(tok)
            row.logprobs.append(float(logp[i, tok]))
            if tok in self._eos or len(row.tokens) >= row.req.params.max_tokens:
                finished.append(Finished(row.req.key, Generation(row.tokens, row.logprobs)))
                self._keys.discard(row.req.key)
                self._cached_prompts[row.req.prompt_ids] -= 1
            else:
                keep.append(i)
                nxt.append(tok)
        self._select(keep)
        if self._rows:
            n = len(self._rows)
            self._mask = torch.cat([self._mask, torch.ones((n, 1), dtype=torch.long, device=self.device)], dim=1)
            pos = torch.tensor([[r.pos] for r in self._rows], dtype=torch.long, device=self.device)
            out = self.module(input_ids=torch.tensor(nxt, dtype=torch.long, device=self.device).unsqueeze(1),
                              attention_mask=self._mask, position_ids=pos, use_cache=True, **{_CACHE_KW: self._cache})
            self._cache, self._logits = _cache_of(out), out.logits[:, -1, :]
            for r in self._rows:
                r.pos += 1
        self._decoded(t0, len(rows), context)
        return finished

    def _logprobs(self, rows: list[_Row]) -> torch.Tensor:
        """Log-probabilities of each row's next token under its processed distribution (temperature, top_k, top_p)."""
        logits = self._logits.float()
        kinds = {r.req.params for r in rows}
        if len(kinds) == 1:
            params, = kinds
            return torch.log_softmax(processed_logits(logits, params), dim=-1).cpu()
        out = torch.empty(logits.shape, dtype=torch.float32)
        for params in kinds:
            idx = torch.tensor([i for i, r in enumerate(rows) if r.req.params == params])
            out[idx] = torch.log_softmax(processed_logits(logits[idx.to(logits.device)], params), dim=-1).cpu()
        return out

    def _admit(self, reqs: list) -> None:
        """Prefill the newcomers (left-padded among themselves) and append them to the running batch."""
        t0 = time.perf_counter()
        n, plen = len(reqs), max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((n, plen), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, plen), dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding
            ids[i, plen - len(r.prompt_ids):] = torch.tensor(list(r.prompt_ids), dtype=torch.long)
            mask[i, plen - len(r.prompt_ids):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache, logits = _cache_of(out), out.logits[:, -1, :]
        fresh = list({r.prompt_ids: None for r in reqs if self._cached_prompts[r.prompt_ids] <= 0})
        for r in reqs:
            self._cached_prompts[r.prompt_ids] += 1
        new_rows = [_Row(r, _seeded(r.seed), len(r.prompt_ids)) for r in reqs]
        if not self._rows:
            self._cache, self._mask, self._logits, self._rows = cache, mask, logits, new_rows
        else:
            width = max(self._mask.shape[1], mask.shape[1])
            for old, new in zip(_layers(self._cache), _layers(cache)):
                old.keys = torch.cat([_left_pad(old.keys, width, 2), _left_pad(new.keys, width, 2)], dim=0)
                old.values = torch.cat([_left_pad(old.values, width, 2), _left_pad(new.values, width, 2)], dim=0)
            self._mask = torch.cat([_left_pad(self._mask, width, 1), _left_pad(mask, width, 1)], dim=0)
            self._logits = torch.cat([self._logits, logits], dim=0)
            self._rows = self._rows + new_rows
        self._prefilled(t0, fresh)

    def _select(self, keep: list[int]) -> None:
        """Keep these rows of the running batch (in order), and drop the cache columns every kept row pads."""
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._cache, self._mask, self._logits = [], None, None, None
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._rows = [self._rows[i] for i in keep]
        mask = self._mask.index_select(0, idx)
        lead = int((mask.sum(0) == 0).long().cumprod(0).sum())  # leading columns padding in every kept row
        self._mask = mask[:, lead:]
        self._logits = self._logits.index_select(0, idx)
        for layer in _layers(self._cache):
            layer.keys = layer.keys.index_select(0, idx)[:, :, lead:]
            layer.values = layer.values.index_select(0, idx)[:, :, lead:]

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams) -> list[Generation]:
        """Sample one response per prompt; ``seeds[i]`` seeds sample ``i``'s generator (``add`` then ``step`` until
        they ended; the engine must hold no other requests)."""
        if self.asleep:
            raise RolloutError("generate() on a sleeping rollout engine (wake_up first)")
        if len(prompts) != len(seeds):
            raise RolloutError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise RolloutError("empty prompt in the batch")
        if self.running:
            raise RolloutError(f"generate() while {self.running} streamed requests run (drain or abort them first)")
        keys = [f"generate:{i}" for i in range(len(prompts))]
        self.add([Request(k, tuple(int(t) for t in p), int(s), params)
                  for k, p, s in zip(keys, prompts, seeds)])
        got: dict[str, Generation] = {}
        while self.running:
            for f in self.step():
                got[f.key] = f.generation
        return [got[k] for k in keys]


def _layers(cache) -> list:
    """The per-layer key/value holders of a transformers cache, refused unless each is a full-attention dynamic layer
    (keys and values ``(batch, heads, columns, head_dim)``, grown by concatenation) that rows can be added to."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RolloutError("continuous batching needs a transformers cache with per-layer tensors; got "
                           f"{type(cache).__name__}")
    for layer in layers:
        if getattr(layer, "is_sliding", False) or not isinstance(getattr(layer, "keys", None), torch.Tensor):
            raise RolloutError("the torch rollout engine needs full-attention dynamic cache layers (rows are added to "
                               f"and dropped from the running batch); this model's cache has {type(layer).__name__}")
    return list(layers)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` zero-padded on the left of dimension ``dim`` to ``width`` (a padded column is masked out)."""
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)
