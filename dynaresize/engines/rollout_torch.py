"""Rollout engine on torch/transformers (CPU or GPU): batched sampling with a KV cache, per-sample seeding.

Why not ``model.generate``: every sample must draw its randomness from its *own* generator, seeded by
``(run seed, step, prompt, index)`` (the work item's ``seed``), so that the tokens of a sample do not depend on
which rank generates it or which other samples share its batch. ``generate`` has one global RNG. This loop does
a batched forward with a KV cache and samples each row with its own ``torch.Generator``.

Sampling: ``logits / temperature``, then nucleus filtering (``top_p``; no top-k, unlike transformers 5's default
of 50), then a categorical draw. The returned logprob of a token is under that *processed* distribution (what
vLLM calls ``processed_logprobs``): at temperature 1 and top_p 1 it equals the raw policy logprob.

Caveat (documented in docs/workers.md): logits of a row can differ in the last bits with the batch shape (BLAS
blocking), so "same sample on any rank" holds exactly for the randomness and up to such rare near-ties.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # sampled tokens (the stop token included when the response ended)
    logprobs: list[float]  # logprob of each sampled token under the sampling distribution


def _cache_kw() -> str:
    import inspect

    from transformers import Qwen2ForCausalLM

    return "cache" if "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters else "past_key_values"


_CACHE_KW = _cache_kw()  # transformers 5.2x renamed past_key_values -> cache


def _cache_of(out):
    return getattr(out, "cache", None) if _CACHE_KW == "cache" else out.past_key_values


class RolloutError(RuntimeError):
    """Bad rollout input (empty prompt, prompt too long) or an engine used in the wrong state."""


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


class TorchRollout:
    """Holds a causal LM (any HF ``*ForCausalLM``) and samples from it. The module is shared, not copied, so a
    weight sync into :meth:`named_weights` tensors updates the engine in place."""

    def __init__(self, module: torch.nn.Module, eos_ids: Iterable[int], pad_id: int, device: str | torch.device = "cpu"):
        self.module = module.eval()
        self.eos = torch.tensor(sorted(set(int(e) for e in eos_ids)), dtype=torch.long)
        self.pad_id = int(pad_id)
        self.device = torch.device(device)
        self.version = 0
        self.asleep = False

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.module.named_parameters()]

    def load_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, t in items:
                params[name].copy_(t)

    def sleep(self) -> None:
        """Nothing to release for the torch engine beyond its KV caches, which live only inside ``generate``."""
        self.asleep = True

    def wake_up(self) -> None:
        self.asleep = False

    def _prefilled(self, start: float, prompts: Sequence[Sequence[int]]) -> None:
        """Called after the prompts' prefill (``start``: ``time.perf_counter()`` before it). Nothing here; the emulated
        engine (dynaresize.emulation.engine) waits out a modelled time."""

    def _decoded(self, start: float, active: int, context: float) -> None:
        """Called after each decode iteration of ``active`` sequences at mean context ``context`` tokens (``start``:
        ``time.perf_counter()`` before it). Nothing here; see :meth:`_prefilled`."""

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams) -> list[Generation]:
        """Sample one response per prompt; ``seeds[i]`` seeds sample ``i``'s generator."""
        if self.asleep:
            raise RolloutError("generate() on a sleeping rollout engine (wake_up first)")
        if len(prompts) != len(seeds):
            raise RolloutError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise RolloutError("empty prompt in the batch")
        n, plen = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, plen), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, plen), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, plen - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, plen - len(p):] = 1
        gens = [torch.Generator(device="cpu").manual_seed(int(s) & ((1 << 63) - 1)) for s in seeds]
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        t0 = time.perf_counter()
        out = self.module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        past, logits = _cache_of(out), out.logits[:, -1, :]
        self._prefilled(t0, prompts)
        plens = [len(p) for p in prompts]
        tokens: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        done = torch.zeros(n, dtype=torch.bool)
        next_pos = pos[:, -1:] + 1
        for it in range(params.max_tokens):
            t0 = time.perf_counter()
            live = [i for i in range(n) if not done[i]]
            # mean context of the token each live row decodes now (it has `it` tokens; + 0.5: the mean over the
            # modelled tokens it stands for, so a batch sums to the simulator's prompt + E[L^2] / 2E[L] per token)
            context = sum(plens[i] for i in live) / len(live) + it + 0.5
            proc = top_p_filter(logits.float() / params.temperature, params.top_p)
            logp = torch.log_softmax(proc, dim=-1).cpu()
            probs = logp.exp()
            nxt = torch.full((n,), self.pad_id, dtype=torch.long)
            for i in range(n):
                if done[i]:
                    continue
                tok = int(torch.multinomial(probs[i], 1, generator=gens[i]))
                nxt[i] = tok
                tokens[i].append(tok)
                lps[i].append(float(logp[i, tok]))
                if bool((self.eos == tok).any()):
                    done[i] = True
            if bool(done.all()):
                self._decoded(t0, len(live), context)
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long, device=self.device)], dim=1)
            out = self.module(input_ids=nxt.unsqueeze(1).to(self.device), attention_mask=mask,
                              position_ids=next_pos, use_cache=True, **{_CACHE_KW: past})
            past, logits = _cache_of(out), out.logits[:, -1, :]
            next_pos = next_pos + 1
            self._decoded(t0, len(live), context)
        return [Generation(t, l) for t, l in zip(tokens, lps)]
