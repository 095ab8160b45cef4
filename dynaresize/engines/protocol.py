"""The rollout engine protocol: what a worker rank asks of its inference engine (torch, vLLM, the emulated one).

Work arrives as a stream (continuous batching): the rank ``add``s requests as its commands arrive, calls ``step``
to run one engine iteration (a prefill of newly admitted requests and/or one decode token for every running one),
and gets back the requests that ended in that iteration. Requests wait in the engine until a slot frees; a request
keeps its own generator, seeded by its key's seed, so its tokens do not depend on which other requests share the
running batch, nor on when it was admitted.

Weight versions: an engine decodes with one set of weights. Before a rank installs a new version it either lets
the running requests finish (``drain``: ``step`` until ``running == 0``) or ``abort``s them (their samples are then
handed out again by the scheduler core and generated afresh), so every sample keeps exactly one policy version.
Fencing aborts everything.

``generate`` (a whole batch, one call) stays for callers that do not stream: it is ``add`` then ``step`` until every
one of its requests ended, in the order given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 48
    temperature: float = 1.0  # 0: greedy (the argmax; validation's val_temperature=0)
    top_p: float = 1.0
    top_k: int = -1  # the k most likely tokens only; -1: off (vLLM's and verl's convention)


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # sampled tokens (the stop token included when the response ended)
    logprobs: list[float]  # logprob of each sampled token under the sampling distribution


class RolloutError(RuntimeError):
    """Bad rollout input (empty prompt, prompt too long) or an engine used in the wrong state."""


@dataclass(frozen=True)
class Request:
    """One sample to generate: ``key`` names it (the work item's key), ``seed`` seeds its own generator."""

    key: str
    prompt_ids: tuple[int, ...]
    seed: int
    params: SamplingParams


@dataclass(frozen=True)
class Finished:
    """A request that ended (a stop token, or ``max_tokens``) in the last ``step``."""

    key: str
    generation: Generation


class RolloutEngine(Protocol):
    version: int

    def add(self, requests: Sequence[Request]) -> None: ...  # queued; admitted as slots free

    def step(self) -> list[Finished]: ...  # one iteration; the requests that ended in it

    def abort(self, keys: Iterable[str] | None = None) -> list[str]: ...  # drop these (None: all); the keys dropped

    @property
    def running(self) -> int: ...  # requests added and not yet finished or aborted (admitted or waiting)

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams) -> list[Generation]: ...

    def named_weights(self) -> list: ...

    def load_weights(self, items: Iterable) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...
